"""The trainer's start-up check that the tokenizer is digit-level on its own training data (issue 12, item 2)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import load_config
from ntl_pretrain.data import PretrainingData
from ntl_pretrain.models.build import load_run_tokenizer as load_tokenizer
from ntl_pretrain.tokenizer.run import train_digit_bpe
from ntl_pretrain.numbers import DIGITS, NumberVocab
from ntl_pretrain.tokenizer import split_digits
from ntl_pretrain.tokenizer.coverage import DIGIT_LEVEL_SHARE, check_training_digits, first_samples

from test_tokenizer_families import build_gpt2_style, build_llama3_style, number_corpus
from helpers.distributed import finish_ranks, start_ranks
from test_train_errors import _cli

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
GPT2 = SHARED / "tokenizers" / "gpt2"
GSM8K_TEST = SHARED / "gsm8k" / "test.jsonl"
needs_shared = pytest.mark.skipif(not (GPT2 / "tokenizer.json").is_file() or not GSM8K_TEST.is_file(),
                                  reason="shared GPT-2 tokenizer or GSM8K absent")


@pytest.fixture(scope="module")
def gsm8k_corpus(tmp_path_factory) -> Path:
    """The first 400 GSM8K test problems (question + answer) as training documents."""
    path = tmp_path_factory.mktemp("gsm8k") / "train.jsonl"
    if GSM8K_TEST.is_file():
        with open(GSM8K_TEST, encoding="utf-8") as source:
            rows = [json.loads(line) for _, line in zip(range(400), source)]
        path.write_text("".join(json.dumps({"text": f"{r['question']}\n{r['answer']}"}) + "\n" for r in rows),
                        encoding="utf-8")
    return path


def _data(tokenizer_path, corpus: Path, cache: Path, *overrides: str):
    cfg = load_config(None, ["model.architecture.model_type=llama", f"tokenizer.name_or_path={tokenizer_path}",
                             f"data.sources.0.path={corpus}", f"data.cache_dir={cache}", "data.seq_len=128",
                             "data.validation_documents=10", *overrides])
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
    return tokenizer, NumberVocab.from_tokenizer(tokenizer), PretrainingData.build(cfg.data, tokenizer, dp_rank=0,
                                                                                  dp_size=1)


def _reference(tokenizer, number_vocab, data) -> tuple[int, int]:
    """(digits in the decoded label text, label tokens that are number tokens): counted without the vocabulary."""
    sizes = sum(source.size for source in data.sources)
    labels = [s[1:] for s in first_samples(data.sample, sizes)]
    digits = sum(sum(ch in DIGITS for ch in tokenizer.decode(ids.tolist())) for ids in labels)
    in_numbers = sum(int(np.isin(ids, number_vocab.token_ids).sum()) for ids in labels)
    return digits, in_numbers


@needs_shared
def test_gpt2_is_refused_on_gsm8k_and_its_split_digits_conversion_passes(gsm8k_corpus, tmp_path, caplog):
    tokenizer, number_vocab, data = _data(GPT2, gsm8k_corpus, tmp_path / "cache")
    assert number_vocab.token_ids == tuple(range(15, 25))  # the ten bare digits exist: from_tokenizer succeeds
    with pytest.raises(ValueError) as info:
        check_training_digits(tokenizer, number_vocab, data, source=str(GPT2), ntl_on=True, allow=False)
    message = str(info.value)
    assert f"python tools/tokenizer.py split-digits {GPT2} OUT_DIR" in message
    assert "tokenizer.digit_level=false" in message and "tokenizer.allow_non_digit_level=true" in message
    assert "'Ġ" in message  # names multi-digit / space-marked tokens the digits sit in

    with caplog.at_level(logging.INFO, logger="ntl_pretrain"):
        coverage = check_training_digits(tokenizer, number_vocab, data, source=str(GPT2), ntl_on=True, allow=True)
    digits, in_numbers = _reference(tokenizer, number_vocab, data)
    assert (coverage.digits, coverage.in_number_tokens) == (digits, in_numbers)
    assert 0 < coverage.share < 0.5
    assert f"{100 * coverage.share:.1f}% of the {digits} digits" in caplog.text and "training anyway" in caplog.text

    split_digits(GPT2, tmp_path / "gpt2-digits")
    tokenizer, number_vocab, data = _data(tmp_path / "gpt2-digits", gsm8k_corpus, tmp_path / "cache")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ntl_pretrain"):
        coverage = check_training_digits(tokenizer, number_vocab, data, source="gpt2-digits", ntl_on=True, allow=False)
    assert coverage.share == 1.0 and (coverage.digits, coverage.in_number_tokens) == _reference(tokenizer, number_vocab,
                                                                                               data)
    assert f"100.0% of the {coverage.digits} digits" in caplog.text


@pytest.mark.parametrize("style", ["gpt2", "llama3"])
def test_self_made_tokenizers_without_shared_files(style, tmp_path):
    """GPT-2- and Llama-3-style BPEs trained here are refused; the demo's digit-level BPE passes; CE-only runs
    only log."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in number_corpus(400)), encoding="utf-8")
    build = build_gpt2_style if style == "gpt2" else build_llama3_style
    tokenizer, number_vocab, data = _data(build(tmp_path / style), corpus, tmp_path / "cache")
    with pytest.raises(ValueError, match="is not digit-level on the training data"):
        check_training_digits(tokenizer, number_vocab, data, source="x", ntl_on=True, allow=False)
    coverage = check_training_digits(tokenizer, number_vocab, data, source="x", ntl_on=False, allow=False)
    assert coverage.share < DIGIT_LEVEL_SHARE
    assert (coverage.digits, coverage.in_number_tokens) == _reference(tokenizer, number_vocab, data)

    train_digit_bpe(number_corpus(400), vocab_size=400, out_dir=str(tmp_path / "digit_bpe"))
    tokenizer, number_vocab, data = _data(tmp_path / "digit_bpe", corpus, tmp_path / "cache")
    coverage = check_training_digits(tokenizer, number_vocab, data, source="y", ntl_on=True, allow=False)
    assert coverage.share == 1.0 and coverage.digits == _reference(tokenizer, number_vocab, data)[0]


