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

Atomicity: every rank writes into `global_stepN.partial` (marked as ours by a `.ntl_staging` file);
when all ranks have finished, the ranks hash the files (sha256, each rank a share), global rank 0
lists them with their sizes and hashes in the manifest, renames the folder to `global_stepN` (an atomic
rename) and then replaces `latest`. A save killed at any point leaves at most a `.partial` folder,
which no resume picks; the next save removes it (only folders carrying the marker). A resume checks
the manifest (every file present with its recorded size and content hash, so a truncated or corrupted
shard is caught before DeepSpeed reads it), the fingerprint (model config, tokenizer, number
vocabulary, data configuration), the learning-rate schedule and the layout (dp, tp, ZeRO stage); a
different layout is loaded through a universal checkpoint (`deepspeed.checkpoint.ds_to_universal`).

Every load of a checkpoint file (ours, DeepSpeed's engine and its universal conversion) unpickles with
`torch.load(weights_only=True)` and an allow-list of the few DeepSpeed classes its files hold
(`weights_only_loads`), so a crafted pickle cannot run code; docs/checkpoints.md says what trusting a
checkpoint folder still means.
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
import math
import os
import pickle
import random
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .fs import apply_umask_modes, fsync_dir, write_text_atomic

logger = logging.getLogger("ntl_pretrain")

MANIFEST_NAME = "ntl_checkpoint.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file to the newest tag
TAG_PREFIX = "global_step"
STAGING_SUFFIX = ".partial"
UNIVERSAL_SUFFIX = "_universal"
REPLACED_SUFFIX = ".replaced"
KEEP_MARKER = "KEEP"
HF_DIR = "hf"
STAGING_MARKER = ".ntl_staging"  # inside every folder this module creates under a temporary name
HASH_ALGORITHM = "sha256"  # content hash of every file, recorded in the manifest (format 2)
FORMAT_VERSION = 2  # 1: sizes only; 2: sizes + sha256 per file, plain-tensor RNG state, data and LR fingerprint
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads it on every call
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_TAG_RE = re.compile(r"^global_step(\d+)$")
# HF config keys that do not change what the weights mean (so they stay out of the fingerprint)
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache", "architectures",
    "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "_commit_hash",
    "output_attentions", "output_hidden_states", "return_dict", "_experts_implementation",
})


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or resumed; the message names the folder, the reason and the fix."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that could run code; never skipped silently, always an error."""


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


def verify_checkpoint(path: str, content: bool = True, collective: bool = False) -> dict:
    """Check a checkpoint folder before anything in it is loaded; return its manifest.

    Every file the manifest lists must be present with its recorded size (a truncated or missing shard
    is caught before DeepSpeed reads it, which would fail deep inside torch.load, or on one rank only).
    With `content`, each file's sha256 must match the manifest's (a shard corrupted in place) and no
    pickle may hold more than tensors and the allow-listed DeepSpeed classes (`unsafe_pickle_globals`).
    With `collective` (torch.distributed initialised) every rank must call this at the same point: each
    checks a share of the files and all agree on the result. A manifest of format 1 (no hashes) is
    checked by size only, with a warning.
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
    if content:
        _verify_content(path, manifest, collective)
    return manifest


def file_digest(path: str) -> str:
    """The sha256 of a file, read in 8 MiB blocks."""
    digest = hashlib.new(HASH_ALGORITHM)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
    return digest.hexdigest()


def _collective(requested: bool) -> bool:
    import torch.distributed as dist

    return requested and dist.is_initialized() and dist.get_world_size() > 1


def _my_share(names: list[str], sizes: dict[str, int], collective: bool) -> list[str]:
    """This rank's share of files for hashing or checking (largest first, dealt round-robin)."""
    import torch.distributed as dist

    if not _collective(collective):
        return names
    ordered = sorted(names, key=lambda n: (-sizes.get(n, 0), n))
    return ordered[dist.get_rank()::dist.get_world_size()]


