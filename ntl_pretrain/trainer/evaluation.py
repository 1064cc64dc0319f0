"""What a run measures besides its training figures: the loss on the held-out samples (`validate`) and the
evaluation hooks of `ntl_pretrain.eval` when due (`evaluate`).

Each function takes the run's `Trainer` (typed Any: `trainer.Trainer` imports this module), whose parts and
state it reads and sets."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..loss.objective import SUMS_WIDTH
from .training_objective import StepFigures


@torch.no_grad()
def validate(trainer: Any) -> dict[str, float]:
    """CE, NTL and total loss on the held-out samples, of the mixture (`val/*`) and of each source
    (`val/<label>/*`): global means; every rank runs the same micro-batches count. A micro-batch holds one
    source's samples, so its sums add to that source's row of the totals (and the mixture's when it is one of
    the mixture's); the totals stay on the device, are summed over the loss group there and read once."""
    names = trainer.cfg.data.source_names()
    trainer.engine.eval()
    totals = torch.zeros(1 + len(names), SUMS_WIDTH, dtype=torch.float64, device=trainer.device)
    for batch, source, in_mixture in trainer.data.validation_plan(trainer.cfg.train.val_batches):
        with torch.no_grad():  # forward only (the chunked head would otherwise prepare gradients)
            sums = trainer._forward_sums(batch, trainer.objective.ntl_on).stack().double()
        if in_mixture:
            totals[0] += sums
        if source >= 0:
            totals[1 + source] += sums
    trainer.engine.train()
    if trainer.layout.loss_size > 1:  # over the ranks the training figures are summed over
        torch.distributed.all_reduce(totals, group=trainer.groups.loss_group)
    reduced = totals.flatten().tolist()  # the one read of the validation
    figures = {}
    for row, prefix in enumerate(["val"] + [f"val/{name}" for name in names]):
        sums = StepFigures(*reduced[row * SUMS_WIDTH: (row + 1) * SUMS_WIDTH])
        if row and not sums.tokens:
            continue  # a source without a whole micro-batch of held-out samples: no figures
        loss, ce, ntl = trainer.objective.losses(sums, max(trainer.step, 1))
        figures.update({f"{prefix}/loss": loss, f"{prefix}/ce": ce, f"{prefix}/ntl": ntl})
    return figures


def log_validation(trainer: Any) -> None:
    """Validate and log the figures (kept for the run's summary)."""
    trainer.last_validation = trainer.validate()
    trainer.monitor.log_validation(trainer.step, trainer.last_validation)


def evaluate(trainer: Any, final: bool) -> None:
    """Run the evaluation hooks (ntl_pretrain.eval) when due; every rank calls this."""
    if not trainer.cfg.eval.is_due(trainer.step, final=final):
        return
    from ..eval.hooks import run_evaluation

    # generation: whole prompts with the plain attention on every rank, prompts split over all dp x sp ranks
    # under sequence parallelism (UlyssesAttention.unsharded); the dp group otherwise
    unsharded = trainer.ulysses.unsharded() if trainer.ulysses else contextlib.nullcontext()
    prompts_group = trainer.groups.loss_group if trainer.ulysses else trainer.groups.dp_group
    with unsharded:
        results = run_evaluation(trainer.engine, trainer.tokenizer, trainer.cfg.eval, step=trainer.step,
                                 output_dir=trainer.cfg.train.output_dir, writer=trainer.monitor.writer,
                                 tp_group=trainer.groups.tp_group, dp_group=prompts_group, final=final,
                                 document_mask=trainer.cfg.data.document_mask)
    headline = {k: v for k, v in results.items()
                if isinstance(v, (int, float)) and k.rsplit("/", 1)[-1] in ("accuracy", "mae", "time_s")
                and k.count("/") <= 3}  # the headline figures; TensorBoard and the predictions file have all
    trainer.monitor.message(f"step {trainer.step}: evaluation " + " ".join(f"{k}={v:.4g}" for k, v in headline.items()))
