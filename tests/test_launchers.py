"""How the trainer is started: torchrun and `python launch/pretrain.sh` alone (a world of one) log the losses
of DeepSpeed's launcher; `accelerate launch` and a rendezvous port another process holds are refused in one
line before any rank starts; the installed library versions are checked against the supported ranges."""

from __future__ import annotations

import os
import socket
import sys
import time
import tomllib

import pytest

from conftest import REPO_ROOT
from helpers.distributed import free_port
from helpers.launch import demo_args, deepspeed_command, launch_env, run, run_ok
from helpers.tensorboard import scalars as read_scalars

TIMEOUT = 420
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _no_launcher_env(**extra: str) -> dict[str, str]:
    env = launch_env(**extra)
    for name in LAUNCHER_VARIABLES:
        env.pop(name, None)
    return env


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(4 * TIMEOUT)
def test_torchrun_and_python_alone_log_the_deepspeed_launchers_losses(assets, tmp_path):
    """The demo for 2 steps three ways: `deepspeed --num_gpus 2` (T=2 by tp_size=auto, one DP rank of 8
    sequences), `torchrun --nproc_per_node 2` (the same layout) and `python launch/pretrain.sh` with no launcher
    (one process, T=1, the same 8 sequences): the same losses and gradient norms."""
    extra = ("train.max_steps=2", "checkpoint.save_final=false")
    runs = {name: tmp_path / name for name in ("deepspeed", "torchrun", "alone")}
    run_ok(deepspeed_command(2, *demo_args(assets, runs["deepspeed"], *extra)), timeout=TIMEOUT)
    torchrun = ["torchrun", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                "launch/pretrain.sh", *demo_args(assets, runs["torchrun"], *extra)]
    assert "dp=1 tp=2 zero=3" in run_ok(torchrun, timeout=TIMEOUT).stdout
    alone = run_ok([sys.executable, "launch/pretrain.sh", *demo_args(assets, runs["alone"], *extra[:1])],
                   env=_no_launcher_env(), timeout=TIMEOUT)  # its final checkpoint is evaluated below
    assert "dp=1 tp=1 zero=3" in alone.stdout and "mpi4py" not in alone.stderr
    # the evaluation tool on that run without a launcher: a world of one too (it was DeepSpeed's MPI discovery, a raw
    # "No module named 'mpi4py'"), and a tag the run does not hold is one line
    evaluated = run_ok([sys.executable, "tools/evaluate.py", "--run", str(runs["alone"]), "arithmetic_n=2",
                        "arithmetic_max_new_tokens=2"], env=_no_launcher_env(), timeout=TIMEOUT)
    assert "eval/arith/interpolation/n" in evaluated.stdout and "mpi4py" not in evaluated.stderr
    missing = run([sys.executable, "tools/evaluate.py", "--run", str(runs["alone"]), "--tag", "global_step9"],
                  env=_no_launcher_env(), timeout=TIMEOUT)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith(
        f"error: --tag global_step9: {str(runs['alone'])!r} has no such checkpoint (it has: global_step"), \
        missing.stderr[-2000:]
    for noise in ("FutureWarning", "before it has started", "built successfully"):  # ntl_pretrain/runtime/log_filter.py
        assert noise not in alone.stdout + alone.stderr, noise
    reference = read_scalars(runs["deepspeed"] / "tensorboard")
    for name in ("torchrun", "alone"):
        logged = read_scalars(runs[name] / "tensorboard")
        for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm"):
            assert [s for s, _ in logged[tag]] == [1, 2], (name, tag)
            assert [v for _, v in logged[tag]] == pytest.approx([v for _, v in reference[tag]], rel=2e-4, abs=1e-6), \
                (name, tag)


