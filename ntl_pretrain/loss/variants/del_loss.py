"""`del`: the Digit Entropy Loss as its authors define it (Zheng et al., arXiv 2605.20369, and their training code,
github PolyU-VCLab/DEL: `train-qwen-deepseek.py`, `train-codellama-mistral.py`). docs/loss.md has the definition,
where it differs from the project's own `digit_entropy`, and the authors' choices this follows.

At every label that is a digit (a digit-level vocabulary: the ten tokens "0".."9"), with `z` the ten digit logits
and `q = softmax(z)` over them (not detached), the term is

    (c / 10) * w * sum_k q_k * BCEWithLogits(z_k, [k = digit]),

an independent sigmoid per digit logit, weighted by that digit's softmax probability; `w` the digit's place weight
in its run (`run_spans`): `2 (p + 1)` for a digit of power of ten `p >= 0`, `1.02 ** (p - 1)` for the decimal of
power `p < 0` (the k-th digit after the '.': `1.02 ** -(k + 1)`). The mean of the terms over the digit labels is `c`
times the mean over the `N x 10` (digit, class) entries, the authors' normalisation; the authors add it to CE with
weight 1 (so `ntl_weight=1` is their objective). The place weights come from the labels only, so a sequence shard
gets them from the whole micro-batch's labels (`spans`, as `number_level` does) and vocabulary-sharded logits need
nothing but the replicated digit logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ...core.numbers import NumberVocab
from ...core.options import check_choice, check_number, option
from ..spans import NumberSpans
from .base import NTLVariant, TermInputs, register

DEL_RUNS = ("batch", "rows")  # how runs of number labels are read: the authors' flattened batch, or per row
INTEGER_PLACE_FACTOR = 2.0  # an integer digit of power p weighs 2 (p + 1)
DECIMAL_BASE = 1.02  # a decimal digit of power p < 0 weighs 1.02 ** (p - 1)


def run_spans(slot: torch.Tensor, labels: torch.Tensor, decimal_point_id: int, ignore_index: int,
              runs: str) -> NumberSpans:
    """The runs of number labels (digits and '.') of `labels` and each digit's power of ten in its run.

    `runs="batch"` (the authors'): a run is a maximal stretch of digit or '.' labels among the non-ignored labels
    of the whole flattened batch, taken in order: ignored labels are skipped, and a row's last labels join the next
    row's first ones. `runs="rows"`: a maximal stretch within one row; an ignored label ends it. A run's decimal
    point is its first '.' unless that is the run's first label (then the run has none, as in the authors' code);
    a digit `j` places after the run's start has power `D - 1 - j` before the point (`D` its index, or the run's
    length without one) and `D - j` after it. `place` holds the power (negative for decimals); `is_start` the
    runs' first labels, `segment` the run of each label (-1 outside runs). No host sync, no data-dependent shape.
    """
    flat = labels.reshape(-1)
    n, device = flat.numel(), flat.device
    positions = torch.arange(n, device=device)
    is_dot = flat == decimal_point_id
    member = (slot >= 0) | is_dot
    if runs == "batch":
        valid = flat != ignore_index
        packed_at = torch.where(valid, valid.long().cumsum(0) - 1, n)  # index among the valid labels; n: dropped

        def packed(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(n + 1).scatter_(0, packed_at, values)[:n]

        seq_member, seq_dot, row_start = packed(member), packed(is_dot), torch.zeros(n, dtype=torch.bool, device=device)
    else:
        packed_at = positions
        seq_member, seq_dot = member, is_dot
        row_start = positions % (labels.shape[-1] if labels.dim() > 0 else 1) == 0
    previous = F.pad(seq_member[:-1], (1, 0))
    start = seq_member & (~previous | row_start)
    run = torch.where(seq_member, start.long().cumsum(0) - 1, -1)
    table_at = run + 1  # tables per run: slot 0 collects the labels outside runs
    length = torch.zeros(n + 1, dtype=torch.long, device=device).index_add_(0, table_at, seq_member.long())
    first = torch.zeros(n + 1, dtype=torch.long, device=device).scatter_(
        0, torch.where(start, table_at, 0), torch.where(start, positions, 0))
    offset = positions - first[table_at]  # place of the label inside its run
    first_dot = torch.full((n + 1,), n, dtype=torch.long, device=device).scatter_reduce_(
        0, table_at, torch.where(seq_dot, offset, n), reduce="amin")[table_at]
    point = torch.where((first_dot > 0) & (first_dot < n), first_dot, length[table_at])
    place = torch.where(offset < point, point - 1 - offset, point - offset)
    place = torch.where(seq_member, place, 0)
    kept = packed_at < n  # the labels that take part (batch: the non-ignored ones)
    at = packed_at.clamp_max(n - 1)
    return NumberSpans(is_start=kept & start[at], segment=torch.where(kept, run[at], -1),
                       place=torch.where(kept & (slot >= 0), place[at], 0), n_segments=n)


def place_weight(place: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The authors' weight of a digit of power of ten `place`: `2 (p + 1)` for integers, `1.02 ** (p - 1)` for
    decimals."""
    place = place.to(dtype)
    return torch.where(place >= 0, INTEGER_PLACE_FACTOR * (place + 1), torch.pow(DECIMAL_BASE, place - 1))


