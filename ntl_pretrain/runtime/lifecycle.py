"""The life of one training process, outside the step: one run per output folder, bounded start-up waits,
DeepSpeed's compiled CPU op and shared-memory buffers, and what a rank tells the launcher wrapper.

- `RunLock`: an exclusive `fcntl.flock` on `train.output_dir/.run.lock`, held by global rank 0 for the
  whole run. The kernel drops it when the process ends in any way (kill -9 included), so a crash never
  leaves a stale lock; the file names the holder (pid, host, start time) for the refusal message.
- `StartupWatchdog`: every start-up wait (rendezvous, first collective, rank 0 preparing files while the
  others wait, the engine's set-up) ends within `train.startup_timeout_s` with an `error:` line that says
  what was waited for, instead of a silent hang until the collective timeout.
- `use_environment_extensions_dir` / `announce_shm_op_build`: DeepSpeed compiles its CPU shared-memory
  all-reduce op on first use; the build goes into a folder of this Python environment (two virtualenvs
  on one Python otherwise rebuild it alternately), local rank 0 of each node alone removes a build lock left
  by a killed build (which makes every later start wait forever) and compiles the op before any rank loads it,
  saying so with the time so far; a stop signal during the build ends the job at once (nothing to save).
- `remove_own_shm_buffer`: DeepSpeed's CPU all-reduce maps a 66 MiB buffer per rank in /dev/shm and never
  unlinks it; once every rank has mapped all of them (after the first collective) each rank unlinks its
  own, so the memory is freed when the job ends, however it ends.
- `launcher_processes` / `stop_when_launchers_end`: the DeepSpeed launchers above a rank (its launch.py and the
  runner); DeepSpeed's runner dies on SIGTERM and leaves launch.py and the ranks running, re-parented, so the
  trainer saves and stops when one ends (trainer/preemption.py) and a rank with nothing to save (tools/evaluate.py)
  ends at once.
- `report_to_supervisor`: when `bash launch/pretrain.sh` started the job (ntl_pretrain/runtime/supervisor.py),
  each rank registers its pid (so a stop signal can be forwarded to it) and how it ended.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from typing import Callable, Iterator

from ..core.fs import write_json_atomic

logger = logging.getLogger("ntl_pretrain")

LOCK_NAME = ".run.lock"
SUPERVISOR_DIR_ENV = "NTL_SUPERVISOR_DIR"  # set by ntl_pretrain/runtime/supervisor.py for the ranks it starts
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed csrc/cpu/comm/shm.cpp: <prefix>_<uid>_<addr>_<port>_<rank>


def global_rank() -> int:
    """This process's global rank from the launcher's environment (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node from the launcher's environment (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes on this node (DeepSpeed's launcher sets LOCAL_SIZE, torchrun LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1")


# ---------------------------------------------------------------------------------------------- run lock
class RunLockError(ValueError):
    """Another live process holds the output folder."""


class RunLock:
    """An exclusive lock on a run folder (`<output_dir>/.run.lock`), taken by global rank 0.

    Args:
        output_dir: the run folder (created if missing; removed again by `release(failed=True)` when this
            lock created it and nothing else was written into it).
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._fd: int | None = None
        self._created_dir = False

    def acquire(self) -> None:
        """Take the lock or raise RunLockError naming the process that holds it."""
        self._created_dir = not os.path.isdir(self.output_dir)
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            # never follow a link (a teammate's `.run.lock -> your file` in a group-writable run folder would
            # have the lock record written into, then truncate, its target); O_NONBLOCK: a FIFO does not wait
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise RunLockError(f"{self.path!r} is a symbolic link, which the run lock never follows; remove it "
                                   f"(rm {self.path}) and start again") from None
            if error.errno == errno.EISDIR:
                raise RunLockError(f"{self.path!r} is a folder, not the run lock file; remove or rename it") from None
            raise RunLockError(f"train.output_dir={self.output_dir!r} cannot be written ({error.strerror}); "
                               f"choose a folder you can write to") from None
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
            os.close(fd)
            what = "has other hard links" if stat.S_ISREG(status.st_mode) else "is not a regular file"
            raise RunLockError(f"{self.path!r} {what}, which the run lock never writes into; remove it "
                               f"(rm {self.path}) and start again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockError(f"train.output_dir={self.output_dir!r} is in use by another run ({holder}); "
                               f"wait for it to end, stop it, or choose another train.output_dir") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def release(self, failed: bool = False) -> None:
        """Drop the lock. After a failed start-up in a folder this lock created, remove the folder again
        if it holds nothing else (an error leaves no run folder behind)."""
        if self._fd is None:
            return
        if failed and self._created_dir and os.listdir(self.output_dir) == [LOCK_NAME]:
            os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.output_dir)
        else:
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return (f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}: "
                f"{holder.get('command', '?')}")
    except (ValueError, KeyError, OSError):
        return "a process that has not yet written its pid"


# ---------------------------------------------------------------------------------------------- start-up waits
class StartupWatchdog:
    """Bounds each start-up wait: `with watchdog.waiting("what"):` ends the process with an `error:` line
    naming `what` if the block has not finished within `timeout_s` (and prints a note at `notice_s`).

    A Python timer thread prints the message (collectives and the rendezvous release the GIL); a
    faulthandler timer a minute later ends the process even inside C code that holds the GIL.
    """

    def __init__(self, timeout_s: float, notice_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.notice_s = notice_s

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        done = threading.Event()

        def watch() -> None:
            if self.notice_s < self.timeout_s and not done.wait(self.notice_s):
                print(f"[rank {global_rank()}] still waiting for {what} after {self.notice_s:.0f} s "
                      f"(limit train.startup_timeout_s={self.timeout_s:g})", file=sys.stderr, flush=True)
            if not done.wait(max(self.timeout_s - (time.monotonic() - started), 0.0)):
                print(f"error: rank {global_rank()} waited {self.timeout_s:g} s for {what}; it did not happen. "
                      f"Look at the other ranks' output above, or raise train.startup_timeout_s if it is only slow",
                      file=sys.stderr, flush=True)
                os._exit(3)

        thread = threading.Thread(target=watch, name="startup-watchdog", daemon=True)
        thread.start()
        faulthandler.dump_traceback_later(self.timeout_s + 60.0, exit=True)
        try:
            yield
        finally:
            done.set()
            faulthandler.cancel_dump_traceback_later()
            thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------- the launchers above
def launcher_processes() -> list[tuple[object, str]]:
    """(psutil.Process, its command, shortened) of the DeepSpeed launchers above this process: its parent
    (launch.py) and grandparent (the `deepspeed` runner) while their commands name deepspeed; [] without one."""
    import psutil

    found: list[tuple[object, str]] = []
    try:
        process = psutil.Process().parent()
        for _ in range(2):
            command = " ".join(process.cmdline()) if process is not None else ""
            if "deepspeed" not in command:
                break
            found.append((process, command[:120]))
            process = process.parent()
    except psutil.Error:
        pass
    return found


def ended_launcher(launchers: list[tuple[object, str]]) -> tuple[object, str] | None:
    """The first of `launchers` (from `launcher_processes`) that has ended, or None."""
    import psutil

    for process, command in launchers:
        try:
            alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        if not alive:
            return process, command
    return None


LAUNCHER_POLL_S = 1.0


def stop_when_launchers_end(what: str, poll_s: float = LAUNCHER_POLL_S) -> bool:
    """For a rank with nothing to save: a daemon thread ends this process (exit 143, as SIGTERM would) with one
    line once a DeepSpeed launcher above it has ended (a stop signal to the `deepspeed` runner, which has no
    handler, left launch.py and the ranks running on); the other ranks see the same and end too, and launch.py
    follows its ranks. Returns whether there was a launcher to watch."""
    launchers = launcher_processes()
    if not launchers:
        return False

    def watch() -> None:
        while True:
            ended = ended_launcher(launchers)
            if ended is not None:
                print(f"error: [rank {global_rank()}] the DeepSpeed launcher above this rank (pid {ended[0].pid}: "
                      f"{ended[1]}) has ended (a stop signal or a failure): {what} stopped", file=sys.stderr,
                      flush=True)
                os._exit(128 + signal.SIGTERM)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return True


# ---------------------------------------------------------------------------------------------- DeepSpeed's CPU op
def environment_extensions_dir() -> str:
    """Where this Python environment keeps its compiled torch/DeepSpeed extensions: inside the virtualenv
    when there is one we can write to, else a per-environment folder of the user's cache."""
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    if in_venv and os.access(sys.prefix, os.W_OK):
        return os.path.join(sys.prefix, "torch_extensions")
    key = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions", f"env-{key}")


def use_environment_extensions_dir() -> str:
    """Set TORCH_EXTENSIONS_DIR to this environment's folder unless the user set it; return it."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", environment_extensions_dir())


# Filesystems whose folders other machines may build into at the same time: a build lock there can be held
# by a compile on another node, invisible from here.
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "ceph", "glusterfs", "fuse",
                      "9p", "afs", "panfs", "wekafs", "virtiofs")
STALE_SHARED_BUILD_LOCK_S = 1800.0  # no compile of the op takes half an hour


def filesystem_type(path: str) -> str:
    """The type (ext4, nfs4, ...) of the filesystem holding `path`, from /proc/mounts ("" if unknown)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def _local_process_works_in(folder: str) -> bool:
    """Whether a process of this machine has `folder` as its working directory (torch runs ninja and the
    compiler there while it builds an extension)."""
    real = os.path.realpath(folder)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == real:
                    return True
    return False


def clear_stale_build_lock(folder: str, min_age_s: float = 30.0) -> str | None:
    """Remove the torch build lock of an extension folder when it was left by a killed build; return what was
    done or found (None when there is no lock).

    torch's FileBaton makes every later start wait, without a word and without limit, on a `lock` file that a
    build interrupted by Ctrl-C or kill -9 left behind. On a local filesystem a lock older than `min_age_s` with
    no process working in the folder is stale and removed. On a shared one (NFS, Lustre, ...) a compile on
    another node may hold it: it is removed only after STALE_SHARED_BUILD_LOCK_S, and named until then.
    """
    lock = os.path.join(folder, "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except OSError:
        return None
    shared = filesystem_type(folder).lower().startswith(SHARED_FILESYSTEMS)
    if age < min_age_s or _local_process_works_in(folder):
        return f"waiting for the build of {os.path.basename(folder)} that another process runs (lock {lock})"
    if shared and age < STALE_SHARED_BUILD_LOCK_S:
        return (f"{lock} exists ({age:.0f} s old) on a shared filesystem and no build runs on this machine: if no "
                f"other node is compiling, it was left by a killed build and every start waits on it: remove it "
                f"(rm {lock})")
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return f"removed {lock}, left {age:.0f} s ago by a build that was killed (no process was building)"


BUILD_NOTICE_EVERY_S = 60.0  # while the op compiles (12+ minutes on a loaded machine): a line with the time so far
BUILD_POLL_S = 0.5
STOP_SIGNALS_BEFORE_TRAINING = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _shm_op_to_build() -> tuple[object, str] | None:
    """(DeepSpeed's builder of its CPU communication op, the folder it is compiled into) when this run's
    DeepSpeed start-up will compile or load it from that folder; None otherwise (GPU, pre-built, not supported)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return None
    import deepspeed.ops
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name, False) or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None  # pre-built into the DeepSpeed install, or DeepSpeed will not use it
    return builder, os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", environment_extensions_dir()), builder.name)


def _elapsed(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@contextlib.contextmanager
def _notices_every(interval_s: float, line: Callable[[float], str]) -> Iterator[None]:
    """Print `line(elapsed seconds)` every `interval_s` until the block ends."""
    started, done = time.monotonic(), threading.Event()

    def repeat() -> None:
        while not done.wait(interval_s):
            print(line(time.monotonic() - started), file=sys.stderr, flush=True)

    thread = threading.Thread(target=repeat, name="op-build-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


@contextlib.contextmanager
def _stop_at_once(what: str, own_lock: str | None = None) -> Iterator[None]:
    """A stop signal inside the block ends this process at once (no step has run, so there is nothing to save):
    the compiler processes it started are ended and the build lock it took (`own_lock`) removed, so the next
    start neither waits on it nor races a half-removed one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, frame: object) -> None:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        if own_lock is not None:
            with contextlib.suppress(OSError):
                os.remove(own_lock)
        print(f"error: [rank {global_rank()}] {signal.Signals(number).name} while {what}, before step 1: stopped at "
              f"once, nothing is saved (no step has run)", file=sys.stderr, flush=True)
        os._exit(128 + number)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS_BEFORE_TRAINING}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def announce_shm_op_build(local_rank: int) -> None:
    """Settle DeepSpeed's CPU communication op on this node before any rank loads it.

    Local rank 0 alone decides about a build lock (one left by a killed build is removed, see
    `clear_stale_build_lock`) and, when the op is not built in this environment yet, compiles it: a notice,
    repeated every BUILD_NOTICE_EVERY_S with the time so far; a stop signal ends the build and the process at
    once. The other local ranks wait meanwhile until the op is built and no lock is held: none of them waits
    on a lock that local rank 0 then removes (and takes the removal for a finished build), so DeepSpeed's
    start-up on every rank finds the op built.
    """
    found = _shm_op_to_build()
    if found is None:
        return
    builder, folder = found
    library, lock = os.path.join(folder, f"{builder.name}.so"), os.path.join(folder, "lock")
    if local_rank != 0:
        if os.path.exists(library) and not os.path.exists(lock):
            return
        with _stop_at_once("waiting for local rank 0 to compile DeepSpeed's CPU communication op"), _notices_every(
                BUILD_NOTICE_EVERY_S, lambda s: f"[rank {global_rank()}] still waiting for local rank 0 to compile "
                                                f"DeepSpeed's CPU communication op: {_elapsed(s)} so far"):
            while not os.path.exists(library) or os.path.exists(lock):
                time.sleep(BUILD_POLL_S)
        return
    lock_note = clear_stale_build_lock(folder)
    if lock_note:
        print(f"note: {lock_note}", file=sys.stderr, flush=True)
    if os.path.exists(library) and not os.path.exists(lock):
        return  # built (DeepSpeed's start-up loads it; torch rebuilds it itself if its sources changed)
    compiler = os.environ.get("CXX", "c++")
    need = "" if shutil.which(compiler) else (f" It needs a C++ compiler and `{compiler}` is not on PATH: install "
                                              f"one (e.g. apt-get install g++) or set CXX.")
    print(f"compiling DeepSpeed's CPU communication op ({builder.name}) into {folder}: first use in this "
          f"environment only, ~1-4 min (12+ on a loaded machine).{need}", file=sys.stderr, flush=True)
    own_lock = None if os.path.exists(lock) else lock  # a lock there now is another live build's: not ours
    with _stop_at_once("compiling DeepSpeed's CPU communication op", own_lock), _notices_every(
            BUILD_NOTICE_EVERY_S, lambda s: f"still compiling DeepSpeed's CPU communication op ({builder.name}): "
                                            f"{_elapsed(s)} so far (first use in this environment only)"):
        started = time.monotonic()
        builder.load(verbose=False)
    print(f"compiled DeepSpeed's CPU communication op in {_elapsed(time.monotonic() - started)}", file=sys.stderr,
          flush=True)


def own_shm_buffer() -> str | None:
    """The /dev/shm path of this rank's DeepSpeed CPU all-reduce buffer (None without a launcher's address)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return f"/dev/shm/{SHM_BUFFER_PREFIX}_{os.getuid()}_{addr}_{port}_{global_rank()}"


def remove_own_shm_buffer() -> None:
    """Unlink this rank's buffer; call after a collective that every rank reached after DeepSpeed's
    communication start-up (all ranks have mapped every buffer by then; the mappings stay valid)."""
    path = own_shm_buffer()
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ---------------------------------------------------------------------------------------------- the wrapper
def report_to_supervisor(event: str, **fields: object) -> None:
    """Tell `ntl_pretrain.runtime.supervisor` (when it started this job) about this rank: `started` (its pid, so
    stop signals reach it) or `done` (it ended cleanly, with why). No-op otherwise."""
    folder = os.environ.get(SUPERVISOR_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return
    record = {"pid": os.getpid(), "rank": global_rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "local_world_size": local_world_size(), **fields}
    write_json_atomic(os.path.join(folder, f"{event}.{record['local_rank']}.json"), record)
