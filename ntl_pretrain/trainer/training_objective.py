"""What a training step optimises, decided once at start-up from the `loss` section.

`Objective` is CE, plus lambda(step) x NTL when NTL is on (`LossConfig.ntl_on`: loss.enabled and
loss.ntl_weight > 0, the one switch), computed through the full LM head or the chunked one
(loss.chunk_tokens > 0, docs/chunked.md). The trainer asks it for the step's weight, counts, the
scaled micro-batch loss and the logged losses; it never re-reads the configuration. The loss maths
itself is `ntl_pretrain.loss`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ..config import LossConfig, NTLScheduleName, ntl_settings
from ..core.numbers import NumberVocab
from ..loss import NTLSettings, ObjectiveSums, StepCounts, count_step, scaled_micro_batch_loss
from ..loss.heads import LossHead, select_loss_head
from ..loss.sequence_shard import SequenceShard
from ..parallel.layout import ParallelGroups, ParallelLayout


@dataclass(frozen=True, kw_only=True)
class StepFigures:
    """A step's (or a validation's) global sums, one field per `ObjectiveSums` field of the same name, read to the
    host in one transfer, and its gradient norm. Built by name (`from_sums`), never by position: reordering or
    renaming a sum cannot shift the logged figures (tests/test_trainer_figures.py)."""

    ce_sum: float
    ntl_sum: float
    token_count: float
    ntl_count: float
    number_tokens: float
    abs_error_sum: float
    grad_norm: float | None = None  # None: no gradient norm (validation; ZeRO-less engines without one)

    @classmethod
    def from_sums(cls, values: Sequence[float], grad_norm: float | None = None) -> "StepFigures":
        """The figures of `values`, a vector in `ObjectiveSums.stack()` order, each taken by its field's name."""
        names = [sums_field.name for sums_field in fields(ObjectiveSums)]
        if len(values) != len(names):
            raise ValueError(f"{len(values)} sums for the {len(names)} fields of ObjectiveSums ({', '.join(names)})")
        return cls(**dict(zip(names, values)), grad_norm=grad_norm)


@dataclass(frozen=True)
class Objective:
    """The run's training objective; build it with `Objective.from_config(cfg.loss)`."""

    ntl_on: bool  # NTL is computed, weighted and logged (False: CE only)
    ntl_weight: float  # lambda after its warm-up
    ntl_schedule: NTLScheduleName  # constant | linear_warmup
    ntl_warmup_steps: int  # steps of the linear warm-up of lambda
    chunk_tokens: int  # > 0: the chunked LM head over this many tokens at a time; 0: the full logits
    chunk_backward: str  # the chunked head's gradient algorithm (loss.chunked.resolve_chunk_backward)
    settings: NTLSettings  # the NTL variant and its options
    head: LossHead  # full logits, the chunked head, ...: chosen once from the loss section (loss.heads)

    @classmethod
    def from_config(cls, loss: LossConfig) -> "Objective":
        """The objective of a `loss` section (the loss's own checks as a ConfigError naming the keys)."""
        settings = ntl_settings(loss)  # the one builder of the run's NTL settings (and their checks)
        return cls(ntl_on=loss.ntl_on, ntl_weight=loss.ntl_weight, ntl_schedule=loss.ntl_schedule,
                   ntl_warmup_steps=loss.ntl_warmup_steps, chunk_tokens=loss.chunk_tokens,
                   chunk_backward=loss.chunk_backward, settings=settings,
                   head=select_loss_head(loss))

    def ntl_lambda(self, step: int) -> float:
        """The NTL weight at optimizer step `step` (numbering from 1); 0 with NTL off."""
        if not self.ntl_on:
            return 0.0
        if self.ntl_schedule == "linear_warmup":
            return self.ntl_weight * min(1.0, step / self.ntl_warmup_steps)
        return self.ntl_weight

    def describe(self) -> str:
        """One line for the log: the loss and the head."""
        loss = (f"CE + {self.ntl_weight:g} x NTL ({self.settings.describe()}; {self.ntl_schedule})" if self.ntl_on
                else "CE only (NTL off)")
        return f"objective: {loss}, {self.head.describe()}"

    def count(self, labels: Sequence[torch.Tensor], number_vocab: NumberVocab, groups: ParallelGroups,
              shard: SequenceShard | None = None) -> StepCounts:
        """The step's tokens and NTL terms over its micro-batches and every rank holding other tokens
        (`groups.loss_group`: one all-reduce); `shard`: this rank's sequence slice of the rows."""
        return count_step(labels, number_vocab, self.settings, groups.loss_group, shard=shard)

    def micro_batch_loss(self, sums: ObjectiveSums, counts: StepCounts, step: int, layout: ParallelLayout,
                         grad_accum_steps: int) -> torch.Tensor:
        """The micro-batch's loss for `engine.backward`: the step's update is that of CE_mean +
        lambda * NTL_mean over the GLOBAL batch (see `loss.normalize`; DeepSpeed's gradient averaging over
        `layout.grad_average_size` ranks undone)."""
        return scaled_micro_batch_loss(sums, counts, self.ntl_lambda(step), layout.grad_average_size, grad_accum_steps)

    def losses(self, figures: StepFigures, step: int) -> tuple[float, float, float]:
        """(loss, CE, NTL): the global means of a step's or a validation's figures, weighted for `step`."""
        ce = figures.ce_sum / max(figures.token_count, 1.0)
        ntl = figures.ntl_sum / figures.ntl_count if figures.ntl_count > 0 else 0.0
        return ce + self.ntl_lambda(step) * ntl, ce, ntl
