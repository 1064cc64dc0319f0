"""The NTL variants, on the number-token logits only (DESIGN.md section 1).

Everything here works on `[n, K]` number-token logits and `[n]` labels, which are identical on every
tensor-parallel rank once `parallel.shard_reductions` has run: this is small replicated math that
plain autograd differentiates. The full-vocabulary part (log-sum-exp for reweighing) arrives as an
input, so the same code serves one device and a vocabulary-sharded head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..core.numbers import NumberVocab

VARIANTS = ("was", "mse", "mae", "huber", "number_level")
TOKEN_LEVEL_VARIANTS = ("was", "mse", "mae", "huber")
REWEIGH_MARGIN = 1.01  # a wrong non-number token costs a bit more than the worst number token


@dataclass(frozen=True)
class NTLSettings:
    """Settings of the NTL term."""

    variant: str = "was"  # "was" (Wasserstein, the paper's default), "mse", "mae", "huber", "number_level"
    reweigh: bool = False  # scale by the probability mass on number tokens (over the full vocabulary)
    squash_factor: float | None = None  # "was": farthest wrong number costs this many times the nearest
    smoothing_sigma: float = 0.0  # "was": Gaussian label smoothing of the target over number values
    float_level: bool = False  # "number_level": a "." between digits joins them into one number
    max_number_digits: int = 20  # "number_level": digits beyond this many share the highest place value
    ignore_index: int = -100  # label that marks positions without a target

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown NTL variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.squash_factor is not None:
            if self.variant != "was":
                raise ValueError(f"squash_factor applies to variant 'was' only, not {self.variant!r}")
            if not self.squash_factor > 1:
                raise ValueError(f"squash_factor must be > 1 (1 would turn NTL into CE), got {self.squash_factor}")
        if self.smoothing_sigma < 0:
            raise ValueError(f"smoothing_sigma must be >= 0, got {self.smoothing_sigma}")
        if self.smoothing_sigma > 0 and (self.variant != "was" or self.squash_factor is not None):
            raise ValueError("smoothing_sigma needs variant 'was' without squash_factor (the Wasserstein-1 "
                             "form on sorted values has no squashed distance)")
        if self.max_number_digits < 1:
            raise ValueError(f"max_number_digits must be >= 1, got {self.max_number_digits}")
        if self.float_level and self.variant != "number_level":
            raise ValueError(f"float_level applies to variant 'number_level' only, not {self.variant!r}")

    def describe(self) -> str:
        """The effective settings in one line (those of other variants left out), e.g. for a start-up log:
        reweigh is always named, since ntloss's classes default to True and everything here to False."""
        parts = [f"variant={self.variant}", f"reweigh={self.reweigh}"]
        if self.variant == "was":
            parts += [f"squash_factor={self.squash_factor}", f"smoothing_sigma={self.smoothing_sigma:g}"]
        if self.variant == "number_level":
            parts += [f"float_level={self.float_level}", f"max_number_digits={self.max_number_digits}"]
        return ", ".join(parts)


