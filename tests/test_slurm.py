"""Slurm for real on this machine: munged, slurmctld and slurmd of our own (tools/local_cluster.py: a
generated slurm.conf with this host's CPUs, state, spool and munge key under a temporary folder), and the
literal `sbatch launch/slurm_pretrain.sbatch configs/demo.yaml ...` with 2 tasks (ZeRO-3, T=2, CPU).

* An uninterrupted job trains, writes its checkpoint and TensorBoard events, and exits 0.
* The same job again, given `scancel --signal=USR1` while training (what `--signal=USR1@300` does before
  the time limit): the ranks save at the next step boundary and exit 0, the script requeues the job, the
  requeued job resumes with train.resume=auto and finishes with bitwise the uninterrupted job's weights.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers.distributed import free_port
from helpers.launch import REPO, demo_overrides
from helpers.multinode import end_processes_with, local_cluster
from helpers.tensorboard import scalars as _scalars
from test_checkpoint_resume import _fp32_partitions

TIMEOUT = 420  # per job (a requeued one: both runs); a hang fails the test instead of blocking the suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(4 * TIMEOUT)]
STEPS = 8


class Slurm:
    def __init__(self, cluster: local_cluster.SlurmCluster) -> None:
        self.cluster = cluster
        self.jobs: list[str] = []
        # the job inherits this environment (sbatch --export=ALL); MASTER_PORT: a free port, never 29500
        self.env = cluster.env(dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port())))

    def command(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(list(args), cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{args} failed ({done.returncode}): {done.stdout} {done.stderr}")
        return done.stdout

    def submit(self, log: Path, overrides: list[str]) -> str:
        # 2 tasks on this one node, no GPU; everything else comes from the script's #SBATCH lines
        job = self.command("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                           "--cpus-per-task=1", f"--output={log}", "launch/slurm_pretrain.sbatch",
                           "configs/demo.yaml", *overrides).strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        fields = {}
        for item in self.command("scontrol", "show", "job", "--oneliner", job).split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait(self, job: str, log: Path, timeout: float = TIMEOUT, on_log=None) -> dict[str, str]:
        """The job's final record; `on_log(text)` sees the log while it runs. Cancels the job and fails on a hang."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if on_log is not None and log.exists():
                on_log(log.read_text())
            fields = self.job(job)
            if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return fields
            time.sleep(0.2)
        self.command("scancel", "--full", job, check=False)
        text = log.read_text()[-4000:] if log.exists() else "(no log)"
        raise AssertionError(f"job {job} did not end within {timeout:.0f} s:\n{text}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    cluster = local_cluster.SlurmCluster(root, free_port(), free_port())
    client = Slurm(cluster)
    try:
        yield client
    finally:
        for job in client.jobs:  # a failed test can leave a job running: end it before its daemons
            client.command("scancel", "--full", "--signal=KILL", job, check=False)
        cluster.stop()
        end_processes_with(f"SLURM_CONF={cluster.conf}")  # slurmstepd and job processes that outlived slurmd
        end_processes_with(str(root))


@pytest.fixture(scope="module")
def uninterrupted(slurm, assets, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    log = out.parent / "job.out"
    started = time.monotonic()
    job = slurm.submit(log, demo_overrides(assets, out, f"train.max_steps={STEPS}"))
    fields = slurm.wait(job, log)
    print(f"uninterrupted job: {time.monotonic() - started:.0f} s from sbatch to the end")
    return {"out": out, "job": fields, "log": log.read_text()}


@pytest.fixture(scope="module")
def preempted(slurm, assets, uninterrupted, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("preempted") / "run"
    log = out.parent / "job.out"
    job = slurm.submit(log, demo_overrides(assets, out, f"train.max_steps={STEPS}"))
    signalled, seen = [], {}

    def preempt_at_step_2(text: str) -> None:
        if not signalled and "step 2:" in text:
            slurm.command("scancel", "--signal=USR1", job)  # to every task of the job's steps: the ranks
            signalled.append(time.monotonic())
        for mark in ("requeueing", "(restart 1)"):
            if mark in text:
                seen.setdefault(mark, time.monotonic())

    started = time.monotonic()
    fields = slurm.wait(job, log, timeout=2 * TIMEOUT, on_log=preempt_at_step_2)
    if len(seen) == 2:
        print(f"pre-empted job: {time.monotonic() - started:.0f} s in all; requeue to the restarted script "
              f"{seen['(restart 1)'] - seen['requeueing']:.0f} s")
    return {"out": out, "job": fields, "log": log.read_text(), "signalled": bool(signalled)}


def test_sbatch_job_trains_writes_checkpoint_and_events_and_exits_0(uninterrupted):
    job, log, out = uninterrupted["job"], uninterrupted["log"], uninterrupted["out"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-4000:]
    assert job["Restarts"] == "0" and job["NumTasks"] == "2"
    assert "(restart 0): 2 ranks, 2 per node on 1 node(s)" in log
    assert "training steps 1..8: dp=1 tp=2 zero=3" in log
    assert (out / "latest").read_text().strip() == f"global_step{STEPS}"
    files = os.listdir(out / f"global_step{STEPS}")
    assert any("mp_rank_00" in f for f in files) and any("mp_rank_01" in f for f in files)  # both ranks saved
    scalars = _scalars(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, STEPS + 1))


def test_usr1_saves_requeues_and_the_requeued_job_finishes_bitwise(preempted, uninterrupted):
    job, log, out = preempted["job"], preempted["log"], preempted["out"]
    assert preempted["signalled"], log[-4000:]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-4000:]
    assert job["Restarts"] == "1", log[-4000:]  # requeued once, by the script
    assert "SIGUSR1 received (pre-emption): saving a checkpoint" in log, log[-4000:]
    stopped = int(log.split("(pre-empted): requeueing")[0].rsplit("stopped at step ", 1)[1].split()[0])
    assert 2 <= stopped < STEPS
    assert f"pre-empted at step {stopped}: global_step{stopped} saved" in log
    assert "(restart 1): 2 ranks, 2 per node on 1 node(s)" in log
    assert f"resumed from {out / f'global_step{stopped}'} at step {stopped}" in log
    assert f"training steps {stopped + 1}..{STEPS}" in log
    assert (out / "latest").read_text().strip() == f"global_step{STEPS}"
    resumed = _fp32_partitions(out / f"global_step{STEPS}")
    reference = _fp32_partitions(uninterrupted["out"] / f"global_step{STEPS}")
    assert resumed.keys() == reference.keys() and len(resumed) == 2
    for name in resumed:
        assert all(torch.equal(a, b) for a, b in zip(resumed[name], reference[name])), name
    got, want = _scalars(out / "tensorboard"), _scalars(uninterrupted["out"] / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm"):
        assert [s for s, _ in got[tag]] == list(range(1, STEPS + 1)), tag
        assert [v for _, v in got[tag]] == [v for _, v in want[tag]], tag
