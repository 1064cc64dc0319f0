"""CE + NTL on one sequence shard (Ulysses sequence parallelism, `ntl_pretrain/parallel/ulysses.py`).

Under sequence parallelism the `sp` ranks of a group hold the same packed rows `[B, S]` and each computes the
logits of its own slice of the sequence, positions `[r * S / sp, (r + 1) * S / sp)`. CE and every token-level
NTL variant are sums over positions, so each rank computes its slice's sums and the trainer normalises them
over the data x sequence-parallel ranks (`normalize.py`). The number-level variant is a sum over NUMBERS: a
number whose digits cross a shard boundary has its expected value split over two (or more) ranks. Its spans
are found on the whole row (every rank holds the whole labels), and the partial values of the numbers that
cross a boundary are summed over the sequence-parallel group (`_SumOverSequenceGroup`, B x (sp - 1) pairs
of floats, run on every call whether or not a number crosses); the number's term then sits on the rank that
holds its first digit, exactly as without sharding.

Nothing here reads a tensor value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, NumberSpans, term_positions


@dataclass(frozen=True)
class SequenceShard:
    """Which slice of the sequence this rank holds: equal slices of `seq_len / size` positions, in rank order
    over the sequence-parallel `group` (the order DeepSpeed's Ulysses attention gathers them in)."""

    rank: int = 0  # rank inside the sequence-parallel group
    size: int = 1  # sequence-parallel group size
    group: dist.ProcessGroup | None = None  # None: the whole sequence on this rank

    def bounds(self, seq_len: int) -> tuple[int, int]:
        """`[start, stop)` of this rank's positions in a row of `seq_len`."""
        if seq_len % self.size:
            raise ValueError(f"the sequence length {seq_len} is not divisible by the sequence-parallel size "
                             f"{self.size}: set data.seq_len to a multiple of parallel.sp_size")
        width = seq_len // self.size
        return self.rank * width, (self.rank + 1) * width

    def split(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `[B, S, ...]` rows along the sequence (dim 1), contiguous."""
        start, stop = self.bounds(rows.shape[1])
        return rows[:, start:stop].contiguous()


class _SumOverSequenceGroup(torch.autograd.Function):
    """Sum a small tensor over the sequence-parallel group (the partial values of numbers across shards).

    Forward: one all-reduce SUM over `group`; every rank gets the same sum. Backward: one all-reduce SUM of
    the incoming gradient over the same group: each rank's loss reads the sum, so the gradient of the total
    loss w.r.t. one rank's part is the sum of every rank's gradient w.r.t. the sum.
    """

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_over_sequence_group(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`partial` summed over the sequence-parallel group, differentiable (`_SumOverSequenceGroup`)."""
    return _SumOverSequenceGroup.apply(partial, group)


def shard_number_spans(labels: torch.Tensor, shard: SequenceShard, number_vocab: NumberVocab,
                       settings: NTLSettings) -> NumberSpans:
    """The number spans of the whole `[B, S]` rows `labels`, seen from this rank's slice (`ntl.NumberSpans`
    for `ce_ntl_sums(..., spans=)`), with the exchange of the numbers that cross a slice boundary.

    A number crossing boundaries gets the slot of the first boundary it crosses (row b, boundary j: slot
    `b * (sp - 1) + j`); the exchange sums the `[2, B * (sp - 1)]` table of (expected, true) partial values
    of those slots over the group, on every call (no data-dependent shapes or collectives)."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, sequence] rows, got shape {tuple(labels.shape)}")
    rows, seq_len = labels.shape
    start, stop = shard.bounds(seq_len)
    # the variant's spans of the whole micro-batch (`NTLVariant.spans`: runs may depend on other rows, e.g. "del")
    whole = settings.ntl_variant.spans(number_vocab.index_of(labels.reshape(-1), settings.ignore_index), labels,
                                       number_vocab, settings)
    is_start, segment, place, n_segments = whole.is_start, whole.segment, whole.place, whole.n_segments

    def local(values: torch.Tensor) -> torch.Tensor:
        return values.view(rows, seq_len)[:, start:stop].reshape(-1)

    spans = NumberSpans(local(is_start), local(segment), local(place), n_segments)
    if shard.size == 1:
        return spans
    width = seq_len // shard.size
    boundaries = torch.arange(1, shard.size, device=labels.device) * width
    by_row = segment.view(rows, seq_len)
    left, right = by_row[:, boundaries - 1], by_row[:, boundaries]  # [B, sp - 1]
    crosses = (left == right) & (right >= 0)
    n_cross = rows * (shard.size - 1)
    slots = torch.arange(n_cross, device=labels.device).view(rows, shard.size - 1)
    # exchange slot of each number (indexed as the tables: segment + 1), n_cross for none; the first boundary wins
    slot_of_number = torch.full((n_segments + 1,), n_cross, dtype=torch.long, device=labels.device)
    slot_of_number.scatter_reduce_(0, torch.where(crosses, right + 1, 0).reshape(-1),
                                   torch.where(crosses, slots, n_cross).reshape(-1), reduce="amin")
    crossing = slot_of_number < n_cross

    def combine(table: torch.Tensor) -> torch.Tensor:
        parts = table.new_zeros(table.shape[0], n_cross + 1).index_add(1, slot_of_number, table)
        whole = sum_over_sequence_group(parts[:, :n_cross], shard.group)
        whole = torch.cat([whole, whole.new_zeros(table.shape[0], 1)], dim=1)
        return torch.where(crossing, whole[:, slot_of_number], table)

    return NumberSpans(spans.is_start, spans.segment, spans.place, n_segments, combine)


def shard_term_positions(labels: torch.Tensor, shard: SequenceShard, number_vocab: NumberVocab,
                         settings: NTLSettings) -> torch.Tensor:
    """`[B * S / sp]` bool: where this rank's slice of the `[B, S]` rows holds an NTL term (`term_positions` of
    the whole rows, sliced: a number-level term sits at its number's first digit, in whichever slice)."""
    return shard.split(term_positions(labels, number_vocab, settings).view(labels.shape)).reshape(-1)
