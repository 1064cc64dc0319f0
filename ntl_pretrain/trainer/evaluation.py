"""What a run measures besides its training figures: the loss on the held-out samples (`validate`) and the
evaluation hooks of `ntl_pretrain.eval` when due (`evaluate`).

Each function takes the run's parts (`TrainerParts`) and state (`TrainingState`), and reads them."""

from __future__ import annotations

import contextlib

import torch

from ..loss.objective import SUMS_WIDTH
from .one_step import forward_sums
from .parts import StepHooks, TrainerParts, TrainingState
from .training_objective import StepFigures


@torch.no_grad()
def validate(parts: TrainerParts, state: TrainingState, hooks: StepHooks) -> dict[str, float]:
    """CE, NTL and total loss on the held-out samples, of the mixture (`val/*`) and of each source
    (`val/<label>/*`): global means; every rank runs the same micro-batches count. A micro-batch holds one
    source's samples, so its sums add to that source's row of the totals (and the mixture's when it is one of
    the mixture's); the totals stay on the device, are summed over the loss group there and read once. Each
    micro-batch's forward runs inside `hooks.around_micro_batch`."""
    names = parts.cfg.data.source_names()
    parts.engine.eval()
    totals = torch.zeros(1 + len(names), SUMS_WIDTH, dtype=torch.float64, device=parts.device)
    for batch, source, in_mixture in parts.data.validation_plan(parts.cfg.train.val_batches):
        with torch.no_grad(), hooks.around_micro_batch():  # forward only (else the chunked head prepares gradients)
            sums = forward_sums(parts, state, batch, parts.objective.ntl_on).stack().double()
        if in_mixture:
            totals[0] += sums
        if source >= 0:
            totals[1 + source] += sums
    parts.engine.train()
    if parts.layout.loss_size > 1:  # over the ranks the training figures are summed over
        torch.distributed.all_reduce(totals, group=parts.groups.loss_group)
    reduced = totals.flatten().tolist()  # the one read of the validation
    figures = {}
    for row, prefix in enumerate(["val"] + [f"val/{name}" for name in names]):
        sums = StepFigures.from_sums(reduced[row * SUMS_WIDTH: (row + 1) * SUMS_WIDTH])
        if row and not sums.token_count:
            continue  # a source without a whole micro-batch of held-out samples: no figures
        loss, ce, ntl = parts.objective.losses(sums, max(state.step, 1))
        figures.update({f"{prefix}/loss": loss, f"{prefix}/ce": ce, f"{prefix}/ntl": ntl})
    return figures


def evaluate(parts: TrainerParts, state: TrainingState, final: bool) -> None:
    """Run the evaluation hooks (ntl_pretrain.eval) when due; every rank calls this."""
    if not parts.cfg.eval.is_due(state.step, final=final):
        return
    from ..eval.hooks import run_evaluation

    # generation: whole prompts with the plain attention on every rank, prompts split over all dp x sp ranks
    # under sequence parallelism (UlyssesAttention.unsharded); the dp group otherwise
    unsharded = parts.ulysses.unsharded() if parts.ulysses else contextlib.nullcontext()
    prompts_group = parts.groups.loss_group if parts.ulysses else parts.groups.dp_group
    with unsharded:
        results = run_evaluation(parts.engine, parts.tokenizer, parts.cfg.eval, step=state.step,
                                 output_dir=parts.cfg.train.output_dir, writer=parts.monitor.writer,
                                 tp_group=parts.groups.tp_group, dp_group=prompts_group, final=final,
                                 document_mask=parts.cfg.data.document_mask)
    headline = {k: v for k, v in results.items()
                if isinstance(v, (int, float)) and k.rsplit("/", 1)[-1] in ("accuracy", "mae", "time_s")
                and k.count("/") <= 3}  # the headline figures; TensorBoard and the predictions file have all
    parts.monitor.message(f"step {state.step}: evaluation " + " ".join(f"{k}={v:.4g}" for k, v in headline.items()))
