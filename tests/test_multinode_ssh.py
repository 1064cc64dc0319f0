"""Two nodes over ssh on this machine, through DeepSpeed's pdsh runner, with the literal user command.

tools/local_cluster.py starts an sshd of our own on 127.0.0.1 and 127.0.0.2 (generated host and user keys,
all under a temporary folder), names them node1 and node2 in an ssh client config of our own, and writes a
hostfile with `slots=1` each. `deepspeed --hostfile H launch/pretrain.sh --config configs/demo.yaml ...`
then runs one rank per node (its passwordless-ssh check included; no --no_ssh, no --no_ssh_check); the
environment reaches the remote ranks through DeepSpeed's .deepspeed_env file (DS_ENV_FILE names ours).

* T=1/dp=2 across the nodes gives the single-node 2-process T=2 run's losses (the tolerance of
  tests/test_train_e2e.py).
* T=2 across the nodes, SIGKILL to node2's rank after step 3: every process on both nodes ends within
  train.dist_timeout_minutes (1), nothing hangs; train.resume=auto continues from the last complete
  checkpoint, and steps 1..6 give the single-node losses.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from helpers.distributed import free_port
from helpers.launch import DEMO, REPO, demo_overrides, deepspeed_command, launch_env
from helpers.multinode import LoggedRun, end_processes_with, local_cluster, processes_with
from helpers.tensorboard import scalars as _scalars

from ntl_pretrain.checkpoint import verify_checkpoint  # noqa: E402

TIMEOUT = 420  # a hang (a rank waiting on a dead one) fails the test instead of blocking the suite
DIST_TIMEOUT_MINUTES = 1
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(6 * TIMEOUT)]
TAGS = ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ssh_cluster")
    nodes = local_cluster.SshCluster(root, free_port())
    # what every rank needs, on every node: DeepSpeed's runner exports only PYTHON*, MLFLOW*, MV2*, UCX*
    # variables of its own environment; the rest comes from .deepspeed_env
    env_file = root / "deepspeed_env"
    env_file.write_text(f"DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\nPYTHONPATH={REPO}\nPYTHONUNBUFFERED=1\n")
    env = nodes.env(dict(os.environ, DS_ENV_FILE=str(env_file), PYTHONUNBUFFERED="1"))
    for key in ("DS_ACCELERATOR", "OMP_NUM_THREADS"):  # so the remote ranks can only have them from the file
        env.pop(key, None)
    try:
        yield nodes, env
    finally:
        nodes.stop()
        end_processes_with(str(tmp_path_factory.getbasetemp()))


def _two_nodes(cluster, assets: Path, out: Path, *extra: str) -> LoggedRun:
    nodes, env = cluster
    command = ["deepspeed", "--hostfile", str(nodes.hostfile), "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), "launch/pretrain.sh", "--config", DEMO, *demo_overrides(assets, out, *extra)]
    return LoggedRun(command, env)


@pytest.fixture(scope="module")
def single_node(assets, tmp_path_factory) -> tuple[Path, LoggedRun]:
    """The reference: one node, 2 processes, ZeRO-3, T=2."""
    out = tmp_path_factory.mktemp("single") / "run"
    run = LoggedRun(deepspeed_command(2, "--config", DEMO, *demo_overrides(
        assets, out, "parallel.tp_size=2", "train.max_steps=6", "checkpoint.save_final=false")), launch_env())
    assert run.wait(TIMEOUT) == 0, run.output[-4000:]
    return out, run


def _assert_losses_match(got_dir: Path, want_dir: Path, steps: int) -> float:
    """Same losses for steps 1..steps; returns the largest relative difference."""
    got, want = _scalars(got_dir / "tensorboard"), _scalars(want_dir / "tensorboard")
    worst = 0.0
    for tag in TAGS:
        assert [s for s, _ in got[tag]] == list(range(1, steps + 1)), tag
        a, b = [v for _, v in got[tag]], [v for _, v in want[tag][:steps]]
        assert a == pytest.approx(b, rel=2e-4, abs=1e-6), tag
        worst = max([worst] + [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)])
    return worst


def test_t1_dp2_across_two_nodes_matches_one_node(cluster, assets, request, tmp_path):
    out = tmp_path / "run"
    # the same global batch: T=2 has 1 DP rank x 8 sequences, T=1 has 2 DP ranks x 4
    run = _two_nodes(cluster, assets, out, "parallel.tp_size=1", "data.micro_batch_size=4", "train.max_steps=4",
                     "checkpoint.save_final=false")
    assert run.wait(TIMEOUT) == 0, run.output[-4000:]
    reference, _ = request.getfixturevalue("single_node")  # after this run, which built the demo assets
    output = run.output
    assert "cmd = pdsh -S -f 1024 -w node1,node2" in output  # DeepSpeed's pdsh runner, both hosts
    assert "node1: " in output and "node2: " in output
    assert "nnodes=2, num_local_procs=1, node_rank=1" in output  # node2 runs one rank as node 1
    assert output.count("exits successfully") == 2
    assert "dp=2 tp=1 zero=3" in output
    worst = _assert_losses_match(out, reference, 4)
    print(f"T=1 dp=2, two nodes vs one node: largest relative loss difference {worst:.2e}")


def _rank_process(out: Path, rank: int) -> psutil.Process | None:
    for proc in processes_with(f"train.output_dir={out}"):
        try:
            if "launch/pretrain.sh" in proc.cmdline() and proc.environ().get("RANK") == str(rank) \
                    and "deepspeed.launcher.launch" not in " ".join(proc.cmdline()):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.fixture(scope="module")
def killed_and_resumed(cluster, assets, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("killed") / "run"
    info: dict = {"out": out}
    # T=2 across the nodes, said explicitly: the demo's tp_size=auto would choose T=1 with one process per node
    extra = ("parallel.tp_size=2", "train.max_steps=6", "checkpoint.every_n_steps=1",
             f"train.dist_timeout_minutes={DIST_TIMEOUT_MINUTES}")
    run = _two_nodes(cluster, assets, out, *extra)
    try:
        info["first_step_s"] = run.wait_for_line("step 1:", TIMEOUT)
        run.wait_for_line("step 3:", TIMEOUT)
        victim = _rank_process(out, 1)
        assert victim is not None, "node2's rank (RANK=1) not found"
        info["victim_parent"] = " ".join(victim.parent().cmdline())
        victim.kill()
        killed_at = time.monotonic()
        info["rc"] = run.wait(TIMEOUT)
        while processes_with(f"train.output_dir={out}") and time.monotonic() - killed_at < TIMEOUT:
            time.sleep(0.2)
        info["ended_s"] = time.monotonic() - killed_at
        info["left"] = end_processes_with(f"train.output_dir={out}")
    finally:
        run.kill()
    info["killed_output"] = run.output
    info["latest"] = (out / "latest").read_text().strip()
    info["latest_manifest"] = verify_checkpoint(str(out / info["latest"]))  # complete (before the resume prunes it)
    resumed = _two_nodes(cluster, assets, out, *extra, "train.resume=auto")
    assert resumed.wait(TIMEOUT) == 0, resumed.output[-4000:]
    info["resume_output"] = resumed.output
    return info


def test_sigkill_on_one_node_ends_both_nodes_and_resume_continues(killed_and_resumed, single_node):
    info = killed_and_resumed
    out = info["out"]
    assert "--node_rank=1" in info["victim_parent"]  # the rank killed ran on node2, under DeepSpeed's launcher there
    assert info["rc"] != 0, info["killed_output"][-3000:]
    assert info["left"] == [], info["left"]  # nothing outlived the runner's exit and the wait
    assert info["ended_s"] < DIST_TIMEOUT_MINUTES * 60, info["killed_output"][-3000:]
    node1_error = next((line for line in info["killed_output"].splitlines() if line.startswith("node1:") and "Error" in line),
                       "(no error line from node1)")
    print(f"SIGKILL of node2's rank: every process of the run ended {info['ended_s']:.1f} s later; node1: "
          f"{node1_error[:300]}")
    latest = info["latest"]
    assert info["latest_manifest"]["step"] == int(latest[len("global_step"):]) >= 1
    assert f"resumed from {out / latest} at step {latest[len('global_step'):]}" in info["resume_output"]
    assert (out / "latest").read_text().strip() == "global_step6"
    reference, local = single_node
    worst = _assert_losses_match(out, reference, 6)
    print(f"T=2 two nodes (killed, resumed) vs one node: largest relative loss difference {worst:.2e}; launch to "
          f"step 1 (T=2, assets built): {info['first_step_s']:.1f} s over ssh, {local.seconds_to('step 1:'):.1f} s "
          f"on one node")
