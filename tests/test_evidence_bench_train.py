"""Smoke test of tools/bench_train.py at a tiny size through DeepSpeed's launcher: it runs with the ZeRO
stage and TP size given as arguments and writes well-formed JSON with the model-FLOP figures (timings
are measured by the script, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

sys.path.insert(0, str(REPO_ROOT / "tools"))

import bench_train  # noqa: E402
from helpers.distributed import free_port  # noqa: E402

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
SEQ_LEN = 32



def test_bench_train_zero_stage_and_tp_arguments_and_json(tmp_path):
    out = tmp_path / "bench_train.json"
    overrides = [f"data.sources.0.path={tmp_path / 'arith.jsonl'}", "data.sources.0.generate_arithmetic=500",
                 f"tokenizer.name_or_path={tmp_path / 'tok'}", "tokenizer.train_vocab_size=300",
                 "data.validation_documents=20", f"data.seq_len={SEQ_LEN}", "data.micro_batch_size=2",
                 *[f"model.architecture.{key}={value}" for key, value in TINY.items()]]
    command = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), "tools/bench_train.py",
               "--config", "configs/demo.yaml", "--steps", "4", "--warmup", "1", "--zero-stage", "1", "--tp", "1",
               "--out", str(out), *overrides]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())
    # the demo config says ZeRO-3 with T=2: the arguments win
    assert (result["zero_stage"], result["tp_size"], result["world_size"]) == (1, 1, 1)
    assert result["tokens_per_step"] == SEQ_LEN * 2
    for side in ("on", "off"):
        assert result[f"median_step_time_s_ntl_{side}"] > 0
        assert result[f"model_tflops_per_s_ntl_{side}"] == pytest.approx(
            result["model_flops_per_token"] * result[f"median_tokens_per_s_ntl_{side}"] / 1e12)
        assert result[f"mfu_ntl_{side}"] is None  # no peak FLOP/s for a CPU
    assert result["peak_tflops_per_device"] is None

    # reference FLOPs per token: 6 x parameters in matrix products + 12 x layers x hidden x seq_len
    from transformers import LlamaConfig, LlamaForCausalLM

    reference = LlamaForCausalLM(LlamaConfig(vocab_size=result["vocab_size"], tie_word_embeddings=False, **TINY))
    parameters = sum(p.numel() for p in reference.parameters())
    assert result["model_parameters"] == parameters
    embedding = result["vocab_size"] * TINY["hidden_size"]
    assert result["model_flops_per_token"] == pytest.approx(
        6 * (parameters - embedding) + 12 * TINY["num_hidden_layers"] * TINY["hidden_size"] * SEQ_LEN)


def test_peak_table_and_override():
    assert bench_train.peak_tflops_per_device(123.0) == 123.0
    names = [name for name, _ in bench_train.PEAK_TFLOPS]
    # a longer name must come before any name it contains, or the shorter one would match first
    for i, name in enumerate(names):
        assert not any(other in name for other in names[:i]), name
