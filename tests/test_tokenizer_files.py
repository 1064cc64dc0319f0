"""Real tokenizer files: a tokenizer.json's own truncation/padding, and a model config.json beside the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from helpers.models import tiny_llama
from ntl_pretrain.tokenizer import inspect_tokenizer, load_tokenizer, resize_model, split_digits, verify_conversion
from ntl_pretrain.tokenizer.analysis import digit_split_problems
from ntl_pretrain.tokenizer.split_digits import plan_digit_split, save_split_tokenizer

from test_tokenizer_families import build_gpt2_style, number_corpus

pytestmark = [pytest.mark.fast, pytest.mark.timeout(180)]
# A long text first: more than 128 tokens, with digits after the 128th.
LONG_TEXT = " ".join(f"Ann sold {n} apples on day {n + 1} and walked {n * 3} miles." for n in range(40))
TRUNCATION = {"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0}


def _with_settings(source: Path, out: Path) -> Path:
    """The tokenizer folder with "truncation" (max_length 128) and fixed-length padding in tokenizer.json."""
    out.mkdir()
    for path in source.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    pad_id = data["added_tokens"][0]["id"]
    data["truncation"] = dict(TRUNCATION)
    data["padding"] = {"strategy": {"Fixed": 160}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": pad_id, "pad_type_id": 0, "pad_token": data["added_tokens"][0]["content"]}
    (out / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    plain = build_gpt2_style(root / "plain")
    return {"root": root, "plain": plain, "settings": _with_settings(plain, root / "settings")}


def test_truncation_and_padding_do_not_affect_split_digits(folders, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(LONG_TEXT + "\n" + "\n".join(number_corpus(40)) + "\n", encoding="utf-8")
    original = load_tokenizer(folders["settings"])
    assert original.backend_tokenizer.truncation["max_length"] == 128  # the setting is live in the backend
    direct = original.backend_tokenizer.encode(LONG_TEXT)
    assert sum(direct.attention_mask) == 128 and len(direct.ids) == 160  # cut at 128, padded to 160

    report = split_digits(folders["settings"], tmp_path / "out", corpus=corpus)
    assert report.verification.passed, report.format()
    assert report.removed_settings["truncation"]["max_length"] == 128 and "padding" in report.removed_settings
    saved = json.loads((tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved["truncation"] is None and saved["padding"] is None  # decided: converted files drop them
    reference = split_digits(folders["plain"], tmp_path / "reference", corpus=corpus)
    for name in ("digits", "round_trip", "digit_free"):
        assert getattr(report.verification, name) == getattr(reference.verification, name)
    converted = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert converted(LONG_TEXT)["input_ids"] == load_tokenizer(tmp_path / "reference")(LONG_TEXT)["input_ids"]


def test_checks_do_not_depend_on_sample_order(folders, tmp_path):
    """A fresh tokenizer (settings live) and one the wrapper has already used (settings cleared) agree."""
    texts = [LONG_TEXT] + number_corpus(20)
    results = []
    for order in (texts, texts[::-1]):
        original = load_tokenizer(folders["settings"])
        save_split_tokenizer(original, plan_digit_split(original), tmp_path / f"c{len(results)}")
        converted = load_tokenizer(folders["settings"])  # the conversion's pipeline, settings still in it
        converted.backend_tokenizer.pre_tokenizer = load_tokenizer(tmp_path / f"c{len(results)}").backend_tokenizer.pre_tokenizer
        assert converted.backend_tokenizer.truncation is not None
        assert digit_split_problems(converted, LONG_TEXT) == []
        assert converted.backend_tokenizer.truncation["max_length"] == 128  # the caller's tokenizer is left as it was
        results.append(verify_conversion(load_tokenizer(folders["settings"]), converted, order))
    assert results[0].passed and results[1].passed, results[0].format()
    assert results[0].digits.checked == results[1].digits.checked == len(texts)


def test_inspect_ignores_truncation_and_padding(folders):
    plain = inspect_tokenizer(load_tokenizer(folders["plain"]))
    tokenizer = load_tokenizer(folders["settings"])
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)  # even a tiny limit cuts no probe
    with_settings = inspect_tokenizer(tokenizer)
    assert [(p.tokens, p.digit_level) for p in with_settings.probes] == [(p.tokens, p.digit_level) for p in plain.probes]
    assert with_settings.digit_level == plain.digit_level and tokenizer.backend_tokenizer.truncation["max_length"] == 2


def _tiny_qwen2(vocab_size: int, folder: Path) -> Path:
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    Qwen2ForCausalLM(config).save_pretrained(str(folder))
    return folder


def test_resize_model_output_loads_verbatim_beside_a_qwen2_config(folders, tmp_path):
    """transformers 5 picks Qwen2Tokenizer for a folder with a qwen2 config.json; it rebuilds Qwen2's own
    pipeline (NFC, Qwen's regex) and drops the converted GPT-2-style pipeline with its digit split."""
    split = tmp_path / "split"
    split_digits(folders["settings"], split)
    expected = json.loads(load_tokenizer(split).backend_tokenizer.to_str())
    model = _tiny_qwen2(len(load_tokenizer(split)), tmp_path / "qwen2")
    report, number_vocab = resize_model(model, split, tmp_path / "out", pad_to_multiple_of=64)
    assert number_vocab is not None and report.new_rows % 64 == 0

    loaded = load_tokenizer(tmp_path / "out")  # the trainer's and the tools' loader
    got = json.loads(loaded.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "model", "decoder", "post_processor", "truncation", "padding"):
        assert got[key] == expected[key], key
    assert inspect_tokenizer(loaded).digit_level
    text = "In 2024, café $hello DON'T x86"
    assert loaded.tokenize(text) == load_tokenizer(split).tokenize(text)
    assert loaded.eos_token == "<|endoftext|>"
    saved = json.loads((tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8"))
    assert saved["pre_tokenizer"] == expected["pre_tokenizer"] and saved["truncation"] is None
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).config.vocab_size == report.new_rows
    # AutoTokenizer itself cannot be steered for qwen2 (transformers forces the family's class): the report says so
    assert type(AutoTokenizer.from_pretrained(str(tmp_path / "out"))).__name__ == "Qwen2Tokenizer"
    assert "Qwen2Tokenizer" in report.tokenizer_note and "PreTrainedTokenizerFast.from_pretrained(OUT)" in report.tokenizer_note
    generic = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "out"))
    assert generic.tokenize(text) == load_tokenizer(split).tokenize(text)
    saved_report = json.loads((tmp_path / "out" / "resize_report.json").read_text(encoding="utf-8"))
    assert saved_report["tokenizer_note"] == report.tokenizer_note


def test_resize_model_output_beside_a_llama_config_loads_verbatim_everywhere(folders, tmp_path):

    split = tmp_path / "split"
    split_digits(folders["plain"], split)
    tiny_llama(len(load_tokenizer(split)), num_hidden_layers=1, num_attention_heads=2,
               max_position_embeddings=2048).save_pretrained(str(tmp_path / "llama"))
    report, _ = resize_model(tmp_path / "llama", split, tmp_path / "out", pad_to_multiple_of=64)
    assert report.tokenizer_note == ""
    text = "In 2024, café $hello DON'T x86"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).tokenize(text) == load_tokenizer(split).tokenize(text)
