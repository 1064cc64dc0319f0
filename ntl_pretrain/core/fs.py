"""Files and folders the project writes: complete or absent (temporary name, fsync, rename), with the
permissions the user's umask gives (`tempfile.mkstemp`/`mkdtemp` make 0600/0700, which teammates on a
shared file system cannot read), an early check that a folder can be written at all, and a user's path told
apart from a Hugging Face Hub id (`local_or_hub`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from typing import IO, Any, Iterator


def current_umask() -> int:
    """The process umask, read without changing it (thread-safe on Linux; elsewhere set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open(path, "w")` would give a new file (0o666 less the umask)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode `os.mkdir` would give a new folder (0o777 less the umask)."""
    return 0o777 & ~current_umask()


def apply_umask_modes(root: str) -> None:
    """Give `root` and everything under it the umask's modes (for trees written by libraries that create
    private files, e.g. safetensors' 0600)."""
    files, dirs = file_mode(), dir_mode()
    os.chmod(root, dirs)
    for folder, subdirs, names in os.walk(root):
        for name in subdirs:
            os.chmod(os.path.join(folder, name), dirs)
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, files)


def fsync_dir(path: str) -> None:
    """fsync a folder so a rename inside it is durable (best effort: some file systems cannot)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the rename is still atomic
    finally:
        os.close(fd)


# the names that mean a standard stream (the stream is written, never a file put in its place)
STANDARD_STREAMS = {"-": "stdout", "/dev/stdout": "stdout", "/dev/stderr": "stderr", "/dev/fd/1": "stdout",
                    "/dev/fd/2": "stderr", "/proc/self/fd/1": "stdout", "/proc/self/fd/2": "stderr"}

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"))


class OutputPathError(ValueError):
    """A path given to write a file to that a new file must not replace (a device, fifo, socket or folder)."""


def not_a_file_problem(path: str | os.PathLike) -> str | None:
    """None when a new file may be put at `path` (nothing there, a regular file, a link to one, or a standard
    stream's name); else one line naming the path, what is there, and the fix.

    A file renamed over a device node replaces the node for every process of the machine (run as root, `--json
    /dev/null` left /dev/null a regular file), so the one shared writer (`atomic_write`) refuses such targets."""
    path = os.fspath(path)
    if path in STANDARD_STREAMS:
        return None
    try:
        mode = os.stat(path).st_mode  # through links: a link to /dev/null is /dev/null
    except OSError:
        return None  # nothing there (or a dangling link, which the rename replaces): a new file goes there
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    if os.path.islink(path):
        kind = f"a symbolic link to {os.path.realpath(path)!r}, {kind}"
    return (f"{path!r} is {kind}, not a regular file, so no file is written in its place; choose a file path "
            f"(or - or /dev/stdout for the standard output)")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; on success it is fsynced and renamed onto `path`
    (mode from the umask), on error removed: readers see the old file or the whole new one, never a part.

    `-`, `/dev/stdout` and `/dev/stderr` (or /dev/fd/1, 2) write to that stream; any other target that exists and is not a regular
    file (a device node, fifo, socket, folder, or a link to one) is refused with `OutputPathError`, before
    anything is written (`not_a_file_problem`)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a new file: mode must be 'w' or 'wb', not {mode!r}")
    path = os.fspath(path)
    if path in STANDARD_STREAMS:
        stream = getattr(sys, STANDARD_STREAMS[path])
        stream.flush()  # text written before comes first
        yield stream if "b" not in mode else stream.buffer
        stream.flush()
        return
    problem = not_a_file_problem(path)
    if problem:
        raise OutputPathError(problem)
    directory = os.path.dirname(os.path.abspath(path))
    step = f"creating its folder {directory!r}"
    try:  # an error names the user's path, not the temporary file's
        os.makedirs(directory, exist_ok=True)
        step = f"creating a file in {directory!r}"
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=directory)
    except OSError as error:
        raise type(error)(error.errno, f"cannot write {path!r}: {step} failed ({error.strerror}); choose a path "
                                       f"in a folder you can write") from None
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        problem = not_a_file_problem(path)  # put there while this wrote
        if problem:
            raise OutputPathError(problem)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def write_text_atomic(path: str | os.PathLike, text: str) -> str:
    """Write `text` to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as handle:
        handle.write(text)
    return os.fspath(path)


def write_json_atomic(path: str | os.PathLike, data: Any, **dump_kwargs: Any) -> str:
    """Write `data` as JSON to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as handle:
        json.dump(data, handle, **dump_kwargs)
    return os.fspath(path)


STAGING_MARKER = ".ntl-staging.json"  # inside a staging folder of `atomic_directory`: who writes it


def _staging_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _retired_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.old-"


def _write_marker(folder: str) -> None:
    with open(os.path.join(folder, STAGING_MARKER), "x", encoding="utf-8") as handle:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "written_by": "ntl_pretrain"}, handle)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's (EPERM)
    return True


def remove_stale_staging(path: str | os.PathLike) -> list[str]:
    """Remove the staging folders of `atomic_directory` for `path` that a killed process left beside it, and the
    folders a replacement moved the previous `path` into (`commit_directory` with `replace`) before it was killed.

    Only folders named `.NAME.tmp-*` or `.NAME.old-*` that hold our `STAGING_MARKER` naming a process of this host
    that no longer runs are removed: a folder without the marker (not ours), a link, or one whose writer is alive or
    on another host (a shared file system: its process cannot be seen from here) is left alone. Returns the removed."""
    path = os.path.abspath(os.fspath(path))
    parent, prefixes = os.path.dirname(path), (_staging_prefix(path), _retired_prefix(path))
    try:
        names = [name for name in os.listdir(parent) if name.startswith(prefixes)]
    except OSError:
        return []
    removed = []
    for name in names:
        folder = os.path.join(parent, name)
        marker = os.path.join(folder, STAGING_MARKER)
        if os.path.islink(folder) or not os.path.isdir(folder) or os.path.islink(marker):
            continue
        try:
            with open(marker, encoding="utf-8") as handle:
                owner = json.load(handle)
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host == socket.gethostname() and pid != os.getpid() and not _process_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, replace: bool = False) -> Iterator[str]:
    """Yield an empty staging folder beside `path` (mode from the umask); on success the files in it get
    the umask's modes and it is renamed onto `path`, on error removed.

    The staging folder (`.NAME.tmp-*`) holds `STAGING_MARKER` (this process's id and host; callers list the
    folder without it) until it is committed, so a folder left by a process killed with SIGKILL is removed by
    the next `atomic_directory` for the same `path` (`remove_stale_staging`).

    Raises FileExistsError (staging removed) when `path` already exists and is not empty, so a caller
    that races another process for the same result can keep the one that finished first; with `replace`
    such a folder is replaced instead (see `commit_directory`).
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    step = f"creating its folder {parent!r}"
    try:  # an error names the user's path, not the staging folder's
        os.makedirs(parent, exist_ok=True)
        remove_stale_staging(path)
        step = f"creating a folder in {parent!r}"
        staging = tempfile.mkdtemp(prefix=_staging_prefix(path), dir=parent)
    except OSError as error:
        raise type(error)(error.errno, f"cannot write {path!r}: {step} failed ({error.strerror}); choose a path "
                                       f"in a folder you can write") from None
    try:
        _write_marker(staging)
        yield staging
        apply_umask_modes(staging)
        commit_directory(staging, path, replace=replace, staging_marker=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def commit_directory(staging: str | os.PathLike, path: str | os.PathLike, replace: bool = False,
                     staging_marker: bool = False) -> None:
    """The last step of writing a folder under a temporary name: fsync it, rename it onto `path` and fsync
    the parent, so the rename is durable. An empty folder at `path` is replaced; a non-empty one raises
    FileExistsError (`staging` stays), or with `replace` is moved aside (into `.NAME.old-*`, which holds
    `STAGING_MARKER` first), replaced and then deleted. With `staging_marker`, `staging`'s own marker is removed
    only once the old folder is aside, so a process killed in between leaves two marked folders that the next
    `atomic_directory` for `path` removes. For staging folders with a fixed name (a checkpoint's `.partial`,
    which every rank writes into); `atomic_directory` makes and commits one itself."""
    staging, path = os.fspath(staging), os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    retired = None
    if replace and os.path.isdir(path) and os.listdir(path):
        retired = tempfile.mkdtemp(prefix=_retired_prefix(path), dir=parent)
        _write_marker(retired)  # first: killed from here on, the next writer of `path` removes it
        os.rename(path, os.path.join(retired, os.path.basename(path)))
    if staging_marker:
        os.remove(os.path.join(staging, STAGING_MARKER))
    fsync_dir(staging)
    try:
        os.rename(staging, path)  # replaces an empty folder; fails on a non-empty one
    except OSError as error:
        if retired is not None:  # put the old folder back
            os.rename(os.path.join(retired, os.path.basename(path)), path)
            shutil.rmtree(retired, ignore_errors=True)
        if os.path.isdir(path) and os.listdir(path):
            raise FileExistsError(f"{path!r} already exists and is not empty") from error
        raise
    fsync_dir(parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def writable_problem(path: str | os.PathLike, key: str) -> str | None:
    """None when files can be created in folder `path` (or, if it does not exist yet, in its nearest
    existing parent, which is left unchanged); else one line naming `key`, the folder and the fix.

    Tries a real file (permissions, ACLs, read-only mounts and full quotas all show up), not os.access.
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    probe_dir = path
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        return (f"{key}={os.fspath(path)!r} cannot be created: {probe_dir!r} is a file, not a folder; "
                f"choose another {key}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ntl-write-check-", dir=probe_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        where = "" if probe_dir == path else f" (its nearest existing parent {probe_dir!r})"
        return (f"{key}={os.fspath(path)!r} is not writable{where}: {error.strerror or error}; choose a folder "
                f"you can write (on every node), or fix its permissions")
    return None


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how torch's zip writer (torch.save, DeepSpeed's checkpoint files) reports a failed write: as a short write
SHORT_WRITE_SIGNS = ("unexpected pos", "file write failed", "No space left")
LOW_SPACE_BYTES = 256 << 20  # below this, a short write is taken for a full disk


def is_short_write(error: BaseException) -> bool:
    """A write cut short, as torch's writer or the OS report it (no errno from torch's writer)."""
    return any(sign in str(error) for sign in SHORT_WRITE_SIGNS)


def is_full_disk(error: BaseException, free_bytes: int) -> bool:
    """Whether a failed write is a full disk (or quota): ENOSPC/EDQUOT, or a short write with almost no space left."""
    return getattr(error, "errno", None) in DISK_FULL_ERRNOS or (is_short_write(error) and free_bytes < LOW_SPACE_BYTES)


def local_or_hub(source: str, key: str) -> str:
    """`source` with `~` expanded, or an error when it is clearly a missing local path.

    A Hub id is "name" or "org/name"; an absolute or ./ path, one with several "/", or one whose first
    component is a local folder ("runs/tok" with ./runs present) is a path the user meant.
    """
    expanded = os.path.expanduser(source)
    if os.path.exists(expanded):
        return expanded
    first = expanded.split("/", 1)[0]
    if (os.path.isabs(expanded) or source.startswith((".", "~")) or expanded.count("/") > 1
            or ("/" in expanded and os.path.isdir(first))):
        raise ValueError(f"{key}={source!r} does not exist (no such file or folder; working directory "
                         f"{os.getcwd()}); fix the path, or give a Hugging Face Hub id")
    return source
