"""The fit loop: steps until train.max_steps with validation, checkpoints and evaluation at their intervals
(kept out of the logged step time), a stop signal honoured at a step boundary (save, then exit 0), the final
validation, checkpoint, evaluation and export, and the run's summary.

Each function takes the run's `Trainer` (typed Any: `trainer.Trainer` imports this module), whose parts and
state it reads and sets."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..runtime import lifecycle
from .evaluation import log_validation

logger = logging.getLogger("ntl_pretrain")


def fit(trainer: Any) -> None:
    cfg = trainer.cfg
    ckpt_every = cfg.checkpoint.every_n_steps
    if trainer.step >= cfg.train.max_steps:
        trainer.monitor.message(f"nothing to do: the run is at step {trainer.step} and train.max_steps={cfg.train.max_steps}")
        finish(trainer)
        return
    sp = f"sp={trainer.layout.sp_size} " if trainer.layout.sp_size > 1 else ""  # the dp x tp line as before without sp
    trainer.monitor.message(f"training steps {trainer.step + 1}..{cfg.train.max_steps}: dp={trainer.layout.dp_size} "
                            f"{sp}tp={trainer.layout.tp_size} zero={cfg.parallel.zero_stage} micro_batch="
                            f"{cfg.data.micro_batch_size} grad_accum={cfg.train.grad_accum_steps} seq_len={cfg.data.seq_len}")
    saved_at = None
    # from here a stop signal saves at the next step boundary (the supervisor forwards it to the started
    # ranks); before, during start-up, it ends the job at once: nothing has been trained to save
    trainer.preemption.training_starts()
    lifecycle.report_to_supervisor("started")
    trainer.window.restart()
    while trainer.step < cfg.train.max_steps:
        scalars = trainer.train_step()
        if scalars is not None:
            trainer.last_scalars, trainer.last_logged_step = scalars, trainer.step
        trainer.monitor.log_step(trainer.step, scalars)
        # every rank, every step: one integer all-reduced on the host (gloo), no device sync
        signal_name = trainer.preemption.requested()
        if signal_name is not None:
            stop_for_preemption(trainer, signal_name)
            return
        last = trainer.step == cfg.train.max_steps
        with trainer.window.paused():  # not training steps: kept out of the logged step time and tokens/s
            trainer.commit_pending_checkpoint(wait=False)  # a background save every rank has written
            if cfg.train.validates_after(trainer.step) and not last:  # the last step's comes after the save
                log_validation(trainer)
            if ckpt_every > 0 and trainer.step % ckpt_every == 0:
                saved_at = trainer.save_checkpoint(asynchronous=cfg.checkpoint.async_save)
            if not last:
                trainer.evaluate(final=False)
    if cfg.train.validates_after(trainer.step):
        log_validation(trainer)  # overlaps the writing of a background save of the last step
    trainer.commit_pending_checkpoint(wait=True)
    if cfg.checkpoint.save_final and saved_at != f"global_step{trainer.step}":
        saved_at = trainer.save_checkpoint()
    trainer.evaluate(final=True)
    if cfg.checkpoint.export_hf_at_end and saved_at is not None:
        trainer.export_final(saved_at)
    finish(trainer)


def stop_for_preemption(trainer: Any, signal_name: str) -> None:
    """Save at this step boundary and return (the process then exits 0)."""
    trainer.monitor.message(f"step {trainer.step}: {signal_name} received (pre-emption): saving a checkpoint")
    tag = trainer.save_checkpoint()
    trainer.monitor.message(f"pre-empted at step {trainer.step}: {tag} saved; continue with train.resume=auto")
    trainer.stopped_by = signal_name
    finish(trainer)


def finish(trainer: Any) -> None:
    """Commit a checkpoint still being written, print the run's summary (as the HF Trainer does), close the
    monitor, drop the signal handlers."""
    trainer.commit_pending_checkpoint(wait=True)
    trainer.monitor.message(trainer.summary())
    trainer.monitor.close("stopped" if trainer.stopped_by else "finished")
    trainer.preemption.uninstall()


def close_after_failure(trainer: Any) -> None:
    """Close the monitor of a run that ended by an error (the trackers mark it failed); nothing if it is closed
    already. Another failure while closing is logged: the run's own error is the one reported. A checkpoint
    being written in the background is finished but not committed (that takes every rank; its `.partial`
    folder is removed at the next start)."""
    abandoned = trainer.checkpoints.abandon_pending() if getattr(trainer, "checkpoints", None) else None
    if abandoned is not None:
        logger.warning("checkpoint %s was being written in the background when the run failed: not committed; "
                       "train.resume=auto resumes from the previous one", abandoned)
    try:
        trainer.monitor.close("failed")
    except Exception as error:  # the run's own error is reported; this one only logged
        logger.warning("closing the monitor after the run's error failed too: %s", error)


def summary(trainer: Any) -> str:
    """Steps, wall time, tokens, final losses and where the run's outputs are."""
    output_dir = trainer.cfg.train.output_dir
    seconds = max(time.time() - trainer.started, 0.0)
    steps = trainer.step - trainer.start_step
    how = f"stopped by {trainer.stopped_by} at step {trainer.step}" if trainer.stopped_by else f"finished at step {trainer.step}"
    losses = " ".join(f"{k.split('/', 1)[1]}={trainer.last_scalars[k]:.4g}" for k in ("train/loss", "train/ce", "train/ntl")
                      if k in trainer.last_scalars)
    val = " ".join(f"{k}={v:.4g}" for k, v in trainer.last_validation.items())
    lines = [f"run summary: {how}: {steps} steps in {seconds / 60:.1f} min (from the command's start), "
             f"{trainer.tokens_seen:,} tokens seen in total",
             f"  train (last logged, step {trainer.last_logged_step}): {losses or '-'}" + (f"; {val}" if val else ""),
             f"  checkpoint: {os.path.join(output_dir, trainer.saved_tag) if trainer.saved_tag else 'none saved'}"
             + (" (continue with train.resume=auto)" if trainer.stopped_by else ""),
             f"  export: {trainer.export_dir or 'none (checkpoint.export_hf_at_end=false)'}",
             f"  TensorBoard: tensorboard --logdir {trainer.tensorboard_dir}"]
    return "\n".join(lines)
