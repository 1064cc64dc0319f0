"""No host syncs in the training step: the real Trainer (2 CPU processes, ZeRO-3, DeepSpeed engines) runs
optimizer steps of 2 micro-batches while every tensor call that would force a device-to-host sync on a GPU is
counted (tests/helpers/sync_counter.py). Our code makes none inside the micro-batch loop and at most one per
optimizer step (the logged figures), for the full and the chunked head, T=1 (dp=2) and T=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.distributed import run_workers  # noqa: E402

TIMEOUT = 400
STEPS = 2
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sync_assets")


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return ["configs/demo.yaml", f"data.sources.0.path={assets / 'arithmetic.jsonl'}",
            "data.sources.0.generate_arithmetic=600", f"tokenizer.name_or_path={assets / 'tokenizer'}",
            f"data.cache_dir={assets / 'cache'}", "data.validation_documents=50", f"train.output_dir={out}",
            "data.seq_len=64", "data.micro_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=10",
            "monitor.progress_bar=never", "eval.at_end=false", "checkpoint.save_final=false", *extra]


@pytest.mark.parametrize("tp,chunk_tokens", [(1, 0), (1, 48), (2, 0), (2, 48)])
def test_step_makes_no_host_sync_in_the_micro_batch_loop(assets, tmp_path, tp, chunk_tokens):
    result = tmp_path / "syncs.json"
    run_workers("trainer_syncs.py", 2, [str(result), str(STEPS), *overrides(
        assets, tmp_path / "run", f"parallel.tp_size={tp}", f"loss.chunk_tokens={chunk_tokens}")], timeout=TIMEOUT)
    counts = json.loads(result.read_text())
    print(json.dumps({k: v for k, v in counts.items() if k != "figures"}, indent=1))
    # data.py builds each micro-batch from numpy arrays on the host, before it moves to the device: its tensor
    # calls touch CPU tensors only, on every machine, so they never wait for a device
    ours = {key: n for key, n in counts["sites"].items() if "/ntl_pretrain/" in key and "/data.py:" not in key}
    in_loop = {key: n for key, n in ours.items() if key.startswith("micro_batch/")}
    assert not in_loop, f"host syncs inside the micro-batch loop: {in_loop}"
    assert sum(ours.values()) <= STEPS, f"more than one host sync per optimizer step: {ours}"
    for figures in counts["figures"]:
        assert figures["train/ce"] > 0 and figures["train/grad_norm"] > 0, figures
