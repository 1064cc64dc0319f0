"""CE + lambda * NTL from a (possibly vocabulary-sharded) logit tensor.

The heavy `[n, V]` work happens once in `parallel.shard_reductions` (one log-sum-exp serves CE and
the reweigh mass, and the number-token columns travel in the same SUM collective); the rest is
replicated `[n, K]` math in `ntl.py`. On one device pass `tp_group=None` (the default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..numbers import NumberVocab
from .ntl import NTLSettings, ntl_terms
from .parallel import ShardStats, group_size, shard_reductions

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class ObjectiveSums:
    """Sums and counts of one micro-batch, identical on every TP rank of a group.

    A trainer normalises them globally (see `normalize.py`); `ce_ntl_loss` normalises locally.
    """

    ce_sum: torch.Tensor  # differentiable float32 scalar: CE summed over non-ignored tokens
    ntl_sum: torch.Tensor  # differentiable float32 scalar: weighted NTL summed over NTL terms
    token_count: torch.Tensor  # non-ignored tokens
    ntl_count: torch.Tensor  # the NTL normaliser: summed loss weights of the NTL terms
    number_tokens: torch.Tensor  # label positions that hold a number token
    abs_error_sum: torch.Tensor  # detached: sum over those of |expected number - true value|


def validate_loss_weights(labels: torch.Tensor, loss_weights: torch.Tensor | None) -> None:
    """NTL loss weights must match the labels' shape and be non-negative."""
    if loss_weights is None:
        return
    if loss_weights.shape != labels.shape:
        raise ValueError(f"loss_weights shape {tuple(loss_weights.shape)} must equal the labels' shape "
                         f"{tuple(labels.shape)}")
    if bool((loss_weights < 0).any()):
        raise ValueError("loss_weights must be >= 0")


def _validate(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, tp_group,
              vocab_start_index: int, loss_weights: torch.Tensor | None) -> None:
    if not isinstance(number_vocab, NumberVocab):
        raise TypeError(f"number_vocab must be a NumberVocab (NumberVocab.from_tokenizer), got {type(number_vocab)}")
    if not torch.is_floating_point(logits):
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.dim() < 2 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty [..., V] tensor, got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match the logits' leading dims "
                         f"{tuple(logits.shape[:-1])}; labels must be aligned with the logits (already shifted)")
    if labels.dtype not in (torch.long, torch.int, torch.int32, torch.int16):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    validate_loss_weights(labels, loss_weights)
    if group_size(tp_group) == 1:
        if vocab_start_index != 0:
            raise ValueError(f"vocab_start_index={vocab_start_index} without a tensor-parallel group; pass the "
                             f"tp_group that shards the vocabulary, or 0 for full logits")
        if logits.shape[-1] < number_vocab.vocab_size:
            raise ValueError(
                f"the logits have {logits.shape[-1]} columns but the number vocabulary was built for "
                f"vocab_size={number_vocab.vocab_size}: the model's vocabulary is smaller than the tokenizer's. "
                f"Resize the model's embeddings (tools/tokenizer.py resize-model), or pass tp_group and "
                f"vocab_start_index if these are one shard of vocabulary-parallel logits.")
    elif vocab_start_index < 0:
        raise ValueError(f"vocab_start_index must be >= 0, got {vocab_start_index}")


def _reduce_stats(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, need_lse: bool,
                  need_target: bool, tp_group, vocab_start_index: int, ignore_index: int) -> ShardStats:
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    stats = shard_reductions(flat_logits, number_vocab, targets=flat_labels if need_target else None,
                             need_lse=need_lse, tp_group=tp_group, vocab_start_index=vocab_start_index,
                             ignore_index=ignore_index)
    if stats.vocab_size < number_vocab.vocab_size:
        raise ValueError(f"the logits span {stats.vocab_size} vocabulary columns over the TP group, fewer than the "
                         f"number vocabulary's vocab_size={number_vocab.vocab_size}: the model's vocabulary is "
                         f"smaller than the tokenizer's; resize its embeddings")
    if need_target:
        bad = (flat_labels != ignore_index) & ((flat_labels < 0) | (flat_labels >= stats.vocab_size))
        if bool(bad.any()):
            raise ValueError(f"label {int(flat_labels[bad][0])} is outside the vocabulary [0, {stats.vocab_size}) "
                             f"and is not ignore_index={ignore_index}")
    return stats


def ce_ntl_sums(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
                settings: NTLSettings = NTLSettings(), *, tp_group: dist.ProcessGroup | None = None,
                vocab_start_index: int = 0, loss_weights: torch.Tensor | None = None,
                with_ntl: bool = True) -> ObjectiveSums:
    """CE and NTL sums (and counts) of one micro-batch.

    Args:
        logits: `[..., V_local]` logits, or this rank's vocabulary shard of them; any float dtype (the
            maths runs in float32). Never modified.
        labels: `[...]` target ids aligned with the logits (already shifted); `settings.ignore_index`
            marks positions without a target. Identical on every rank of `tp_group`.
        number_vocab: the number tokens (`NumberVocab.from_tokenizer`).
        settings: the NTL variant and its options.
        tp_group: the group over which the vocabulary is split; None for full logits.
        vocab_start_index: first global vocabulary id of this rank's shard.
        loss_weights: `[...]` non-negative weights of the NTL terms (CE is unweighted).
        with_ntl: False computes CE only (the NTL sum is then zero); the number-token figures for
            monitoring are computed either way.
    """
    _validate(logits, labels, number_vocab, tp_group, vocab_start_index, loss_weights)
    stats = _reduce_stats(logits, labels, number_vocab, need_lse=True, need_target=True, tp_group=tp_group,
                          vocab_start_index=vocab_start_index, ignore_index=settings.ignore_index)
    return sums_from_stats(stats, labels, number_vocab, settings, loss_weights=loss_weights, with_ntl=with_ntl)


