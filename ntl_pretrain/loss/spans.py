"""Where the numbers of the labels sit: the contiguous runs of number tokens, each digit's place value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

MAX_NUMBER_DIGITS = 20  # the default of max_number_digits: digits beyond this many share the highest place


def number_spans(number_slot: torch.Tensor, labels: torch.Tensor, decimal_point_id: int | None,
                 float_level: bool, max_digits: int = MAX_NUMBER_DIGITS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def rows_of(labels: torch.Tensor) -> torch.Tensor:
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
