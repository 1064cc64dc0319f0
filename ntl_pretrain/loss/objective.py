"""CE + lambda * NTL from a (possibly vocabulary-sharded) logit tensor.

The heavy `[n, V]` work happens once in `parallel.shard_reductions` (one log-sum-exp serves CE and
the reweigh mass, and the number-token columns travel in the same SUM collective); the rest is
replicated `[n, K]` math in `ntl.py`. On one device pass no shard (the default); on a vocabulary-
parallel head pass this rank's `VocabShard` (`vocab_shard_of(engine)`).

Host syncs: with `check_inputs=True` (the default) each call checks what only the host can check
(the shard layout over the TP group, labels inside the vocabulary, loss weights >= 0), which reads
tensor values on the host. With `check_inputs=False` nothing reads a tensor value on the host: what
a training step should call, once the layout has been checked at start-up
(`VocabShard.check_tiling`), as the trainer does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, NumberSpans, check_ntl_weight, ntl_terms
from .parallel import ShardStats, shard_reductions
from .settings import settings_from_keywords, takes_settings_keywords
from .shard import VocabShard, as_vocab_shard

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class ObjectiveSums:
    """Sums and counts of one micro-batch, identical on every TP rank of a group.

    A trainer normalises them globally (see `normalize.py`); `ce_ntl_loss` normalises locally.
    """

    ce_sum: torch.Tensor  # differentiable scalar (max(float32, logits' dtype)): CE summed over non-ignored tokens
    ntl_sum: torch.Tensor  # differentiable scalar (same dtype): weighted NTL summed over NTL terms
    token_count: torch.Tensor  # non-ignored tokens
    ntl_count: torch.Tensor  # the NTL normaliser: summed loss weights of the NTL terms
    number_tokens: torch.Tensor  # label positions that hold a number token
    abs_error_sum: torch.Tensor  # detached: sum over those of |expected number - true value|

    def stack(self) -> torch.Tensor:
        """The six values, detached, as one `[6]` vector in field order (to add up over micro-batches and
        all-reduce in one collective); `unstack` reads it back."""
        return torch.stack([getattr(self, field.name).detach() for field in fields(self)])

    @classmethod
    def unstack(cls, packed: torch.Tensor) -> "ObjectiveSums":
        """The sums of a `[6]` vector in `stack`'s order; `ce_sum` and `ntl_sum` keep its gradient, the counts
        are detached."""
        ce_sum, ntl_sum, *counts = packed.unbind()
        return cls(ce_sum, ntl_sum, *(count.detach() for count in counts))


SUMS_WIDTH = len(fields(ObjectiveSums))  # entries of ObjectiveSums.stack()


def check_loss_inputs(labels: torch.Tensor, number_vocab: NumberVocab, loss_weights: torch.Tensor | None,
                      check_values: bool = True) -> None:
    """What every entry point checks before any device work: the number vocabulary, integer labels and NTL
    loss weights of the labels' shape (`check_values`: a host sync, also non-negative and finite)."""
    if not isinstance(number_vocab, NumberVocab):
        raise TypeError(f"number_vocab must be a NumberVocab (NumberVocab.from_tokenizer), got {type(number_vocab)}")
    if labels.dtype not in (torch.long, torch.int, torch.int32, torch.int16) or labels.numel() == 0:
        raise TypeError(f"labels must be a non-empty integer tensor, got {labels.dtype} with shape "
                        f"{tuple(labels.shape)}")
    if loss_weights is None:
        return
    if loss_weights.shape != labels.shape:
        raise ValueError(f"loss_weights shape {tuple(loss_weights.shape)} must equal the labels' shape "
                         f"{tuple(labels.shape)}")
    if check_values and bool(((loss_weights < 0) | ~torch.isfinite(loss_weights)).any()):  # one sync for both
        bad = loss_weights[(loss_weights < 0) | ~torch.isfinite(loss_weights)][0].item()
        raise ValueError(f"loss_weights must be >= 0 and finite, got {bad} (a nan or inf weight makes the loss nan)")


def check_on_host(shard: VocabShard, local_width: int, labels: torch.Tensor, number_vocab: NumberVocab,
                  ignore_index: int, device: torch.device) -> int:
    """The checks that read values on the host (`check_inputs=True`); returns the vocabulary size V.

    The shards of the TP group tile `[0, V)` (one small all-reduce), V covers the number vocabulary, and
    every label is `ignore_index` or a token id below V.
    """
    vocab_size = shard.check_tiling(device, local_width)
    check_vocabulary_covers_numbers(vocab_size, number_vocab)
    flat = labels.reshape(-1)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"label {int(flat[bad][0])} is outside the vocabulary [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index}")
    return vocab_size


