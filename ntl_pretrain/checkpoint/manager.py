"""The checkpoint manager: which checkpoint a run resumes from, and its save (atomic, verified), load,
keep-last-K and resume planning (fingerprint, data, learning-rate schedule, layout)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pickle
import shutil
import time
from typing import Any, Callable

import torch

from ..core.agreement import host_group
from ..core.fs import (OutputPathError, atomic_write, commit_directory, is_full_disk, is_short_write,
                       write_text_atomic)
from .async_save import PendingSave, snapshot_saves
from .collective import agree, broadcast_from_main, gather, run_on_main
from .fingerprint import check_data, check_fingerprint, describe_changes, lr_text
from .format import (FORMAT_VERSION, HF_DIR, LATEST_NAME, MANIFEST_NAME, REPLACED_SUFFIX, STAGING_MARKER,
                     STAGING_SUFFIX, UNIVERSAL_SUFFIX, CheckpointError, CheckpointInfo, SavedLayout, UnsafeCheckpointError,
                     file_sizes, folder_bytes, needs_reshard, read_manifest, rng_state_file, saved_layout, step_of_tag,
                     tag_for_step)
from .integrity import hash_files, hash_record, verify_checkpoint
from .safe_loading import load_rng_state, reseed, rng_state, set_rng_state, weights_only_loads
from .staging import make_staging, mark_staging, remove_interrupted_saves, remove_staging
from .universal import convert_while_others_wait, universal_path

logger = logging.getLogger("ntl_pretrain")


def list_checkpoints(output_dir: str, verify: bool = True) -> list[CheckpointInfo]:
    """The complete checkpoints of a run folder, oldest first. Skipped with a warning naming them: symbolic
    links (never followed out of the run folder), incomplete ones, those whose name and manifest disagree on
    the step, and with `verify` those with a missing, truncated, linked or unlisted file (contents are
    checked by `verify_checkpoint`). So neither resume=auto nor keep-last-K acts on any of them."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = step_of_tag(name)
        path = os.path.join(output_dir, name)
        if step is not None and os.path.islink(path):
            logger.warning("skipping %s: it is a symbolic link, and checkpoints are never followed out of the run "
                           "folder; copy the checkpoint in (cp -r) to resume from it", path)
            continue
        if step is None or not os.path.isdir(path):
            continue
        try:
            manifest = verify_checkpoint(path, content=False) if verify else read_manifest(path)
        except CheckpointError as error:
            logger.warning("skipping %s", error)
            continue
        found.append(CheckpointInfo(tag=name, path=path, step=step, manifest=manifest))
    return sorted(found, key=lambda info: info.step)


def _checkpoint_like_entries(output_dir: str) -> list[str]:
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if step_of_tag(n) is not None]
    return sorted(names, key=lambda n: step_of_tag(n) or 0)