def _gather(mine: dict, collective: bool) -> dict:
    """The union of every rank's dict (with `collective`, all ranks call this)."""
    import torch.distributed as dist

    if not _collective(collective):
        return dict(mine)
    parts: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict = {}
    for part in parts:
        merged.update(part or {})
    return merged


def hash_files(folder: str, names: list[str], sizes: dict[str, int], collective: bool = False) -> dict[str, str]:
    """sha256 of each named file of a folder; with `collective` every rank hashes a share (all call this)."""
    mine, error = {}, None
    for name in _my_share(names, sizes, collective):
        try:
            mine[name] = file_digest(os.path.join(folder, name))
        except OSError as exc:
            error = f"cannot hash {name} in {folder!r}: {exc}"
            break
    if _collective(collective):
        _agree(error)
    elif error:
        raise CheckpointError(error)
    return dict(sorted(_gather(mine, collective).items()))


def _verify_content(path: str, manifest: dict, collective: bool) -> None:
    names = sorted(manifest["files"])
    digests = manifest.get(HASH_ALGORITHM)
    if digests is None:
        logger.warning("checkpoint %s has a manifest of format %s without content hashes (saved before they were "
                       "recorded): only file sizes are checked", path, manifest.get("format", 1))
    findings: dict[str, str] = {}
    with weights_only_loads():
        for name in _my_share(names, manifest["files"], collective):
            full = os.path.join(path, name)
            try:
                if digests is not None and file_digest(full) != digests.get(name):
                    findings[name] = "hash"
                    continue
            except OSError as error:
                findings[name] = f"read:{error}"
                continue
            unsafe = unsafe_pickle_globals(full)
            if os.path.basename(name).startswith("rng_state_"):  # format 1: numpy's state array (load_rng_state)
                unsafe = [g for g in unsafe if g not in _LEGACY_RNG_GLOBALS]
            if unsafe:
                findings[name] = "pickle:" + ", ".join(unsafe[:3])
    findings = _gather(findings, collective)
    for name, finding in sorted(findings.items()):
        if finding.startswith("pickle:"):
            raise UnsafeCheckpointError(
                f"checkpoint {path!r}: {name} holds pickled Python objects that a weights-only load refuses "
                f"({finding[len('pickle:'):]}); unpickling it could run arbitrary code, so nothing was loaded. "
                f"Only resume or export checkpoints written by ntl_pretrain that you trust (docs/checkpoints.md)")
    for name, finding in sorted(findings.items()):
        if finding == "hash":
            raise CheckpointError(f"checkpoint {path!r} is damaged: the content of {name} differs from what was "
                                  f"written (its {HASH_ALGORITHM} does not match the manifest's); resume from another "
                                  f"checkpoint (train.resume=TAG)")
        raise CheckpointError(f"checkpoint {path!r}: cannot read {name}: {finding[len('read:'):]}")


# ---------------------------------------------------------------------------------------------- safe loading
def _engine_safe_globals() -> list:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and plain containers (ZeRO optimizer
    states, loss scalers, universal-checkpoint metadata); constructing them runs no code of the file's."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, SubparamShape]


@contextlib.contextmanager
def weights_only_loads():
    """Every `torch.load` inside, including DeepSpeed's own (which pass weights_only=False), unpickles with
    weights_only=True: tensors, plain containers and the allow-listed DeepSpeed classes only.

    Uses torch's own switch (the TORCH_FORCE_WEIGHTS_ONLY_LOAD environment variable, read by every
    torch.load call) and allow-list (`torch.serialization.safe_globals`); both are process-wide while the
    context is open, and processes forked inside it (ds_to_universal's workers) inherit them.
    """
    saved = {key: os.environ.get(key) for key in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(_FORCE_NO_WEIGHTS_ONLY, None)
    try:
        with torch.serialization.safe_globals(_engine_safe_globals()):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def unsafe_pickle_globals(path: str) -> list[str]:
    """The globals of a torch.save file that a weights-only load would refuse (read statically, nothing is
    run); [] for files that are not torch zip archives (their load is still weights-only)."""
    if not path.endswith((".pt", ".pth", ".bin")):
        return []
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, RuntimeError):  # not a torch zip archive, or a damaged one (the load then fails safely)
        return []


