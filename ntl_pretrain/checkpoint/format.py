"""The checkpoint format: folder and file names, the manifest, the error types and the saved layout."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from ..core.agreement import AgreedError

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


def rng_state_file(rank: int) -> str:
    """The file of global rank `rank`'s RNG state in a checkpoint folder (written beside DeepSpeed's files)."""
    return f"rng_state_{rank}.pt"


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


MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists names, sizes and hashes: far below this for any real checkpoint
KNOWN_FORMATS = (1, 2, FORMAT_VERSION)
UNLISTED_ENTRIES = (MANIFEST_NAME, KEEP_MARKER, STAGING_MARKER)  # files at a checkpoint's top its manifest never
#                                                                 lists (the marker: a save killed after its rename)
_LAYOUT_FIELDS = ("world_size", "dp_size", "tp_size", "zero_stage")
_OPTIONAL_LAYOUT_FIELDS = ("sp_size",)  # absent from checkpoints saved before sequence parallelism: 1
_NoneType = type(None)
# the manifest's other entries: the types they must have where present (a list where a mapping belongs, a
# string for a number, is refused in one line before anything uses it)
MANIFEST_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "tag": (str,), "tokens_seen": (int, _NoneType), "layout": (dict,), "fingerprint": (dict,),
    "permanent": (bool,), "saved_at": (str,), "data": (dict, _NoneType), "lr_schedule": (dict, _NoneType),
    "hash_algorithm": (str,), "hashes": (dict,), "sha256": (dict,), "bytes": (int,), "universal_of": (str,),
}


def check_not_a_link(path: str, what: str = "checkpoint") -> None:
    """Refuse a checkpoint (or run) path that is a symbolic link, naming its target: links are never followed
    out of a run folder, and the messages further on would not say why the folder is refused."""
    if os.path.islink(path.rstrip("/") or path):
        raise CheckpointError(f"{what} path {path!r} is a symbolic link (to {os.path.realpath(path)!r}), which is "
                              f"never followed; pass the real folder {os.path.realpath(path)!r}")


def read_manifest(path: str) -> dict:
    """The manifest of a checkpoint folder, its schema checked (`check_manifest`); CheckpointError if the
    folder is missing, unreadable or incomplete, or the manifest is damaged, a link or of an unknown format."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"checkpoint folder {path!r} is not readable (permissions); fix them with chmod")
    manifest_path = os.path.join(path, MANIFEST_NAME)
    try:  # never through a link: its error or content would tell about a file outside the checkpoint
        fd = os.open(manifest_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path!r} is incomplete: it has no {MANIFEST_NAME} (its save was "
                              f"interrupted, or it was not written by ntl_pretrain); resume from another one") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint {path!r}: its {MANIFEST_NAME} is a symbolic link, which is never "
                                  f"followed; resume from another checkpoint") from None
        raise CheckpointError(f"checkpoint {path!r}: cannot read its {MANIFEST_NAME} ({error.strerror}); fix its "
                              f"permissions or resume from another checkpoint") from None
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode) or status.st_size > MANIFEST_MAX_BYTES:
            raise CheckpointError(f"checkpoint {path!r}: its {MANIFEST_NAME} is not a manifest (not a regular file "
                                  f"of at most {MANIFEST_MAX_BYTES >> 20} MiB); resume from another checkpoint")
        raw = handle.read()
    try:
        manifest = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, a key twice, nesting
        raise CheckpointError(f"checkpoint {path!r} has a damaged {MANIFEST_NAME}: {error}") from None
    check_manifest(manifest, path)
    return manifest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key {twice[0]!r} appears twice in one object")
    return dict(pairs)


