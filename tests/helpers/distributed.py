"""Run a worker script in N local processes with the gloo backend, with a timeout that turns a hang
into a test failure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"


# Ports handed out in this test process: DeepSpeed's CPU all-reduce names its /dev/shm buffers
# `deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, so conftest removes only the buffers of these
# ports, never those of a job that happens to run next to the tests.
PORTS_USED: set[int] = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a rendezvous (never DeepSpeed's default 29500), recorded for the
    shared-memory clean-up."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    PORTS_USED.add(port)
    return port


def run_workers(script: str, world_size: int, args: list[str], timeout: float = 240.0,
                extra_env: dict[str, str] | None = None) -> list[str]:
    """Start `tests/workers/<script>` once per rank; wait for all; return each rank's output.

    Raises AssertionError with the outputs if any rank fails, or kills all ranks and raises if they
    have not finished within `timeout` seconds.
    """
    port = str(free_port())
    procs = []
    repo = str(Path(__file__).resolve().parents[2])
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get(
                       "PYTHONPATH", ""), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            remaining = max(deadline - time.monotonic(), 1.0)
            out, _ = proc.communicate(timeout=remaining)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = [proc.communicate()[0][-3000:] for proc in procs]
        raise AssertionError(f"{script} did not finish within {timeout:.0f}s (a hang?):\n" + "\n----\n".join(tails)) from None
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise AssertionError(f"{script} failed on ranks {failed}:\n" +
                             "\n----\n".join(out[-4000:] for out in outputs))
    return outputs