def safe_load(path: str, what: str) -> Any:
    """`torch.load` of one checkpoint file with weights_only=True; a refused pickle is a CheckpointError."""
    with weights_only_loads():
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"{what} {path!r} holds pickled Python objects that a weights-only load refuses; unpickling it "
                f"could run arbitrary code, so it was not loaded ({str(error).splitlines()[0]})") from None
        except (OSError, RuntimeError, EOFError) as error:
            raise CheckpointError(f"cannot read {what} {path!r}: {type(error).__name__}: {error}") from None


def list_checkpoints(output_dir: str, verify: bool = True) -> list[CheckpointInfo]:
    """The complete checkpoints of a run folder, oldest first (incomplete ones, and with `verify` those with
    a missing or truncated file, are skipped; contents are checked by `verify_checkpoint`)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        step = step_of_tag(name)
        path = os.path.join(output_dir, name)
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
    if not os.path.isdir(path):
        found = [info.tag for info in list_checkpoints(output_dir, verify=False)]
        raise CheckpointError(f"train.resume={resume!r}: no such checkpoint in {output_dir!r} (found: {found or 'none'})")
    verify_checkpoint(path, collective=True)
    return resume


def _read_latest(output_dir: str) -> str | None:
    try:
        with open(os.path.join(output_dir, LATEST_NAME), encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None




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


def data_description(data_cfg: Any) -> dict:
    """What a resume must find unchanged about the data: every key that decides which samples the stream
    holds (sources with their weights and the files they resolve to, held-out documents, seq_len, seed),
    not those that only decide how it is read (batch sizes, num_proc, cache_dir)."""
    from .data import DataError, resolve_files

    sources = []
    for index, source in enumerate(data_cfg.sources):
        entry = {k: v for k, v in dataclasses.asdict(source).items()}
        try:
            resolved = resolve_files(source, f"data.sources.{index}")
        except DataError:
            resolved = None  # reported by the data pipeline itself
        if resolved is not None:
            files = [(os.path.basename(f), os.path.getsize(f)) for f in resolved[1]]
            entry["files"] = {"count": len(files), "bytes": sum(size for _, size in files), "names_and_sizes": _sha(files)}
        sources.append(entry)
    return {"sources": sources, "seq_len": data_cfg.seq_len, "validation_documents": data_cfg.validation_documents,
            "mask_document_start": data_cfg.mask_document_start, "seed": data_cfg.seed}


def describe_changes(saved: Any, current: Any, prefix: str) -> str:
    """`key: saved -> current` for each leaf that differs (at most 6)."""
    changes: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                walk(a.get(k), b.get(k), f"{key}.{k}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}.{i}")
        elif a != b:
            changes.append(f"{key}: {json.dumps(a, default=str)} -> {json.dumps(b, default=str)}")

    walk(saved, current, prefix)
    return "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")


def check_data(saved: dict | None, current: dict, where: str, allow_change: bool) -> None:
    """Refuse a resume whose data configuration differs from the checkpoint's (samples would repeat or be
    skipped, validation documents could leak into training), unless the user allows it (logged)."""
    if saved is None:
        logger.warning("checkpoint %s records no data configuration (saved before format 2): the data sources are "
                       "not compared, only data.seed and data.seq_len", where)
        return
    if saved == current:
        return
    changes = describe_changes(saved, current, "data")
    if not allow_change:
        raise CheckpointError(
            f"checkpoint {where} was saved with another data configuration than this run's ({changes}); resuming "
            f"would continue its sample stream on other data (samples repeat or are skipped, validation documents "
            f"may enter training). Resume with the saved data settings, or set checkpoint.allow_data_change=true "
            f"if you mean it")
    logger.warning("checkpoint %s was saved with another data configuration (%s); continuing because "
                   "checkpoint.allow_data_change=true: the stream position is reused on the new data", where, changes)


def lr_schedule_description(ds_config: dict) -> dict:
    """The learning-rate schedule a DeepSpeed config builds: its scheduler section and the optimizer's lr."""
    return {"scheduler": ds_config.get("scheduler"),
            "lr": (ds_config.get("optimizer") or {}).get("params", {}).get("lr")}


