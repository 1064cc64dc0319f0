"""Checkpoints: DeepSpeed's tensor-sharded save/load made safe for long runs on clusters that pre-empt.

Layout of a run folder (`train.output_dir`):

    global_step300/              one DeepSpeed checkpoint (one file set per ZeRO partition and TP rank)
      zero_pp_rank_*_mp_rank_*_{model,optim}_states.pt
      rng_state_<rank>.pt        python / numpy / torch (/ accelerator) RNG of each global rank
      hf/                        config.json, generation_config.json, tokenizer, number_vocab.json (export)
      ntl_checkpoint.json        the manifest: written last, so a folder without it is incomplete
      KEEP                       (optional, made by hand) never deleted by keep-last-K
    global_step300_universal/    DeepSpeed universal form of it (resharding), made on demand
    latest                       the newest complete tag (DeepSpeed's pointer file, replaced atomically)

Atomicity: every rank writes into `global_stepN.partial`; when all ranks have finished, global rank 0
lists the files with their sizes into the manifest, renames the folder to `global_stepN` (an atomic
rename) and then replaces `latest`. A save killed at any point leaves at most a `.partial` folder,
which no resume picks; the next save removes it. A resume checks the manifest (every file present
with its recorded size, so a truncated shard is caught before DeepSpeed reads it), the fingerprint
(model config, tokenizer, number vocabulary) and the layout (dp, tp, ZeRO stage); a different layout
is loaded through a universal checkpoint (`deepspeed.checkpoint.ds_to_universal`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

logger = logging.getLogger("ntl_pretrain")

MANIFEST_NAME = "ntl_checkpoint.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file to the newest tag
TAG_PREFIX = "global_step"
STAGING_SUFFIX = ".partial"
UNIVERSAL_SUFFIX = "_universal"
REPLACED_SUFFIX = ".replaced"
KEEP_MARKER = "KEEP"
HF_DIR = "hf"
FORMAT_VERSION = 1
_TAG_RE = re.compile(r"^global_step(\d+)$")
# HF config keys that do not change what the weights mean (so they stay out of the fingerprint)
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "_commit_hash",
    "output_attentions", "output_hidden_states", "return_dict", "_experts_implementation",
})


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or resumed; the message names the folder, the reason and the fix."""


# ---------------------------------------------------------------------------------------------- tags and manifests
def tag_for_step(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of_tag(name: str) -> int | None:
    """The step of a checkpoint folder name `global_stepN`; None for anything else (staging, universal)."""
    match = _TAG_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint in a run folder."""

    tag: str  # folder name, global_stepN
    path: str  # full path of the folder
    step: int  # optimizer steps done when it was saved
    manifest: dict  # the parsed ntl_checkpoint.json

    @property
    def permanent(self) -> bool:
        """Kept by keep-last-K: marked at save (checkpoint.keep_every_n_steps) or by a KEEP file."""
        return bool(self.manifest.get("permanent")) or os.path.exists(os.path.join(self.path, KEEP_MARKER))


def read_manifest(path: str) -> dict:
    """The manifest of a checkpoint folder; CheckpointError if the folder is missing, unreadable or incomplete."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"checkpoint folder {path!r} is not readable (permissions); fix them with chmod")
    manifest_path = os.path.join(path, MANIFEST_NAME)
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: it has no {MANIFEST_NAME} (its save was "
                              f"interrupted, or it was not written by ntl_pretrain); resume from another one") from None
    except PermissionError as error:
        raise CheckpointError(f"checkpoint {path!r} is not readable: {error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {path!r} has a damaged {MANIFEST_NAME}: {error}") from None
    if not isinstance(manifest, dict) or "files" not in manifest or "step" not in manifest:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST_NAME} lacks 'files' or 'step'")
    return manifest


