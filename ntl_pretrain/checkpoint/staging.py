"""Folders written under a temporary name (a save, a universal conversion, an export), marked as ours so that
only such folders are ever removed as the leftovers of an interrupted run."""

from __future__ import annotations

import logging
import os
import re
import shutil

from .format import MANIFEST_NAME, STAGING_MARKER, CheckpointError

logger = logging.getLogger("ntl_pretrain")

def make_staging(path: str) -> None:
    """Create a folder under a temporary name, marked as made by this package (so only such folders are
    ever removed as leftovers of an interrupted save, conversion or export)."""
    os.makedirs(path)
    mark_staging(path)


def mark_staging(path: str) -> None:
    """Mark a folder of ours as a temporary one (a new staging folder, a committed checkpoint moved aside);
    a link in the marker's place is not written through (OSError)."""
    fd = os.open(os.path.join(path, STAGING_MARKER), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
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


def _is_committed(path: str) -> bool:
    """A folder holding a manifest: a committed checkpoint (moved aside by a re-save killed before marking it)."""
    return os.path.isdir(path) and not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


_LEFTOVER_RE = re.compile(r"^global_step\d+(_universal)?(\.partial|\.replaced)$")


def remove_interrupted_saves(output_dir: str) -> list[str]:
    """Delete the folders of interrupted saves in a run folder: only names of our own pattern
    (`global_stepN.partial`, `global_stepN.replaced`, `global_stepN_universal.partial`) holding our
    marker; a user's `mydata.partial/` is never touched. A `global_stepN.replaced` whose `global_stepN` is
    missing (a re-save of step N killed between its two renames) is the only copy of step N: it is restored.
    Returns the names removed."""
    removed = []
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        committed = path[: -len(".replaced")]
        if (_LEFTOVER_RE.match(name) and name.endswith(".replaced") and not os.path.lexists(committed)
                and (is_own_staging(path) or _is_committed(path))):
            # killed between moving the old checkpoint of this step aside and committing the new one: the old
            # one is complete and the only copy of its step, so it is put back rather than deleted
            os.rename(path, committed)
            logger.warning("restored %s: a save of the same step was interrupted before it was committed", committed)
            continue
        if _LEFTOVER_RE.match(name) and is_own_staging(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info("removed the folders of interrupted saves: %s", ", ".join(removed))
    return removed
