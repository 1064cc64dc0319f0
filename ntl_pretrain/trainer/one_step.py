"""One optimizer step: the micro-batches' forward and backward (`accumulate`), the update under the step guard
(`optimizer_step`), and on a logging step the figures read to the host in one transfer (`logged_figures`).

Between logging steps nothing is read from the device: counts, losses and figures stay device tensors, and the
step time comes from the logging window (`ThroughputWindow`). Without ZeRO every step reads its figures just
before the update, which they decide. A non-finite loss or gradient norm skips the update (`step_guard`).

Each function takes the run's parts (`TrainerParts`, read only), and where it needs them the state
(`TrainingState`, advanced once per step) and the step's hooks (`StepHooks`)."""

from __future__ import annotations

from typing import Any

import torch

from ..data import MicroBatch
from ..loss import ObjectiveSums
from ..loss.objective import SUMS_WIDTH
from ..loss.sequence_shard import shard_number_spans
from ..observability.monitor import memory_gib
from ..parallel.ulysses import model_inputs
from .parts import StepHooks, TrainerParts, TrainingState
from .step_guard import describe_figures, finite_step, nan_gradient_if_nonfinite, unpartitioned_grad_norm, update_skipped
from .training_objective import StepFigures


def logs_at(parts: TrainerParts, step: int) -> bool:
    """Whether optimizer step `step` reads its figures to the host and logs them: the first, every
    `train.log_every_n_steps`-th and the last."""
    train = parts.cfg.train
    return step == 1 or step % train.log_every_n_steps == 0 or step == train.max_steps


def train_step(parts: TrainerParts, state: TrainingState, hooks: StepHooks) -> dict[str, float] | None:
    """One optimizer step; on a logging step (`logs_at`) returns its global figures (identical on every rank),
    else None."""
    step = state.step + 1
    accumulation = parts.cfg.train.grad_accum_steps
    micro_batches = (hooks.micro_batches or parts.data.next_step)(accumulation)
    totals = accumulate(parts, state, hooks, micro_batches, step)
    lr = float(parts.engine.get_lr()[0])  # what this step's update uses (the schedule moves with the step)
    figures, grad_norm = optimizer_step(parts, totals, step)
    step_tokens = sum(mb.input_ids.numel() for mb in micro_batches) * parts.layout.data_size
    state.advance(step_tokens)
    parts.window.add(step_tokens)
    if not logs_at(parts, step):
        return None
    if figures is None:
        figures = step_figures(parts, totals, grad_norm)  # the logging step's one read
    return logged_figures(parts, figures, step, lr)


def accumulate(parts: TrainerParts, state: TrainingState, hooks: StepHooks, micro_batches: list[MicroBatch],
               step: int) -> torch.Tensor:
    """Forward and backward of each micro-batch with the loss scaled for the global batch (`Objective`); returns
    the step's summed figures (device tensor, `ObjectiveSums` order)."""
    objective, accumulation = parts.objective, parts.cfg.train.grad_accum_steps
    counts = objective.count([mb.labels.to(parts.device, non_blocking=True) for mb in micro_batches],
                             parts.number_vocab, parts.groups, parts.sequence)
    totals = torch.zeros(SUMS_WIDTH, dtype=torch.float64, device=parts.device)
    for index, batch in enumerate(micro_batches):
        with hooks.around_micro_batch():
            sums = forward_sums(parts, state, batch, objective.ntl_on)
            loss = objective.micro_batch_loss(sums, counts, step, parts.layout, accumulation)
            parts.engine.backward(nan_gradient_if_nonfinite(loss))
        totals += sums.stack().double()  # ObjectiveSums order: StepFigures.from_sums reads it back by name
        if index < len(micro_batches) - 1:
            parts.engine.step()  # inside the accumulation: DeepSpeed only counts the micro-batch
    return totals


