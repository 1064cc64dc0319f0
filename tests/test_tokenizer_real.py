"""The real GPT-2 and Llama-2 tokenizers from ../shared/data/tokenizers (skipped when that folder is absent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece
from transformers import AutoTokenizer

from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.tokenizer import inspect_tokenizer, load_tokenizer, split_digits

pytestmark = pytest.mark.timeout(180)
SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZERS = SHARED / "data" / "tokenizers"
GSM8K_TEST = SHARED / "data" / "gsm8k" / "test.jsonl"
# From ../shared/data/tokenizers/README.md (the published Llama-2 vocabulary)
LLAMA2_DIGIT_IDS = {"0": 29900, "1": 29896, "2": 29906, "3": 29941, "4": 29946, "5": 29945, "6": 29953,
                    "7": 29955, "8": 29947, "9": 29929}

needs_gpt2 = pytest.mark.skipif(not (TOKENIZERS / "gpt2" / "tokenizer.json").is_file(), reason="shared GPT-2 absent")
needs_llama2 = pytest.mark.skipif(not (TOKENIZERS / "llama2" / "tokenizer.model").is_file(),
                                  reason="shared Llama-2 absent")


@pytest.fixture(scope="module")
def gsm8k_corpus(tmp_path_factory) -> Path | None:
    """The first 150 GSM8K test problems (question and answer) as a JSON-lines corpus."""
    if not GSM8K_TEST.is_file():
        return None
    path = tmp_path_factory.mktemp("gsm8k") / "sample.jsonl"
    with open(GSM8K_TEST, encoding="utf-8") as source:
        path.write_text("".join(line for _, line in zip(range(150), source)), encoding="utf-8")
    return path


@needs_gpt2
def test_gpt2_inspect_and_split_digits(tmp_path, gsm8k_corpus):
    source = TOKENIZERS / "gpt2"
    report = inspect_tokenizer(load_tokenizer(source), str(source))
    assert not report.digit_level
    assert load_tokenizer(source).tokenize("In 2024, 12345") == ["In", "Ġ2024", ",", "Ġ123", "45"]  # README
    assert report.digit_token_ids == {str(d): 15 + d for d in range(10)}  # README: digits are ids 15..24
    assert report.multi_digit_tokens > 1000 and report.space_marked_digit_tokens == 10
    corpora = [None] + ([gsm8k_corpus] if gsm8k_corpus else [])
    for index, corpus in enumerate(corpora):
        result = split_digits(source, tmp_path / f"out{index}", corpus=corpus)
        assert result.verification.passed, result.format()
        assert result.added_digits == {} and not result.needs_resize
    converted = AutoTokenizer.from_pretrained(str(tmp_path / "out0"))
    assert converted.tokenize("In 2024, 12345") == ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", "3", "4", "5"]
    original = load_tokenizer(source)
    text = "The quick brown fox jumps over the lazy dog."
    assert converted.encode(text) == original.encode(text)
    vocab = NumberVocab.load(tmp_path / "out0")
    assert vocab.token_ids == tuple(range(15, 25)) and vocab.vocab_size == 50257
    assert inspect_tokenizer(load_tokenizer(tmp_path / "out0")).digit_level


@needs_llama2
def test_llama2_is_digit_level_and_matches_sentencepiece(tmp_path, gsm8k_corpus):
    model_file = TOKENIZERS / "llama2" / "tokenizer.model"
    tokenizer = load_tokenizer(model_file)
    report = inspect_tokenizer(tokenizer, str(model_file))
    assert report.digit_level, report.format()
    assert report.digit_token_ids == LLAMA2_DIGIT_IDS
    assert dict(zip(report.number_vocab["tokens"], report.number_vocab["token_ids"])) == LLAMA2_DIGIT_IDS
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    texts = ["In 2024, 12345 apples cost $1,299.99.", "x86 -3.5 and 15/03/2024", "  two  spaces\nnew line 7"]
    if gsm8k_corpus:
        texts += [json.loads(line)["answer"] for line in gsm8k_corpus.read_text().splitlines()[:50]]
    for text in texts:
        assert tokenizer.encode(text, add_special_tokens=False) == processor.encode(text)
    result = split_digits(TOKENIZERS / "llama2", tmp_path / "out", corpus=gsm8k_corpus)
    assert result.verification.passed and result.digit_level_before and result.added_digits == {}
    assert NumberVocab.load(tmp_path / "out").token_ids == tuple(sorted(LLAMA2_DIGIT_IDS.values()))
