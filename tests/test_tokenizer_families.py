"""Tokenizer families built in the test from small corpora: inspect, split-digits, train-spm, number vocab.

Each family reproduces a real model's number handling:
- byte-level BPE with GPT-2's pre-tokenizer regex (multi-digit merges such as "Ġ20", "24");
- a Llama-3-style regex split into chunks of 1-3 digits, then byte-level BPE;
- a SentencePiece unigram model without split_digits (multi-digit pieces such as "▁2024");
- a SentencePiece unigram model with split_digits (already digit-level).
"""

from __future__ import annotations

import io
import json
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ntl_pretrain.numbers import DIGITS, NumberVocab
from ntl_pretrain.tokenizer import (SpmTrainConfig, inspect_tokenizer, is_digit_level, load_tokenizer, split_digits,
                                    train_spm)
from ntl_pretrain.tokenizer.corpus import SAMPLE_CORPUS

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]
LLAMA3_STYLE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NAMES = ["Ann", "Bob", "Carla", "Dev", "Emma", "Farid", "Gus"]
NOUNS = ["apples", "pages", "miles", "tickets", "coins", "books", "eggs"]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def number_corpus(lines: int = 600, seed: int = 0) -> list[str]:
    """Deterministic English text dense in numbers (years, prices, counts, dates, arithmetic)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        name, noun = rng.choice(NAMES), rng.choice(NOUNS)
        year, count, price = rng.randint(1900, 2030), rng.randint(0, 999), rng.randint(0, 99999) / 100
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(rng.choice([
            f"In {year}, {name} sold {count} {noun} for ${price:.2f}.",
            f"{name} has {a} {noun} and buys {b} more, so {a} + {b} = {a + b}.",
            f"On {year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} the total was {count * 7} {noun}.",
            f"The answer is {a * b}. {name} read {count} pages in {rng.randint(1, 9)} days.",
            f"{name} walked 7 miles, then 7 more, and 77 in the year {year}.",
        ]))
    return out


def all_digit_texts() -> list[str]:
    return number_corpus() + list(SAMPLE_CORPUS)


def _save_tokenizers_backend(tokenizer: Tokenizer, folder: Path, **special) -> Path:
    TokenizersBackend(tokenizer_object=tokenizer, **special).save_pretrained(str(folder))
    return folder


def build_gpt2_style(folder: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # use_regex: GPT-2's pattern
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(all_digit_texts(), trainer)
    return _save_tokenizers_backend(tokenizer, folder, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                    chat_template=CHAT_TEMPLATE)


def build_llama3_style(folder: Path) -> Path:
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_STYLE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(all_digit_texts(), trainer)
    return _save_tokenizers_backend(tokenizer, folder, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def train_sentencepiece(texts: list[str], split_digits: bool, vocab_size: int = 400,
                        model_type: str = "unigram") -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        split_digits=split_digits, character_coverage=1.0, byte_fallback=False, num_threads=1, minloglevel=2,
        hard_vocab_limit=False)
    return model.getvalue()


def build_spm(folder: Path, split_digits: bool) -> Path:
    """A SentencePiece folder (tokenizer.model only) as published for T5-style or Llama-2-style models."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(train_sentencepiece(all_digit_texts(), split_digits))
    return folder


BUILDERS = {
    "gpt2_style": build_gpt2_style,
    "llama3_style": build_llama3_style,
    "spm_unigram_multi_digit": lambda folder: build_spm(folder, split_digits=False),
    "spm_split_digits": lambda folder: build_spm(folder, split_digits=True),
}
DIGIT_LEVEL_BEFORE = {"gpt2_style": False, "llama3_style": False, "spm_unigram_multi_digit": False,
                      "spm_split_digits": True}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module")
