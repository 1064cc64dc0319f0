"""The monitor when its folder goes away mid-run: one line naming the folder, no raw trace from TensorBoard's
writer thread; other threads' errors still print. Run in a fresh interpreter: pytest replaces the thread hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers.distributed import REPO

pytestmark = pytest.mark.fast

SCRIPT = textwrap.dedent("""
    import os, shutil, sys, threading, time
    from ntl_pretrain.observability.monitor import Monitor, MonitorError
    run = sys.argv[1]
    monitor = Monitor(True, run + "/tensorboard", total_steps=10, progress_bar="never")
    monitor.log_step(1, {"train/loss": 1.0})
    # TensorBoard's writer thread reopens its file for append at each flush, so it can recreate an event file
    # while rmtree walks the folder ("Directory not empty"): remove until the folder stays gone
    for _ in range(100):
        shutil.rmtree(run, ignore_errors=True)
        if not os.path.lexists(run):
            break
        time.sleep(0.01)
    try:
        for step in range(2, 50):  # the writer thread fails at its next write; the training thread hears after
            monitor.log_step(step, {"train/loss": 1.0})
            time.sleep(0.05)
        monitor.close()
    except MonitorError as error:
        print("MonitorError:", error)

    def fails():
        raise OSError("an error of another thread")

    other = threading.Thread(target=fails)
    other.start()
    other.join()
""")


def test_a_removed_run_folder_is_one_line_naming_it_and_the_writer_thread_stays_quiet(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(run)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("MonitorError:")]
    assert len(lines) == 1, done.stdout + done.stderr
    assert str(run / "tensorboard") in lines[0] and "no longer exists" in lines[0] and "train.resume=auto" in lines[0]
    # the writer thread's own trace is gone; another thread's error still prints (the hook is that narrow)
    assert done.stderr.count("Traceback") == 1 and "an error of another thread" in done.stderr, done.stderr
