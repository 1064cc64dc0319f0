"""Content integrity: a hash of every file recorded in the manifest at save time, and the check of a folder
(sizes, hashes, pickles) before anything in it is loaded.

The hash is xxHash's XXH3-128 (non-cryptographic: it catches corruption, a truncated or overwritten shard,
not an attacker who can also rewrite the manifest; see docs/checkpoints.md), which runs near memory speed
where sha256 took a third of the save's write time. The manifest names its algorithm (format 3); the
sha256 entries of format-2 manifests still verify.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from typing import Any, Callable

import xxhash

from .collective import agree, gather, is_collective, my_share
from .format import HF_DIR, UNLISTED_ENTRIES, CheckpointError, UnsafeCheckpointError, read_manifest, saved_layout
from .safe_loading import LEGACY_RNG_GLOBALS, unsafe_pickle_globals, weights_only_loads

logger = logging.getLogger("ntl_pretrain")

HASH_ALGORITHM = "xxh3_128"  # the content hash new manifests record
HASHERS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
_BLOCK = 1 << 20  # bytes read per call: a block that stays in the CPU cache is hashed ~1.4x faster than 8 MiB


def hash_record(digests: dict[str, str]) -> dict[str, Any]:
    """The manifest entries of a content hash: its algorithm and each file's digest."""
    return {"hash_algorithm": HASH_ALGORITHM, "hashes": dict(sorted(digests.items()))}


def recorded_hashes(manifest: dict, where: str) -> tuple[str, dict[str, str]] | None:
    """(algorithm, {file: digest}) a manifest records: format 3 names its algorithm, format 2 has sha256
    entries, format 1 none (None)."""
    if "hashes" in manifest:
        algorithm = manifest.get("hash_algorithm")
        if algorithm not in HASHERS:
            raise CheckpointError(f"checkpoint {where!r}: its manifest names the content hash {algorithm!r}, which "
                                  f"this version does not know ({', '.join(HASHERS)}); use the ntl_pretrain "
                                  f"version that saved it")
        return algorithm, manifest["hashes"]
    if "sha256" in manifest:
        return "sha256", manifest["sha256"]
    return None


def verify_checkpoint(path: str, content: bool = True, collective: bool = False) -> dict:
    """Check a checkpoint folder before anything in it is loaded; return its manifest.

    The manifest's schema is checked first (`read_manifest`: its names stay inside the folder). The folder
    must hold exactly the files the manifest lists (`listed_file_sizes`: no link, no unlisted file or folder),
    each with its recorded size (a truncated or missing shard is caught before DeepSpeed reads it, which
    would fail deep inside torch.load, or on one rank only). With `content`, each file's hash must match
    the manifest's (a shard corrupted in place) and no pickle may hold more than tensors and the
    allow-listed DeepSpeed classes (`unsafe_pickle_globals`). With `collective` (torch.distributed
    initialised) every rank must call this at the same point: each checks a share of the files and all
    agree on the result. A manifest of format 1 (no hashes) is checked by size only, with a warning.
    """
    manifest = read_manifest(path)
    present = listed_file_sizes(path, manifest)
    for name, size in manifest["files"].items():
        actual = present.get(name)
        if actual is None:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} is missing; resume from another "
                                  f"checkpoint (train.resume=TAG)")
        if actual != size:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} has {actual} bytes, {size} were written "
                                  f"(a truncated shard); resume from another checkpoint (train.resume=TAG)")
    check_rank_files(path, manifest)
    if content:
        _verify_content(path, manifest, collective)
    return manifest


_RANK_FILE = re.compile(r"^(?:bf16_)?(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_(optim|model)_states\.pt$")
_RNG_FILE = re.compile(r"^rng_state_(\d+)\.pt$")


