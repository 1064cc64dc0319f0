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
from typing import Any, Callable

import xxhash

from .collective import agree, gather, is_collective, my_share
from .format import CheckpointError, UnsafeCheckpointError, read_manifest
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

    Every file the manifest lists must be present with its recorded size (a truncated or missing shard
    is caught before DeepSpeed reads it, which would fail deep inside torch.load, or on one rank only).
    With `content`, each file's hash must match the manifest's (a shard corrupted in place) and no
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


def file_digest(path: str, algorithm: str = HASH_ALGORITHM) -> str:
    """The hex digest of a file (`HASHERS[algorithm]`), read in 1 MiB blocks."""
    digest = HASHERS[algorithm]()
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
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