def resolve_resume(output_dir: str, resume: str) -> str | None:
    """The checkpoint tag a run resumes from (None: start fresh), checked before anything is loaded.

    Args:
        output_dir: the run folder.
        resume: "none" (refuse a folder with checkpoints), "auto" (the newest complete checkpoint whose
            files match their recorded sizes and hashes, or a fresh start if there is none) or a tag
            (`global_step300`: a damaged one is an error).
    With torch.distributed initialised, every rank calls this at the same point (the contents are
    checked in shares, see `verify_checkpoint`).
    """
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointError(f"train.output_dir={output_dir!r} is a file, not a folder; choose another path")
    if os.path.isdir(output_dir) and not os.access(output_dir, os.R_OK | os.X_OK):
        raise CheckpointError(f"train.output_dir={output_dir!r} is not readable (permissions)")
    if resume == "none":
        existing = _checkpoint_like_entries(output_dir)
        if existing or os.path.isfile(os.path.join(output_dir, LATEST_NAME)):
            raise CheckpointError(
                f"train.output_dir={output_dir!r} already holds checkpoints of another run ({', '.join(existing) or 'latest'}); "
                f"refusing to mix runs. Continue it with train.resume=auto, or choose a new train.output_dir")
        return None
    if resume == "auto":
        complete = list_checkpoints(output_dir)
        if not complete:
            partial = _checkpoint_like_entries(output_dir)
            if partial:
                raise CheckpointError(f"train.resume=auto: {output_dir!r} holds checkpoint folders ({', '.join(partial)}) "
                                      f"but none is complete; remove them to start afresh, or choose a new train.output_dir")
            return None
        pointed = _read_latest(output_dir)
        for newest in reversed(complete):  # the newest whose contents are intact
            try:
                verify_checkpoint(newest.path, collective=True)
            except UnsafeCheckpointError:
                raise  # never skipped: someone placed code in the run folder
            except CheckpointError as error:
                logger.warning("skipping %s", error)
                continue
            if pointed is not None and pointed != newest.tag:
                logger.warning("'latest' names %s but the newest intact checkpoint is %s; resuming from %s",
                               pointed, newest.tag, newest.tag)
            return newest.tag
        raise CheckpointError(f"train.resume=auto: no checkpoint in {output_dir!r} is intact (see the warnings above); "
                              f"resume from a copy of the run folder, or choose a new train.output_dir")
    if step_of_tag(resume) is None:
        raise CheckpointError(f"train.resume={resume!r} is not none, auto or a checkpoint tag like global_step300")
    if not os.path.isdir(output_dir):
        raise CheckpointError(f"train.resume={resume!r}: the checkpoint directory train.output_dir={output_dir!r} "
                              f"does not exist")
    path = os.path.join(output_dir, resume)
    if os.path.islink(path):
        raise CheckpointError(f"train.resume={resume!r}: {path!r} is a symbolic link, and checkpoints are never "
                              f"followed out of the run folder; copy the checkpoint in (cp -r) instead")
    if not os.path.isdir(path):
        found = [info.tag for info in list_checkpoints(output_dir, verify=False)]
        raise CheckpointError(f"train.resume={resume!r}: no such checkpoint in {output_dir!r} (found: {found or 'none'})")
    verify_checkpoint(path, collective=True)
    return resume


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _read_latest(output_dir: str) -> str | None:
    """The tag `latest` names (None: none, or not a tag). Never read through a link: a warning quotes it."""
    try:
        fd = os.open(os.path.join(output_dir, LATEST_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            text = handle.read(256).decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    return text if step_of_tag(text) is not None else None




class CheckpointManager:
    """Saves and resumes the checkpoints of one run (every rank builds one and calls every method).

    Args:
        cfg: the `checkpoint` section (keep_last, keep_every_n_steps, reshard_on_resume, ...).
        output_dir: the run folder.
        layout: this run's `parallel.layout.ParallelLayout`.
        zero_stage: this run's ZeRO stage.
        run_fingerprint: `fingerprint(...)` of this run's model, tokenizer and number vocabulary.
        seed: train.seed (re-seeds RNGs when a resume changes the world size).
        data: `data_description(cfg.data)`: a resume refuses another data configuration unless
            `checkpoint.allow_data_change` (None: not checked, not recorded).
        lr_schedule: `lr_schedule_description(ds_config)`: the learning-rate schedule DeepSpeed builds
            (see `resume_lr_schedule`; None: not checked, not recorded).
    """

    def __init__(self, cfg: Any, output_dir: str, layout: Any, zero_stage: int, run_fingerprint: dict,
                 seed: int, data: dict | None = None, lr_schedule: dict | None = None) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.layout = layout
        self.current = SavedLayout(world_size=layout.world_size, dp_size=layout.dp_size, tp_size=layout.tp_size,
                                   zero_stage=zero_stage, sp_size=layout.sp_size)
        self.fingerprint = run_fingerprint
        self.seed = seed
        self.data = data
        self.lr_schedule = lr_schedule
        self.last_save: dict[str, float] = {}
        self.pending: PendingSave | None = None  # the save being written in the background (async_save)
        self.stall_s = 0.0  # seconds the training thread spent in saves (snapshots, waits, commits)
        self.saves = 0  # checkpoints committed by this manager
        self._host_group: Any = False  # the host-memory group of asynchronous saves (False: not made yet)
        self._host_buffers: list = []  # their snapshots' memory, reused from save to save

    # ------------------------------------------------------------------ resume
    def plan_resume(self, tag: str) -> str:
        """Before `deepspeed.initialize`: check the checkpoint and return the tag DeepSpeed will load
        (the tag itself, or its universal form when the layout changed; converted here once)."""
        path = os.path.join(self.output_dir, tag)
        manifest = verify_checkpoint(path, content=False)  # contents: checked by resolve_resume
        check_fingerprint(manifest.get("fingerprint", {}), self.fingerprint, path)
        if self.data is not None:
            check_data(manifest.get("data"), self.data, path, allow_change=self.cfg.allow_data_change,
                       step=int(manifest["step"]))
        if not needs_reshard(manifest, self.current):
            return tag
        saved = saved_layout(manifest)
        if not self.cfg.reshard_on_resume:
            raise CheckpointError(
                f"checkpoint {path!r} was saved with {saved.describe()}; this run has {self.current.describe()}. "
                f"Set checkpoint.reshard_on_resume=true to load it through a universal checkpoint, or launch "
                f"with the saved layout")
        logger.info("checkpoint %s was saved with %s; this run has %s: loading its universal form",
                    tag, saved.describe(), self.current.describe())
        convert_while_others_wait(path, self.layout.is_main)  # outside dist_timeout_minutes: it may take hours
        return tag + UNIVERSAL_SUFFIX

    def resume_lr_schedule(self, tag: str) -> dict | None:
        """The learning-rate schedule a resume from `tag` must build (None: this run's own).

        When the checkpoint's schedule (DeepSpeed's scheduler section and peak lr, e.g. another
        train.max_steps) differs from this run's, `checkpoint.resume_lr_schedule` decides: `error`
        (default) stops with both choices named, `keep` returns the checkpoint's (the run goes on along
        the saved curve, and stays at its final lr past its end), `replan` keeps this run's (the curve is
        recomputed for the new settings at the current step, so the lr jumps). Either is logged with the
        lr of the next step under both.
        """
        manifest = read_manifest(os.path.join(self.output_dir, tag))
        saved, current = manifest.get("lr_schedule"), self.lr_schedule
        if saved is None or current is None or saved == current:
            return None
        step = int(manifest["step"])
        change = (f"checkpoint {tag} was saved with another learning-rate schedule than this run's "
                  f"({describe_changes(saved, current, 'deepspeed')}): lr of step {step + 1} is "
                  f"{lr_text(saved, step)} under the checkpoint's schedule, {lr_text(current, step)} under this run's")
        choice = self.cfg.resume_lr_schedule
        if choice == "error":
            raise CheckpointError(f"{change}. Choose: checkpoint.resume_lr_schedule=keep (continue the saved "
                                  f"schedule to its end, then its final lr) or =replan (this run's schedule at step "
                                  f"{step + 1}), or resume with the saved settings")
        logger.warning("%s; checkpoint.resume_lr_schedule=%s: %s", change, choice,
                       "continuing the checkpoint's schedule" if choice == "keep" else "using this run's schedule")
        if choice == "keep":
            self.lr_schedule = saved  # recorded as such in the next checkpoints
            return saved
        return None

    def load(self, engine: Any, load_tag: str) -> dict:
        """Load a checkpoint (or its universal form) into the engine; returns the client state."""
        path = os.path.join(self.output_dir, load_tag)
        manifest = verify_checkpoint(path, content=False)  # contents: checked by resolve_resume / the conversion
        started = time.perf_counter()
        try:
            with weights_only_loads():
                loaded_path, client_state = engine.load_checkpoint(self.output_dir, tag=load_tag)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(f"checkpoint {path!r} holds pickled Python objects that a weights-only load "
                                        f"refuses ({str(error).splitlines()[0]}); nothing was loaded") from None
        except (OSError, RuntimeError, KeyError, EOFError, ValueError) as error:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {path!r}: {type(error).__name__}: {error}") from None
        if loaded_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint files for this rank in {path!r}")
        same_world = saved_layout(manifest).world_size == self.layout.world_size
        rng_path = os.path.join(path, rng_state_file(self.layout.rank))
        if same_world and os.path.isfile(rng_path):
            set_rng_state(load_rng_state(rng_path))
        else:
            reseed(self.seed, int(manifest["step"]), self.layout.rank)
            logger.info("RNG states re-seeded (the checkpoint's world size differs from this run's)")
        self.last_save["load_s"] = time.perf_counter() - started
        return client_state

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, step: int, client_state: dict, write_hf_files: Callable[[str], None],
             asynchronous: bool = False) -> str:
        """Save a checkpoint of step `step` atomically; prune old ones; returns the tag.

        `write_hf_files(folder)` writes config.json, generation_config.json, the tokenizer and the number
        vocabulary (called on global rank 0). A save still being written in the background is committed
        first. With `asynchronous` this returns once every rank holds a snapshot of its files in host memory:
        a background thread writes and hashes them, and `poll` (at each step boundary) or `finish_pending`
        commits the checkpoint; until then `latest` names the previous one.
        """
        self.finish_pending()  # the previous save first: one checkpoint in flight at a time
        started = time.perf_counter()
        tag = tag_for_step(step)
        staging_tag = tag + STAGING_SUFFIX
        staging = os.path.join(self.output_dir, staging_tag)
        run_on_main(self.layout.is_main, lambda: self._prepare(staging, write_hf_files))

        error = None
        rng_name = rng_state_file(self.layout.rank)
        try:  # each rank's own RNG state, beside DeepSpeed's files
            with atomic_write(os.path.join(staging, rng_name), "wb") as handle:
                torch.save(rng_state(), handle)
        except (OSError, RuntimeError) as exc:  # torch.save: RuntimeError on a short write, OSError from the handle
            error = (f"saving checkpoint {tag}: rank {self.layout.rank} could not write its RNG state: "
                     f"{self._write_failure(exc)}")
        agree(self._with_previous(error))
        try:
            with snapshot_saves(engine, self._host_buffers) if asynchronous else contextlib.nullcontext() as snapshots:
                engine.save_checkpoint(self.output_dir, tag=staging_tag, client_state=client_state, save_latest=False)
        except (OSError, RuntimeError, MemoryError) as exc:  # MemoryError: a snapshot beyond the host's memory
            # Raised at once (not agreed on): the other ranks may be inside DeepSpeed's barrier. The
            # launcher stops them when this process exits; the partial folder is never resumed from.
            raise CheckpointError(self._with_previous(
                f"saving checkpoint {tag} failed on rank {self.layout.rank}: {self._write_failure(exc)}")) from None
        agree(None)  # every rank has written its files (or, asynchronous, taken their snapshots)
        if asynchronous:
            if self._host_group is False:  # made once, at the first asynchronous save (collective)
                self._host_group = host_group()
            hf_files = sorted(HF_DIR + "/" + name for name in file_sizes(os.path.join(staging, HF_DIR))) \
                if self.layout.is_main else []
            snapshot_bytes = snapshots.bytes
            self.pending = PendingSave(tag, step, client_state.get("tokens_seen"), staging, snapshots.files,
                                       [rng_name, *hf_files], self._write_failure, self._host_group)
            self.last_save = {"snapshot_s": time.perf_counter() - started, "snapshot_bytes": float(snapshot_bytes)}
            self.stall_s += self.last_save["snapshot_s"]
            return tag
        written = time.perf_counter() - started
        sizes = broadcast_from_main(self.layout.is_main, lambda: file_sizes(staging))
        try:  # every rank hashes a share of the files (read back from the page cache, mostly)
            digests = hash_files(staging, sorted(sizes), sizes, collective=True)
        except CheckpointError as exc:  # agreed by all ranks (or this one alone): raised as such
            raise type(exc)(self._with_previous(f"saving checkpoint {tag}: {exc}")) from None
        hashed = time.perf_counter() - started - written
        self._commit_agreed(tag, step, client_state.get("tokens_seen"), digests)
        self.last_save = {"save_s": time.perf_counter() - started, "write_s": written, "hash_s": hashed,
                          "bytes": float(sum(sizes.values()))}
        self.stall_s += self.last_save["save_s"]
        self.saves += 1
        return tag

    def poll(self) -> str | None:
        """At a step boundary (every rank, every step): commit the save being written in the background once every
        rank has written and hashed its files; returns its tag then, else None. Costs nothing when no save is in
        flight, one host-memory all-reduce of one integer while one is."""
        if self.pending is None:
            return None
        started = time.perf_counter()
        done = self.pending.all_written()
        self.stall_s += time.perf_counter() - started
        return self.finish_pending() if done else None

    def finish_pending(self) -> str | None:
        """Wait for the save being written in the background and commit it (every rank, at the same point); its
        tag, or None when none is in flight. A write that failed on any rank raises its one-line error on every
        rank; the previous checkpoint and `latest` are then as they were."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        started = time.perf_counter()
        waited = pending.wait()
        failure = None if pending.error is None else (
            f"saving checkpoint {pending.tag} (written in the background) failed on rank {self.layout.rank}: "
            f"{pending.error}")
        agree(self._with_previous(failure))
        digests = gather(pending.digests, collective=True)
        self._commit_agreed(pending.tag, pending.step, pending.tokens_seen, digests)
        self.stall_s += time.perf_counter() - started
        self.saves += 1
        self.last_save = {"save_s": time.perf_counter() - pending.started, "write_s": pending.write_s,
                          "hash_s": pending.hash_s, "waited_s": waited, "rank_bytes": float(pending.bytes)}
        return pending.tag

    def abandon_pending(self) -> str | None:
        """After the run failed (no collective may run): let this rank's background writer finish, without
        committing its checkpoint (the next start removes the `.partial` folder). Returns its tag, or None."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.wait()
        return pending.tag

    def _commit_agreed(self, tag: str, step: int, tokens_seen: Any, digests: dict[str, str]) -> None:
        """The manifest of a staged save whose files every rank has written and hashed; committed by global rank 0."""
        permanent = self.cfg.keep_every_n_steps > 0 and step % self.cfg.keep_every_n_steps == 0
        manifest = {
            "format": FORMAT_VERSION, "tag": tag, "step": step, "tokens_seen": tokens_seen,
            "layout": dataclasses.asdict(self.current), "fingerprint": self.fingerprint, "permanent": permanent,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "data": self.data, "lr_schedule": self.lr_schedule, **hash_record(digests),
        }
        staging, final = os.path.join(self.output_dir, tag + STAGING_SUFFIX), os.path.join(self.output_dir, tag)
        run_on_main(self.layout.is_main, lambda: self._commit(staging, final, tag, manifest))

    def _write_failure(self, exc: BaseException) -> str:
        """What a failed write of checkpoint files says: a full disk as such, with the space left (torch's
        writer reports one only as a short write, "unexpected pos")."""
        detail = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        try:
            free = shutil.disk_usage(self.output_dir).free
        except OSError:
            return detail
        if is_full_disk(exc, free):
            return f"no space left on {self.output_dir!r} ({_gib(free)} free)"
        if is_short_write(exc):
            return (f"a write was cut short ({detail}) with {_gib(free)} free on {self.output_dir!r}: a disk quota "
                    f"or a file-size limit (ulimit -f)?")
        return detail

    def _with_previous(self, error: str | None) -> str | None:
        if error is None:
            return None
        previous = list_checkpoints(self.output_dir, verify=False)
        keep = f"the previous checkpoint {previous[-1].tag} is intact" if previous else "no previous checkpoint exists"
        return f"{error}; {keep} (resume with train.resume=auto); free disk space or fix permissions of {self.output_dir!r}"

    def _prepare(self, staging: str, write_hf_files: Callable[[str], None]) -> None:
        if not os.path.isdir(self.output_dir):  # made with the run lock at start: never recreated without it
            raise CheckpointError(f"cannot save a checkpoint: train.output_dir={self.output_dir!r} was deleted or moved "
                                  f"while this run was training (its checkpoints and run lock with it); nothing was "
                                  f"saved. Put the folder back and resume with train.resume=auto, or start afresh")
        if not os.access(self.output_dir, os.W_OK):
            raise CheckpointError(self._with_previous(f"cannot save a checkpoint: {self.output_dir!r} is not writable"))
        remove_interrupted_saves(self.output_dir)  # never complete, never used
        previous = list_checkpoints(self.output_dir, verify=False)
        if previous:
            needed = folder_bytes(previous[-1].path)
            free = shutil.disk_usage(self.output_dir).free
            if free < needed:
                raise CheckpointError(self._with_previous(
                    f"cannot save a checkpoint: {self.output_dir!r} has {free / 2**30:.2f} GiB free, the last "
                    f"checkpoint took {needed / 2**30:.2f} GiB"))
        try:
            make_staging(staging)
            write_hf_files(os.path.join(staging, HF_DIR))
        except OSError as exc:
            raise CheckpointError(self._with_previous(
                f"cannot save a checkpoint into {staging!r}: {self._write_failure(exc)}")) from None

    def _commit(self, staging: str, final: str, tag: str, manifest: dict) -> None:
        try:
            manifest["files"] = file_sizes(staging)
            manifest["bytes"] = sum(manifest["files"].values())
            if sorted(manifest["files"]) != sorted(manifest["hashes"]):
                raise CheckpointError(self._with_previous(
                    f"saving checkpoint {tag}: files in {staging!r} changed while it was being saved (another "
                    f"process writing into train.output_dir?)"))
            write_text_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(manifest, indent=1))
            replaced = None
            if os.path.lexists(final):  # the same step saved again (a resume from an older checkpoint)
                replaced = final + REPLACED_SUFFIX
                os.rename(final, replaced)
                if not os.path.islink(replaced):  # ours again: the start-up cleanup restores or removes it
                    mark_staging(replaced)
            commit_directory(staging, final)
            # committed: no longer "an interrupted save of ours" (killed before this line, the marker stays
            # in a folder no clean-up pattern matches, and the manifest does not list it)
            with contextlib.suppress(OSError):  # left there, it is harmless: allowed unlisted, and never a leftover
                os.remove(os.path.join(final, STAGING_MARKER))
            write_text_atomic(os.path.join(self.output_dir, LATEST_NAME), tag)
            if replaced and os.path.islink(replaced):  # a link the user had named global_stepN: never followed
                logger.warning("left %s (a symbolic link that stood where %s was saved) alone", replaced, final)
            elif replaced:
                remove_staging(replaced)
                stale = universal_path(final)
                if os.path.isdir(stale) and not os.path.islink(stale):
                    shutil.rmtree(stale, ignore_errors=True)
        except OSError as exc:
            raise CheckpointError(self._with_previous(
                f"saving checkpoint {tag} failed while committing it: {self._write_failure(exc)}")) from None
        except OutputPathError:  # `latest` made a fifo, device or folder while the run trained: never replaced
            latest = os.path.join(self.output_dir, LATEST_NAME)
            raise CheckpointError(f"checkpoint {tag} is saved, but {latest!r} is not a regular file, so it was left as "
                                  f"it is and does not name {tag}: remove it (the next save writes it), or resume "
                                  f"with train.resume={tag}") from None
        self.prune()

    def prune(self) -> list[str]:
        """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all), except permanent ones."""
        keep_last = self.cfg.keep_last
        if keep_last <= 0:
            return []
        complete = list_checkpoints(self.output_dir, verify=False)
        removed = []
        for info in complete[:-keep_last]:
            if info.permanent:
                continue
            shutil.rmtree(info.path)
            universal = universal_path(info.path)
            if os.path.islink(universal):
                logger.warning("keep-last-K left %s alone: it is a symbolic link, never followed", universal)
            elif os.path.isdir(universal):
                shutil.rmtree(universal)
            removed.append(info.tag)
        if removed:
            logger.info("removed old checkpoints %s (checkpoint.keep_last=%d)", ", ".join(removed), keep_last)
        return removed
