"""The process lifecycle outside the step (ntl_pretrain/runtime/lifecycle.py): the run-folder lock, bounded start-up
waits, the TP size chosen for the world, errors printed once, DeepSpeed's compiled op per environment.

The lock is held by a real second process (and then killed with SIGKILL); the start-up wait is a real
rendezvous that one rank of two never joins; the error-once check starts the real entry point as two
ranks; a rank that raises or is stopped (SIGSTOP) past the collective timeout is one of three real gloo
ranks. Two-run and signal tests with the launcher are in tests/test_signals.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ntl_pretrain.parallel import distributed
from ntl_pretrain.runtime import lifecycle
from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.runtime.lifecycle import RunLock, RunLockError

from helpers.distributed import finish_ranks, free_port, start_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")


def _hold_lock(folder: Path) -> subprocess.Popen:
    script = ("import sys, time; from ntl_pretrain.runtime.lifecycle import RunLock\n"
              "lock = RunLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_run_lock_names_the_holder_and_is_free_after_kill_9(tmp_path):
    out = tmp_path / "run"
    holder = _hold_lock(out)
    try:
        with pytest.raises(RunLockError) as info:
            RunLock(str(out)).acquire()
        message = str(info.value)
        assert f"train.output_dir={str(out)!r} is in use by another run (pid {holder.pid} on host " \
               f"{socket.gethostname()}" in message and "choose another train.output_dir" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock = RunLock(str(out))  # a killed holder leaves the file, not the lock
    lock.acquire()
    lock.release()
    again = RunLock(str(out))
    again.acquire()
    again.release()


def test_failed_start_leaves_no_folder_it_created(tmp_path):
    lock = RunLock(str(tmp_path / "new"))
    lock.acquire()
    lock.release(failed=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    lock = RunLock(str(tmp_path / "old"))
    lock.acquire()
    lock.release(failed=True)
    assert (tmp_path / "old").is_dir()  # the user's folder stays


def _demo_cfg(*overrides: str):
    return load_config(DEMO, list(overrides))


@pytest.mark.parametrize("world,local,expected", [(1, 1, 1), (2, 2, 2), (3, 3, 1), (4, 4, 2), (8, 8, 2),
                                                  (6, 3, 1), (16, 8, 2)])
def test_demo_tp_size_auto_divides_the_world_and_the_heads(world, local, expected):
    cfg = _demo_cfg()
    assert cfg.parallel.tp_size == "auto"  # the demo runs on 1, 2, 3, 4 or 8 GPUs and on CPU
    note = distributed.resolve_tp_size(cfg, world, local)
    assert cfg.parallel.tp_size == expected
    assert f"using tp_size={expected} for world size {world}" in note and f"dp={world // expected}" in note
    distributed.check_tp_divides(world, cfg.parallel.tp_size)


def test_tp_size_auto_reads_a_local_model_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"num_attention_heads": 12, "num_key_value_heads": 4}')
    cfg = _demo_cfg(f"model.name_or_path={tmp_path / 'm'}", "model.architecture={}", "parallel.tp_size=auto")
    distributed.resolve_tp_size(cfg, 8, 8)
    assert cfg.parallel.tp_size == 4
    with pytest.raises(ConfigError, match="parallel.tp_size must be an integer or one of auto, got str 'biggest'"):
        _demo_cfg("parallel.tp_size=biggest")


def test_tp_message_names_the_fix_for_gpus_and_cpus(monkeypatch):
    monkeypatch.setattr(distributed, "_on_cpu", lambda: False)
    with pytest.raises(ConfigError) as info:
        distributed.check_tp_divides(1, 2)
    assert "set parallel.tp_size=1" in str(info.value) and "CPU processes" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        distributed.check_tp_divides(6, 4)
    assert "set parallel.tp_size=3 (or another divisor of 6: 1, 2, 3, 6)" in str(info.value)
    monkeypatch.setattr(distributed, "_on_cpu", lambda: True)
    with pytest.raises(ConfigError) as info:
        distributed.check_tp_divides(3, 2)
    message = str(info.value)
    assert "set parallel.tp_size=1" in message and "NTL_CPU_PROCS=2 bash launch/pretrain.sh" in message
    assert "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 launch/pretrain.sh" in message


def test_extensions_folder_is_per_environment(monkeypatch, tmp_path):
    # use_environment_extensions_dir() writes os.environ itself; on a copy, nothing leaks into later tests
    # (a leaked folder of a made-up prefix sent every later DeepSpeed start to wait on a stale build lock)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    found = []
    for venv in ("a", "b"):
        (tmp_path / venv).mkdir()
        monkeypatch.setattr(sys, "prefix", str(tmp_path / venv))
        found.append(lifecycle.environment_extensions_dir())
    assert found == [str(tmp_path / "a" / "torch_extensions"), str(tmp_path / "b" / "torch_extensions")]
    monkeypatch.setattr(sys, "prefix", "/usr")  # no virtualenv: a per-prefix folder of the user's cache
    plain = lifecycle.environment_extensions_dir()
    monkeypatch.setattr(sys, "prefix", "/opt/other-python")
    monkeypatch.setattr(sys, "base_prefix", "/opt/other-python")
    assert plain != lifecycle.environment_extensions_dir() and "torch_extensions" in plain
    assert lifecycle.use_environment_extensions_dir() == os.environ["TORCH_EXTENSIONS_DIR"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert lifecycle.use_environment_extensions_dir() == str(tmp_path / "mine")  # the user's setting wins


class _StandInBuilder:
    """DeepSpeed's op builder as `lifecycle.announce_shm_op_build` uses it; `load` builds as torch does: it takes
    the folder's lock, runs a stand-in compiler in the folder, writes the library and drops the lock."""

    name = NAME = "deepspeed_shm_comm"

    def __init__(self, folder: Path, build_s: float) -> None:
        self.folder, self.build_s, self.loads = folder, build_s, 0

    def load(self, verbose: bool = False) -> None:
        self.loads += 1
        self.folder.mkdir(exist_ok=True)
        (self.folder / "lock").write_bytes(b"")
        subprocess.run([sys.executable, "-c", f"import time; time.sleep({self.build_s})"], cwd=self.folder, check=True)
        (self.folder / f"{self.name}.so").write_bytes(b"")
        (self.folder / "lock").unlink()


