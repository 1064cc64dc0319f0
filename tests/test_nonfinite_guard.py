"""A step that refuses to poison a run (real Trainer, real DeepSpeed engines, 2 CPU processes).

Corrupted weights (a NaN in every rank's share, as from a damaged shard): each step's update is skipped (the
rest of the weights stay bitwise equal), the step is counted, a checkpoint of them is refused, and after
`train.max_nonfinite_steps` steps in a row the run stops with a clear error. ZeRO-3 (DeepSpeed's own overflow
skip, T=2) and ZeRO-0 (the trainer's skip, dp=2). End to end through the launcher: lr=1e6 without clipping
diverges, the run exits non-zero with one clear error line and every checkpoint it left holds finite weights.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.distributed import free_port, run_workers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 400
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nonfinite_assets")


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return ["configs/demo.yaml", f"data.sources.0.path={assets / 'arithmetic.jsonl'}",
            "data.sources.0.generate_arithmetic=600", f"tokenizer.name_or_path={assets / 'tokenizer'}",
            f"data.cache_dir={assets / 'cache'}", "data.validation_documents=50", f"train.output_dir={out}",
            "data.seq_len=64", "data.micro_batch_size=2", "train.grad_accum_steps=2", "train.max_steps=20",
            "monitor.progress_bar=never", "eval.at_end=false", "checkpoint.save_final=false",
            "train.val_every_n_steps=-1", "train.log_every_n_steps=1", *extra]


@pytest.mark.parametrize("stage,tp", [(3, 2), (0, 1)])
def test_nonfinite_weights_skip_updates_refuse_saving_and_stop(assets, tmp_path, stage, tp):
    result = tmp_path / "result.json"
    run_workers("trainer_nonfinite.py", 2, [str(result), *overrides(
        assets, tmp_path / "run", f"parallel.tp_size={tp}", f"parallel.zero_stage={stage}",
        "train.max_nonfinite_steps=3")], timeout=TIMEOUT)
    found = json.loads(result.read_text())
    assert found["saved_finite"] == "global_step1"
    assert [figures["train/nonfinite_steps"] for figures in found["nonfinite"]] == [1.0, 2.0]
    assert all(figures["train/loss"] == "nan" for figures in found["nonfinite"]), found["nonfinite"]
    assert found["unchanged"], "a step with a non-finite loss changed the weights"
    assert found["save_refused"] and "weights are not finite; refusing to save" in found["save_refused"]
    assert not (tmp_path / "run" / "global_step3").exists()
    assert found["stopped"] and "3 optimizer steps in a row had a non-finite loss" in found["stopped"]


def test_divergent_run_stops_with_an_error_and_keeps_finite_checkpoints(assets, tmp_path):
    out = tmp_path / "run"
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.sh", "--config",
               *overrides(assets, out, "optim.lr=1e6", "optim.grad_clip=0", "optim.warmup_steps=0",
                          "checkpoint.every_n_steps=1", "checkpoint.keep_last=0")]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "optimizer steps in a row had a non-finite loss or gradient norm" in output, output[-3000:]
    assert "update skipped" in output
    checkpoints = sorted(out.glob("global_step*"))
    assert checkpoints, output[-3000:]
    for checkpoint in checkpoints:
        for path in checkpoint.glob("*optim_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            for flat in state["optimizer_state_dict"]["fp32_flat_groups"]:
                assert torch.isfinite(flat).all(), path
