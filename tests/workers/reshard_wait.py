"""Worker: plan a resume on another layout (T=2 checkpoint, T=1/dp=2 run) while global rank 0's universal
conversion takes longer than the process group's timeout; prints each plan's outcome as one JSON line.

    python reshard_wait.py RUN_DIR TAG TIMEOUT_S DELAY_S     (once per rank; tests/helpers/distributed.py)

Plan 1: the conversion fails on rank 0 after DELAY_S (every rank must raise its message). Plan 2: it succeeds
after DELAY_S (every rank must get the universal tag). The process group times out after TIMEOUT_S < DELAY_S.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

from ntl_pretrain.checkpoint import CheckpointError, CheckpointManager, fingerprint
from ntl_pretrain.checkpoint import manager, universal
from ntl_pretrain.config import CheckpointConfig
from ntl_pretrain.parallel.layout import ParallelLayout
from ntl_pretrain.numbers import NumberVocab

FAILURE = "injected conversion failure"


def main(run_dir: str, tag: str, timeout_s: float, delay_s: float) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    real = universal.convert_to_universal
    calls = []

    def slow_conversion(*args, **kwargs):  # a model of billions of parameters, in miniature
        calls.append(time.monotonic())
        time.sleep(delay_s)
        if len(calls) == 1:
            raise CheckpointError(FAILURE)
        return real(*args, **kwargs)

    universal.convert_to_universal = slow_conversion
    if hasattr(manager, "convert_to_universal"):  # the code before the conversion left the collective timeout
        manager.convert_to_universal = slow_conversion
    assets = os.path.join(run_dir, tag, "hf")
    run_fingerprint = fingerprint(AutoConfig.from_pretrained(assets), AutoTokenizer.from_pretrained(assets),
                                  NumberVocab.load(assets))
    layout = ParallelLayout.of(world, rank, rank, tp_size=1)
    plans = CheckpointManager(CheckpointConfig(), run_dir, layout, 3, run_fingerprint, seed=1)
    outcomes = []
    for _ in range(2):
        dist.barrier()  # both ranks start waiting together
        started = time.monotonic()
        try:
            outcomes.append({"tag": plans.plan_resume(tag)})
        except CheckpointError as error:
            outcomes.append({"error": type(error).__name__, "message": str(error)})
        outcomes[-1]["waited_s"] = time.monotonic() - started
        if rank == 0 and "error" in outcomes[-1]:  # rank 0 raised its error only once every rank had read it
            store = dist.distributed_c10d._get_default_store()
            outcomes[-1]["read_by"] = store.add("ntl_pretrain/universal_conversion/1/read", 0)
    print(json.dumps({"rank": rank, "conversions": len(calls), "outcomes": outcomes}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