def test_accelerate_launch_is_refused_in_one_line(tmp_path):
    env = _no_launcher_env(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO")
    started = time.monotonic()
    result = run([sys.executable, "launch/pretrain.sh", "--config", "configs/demo.yaml",
                  f"train.output_dir={tmp_path / 'run'}"], env=env, timeout=TIMEOUT)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "`accelerate launch` is not supported" in errors[0] and "torchrun" in errors[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
    assert time.monotonic() - started < 60


@pytest.mark.slow  # the bash form runs the supervisor (it starts DeepSpeed's launcher when the port is free)
@pytest.mark.parametrize("form", ["bash", "rank"])
def test_a_busy_explicit_master_port_is_refused_before_any_rank_starts(assets, tmp_path, form):
    """`bash launch/pretrain.sh` with NTL_DEEPSPEED_ARGS="--master_port P" (the supervisor checks before it starts
    DeepSpeed's runner) and a rank 0 given MASTER_PORT=P by any launcher: one line naming P and how to choose
    another, exit 2, within seconds (not a rendezvous traceback after its retries)."""
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        args = demo_args(assets, tmp_path / "run", "train.max_steps=1")
        if form == "bash":
            command = ["bash", "launch/pretrain.sh", *args]
            env = launch_env(NTL_DEEPSPEED_ARGS=f"--master_port {busy}")
        else:
            command = [sys.executable, "launch/pretrain.sh", *args]
            env = launch_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy))
        started = time.monotonic()
        result = run(command, env=env, timeout=TIMEOUT)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"port {busy} is in use" in errors[0] and "--master_port N" in errors[0], errors
    assert "Traceback" not in result.stderr and "EADDRINUSE" not in result.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run").exists()


def test_the_supported_ranges_are_pyprojects(monkeypatch):
    from ntl_pretrain.core import versions

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name, spec in versions.SUPPORTED.items():
        assert f"{name}{spec}" in declared, (name, spec, declared)
    assert any(d.startswith("huggingface_hub") for d in declared)  # imported by model_loading and the export
    versions.check_versions()  # this environment is a supported one


@pytest.mark.parametrize("name,fake", [("deepspeed", "0.20.1"), ("transformers", "4.56.2"), ("transformers", None)])
def test_an_unsupported_library_version_is_named_with_the_supported_ranges(monkeypatch, capsys, name, fake):
    from ntl_pretrain import cli
    from ntl_pretrain.core import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda dist: fake if dist == name else real(dist))
    monkeypatch.setattr(sys, "argv", ["launch/pretrain.sh"])
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert cli.main(["--config", "configs/demo.yaml", "--dry-run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"{name} {fake or '(not installed)'} installed" in lines[0]
    assert all(f"{dist}{spec}" in lines[0] for dist, spec in versions.SUPPORTED.items())
    assert "RANK" not in os.environ  # refused before a world of one is set up


def test_untested_versions_run_with_a_warning_only_when_asked(monkeypatch, caplog):
    """NTL_ALLOW_UNTESTED_VERSIONS=1 turns the refusal into one warning naming the version; unset (or another
    value) it stays a refusal that names the variable."""
    from ntl_pretrain.core import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda dist: "5.99.0" if dist == "transformers" else real(dist))
    monkeypatch.setenv("NTL_ALLOW_UNTESTED_VERSIONS", "yes")
    with pytest.raises(versions.UnsupportedVersionError, match="NTL_ALLOW_UNTESTED_VERSIONS=1"):
        versions.check_versions()
    monkeypatch.setenv("NTL_ALLOW_UNTESTED_VERSIONS", "1")
    with caplog.at_level("WARNING", logger="ntl_pretrain"):
        versions.check_versions()
    assert [r.getMessage() for r in caplog.records if "transformers 5.99.0 installed" in r.getMessage()], caplog.text


def test_config_given_twice_and_a_bad_world_size_are_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """`--config a.yaml --config b.yaml` ran b silently (argparse keeps the last); refused naming both, before any
    file is read, and so is a --world-size below 1; one file in a folder with spaces still works."""
    from ntl_pretrain import cli

    monkeypatch.setattr(sys, "argv", ["launch/pretrain.sh"])
    for variable in LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert cli.main(["--config", "configs/demo.yaml", "--dry-run", "--config=configs/qwen2.5_0.5b_cpt.yaml"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --config is given 2 times (configs/demo.yaml, configs/qwen2.5_0.5b_cpt.yaml); give one "
                     "file and change single keys with key.sub=value overrides"], lines
    for size in ("0", "-2"):  # 0 was taken as unset (a world of 1), -2 failed with "max() arg is an empty sequence"
        assert cli.main(["--config", "configs/demo.yaml", "--dry-run", "--world-size", size]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: --world-size {size} is not a number of processes; give 1 or more"]
    spaced = tmp_path / "my configs" / "demo copy.yaml"
    spaced.parent.mkdir()
    spaced.write_text((REPO_ROOT / "configs" / "demo.yaml").read_text())
    assert cli.main(["--config", str(spaced), "--dry-run"]) == 0
    assert "dry run OK" in capsys.readouterr().out


@pytest.mark.slow  # bash launch/pretrain.sh: on a regression it starts DeepSpeed's launcher (refused by the config)
def test_a_bad_cpu_process_count_is_refused_before_the_launcher_starts(tmp_path):
    """NTL_CPU_PROCS=0 was a bash division by zero, `abc` an unbound variable, -1 started one process saying
    "starting -1 CPU processes": each is one line naming the value and the fix, exit 2, nothing started."""
    for procs in ("0", "abc", "-1", "2 2"):
        result = run(["bash", "launch/pretrain.sh", "--config", "configs/demo.yaml", f"train.output_dir={tmp_path / 'run'}",
                      "train.max_steps=-5"], env=launch_env(NTL_CPU_PROCS=procs), timeout=TIMEOUT)
        assert result.returncode == 2, (procs, result.stderr[-2000:])
        assert result.stderr.strip().splitlines() == [
            f"error: NTL_CPU_PROCS='{procs}' is not a positive number of CPU processes; set NTL_CPU_PROCS=N (default 2)"]
        assert not (tmp_path / "run").exists()


def test_a_port_taken_before_rank_0_binds_it_is_one_line_and_reported_to_the_supervisor(monkeypatch, capfd, tmp_path):
    """The race of issue 36: the port was free when it was checked (and chosen), another process took it before global
    rank 0's store bound it (the first start compiles DeepSpeed's CPU op meanwhile). Rank 0 says so in one line,
    names the port and the fix, writes nothing, and reports it to the supervisor, which starts again elsewhere."""
    from ntl_pretrain import cli
    from ntl_pretrain.runtime import launcher, lifecycle

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    supervisor_dir = tmp_path / "supervisor"
    supervisor_dir.mkdir()
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), **{lifecycle.SUPERVISOR_DIR_ENV: str(supervisor_dir)})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launcher, "check_rendezvous_port", lambda: None)  # the port was free when it was checked
    monkeypatch.setattr(sys, "argv", ["launch/pretrain.sh"])
    try:
        code = cli.main(["--config", "configs/demo.yaml", f"train.output_dir={tmp_path / 'run'}",
                         "train.dist_timeout_minutes=1"])
    finally:
        holder.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1, lines
    assert f"the rendezvous port {port} was taken by another process" in lines[0] and "--master_port N" in lines[0]
    assert "another rank ended" not in lines[0] and "checkpoint" not in lines[0]
    assert [p.name for p in supervisor_dir.iterdir()] == [f"{launcher.PORT_TAKEN_EVENT}.0.json"]
    assert not (tmp_path / "run").exists()


