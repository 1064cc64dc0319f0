"""Chunked CE + NTL head on vocabulary shards over 2 and 4 CPU processes (gloo) against the
single-process unchunked objective on the full head: sums, hidden and weight gradients, the
collectives of one call, and a bad layout failing on every rank."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 2)])
def test_chunked_shards_equal_single_process(world_size, tp_size):
    outputs = run_workers("chunked_shards.py", world_size, ["--tp", str(tp_size)], timeout=240)
    assert all("OK" in out for out in outputs), outputs