def check_vocabulary_covers_numbers(vocab_size: int, number_vocab: NumberVocab) -> None:
    """The logits (or the head) span at least the number vocabulary's `vocab_size` columns."""
    if vocab_size < number_vocab.vocab_size:
        raise ValueError(f"the logits span {vocab_size} vocabulary columns over the TP group, fewer than the "
                         f"number vocabulary's vocab_size={number_vocab.vocab_size}: the model's vocabulary is "
                         f"smaller than the tokenizer's; resize its embeddings")


def _logit_stats(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, shard: VocabShard,
                 loss_weights: torch.Tensor | None, need_lse: bool, need_target: bool, ignore_index: int,
                 check_inputs: bool) -> ShardStats:
    """Checked inputs reduced over the vocabulary (`parallel.shard_reductions`)."""
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 2 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty [..., V] tensor, got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match the logits' leading dims "
                         f"{tuple(logits.shape[:-1])}; labels must be aligned with the logits (already shifted)")
    check_loss_inputs(labels, number_vocab, loss_weights, check_values=check_inputs)
    if not shard.is_split and logits.shape[-1] < number_vocab.vocab_size:
        raise ValueError(
            f"the logits have {logits.shape[-1]} columns but the number vocabulary was built for "
            f"vocab_size={number_vocab.vocab_size}: the model's vocabulary is smaller than the tokenizer's. "
            f"Resize the model's embeddings (tools/tokenizer.py resize-model), or pass this rank's VocabShard "
            f"if these are one shard of vocabulary-parallel logits.")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    shard.check_width(flat_logits.shape[1], "the logits")
    if check_inputs:
        check_on_host(shard, flat_logits.shape[1], flat_labels, number_vocab, ignore_index, logits.device)
    return shard_reductions(flat_logits, number_vocab, targets=flat_labels if need_target else None,
                            need_lse=need_lse, shard=shard, ignore_index=ignore_index, check=False)


def ce_ntl_sums(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
                settings: NTLSettings = NTLSettings(), *, shard: VocabShard = VocabShard(),
                loss_weights: torch.Tensor | None = None, with_ntl: bool = True,
                check_inputs: bool = True, spans: NumberSpans | None = None) -> ObjectiveSums:
    """CE and NTL sums (and counts) of one micro-batch.

    Args:
        logits: `[..., V_local]` logits, or this rank's vocabulary shard of them; any float dtype (the
            maths runs in max(float32, their dtype)). Never modified.
        labels: `[...]` target ids aligned with the logits (already shifted); `settings.ignore_index`
            marks positions without a target. Identical on every rank of the shard's TP group.
        number_vocab: the number tokens (`NumberVocab.from_tokenizer`).
        settings: the NTL variant and its options.
        shard: where this rank's logits sit in the vocabulary (`vocab_shard_of(engine)`); the default is
            the full vocabulary on one device.
        loss_weights: `[...]` non-negative weights of the NTL terms (CE is unweighted).
        with_ntl: False computes CE only (the NTL sum is then zero); the number-token figures for
            monitoring are computed either way.
        check_inputs: run the checks that read values on the host (shard layout over the TP group,
            labels inside the vocabulary, loss weights >= 0). False: no host sync at all; check the
            layout once with `VocabShard.check_tiling` instead.
        spans: "number_level" only: where the numbers sit when `labels` are one sequence shard of longer rows
            (`sequence_shard.shard_number_spans`); default: found in `labels`.
    """
    stats = _logit_stats(logits, labels, number_vocab, as_vocab_shard(shard), loss_weights, need_lse=True, need_target=True,
                         ignore_index=settings.ignore_index, check_inputs=check_inputs)
    return sums_from_stats(stats, labels, number_vocab, settings, loss_weights=loss_weights, with_ntl=with_ntl,
                           spans=spans)