def converted_dirs(family_dirs, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("converted")
    return {name: (root / name, split_digits(folder, root / name)) for name, folder in family_dirs.items()}


def _digits_in_tokens(tokenizer, text: str) -> tuple[list[str], list[str]]:
    """Tokens holding a digit, and the digits of the text as the tokenizer's normalizer (e.g. NFKC) leaves it."""
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
    normalizer = tokenizer.backend_tokenizer.normalizer
    normalized = normalizer.normalize_str(text) if normalizer is not None else text
    return [t for t in tokens if re.search(r"[0-9]", t)], re.findall(r"[0-9]", normalized)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_inspect_verdict_before_conversion(family, family_dirs):
    tokenizer = load_tokenizer(family_dirs[family])
    report = inspect_tokenizer(tokenizer, str(family_dirs[family]))
    assert report.digit_level is DIGIT_LEVEL_BEFORE[family], report.format()
    assert len(report.probes) >= 12 + 8
    # each probe's tokens are the tokenizer's own encoding of the probe text
    for probe in report.probes:
        assert probe.ids == tokenizer.encode(probe.text, add_special_tokens=False)
    if DIGIT_LEVEL_BEFORE[family]:
        assert report.multi_digit_tokens == 0 and "number-vocab" in report.advice
        assert report.number_vocab["tokens"] == sorted(DIGITS, key=lambda d: tokenizer.get_vocab()[d])
    else:
        # the family really reproduces multi-digit number tokens, and the advice names the fix
        assert report.multi_digit_tokens > 0, report.format()
        assert f"split-digits {family_dirs[family]}" in report.advice
    json.loads(report.to_json())  # --json output is valid JSON
    assert ("DIGIT-LEVEL" if report.digit_level else "NOT digit-level") in report.format()


@pytest.mark.parametrize("family", list(BUILDERS))
def test_split_digits_checks_and_number_vocab(family, family_dirs, converted_dirs):
    out, report = converted_dirs[family]
    assert report.verification.passed, report.format()
    assert report.verification.samples == len(SAMPLE_CORPUS)
    assert report.verification.digit_free.checked > 100
    assert report.digit_level_before is DIGIT_LEVEL_BEFORE[family]
    original = load_tokenizer(family_dirs[family])
    converted = AutoTokenizer.from_pretrained(str(out))  # exactly what the trainer does
    assert is_digit_level(converted, all_digit_texts())
    for text in all_digit_texts():
        digit_tokens, digits = _digits_in_tokens(converted, text)
        assert digit_tokens == digits, text  # (a) one bare digit token per digit, in order
        assert converted.decode(converted.encode(text, add_special_tokens=False)) == original.decode(
            original.encode(text, add_special_tokens=False))  # (b)
        if not digits:  # (c) digit-free text (after normalisation): identical ids
            assert converted.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)
    # digit-free words inside number-bearing text keep their ids too
    for word in ("the", " total", " apples", "In", " walked"):
        assert converted.encode(word, add_special_tokens=False) == original.encode(word, add_special_tokens=False)
    # the trainer's number vocabulary: written beside the tokenizer and equal to the one built from it
    saved = NumberVocab.load(out)
    assert saved == NumberVocab.from_tokenizer(converted)
    vocab = converted.get_vocab()
    assert sorted(saved.tokens) == list(DIGITS)
    assert all(vocab[token] == token_id for token, token_id in zip(saved.tokens, saved.token_ids))
    assert saved.vocab_size == len(converted)
    # special tokens, chat template and normaliser survive the rewrite
    assert converted.bos_token == original.bos_token and converted.eos_token == original.eos_token
    assert converted.all_special_tokens == original.all_special_tokens
    assert converted.chat_template == original.chat_template
    if family == "gpt2_style":
        assert converted.chat_template == CHAT_TEMPLATE
    before, after = (json.loads(t.backend_tokenizer.to_str())["normalizer"] for t in (original, converted))
    assert after == before
    assert json.loads((out / "split_digits.json").read_text())["verification"]["passed"] is True


