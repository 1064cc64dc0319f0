"""A step that refuses to poison a run (real Trainer, real DeepSpeed engines, 2 CPU processes).

Corrupted weights (a NaN in every rank's share, as from a damaged shard): each step's update is skipped (the
rest of the weights stay bitwise equal), the step is counted, a checkpoint of them is refused, and after
`train.max_nonfinite_steps` steps in a row the run stops with a clear error. ZeRO-3 (DeepSpeed's own overflow
skip, T=2) and ZeRO-0 (the trainer's skip, dp=2). End to end through the launcher: lr=1e6 without clipping
diverges, the run exits non-zero with one clear error line and every checkpoint it left holds finite weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.distributed import run_workers
from helpers.launch import DEMO, demo_overrides, deepspeed_command, run

TIMEOUT = 400
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT)]


def overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return demo_overrides(assets, out, "data.seq_len=64", "data.micro_batch_size=2", "train.grad_accum_steps=2",
                          "train.max_steps=20", "checkpoint.save_final=false", *extra)


# ZeRO-3 with reads deferred (steps 2-4 do not log: nothing is read from the device, DeepSpeed's own skip
# decides); ZeRO-0 logging every step
@pytest.mark.parametrize("stage,tp,log_every", [(3, 2, 100), (0, 1, 1)])
def test_nonfinite_weights_skip_updates_refuse_saving_and_stop(assets, tmp_path, stage, tp, log_every):
    result = tmp_path / "result.json"
    run_workers("trainer_nonfinite.py", 2, [str(result), DEMO, *overrides(
        assets, tmp_path / "run", f"parallel.tp_size={tp}", f"parallel.zero_stage={stage}",
        "train.max_nonfinite_steps=3", f"train.log_every_n_steps={log_every}")], timeout=TIMEOUT)
    found = json.loads(result.read_text())
    assert found["saved_finite"] == "global_step1"
    assert found["nonfinite_totals"] == [1, 2]
    logged = [figures for figures in found["nonfinite"] if figures is not None]
    assert len(logged) == (2 if log_every == 1 else 0), found["nonfinite"]
    assert [figures["train/nonfinite_steps"] for figures in logged] == [1.0, 2.0][:len(logged)]
    assert all(figures["train/loss"] == "nan" for figures in logged), logged
    assert found["unchanged"], "a step with a non-finite loss changed the weights"
    assert found["save_refused"] and "weights are not finite; refusing to save" in found["save_refused"]
    assert not (tmp_path / "run" / "global_step3").exists()
    assert found["stopped"] and "step 4: 3 optimizer steps in a row had a non-finite loss" in found["stopped"]


def test_divergent_run_stops_with_an_error_and_keeps_finite_checkpoints(assets, tmp_path):
    out = tmp_path / "run"
    result = run(deepspeed_command(2, "--config", DEMO, *overrides(
        assets, out, "optim.lr=1e6", "optim.grad_clip=0", "optim.warmup_steps=0", "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=0")), timeout=TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "optimizer steps in a row had a non-finite loss or gradient norm" in output, output[-3000:]
    assert "update skipped" in output
    checkpoints = sorted(out.glob("global_step*"))
    assert checkpoints, output[-3000:]
    for checkpoint in checkpoints:
        for path in checkpoint.glob("*optim_states.pt"):
            state = torch.load(path, map_location="cpu", weights_only=False)
            for flat in state["optimizer_state_dict"]["fp32_flat_groups"]:
                assert torch.isfinite(flat).all(), path
