"""Vocabulary-parallel CE + NTL over 2 and 4 CPU processes (gloo) against the single-process result."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers

pytestmark = [pytest.mark.fast, pytest.mark.multiprocess]


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 4), (4, 2)])
def test_sharded_objective_equals_single_process(world_size, tp_size):
    outputs = run_workers("vocab_parallel_objective.py", world_size, ["--tp", str(tp_size)], timeout=300)
    assert all("OK" in out and "collectives per call {'MAX': 1, 'SUM': 1}" in out for out in outputs), outputs