def verify_checkpoint(path: str) -> dict:
    """Check that every file the manifest lists is present with its recorded size; return the manifest.

    Catches a truncated or missing shard before DeepSpeed reads it (which would fail deep inside
    torch.load, or on one rank only).
    """
    manifest = read_manifest(path)
    for name, size in manifest["files"].items():
        file_path = os.path.join(path, name)
        try:
            actual = os.path.getsize(file_path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} is missing; resume from another "
                                  f"checkpoint (train.resume=TAG)") from None
        except OSError as error:
            raise CheckpointError(f"checkpoint {path!r}: cannot read {name}: {error}") from None
        if actual != size:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} has {actual} bytes, {size} were written "
                                  f"(a truncated shard); resume from another checkpoint (train.resume=TAG)")
    return manifest


def list_checkpoints(output_dir: str, verify: bool = True) -> list[CheckpointInfo]:
    """The complete checkpoints of a run folder, oldest first (incomplete or damaged ones are skipped)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = step_of_tag(name)
        path = os.path.join(output_dir, name)
        if step is None or not os.path.isdir(path):
            continue
        try:
            manifest = verify_checkpoint(path) if verify else read_manifest(path)
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
        resume: "none" (refuse a folder with checkpoints), "auto" (the newest complete checkpoint, or a
            fresh start if there is none) or a tag (`global_step300`).
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
        newest = complete[-1]
        pointed = _read_latest(output_dir)
        if pointed is not None and pointed != newest.tag:
            logger.warning("'latest' names %s but the newest complete checkpoint is %s; resuming from %s",
                           pointed, newest.tag, newest.tag)
        return newest.tag
    if step_of_tag(resume) is None:
        raise CheckpointError(f"train.resume={resume!r} is not none, auto or a checkpoint tag like global_step300")
    if not os.path.isdir(output_dir):
        raise CheckpointError(f"train.resume={resume!r}: the checkpoint directory train.output_dir={output_dir!r} "
                              f"does not exist")
    path = os.path.join(output_dir, resume)
    if not os.path.isdir(path):
        found = [info.tag for info in list_checkpoints(output_dir, verify=False)]
        raise CheckpointError(f"train.resume={resume!r}: no such checkpoint in {output_dir!r} (found: {found or 'none'})")
    verify_checkpoint(path)
    return resume


def _read_latest(output_dir: str) -> str | None:
    try:
        with open(os.path.join(output_dir, LATEST_NAME), encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def folder_bytes(path: str) -> int:
    """Bytes of all files under a folder."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


# ---------------------------------------------------------------------------------------------- fingerprint
def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_fingerprint(model_config: Any) -> str:
    """Hash of a transformers config without the keys that do not change what the weights mean."""
    config = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    return _sha({k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS})


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Hash of how a tokenizer maps text to ids (vocabulary, merges, normalizer, pre-tokenizer, specials)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)  # runtime settings, not the mapping
        spec.pop("padding", None)
        return _sha(spec)
    return _sha(sorted(tokenizer.get_vocab().items()))


def fingerprint(model_config: Any, tokenizer: Any, number_vocab: Any) -> dict[str, Any]:
    """What a resume must find unchanged: the model's config, the tokenizer, the NTL number vocabulary."""
    return {
        "model": model_fingerprint(model_config),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "number_vocab": _sha({"ids": list(number_vocab.token_ids), "values": list(number_vocab.values)}),
        "model_type": getattr(model_config, "model_type", None),
        "vocab_size": getattr(model_config, "vocab_size", None),
        "tokenizer_size": len(tokenizer),
    }


def check_fingerprint(saved: dict, current: dict, where: str) -> None:
    """Raise naming the first difference between a checkpoint's fingerprint and this run's."""
    fixes = {
        "model": "model (architecture or vocabulary size)",
        "tokenizer": "tokenizer (vocabulary or how it splits text)",
        "number_vocab": "NTL number vocabulary (tokenizer.digit_level or the tokenizer)",
    }
    for key, what in fixes.items():
        if key in saved and saved[key] != current[key]:
            detail = ""
            if key == "model":
                detail = (f" (saved: {saved.get('model_type')}, vocabulary {saved.get('vocab_size')}; this run: "
                          f"{current.get('model_type')}, vocabulary {current.get('vocab_size')})")
            elif key == "tokenizer":
                detail = f" (saved: {saved.get('tokenizer_size')} tokens; this run: {current.get('tokenizer_size')})"
            raise CheckpointError(
                f"checkpoint {where} was saved with a different {what} than this run{detail}; fingerprint "
                f"{saved[key]} != {current[key]}. Resume with the model and tokenizer it was trained with, or "
                f"export it (tools/export_hf.py) and start a new run from the export in another train.output_dir")


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This process's random number generator states (python, numpy, torch CPU, accelerator)."""
    from deepspeed.accelerator import get_accelerator

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    accelerator = get_accelerator()
    if "accelerator" in state and accelerator.device_name() != "cpu":
        accelerator.set_rng_state(state["accelerator"])


