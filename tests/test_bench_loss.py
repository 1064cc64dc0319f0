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
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_loss.py"), "--tokens", "64", "--vocab",
                           "512", "--tp", "1", "2", "--reps", "2", "--methods", "ce", "ours_was", "ntloss_was",
                           "--json", str(out)],
                          check=True, timeout=600, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # one thread a process: a busy machine stays usable
    rows = json.loads(out.read_text())["rows"]
    assert {(row["tp"], row["method"]) for row in rows} == {(1, "ce"), (1, "ours_was"), (1, "ntloss_was"),
                                                           (2, "ce"), (2, "ours_was")}
    for row in rows:
        assert row["median_s"] > 0 and row["ratio_vs_ce"] > 0 and row["peak_extra_mib"] >= 0
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and len(row["load_average_before"]) == 3
        assert row["threads"] == 1, row  # OMP_NUM_THREADS is honoured at TP=1 too (it used to take every core)
    assert done.stdout.count("load average (1/5/15 min)") == 2 and "(min-max " in done.stdout
    tp2_ours = next(row for row in rows if row["tp"] == 2 and row["method"] == "ours_was")
    # one MAX of n floats and one SUM of n * (K + 2) floats, K = 10 digits (the layout is checked once, not
    # per call: check_inputs=False, as in the trainer)
    assert tp2_ours["bytes_per_collective"] == [4 * 64, 4 * 64 * 12]
