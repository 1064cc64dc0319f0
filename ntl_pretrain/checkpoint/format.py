"""The checkpoint format: folder and file names, the manifest, the error types and the saved layout."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..distributed import AgreedError

MANIFEST_NAME = "ntl_checkpoint.json"
LATEST_NAME = "latest"  # DeepSpeed's pointer file to the newest tag
TAG_PREFIX = "global_step"
STAGING_SUFFIX = ".partial"
UNIVERSAL_SUFFIX = "_universal"
REPLACED_SUFFIX = ".replaced"
KEEP_MARKER = "KEEP"
HF_DIR = "hf"
STAGING_MARKER = ".ntl_staging"  # inside every folder this package creates under a temporary name
FORMAT_VERSION = 3  # 1: sizes only; 2: + sha256 per file, plain-tensor RNG state, data and LR fingerprint;
#                    3: the content hash's algorithm named in the manifest ("hash_algorithm", "hashes")

_TAG_RE = re.compile(r"^global_step(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or resumed; the message names the folder, the reason and the fix."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that could run code; never skipped silently, always an error."""


class AgreedCheckpointError(AgreedError, CheckpointError):
    """A CheckpointError that every rank raises together (`collective.agree`), reported once."""


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


def folder_bytes(path: str) -> int:
    """Bytes of all files under a folder."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def file_sizes(path: str) -> dict[str, int]:
    """Bytes of each file under a checkpoint folder, by relative path (its own manifest left out)."""
    sizes = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == MANIFEST_NAME and root == path:
                continue
            full = os.path.join(root, name)
            sizes[os.path.relpath(full, path)] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


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
