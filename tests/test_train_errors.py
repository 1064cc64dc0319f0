"""Bad input to the trainer: each error names the problem, and nothing is left half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntl_pretrain.config import load_config
from ntl_pretrain.config.schema import ParallelConfig
from ntl_pretrain.parallel.distributed import check_tp_divides, layout
from ntl_pretrain.models.build import build_model, padded_vocab_size
from ntl_pretrain.tokenizer.run import train_digit_bpe
from ntl_pretrain.trainer.preflight import check_output_dir, number_vocab_for
from ntl_pretrain.trainer.training_objective import Objective
from helpers.distributed import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _words_only_tokenizer(out: Path):
    """A real fast tokenizer whose vocabulary has no digit token at all."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "hello", "world", "apples", "pears"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(out)
    return wrapped


@pytest.fixture(scope="module")
def digit_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok") / "digits"
    train_digit_bpe([f"{i} apples cost {i * 7} coins" for i in range(500)], vocab_size=330, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


def _cfg(*overrides: str):
    return load_config(None, ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok",
                              "data.sources.0.path=c.jsonl", *overrides])


def test_tokenizer_without_digits_when_ntl_is_on(tmp_path):
    tokenizer = _words_only_tokenizer(tmp_path / "words")
    with pytest.raises(ValueError) as info:
        cfg = _cfg("loss.ntl_weight=0.3")
        number_vocab_for(cfg, Objective.from_config(cfg.loss), tokenizer)
    message = str(info.value)
    assert "NTL is on" in message and "no bare digit tokens" in message and "loss.enabled=false" in message


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The real entry point as one process (world size 1), on the demo config with local files."""
    port = free_port()
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(REPO / "launch" / "pretrain.sh"), "--config", str(REPO / "configs" / "demo.yaml"),
         "tokenizer.train_vocab_size=0", "data.sources.0.generate_arithmetic=0", f"train.output_dir={tmp_path / 'run'}",
         f"data.cache_dir={tmp_path / 'cache'}", *overrides],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


@pytest.mark.parametrize("case", ["no_digits", "missing_data", "tp_does_not_divide"])
def test_command_line_errors_name_the_problem_and_write_nothing(tmp_path, case, digit_tokenizer):
    """Exit code 2, one message on stderr, no run folder written."""
    _words_only_tokenizer(tmp_path / "words")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": "hello world apples"}) + "\n" for _ in range(600)))
    overrides = {
        "no_digits": ["parallel.tp_size=1", f"data.sources.0.path={tmp_path / 'c.jsonl'}"],
        "missing_data": ["parallel.tp_size=1", f"data.sources.0.path={tmp_path / 'missing.jsonl'}"],
        "tp_does_not_divide": ["parallel.tp_size=2", f"data.sources.0.path={tmp_path / 'c.jsonl'}"],
    }[case]
    expected = {
        "no_digits": "NTL is on (loss.enabled=true, loss.ntl_weight=0.3) but tokenizer",
        "missing_data": "data.sources.0.path=",
        "tp_does_not_divide": "parallel.tp_size=2 does not divide the world size 1",
    }[case]
    tokenizer = tmp_path / "words" if case == "no_digits" else digit_tokenizer.name_or_path
    result = _cli(tmp_path, f"tokenizer.name_or_path={tokenizer}", *overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert expected in result.stderr
    if case == "missing_data":
        assert "missing.jsonl': no such file or folder" in result.stderr
    assert not (tmp_path / "run").exists()


def test_model_vocabulary_smaller_than_the_tokenizer(tmp_path, digit_tokenizer):
    from helpers.models import tiny_llama

    small = tiny_llama(200, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=2048)
    small.save_pretrained(tmp_path / "small")
    cfg = _cfg(f"model.name_or_path={tmp_path / 'small'}", "model.dtype=fp32")
    assert len(digit_tokenizer) > 200
    with pytest.raises(ValueError) as info:
        build_model(cfg.model, digit_tokenizer, tp_size=2)
    message = str(info.value)
    assert "vocabulary (200) is smaller than the tokenizer's" in message and "model.resize_embeddings=true" in message

    cfg.model.resize_embeddings = True
    model, report = build_model(cfg.model, digit_tokenizer, tp_size=3)
    rows = model.get_input_embeddings().weight
    assert report.resized_from == 200 and report.vocab_size == rows.shape[0] == padded_vocab_size(len(digit_tokenizer), 64, 3)
    assert report.vocab_size % 3 == 0 and report.vocab_size % 64 == 0 and report.vocab_size >= len(digit_tokenizer)
    assert model.get_output_embeddings().weight.shape[0] == report.vocab_size
    assert torch.isfinite(rows).all()
    torch.testing.assert_close(rows[:200], small.get_input_embeddings().weight)


def test_new_model_gets_a_padded_vocabulary_and_the_same_weights_everywhere(digit_tokenizer):
    cfg = _cfg("model.architecture={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
               "num_attention_heads: 2, num_key_value_heads: 2}", "model.dtype=fp32")
    first, report = build_model(cfg.model, digit_tokenizer, tp_size=2)
    second, _ = build_model(cfg.model, digit_tokenizer, tp_size=2)
    assert report.vocab_size % 64 == 0 and report.vocab_size >= len(digit_tokenizer)
    assert report.attn_implementation == "sdpa"  # no CUDA here
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_tp_size_that_does_not_divide_the_world(monkeypatch):
    with pytest.raises(ValueError, match=r"parallel.tp_size=4 does not divide the world size 6"):
        check_tp_divides(6, 4)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"parallel.tp_size=2 does not divide the world size 3"):
        layout(ParallelConfig(tp_size=2))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    got = layout(ParallelConfig(tp_size=2))
    assert (got.dp_size, got.dp_rank, got.tp_rank) == (2, 1, 1)


def test_output_dir_with_another_runs_checkpoints_is_refused(tmp_path):
    out = tmp_path / "run"
    (out / "global_step20").mkdir(parents=True)
    # a complete checkpoint carries its manifest (ntl_pretrain/checkpoint); resume=auto ignores folders without one
    (out / "global_step20" / "shard.pt").write_bytes(b"x")
    (out / "global_step20" / "ntl_checkpoint.json").write_text('{"step": 20, "files": {"shard.pt": 1}}')
    (out / "latest").write_text("global_step20")
    before = sorted(p.name for p in out.iterdir())
    cfg = _cfg(f"train.output_dir={out}")
    with pytest.raises(ValueError, match=r"already holds checkpoints of another run \(global_step20\).*train.resume=auto"):
        check_output_dir(cfg)
    assert sorted(p.name for p in out.iterdir()) == before
    cfg.train.resume = "auto"
    assert check_output_dir(cfg) == "global_step20"
    cfg.train.resume = "global_step7"
    with pytest.raises(ValueError, match="no such checkpoint"):
        check_output_dir(cfg)
    cfg.train.resume = "none"
    cfg.train.output_dir = str(tmp_path / "fresh")
    assert check_output_dir(cfg) is None


def test_gradient_checkpointing_and_attention_choice(digit_tokenizer):
    cfg = _cfg("model.architecture={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
               "num_attention_heads: 2, num_key_value_heads: 2}", "model.dtype=bf16", "model.gradient_checkpointing=true",
               "model.attn_implementation=eager")
    model, report = build_model(cfg.model, digit_tokenizer, tp_size=1)
    assert model.is_activation_checkpointing and report.attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"
    assert next(model.parameters()).dtype == torch.bfloat16
