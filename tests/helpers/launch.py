"""Launched runs: their environment, configs/demo.yaml made small, the launcher command and a runner whose
timeout turns a hang into a test failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.distributed import REPO, free_port, pythonpath

DEMO = "configs/demo.yaml"
TIMEOUT = 420.0  # seconds; generous: 2 cores shared with other jobs


def launch_env(**extra: str) -> dict[str, str]:
    """os.environ for a launched run: CPU accelerator, one thread per process, unbuffered output, this
    checkout first on PYTHONPATH (`helpers.distributed.pythonpath`); `extra` last (e.g. NTL_CPU_PROCS,
    NTL_DEEPSPEED_ARGS)."""
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath(),
                **extra)


def demo_overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    """configs/demo.yaml made small: its corpus, tokenizer and data cache under `assets` (written on first
    use and reused by later runs), the run in `out`, a log line every step, no validation or evaluation
    unless `extra` (applied last, so it wins) asks for them."""
    return [f"data.sources.0.path={assets / 'arithmetic.jsonl'}", "data.sources.0.generate_arithmetic=3000",
            f"tokenizer.name_or_path={assets / 'tokenizer'}", f"data.cache_dir={assets / 'cache'}",
            "data.validation_documents=100", f"train.output_dir={out}", "train.log_every_n_steps=1",
            "monitor.progress_bar=never", "train.val_every_n_steps=-1", "eval.at_end=false", *extra]


def demo_args(assets: Path, out: Path, *extra: str) -> list[str]:
    """`--config configs/demo.yaml` and `demo_overrides`: the arguments of launch/pretrain.sh."""
    return ["--config", DEMO, *demo_overrides(assets, out, *extra)]


def deepspeed_command(procs: int, *args: str, script: str = "launch/pretrain.sh", prefix: str = "") -> list[str]:
    """`deepspeed --num_gpus procs --master_port <free> script args`; `prefix` is shell run first in the same
    process (e.g. a `ulimit` for the whole job)."""
    command = ["deepspeed", "--num_gpus", str(procs), "--master_port", str(free_port()), script, *args]
    if prefix:
        return ["bash", "-c", prefix + ' && exec "$@"', "bash", *command]
    return command


def run(command: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None,
        timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run `command` to its end (output captured); fails the test, with the output so far, past `timeout`."""
    try:
        return subprocess.run(command, cwd=cwd, env=launch_env() if env is None else env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{command[:4]} did not finish within {timeout:.0f} s (a hang?):\n"
                             f"{_text(error.stdout)[-3000:]}\n{_text(error.stderr)[-3000:]}") from None


def run_ok(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`run`, failing the test with the output's tail unless the command exits 0."""
    result = run(command, **kwargs)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def dry_run(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launch/pretrain.sh --dry-run args` in this interpreter (resolves and validates the config, starts nothing);
    the world size comes from `--world-size`, never from a WORLD_SIZE of the test's environment."""
    if env is None:
        env = launch_env()
        env.pop("WORLD_SIZE", None)
    return run([sys.executable, str(REPO / "launch" / "pretrain.sh"), "--dry-run", *args], cwd=cwd, env=env,
               timeout=300)


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