def reseed(seed: int, step: int, rank: int) -> None:
    """RNG states for a resume whose world differs from the saved one (each rank's own, reproducible)."""
    value = (seed * 1_000_003 + step * 7919 + rank) % 2**31
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


# ---------------------------------------------------------------------------------------------- collectives
def _agree(error: str | None) -> None:
    """Every rank calls this; an error on any rank is raised on all (nobody waits on a dead rank)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if error:
            raise CheckpointError(error)
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)
    first = next((m for m in messages if m), None)
    if first:
        raise CheckpointError(first)


def run_on_main(is_main: bool, fn: Callable[[], Any]) -> Any:
    """Run `fn` on global rank 0 while the others wait; its error is raised on every rank."""
    result, error = None, None
    if is_main:
        try:
            result = fn()
        except (OSError, ValueError, RuntimeError) as exc:
            error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    _agree(error)
    return result


# ---------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class SavedLayout:
    """How the processes of a run were laid out when it saved (resharding compares this)."""

    world_size: int  # all processes
    dp_size: int  # data-parallel size
    tp_size: int  # tensor-parallel (AutoTP) size
    zero_stage: int  # ZeRO stage

    def describe(self) -> str:
        return f"world {self.world_size} = dp {self.dp_size} x tp {self.tp_size}, ZeRO-{self.zero_stage}"


def saved_layout(manifest: dict) -> SavedLayout:
    return SavedLayout(**manifest["layout"])


def needs_reshard(manifest: dict, current: SavedLayout) -> bool:
    """Whether a checkpoint must go through the universal form to load with the current layout."""
    saved = saved_layout(manifest)
    return (saved.dp_size, saved.tp_size, saved.zero_stage) != (current.dp_size, current.tp_size, current.zero_stage)


# ---------------------------------------------------------------------------------------------- universal
def universal_path(checkpoint_path: str) -> str:
    return checkpoint_path.rstrip("/") + UNIVERSAL_SUFFIX


def convert_to_universal(checkpoint_path: str, output_path: str | None = None, workers: int = 1) -> str:
    """Convert a (complete) DeepSpeed checkpoint to DeepSpeed's universal form, once; returns its path.

    The conversion (`deepspeed.checkpoint.ds_to_universal`) writes full, unsharded fp32 weights and
    optimizer states per parameter, which any data- and tensor-parallel size can load. It is written
    to a staging folder and renamed, so an interrupted conversion is redone rather than used.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    manifest = verify_checkpoint(checkpoint_path)
    output_path = output_path or universal_path(checkpoint_path)
    if os.path.isfile(os.path.join(output_path, MANIFEST_NAME)):
        return output_path
    if os.path.exists(output_path):
        raise CheckpointError(f"{output_path!r} exists but is not a finished universal checkpoint; remove it and "
                              f"run the conversion again")
    staging = output_path + STAGING_SUFFIX
    if os.path.exists(staging):
        shutil.rmtree(staging)
    if manifest["layout"]["zero_stage"] == 0:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0, which DeepSpeed's universal "
                              f"checkpoints do not cover; resume it with the layout it was saved with "
                              f"({saved_layout(manifest).describe()})")
    args = argparse.Namespace(input_folder=checkpoint_path, output_folder=staging, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=False)
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its progress prints would interleave with the run's log
            ds_to_universal(args)
    except (OSError, RuntimeError, ValueError, KeyError, AssertionError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"converting {checkpoint_path!r} to a universal checkpoint failed ({type(error).__name__}: "
                              f"{error}); the checkpoint itself is unchanged. Free disk space, or resume with the "
                              f"layout it was saved with ({saved_layout(manifest).describe()})") from None
    # carry our own files (RNG, HF assets) and write a manifest of the universal folder
    for name in os.listdir(checkpoint_path):
        source = os.path.join(checkpoint_path, name)
        if name.startswith("rng_state_"):
            shutil.copy2(source, os.path.join(staging, name))
        elif name == HF_DIR:
            shutil.copytree(source, os.path.join(staging, name))
    universal_manifest = dict(manifest, universal_of=os.path.basename(checkpoint_path.rstrip("/")),
                              files=_file_sizes(staging))
    _write_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(universal_manifest, indent=1))
    os.rename(staging, output_path)
    pointer = os.path.join(os.path.dirname(output_path), "latest_universal")  # ds_to_universal's, naming the staging folder
    if os.path.isfile(pointer):
        _write_atomic(pointer, os.path.basename(output_path))
    logger.info("converted %s to a universal checkpoint %s in %.1f s", checkpoint_path, output_path,
                time.perf_counter() - started)
    return output_path


