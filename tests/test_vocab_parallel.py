"""Vocabulary-parallel CE + NTL over 2 and 4 CPU processes (gloo) against the single-process result."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers

pytestmark = pytest.mark.multiprocess


# the fast tier runs 2 shards (the same placements, uneven cuts and settings); 4 shards and dp x tp groups on 4
# processes are the full suite's
@pytest.mark.parametrize("world_size,tp_size", [pytest.param(2, 2, marks=pytest.mark.fast), (4, 4), (4, 2)])
def test_sharded_objective_equals_single_process(world_size, tp_size):
    outputs = run_workers("vocab_parallel_objective.py", world_size, ["--tp", str(tp_size)], timeout=300)
    assert all("OK" in out and "collectives per call {'MAX': 1, 'SUM': 1}" in out for out in outputs), outputs
