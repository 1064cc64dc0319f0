"""The training run: DeepSpeed engine (ZeRO 0-3, AutoTP), CE + vocabulary-parallel NTL with global
normalisation, LR and NTL-weight schedules, validation, checkpoint and evaluation hooks, monitoring.

Started once per rank by DeepSpeed's launcher (`deepspeed launch/pretrain.sh --config X.yaml k=v ...`).
One optimizer step: fetch this rank's `grad_accum_steps` micro-batches -> count the step's tokens and
NTL positions over the loss group (`ParallelGroups.loss_group`, one all-reduce) -> per micro-batch: local logits -> CE/NTL
sums -> loss scaled so the update is CE_mean + lambda * NTL_mean of the GLOBAL batch -> backward ->
`engine.step()` (DeepSpeed clips and steps at the accumulation boundary) -> on a logging step
(`train.log_every_n_steps`), read the figures and log; no other step reads the device.

`Trainer` owns the run's parts, state, record and step hooks (`parts`: `TrainerParts`, `TrainingState`,
`RunRecord`, `StepHooks`) and runs the fit loop; each other job is a module of free functions over the typed
parts: `startup` (checks, process group, logging, lock, assets, engine, run folder; builds the parts), `one_step`
(one optimizer step), `checkpointing` (save, resume, export), `evaluation` (validation, evaluation hooks). Beside
them: `preflight` (start-up checks, `--dry-run`), `ds_config` (the configuration resolved once, with the DeepSpeed
config), `engine` (model, checkpoint manager and engine), `training_objective` (what a step optimises and the
logged figures), `step_guard` (non-finite losses and gradients), `preemption` (stop signals); `ntl_pretrain.cli`
is the command line.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import psutil

from ..config import Config
from ..runtime import lifecycle
from ..runtime.supervisor import COMMAND_START_ENV
from . import checkpointing, evaluation, one_step, startup
from .parts import RunRecord, StepHooks, TrainerParts, TrainingState
from .startup import collective_call
from .step_guard import TrainingDiverged

__all__ = ["RunRecord", "StepHooks", "Trainer", "TrainerParts", "TrainingDiverged", "TrainingState", "collective_call"]

logger = logging.getLogger("ntl_pretrain")


class Trainer:
    """One training run on this process (every rank builds one). It owns `parts` (what start-up built, frozen),
    `state` (step, tokens seen; advanced by the step), `record` (what the summary reports) and `hooks` (the step's
    extension points, the defaults unless a tool or test replaces them with `with_hooks`)."""

    def __init__(self, cfg: Config) -> None:
        # the run's wall time counts from the command (launch/pretrain.sh's supervisor passes its start;
        # under another launcher, from this process's start)
        started = float(os.environ.get(COMMAND_START_ENV) or psutil.Process().create_time())
        self.record = RunRecord(started=started)
        self.hooks = StepHooks()
        self.parts, self.state = startup.start(cfg)

    @contextmanager
    def with_hooks(self, **changes: Any) -> Iterator[StepHooks]:
        """Run the block with some step hooks replaced (`StepHooks`' fields by name); the previous ones after it."""
        previous = self.hooks
        self.hooks = replace(previous, **changes)
        try:
            yield self.hooks
        finally:
            self.hooks = previous

    @contextmanager
    def with_parts(self, **changes: Any) -> Iterator[TrainerParts]:
        """Run the block with some parts replaced (`TrainerParts`' fields by name; a benchmark's A/B of the
        objective or the document mask); the previous ones after it."""
        previous = self.parts
        self.parts = replace(previous, **changes)
        try:
            yield self.parts
        finally:
            self.parts = previous

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` reads its figures to the host and logs them (`one_step.logs_at`)."""
        return one_step.logs_at(self.parts, step)

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step (`one_step.train_step`), then `hooks.after_step`; on a logging step its global
        figures, else None."""
        figures = one_step.train_step(self.parts, self.state, self.hooks)
        if self.hooks.after_step is not None:
            self.hooks.after_step(self.state)
        return figures

    def validate(self) -> dict[str, float]:
        """CE, NTL and total loss on the held-out samples (`evaluation.validate`)."""
        return evaluation.validate(self.parts, self.state, self.hooks)

    def log_validation(self) -> None:
        """Validate and log the figures (kept for the run's summary)."""
        self.record.last_validation = self.validate()
        self.parts.monitor.log_validation(self.state.step, self.record.last_validation)

    def evaluate(self, final: bool) -> None:
        """Run the evaluation hooks when due (`evaluation.evaluate`); every rank calls this."""
        evaluation.evaluate(self.parts, self.state, final)

    def save_checkpoint(self, asynchronous: bool = False) -> str:
        """Save a checkpoint of the current step on every rank (`checkpointing.save_checkpoint`); `asynchronous`
        writes its files in the background."""
        return checkpointing.save_checkpoint(self.parts, self.state, self.record, asynchronous)

    def commit_pending_checkpoint(self, wait: bool) -> str | None:
        """Commit a checkpoint written in the background once it is (`checkpointing.commit_pending`)."""
        return checkpointing.commit_pending(self.parts, self.record, wait)

    def export_final(self, tag: str) -> None:
        """Export checkpoint `tag` as a Hugging Face folder (`checkpointing.export_final`)."""
        checkpointing.export_final(self.parts, self.record, tag)

    def fit(self) -> None:
        """Train until train.max_steps with validation, checkpoints and evaluation at their intervals (kept out of
        the logged step time), a stop signal honoured at a step boundary (save, then return), the final
        validation, checkpoint, evaluation and export, and the run's summary."""
        parts, state, cfg = self.parts, self.state, self.parts.cfg
        if state.step >= cfg.train.max_steps:
            parts.monitor.message(f"nothing to do: the run is at step {state.step} and "
                                  f"train.max_steps={cfg.train.max_steps}")
            self._finish()
            return
        layout = parts.layout
        sp = f"sp={layout.sp_size} " if layout.sp_size > 1 else ""  # the dp x tp line as before without sp
        parts.monitor.message(f"training steps {state.step + 1}..{cfg.train.max_steps}: dp={layout.dp_size} "
                              f"{sp}tp={layout.tp_size} zero={cfg.parallel.zero_stage} micro_batch="
                              f"{cfg.data.micro_batch_size} grad_accum={cfg.train.grad_accum_steps} "
                              f"seq_len={cfg.data.seq_len}")
        # from here a stop signal saves at the next step boundary (the supervisor forwards it to the started
        # ranks); before, during start-up, it ends the job at once: nothing has been trained to save
        parts.preemption.training_starts()
        lifecycle.report_to_supervisor("started")
        parts.window.restart()
        saved_at = self._steps()
        if self.record.stopped_by is not None:
            return  # a stop signal: saved and finished at its step boundary
        if cfg.train.validates_after(state.step):
            self.log_validation()  # overlaps the writing of a background save of the last step
        self.commit_pending_checkpoint(wait=True)
        if cfg.checkpoint.save_final and saved_at != f"global_step{state.step}":
            saved_at = self.save_checkpoint()
        self.evaluate(final=True)
        if cfg.checkpoint.export_hf_at_end and saved_at is not None:
            self.export_final(saved_at)
        self._finish()

    def _steps(self) -> str | None:
        """The steps to train.max_steps with what comes between them, or to a stop signal (then the run is saved and
        finished, `record.stopped_by` set); the tag of the last checkpoint saved (None: none)."""
        cfg, ckpt_every, saved_at = self.parts.cfg, self.parts.cfg.checkpoint.every_n_steps, None
        while self.state.step < cfg.train.max_steps:
            scalars = self.train_step()
            if scalars is not None:
                self.record.last_scalars, self.record.last_logged_step = scalars, self.state.step
            self.parts.monitor.log_step(self.state.step, scalars)
            # every rank, every step: one integer all-reduced on the host (gloo), no device sync
            signal_name = self.parts.preemption.requested()
            if signal_name is not None:
                self._stop_for_preemption(signal_name)
                return saved_at
            last = self.state.step == cfg.train.max_steps
            with self.parts.window.paused():  # not training steps: kept out of the logged step time and tokens/s
                self.commit_pending_checkpoint(wait=False)  # a background save every rank has written
                if cfg.train.validates_after(self.state.step) and not last:  # the last step's comes after the save
                    self.log_validation()
                if ckpt_every > 0 and self.state.step % ckpt_every == 0:
                    saved_at = self.save_checkpoint(asynchronous=cfg.checkpoint.async_save)
                if not last:
                    self.evaluate(final=False)
        return saved_at

    def _stop_for_preemption(self, signal_name: str) -> None:
        """Save at this step boundary and finish (the process then exits 0)."""
        monitor = self.parts.monitor
        monitor.message(f"step {self.state.step}: {signal_name} received (pre-emption): saving a checkpoint")
        tag = self.save_checkpoint()
        monitor.message(f"pre-empted at step {self.state.step}: {tag} saved; continue with train.resume=auto")
        self.record.stopped_by = signal_name
        self._finish()

    def _finish(self) -> None:
        """Commit a checkpoint still being written, print the run's summary (as the HF Trainer does), close the
        monitor, drop the signal handlers."""
        self.commit_pending_checkpoint(wait=True)
        self.parts.monitor.message(self.summary())
        self.parts.monitor.close("stopped" if self.record.stopped_by else "finished")
        self.parts.preemption.uninstall()

    def close_after_failure(self) -> None:
        """Close the monitor of a run that ended by an error (the trackers mark it failed); nothing if it is closed
        already. Another failure while closing is logged: the run's own error is the one reported. A checkpoint
        being written in the background is finished but not committed (that takes every rank; its `.partial`
        folder is removed at the next start)."""
        abandoned = self.parts.checkpoints.abandon_pending()
        if abandoned is not None:
            logger.warning("checkpoint %s was being written in the background when the run failed: not committed; "
                           "train.resume=auto resumes from the previous one", abandoned)
        try:
            self.parts.monitor.close("failed")
        except Exception as error:  # the run's own error is reported; this one only logged
            logger.warning("closing the monitor after the run's error failed too: %s", error)

    def summary(self) -> str:
        """Steps, wall time, tokens, final losses and where the run's outputs are."""
        record, state, output_dir = self.record, self.state, self.parts.cfg.train.output_dir
        seconds = max(time.time() - record.started, 0.0)
        how = (f"stopped by {record.stopped_by} at step {state.step}" if record.stopped_by
               else f"finished at step {state.step}")
        losses = " ".join(f"{k.split('/', 1)[1]}={record.last_scalars[k]:.4g}"
                          for k in ("train/loss", "train/ce", "train/ntl") if k in record.last_scalars)
        val = " ".join(f"{k}={v:.4g}" for k, v in record.last_validation.items())
        lines = [f"run summary: {how}: {state.step - state.start_step} steps in {seconds / 60:.1f} min (from the "
                 f"command's start), {state.tokens_seen:,} tokens seen in total",
                 f"  train (last logged, step {record.last_logged_step}): {losses or '-'}" + (f"; {val}" if val else ""),
                 f"  checkpoint: {os.path.join(output_dir, record.saved_tag) if record.saved_tag else 'none saved'}"
                 + (" (continue with train.resume=auto)" if record.stopped_by else ""),
                 f"  export: {record.export_dir or 'none (checkpoint.export_hf_at_end=false)'}",
                 f"  TensorBoard: tensorboard --logdir {self.parts.tensorboard_dir}"]
        return "\n".join(lines)