def test_split_digits_gives_the_expected_pieces(converted_dirs):
    gpt2 = AutoTokenizer.from_pretrained(str(converted_dirs["gpt2_style"][0]))
    assert gpt2.tokenize("In 2024") == ["In", "Ġ", "2", "0", "2", "4"]
    llama3 = AutoTokenizer.from_pretrained(str(converted_dirs["llama3_style"][0]))
    assert llama3.tokenize("12345") == ["1", "2", "3", "4", "5"]
    spm = AutoTokenizer.from_pretrained(str(converted_dirs["spm_unigram_multi_digit"][0]))
    assert spm.tokenize(" 2024")[-4:] == ["2", "0", "2", "4"]
    # non-ASCII numerals and byte-level "³" are ordinary text: unchanged
    original = load_tokenizer(converted_dirs["gpt2_style"][1].source)
    for text in ("ó³ ½ ٣", "x²"):
        assert gpt2.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False)


def test_split_digits_is_idempotent(converted_dirs, tmp_path):
    out, first = converted_dirs["gpt2_style"]
    again = split_digits(out, tmp_path / "again")
    assert again.verification.passed and again.digit_level_before
    assert again.pipeline_after == first.pipeline_after  # no second digit-splitting step
    assert (json.loads((tmp_path / "again" / "tokenizer.json").read_text())["pre_tokenizer"]
            == json.loads((out / "tokenizer.json").read_text())["pre_tokenizer"])


def test_split_digits_with_corpus_file(family_dirs, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"question": q, "answer": "#### 12"}) for q in number_corpus(50, seed=3)))
    report = split_digits(family_dirs["llama3_style"], tmp_path / "out", corpus=corpus)
    assert report.verification.passed and report.corpus == str(corpus)
    assert report.verification.samples == -(-100 // 8)  # 100 lines (question + answer) in samples of 8 lines


def test_missing_digit_is_added(tmp_path):
    texts = [line for line in all_digit_texts() if "7" not in line]
    folder = tmp_path / "no7"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(train_sentencepiece(texts, split_digits=False))
    before = load_tokenizer(folder)
    assert "7" not in before.get_vocab() and not inspect_tokenizer(before).digit_level
    report = split_digits(folder, tmp_path / "out")
    after = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert report.added_digits == {"7": len(before)} and report.needs_resize
    assert len(after) == len(before) + 1
    assert after.tokenize(" 1797")[-4:] == ["1", "7", "9", "7"]
    assert after.decode(after.encode(" 1797", add_special_tokens=False)).strip() == "1797"
    assert NumberVocab.load(tmp_path / "out").token_ids[-1] == len(before)


def test_train_spm_is_digit_level_and_loads_directly(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(number_corpus(400)))
    report = train_spm(corpus, tmp_path / "spm", SpmTrainConfig(vocab_size=400, num_threads=1))
    assert report.digit_level and report.parity.passed and report.pieces == 400
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "spm"))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm" / "tokenizer.model"))
    assert processor.encode("In 2024, Ann sold 12345 apples.") == tokenizer.encode(
        "In 2024, Ann sold 12345 apples.", add_special_tokens=False)
    text = "Ünïcödé → 42"  # characters missing from the corpus fall back to bytes, not <unk>
    assert tokenizer.unk_token_id not in tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert is_digit_level(tokenizer)
    assert NumberVocab.load(tmp_path / "spm") == NumberVocab.from_tokenizer(tokenizer)
    assert inspect_tokenizer(load_tokenizer(tmp_path / "spm" / "tokenizer.model")).digit_level


