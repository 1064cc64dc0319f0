"""The trainer with `loss.chunk_tokens`: a short run of configs/demo.yaml through the DeepSpeed
launcher (2 CPU processes, ZeRO-3, AutoTP T=2) logs the same losses, grad norms and validation loss
as the same run computing the full logits."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers.distributed import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 400  # a hang fails the test instead of blocking the suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]



def _train(assets: Path, out: Path, *overrides: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.sh",
               "--config", "configs/demo.yaml", f"data.sources.0.path={assets / 'arithmetic.jsonl'}",
               "data.sources.0.generate_arithmetic=2000", f"tokenizer.name_or_path={assets / 'tokenizer'}",
               f"data.cache_dir={assets / 'cache'}", "data.validation_documents=120", "train.val_batches=1",
               f"train.output_dir={out}", "train.log_every_n_steps=1", "train.max_steps=3",
               "train.val_every_n_steps=3", "eval.at_end=false", "checkpoint.save_final=false",
               "monitor.progress_bar=never", *overrides]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    accumulator = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_chunked_training_logs_the_same_losses(tmp_path):
    assets = tmp_path / "assets"
    # 8 x 128 tokens per micro-batch: chunks of 100 do not divide them
    full = _train(assets, tmp_path / "full")
    chunked = _train(assets, tmp_path / "chunked", "loss.chunk_tokens=100")
    from ntl_pretrain.config import load_config

    assert load_config(tmp_path / "chunked" / "config.yaml").loss.chunk_tokens == 100
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae", "val/loss", "val/ntl"):
        assert len(full[tag]) == (1 if tag.startswith("val/") else 3), tag
        assert chunked[tag] == pytest.approx(full[tag], rel=2e-4, abs=1e-6), tag