def distance_table(number_vocab: NumberVocab, squash_factor: float | None, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`D[i, k] = |v_i - v_k|`, optionally squashed so the largest distance is `squash_factor` times the
    smallest non-zero one (zero stays zero). Built once per vocabulary, device and dtype (the range is
    found on the host from the vocabulary's values: no device sync)."""
    def build() -> torch.Tensor:
        values = number_vocab.values_tensor(device, dtype)
        diff = (values[:, None] - values[None, :]).abs()
        if squash_factor is None:
            return diff
        distances = [abs(a - b) for a in number_vocab.values for b in number_vocab.values if a != b]
        if not distances:
            raise ValueError("squash_factor needs at least two distinct number values")
        low, high = min(distances), max(distances)
        scaled = 1 + (diff - low) * ((squash_factor - 1) / (high - low) if high > low else 0.0)
        return torch.where(diff == 0, torch.zeros_like(diff), scaled)

    return number_vocab._cached(("distance_table", squash_factor, torch.device(device), dtype), build)


def max_distance(number_vocab: NumberVocab, settings: NTLSettings, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The largest per-token NTL a number prediction can cost (the reweigh penalty's base)."""
    if settings.variant == "number_level":
        return torch.tensor(1.0, device=device, dtype=dtype)  # symmetric MAPE is bounded by 1
    if settings.variant == "was":
        return distance_table(number_vocab, settings.squash_factor, device, dtype).max()
    values = number_vocab.values_tensor(device, dtype)
    span = (values.max() - values.min())[None]
    return _lp(span, torch.zeros_like(span), settings.variant)[0]


def _lp(prediction: torch.Tensor, target: torch.Tensor, variant: str) -> torch.Tensor:
    if variant == "mse":
        return F.mse_loss(prediction, target, reduction="none")
    if variant == "mae":
        return F.l1_loss(prediction, target, reduction="none")
    return F.huber_loss(prediction, target, reduction="none", delta=1.0)


def _wasserstein_smoothed(probs: torch.Tensor, target_values: torch.Tensor, values: torch.Tensor,
                          sigma: float) -> torch.Tensor:
    """1-D Wasserstein-1 distance between `probs` and a Gaussian-smoothed target, on sorted values."""
    order = torch.argsort(values)
    sorted_values = values[order]
    target = torch.softmax(-((sorted_values[None, :] - target_values[:, None]) ** 2) / (2 * sigma**2), dim=-1)
    cdf_gap = (probs[:, order].cumsum(-1) - target.cumsum(-1)).abs()[:, :-1]
    return (cdf_gap * sorted_values.diff()[None, :]).sum(-1)


@dataclass
class NTLTerms:
    """NTL per term (one per number token, or per number for "number_level"), each at its flat position.

    Shapes are those of the labels, whatever the data (no data-dependent sizes, so no host sync): a
    position without a term holds loss 0 and weight 0.
    """

    loss: torch.Tensor  # [n] per-term loss after reweighing, differentiable; 0 where no term sits
    weights: torch.Tensor  # [n] loss weight of each term; 0 where no term sits
    positions: torch.Tensor  # [n] bool: where a term sits


def number_spans(number_slot: torch.Tensor, labels: torch.Tensor, decimal_point_id: int | None,
                 float_level: bool, max_digits: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group digit positions of `[B, S]` labels into contiguous numbers.

    Returns (is_start `[B*S]` bool: the first digit of each number, segment `[B*S]` long: the number
    each digit belongs to (-1 elsewhere), place `[B*S]` long: the digit's power of ten).
    """
    rows, length = labels.shape
    is_digit = (number_slot >= 0).view(rows, length)
    in_number = is_digit
    if float_level:
        prev_digit = F.pad(is_digit[:, :-1], (1, 0))
        next_digit = F.pad(is_digit[:, 1:], (0, 1))
        in_number = is_digit | ((labels == decimal_point_id) & prev_digit & next_digit)
    continues = F.pad(in_number[:, :-1], (1, 0))
    is_start = (in_number & ~continues).flatten()
    in_number, is_digit = in_number.flatten(), is_digit.flatten()
    segment = torch.where(in_number, is_start.long().cumsum(0) - 1, -1)
    # per-number tables sized by the positions (an upper bound on the numbers): no host sync for a count
    n_slots = is_start.numel() + 1  # slot 0 collects the positions outside any number
    digits_per_segment = torch.zeros(n_slots, dtype=torch.long, device=labels.device)
    digits_per_segment.index_add_(0, segment + 1, is_digit.long())
    digit_rank = is_digit.long().cumsum(0)  # digits seen so far, inclusive
    first_rank = torch.zeros(n_slots, dtype=torch.long, device=labels.device)
    first_rank.scatter_(0, torch.where(is_start, segment + 1, 0), torch.where(is_start, digit_rank, 0))
    place = digits_per_segment[segment + 1] - (digit_rank - first_rank[segment + 1]) - 1
    place = torch.where(is_digit, place, 0).clamp(0, max_digits - 1)
    return is_start, segment, place


def check_number_level_vocab(number_vocab: NumberVocab) -> None:
    """Number-level NTL composes a number as sum(digit value x 10^place), which holds for single-digit
    tokens only (ntloss's NumberLevelLoss is digit-level only, too): refuse any other vocabulary.
    Host-side checks of the vocabulary's Python tuples, no device work."""
    tokens = number_vocab.tokens or tuple(f"{v:g}" for v in number_vocab.values)
    bad = [t for t, v in zip(tokens, number_vocab.values) if len(t) != 1 or v not in range(10)]
    if bad:
        raise ValueError(f"variant 'number_level' composes numbers from single-digit tokens, but the number "
                         f"vocabulary holds {len(bad)} other number tokens (e.g. {', '.join(map(repr, bad[:5]))}): "
                         f"use a digit-level vocabulary (NumberVocab.from_tokenizer(tok, digit_level=True), "
                         f"tokenizer.digit_level=true; tools/tokenizer.py split-digits for a tokenizer that merges "
                         f"digits) or a token-level variant (was, mse, mae, huber)")


def term_positions(labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings) -> torch.Tensor:
    """`[n]` bool over the flattened labels: where an NTL term sits (each number token, or the first
    digit of each number for "number_level"). Trainers count these to normalise NTL globally."""
    slot = number_vocab.index_of(labels.reshape(-1), settings.ignore_index)
    if settings.variant != "number_level":
        return slot >= 0
    return number_spans(slot, _as_rows(labels), number_vocab.decimal_point_id, settings.float_level,
                        settings.max_number_digits)[0]


def _as_rows(labels: torch.Tensor) -> torch.Tensor:
    """Labels as `[rows, sequence]`: numbers never continue across a row."""
    return labels.reshape(1, -1) if labels.dim() < 2 else labels.reshape(-1, labels.shape[-1])


@dataclass
class NumberSpans:
    """Where the numbers of the labels sit, for "number_level" (`number_spans`, or a sequence shard's view of
    the whole sequence's spans: `sequence_shard.shard_number_spans`)."""

    is_start: torch.Tensor  # [n] bool: the first digit of each number (where its term sits)
    segment: torch.Tensor  # [n] long: the number each position belongs to (-1 elsewhere), < n_segments
    place: torch.Tensor  # [n] long: the digit's power of ten
    n_segments: int  # an upper bound on the segment ids (the tables' size)
    # maps the `[2, n_segments + 1]` table of (expected, true) value sums per number, summed over this view's
    # positions, to the whole numbers' sums (a sequence shard adds the other shards' parts); None: identity
    combine: Callable[[torch.Tensor], torch.Tensor] | None = None


def ntl_terms(number_logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
              settings: NTLSettings, *, number_mass: Callable[[torch.Tensor], torch.Tensor] | None = None,
              loss_weights: torch.Tensor | None = None, spans: NumberSpans | None = None) -> NTLTerms:
    """Per-term NTL from `[n, K]` number logits and `[B, S]` (or `[n]`) labels aligned with them.

    `number_mass()` (the `[n]` full-vocabulary probability mass on number tokens at every row,
    `ShardStats.number_mass`) is needed only when `settings.reweigh`. Every row is computed and the rows
    without a term are masked (their number logits replaced by zeros first, so they get exactly zero
    gradient): `[n, K]` work with K ~ 10, and no host sync. `spans` ("number_level" only): the numbers'
    spans when the labels are a slice of longer rows (a sequence shard); default: found in `labels`.
    """
    device, dtype = number_logits.device, number_logits.dtype
    flat_labels = labels.reshape(-1)
    slot = number_vocab.index_of(flat_labels, settings.ignore_index)
    weights_all = (torch.ones(flat_labels.shape, device=device, dtype=dtype) if loss_weights is None
                   else loss_weights.reshape(-1).to(device=device, dtype=dtype))
    values = number_vocab.values_tensor(device, dtype)

    if settings.variant == "number_level":
        check_number_level_vocab(number_vocab)
        if settings.float_level and number_vocab.decimal_point_id is None:
            raise ValueError("float_level number-level NTL needs the '.' token id: the tokenizer has no '.' token "
                             "(NumberVocab.decimal_point_id is None)")
        if spans is None:
            spans = NumberSpans(*number_spans(slot, _as_rows(labels), number_vocab.decimal_point_id,
                                              settings.float_level, settings.max_number_digits), slot.numel())
        digits = slot >= 0
        probs = torch.softmax(torch.where(digits[:, None], number_logits, 0.0), dim=-1)
        scale = torch.where(digits, torch.pow(10.0, spans.place.to(dtype)), 0.0)
        number_slot = spans.segment + 1  # slot 0: positions outside any number (their scale is 0)
        # row 0: the expected value of each number, row 1: its true value
        sums = values.new_zeros(2, spans.n_segments + 1).index_add(
            1, number_slot, torch.stack([probs @ values * scale, values[slot.clamp_min(0)] * scale]))
        expected, true = (sums if spans.combine is None else spans.combine(sums)).unbind()
        per_number = (expected - true).abs() / (expected.abs() + true.abs() + torch.finfo(dtype).eps)
        positions = spans.is_start
        loss = per_number[number_slot]  # each number's term at its first digit (masked below)
    else:
        positions = slot >= 0
        target_slot = slot.clamp_min(0)
        probs = torch.softmax(torch.where(positions[:, None], number_logits, 0.0), dim=-1)
        if settings.variant == "was" and settings.smoothing_sigma > 0:
            loss = _wasserstein_smoothed(probs, values[target_slot], values, settings.smoothing_sigma)
        elif settings.variant == "was":
            loss = (probs * distance_table(number_vocab, settings.squash_factor, device, dtype)[target_slot]).sum(-1)
        else:
            loss = _lp(probs @ values, values[target_slot], settings.variant)

    if settings.reweigh:
        if number_mass is None:
            raise ValueError("reweigh needs the full-vocabulary number-token mass (number_mass)")
        mass = number_mass()
        loss = loss * mass + REWEIGH_MARGIN * max_distance(number_vocab, settings, device, dtype) * (1 - mass)
    return NTLTerms(loss=torch.where(positions, loss, 0.0), weights=torch.where(positions, weights_all, 0.0),
                    positions=positions)