def _file_sizes(path: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == MANIFEST_NAME and root == path:
                continue
            full = os.path.join(root, name)
            sizes[os.path.relpath(full, path)] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


# ---------------------------------------------------------------------------------------------- pre-emption
class PreemptionHandler:
    """SIGTERM / SIGUSR1 (configurable) on any rank -> every rank saves at the next step boundary and exits 0.

    The handler only records the signal; `requested()` (called by every rank at every step boundary)
    agrees on it over the whole world with one small all-reduce. A watchdog started at the first
    signal ends the process if it has not finished within the grace time, so a pre-empted job never
    outlives what the cluster allows (the previous checkpoint then stays the resume point).

    Args:
        signals: signal names, e.g. ["SIGTERM", "SIGUSR1"].
        grace_s: seconds from the signal to the exit.
    """

    def __init__(self, signals: list[str], grace_s: float) -> None:
        self.signals = []
        for name in signals:
            number = getattr(signal, name, None)
            if not isinstance(number, signal.Signals):
                raise CheckpointError(f"checkpoint.preempt_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
            self.signals.append(number)
        self.grace_s = grace_s
        self.received: int = 0  # the signal number this process got (0: none)
        self._watchdog: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog.join(timeout=5)

    def _on_signal(self, number: int, frame: Any) -> None:
        if not self.received:
            self.received = int(number)
            self._watchdog = threading.Timer(self.grace_s, self._grace_exceeded)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _grace_exceeded(self) -> None:
        logger.error("pre-emption: no checkpoint within checkpoint.preempt_grace_s=%s s of %s; exiting without it "
                     "(the previous complete checkpoint stays the resume point)", self.grace_s,
                     signal.Signals(self.received).name)
        os._exit(1)

    def requested(self, device: torch.device) -> str | None:
        """The name of the signal any rank received, or None; every rank calls this at the same point."""
        import torch.distributed as dist

        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        number = int(flag.item())
        return signal.Signals(number).name if number else None


# ---------------------------------------------------------------------------------------------- TensorBoard
def purge_tensorboard_after(tensorboard_dir: str, step: int) -> None:
    """Hide TensorBoard points after `step` that a run killed after its last checkpoint had written.

    A resumed run writes those steps again; TensorBoard's "purge_step" session marker (written here,
    before the new run's event file) makes readers drop the older points with step > `step`.
    """
    from torch.utils.tensorboard import SummaryWriter

    if not os.path.isdir(tensorboard_dir):
        return
    writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=step + 1)
    writer.close()


# ---------------------------------------------------------------------------------------------- the manager
class CheckpointManager:
    """Saves and resumes the checkpoints of one run (every rank builds one and calls every method).

    Args:
        cfg: the `checkpoint` section (keep_last, keep_every_n_steps, reshard_on_resume, ...).
        output_dir: the run folder.
        layout: this run's `distributed.ParallelLayout`.
        zero_stage: this run's ZeRO stage.
        run_fingerprint: `fingerprint(...)` of this run's model, tokenizer and number vocabulary.
        seed: train.seed (re-seeds RNGs when a resume changes the world size).
    """

    def __init__(self, cfg: Any, output_dir: str, layout: Any, zero_stage: int, run_fingerprint: dict,
                 seed: int) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.layout = layout
        self.current = SavedLayout(world_size=layout.world_size, dp_size=layout.dp_size, tp_size=layout.tp_size,
                                   zero_stage=zero_stage)
        self.fingerprint = run_fingerprint
        self.seed = seed
        self.last_save: dict[str, float] = {}

    # ------------------------------------------------------------------ resume
    def plan_resume(self, tag: str) -> str:
        """Before `deepspeed.initialize`: check the checkpoint and return the tag DeepSpeed will load
        (the tag itself, or its universal form when the layout changed; converted here once)."""
        path = os.path.join(self.output_dir, tag)
        manifest = verify_checkpoint(path)
        check_fingerprint(manifest.get("fingerprint", {}), self.fingerprint, path)
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
        run_on_main(self.layout.is_main, lambda: convert_to_universal(path))
        return tag + UNIVERSAL_SUFFIX

    def load(self, engine: Any, load_tag: str) -> dict:
        """Load a checkpoint (or its universal form) into the engine; returns the client state."""
        path = os.path.join(self.output_dir, load_tag)
        manifest = verify_checkpoint(path)
        started = time.perf_counter()
        try:
            loaded_path, client_state = engine.load_checkpoint(self.output_dir, tag=load_tag)
        except (OSError, RuntimeError, KeyError, EOFError, ValueError) as error:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {path!r}: {type(error).__name__}: {error}") from None
        if loaded_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint files for this rank in {path!r}")
        same_world = saved_layout(manifest).world_size == self.layout.world_size
        rng_path = os.path.join(path, f"rng_state_{self.layout.rank}.pt")
        if same_world and os.path.isfile(rng_path):
            set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=False))
        else:
            reseed(self.seed, int(manifest["step"]), self.layout.rank)
            logger.info("RNG states re-seeded (the checkpoint's world size differs from this run's)")
        self.last_save["load_s"] = time.perf_counter() - started
        return client_state

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, step: int, client_state: dict, write_hf_files: Callable[[str], None]) -> str:
        """Save a checkpoint of step `step` atomically; prune old ones; returns the tag.

        `write_hf_files(folder)` writes config.json, generation_config.json, the tokenizer and the number
        vocabulary (called on global rank 0).
        """
        tag = tag_for_step(step)
        final = os.path.join(self.output_dir, tag)
        staging_tag = tag + STAGING_SUFFIX
        staging = os.path.join(self.output_dir, staging_tag)
        started = time.perf_counter()
        run_on_main(self.layout.is_main, lambda: self._prepare(staging, write_hf_files))

        error = None
        try:  # each rank's own RNG state, beside DeepSpeed's files
            _save_torch_atomic(rng_state(), os.path.join(staging, f"rng_state_{self.layout.rank}.pt"))
        except OSError as exc:
            error = f"saving checkpoint {tag}: rank {self.layout.rank} could not write its RNG state: {exc}"
        _agree(self._with_previous(error))
        try:
            engine.save_checkpoint(self.output_dir, tag=staging_tag, client_state=client_state, save_latest=False)
        except (OSError, RuntimeError) as exc:
            # Raised at once (not agreed on): the other ranks may be inside DeepSpeed's barrier. The
            # launcher stops them when this process exits; the partial folder is never resumed from.
            raise CheckpointError(self._with_previous(
                f"saving checkpoint {tag} failed on rank {self.layout.rank}: {type(exc).__name__}: {exc}")) from None
        _agree(None)  # every rank has written its files
        written = time.perf_counter() - started
        permanent = self.cfg.keep_every_n_steps > 0 and step % self.cfg.keep_every_n_steps == 0
        manifest = {
            "format": FORMAT_VERSION, "tag": tag, "step": step, "tokens_seen": client_state.get("tokens_seen"),
            "layout": dataclasses.asdict(self.current), "fingerprint": self.fingerprint, "permanent": permanent,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        run_on_main(self.layout.is_main, lambda: self._commit(staging, final, tag, manifest))
        self.last_save = {"save_s": time.perf_counter() - started, "write_s": written}
        return tag

    def _with_previous(self, error: str | None) -> str | None:
        if error is None:
            return None
        previous = list_checkpoints(self.output_dir, verify=False)
        keep = f"the previous checkpoint {previous[-1].tag} is intact" if previous else "no previous checkpoint exists"
        return f"{error}; {keep} (resume with train.resume=auto); free disk space or fix permissions of {self.output_dir!r}"

    def _prepare(self, staging: str, write_hf_files: Callable[[str], None]) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        if not os.access(self.output_dir, os.W_OK):
            raise CheckpointError(self._with_previous(f"cannot save a checkpoint: {self.output_dir!r} is not writable"))
        for name in os.listdir(self.output_dir):  # folders of interrupted saves: never complete, never used
            if name.endswith(STAGING_SUFFIX) or name.endswith(REPLACED_SUFFIX):
                shutil.rmtree(os.path.join(self.output_dir, name), ignore_errors=True)
        previous = list_checkpoints(self.output_dir, verify=False)
        if previous:
            needed = folder_bytes(previous[-1].path)
            free = shutil.disk_usage(self.output_dir).free
            if free < needed:
                raise CheckpointError(self._with_previous(
                    f"cannot save a checkpoint: {self.output_dir!r} has {free / 2**30:.2f} GiB free, the last "
                    f"checkpoint took {needed / 2**30:.2f} GiB"))
        try:
            os.makedirs(staging)
            write_hf_files(os.path.join(staging, HF_DIR))
        except OSError as exc:
            raise CheckpointError(self._with_previous(f"cannot save a checkpoint into {staging!r}: {exc}")) from None

    def _commit(self, staging: str, final: str, tag: str, manifest: dict) -> None:
        try:
            manifest["files"] = _file_sizes(staging)
            manifest["bytes"] = sum(manifest["files"].values())
            _write_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(manifest, indent=1))
            _fsync_dir(staging)
            replaced = None
            if os.path.exists(final):  # the same step saved again (a resume from an older checkpoint)
                replaced = final + REPLACED_SUFFIX
                os.rename(final, replaced)
            os.rename(staging, final)
            _fsync_dir(self.output_dir)
            _write_atomic(os.path.join(self.output_dir, LATEST_NAME), tag)
            if replaced:
                shutil.rmtree(replaced, ignore_errors=True)
                stale = universal_path(final)
                if os.path.isdir(stale):
                    shutil.rmtree(stale, ignore_errors=True)
        except OSError as exc:
            raise CheckpointError(self._with_previous(f"saving checkpoint {tag} failed while committing it: {exc}")) from None
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
            if os.path.isdir(universal_path(info.path)):
                shutil.rmtree(universal_path(info.path))
            removed.append(info.tag)
        if removed:
            logger.info("removed old checkpoints %s (checkpoint.keep_last=%d)", ", ".join(removed), keep_last)
        return removed