def test_the_supervisor_starts_again_on_another_port_only_when_it_chose_the_port(monkeypatch, capsys):
    """A taken port that the user did not name: the job starts again on a new free port (at most PORT_ATTEMPTS
    starts); a port the user named, or a multi-node job, is never moved."""
    from ntl_pretrain.runtime import supervisor

    monkeypatch.delenv("MASTER_PORT", raising=False)
    starts: list[list[str]] = []

    def start(args):
        starts.append(list(args))
        return (2, True) if len(starts) == 1 else (0, False)

    assert supervisor.run_with_port_retries(["--num_gpus", "2", "launch/pretrain.sh", "--config", "x"], start) == 0
    assert len(starts) == 2 and starts[1][0] == "--master_port" and starts[1][1].isdigit(), starts
    assert starts[1][2:] == starts[0], starts
    assert "starting again on port" in capsys.readouterr().err
    port = str(free_port())  # a start that is never launched, but no fixed port all the same
    for named in (["--master_port", port], [f"--master_port={port}"], ["--hostfile", "hosts"]):
        starts.clear()
        assert supervisor.run_with_port_retries([*named, "launch/pretrain.sh"], start) == 2
        assert len(starts) == 1, named
    starts.clear()
    always_taken = lambda args: (starts.append(args), (2, True))[1]  # noqa: E731
    assert supervisor.run_with_port_retries(["launch/pretrain.sh"], always_taken) == 2
    assert len(starts) == supervisor.PORT_ATTEMPTS
