"""A run's checkpoints: save the current step on every rank (with the Hugging Face assets and the evaluation
settings an export needs), resume from one, and export one as a Hugging Face folder at the end.

Each function takes the run's `Trainer` (typed Any: `trainer.Trainer` imports this module), whose parts and
state it reads and sets."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..checkpoint import export_hf, run_on_main, write_hf_assets
from ..config import to_yaml
from ..eval.config import save_eval_settings
from .step_guard import check_weights_finite

logger = logging.getLogger("ntl_pretrain")


def save_checkpoint(trainer: Any, asynchronous: bool = False) -> str:
    """Save a checkpoint of the current step on every rank (atomic; keeps the last K). With `asynchronous`
    (checkpoint.async_save) it returns once each rank holds a snapshot of its files in host memory; the files are
    written in the background and committed at a later step boundary (`commit_pending`)."""
    commit_pending(trainer, wait=True)  # the previous one first, reported as committed
    check_weights_finite(trainer.engine, trainer.device, trainer.step, trainer.cfg.train.output_dir)
    client_state = {"step": trainer.step, "tokens_seen": trainer.tokens_seen, "data": trainer.data.state_dict(),
                    "ntl_lambda": trainer.objective.ntl_lambda(max(trainer.step, 1)), "config": to_yaml(trainer.cfg)}
    tag = trainer.checkpoints.save(
        trainer.engine, trainer.step, client_state,
        lambda folder: (write_hf_assets(folder, trainer.engine.module.config, trainer.tokenizer, trainer.number_vocab),
                        # the export evaluates as the run, its prompts encoded as the run trained
                        save_eval_settings(folder, trainer.cfg.eval, trainer.cfg.data.document_mask)),
        asynchronous=asynchronous)
    timing = trainer.checkpoints.last_save
    if asynchronous:
        trainer.monitor.message(f"checkpoint {tag}: snapshot of {timing.get('snapshot_bytes', 0.0) / 2**20:.1f} MiB per "
                                f"rank taken in {timing.get('snapshot_s', 0.0):.2f} s; writing it in the background")
        return tag
    _report_saved(trainer, tag)
    return tag


def commit_pending(trainer: Any, wait: bool) -> str | None:
    """Commit the checkpoint being written in the background (every rank, at a step boundary): with `wait` block
    until its files are written, else only when every rank has finished them. Its tag once committed, else None."""
    tag = trainer.checkpoints.finish_pending() if wait else trainer.checkpoints.poll()
    if tag is not None:
        _report_saved(trainer, tag)
    return tag


def _report_saved(trainer: Any, tag: str) -> None:
    timing = trainer.checkpoints.last_save
    how = (f"written in the background in {timing['save_s']:.1f} s, the training waited {timing['waited_s']:.2f} s for it"
           if "waited_s" in timing else f"{timing.get('save_s', 0.0):.1f} s")
    trainer.monitor.message(f"saved checkpoint {os.path.join(trainer.cfg.train.output_dir, tag)} "
                            f"({how}, of which hashing {timing.get('hash_s', 0.0):.2f} s)")
    trainer.saved_tag = tag


def resume(trainer: Any, load_tag: str) -> None:
    """The engine, step, tokens seen and data position of checkpoint `load_tag`."""
    client_state = trainer.checkpoints.load(trainer.engine, load_tag)
    scheduler = trainer.engine.lr_scheduler
    if scheduler is not None:
        # the optimizer's restored lr is the saved schedule's for the next step; this run's schedule
        # (checkpoint.resume_lr_schedule=replan) sets it from the restored iteration on (the same value otherwise)
        scheduler.step(scheduler.last_batch_iteration)
    trainer.step = int(client_state["step"])
    trainer.tokens_seen = int(client_state.get("tokens_seen", 0))
    trainer.data.load_state_dict(client_state["data"], steps_done=trainer.step)
    logger.info("resumed from %s at step %d (%.1f s)", os.path.join(trainer.cfg.train.output_dir, load_tag),
                trainer.step, trainer.checkpoints.last_save.get("load_s", 0.0))


def export_final(trainer: Any, tag: str) -> None:
    """Export a checkpoint of this run as a Hugging Face folder (global rank 0 converts; all wait)."""
    cfg = trainer.cfg.checkpoint
    out = cfg.export_dir or os.path.join(trainer.cfg.train.output_dir, "hf_export")
    report = run_on_main(trainer.layout.is_main, lambda: export_hf(
        os.path.join(trainer.cfg.train.output_dir, tag), out, max_shard_size=cfg.export_max_shard_size))
    if report is not None:
        trainer.monitor.message(f"exported {tag} to {out} ({report['seconds']:.1f} s)")
    trainer.export_dir = out
