"""No host syncs in the training step: the real Trainer (2 CPU processes, ZeRO-3, DeepSpeed engines) runs
optimizer steps of 2 micro-batches while every tensor call that would force a device-to-host sync on a GPU is
counted (tests/helpers/sync_counter.py). Our code makes none inside the micro-batch loop and at most one per
optimizer step (the logged figures), for the full and the chunked head, T=1 (dp=2) and T=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides

TIMEOUT = 400
STEPS = 2
LAYOUTS = [1, 2]  # tp_size; each launch runs the full and the chunked head, one Trainer after the other
CHUNKED = {"chunk0": ["loss.chunk_tokens=0"],  # the full head
           "chunk48_rows": ["loss.chunk_tokens=48", "loss.chunk_backward=rows"],
           "chunk48_vocab_blocks": ["loss.chunk_tokens=48", "loss.chunk_backward=vocab_blocks"],
           # reweigh: its dense gradient comes with the recomputed blocks, no row count read on the host
           "chunk48_vocab_blocks_reweigh": ["loss.chunk_tokens=48", "loss.chunk_backward=vocab_blocks",
                                            "loss.reweigh=true"]}
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(5 * TIMEOUT)]  # the fixture: 2 launches


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return demo_overrides(assets, out, "data.seq_len=64", "data.micro_batch_size=2", "train.grad_accum_steps=2",
                          "train.max_steps=10", "checkpoint.save_final=false", *extra)


@pytest.fixture(scope="module")
def counted(assets, tmp_path_factory) -> Path:
    """The sync counts of every (tp, head) case: one launch per tp."""
    root = tmp_path_factory.mktemp("syncs")
    for tp in LAYOUTS:
        cases = [{"name": f"tp{tp}_{head}", "overrides": overrides(
            assets, root / f"run_tp{tp}_{head}", f"parallel.tp_size={tp}", *head_overrides)}
            for head, head_overrides in CHUNKED.items()]
        (root / f"cases_tp{tp}.json").write_text(json.dumps(cases))
        run_workers("trainer_syncs.py", 2, [str(root), str(STEPS), DEMO, str(root / f"cases_tp{tp}.json")],
                    timeout=2 * TIMEOUT)
    return root


@pytest.mark.parametrize("tp,head", [(tp, head) for tp in LAYOUTS for head in CHUNKED])
def test_step_makes_no_host_sync_in_the_micro_batch_loop(counted, tp, head):
    counts = json.loads((counted / f"tp{tp}_{head}.json").read_text())
    print(json.dumps({k: v for k, v in counts.items() if k != "figures"}, indent=1))
    # the data package builds each micro-batch from numpy arrays on the host, before it moves to the device: its
    # tensor calls touch CPU tensors only, on every machine, so they never wait for a device
    ours = {key: n for key, n in counts["sites"].items() if "/ntl_pretrain/" in key and "/ntl_pretrain/data/" not in key}
    in_loop = {key: n for key, n in ours.items() if key.startswith("micro_batch/")}
    assert not in_loop, f"host syncs inside the micro-batch loop: {in_loop}"
    assert sum(ours.values()) <= STEPS, f"more than one host sync per optimizer step: {ours}"
    for figures in counts["figures"]:
        assert figures["train/ce"] > 0 and figures["train/grad_norm"] > 0, figures
