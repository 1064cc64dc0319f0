"""Local multi-process runs without a launcher: free ports, each rank's environment, a worker script in N
processes with the gloo backend, with a timeout that turns a hang into a test failure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"
def pythonpath() -> str:
    """PYTHONPATH for the processes a launch or a worker starts: this checkout first, then the test's own."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


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


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """os.environ for rank `rank` of `world_size` local processes started without a launcher (torch's env://
    rendezvous at 127.0.0.1:port), CPU accelerator, one thread, this checkout first on PYTHONPATH; `extra` overrides."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath())
    return {**env, **extra}


def start_ranks(command: list[str], world_size: int, *, ranks: list[int] | None = None, port: int | None = None,
                cwd: Path | None = None, extra_env: dict[str, str] | None = None,
                merge_stderr: bool = True) -> list[subprocess.Popen]:
    """Start `command` once per rank (`ranks`, default all of `world_size`) with `rank_env`; output piped."""
    port = free_port() if port is None else port
    return [subprocess.Popen(command, cwd=cwd, env=rank_env(rank, world_size, port, **(extra_env or {})),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                             text=True)
            for rank in (range(world_size) if ranks is None else ranks)]


def finish_ranks(procs: list[subprocess.Popen], timeout: float, what: str = "the ranks") -> list[tuple[str, str]]:
    """Wait for every process; each one's (stdout, stderr) (stderr "" when merged). Past `timeout` seconds all are
    killed and the test fails with their output's tails (a hang)."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            outputs.append((out, err or ""))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        tails = ["".join(part or "" for part in proc.communicate())[-3000:] for proc in procs]
        raise AssertionError(f"{what} did not finish within {timeout:.0f}s (a hang?):\n" + "\n----\n".join(tails)) from None
    return outputs


def run_workers(script: str, world_size: int, args: list[str], timeout: float = 240.0,
                extra_env: dict[str, str] | None = None) -> list[str]:
    """Start `tests/workers/<script>` once per rank; wait for all; return each rank's output.

    Raises AssertionError with the outputs if any rank fails, or kills all ranks and raises if they
    have not finished within `timeout` seconds.
    """
    procs = start_ranks([sys.executable, str(WORKERS / script), *args], world_size, extra_env=extra_env)
    outputs = [out for out, _ in finish_ranks(procs, timeout, script)]
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise AssertionError(f"{script} failed on ranks {failed}:\n" +
                             "\n----\n".join(out[-4000:] for out in outputs))
    return outputs


def tp_groups_from_args():
    """For a worker started by `run_workers` with `--tp N`: init gloo (env://), split the world into tensor-parallel
    groups of N consecutive ranks; returns (tp_group, tp_rank, tp_size, rank, world)."""
    import argparse

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    tp_size = parser.parse_args().tp
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(first, first + tp_size))) for first in range(0, world, tp_size)]
    return groups[rank // tp_size], rank % tp_size, tp_size, rank, world