def test_train_spm_command(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": line}) for line in number_corpus(300, seed=5)))
    tool = runpy.run_path(str(REPO / "tools" / "tokenizer.py"))
    assert tool["main"](["train-spm", str(corpus), str(tmp_path / "unigram"), "--vocab-size", "320",
                         "--model-type", "unigram", "--num-threads", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["digit_level"] and report["config"]["model_type"] == "unigram" and report["pieces"] == 320
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "unigram"))
    assert tokenizer.tokenize("Ann sold 2024")[-4:] == ["2", "0", "2", "4"]
    assert NumberVocab.load(tmp_path / "unigram").token_ids == tuple(report["number_vocab"]["token_ids"])


def test_train_spm_vocab_too_large_for_corpus(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("one 1 two 2\n" * 20)
    with pytest.raises(ValueError, match="--vocab-size 5000 is too large for this corpus"):
        train_spm(corpus, tmp_path / "out", SpmTrainConfig(vocab_size=5000, num_threads=1))
    assert not (tmp_path / "out").exists()


def test_command_line_end_to_end(family_dirs, tmp_path):
    tool = [sys.executable, str(REPO / "tools" / "tokenizer.py")]
    help_text = subprocess.run(tool + ["--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for command in ("inspect", "split-digits", "train-spm", "resize-model", "number-vocab"):
        assert command in help_text
    out = tmp_path / "converted"
    script = (
        f"import runpy; tool = runpy.run_path({str(REPO / 'tools' / 'tokenizer.py')!r});"
        f"codes = [tool['main'](['split-digits', {str(family_dirs['gpt2_style'])!r}, {str(out)!r}, '--json']),"
        f"         tool['main'](['inspect', {str(out)!r}, '--json']),"
        f"         tool['main'](['split-digits', {str(family_dirs['gpt2_style'])!r}, {str(out)!r}])];"
        "print('CODES', codes)")
    result = subprocess.run([sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=120)
    assert "CODES [0, 0, 2]" in result.stdout, result.stderr
    decoder = json.JSONDecoder()
    split_report, end = decoder.raw_decode(result.stdout.lstrip())
    inspection, _ = decoder.raw_decode(result.stdout.lstrip()[end:].lstrip())
    assert split_report["verification"]["passed"] and inspection["digit_level"] is True
    assert "already exists; pass --force" in result.stderr


def test_train_spm_samples_lines_uniformly(tmp_path):
    from ntl_pretrain.tokenizer.spm import _sample_lines

    corpus = tmp_path / "lines.txt"
    corpus.write_text("\n".join(f"line {i}" for i in range(2000)) + "\n\n")
    sample = _sample_lines([corpus], 200)
    indices = [int(line.split()[1]) for line in sample]
    assert len(set(indices)) == 200 and indices == sorted(indices)
    assert 60 < sum(i < 1000 for i in indices) < 140  # both halves of the corpus, not just its start
    assert sample == _sample_lines([corpus], 200)  # reproducible
    assert len(_sample_lines([corpus], 0)) == 2000


def test_split_digits_on_a_digit_level_tokenizer_says_so_and_keeps_the_pipeline(family_dirs, converted_dirs):
    out, report = converted_dirs["spm_split_digits"]
    original = load_tokenizer(family_dirs["spm_split_digits"])
    converted = load_tokenizer(out)
    assert report.digit_level_before and report.added_digits == {}
    assert report.pipeline_after == report.pipeline_before
    assert (json.loads(converted.backend_tokenizer.to_str())["pre_tokenizer"]
            == json.loads(original.backend_tokenizer.to_str())["pre_tokenizer"])
    assert "ALREADY DIGIT-LEVEL" in report.format() and "number-vocab" in report.format()
    assert "ALREADY DIGIT-LEVEL" not in converted_dirs["gpt2_style"][1].format()


def test_inspect_counts_special_tokens_apart(family_dirs):
    tokenizer = load_tokenizer(family_dirs["llama3_style"])
    specials = ["[control_8]", "<|reserved_special_token_12|>", "<|reserved_special_token_250|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    report = inspect_tokenizer(tokenizer, "llama3_style")
    assert set(report.special_digit_examples) == set(specials) == {
        token for token in tokenizer.all_special_tokens if re.search(r"[0-9]", token)}
    assert report.special_digit_tokens == 3
    assert not set(specials) & set(report.other_digit_examples + report.multi_digit_examples)
    assert "special tokens with digits in their name (not text, never numbers): 3" in report.format()