def check_rank_files(path: str, manifest: dict) -> None:
    """The manifest's DeepSpeed and RNG files are exactly those of its saved layout: none missing (a
    tensor-parallel rank's files deleted and the manifest re-signed surfaced as a weight of half its shape at
    export, or as DeepSpeed's assertion "checkpoint count 1 is different from saved mp_world_size 2" at resume)
    and none extra (a layout edited to tp 1 over tp-2 files exported rank 0's half of every sharded weight).
    Universal folders hold other files."""
    if "layout" not in manifest or "universal_of" in manifest:
        return
    layout = saved_layout(manifest)
    if layout.world_size != layout.dp_size * layout.sp_size * layout.tp_size:
        raise CheckpointError(f"checkpoint {path!r}: its manifest's layout is inconsistent ({layout.describe()}: "
                              f"{layout.dp_size * layout.sp_size * layout.tp_size} processes, not "
                              f"{layout.world_size}); restore the manifest, or resume from another checkpoint")
    found: dict[str, set[tuple[int, int]]] = {"optim": set(), "model": set()}
    partitions = layout.zero_partitions  # optimizer files: one per ZeRO partition (bf16 at stage 0 too)
    model_partitions = partitions if layout.zero_stage == 3 else 1
    extra = []
    for name in manifest["files"]:
        match = _RANK_FILE.match(name)
        if match:
            tp, dp, kind = int(match.group(2)), int(match.group(1) or 0), match.group(3)
            found[kind].add((tp, dp))
            per_partition = match.group(1) is not None
            if (tp >= layout.tp_size or dp >= (model_partitions if kind == "model" else partitions)
                    or (kind == "model" and per_partition != (layout.zero_stage == 3))):
                extra.append(name)
        elif (rng := _RNG_FILE.match(name)) and int(rng.group(1)) >= layout.world_size:
            extra.append(name)
    if extra:
        extra.sort()
        raise CheckpointError(
            f"checkpoint {path!r} holds {len(extra)} file(s) its layout ({layout.describe()}) has no rank for: "
            f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} (a manifest edited to another layout, or "
            f"files of another run copied in); restore the manifest, or resume from another checkpoint")
    wanted = {"model": range(model_partitions)}
    if layout.zero_stage:
        wanted["optim"] = range(partitions)
    for kind, dp_ranks in wanted.items():
        missing = [(tp, dp) for tp in range(layout.tp_size) for dp in dp_ranks if (tp, dp) not in found[kind]]
        if missing:
            tp, dp = missing[0]
            name = (f"mp_rank_{tp:02d}_{kind}_states.pt" if kind == "model" and layout.zero_stage < 3 else
                    f"zero_pp_rank_{dp}_mp_rank_{tp:02d}_{kind}_states.pt")
            raise CheckpointError(
                f"checkpoint {path!r} lacks {len(missing)} {kind}-states file(s) of its layout ({layout.describe()}): "
                f"those of (tensor-parallel rank, ZeRO partition) {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                f"e.g. {name}; restore them, or resume from another checkpoint")


def listed_file_sizes(path: str, manifest: dict) -> dict[str, int]:
    """{name: bytes} of the files a checkpoint folder holds, walked without following links; CheckpointError
    naming the first entry that is a symbolic link, not a regular file or folder, a folder inside `hf/`,
    or a file or folder its manifest does not list (only `UNLISTED_ENTRIES` at the top may be unlisted).

    The gate before anything in a checkpoint is read, loaded or copied (resume, conversion, export): what
    passes holds only the manifest's own files, inside the folder."""
    listed = manifest["files"]
    parents = {"/".join(name.split("/")[:depth]) for name in listed for depth in range(1, name.count("/") + 1)}
    where = f"checkpoint {path!r}"
    fix = "remove it, or resume from another checkpoint"
    present: dict[str, int] = {}
    for root, folders, names in os.walk(path, onerror=_raise_walk_error(path)):
        relative_root = os.path.relpath(root, path)
        prefix = "" if relative_root == "." else relative_root + "/"
        for name in folders + names:
            relative = prefix + name
            try:
                status = os.lstat(os.path.join(root, name))
            except OSError as error:  # removed or made unreadable while being checked
                raise CheckpointError(f"{where}: cannot read {relative} ({error.strerror}): {fix}") from None
            mode = status.st_mode
            if stat.S_ISLNK(mode):
                raise CheckpointError(f"{where}: {relative} is a symbolic link; a checkpoint holds its own files "
                                      f"and links are never followed: replace it with the file it stands for or {fix}")
            if stat.S_ISDIR(mode):
                if prefix.split("/")[0] == HF_DIR:
                    raise CheckpointError(f"{where}: {relative} is a folder; {HF_DIR}/ holds the model's config and "
                                          f"tokenizer files only: {fix}")
                if relative not in parents:
                    raise CheckpointError(f"{where} holds the folder {relative}, which its manifest does not list "
                                          f"(added after the save): {fix}")
            elif not stat.S_ISREG(mode):
                raise CheckpointError(f"{where}: {relative} is not a regular file (a pipe, socket or device): {fix}")
            elif relative in listed:
                present[relative] = status.st_size
            elif not (prefix == "" and name in UNLISTED_ENTRIES):
                raise CheckpointError(f"{where} holds {relative}, which its manifest does not list (added after the "
                                      f"save): {fix}")
    return present


def _raise_walk_error(path: str) -> Callable[[OSError], None]:
    def raise_error(error: OSError) -> None:
        raise CheckpointError(f"checkpoint {path!r}: cannot list {os.path.relpath(error.filename, path)} "
                              f"({error.strerror}); fix its permissions or resume from another checkpoint")
    return raise_error


def file_digest(path: str, algorithm: str = HASH_ALGORITHM) -> str:
    """The hex digest of a file (`HASHERS[algorithm]`), read in 1 MiB blocks."""
    digest = HASHERS[algorithm]()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    # O_NOFOLLOW: a link put in place of a checked file is not read through
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
    return digest.hexdigest()


def hash_files(folder: str, names: list[str], sizes: dict[str, int], collective: bool = False) -> dict[str, str]:
    """The content hash of each named file of a folder; with `collective` every rank hashes a share (all
    call this)."""
    mine, error = {}, None
    for name in my_share(names, sizes, collective):
        try:
            mine[name] = file_digest(os.path.join(folder, name))
        except OSError as exc:
            error = f"cannot hash {name} in {folder!r}: {exc}"
            break
    if is_collective(collective):
        agree(error)
    elif error:
        raise CheckpointError(error)
    return dict(sorted(gather(mine, collective).items()))


def _verify_content(path: str, manifest: dict, collective: bool) -> None:
    names = sorted(manifest["files"])
    recorded = recorded_hashes(manifest, path)
    algorithm, digests = recorded if recorded is not None else ("", {})
    if recorded is None:
        logger.warning("checkpoint %s has a manifest of format %s without content hashes (saved before they were "
                       "recorded): only file sizes are checked", path, manifest.get("format", 1))
    findings: dict[str, str] = {}
    with weights_only_loads():
        for name in my_share(names, manifest["files"], collective):
            full = os.path.join(path, name)
            try:
                if recorded is not None and file_digest(full, algorithm) != digests.get(name):
                    findings[name] = "hash"
                    continue
            except OSError as error:
                findings[name] = f"read:{error}"
                continue
            unsafe = unsafe_pickle_globals(full)
            if os.path.basename(name).startswith("rng_state_"):  # format 1: numpy's state array (load_rng_state)
                unsafe = [g for g in unsafe if g not in LEGACY_RNG_GLOBALS]
            if unsafe:
                findings[name] = "pickle:" + ", ".join(unsafe[:3])
    findings = gather(findings, collective)
    for name, finding in sorted(findings.items()):
        if finding.startswith("pickle:"):
            raise UnsafeCheckpointError(
                f"checkpoint {path!r}: {name} holds pickled Python objects that a weights-only load refuses "
                f"({finding[len('pickle:'):]}); unpickling it could run arbitrary code, so nothing was loaded. "
                f"Only resume or export checkpoints written by ntl_pretrain that you trust (docs/checkpoints.md)")
    for name, finding in sorted(findings.items()):
        if finding == "hash":
            raise CheckpointError(f"checkpoint {path!r} is damaged: the content of {name} differs from what was "
                                  f"written (its {algorithm} does not match the manifest's); resume from another "
                                  f"checkpoint (train.resume=TAG)")
        raise CheckpointError(f"checkpoint {path!r}: cannot read {name}: {finding[len('read:'):]}")