def sums_from_stats(stats: ShardStats, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings, *,
                    loss_weights: torch.Tensor | None = None, with_ntl: bool = True,
                    spans: NumberSpans | None = None) -> ObjectiveSums:
    """CE and NTL sums from the reduced statistics of the logits (`shard_reductions`, or the chunked
    head's per-chunk reductions), differentiable through them (`spans`: as in `ce_ntl_sums`)."""
    flat_labels = labels.reshape(-1).long()
    valid = (flat_labels != settings.ignore_index).to(stats.number_logits.dtype)
    ce_sum = ((stats.lse - stats.target_logit) * valid).sum()

    with torch.no_grad():  # every row, masked: no data-dependent shapes, no host sync
        slot = number_vocab.index_of(flat_labels, settings.ignore_index)
        is_number = slot >= 0
        values = number_vocab.values_tensor(flat_labels.device, stats.number_logits.dtype)
        expected = torch.softmax(stats.number_logits, dim=-1) @ values
        abs_error_sum = torch.where(is_number, (expected - values[slot.clamp_min(0)]).abs(), 0.0).sum()
        number_tokens = is_number.sum().to(values.dtype)

    if with_ntl:
        terms = ntl_terms(stats.number_logits, labels, number_vocab, settings,
                          number_mass=stats.number_mass, loss_weights=loss_weights,
                          spans=spans)
        ntl_sum = (terms.loss * terms.weights).sum()
        ntl_count = terms.weights.sum().detach()
    else:
        ntl_sum = ce_sum.new_zeros(())
        ntl_count = ce_sum.new_zeros(())
    return ObjectiveSums(ce_sum=ce_sum, ntl_sum=ntl_sum, token_count=valid.sum(), ntl_count=ntl_count,
                         number_tokens=number_tokens, abs_error_sum=abs_error_sum)


def safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """`total / count`, 0 (not NaN) where nothing was counted; no host sync."""
    return total / count.clamp_min(torch.finfo(torch.float32).eps)


def ce_ntl_loss(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, *, ntl_weight: float = 0.3,
                settings: NTLSettings = NTLSettings(), shard: VocabShard = VocabShard(),
                loss_weights: torch.Tensor | None = None, check_inputs: bool = True) -> torch.Tensor:
    """`mean CE + ntl_weight * mean NTL` over this batch (for global normalisation across micro-batches
    and data-parallel ranks use `ce_ntl_sums` with `normalize.py`)."""
    ntl_weight = check_ntl_weight(ntl_weight)
    sums = ce_ntl_sums(logits, labels, number_vocab, settings, shard=shard, loss_weights=loss_weights,
                       with_ntl=ntl_weight != 0, check_inputs=check_inputs)
    return safe_mean(sums.ce_sum, sums.token_count) + ntl_weight * safe_mean(sums.ntl_sum, sums.ntl_count)


@takes_settings_keywords
def number_token_loss(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, *,
                      loss_weights: torch.Tensor | None = None, reduction: str = "mean",
                      shard: VocabShard = VocabShard(), check_inputs: bool = True, **options: Any) -> torch.Tensor:
    """The Number Token Loss alone.

    Args:
        logits: `[..., V]` logits (or this rank's vocabulary shard, with `shard`), any float dtype;
            computed in max(float32, their dtype).
        labels: `[...]` target ids aligned with the logits; `ignore_index` positions are skipped.
        number_vocab: `NumberVocab.from_tokenizer(tokenizer)`.
        loss_weights: `[...]` non-negative per-token weights.
        reduction: "mean" (weighted mean over the NTL terms), "sum", or "none" (labels' shape, zero
            where there is no term; a number's term sits on its first digit for "number_level").
        shard: where this rank's logits sit in the vocabulary (default: all of it, one device).
        check_inputs: check the shard layout (on every path, reweigh or not), labels and loss weights,
            reading values on the host; False for a hot loop whose layout was checked once
            (`VocabShard.check_tiling`).
        **options: the `NTLSettings` fields, each a keyword (default and meaning):

    Returns a scalar, or a tensor of the labels' shape for reduction "none", in max(float32, the logits' dtype).
    """
    return ntl_with_settings(logits, labels, number_vocab, settings_from_keywords("number_token_loss", options),
                             shard=shard, loss_weights=loss_weights, reduction=reduction, check_inputs=check_inputs)


def ntl_with_settings(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings,
                      *, shard: VocabShard = VocabShard(), loss_weights: torch.Tensor | None = None,
                      reduction: str = "mean", ignore_index: int | None = None,
                      check_inputs: bool = True) -> torch.Tensor:
    """`number_token_loss` with its options as an `NTLSettings` (`ignore_index`, when given, replaces the
    settings' own)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    shard = as_vocab_shard(shard)
    if ignore_index is not None and ignore_index != settings.ignore_index:
        settings = replace(settings, ignore_index=ignore_index)
    stats = _logit_stats(logits, labels, number_vocab, shard, loss_weights,
                         need_lse=settings.reweigh or settings.ntl_variant.reads_number_mass,
                         need_target=False, ignore_index=settings.ignore_index, check_inputs=check_inputs)
    terms = ntl_terms(stats.number_logits, labels, number_vocab, settings,
                      number_mass=stats.number_mass if stats.sum_exp is not None else None, loss_weights=loss_weights)
    weighted = terms.loss * terms.weights
    if reduction == "sum":
        return weighted.sum()
    if reduction == "mean":
        return safe_mean(weighted.sum(), terms.weights.sum())
    return weighted.view(labels.shape)  # zero where no term sits
