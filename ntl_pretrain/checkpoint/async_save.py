"""Asynchronous saves (`checkpoint.async_save`): the training thread takes a snapshot of every file DeepSpeed
saves (each serialized into host memory at the save's step: the bytes a synchronous save would write) and goes
on training, while a background thread on each rank writes those bytes into the staging folder and hashes the
files that rank wrote.

The commit stays a collective decision on the training thread (`CheckpointManager.finish_pending`): at each
step boundary while a save is being written, every rank says in host memory whether its writer is still busy
(`PendingSave.all_written`, one all-reduce of one integer on a gloo group), and once none is, the ranks gather
the hashes and agree on any writer's error, and global rank 0 writes the manifest and renames the folder as
for a synchronous save. So kill -9 at any point leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Any, Callable, Iterator

import numpy
import torch
import torch.distributed as dist

from .integrity import file_digest


class HostBuffer:
    """Bytes in host memory that `torch.save` writes into (it needs only `write`), kept by the manager and
    reused by the next snapshot: allocating and first touching fresh memory at every save cost about as much
    as the copy itself (`tools/bench_checkpoint_async.py`)."""

    def __init__(self) -> None:
        self._data = bytearray()
        self.size = 0

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        end = self.size + chunk.nbytes
        if end > len(self._data):  # grows by at least its size: amortized, and only until the first save's size
            self._data.extend(bytes(max(end - len(self._data), len(self._data))))
        self._data[self.size:end] = chunk
        self.size = end
        return chunk.nbytes

    def flush(self) -> None:
        pass

    def view(self) -> memoryview:
        return memoryview(self._data)[: self.size]


class SnapshotWriter:
    """Stands in for DeepSpeed's checkpoint engine during one `engine.save_checkpoint`: each `save(state, path)`
    serializes `state` into host memory at once (so the training thread may change the tensors afterwards),
    into the next of `buffers` (grown as needed), and remembers the path; everything else is the engine's own
    (`makedirs`, `commit`, its flags)."""

    def __init__(self, inner: Any, buffers: list[HostBuffer]) -> None:
        self.inner = inner
        self.buffers = buffers
        self.files: collections.deque[tuple[str, HostBuffer]] = collections.deque()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        if len(self.files) == len(self.buffers):
            self.buffers.append(HostBuffer())
        buffer = self.buffers[len(self.files)]
        buffer.size = 0
        torch.save(state_dict, buffer,
                   _use_new_zipfile_serialization=getattr(self.inner, "zipfile_serialization", True))
        self.files.append((path, buffer))

    @property
    def bytes(self) -> int:
        return sum(buffer.size for _, buffer in self.files)


@contextlib.contextmanager
def snapshot_saves(engine: Any, buffers: list[HostBuffer]) -> Iterator[SnapshotWriter]:
    """DeepSpeed's file writes inside the block become snapshots in host memory (`SnapshotWriter.files`), in
    `buffers` (reused: call this only once the previous snapshots are written)."""
    writer = SnapshotWriter(engine.checkpoint_engine, buffers)
    engine.checkpoint_engine = writer
    try:
        yield writer
    finally:
        engine.checkpoint_engine = writer.inner


class PendingSave:
    """A save of this rank being written in the background: its snapshots, then the hashes of this rank's files.

    Args:
        tag, step, tokens_seen: the checkpoint's.
        staging: its `.partial` folder.
        snapshots: (path, HostBuffer) of each file DeepSpeed saved on this rank (`SnapshotWriter.files`).
        written_here: names (relative to `staging`) of the files this rank wrote already (its RNG state, the
            `hf/` assets on global rank 0): hashed with the snapshots.
        describe_failure: the one-line reason of a failed write (a full disk named as such).
        group: the host-memory group of `all_written` (None: the default group).
    """

    def __init__(self, tag: str, step: int, tokens_seen: Any, staging: str, snapshots: collections.deque,
                 written_here: list[str], describe_failure: Callable[[BaseException], str],
                 group: Any) -> None:
        self.tag, self.step, self.tokens_seen, self.staging = tag, step, tokens_seen, staging
        self.started = time.perf_counter()
        self.digests: dict[str, str] = {}
        self.error: str | None = None
        self.write_s = self.hash_s = 0.0
        self.bytes = 0
        self._snapshots = snapshots
        self._written_here = written_here
        self._describe_failure = describe_failure
        self._group = group
        self._flag = numpy.zeros(1, dtype=numpy.int64)
        # not a daemon: an interpreter that exits (after an error too) first lets the files be written; they are
        # never committed then, and the next start removes the `.partial` folder
        self._thread = threading.Thread(target=self._write_and_hash, name=f"checkpoint-writer-{tag}")
        self._thread.start()

    def _write_and_hash(self) -> None:
        names = list(self._written_here)
        try:
            started = time.perf_counter()
            while self._snapshots:
                path, buffer = self._snapshots.popleft()
                with open(path, "wb") as handle, buffer.view() as data:
                    handle.write(data)
                    self.bytes += data.nbytes
                names.append(os.path.relpath(path, self.staging))
            self.write_s = time.perf_counter() - started
            for name in names:  # read back, as a synchronous save hashes its files
                self.digests[name] = file_digest(os.path.join(self.staging, name))
            self.hash_s = time.perf_counter() - started - self.write_s
        except Exception as exc:  # noqa: BLE001 -- any failure here must reach the training thread, not vanish with the thread
            self._snapshots.clear()
            self.error = self._describe_failure(exc)

    def busy(self) -> bool:
        return self._thread.is_alive()

    def all_written(self) -> bool:
        """Whether every rank's writer has finished (with or without an error); every rank calls this at the same
        step boundary and gets the same answer (no device sync: one integer in host memory)."""
        self._flag[0] = int(self.busy())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(torch.from_numpy(self._flag), op=dist.ReduceOp.MAX, group=self._group)
        return not int(self._flag[0])

    def wait(self) -> float:
        """Block until this rank's writer has finished; returns the seconds waited."""
        started = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - started
