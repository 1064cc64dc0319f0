"""The training run: DeepSpeed engine (ZeRO 0-3, AutoTP), CE + vocabulary-parallel NTL with global
normalisation, LR and NTL-weight schedules, validation, checkpoint and evaluation hooks, monitoring.

Started once per rank by DeepSpeed's launcher (`deepspeed launch/pretrain.sh --config X.yaml k=v ...`).
One optimizer step: fetch this rank's `grad_accum_steps` micro-batches -> count the step's tokens and
NTL positions over the loss group (`ParallelGroups.loss_group`, one all-reduce) -> per micro-batch: local logits -> CE/NTL
sums -> loss scaled so the update is CE_mean + lambda * NTL_mean of the GLOBAL batch -> backward ->
`engine.step()` (DeepSpeed clips and steps at the accumulation boundary) -> on a logging step
(`train.log_every_n_steps`), read the figures and log; no other step reads the device.

`Trainer` holds the run's parts and state; each job is a module of this package: `startup` (checks, process
group, logging, lock, assets, engine, run folder), `one_step` (one optimizer step), `checkpointing` (save, resume,
export), `evaluation` (validation, evaluation hooks), `fit_loop` (the loop and the summary). Beside them:
`preflight` (start-up checks, `--dry-run`), `ds_config` (the configuration resolved once, with the DeepSpeed
config), `engine` (model, checkpoint manager and engine), `training_objective` (what a step optimises),
`step_guard` (non-finite losses and gradients), `preemption` (stop signals); `ntl_pretrain.cli` is the command line.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

from ..config import Config
from ..runtime.supervisor import COMMAND_START_ENV
from . import checkpointing, evaluation, fit_loop, one_step, startup
from .startup import collective_call
from .step_guard import TrainingDiverged

__all__ = ["Trainer", "TrainingDiverged", "collective_call"]


class Trainer:
    """One training run on this process (every rank builds one). Its parts (`startup` sets them): cfg, layout,
    groups, engine, objective, data, tokenizer, number_vocab, vocab_shard, sequence, document_eos_id, checkpoints, nonfinite (the
    step guard), preemption, lock, monitor, window (throughput); its state: step, tokens_seen."""

    def __init__(self, cfg: Config) -> None:
        # the run's wall time counts from the command (launch/pretrain.sh's supervisor passes its start;
        # under another launcher, from this process's start)
        self.started = float(os.environ.get(COMMAND_START_ENV) or psutil.Process().create_time())
        self.stopped_by: str | None = None  # the signal that stopped the run early (None: ran to the end)
        self.last_scalars: dict[str, float] = {}  # the figures of the last logging step
        self.last_logged_step = 0
        self.last_validation: dict[str, float] = {}
        self.saved_tag: str | None = None
        self.export_dir: str | None = None
        startup.start(self, cfg)

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` reads its figures to the host and logs them: the first, every
        `train.log_every_n_steps`-th and the last."""
        return step == 1 or step % self.cfg.train.log_every_n_steps == 0 or step == self.cfg.train.max_steps

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step (`one_step.train_step`); on a logging step its global figures, else None."""
        return one_step.train_step(self)

    def _forward_sums(self, batch: Any, with_ntl: bool) -> Any:
        # one micro-batch's sums; a method, so a benchmark or test can wrap it on one trainer
        return one_step.forward_sums(self, batch, with_ntl)

    def validate(self) -> dict[str, float]:
        """CE, NTL and total loss on the held-out samples (`evaluation.validate`)."""
        return evaluation.validate(self)

    def evaluate(self, final: bool) -> None:
        """Run the evaluation hooks when due (`evaluation.evaluate`); every rank calls this."""
        evaluation.evaluate(self, final)

    def save_checkpoint(self, asynchronous: bool = False) -> str:
        """Save a checkpoint of the current step on every rank (`checkpointing.save_checkpoint`); `asynchronous`
        writes its files in the background."""
        return checkpointing.save_checkpoint(self, asynchronous)

    def commit_pending_checkpoint(self, wait: bool) -> str | None:
        """Commit a checkpoint written in the background once it is (`checkpointing.commit_pending`)."""
        return checkpointing.commit_pending(self, wait)

    def export_final(self, tag: str) -> None:
        """Export checkpoint `tag` as a Hugging Face folder (`checkpointing.export_final`)."""
        checkpointing.export_final(self, tag)

    def fit(self) -> None:
        """Train until train.max_steps (`fit_loop.fit`)."""
        fit_loop.fit(self)

    def close_after_failure(self) -> None:
        """Close the monitor of a run that ended by an error (`fit_loop.close_after_failure`)."""
        fit_loop.close_after_failure(self)

    def summary(self) -> str:
        """Steps, wall time, tokens, final losses and where the run's outputs are (`fit_loop.summary`)."""
        return fit_loop.summary(self)