def test_the_op_build_is_announced_with_the_time_so_far_and_only_when_needed(monkeypatch, tmp_path, capsys):
    folder = tmp_path / "deepspeed_shm_comm"
    builder = _StandInBuilder(folder, build_s=1.2)
    monkeypatch.setattr(lifecycle, "_shm_op_to_build", lambda: (builder, str(folder)))
    monkeypatch.setattr(lifecycle, "BUILD_NOTICE_EVERY_S", 0.3)
    lifecycle.announce_shm_op_build(local_rank=0)
    err = capsys.readouterr().err
    assert "compiling DeepSpeed's CPU communication op (deepspeed_shm_comm)" in err and builder.loads == 1
    repeats = [line for line in err.splitlines() if line.startswith("still compiling DeepSpeed's CPU communication op")]
    assert len(repeats) >= 2 and all(re.search(r": \d+ s so far", line) for line in repeats), err
    lifecycle.announce_shm_op_build(local_rank=0)  # built: nothing to say, nothing built
    lifecycle.announce_shm_op_build(local_rank=1)
    assert capsys.readouterr().err == "" and builder.loads == 1


def test_after_a_killed_build_local_rank_0_alone_decides_and_the_others_wait_for_its_build(monkeypatch, tmp_path):
    """The race of a restart after a killed build: a stale lock and no library. Rank 1 must not take the lock's
    removal by local rank 0 for a finished build: it returns only once the library is there; it never loads."""
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    (folder / "lock").write_bytes(b"")
    old = time.time() - 120
    os.utime(folder / "lock", (old, old))
    builder = _StandInBuilder(folder, build_s=1.0)
    monkeypatch.setattr(lifecycle, "_shm_op_to_build", lambda: (builder, str(folder)))
    monkeypatch.setattr(lifecycle, "BUILD_POLL_S", 0.01)
    waiter_saw: list[bool] = []
    waiter = threading.Thread(target=lambda: (lifecycle.announce_shm_op_build(local_rank=1),
                                              waiter_saw.append((folder / "deepspeed_shm_comm.so").exists())))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # waits on the stale lock without touching it
    lifecycle.announce_shm_op_build(local_rank=0)  # removes the stale lock, builds
    waiter.join(timeout=30)
    assert waiter_saw == [True] and builder.loads == 1 and not (folder / "lock").exists()


