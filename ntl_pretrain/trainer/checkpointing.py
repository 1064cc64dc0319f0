"""A run's checkpoints: save the current step on every rank (with the Hugging Face assets and the evaluation
settings an export needs), resume from one, and export one as a Hugging Face folder at the end.

Each function takes the run's parts (`TrainerParts`) and what it reads or writes of the state (`TrainingState`:
`resume` restores it) and of the run's record (`RunRecord`: the checkpoint saved, the export)."""

from __future__ import annotations

import logging
import os
from ..checkpoint import export_hf, run_on_main, write_hf_assets
from ..config import to_yaml
from ..data import PretrainingData
from ..eval.config import save_eval_settings
from .engine import BuiltEngine
from .parts import RunRecord, TrainerParts, TrainingState
from .step_guard import check_weights_finite

logger = logging.getLogger("ntl_pretrain")


def save_checkpoint(parts: TrainerParts, state: TrainingState, record: RunRecord, asynchronous: bool = False) -> str:
    """Save a checkpoint of the current step on every rank (atomic; keeps the last K). With `asynchronous`
    (checkpoint.async_save) it returns once each rank holds a snapshot of its files in host memory; the files are
    written in the background and committed at a later step boundary (`commit_pending`)."""
    commit_pending(parts, record, wait=True)  # the previous one first, reported as committed
    check_weights_finite(parts.engine, parts.device, state.step, parts.cfg.train.output_dir)
    client_state = {"step": state.step, "tokens_seen": state.tokens_seen, "data": parts.data.state_dict(),
                    "ntl_lambda": parts.objective.ntl_lambda(max(state.step, 1)), "config": to_yaml(parts.cfg)}
    tag = parts.checkpoints.save(
        parts.engine, state.step, client_state,
        lambda folder: (write_hf_assets(folder, parts.engine.module.config, parts.tokenizer, parts.number_vocab),
                        # the export evaluates as the run, its prompts encoded as the run trained
                        save_eval_settings(folder, parts.cfg.eval, parts.cfg.data.document_mask)),
        asynchronous=asynchronous)
    timing = parts.checkpoints.last_save
    if asynchronous:
        parts.monitor.message(f"checkpoint {tag}: snapshot of {timing.get('snapshot_bytes', 0.0) / 2**20:.1f} MiB per "
                              f"rank taken in {timing.get('snapshot_s', 0.0):.2f} s; writing it in the background")
        return tag
    _report_saved(parts, record, tag)
    return tag


def commit_pending(parts: TrainerParts, record: RunRecord, wait: bool) -> str | None:
    """Commit the checkpoint being written in the background (every rank, at a step boundary): with `wait` block
    until its files are written, else only when every rank has finished them. Its tag once committed, else None."""
    tag = parts.checkpoints.finish_pending() if wait else parts.checkpoints.poll()
    if tag is not None:
        _report_saved(parts, record, tag)
    return tag


def _report_saved(parts: TrainerParts, record: RunRecord, tag: str) -> None:
    timing = parts.checkpoints.last_save
    how = (f"written in the background in {timing['save_s']:.1f} s, the training waited {timing['waited_s']:.2f} s for it"
           if "waited_s" in timing else f"{timing.get('save_s', 0.0):.1f} s")
    parts.monitor.message(f"saved checkpoint {os.path.join(parts.cfg.train.output_dir, tag)} "
                          f"({how}, of which hashing {timing.get('hash_s', 0.0):.2f} s)")
    record.saved_tag = tag


def resume(built: BuiltEngine, data: PretrainingData, state: TrainingState, output_dir: str) -> None:
    """The engine, step, tokens seen and data position of the checkpoint `built.load_tag` (at start-up)."""
    client_state = built.checkpoints.load(built.engine, built.load_tag)
    scheduler = built.engine.lr_scheduler
    if scheduler is not None:
        # the optimizer's restored lr is the saved schedule's for the next step; this run's schedule
        # (checkpoint.resume_lr_schedule=replan) sets it from the restored iteration on (the same value otherwise)
        scheduler.step(scheduler.last_batch_iteration)
    state.restore(int(client_state["step"]), int(client_state.get("tokens_seen", 0)))
    data.load_state_dict(client_state["data"], steps_done=state.step)
    logger.info("resumed from %s at step %d (%.1f s)", os.path.join(output_dir, built.load_tag), state.step,
                built.checkpoints.last_save.get("load_s", 0.0))


def export_final(parts: TrainerParts, record: RunRecord, tag: str) -> None:
    """Export a checkpoint of this run as a Hugging Face folder (global rank 0 converts; all wait)."""
    cfg = parts.cfg.checkpoint
    out = cfg.export_dir or os.path.join(parts.cfg.train.output_dir, "hf_export")
    report = run_on_main(parts.layout.is_main, lambda: export_hf(
        os.path.join(parts.cfg.train.output_dir, tag), out, max_shard_size=cfg.export_max_shard_size))
    if report is not None:
        parts.monitor.message(f"exported {tag} to {out} ({report['seconds']:.1f} s)")
    record.export_dir = out