def _json_type(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def outside_name_problem(name: Any) -> str | None:
    """Why a file name from a manifest does not name a file inside its checkpoint (None: it does): only
    plain relative paths, without `.`, `..` or empty parts, are joined to the folder."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if "\x00" in name or os.path.isabs(name) or any(part in ("", ".", "..") for part in name.split("/")):
        return "is not a plain relative path inside the checkpoint (absolute, or with '..', '.' or '//')"
    return None


def check_manifest(manifest: Any, path: str) -> None:
    """Check a parsed manifest's schema before anything uses it: a known `format`, the step, a non-empty file
    list of names inside the checkpoint with their sizes, a hash for each file (formats 2 and 3), and each
    other entry of its type (`MANIFEST_FIELD_TYPES`); CheckpointError in one line naming what is wrong."""
    where = f"checkpoint {path!r}: {MANIFEST_NAME}"
    if not isinstance(manifest, dict) or "files" not in manifest or "step" not in manifest:
        raise CheckpointError(f"{where} lacks 'files' or 'step'")
    version = manifest.get("format", 1)
    if version not in KNOWN_FORMATS or isinstance(version, bool):
        raise CheckpointError(f"{where} has format {version!r}, which this version does not know "
                              f"({', '.join(map(str, KNOWN_FORMATS))}); use the ntl_pretrain version that saved it")
    if not _is_count(manifest["step"]):
        raise CheckpointError(f"{where}: 'step' is {manifest['step']!r}, not a step number")
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{where}: 'files' is {'empty' if files == {} else _json_type(files)}, not the "
                              f"mapping of the checkpoint's files to their sizes, so nothing could be verified")
    for name, size in files.items():
        problem = outside_name_problem(name)
        if problem:
            raise CheckpointError(f"{where} lists {name!r}, which {problem}; a manifest names files of its own "
                                  f"folder only: nothing was read")
        if not _is_count(size):
            raise CheckpointError(f"{where}: the size of {name} is {size!r}, not a number of bytes")
    for key, types in MANIFEST_FIELD_TYPES.items():
        if key in manifest and not isinstance(manifest[key], types):
            wanted = " or ".join("null" if t is _NoneType else {"dict": "a mapping"}.get(t.__name__, t.__name__)
                                 for t in types)
            raise CheckpointError(f"{where}: {key!r} is {_json_type(manifest[key])}, not {wanted}")
    hashes = manifest.get("hashes", manifest.get("sha256")) if version >= 2 else None
    if version >= 2 and (not isinstance(hashes, dict) or set(hashes) != set(files)
                         or not all(isinstance(digest, str) for digest in hashes.values())):
        raise CheckpointError(f"{where} is of format {version} but does not record a content hash for each file "
                              f"it lists; resume from another checkpoint")
    if "layout" in manifest:
        layout = manifest["layout"]
        required = sorted(key for key in layout if key not in _OPTIONAL_LAYOUT_FIELDS)
        if required != sorted(_LAYOUT_FIELDS) or not all(_is_count(v) for v in layout.values()):
            raise CheckpointError(f"{where}: 'layout' is {layout!r}, not {{{', '.join(_LAYOUT_FIELDS)}}} as numbers")
        empty = [key for key, value in layout.items() if key != "zero_stage" and value < 1]
        if empty:  # a size 0 matched no file and loaded nothing
            raise CheckpointError(f"{where}: 'layout' has {empty[0]}={layout[empty[0]]}, not a number of processes "
                                  f"(1 or more); restore the manifest, or resume from another checkpoint")
        if layout["zero_stage"] > 3:  # read as "no rank for" the files of a real stage
            raise CheckpointError(f"{where}: 'layout' has zero_stage={layout['zero_stage']}, not a ZeRO stage (0-3); "
                                  f"restore the manifest, or resume from another checkpoint")
    step = step_of_tag(os.path.basename(os.path.normpath(path)))
    if step is not None and step != manifest["step"]:
        raise CheckpointError(f"checkpoint {path!r} is named for step {step} but its manifest says step "
                              f"{manifest['step']} (a copied or renamed folder); rename it "
                              f"{tag_for_step(manifest['step'])} or remove it")


def check_output_outside(checkpoint_path: str, output_path: str, what: str) -> None:
    """Refuse an output folder inside the checkpoint: it would add an unlisted folder to the checkpoint, and
    verification then refuses the checkpoint (the run could no longer resume from it)."""
    if os.path.islink(output_path.rstrip("/") or output_path):  # found only at the final rename, after all the work
        raise CheckpointError(f"{what} folder {output_path!r} is a symbolic link (to {os.readlink(output_path)!r}), "
                              f"which is never written through; pass a real folder that does not exist yet")
    checkpoint, output = os.path.realpath(checkpoint_path), os.path.realpath(output_path)
    if os.path.commonpath([checkpoint, output]) == checkpoint:
        raise CheckpointError(f"{what} folder {output_path!r} is inside the checkpoint {checkpoint_path!r}, whose "
                              f"verification would then refuse it; write it beside the checkpoint")
    folder = os.path.dirname(output)
    while True:  # any other checkpoint too (RUN/global_step1/exported while exporting global_step2)
        if is_checkpoint_folder(folder):
            raise CheckpointError(f"{what} folder {output_path!r} is inside the checkpoint {folder!r}, whose "
                                  f"verification would then refuse it (it could no longer be resumed or exported); "
                                  f"write it outside every checkpoint folder, e.g. beside them in the run folder")
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def is_checkpoint_folder(path: str) -> bool:
    """A folder a checkpoint save (or a universal conversion) wrote: it holds a manifest or the staging marker (a
    folder merely named global_stepN, an export's say, is not one)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (MANIFEST_NAME, STAGING_MARKER))


def folder_bytes(path: str) -> int:
    """Bytes of all files under a folder."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def file_sizes(path: str) -> dict[str, int]:
    """Bytes of each file under a checkpoint folder, by relative path (its own manifest and staging marker
    left out)."""
    sizes = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name in (MANIFEST_NAME, STAGING_MARKER) and root == path:  # the marker is removed at commit
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
    sp_size: int = 1  # sequence-parallel (Ulysses) size

    @property
    def zero_partitions(self) -> int:
        """The ranks ZeRO partitions each weight over (and names its files by): dp x sp (DeepSpeed's
        sequence-data-parallel group; its Ulysses groups count as model-parallel size 1)."""
        return self.dp_size * self.sp_size

    def describe(self) -> str:
        sp = f" x sp {self.sp_size}" if self.sp_size > 1 else ""
        return f"world {self.world_size} = dp {self.dp_size}{sp} x tp {self.tp_size}, ZeRO-{self.zero_stage}"


def saved_layout(manifest: dict) -> SavedLayout:
    if "layout" not in manifest:
        raise CheckpointError(f"checkpoint {manifest.get('tag', '?')}: its {MANIFEST_NAME} records no 'layout' (not "
                              f"saved by ntl_pretrain); it cannot be resumed")
    return SavedLayout(**manifest["layout"])


def needs_reshard(manifest: dict, current: SavedLayout) -> bool:
    """Whether a checkpoint must go through the universal form to load with the current layout: another ZeRO
    partitioning. Another sp size over the same ranks is not (the same files, `SavedLayout.zero_partitions`)."""
    saved = saved_layout(manifest)
    return ((saved.zero_partitions, saved.tp_size, saved.zero_stage)
            != (current.zero_partitions, current.tp_size, current.zero_stage))