def _save_torch_atomic(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- Hugging Face export
def write_hf_assets(folder: str, model_config: Any, tokenizer: Any, number_vocab: Any) -> None:
    """What an export needs besides the weights: config.json, generation_config.json, the tokenizer and the
    NTL number vocabulary (a few files, saved into every checkpoint so that it exports on its own)."""
    from transformers import GenerationConfig

    os.makedirs(folder, exist_ok=True)
    model_config.save_pretrained(folder)
    GenerationConfig.from_model_config(model_config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    number_vocab.save(folder)


def _full_weights(checkpoint_path: str, manifest: dict, scratch: str) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights of a checkpoint: from its universal form (made in `scratch` if needed)."""
    layout = manifest["layout"]
    if layout["zero_stage"] == 0:
        if layout["tp_size"] != 1:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0 and tp_size "
                                  f"{layout['tp_size']}; export covers ZeRO 1-3 with any tp_size and ZeRO 0 with tp_size 1")
        state = torch.load(os.path.join(checkpoint_path, "mp_rank_00_model_states.pt"), map_location="cpu",
                           weights_only=False)
        return {name: tensor.float() for name, tensor in state["module"].items()}
    if manifest.get("universal_of"):
        universal = checkpoint_path
    elif os.path.isfile(os.path.join(universal_path(checkpoint_path), MANIFEST_NAME)):
        universal = universal_path(checkpoint_path)
    else:
        universal = convert_to_universal(checkpoint_path, os.path.join(scratch, "universal"))
    zero = os.path.join(universal, "zero")
    weights = {}
    for name in sorted(os.listdir(zero)):
        fp32 = os.path.join(zero, name, "fp32.pt")
        if os.path.isfile(fp32):
            weights[name] = torch.load(fp32, map_location="cpu", weights_only=False)["param"]
    return weights


def export_hf(checkpoint_path: str, out_dir: str, *, dtype: str | None = None, max_shard_size: str | int = "5GB") -> dict:
    """Export a checkpoint folder (any ZeRO stage 1-3, any TP size; CPU only) as a Hugging Face model folder.

    Writes safetensors weights sharded by `max_shard_size` (with `model.safetensors.index.json` when there
    are several shards), config.json, generation_config.json, the tokenizer and number_vocab.json, all
    into `out_dir` (which must not exist or be empty; written under a staging name and renamed).

    Args:
        checkpoint_path: `RUN/global_stepN` (or its universal form).
        out_dir: the new Hugging Face folder.
        dtype: bf16 | fp16 | fp32; default: the training dtype recorded in the checkpoint's config.json.
        max_shard_size: largest shard, e.g. "5GB" or a number of bytes.
    Returns:
        {"seconds", "bytes", "parameters", "files"} of the export.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    manifest = verify_checkpoint(checkpoint_path)
    assets = os.path.join(checkpoint_path, HF_DIR)
    if not os.path.isfile(os.path.join(assets, "config.json")):
        raise CheckpointError(f"checkpoint {checkpoint_path!r} has no {HF_DIR}/config.json to export with")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise CheckpointError(f"export folder {out_dir!r} already exists and is not empty; choose another one "
                              f"(nothing was overwritten)")
    config = AutoConfig.from_pretrained(assets)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype is not None and dtype not in dtypes:
        raise CheckpointError(f"dtype={dtype!r} is not one of {', '.join(dtypes)}")
    saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    target = dtypes[dtype] if dtype else (saved_dtype if isinstance(saved_dtype, torch.dtype) else
                                          getattr(torch, str(saved_dtype or "float32").replace("torch.", "")))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.abspath(out_dir).rstrip("/") + STAGING_SUFFIX
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    scratch = staging + ".scratch"
    try:
        weights = _full_weights(checkpoint_path, manifest, scratch)
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config)
        expected = reference.state_dict()
        tied = set(getattr(reference, "_tied_weights_keys", None) or [])
        if isinstance(getattr(reference, "_tied_weights_keys", None), dict):
            tied = set(reference._tied_weights_keys)
        if getattr(config, "tie_word_embeddings", False):
            tied |= {"lm_head.weight"}
        missing = sorted(set(expected) - set(weights) - tied)
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} lacks weights the model needs: {missing[:5]}")
        state = {}
        for name, tensor in weights.items():
            if name not in expected:
                continue
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise CheckpointError(f"checkpoint {checkpoint_path!r}: {name} has shape {tuple(tensor.shape)}, the "
                                      f"model expects {tuple(expected[name].shape)}")
            state[name] = tensor.to(target).contiguous()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_torch_state_dict(state, staging, max_shard_size=max_shard_size, metadata={"format": "pt"})
        config.dtype = target
        config.architectures = [type(reference).__name__]
        config.save_pretrained(staging)
        for name in os.listdir(assets):
            if name != "config.json":
                shutil.copy2(os.path.join(assets, name), os.path.join(staging, name))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.rename(staging, out_dir)
    return {"seconds": time.perf_counter() - started, "bytes": folder_bytes(out_dir),
            "parameters": sum(t.numel() for t in state.values()), "files": sorted(os.listdir(out_dir))}
