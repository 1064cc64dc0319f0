"""Smoke test of the chunked methods of the loss benchmark at a tiny size: they run for TP 1 and 2,
report time and memory against the unchunked head, and send the collectives the design says
(timings are measured by the script, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.multiprocess

TOKENS, HIDDEN, CHUNK = 64, 16, 24  # V = 4096: logits of 1 MiB, so the unchunked head's peak is above zero


def test_bench_loss_chunked_methods(tmp_path):
    out = tmp_path / "bench.json"
    methods = ["head_number_level_reweigh", "chunked_number_level_reweigh@rows",
               "chunked_number_level_reweigh@vocab_blocks", "ds_fused_ce"]
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_loss.py"), "--tokens", str(TOKENS), "--vocab",
                    "4096", "--tp", "1", "2", "--reps", "1", "--hidden", str(HIDDEN), "--chunk-tokens", str(CHUNK),
                    "--methods", *methods, "--json", str(out)], check=True, timeout=600, capture_output=True,
                   env=dict(os.environ, BENCH_THREADS="1"))  # one thread a process: a busy machine stays usable
    rows = json.loads(out.read_text())["rows"]
    assert {(row["tp"], row["method"]) for row in rows} == {(tp, m) for tp in (1, 2) for m in methods}
    for row in rows:
        assert row["median_s"] > 0 and row["peak_extra_mib"] >= 0
        if row["method"].startswith("chunked_"):
            assert row["time_vs_unchunked"] > 0 and row["memory_vs_unchunked"] >= 0
        if row["method"] != "ds_fused_ce":  # DeepSpeed's fused head + CE, the anchor of every head method
            assert row["time_vs_ds_fused"] > 0
    # K = 10 digits. Unchunked: one MAX of n floats, one SUM of n * (K + 2), and the column-parallel head's
    # all-reduce of the [n, H] hidden gradient. Chunked: the same two per chunk, then that all-reduce.
    by_method = {row["method"]: row for row in rows if row["tp"] == 2}
    assert by_method["head_number_level_reweigh"]["bytes_per_collective"] == [4 * TOKENS, 4 * TOKENS * 12,
                                                                              4 * TOKENS * HIDDEN]
    per_chunk = []
    for first in range(0, TOKENS, CHUNK):
        rows_in_chunk = min(CHUNK, TOKENS - first)
        per_chunk += [4 * rows_in_chunk, 4 * rows_in_chunk * 12]
    for backward in ("rows", "vocab_blocks"):  # the same collectives for both gradient algorithms
        sent = by_method[f"chunked_number_level_reweigh@{backward}"]["bytes_per_collective"]
        assert sent == per_chunk + [4 * TOKENS * HIDDEN], backward