@dataclass(frozen=True)
class Options:
    """The options of "del"."""

    del_scale: float = option("c, the DEL term's factor (the authors': 0.01 Qwen/DeepSeek, 0.1 CodeLlama/Mistral, "
                              "with ntl_weight=1)", default=0.01)
    del_runs: Literal[DEL_RUNS] = option("batch (runs of digits and '.' over the flattened micro-batch, the "
                                         "authors') | rows (within a row, broken by ignored labels: packed rows)",
                                         default="batch")

    def __post_init__(self) -> None:
        check_number(self.del_scale, "del_scale", "0 would turn the term off; set ntl_weight=0 for that", low=0.0,
                     low_allowed=False)
        check_choice(self.del_runs, "del_runs", DEL_RUNS, "how runs of number labels are read")


class DigitEntropyLoss(NTLVariant):
    name = "del"
    Options = Options
    single_digits_because = "scores each digit position over the ten single-digit tokens"
    needs_spans = True  # the place weights come from the whole batch's runs

    def check(self, settings) -> None:
        if settings.reweigh:
            raise ValueError("reweigh does not apply to variant 'del' (the authors' loss has no number-mass "
                             "penalty, and binary cross-entropy has no largest value for it); set reweigh=False")

    def check_vocab(self, number_vocab: NumberVocab, settings) -> None:
        super().check_vocab(number_vocab, settings)
        if number_vocab.decimal_point_id is None:
            raise ValueError("variant 'del' reads decimals after a '.' and needs the '.' token id: the tokenizer has "
                             "no '.' token (NumberVocab.decimal_point_id is None)")

    def spans(self, slot, labels, number_vocab, settings) -> NumberSpans:
        return run_spans(slot, labels, number_vocab.decimal_point_id, settings.ignore_index, settings.del_runs)

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        digits = inputs.slot >= 0
        logits = torch.where(digits[:, None], inputs.number_logits, 0.0)
        # the one-hot target by comparison: F.one_hot reads its input's range on the host
        target = (inputs.slot[:, None] == torch.arange(logits.shape[-1], device=logits.device)).to(logits.dtype)
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        entropy = (torch.softmax(logits, dim=-1) * bce).sum(-1)
        weight = place_weight(inputs.number_spans().place, logits.dtype)
        # the mean over the digit labels of (c / K) * sum_k is c times the mean over the N x K entries
        return (inputs.settings.del_scale / logits.shape[-1]) * weight * entropy, digits


register(DigitEntropyLoss())