@needs_shared
def test_trainer_refuses_before_building_the_model_and_trains_with_the_override(gsm8k_corpus, tmp_path):
    common = ["parallel.tp_size=1", f"tokenizer.name_or_path={GPT2}", f"data.sources.0.path={gsm8k_corpus}",
              "data.validation_documents=10", "train.val_every_n_steps=-1", "eval.at_end=false",
              "checkpoint.save_final=false", "train.max_steps=1", "model.architecture.hidden_size=32",
              "model.architecture.intermediate_size=64", "model.architecture.num_hidden_layers=1"]
    refused = _cli(tmp_path, *common)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "is not digit-level on the training data" in refused.stderr and "split-digits" in refused.stderr
    assert "model from_config" not in refused.stderr and "parameters, vocabulary" not in refused.stderr
    assert not (tmp_path / "run").exists()

    allowed = _cli(tmp_path, *common, "tokenizer.allow_non_digit_level=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    log = allowed.stdout + allowed.stderr
    assert "is not digit-level on the training data" in log and "training anyway" in log
    assert "% of the" in log and "digits in the first" in log


def test_every_rank_refuses_and_none_hangs(tmp_path):
    """Two ranks (dp=2) measure the same samples, so both stop with the same error and exit 2."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in number_corpus(600)), encoding="utf-8")
    tokenizer = build_gpt2_style(tmp_path / "gpt2_style")
    procs = start_ranks(
        [sys.executable, str(REPO / "launch" / "pretrain.sh"), "--config", str(REPO / "configs" / "demo.yaml"),
         "parallel.tp_size=1", "tokenizer.train_vocab_size=0", f"tokenizer.name_or_path={tokenizer}",
         f"data.sources.0.path={corpus}", "data.sources.0.generate_arithmetic=0", "data.validation_documents=10",
         f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}"],
        2, cwd=tmp_path, merge_stderr=False)
    results = finish_ranks(procs, 400)
    for proc, (_out, err) in zip(procs, results):
        assert proc.returncode == 2, err[-3000:]
    # the error every rank agreed on is printed once, by rank 0
    errors = [line for _out, err in results for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is not digit-level on the training data" in errors[0], results[0][1][-3000:]
    assert "split-digits" in results[0][1]
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_a_streamed_corpus_shorter_than_the_check_counts_each_sample_once(tmp_path):
    """A streamed source restarts when it ends: the check reads it over and over up to its 4096 samples, and counts
    what it read, each sample once: as many samples as the same corpus read whole (packed apart, so the windows and
    their digits differ a little; issue 47: it reported "the first 4096 training samples" of a corpus of 35)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in number_corpus(200)), encoding="utf-8")
    train_digit_bpe(number_corpus(400), vocab_size=400, out_dir=str(tmp_path / "digit_bpe"))
    measured, sizes = {}, {}
    for streaming in ("false", "true"):
        tokenizer, number_vocab, data = _data(tmp_path / "digit_bpe", corpus, tmp_path / "cache",
                                              f"data.sources.0.streaming={streaming}")
        sizes[streaming] = getattr(data.sources[0], "size", None)
        measured[streaming] = check_training_digits(tokenizer, number_vocab, data, source="x", ntl_on=True, allow=False)
    whole, streamed = measured["false"], measured["true"]
    assert sizes["true"] is None and 0 < whole.samples == sizes["false"] < 100  # every sample of the corpus read whole
    assert (streamed.samples, streamed.tokens) == (whole.samples, whole.tokens)
    assert streamed.digits == pytest.approx(whole.digits, rel=0.01)  # not 4096 samples' digits
    assert f"in the first {whole.samples} distinct training samples ({whole.tokens} tokens)" in streamed.describe()
