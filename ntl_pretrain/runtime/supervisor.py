"""`bash launch/pretrain.sh`: DeepSpeed's launcher under a parent that stays, so that a stop signal sent to
any process of the job makes every rank save at its next step boundary, and the job exits 0.

The tree is: this supervisor -> DeepSpeed's runner (`python -m deepspeed.launcher.runner`, what the
`deepspeed` command runs) -> DeepSpeed's `launch.py` (one per node) -> one process per rank. DeepSpeed
0.19's runner has no signal handler on one node (SIGTERM kills it with 143 and leaves the rest running),
and its launch.py answers SIGINT/SIGTERM by sending SIGTERM to the ranks, killing them 30 s later and
exiting 1. So:

- SIGTERM or SIGINT (Ctrl-C) to the supervisor is forwarded to the ranks only, as SIGTERM (SIGUSR1 and
  SIGUSR2 as themselves): they save at the next step boundary and exit 0, and the launchers follow. A
  second SIGTERM / SIGINT ends the whole job at once, without saving. Before any rank has started training
  (DeepSpeed's start-up, its CPU op build) a stop signal ends the job at once: no step has run, nothing is saved.
- The runner gets its own process group, so a terminal's Ctrl-C reaches the supervisor alone; it is
  ended with the supervisor (PR_SET_PDEATHSIG), and the supervisor adopts the processes it leaves
  behind (PR_SET_CHILD_SUBREAPER), so launch.py and the ranks are waited for even if the runner dies.
- A signal sent to the runner or to launch.py directly still reaches the ranks (the runner's death is
  forwarded as a stop, and the ranks watch their launchers too; launch.py forwards SIGTERM itself).
  When every rank of this node has reported a clean stop (`lifecycle.report_to_supervisor`), the
  supervisor exits 0 whatever the launchers returned.
- A one-node job that names no port gets a free one when DeepSpeed's default (29500) is taken, so two runs
  can share a machine; a port it names that another process holds is refused before any rank starts.

Usage: `python -m ntl_pretrain.runtime.supervisor [deepspeed launcher args] script [script args]`.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil

from . import log_filter
from .launcher import PORT_TAKEN_EVENT, LauncherError, busy_port_message, free_port, port_is_free
from .lifecycle import SUPERVISOR_DIR_ENV

__all__ = ["Supervisor", "free_port", "main", "with_free_master_port", "with_quiet_launcher"]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORWARDED_AS_IS = (signal.SIGUSR1, signal.SIGUSR2)
TICK_S = 0.25
COMMAND_START_ENV = "NTL_COMMAND_START"  # the command's start (seconds since the epoch) for the run summary


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no pdeath signal / subreaper; signals still forwarded
        pass


def _runner_setup() -> None:
    """In the runner, before exec: its own process group; ended when the supervisor dies."""
    os.setpgid(0, 0)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _say(text: str) -> None:
    print(f"launch/pretrain.sh: {text}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs `command` (DeepSpeed's runner) and relays stop signals to the ranks it starts."""

    def __init__(self, command: list[str], folder: str) -> None:
        self.command = command
        self.folder = folder
        self.stop_reason: str | None = None  # why a stop was asked for (None: no stop)
        self.forward_signal = signal.SIGTERM
        self.signalled: set[int] = set()
        self.runner: subprocess.Popen | None = None

    # ------------------------------------------------------------------ what the ranks reported
    def records(self, event: str) -> dict[int, dict[str, Any]]:
        found = {}
        for path in glob.glob(os.path.join(self.folder, f"{event}.*.json")):
            try:
                with open(path, encoding="utf-8") as handle:
                    record = json.load(handle)
            except (OSError, ValueError):
                continue
            found[int(record["local_rank"])] = record
        return found

    def _all_local_ranks(self, event: str) -> dict[int, dict[str, Any]] | None:
        """The records of every local rank if all of them wrote one, else None."""
        records = self.records(event)
        if not records:
            return None
        expected = max(int(r["local_world_size"]) for r in records.values())
        return records if set(records) == set(range(expected)) else None

    # ------------------------------------------------------------------ signals
    def install(self) -> None:
        for number in (*STOP_SIGNALS, *FORWARDED_AS_IS):
            signal.signal(number, self._on_signal)

    def _on_signal(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.stop_reason is not None and number in STOP_SIGNALS:
            _say(f"{name} again: ending the job now, without saving")
            self._kill_all()
            os._exit(128 + number)
        if not self.records("started"):
            # no rank has reached training (DeepSpeed's CPU op build, the rendezvous): no step to save at
            _say(f"{name} received before any rank started training (DeepSpeed's start-up, e.g. its CPU op build): "
                 f"ending the job now; nothing is saved (no step has run)")
            self._end_all()
            os._exit(128 + number)
        if self.stop_reason is None:
            self.stop_reason = name
            self.forward_signal = signal.Signals(number) if number in FORWARDED_AS_IS else signal.SIGTERM
            again = "Ctrl-C" if number == signal.SIGINT else name
            _say(f"{name} received: every rank saves a checkpoint at its next step boundary and stops "
                 f"({again} again ends the job at once, without saving)")
        self.forward()

    def forward(self) -> None:
        """Send the stop signal to every registered rank of this node not yet sent one."""
        if self.stop_reason is None:
            return
        descendants = {p.pid for p in psutil.Process().children(recursive=True)}
        for record in self.records("started").values():
            pid = int(record["pid"])
            if pid in self.signalled or pid not in descendants:
                continue
            try:
                os.kill(pid, self.forward_signal)
                self.signalled.add(pid)
            except ProcessLookupError:
                continue

    def _end_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every process of the job (a rank compiling DeepSpeed's op ends its compiler and removes its
        build lock), SIGKILL to those left after `grace_s`."""
        children = psutil.Process().children(recursive=True)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=grace_s)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def _kill_all(self) -> None:
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                continue

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        self.install()
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        env = dict(os.environ, **{SUPERVISOR_DIR_ENV: self.folder})
        env.setdefault(COMMAND_START_ENV, repr(psutil.Process().create_time()))  # launch/pretrain.sh execs us
        self.runner = subprocess.Popen(self.command, env=env, preexec_fn=_runner_setup)
        while True:
            try:
                runner_rc = self.runner.wait(timeout=TICK_S)
                break
            except subprocess.TimeoutExpired:
                self.forward()  # ranks that registered after the signal
        if runner_rc < 0 and self.stop_reason is None:
            self.stop_reason = f"the DeepSpeed runner ended by {signal.Signals(-runner_rc).name}"
            _say(f"{self.stop_reason}: every rank saves a checkpoint at its next step boundary and stops")
        self._wait_for_adopted()
        return self.exit_code(runner_rc)

    def _wait_for_adopted(self) -> None:
        """Reap launch.py and ranks left behind by a runner that died first (they are ours: subreaper)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                self.forward()
                time.sleep(TICK_S)

    def exit_code(self, runner_rc: int) -> int:
        done = self._all_local_ranks("done")
        stopped = done is not None and all(r.get("how") == "stopped" for r in done.values())
        if done is not None and (stopped or runner_rc == 0):
            if runner_rc != 0:
                why = self.stop_reason or "a stop signal"
                _say(f"every rank saved its checkpoint and exited 0 after {why}; exit 0 "
                     f"(DeepSpeed's launcher returned {runner_rc})")
            return 0
        if runner_rc == 0:
            return 0
        return runner_rc if runner_rc > 0 else 128 - runner_rc


DEFAULT_MASTER_PORT = 29500  # DeepSpeed's runner's default (torch's TORCH_DISTRIBUTED_DEFAULT_PORT)
DEEPSPEED_DEFAULT_HOSTFILE = "/job/hostfile"  # the runner goes multi-node when this exists


def launcher_args(args: list[str]) -> list[str]:
    """The arguments of DeepSpeed's launcher: those before the training script (what follows are its own)."""
    launcher: list[str] = []
    for arg in args:
        if arg.endswith((".sh", ".py")) and not (launcher and launcher[-1] in ("--hostfile", "-H")):
            break
        launcher.append(arg)
    return launcher


def is_multi_node(launcher: list[str]) -> bool:
    """Whether DeepSpeed's runner goes multi-node: a hostfile or master address given, or its default hostfile."""
    names = [a.split("=")[0] for a in launcher]
    return any(n in ("--hostfile", "-H", "--master_addr") for n in names) or os.path.exists(DEEPSPEED_DEFAULT_HOSTFILE)


def with_free_master_port(args: list[str], default_port: int = DEFAULT_MASTER_PORT) -> list[str]:
    """The launcher arguments, checked before any rank starts: on a one-node job, a port the user chose
    (`--master_port`) that another process holds is refused in one line (LauncherError), and when
    none is chosen and the default is taken, `--master_port` of a free port is prepended (a second run on the
    machine would otherwise die in the rendezvous with EADDRINUSE). Multi-node jobs are left as they are: the
    port is on the master node, which every node must agree on."""
    launcher = launcher_args(args)
    if is_multi_node(launcher):
        return args
    chosen = None
    for index, arg in enumerate(launcher):
        if arg.startswith("--master_port="):
            chosen = arg.split("=", 1)[1]
        elif arg == "--master_port" and index + 1 < len(launcher):
            chosen = launcher[index + 1]
    if chosen is not None:
        if chosen.isdigit() and not port_is_free(int(chosen)):
            raise LauncherError(busy_port_message(int(chosen), "choose another with NTL_DEEPSPEED_ARGS=\"--master_port "
                                                  "N\", or name none and a free one is chosen"))
        return args
    if os.environ.get("MASTER_PORT") or port_is_free(default_port):
        return args  # MASTER_PORT: the user's business (DeepSpeed's runner uses --master_port, default 29500)
    port = free_port()
    print(f"note: port {default_port} is in use (another job on this machine?): this run's rendezvous uses "
          f"{port}; choose one with NTL_DEEPSPEED_ARGS=\"--master_port N\"", file=sys.stderr, flush=True)
    return ["--master_port", str(port), *args]


def with_quiet_launcher(args: list[str]) -> list[str]:
    """The launcher arguments with `--log_level warning` (DeepSpeed's runner and launch.py then leave out their
    INFO blocks: commands, environment, world info), unless the user set a level or asked for `--verbose`."""
    if log_filter.wants_verbose(args) or any(a.split("=")[0] in ("--log_level", "--quiet", "-q") for a in args):
        return args
    return ["--log_level", "warning", *args]


PORT_ATTEMPTS = 3  # starts of a job whose rendezvous port another process took before global rank 0 bound it


def may_choose_port(args: list[str]) -> bool:
    """Whether the supervisor may move the rendezvous to another port: a one-node job whose port the user did not
    choose (`--master_port` before the script, or MASTER_PORT)."""
    launcher = launcher_args(args)
    named = bool(os.environ.get("MASTER_PORT")) or any(a.split("=")[0] == "--master_port" for a in launcher)
    return not named and not is_multi_node(launcher)


def on_port(args: list[str], port: int) -> list[str]:
    """`args` with the rendezvous on `port` (an earlier `--master_port` of ours, first in `args`, replaced)."""
    if args[:1] == ["--master_port"]:
        args = args[2:]
    return ["--master_port", str(port), *args]


def run_with_port_retries(args: list[str], start: Any, attempts: int = PORT_ATTEMPTS) -> int:
    """`start(args) -> (exit code, whether global rank 0 reported its port taken)`, again on a new free port while
    the port was taken on a one-node job whose port the user did not name: the port is chosen when the job starts,
    and the first start can spend minutes compiling DeepSpeed's CPU op before global rank 0 binds it, so another
    process may take it meanwhile. A port the user named is never changed."""
    movable = may_choose_port(args)
    for attempt in range(1, attempts + 1):
        code, taken = start(args)
        if not taken or not movable or attempt == attempts:
            return code
        port = free_port()
        _say(f"the rendezvous port was taken by another process before global rank 0 bound it; nothing ran: "
             f"starting again on port {port} (attempt {attempt + 1} of {attempts})")
        args = on_port(args, port)
    return code


def _start_once(args: list[str]) -> tuple[int, bool]:
    folder = tempfile.mkdtemp(prefix="ntl_supervisor_")
    try:
        supervisor = Supervisor([sys.executable, "-u", "-m", "deepspeed.launcher.runner", *args], folder)
        code = supervisor.run()
        return code, bool(supervisor.records(PORT_TAKEN_EVENT)) and code != 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = with_free_master_port(sys.argv[1:] if argv is None else argv)
    except LauncherError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return run_with_port_retries(args, lambda chosen: _start_once(with_quiet_launcher(chosen)))


if __name__ == "__main__":
    sys.exit(main())