_STOPPED_BUILD_SCRIPT = """
import subprocess, sys, time
from pathlib import Path
from ntl_pretrain.runtime import lifecycle

folder = Path(sys.argv[1])

class Builder:
    name = NAME = "deepspeed_shm_comm"
    def load(self, verbose=False):
        folder.mkdir(exist_ok=True)
        (folder / "lock").write_bytes(b"")
        compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=folder)
        (folder / "compiler.pid.tmp").write_text(str(compiler.pid))
        (folder / "compiler.pid.tmp").rename(folder / "compiler.pid")  # whole when it appears (the test polls)
        compiler.wait()

lifecycle._shm_op_to_build = lambda: (Builder(), str(folder))
lifecycle.announce_shm_op_build(local_rank=0)
print("the build returned", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_the_op_build_stops_at_once_saying_nothing_is_saved(tmp_path, signum):
    import psutil

    folder = tmp_path / "deepspeed_shm_comm"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_BUILD_SCRIPT, str(folder)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (folder / "compiler.pid").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    compiler = int((folder / "compiler.pid").read_text())
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, err
    assert f"{signal.Signals(signum).name} while compiling DeepSpeed's CPU communication op, before step 1" in err
    assert "nothing is saved" in err and "the build returned" not in out
    assert not (folder / "lock").exists()  # the next start neither waits on it nor races its removal
    # killed: gone, or a zombie, once the kernel has delivered the SIGKILL (on a loaded machine: not at once)
    deadline = time.time() + 20
    while psutil.pid_exists(compiler) and psutil.Process(compiler).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < deadline, f"the compiler (pid {compiler}) outlived the stopped build"
        time.sleep(0.1)


def test_the_supervisor_ends_the_job_at_once_on_a_stop_before_any_rank_started(tmp_path):
    """Ctrl-C to `bash launch/pretrain.sh` while DeepSpeed's op compiles (no rank registered yet): no promise of
    a checkpoint at a step boundary; the job (here a stand-in runner) ends within seconds."""
    import psutil

    script = ("import sys, tempfile\nfrom ntl_pretrain.runtime.supervisor import Supervisor\n"
              "sys.exit(Supervisor([sys.executable, '-c', 'import time; time.sleep(120)'], tempfile.mkdtemp()).run())")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, text=True, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    runner = []
    while not runner and time.time() < deadline:
        runner = psutil.Process(proc.pid).children()
        time.sleep(0.1)
    time.sleep(0.5)  # the supervisor's handlers are installed before it starts the runner
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - started < 20, err
    assert "before any rank started training" in err and "nothing is saved" in err
    assert "next step boundary" not in err
    assert not runner[0].is_running() or runner[0].status() == psutil.STATUS_ZOMBIE


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(monkeypatch, tmp_path):
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    assert lifecycle.clear_stale_build_lock(str(folder)) is None  # no lock, nothing to do
    lock = folder / "lock"
    lock.write_bytes(b"")
    old = time.time() - 120
    os.utime(lock, (old, old))
    # a build in progress: ninja and the compiler work in the folder (here a stand-in process)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder)
    try:
        deadline = time.time() + 10
        while not lifecycle._local_process_works_in(str(folder)) and time.time() < deadline:
            time.sleep(0.05)
        assert "waiting for the build" in lifecycle.clear_stale_build_lock(str(folder)) and lock.exists()
    finally:
        builder.kill()
        builder.wait()
    monkeypatch.setattr(lifecycle, "filesystem_type", lambda path: "nfs4")  # another node may be compiling
    note = lifecycle.clear_stale_build_lock(str(folder))
    assert "shared filesystem" in note and f"rm {lock}" in note and lock.exists()
    monkeypatch.setattr(lifecycle, "filesystem_type", lambda path: "ext4")
    assert "removed" in lifecycle.clear_stale_build_lock(str(folder)) and not lock.exists()
    lock.write_bytes(b"")  # just created: a build that has not started its compiler yet
    assert "waiting for the build" in lifecycle.clear_stale_build_lock(str(folder)) and lock.exists()


def test_filesystem_type_reads_the_mount_table(tmp_path):
    assert lifecycle.filesystem_type("/proc") == "proc"
    assert lifecycle.filesystem_type(str(tmp_path)) not in ("", "proc")


def _ranks(world: int, ranks: list[int], overrides: list[str], tmp_path: Path,
           port: int | None = None) -> list[subprocess.Popen]:
    return start_ranks([sys.executable, str(REPO / "launch" / "pretrain.sh"), "--config", DEMO,
                        f"train.output_dir={tmp_path / 'run'}", *overrides], world, ranks=ranks, port=port, cwd=tmp_path)


def _outputs(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    return [out for out, _ in finish_ranks(procs, timeout)]


@pytest.mark.multiprocess
def test_a_rank_that_never_joins_fails_the_start_within_the_limit(tmp_path):
    """Rank 1 of 2 is never started: rank 0 stops after train.startup_timeout_s with what it waited for."""
    started = time.monotonic()
    (proc,) = _ranks(2, [0], ["train.startup_timeout_s=5"], tmp_path)
    (output,) = _outputs([proc], timeout=240)
    assert proc.returncode != 0
    assert "error: rank 0 waited 5 s for DeepSpeed's communication start-up" in output, output[-3000:]
    assert "rendezvous of 2 processes at 127.0.0.1:" in output
    assert time.monotonic() - started < 200


@pytest.mark.multiprocess
@pytest.mark.parametrize("overrides,message,hint", [
    (["parallel.tp_size=3"], "parallel.tp_size=3 does not divide the world size 2",
     "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 3"),
    (["data.sources.0.path=missing.jsonl", "data.sources.0.generate_arithmetic=0"],
     "data.sources.0.path='missing.jsonl': no such file or folder", "working directory"),
])
def test_an_error_of_every_rank_is_printed_once_before_the_communication_start_up(tmp_path, overrides, message, hint):
    procs = _ranks(2, [0, 1], [*overrides, "--verbose"], tmp_path)  # --verbose: DeepSpeed's op line unfiltered
    outputs = _outputs(procs, timeout=240)
    assert [p.returncode for p in procs] == [2, 2], outputs
    joined = "".join(outputs)
    assert joined.count(message) == 1, joined[-3000:]
    assert hint in joined
    assert "built successfully" not in joined  # refused before DeepSpeed's communication start-up
    assert not (tmp_path / "run").exists()


def test_a_start_up_wait_that_never_ends_names_what_it_waited_for():
    script = ("import time\nfrom ntl_pretrain.runtime.lifecycle import StartupWatchdog\n"
              "with StartupWatchdog(1.0, notice_s=0.3).waiting('global rank 0 to prepare the corpus'):\n"
              "    time.sleep(120)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=str(REPO), RANK="1"))
    assert result.returncode == 3
    assert "[rank 1] still waiting for global rank 0 to prepare the corpus after 0 s" in result.stderr
    assert "error: rank 1 waited 1 s for global rank 0 to prepare the corpus" in result.stderr


@pytest.mark.multiprocess
def test_a_finished_run_leaves_no_shared_memory_buffer(tmp_path):
    """Two ranks started directly (no launcher): both exit 0 and DeepSpeed's 66 MiB /dev/shm buffers of
    this rendezvous are gone."""
    overrides = ["data.sources.0.generate_arithmetic=2000", "data.validation_documents=100", "train.max_steps=1",
                 "train.val_every_n_steps=-1", "eval.at_end=false", "checkpoint.save_final=false",
                 "monitor.progress_bar=never"]
    port = free_port()
    procs = _ranks(2, [0, 1], overrides, tmp_path, port)
    outputs = _outputs(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-2000:] for o in outputs)
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))
    assert "run summary: finished at step 1" in outputs[0]


def test_a_one_node_job_gets_a_free_port_when_the_default_is_taken(monkeypatch):
    from ntl_pretrain.runtime import supervisor

    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setattr(supervisor, "DEEPSPEED_DEFAULT_HOSTFILE", "/nonexistent/hostfile")
    args = ["--num_gpus", "2", "launch/pretrain.sh", "--config", "c.yaml", "--master_port", "7"]
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        moved = supervisor.with_free_master_port(args, default_port=busy)
        assert moved[0] == "--master_port" and int(moved[1]) != busy and moved[2:] == args
        # the user's own choice, several nodes, or a port in the environment: left as given
        own = str(free_port())  # never a fixed port: other runs share the machine
        for chosen in (["--master_port", own, *args], ["--hostfile", "hosts.sh", *args],
                       [f"--master_port={own}", *args]):
            assert supervisor.with_free_master_port(chosen, default_port=busy) == chosen
        monkeypatch.setenv("MASTER_PORT", own)
        assert supervisor.with_free_master_port(args, default_port=busy) == args
    monkeypatch.delenv("MASTER_PORT")
    assert supervisor.with_free_master_port(args, default_port=free_port()) == args  # default free: unchanged


_RUN_PROCESS_SCRIPT = """
import atexit, sys
import torch
import torch.distributed as dist
from ntl_pretrain.parallel.distributed import run_process

case = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *a, **k: (print("group destroyed"), destroy(*a, **k))

def main():
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"sum {int(total)}")  # buffered (stdout is a pipe): run_process must flush it
    if case == "raises":
        raise ValueError("broken input")
    if case == "exit message":
        sys.exit("stopped: a message")
    return {"returns 3": 3, "returns None": None}.get(case, 0)

run_process(main)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, code, stderr_has", [("returns 3", 3, ""), ("returns None", 0, ""),
                                                     ("raises", 1, "ValueError: broken input"),
                                                     ("exit message", 1, "stopped: a message")])
def test_run_process_exits_with_mains_code_after_destroying_the_group_and_flushing(case, code, stderr_has):
    """Two gloo ranks through `distributed.run_process`: each ends with main's code (an exception: its traceback
    and 1), its buffered output written, the process group destroyed first, and no atexit handler run (the
    interpreter's teardown is skipped)."""
    procs = start_ranks([sys.executable, "-c", _RUN_PROCESS_SCRIPT, case], 2, merge_stderr=False,
                        extra_env={"PYTHONUNBUFFERED": ""})
    outputs = finish_ranks(procs, timeout=120, what="run_process ranks")
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == code, (out, err)
        assert out.splitlines() == ["sum 2", "group destroyed"], (out, err)
        assert stderr_has in err