def forward_sums(parts: TrainerParts, state: TrainingState, batch: MicroBatch, with_ntl: bool) -> ObjectiveSums:
    """The CE and NTL sums of one micro-batch (`ObjectiveSums`), through the head the objective chose."""
    input_ids = batch.input_ids.to(parts.device, non_blocking=True)
    labels = batch.labels.to(parts.device, non_blocking=True)
    # the host checks (labels, the shard layout, the chunked head's returned logits) run on the first
    # micro-batch; on every one only to debug (loss.check_every_step)
    check = state.checks_inputs(parts.cfg.loss.check_every_step)
    # position ids per document when attention stays inside documents (data.document_mask); under sequence
    # parallelism this rank's slice with its global positions (parallel/ulysses.py)
    inputs, spans = model_inputs(input_ids, parts.sequence, parts.document_eos_id), None
    objective = parts.objective
    if parts.sequence.size > 1:
        # the labels' slice, and the whole rows' number spans for the variants that read them
        # (loss/sequence_shard.py)
        if with_ntl and objective.settings.ntl_variant.needs_spans:
            spans = shard_number_spans(labels, parts.sequence, parts.number_vocab, objective.settings)
        labels = parts.sequence.split(labels)
    # the full logits or the chunked head (docs/chunked.md), as the objective chose at start-up
    return objective.head.sums(parts.engine, inputs, labels, parts.number_vocab, objective.settings,
                               shard=parts.vocab_shard, with_ntl=with_ntl, check_inputs=check, spans=spans)


def optimizer_step(parts: TrainerParts, totals: torch.Tensor, step: int) -> tuple[StepFigures | None, Any]:
    """Close the accumulation with `engine.step()` (DeepSpeed clips and updates), count a skipped update
    (`NonfiniteGuard`), and return (the figures when this step had to read them, the gradient norm)."""
    engine = parts.engine
    if parts.cfg.parallel.zero_stage == 0:
        # no ZeRO: DeepSpeed's engine neither keeps a norm nor skips a non-finite update, so the
        # figures are read before the update and decide it (one read every step)
        figures = step_figures(parts, totals, unpartitioned_grad_norm(engine))
        finite = finite_step(figures.ce_sum, figures.ntl_sum, figures.grad_norm)
        if finite:
            engine.step()
        else:
            with update_skipped(engine):
                engine.step()
        parts.nonfinite.check(step, not finite, describe_figures(figures.ce_sum, figures.ntl_sum, figures.grad_norm))
        return figures, figures.grad_norm
    # ZeRO 1-3: DeepSpeed skips the update itself when the gradient norm is not finite; its own check
    # read the norm, so whether it skipped is known on the host without a read of ours
    skipped_before = engine.skipped_steps
    engine.step()
    parts.nonfinite.check(step, engine.skipped_steps > skipped_before,
                          "DeepSpeed's overflow check found the global gradient norm not finite")
    return None, engine.get_global_grad_norm()


def step_figures(parts: TrainerParts, totals: torch.Tensor, grad_norm: Any) -> StepFigures:
    """The step's global sums (summed over the loss group; every rank calls this at the same step)
    and the gradient norm, read to the host in ONE transfer."""
    if parts.layout.loss_size > 1:
        torch.distributed.all_reduce(totals, group=parts.groups.loss_group)
    if torch.is_tensor(grad_norm):
        *sums, norm = torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]).tolist()
        return StepFigures.from_sums(sums, norm)
    return StepFigures.from_sums(totals.tolist(), None if grad_norm is None else float(grad_norm))


def logged_figures(parts: TrainerParts, figures: StepFigures, step: int, lr: float) -> dict[str, float]:
    """What a logging step reports (TensorBoard's train/* scalars)."""
    objective = parts.objective
    loss, ce, ntl = objective.losses(figures, step)
    return {
        "train/loss": loss, "train/ce": ce, "train/ntl": ntl, "train/ntl_lambda": objective.ntl_lambda(step),
        "train/lr": lr,
        "train/grad_norm": figures.grad_norm if figures.grad_norm is not None else 0.0,
        **parts.window.read(),
        "train/number_token_share": figures.number_tokens / max(figures.token_count, 1.0),
        "train/number_mae": figures.abs_error_sum / figures.number_tokens if figures.number_tokens > 0 else 0.0,
        "train/memory_gib": memory_gib(parts.device),
        "train/nonfinite_steps": float(parts.nonfinite.total),
        **(parts.data.stage_figures() if parts.cfg.data.stages else {}),  # data/stage, data/source_share/*
    }
