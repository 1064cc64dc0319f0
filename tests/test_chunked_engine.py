"""Chunked CE + NTL head through real DeepSpeed engines (tiny Llama): the same loss, grad norm and
weights after an SGD step as the unchunked objective on the full logits, with ZeRO-3 (two
data-parallel ranks, AutoTP T = 2, gradient accumulation; the head weight is partitioned, not
persistent) and ZeRO-0 (two data-parallel ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_workers

pytestmark = pytest.mark.multiprocess

VOCAB, DIGIT_IDS = 64, list(range(20, 30))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("chunked_engine")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(30, VOCAB, (4, 17), generator=generator)  # rows 0-1: no number tokens at all
    tokens[2:, ::2] = torch.randint(20, 30, (2, 9), generator=generator)  # rows 2-3: half digits
    tokens[3, 1::4] = torch.randint(20, 30, (1, 4), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[1, :3] = -100
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": labels,
             "number_vocab": {"token_ids": tuple(DIGIT_IDS), "values": tuple(float(v) for v in range(10)),
                              "vocab_size": VOCAB}}
    torch.save(batch, root / "batch.pt")
    return root, {k: v.clone() for k, v in model.state_dict().items()}


def _run(setup, name: str, world: int, **options) -> tuple[dict, dict]:
    root, _ = setup
    out = root / name
    out.mkdir()
    args = ["--model", str(root / "model"), "--batch", str(root / "batch.pt"), "--out", str(out)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    run_workers("chunked_engine_step.py", world, args, timeout=300)
    return json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt")


def _assert_same_step(setup, result: dict, weights: dict, reference: dict, ref_weights: dict) -> None:
    _, initial = setup
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    if reference["grad_norm"] is not None:
        assert result["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        delta, expected = weights[key] - initial[key], ref_weights[key] - initial[key]
        assert expected.norm() > 0, f"{key} did not change: the step did nothing"
        assert (delta - expected).norm() <= 1e-4 * expected.norm(), key


def test_zero3_chunked_equals_unchunked_dp2_tp2_grad_accum(setup):
    reference = _run(setup, "ref_t1", 1, chunk_tokens=0)
    # two data-parallel ranks: ZeRO-3 really gathers the (non-persistent) head weight and reduce-scatters its
    # gradient; with accumulation every micro-batch is one row of 16 tokens (5 does not divide them) and the
    # first micro-batch of both ranks holds no number token
    _assert_same_step(setup, *_run(setup, "dp2_ga2_c5", 2, chunk_tokens=5, grad_accum=2), *reference)
    _assert_same_step(setup, *_run(setup, "t2_c7", 2, tp=2, chunk_tokens=7), *reference)


def test_reweighed_number_level_zero3_tp2_and_zero0_dp2(setup):
    options = {"variant": "number_level", "reweigh": 1}
    reference = _run(setup, "ref_zero0", 2, zero_stage=0, chunk_tokens=0, **options)
    _assert_same_step(setup, *_run(setup, "zero0_c9", 2, zero_stage=0, chunk_tokens=9, **options), *reference)
    _assert_same_step(setup, *_run(setup, "zero3_t2_c6", 2, tp=2, chunk_tokens=6, **options), *reference)