def test_run_lock_never_follows_a_link_nor_writes_into_a_shared_file(tmp_path):
    """A `.run.lock` planted as a link (or a hard link) to someone's file is refused by name, the file untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".run.lock").symlink_to(victim)
    with pytest.raises(RunLockError, match=rf"^{str(out / '.run.lock')!r} is a symbolic link, which the run lock "
                                           rf"never follows; remove it"):
        RunLock(str(out)).acquire()
    assert victim.read_text() == "precious"
    (out / ".run.lock").unlink()
    os.link(victim, out / ".run.lock")
    with pytest.raises(RunLockError, match=r"\.run\.lock' has other hard links, which the run lock never writes into"):
        RunLock(str(out)).acquire()
    assert victim.read_text() == "precious"
    (out / ".run.lock").unlink()
    (out / ".run.lock").mkdir()
    with pytest.raises(RunLockError, match=r"\.run\.lock' is a folder, not the run lock file"):
        RunLock(str(out)).acquire()
    (out / ".run.lock").rmdir()
    os.mkfifo(out / ".run.lock")
    with pytest.raises(RunLockError, match=r"\.run\.lock' is not a regular file"):
        RunLock(str(out)).acquire()


_PEER_SCRIPT = """
import datetime, os, signal, sys
import torch.distributed as dist
from ntl_pretrain.parallel.distributed import run_process

case = sys.argv[1]

def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    dist.barrier()
    if case == "rank 0 raises" and dist.get_rank() == 0:
        raise ValueError("broken input on rank 0 only")
    if case.startswith("rank") and case.endswith("stalls") and dist.get_rank() == int(case.split()[1]):
        os.kill(os.getpid(), signal.SIGSTOP)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dist.get_rank())

run_process(main, lost_peer_hint="rerun with train.resume=auto")
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, stalled", [("rank 0 raises", None), ("rank 2 stalls", 2), ("rank 0 stalls", 0)])
def test_ranks_that_lose_a_peer_exit_with_one_line(case, stalled):
    """Three gloo ranks; one raises (its traceback) or stops (SIGSTOP) past the collective timeout: every other
    rank exits with one `error:` line saying what happened to which rank and how to resume, no gloo trace."""
    procs = start_ranks([sys.executable, "-c", _PEER_SCRIPT, case], 3, merge_stderr=False)
    if stalled is not None:
        others = [proc for rank, proc in enumerate(procs) if rank != stalled]
        outputs = finish_ranks(others, timeout=120, what="the ranks that did not stall")
        procs[stalled].kill()
        procs[stalled].communicate(timeout=30)
    else:
        raised, *outputs = finish_ranks(procs, timeout=120)
        others = procs[1:]
        assert "ValueError: broken input on rank 0 only" in raised[1]
    for proc, (_, err) in zip(others, outputs):
        lines = err.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, err
        if stalled is None:
            assert "another rank ended while this one waited in a collective (" in lines[0], err
        else:
            assert re.search(rf"a collective timed out \(.*\): global rank {stalled}( \(.*\))? stalled \(", lines[0]), err
        assert lines[0].startswith("error: [rank ") and lines[0].endswith("; rerun with train.resume=auto"), err