def _lr_text(schedule: dict, steps_done: int) -> str:
    """The lr of step steps_done + 1 under a schedule, as DeepSpeed's scheduler computes it."""
    from deepspeed.runtime import lr_schedules

    section = schedule.get("scheduler") or {}
    try:
        scheduler_class = getattr(lr_schedules, section["type"])
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(schedule.get("lr") or 0.0))
        scheduler = scheduler_class(optimizer, **section.get("params", {}), last_batch_iteration=steps_done)
        return f"{scheduler.get_lr()[0]:.3e}"
    except (KeyError, AttributeError, TypeError, ValueError):
        return "(not computable here)"


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    """This process's random number generator states (python, numpy, torch CPU, accelerator) as tensors and
    plain numbers only, so that it loads with weights_only=True."""
    from deepspeed.accelerator import get_accelerator

    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {"format": FORMAT_VERSION,
             "python": torch.tensor(internal, dtype=torch.int64), "python_version": int(version),
             "python_gauss": gauss,
             "numpy_kind": str(kind), "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
             "numpy_position": int(position), "numpy_has_gauss": int(has_gauss),
             "numpy_gauss": float(cached_gaussian),
             "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate((state["python_version"], tuple(int(v) for v in state["python"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy"].numpy().astype(np.uint32), state["numpy_position"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    accelerator = get_accelerator()
    if "accelerator" in state and accelerator.device_name() != "cpu":
        accelerator.set_rng_state(state["accelerator"])


def load_rng_state(path: str) -> dict:
    """A rank's saved RNG state, unpickled weights-only. Files of format 1 (python tuples and a numpy array)
    load with numpy's array reconstruction allow-listed for this file only, and are converted."""
    try:
        return safe_load(path, "RNG state")
    except UnsafeCheckpointError:
        if unsafe_pickle_globals(path) and set(unsafe_pickle_globals(path)) <= _LEGACY_RNG_GLOBALS:
            with torch.serialization.safe_globals([np.dtype, np.ndarray, _numpy_reconstruct(), type(np.dtype(np.uint32))]):
                legacy = safe_load(path, "RNG state")
            version, internal, gauss = legacy["python"]
            kind, keys, position, has_gauss, cached_gaussian = legacy["numpy"]
            converted = {"python": torch.tensor(internal, dtype=torch.int64), "python_version": version,
                         "python_gauss": gauss, "numpy_kind": kind,
                         "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "numpy_position": position,
                         "numpy_has_gauss": has_gauss, "numpy_gauss": cached_gaussian, "torch": legacy["torch"]}
            if "accelerator" in legacy:
                converted["accelerator"] = legacy["accelerator"]
            return converted
        raise


_LEGACY_RNG_GLOBALS = {"numpy.dtype", "numpy.ndarray", "numpy.core.multiarray._reconstruct",
                       "numpy._core.multiarray._reconstruct", "numpy.dtypes.UInt32DType"}


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


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


def _broadcast_from_main(is_main: bool, fn: Callable[[], Any]) -> Any:
    """`fn()` on global rank 0, its result on every rank (its error raised on every rank)."""
    import torch.distributed as dist

    result = run_on_main(is_main, fn)
    if not _collective(True):
        return result
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def convert_to_universal(checkpoint_path: str, output_path: str | None = None, workers: int = 1,
                         verified: bool = False) -> str:
    """Convert a (complete) DeepSpeed checkpoint to DeepSpeed's universal form, once; returns its path.

    The conversion (`deepspeed.checkpoint.ds_to_universal`) writes full, unsharded fp32 weights and
    optimizer states per parameter, which any data- and tensor-parallel size can load. It is written
    to a staging folder and renamed, so an interrupted conversion is redone rather than used. Every file
    is read with weights-only unpickling; the universal folder gets a manifest with sizes and hashes.

    Args:
        verified: the checkpoint's contents were checked already (a resume); its sizes are checked again.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    manifest = verify_checkpoint(checkpoint_path, content=not verified)
    output_path = output_path or universal_path(checkpoint_path)
    if os.path.isfile(os.path.join(output_path, MANIFEST_NAME)):
        verify_checkpoint(output_path)
        return output_path
    if os.path.exists(output_path):
        raise CheckpointError(f"{output_path!r} exists but is not a finished universal checkpoint; remove it and "
                              f"run the conversion again")
    if manifest["layout"]["zero_stage"] == 0:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0, which DeepSpeed's universal "
                              f"checkpoints do not cover; resume it with the layout it was saved with "
                              f"({saved_layout(manifest).describe()})")
    staging = output_path + STAGING_SUFFIX
    remove_staging(staging)
    make_staging(staging)
    # Without tensor parallelism nothing is sliced, so the universal-checkpoint metadata that AutoTP
    # records (and DeepSpeed's ZeRO 1/2 conversion requires) is complete when it is just the version.
    args = argparse.Namespace(input_folder=checkpoint_path, output_folder=staging, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=manifest["layout"]["tp_size"] == 1)
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), weights_only_loads():  # its prints would interleave with the log
            ds_to_universal(args)
    except pickle.UnpicklingError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeCheckpointError(f"checkpoint {checkpoint_path!r} holds pickled Python objects that a weights-only "
                                    f"load refuses ({str(error).splitlines()[0]}); nothing was converted") from None
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
    sizes = _file_sizes(staging)
    universal_manifest = dict(manifest, format=FORMAT_VERSION, universal_of=os.path.basename(checkpoint_path.rstrip("/")),
                              files=sizes, **{HASH_ALGORITHM: hash_files(staging, sorted(sizes), sizes)})
    write_text_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(universal_manifest, indent=1))
    os.rename(staging, output_path)
    pointer = os.path.join(os.path.dirname(output_path), "latest_universal")  # ds_to_universal's, naming the staging folder
    if os.path.isfile(pointer):
        write_text_atomic(pointer, os.path.basename(output_path))
    logger.info("converted %s to a universal checkpoint %s in %.1f s", checkpoint_path, output_path,
                time.perf_counter() - started)
    return output_path


def make_staging(path: str) -> None:
    """Create a folder under a temporary name, marked as made by this module (so only such folders are
    ever removed as leftovers of an interrupted save, conversion or export)."""
    os.makedirs(path)
    with open(os.path.join(path, STAGING_MARKER), "w", encoding="utf-8") as handle:
        handle.write("made by ntl_pretrain.checkpoint; removed with its folder when a save, conversion or export "
                     "is interrupted\n")


def is_own_staging(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, STAGING_MARKER))


def remove_staging(path: str) -> None:
    """Remove the leftover of an interrupted run of ours at `path`; refuse anything else found there."""
    if not os.path.lexists(path):
        return
    if not is_own_staging(path):
        raise CheckpointError(f"{path!r} exists but was not made by ntl_pretrain (no {STAGING_MARKER} inside); "
                              f"it was left alone: move or remove it yourself")
    shutil.rmtree(path)


_LEFTOVER_RE = re.compile(r"^global_step\d+(_universal)?(\.partial|\.replaced)$")


def remove_interrupted_saves(output_dir: str) -> list[str]:
    """Delete the folders of interrupted saves in a run folder: only names of our own pattern
    (`global_stepN.partial`, `global_stepN.replaced`, `global_stepN_universal.partial`) holding our
    marker; a user's `mydata.partial/` is never touched. Returns the names removed."""
    removed = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if _LEFTOVER_RE.match(name) and is_own_staging(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info("removed the folders of interrupted saves: %s", ", ".join(removed))
    return removed


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
        self._launchers: list[tuple[Any, str]] = []  # (psutil.Process, its command) of the launchers above

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)
        self.watch_launchers()

    def watch_launchers(self) -> None:
        """Remember the DeepSpeed launcher processes above this one (parent and grandparent)."""
        import psutil

        try:
            process = psutil.Process().parent()
            for _ in range(2):
                command = " ".join(process.cmdline()) if process is not None else ""
                if "deepspeed" not in command:
                    break
                self._launchers.append((process, command[:120]))
                process = process.parent()
        except psutil.Error:
            pass

    def _launcher_ended(self) -> bool:
        import psutil

        for process, command in self._launchers:
            try:
                alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                alive = False
            if not alive:
                logger.warning("pre-emption: the DeepSpeed launcher above this rank (pid %d: %s) has ended; "
                               "saving and stopping as for SIGTERM", process.pid, command)
                return True
        return False

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

        if not self.received and self._launchers and self._launcher_ended():
            self._on_signal(signal.SIGTERM, None)
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
                                   zero_stage=zero_stage)
        self.fingerprint = run_fingerprint
        self.seed = seed
        self.data = data
        self.lr_schedule = lr_schedule
        self.last_save: dict[str, float] = {}

    # ------------------------------------------------------------------ resume
    def plan_resume(self, tag: str) -> str:
        """Before `deepspeed.initialize`: check the checkpoint and return the tag DeepSpeed will load
        (the tag itself, or its universal form when the layout changed; converted here once)."""
        path = os.path.join(self.output_dir, tag)
        manifest = verify_checkpoint(path, content=False)  # contents: checked by resolve_resume
        check_fingerprint(manifest.get("fingerprint", {}), self.fingerprint, path)
        if self.data is not None:
            check_data(manifest.get("data"), self.data, path, allow_change=self.cfg.allow_data_change)
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
        run_on_main(self.layout.is_main, lambda: convert_to_universal(path, verified=True))
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
                  f"{_lr_text(saved, step)} under the checkpoint's schedule, {_lr_text(current, step)} under this run's")
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
        rng_path = os.path.join(path, f"rng_state_{self.layout.rank}.pt")
        if same_world and os.path.isfile(rng_path):
            set_rng_state(load_rng_state(rng_path))
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
        sizes = _broadcast_from_main(self.layout.is_main, lambda: _file_sizes(staging))
        try:  # every rank hashes a share of the files (read back from the page cache, mostly)
            digests = hash_files(staging, sorted(sizes), sizes, collective=True)
        except CheckpointError as exc:
            raise CheckpointError(self._with_previous(f"saving checkpoint {tag}: {exc}")) from None
        hashed = time.perf_counter() - started - written
        permanent = self.cfg.keep_every_n_steps > 0 and step % self.cfg.keep_every_n_steps == 0
        manifest = {
            "format": FORMAT_VERSION, "tag": tag, "step": step, "tokens_seen": client_state.get("tokens_seen"),
            "layout": dataclasses.asdict(self.current), "fingerprint": self.fingerprint, "permanent": permanent,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "data": self.data, "lr_schedule": self.lr_schedule, HASH_ALGORITHM: digests,
        }
        run_on_main(self.layout.is_main, lambda: self._commit(staging, final, tag, manifest))
        self.last_save = {"save_s": time.perf_counter() - started, "write_s": written, "hash_s": hashed,
                          "bytes": float(sum(sizes.values()))}
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
            raise CheckpointError(self._with_previous(f"cannot save a checkpoint into {staging!r}: {exc}")) from None

    def _commit(self, staging: str, final: str, tag: str, manifest: dict) -> None:
        try:
            manifest["files"] = _file_sizes(staging)
            manifest["bytes"] = sum(manifest["files"].values())
            if sorted(manifest["files"]) != sorted(manifest[HASH_ALGORITHM]):
                raise CheckpointError(self._with_previous(
                    f"saving checkpoint {tag}: files in {staging!r} changed while it was being saved (another "
                    f"process writing into train.output_dir?)"))
            write_text_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(manifest, indent=1))
            fsync_dir(staging)
            replaced = None
            if os.path.exists(final):  # the same step saved again (a resume from an older checkpoint)
                replaced = final + REPLACED_SUFFIX
                os.rename(final, replaced)
            os.rename(staging, final)
            fsync_dir(self.output_dir)
            write_text_atomic(os.path.join(self.output_dir, LATEST_NAME), tag)
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


