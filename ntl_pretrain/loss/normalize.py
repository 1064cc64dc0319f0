"""Normalisation of CE and NTL that does not depend on how a global batch is split.

An optimizer step sums over `dp * grad_accum` micro-batches. CE must be the mean over all
non-ignored tokens of the global batch and NTL the mean over all NTL terms of the global batch,
whatever the split. So the trainer counts both for the whole step first (one all-reduce over the
ranks holding different tokens: `ParallelGroups.loss_group`, the data-parallel group without sequence
parallelism), then scales each micro-batch's sums so that DeepSpeed's division by the accumulation steps
and its gradient averaging (`ParallelLayout.grad_average_size`) give exactly the global means.

The counts stay on the device (0-d tensors): nothing here reads a tensor value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, term_positions
from .sequence_shard import SequenceShard, shard_term_positions
from .objective import ObjectiveSums
from .shard import group_size


@dataclass(frozen=True)
class StepCounts:
    """Counts of one optimizer step, summed over its micro-batches and the ranks of the loss group."""

    tokens: torch.Tensor  # 0-d float64: non-ignored label positions (the CE normaliser)
    ntl_positions: torch.Tensor  # 0-d float64: NTL terms, weighted by loss weights (the NTL normaliser)


def count_step(labels: Sequence[torch.Tensor], number_vocab: NumberVocab, settings: NTLSettings,
               loss_group: dist.ProcessGroup | None = None,
               loss_weights: Sequence[torch.Tensor] | None = None, shard: SequenceShard | None = None) -> StepCounts:
    """Count the step's tokens and NTL terms over all micro-batches and the ranks of `loss_group`.

    Runs exactly one all-reduce (SUM, 2 floats) over `loss_group` on every call, also when this rank's
    micro-batches hold no number token, so ranks never wait on each other. No host sync: the counts
    are returned as device tensors. `shard` (sequence parallelism): the labels are whole `[B, S]` rows of
    which this rank holds one sequence slice; only the slice's tokens and terms count here (a number-level
    term in the slice where its number starts), the loss group adds the other slices'.
    """
    if not labels:
        raise ValueError("count_step needs the labels of at least one micro-batch")
    if loss_weights is not None and len(loss_weights) != len(labels):
        raise ValueError(f"got {len(loss_weights)} loss-weight tensors for {len(labels)} micro-batches")
    counts = torch.zeros(2, dtype=torch.float64, device=labels[0].device)
    sliced = shard is not None and shard.size > 1
    for index, micro_labels in enumerate(labels):
        if sliced:
            positions = shard_term_positions(micro_labels, shard, number_vocab, settings)
            micro_labels = shard.split(micro_labels)
        else:
            positions = term_positions(micro_labels, number_vocab, settings)
        counts[0] += (micro_labels != settings.ignore_index).sum()
        if loss_weights is None:
            counts[1] += positions.sum()
        else:
            weights = shard.split(loss_weights[index]) if sliced else loss_weights[index]
            weights = weights.reshape(-1).to(device=counts.device, dtype=torch.float64)
            counts[1] += torch.where(positions, weights, 0.0).sum()
    if group_size(loss_group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=loss_group)
    return StepCounts(tokens=counts[0], ntl_positions=counts[1])


def scaled_micro_batch_loss(sums: ObjectiveSums, counts: StepCounts, ntl_weight: float, grad_average_size: int,
                            grad_accum_steps: int) -> torch.Tensor:
    """The loss of one micro-batch to hand to `engine.backward`.

    DeepSpeed divides each micro-batch loss by `grad_accum_steps` and the summed gradients by
    `grad_average_size` (dp x sp, `ParallelLayout.grad_average_size`); multiplying by both
    undoes that, so the step's gradient is that of `CE_sum_global / tokens + ntl_weight * NTL_sum_global /
    ntl_positions`.
    """
    if grad_average_size < 1 or grad_accum_steps < 1:
        raise ValueError(f"grad_average_size ({grad_average_size}) and grad_accum_steps ({grad_accum_steps}) "
                         f"must be >= 1")
    scale = float(grad_average_size * grad_accum_steps)
    dtype = sums.ce_sum.dtype
    loss = sums.ce_sum * (scale / counts.tokens.clamp_min(1.0)).to(dtype)
    if ntl_weight != 0:
        # no NTL term in the whole step: factor 0 (decided on the device, no host sync)
        has_terms = counts.ntl_positions > 0
        factor = torch.where(has_terms, scale * ntl_weight / torch.where(has_terms, counts.ntl_positions, 1.0), 0.0)
        loss = loss + sums.ntl_sum * factor.to(dtype)
    return loss