@pytest.mark.multiprocess
def test_a_folder_with_another_runs_checkpoints_is_refused_once_by_two_ranks(tmp_path):
    """The refusal every rank finds when it reads the run folder (after the communication start-up) is printed
    by global rank 0 alone, as docs/training.md says; each rank exits 2."""
    (tmp_path / "run" / "global_step5").mkdir(parents=True)
    (tmp_path / "run" / "latest").write_text("global_step5")
    procs = _ranks(2, [0, 1], [], tmp_path)
    outputs = _outputs(procs, timeout=240)
    assert [p.returncode for p in procs] == [2, 2], outputs
    joined = "".join(outputs)
    assert joined.count("already holds checkpoints of another run") == 1, joined[-3000:]


def test_a_stop_signal_before_step_1_ends_the_process_at_once_and_later_one_waits_for_the_step_boundary():
    """No step has run during start-up, so a stop signal there ends the rank at once saying nothing is saved;
    once training starts the same signal is recorded for the next step boundary."""
    script = ("import os, signal, time\nfrom ntl_pretrain.trainer.preemption import PreemptionHandler\n"
              "handler = PreemptionHandler(['SIGTERM'], 60.0)\nhandler.install()\n"
              "if os.environ.get('TRAINING'):\n    handler.training_starts()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.5)\n"
              "print('at the step boundary:', handler.requested(), flush=True)\nhandler.uninstall()\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="1")
    before = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert before.returncode == 128 + signal.SIGTERM, before.stderr
    assert ("error: [rank 1] SIGTERM received before step 1 (during start-up): stopped at once, nothing is saved"
            in before.stderr)
    assert "at the step boundary" not in before.stdout
    during = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=dict(env, TRAINING="1"))
    assert during.returncode == 0, during.stderr
    assert "at the step boundary: SIGTERM" in during.stdout


_CLI_STALL_SCRIPT = """
import datetime, os, signal
from types import SimpleNamespace
import torch.distributed as dist
from ntl_pretrain import cli

class StallingTrainer:  # the trainer's collectives, one rank stopped (SIGSTOP) past the collective timeout
    def __init__(self, cfg):
        self.parts = SimpleNamespace(lock=SimpleNamespace(release=lambda: None))  # the Trainer's parts.lock
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))

    def fit(self):
        dist.barrier()
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_gather_object([None] * dist.get_world_size(), dist.get_rank())

    def close_after_failure(self):  # the Trainer's: its monitor closed as failed (none here)
        pass

cli.Trainer, cli.load_config, cli.check_versions = StallingTrainer, lambda path, overrides: None, lambda: None
launcher = cli.launcher
launcher.check_accelerate_launch = launcher.use_world_of_one = launcher.check_rendezvous_port = lambda: None
cli.distributed.run_process(lambda: cli.main([]), lost_peer_hint=cli.LOST_PEER_HINT)
"""


def _without_torch_cpp_warnings(err: str) -> str:
    """`err` less torch's C++ log blocks: a `[rankN]:[W...` line and the indented / frame lines that follow it."""
    kept, in_block = [], False
    for line in err.splitlines():
        if re.match(r"\[rank\d+\]:\[[WE]\d{4} ", line):
            in_block = True
            continue
        if in_block and (line.startswith(("  ", "frame #", "Exception raised from", "<omitting")) or not line.strip()):
            continue
        in_block = False
        kept.append(line)
    return "\n".join(kept)


@pytest.mark.multiprocess
def test_the_trainers_command_line_names_the_rank_that_stalled():
    """Issue 40 item 14: cli.main's `finally` shut the process group down before `run_process` asked which rank
    stalled: a thread's `ValueError: Default process group has not been initialized` traceback, then "global rank 0"
    named when rank 1 was stopped. Now one line naming rank 1 on each rank that waited."""
    procs = start_ranks([sys.executable, "-c", _CLI_STALL_SCRIPT], 3, merge_stderr=False)
    others = [procs[0], procs[2]]
    outputs = finish_ranks(others, timeout=120, what="the ranks that did not stall")
    procs[1].kill()
    procs[1].communicate(timeout=30)
    for proc, (_, err) in zip(others, outputs):
        # torch's c10d may log its own C++ warning (with C++ frames) when rank 0's store goes away while another rank
        # still asks it: not ours to print or silence per call; no Python traceback, and ours is one line
        lines = [line for line in _without_torch_cpp_warnings(err).splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1, err
        assert "Traceback" not in err, err
        assert re.search(r"a collective timed out \(.*\): global rank 1 stalled \(", lines[0]), err
        assert lines[0].endswith("rerun the same command with train.resume=auto (it continues from the last complete "
                                 "checkpoint)"), err
