"""Normalisation of CE and NTL that does not depend on how a global batch is split.

An optimizer step sums over `dp * grad_accum` micro-batches. CE must be the mean over all
non-ignored tokens of the global batch and NTL the mean over all NTL terms of the global batch,
whatever the split. So the trainer counts both for the whole step first (one all-reduce over the
DATA-parallel group), then scales each micro-batch's sums so that DeepSpeed's division by the
accumulation steps and its averaging over data-parallel ranks give exactly the global means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..numbers import NumberVocab
from .ntl import NTLSettings, term_positions
from .objective import ObjectiveSums
from .parallel import group_size


@dataclass(frozen=True)
class StepCounts:
    """Counts of one optimizer step, summed over its micro-batches and all data-parallel ranks."""

    tokens: float  # non-ignored label positions (the CE normaliser)
    ntl_positions: float  # NTL terms, weighted by loss weights (the NTL normaliser)


def count_step(labels: Sequence[torch.Tensor], number_vocab: NumberVocab, settings: NTLSettings,
               dp_group: dist.ProcessGroup | None = None,
               loss_weights: Sequence[torch.Tensor] | None = None) -> StepCounts:
    """Count the step's tokens and NTL terms over all micro-batches and data-parallel ranks.

    Runs exactly one all-reduce (SUM, 2 floats) over `dp_group` on every call, also when this rank's
    micro-batches hold no number token, so ranks never wait on each other.
    """
    if not labels:
        raise ValueError("count_step needs the labels of at least one micro-batch")
    if loss_weights is not None and len(loss_weights) != len(labels):
        raise ValueError(f"got {len(loss_weights)} loss-weight tensors for {len(labels)} micro-batches")
    counts = torch.zeros(2, dtype=torch.float64, device=labels[0].device)
    for index, micro_labels in enumerate(labels):
        counts[0] += (micro_labels != settings.ignore_index).sum()
        positions = term_positions(micro_labels, number_vocab, settings)
        if loss_weights is None:
            counts[1] += positions.sum()
        else:
            counts[1] += loss_weights[index].reshape(-1).to(torch.float64)[positions].sum()
    if group_size(dp_group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    tokens, ntl_positions = counts.tolist()
    return StepCounts(tokens=tokens, ntl_positions=ntl_positions)


def scaled_micro_batch_loss(sums: ObjectiveSums, counts: StepCounts, ntl_weight: float, dp_world_size: int,
                            grad_accum_steps: int) -> torch.Tensor:
    """The loss of one micro-batch to hand to `engine.backward`.

    DeepSpeed divides each micro-batch loss by `grad_accum_steps` and averages gradients over the
    `dp_world_size` data-parallel ranks; multiplying by both undoes that, so the step's gradient is
    that of `CE_sum_global / tokens + ntl_weight * NTL_sum_global / ntl_positions`.
    """
    if dp_world_size < 1 or grad_accum_steps < 1:
        raise ValueError(f"dp_world_size ({dp_world_size}) and grad_accum_steps ({grad_accum_steps}) must be >= 1")
    scale = float(dp_world_size * grad_accum_steps)
    loss = sums.ce_sum * (scale / max(counts.tokens, 1.0))
    if ntl_weight != 0 and counts.ntl_positions > 0:
        loss = loss + sums.ntl_sum * (scale * ntl_weight / counts.ntl_positions)
    return loss