def _full_weights(checkpoint_path: str, manifest: dict, scratch: str,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights of a checkpoint: from its universal form (made in `scratch` if needed).

    DeepSpeed's universal form has two layouts of `zero/<name>/fp32.pt`: a dict whose "param" holds the
    full tensor (ZeRO 1/2, and AutoTP's merge of tensor-parallel slices) and, for ZeRO-3 without tensor
    parallelism, the bare flat tensor; a flat tensor takes its shape from the model (`shapes`), and a
    size that matches no expected shape is an error. Every file is unpickled weights-only.
    """
    layout = manifest["layout"]
    if layout["zero_stage"] == 0:
        if layout["tp_size"] != 1:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0 and tp_size "
                                  f"{layout['tp_size']}; export covers ZeRO 1-3 with any tp_size and ZeRO 0 with tp_size 1")
        state = safe_load(os.path.join(checkpoint_path, "mp_rank_00_model_states.pt"), "model states")
        return {name: tensor.float() for name, tensor in state["module"].items()}
    if manifest.get("universal_of"):
        universal = checkpoint_path
    elif os.path.isfile(os.path.join(universal_path(checkpoint_path), MANIFEST_NAME)):
        universal = convert_to_universal(checkpoint_path, verified=True)  # verifies the existing universal form
    else:
        universal = convert_to_universal(checkpoint_path, os.path.join(scratch, "universal"), verified=True)
    zero = os.path.join(universal, "zero")
    weights = {}
    for name in sorted(os.listdir(zero)):
        fp32 = os.path.join(zero, name, "fp32.pt")
        if not os.path.isfile(fp32):
            continue
        stored = safe_load(fp32, "universal checkpoint file")
        tensor = stored["param"] if isinstance(stored, dict) else stored
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"universal checkpoint file {fp32!r} holds a {type(stored).__name__}, not a tensor "
                                  f"or a dict with 'param'")
        expected = shapes.get(name)
        if expected is not None and tuple(tensor.shape) != tuple(expected) and tensor.numel() == math.prod(expected):
            tensor = tensor.reshape(expected)  # ZeRO-3 without TP: stored flat
        weights[name] = tensor
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
    remove_staging(staging)  # an interrupted export of ours; anything else there is refused, not deleted
    make_staging(staging)
    scratch = tempfile.mkdtemp(prefix=".ntl_export_scratch_", dir=parent)
    try:
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(config)
        expected = reference.state_dict()
        weights = _full_weights(checkpoint_path, manifest, scratch,
                                {name: tuple(tensor.shape) for name, tensor in expected.items()})
        tied = set(getattr(reference, "_tied_weights_keys", None) or [])
        if isinstance(getattr(reference, "_tied_weights_keys", None), dict):
            tied = set(reference._tied_weights_keys)
        if getattr(config, "tie_word_embeddings", False):
            tied |= {"lm_head.weight"}
            for name in tied:  # the tied copy holds the input embedding's values; DeepSpeed's conversion
                weights.pop(name, None)  # may give it one TP shard only (ZeRO 1/2 without its own fragments)
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
        os.remove(os.path.join(staging, STAGING_MARKER))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    apply_umask_modes(staging)  # safetensors writes its shards 0600: teammates could not read the export
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.rename(staging, out_dir)
    return {"seconds": time.perf_counter() - started, "bytes": folder_bytes(out_dir),
            "parameters": sum(t.numel() for t in state.values()), "files": sorted(os.listdir(out_dir))}