def sums_from_stats(stats: ShardStats, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings, *,
                    loss_weights: torch.Tensor | None = None, with_ntl: bool = True) -> ObjectiveSums:
    """CE and NTL sums from the reduced statistics of the logits (`shard_reductions`, or the chunked
    head's per-chunk reductions), differentiable through them."""
    flat_labels = labels.reshape(-1).long()
    valid = (flat_labels != settings.ignore_index).to(stats.number_logits.dtype)
    ce_sum = ((stats.lse - stats.target_logit) * valid).sum()

    with torch.no_grad():
        slot = number_vocab.index_of(flat_labels, settings.ignore_index)
        rows = torch.nonzero(slot >= 0).flatten()
        values = number_vocab.values_tensor(flat_labels.device, stats.number_logits.dtype)
        expected = torch.softmax(stats.number_logits[rows], dim=-1) @ values
        abs_error_sum = (expected - values[slot[rows]]).abs().sum()
        number_tokens = torch.tensor(float(rows.numel()), device=flat_labels.device, dtype=values.dtype)

    if with_ntl:
        terms = ntl_terms(stats.number_logits, labels, number_vocab, settings,
                          number_mass=stats.number_mass if settings.reweigh else None, loss_weights=loss_weights)
        ntl_sum = (terms.loss * terms.weights).sum()
        ntl_count = terms.weights.sum().detach()
    else:
        ntl_sum = ce_sum.new_zeros(())
        ntl_count = ce_sum.new_zeros(())
    return ObjectiveSums(ce_sum=ce_sum, ntl_sum=ntl_sum, token_count=valid.sum(), ntl_count=ntl_count,
                         number_tokens=number_tokens, abs_error_sum=abs_error_sum)


def _safe_mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return total / count.clamp_min(torch.finfo(torch.float32).eps)


def ce_ntl_loss(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, *, ntl_weight: float = 0.3,
                settings: NTLSettings = NTLSettings(), tp_group: dist.ProcessGroup | None = None,
                vocab_start_index: int = 0, loss_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`mean CE + ntl_weight * mean NTL` over this batch (for global normalisation across micro-batches
    and data-parallel ranks use `ce_ntl_sums` with `normalize.py`)."""
    sums = ce_ntl_sums(logits, labels, number_vocab, settings, tp_group=tp_group,
                       vocab_start_index=vocab_start_index, loss_weights=loss_weights, with_ntl=ntl_weight != 0)
    return _safe_mean(sums.ce_sum, sums.token_count) + ntl_weight * _safe_mean(sums.ntl_sum, sums.ntl_count)


def number_token_loss(logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab, *,
                      variant: str = "was", reweigh: bool = False, squash_factor: float | None = None,
                      loss_weights: torch.Tensor | None = None, reduction: str = "mean", ignore_index: int = -100,
                      smoothing_sigma: float = 0.0, float_level: bool = False, max_number_digits: int = 20,
                      tp_group: dist.ProcessGroup | None = None, vocab_start_index: int = 0) -> torch.Tensor:
    """The Number Token Loss alone.

    Args:
        logits: `[..., V]` logits (or this rank's vocabulary shard, with `tp_group` and
            `vocab_start_index`), any float dtype; computed in float32.
        labels: `[...]` target ids aligned with the logits; `ignore_index` positions are skipped.
        number_vocab: `NumberVocab.from_tokenizer(tokenizer)`.
        variant: "was", "mse", "mae", "huber" or "number_level".
        reweigh: scale each term by the probability mass on number tokens over the full vocabulary.
        squash_factor: "was" only; how many times the farthest wrong number costs the nearest one.
        loss_weights: `[...]` non-negative per-token weights.
        reduction: "mean" (weighted mean over the NTL terms), "sum", or "none" (labels' shape, zero
            where there is no term; a number's term sits on its first digit for "number_level").
        smoothing_sigma: "was" only; Gaussian label smoothing over number values (Wasserstein-1 form).
        float_level: "number_level" only; "1.5" is one number (15) instead of two.
        max_number_digits: "number_level" only; longest number with distinct place values.
        tp_group, vocab_start_index: the vocabulary-parallel layout of `logits` (default: one device).

    Returns a float32 scalar, or a float32 tensor of the labels' shape for reduction "none".
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    settings = NTLSettings(variant=variant, reweigh=reweigh, squash_factor=squash_factor,
                           smoothing_sigma=smoothing_sigma, float_level=float_level, ignore_index=ignore_index,
                           max_number_digits=max_number_digits)
    _validate(logits, labels, number_vocab, tp_group, vocab_start_index, loss_weights)
    stats = _reduce_stats(logits, labels, number_vocab, need_lse=reweigh, need_target=False, tp_group=tp_group,
                          vocab_start_index=vocab_start_index, ignore_index=ignore_index)
    terms = ntl_terms(stats.number_logits, labels, number_vocab, settings,
                      number_mass=stats.number_mass if reweigh else None, loss_weights=loss_weights)
    weighted = terms.loss * terms.weights
    if reduction == "sum":
        return weighted.sum()
    if reduction == "mean":
        return _safe_mean(weighted.sum(), terms.weights.sum())
    per_position = weighted.new_zeros(terms.positions.shape).masked_scatter(terms.positions, weighted)
    return per_position.view(labels.shape)
