"""Smoke test of the loss benchmark at a tiny size: it runs for TP 1 and 2 and writes well-formed JSON
(timings are measured by the script, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.multiprocess


def test_bench_loss_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_loss.py"), "--tokens", "64", "--vocab", "512",
                    "--tp", "1", "2", "--reps", "1", "--methods", "ce", "ours_was", "ntloss_was", "--json", str(out)],
                   check=True, timeout=600, capture_output=True,
                   env=dict(os.environ, BENCH_THREADS="1"))  # one thread a process: a busy machine stays usable
    rows = json.loads(out.read_text())["rows"]
    assert {(row["tp"], row["method"]) for row in rows} == {(1, "ce"), (1, "ours_was"), (1, "ntloss_was"),
                                                           (2, "ce"), (2, "ours_was")}
    for row in rows:
        assert row["median_s"] > 0 and row["ratio_vs_ce"] > 0 and row["peak_extra_mib"] >= 0
    tp2_ours = next(row for row in rows if row["tp"] == 2 and row["method"] == "ours_was")
    # one MAX of n floats and one SUM of n * (K + 2) floats, K = 10 digits (the layout is checked once, not
    # per call: check_inputs=False, as in the trainer)
    assert tp2_ours["bytes_per_collective"] == [4 * 64, 4 * 64 * 12]
