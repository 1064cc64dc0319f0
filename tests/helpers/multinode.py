"""Helpers of the multi-node tests (tests/test_multinode_ssh.py, tests/test_slurm.py): a launcher run whose
output lines are timed, and the clean-up of a test's processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from helpers.launch import REPO

sys.path.insert(0, str(REPO / "tools"))
import local_cluster  # noqa: E402,F401  (re-exported for the tests)


class LoggedRun:
    """A command whose merged stdout/stderr is collected line by line with the time each line arrived."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path = REPO) -> None:
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - self.started, line))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def seconds_to(self, text: str) -> float | None:
        """Seconds from the start to the first line containing `text` (None: not seen)."""
        return next((t for t, line in self.lines if text in line), None)

    def wait_for_line(self, text: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.seconds_to(text)
            if seen is not None:
                return seen
            if self.process.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"the run ended (rc {self.process.returncode}) before {text!r}:\n{self.output[-4000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} within {timeout:.0f} s:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        """The exit code; kills the run's process group and fails if it runs past `timeout` (a hang)."""
        try:
            self.process.wait(timeout=max(timeout - (time.monotonic() - self.started), 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.process.args[:4]} did not end within {timeout:.0f} s (a hang?):\n"
                                 f"{self.output[-4000:]}") from None
        self._reader.join(timeout=30)
        return self.process.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait()


def processes_with(marker: str) -> list[psutil.Process]:
    """This machine's processes (other than this one) whose command line or environment holds `marker`,
    e.g. a test's temporary folder: the ranks started over ssh or by Slurm are not our children."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if any(marker in arg for arg in proc.cmdline()) or any(marker in v for v in proc.environ().values()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def end_processes_with(marker: str) -> list[str]:
    """SIGKILL what `processes_with(marker)` finds; returns their command lines (empty: nothing was left)."""
    left = processes_with(marker)
    names = []
    for proc in left:
        try:
            names.append(" ".join(proc.cmdline())[:200])
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=10)
    return names
