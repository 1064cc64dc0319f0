"""Train a digit-level SentencePiece tokenizer and save it as a Hugging Face tokenizer folder.

`split_digits` makes every digit its own piece, `byte_fallback` spells characters outside the
vocabulary as byte pieces "<0x..>" instead of "<unk>" (the Llama-2 / Mistral recipe). The model is
converted with transformers' own SentencePiece converter, checked to encode the corpus exactly as
`sentencepiece` does, and saved with `tokenizer.json` so `AutoTokenizer.from_pretrained(OUT)` loads it.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
from dataclasses import asdict, dataclass

import sentencepiece

from ntl_pretrain.core.numbers import NumberVocab
from ntl_pretrain.tokenizer.analysis import CheckResult
from ntl_pretrain.tokenizer.corpus import SAMPLE_CORPUS, iter_corpus_lines, read_corpus
from ntl_pretrain.tokenizer.loading import (SENTENCEPIECE_MODEL, atomic_output_dir, check_output_dir, load_tokenizer,
                                            load_verbatim)
from ntl_pretrain.tokenizer.split_digits import is_digit_level

REPORT_FILENAME = "train_spm.json"
MODEL_TYPES = ("bpe", "unigram")
NORMALIZATIONS = ("identity", "nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf")
PARITY_SAMPLES = 500


@dataclass
class SpmTrainConfig:
    """Options of `train-spm`; digits are always split and byte fallback is always on."""

    vocab_size: int = 32000
    """Total number of pieces, including the 256 byte pieces and <unk>, <s>, </s>."""
    model_type: str = "bpe"
    """SentencePiece algorithm: "bpe" (Llama, Mistral) or "unigram" (T5)."""
    character_coverage: float = 0.9995
    """Share of the corpus' characters that get their own piece; rarer ones are spelled in bytes."""
    normalization: str = "identity"
    """SentencePiece normalization rule: "identity" keeps text verbatim, "nmt_nfkc" applies NFKC."""
    max_sentences: int = 2_000_000
    """Lines sampled uniformly from the corpus for training (bounds memory); 0 = all lines."""
    max_sentence_length: int = 16384
    """Longest line in bytes that training uses; longer lines are skipped."""
    num_threads: int = 0
    """Trainer threads; 0 = all CPU cores."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; use one of {MODEL_TYPES}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r} is not a SentencePiece rule; use one of "
                             f"{NORMALIZATIONS}")
        if self.vocab_size < 270:
            raise ValueError(f"vocab_size={self.vocab_size} is too small: the 256 byte pieces, 3 special pieces and "
                             f"the ten digits alone need 269; use --vocab-size 270 or more")
        if not 0.0 < self.character_coverage <= 1.0:
            raise ValueError(f"character_coverage={self.character_coverage} must be in (0, 1]")
        if self.max_sentences < 0 or self.max_sentence_length < 1 or self.num_threads < 0:
            raise ValueError("max_sentences and num_threads must be >= 0 and max_sentence_length >= 1")


@dataclass
class SpmTrainReport:
    """What `train-spm` produced and checked."""

    corpus: list[str]
    out_dir: str
    config: dict
    pieces: int
    digit_level: bool
    parity: CheckResult
    number_vocab: dict

    def to_dict(self) -> dict:
        data = asdict(self)
        data["parity"]["passed"] = self.parity.passed
        return data

    def format(self) -> str:
        ids = ", ".join(f"{t}={i}" for t, i in zip(self.number_vocab["tokens"], self.number_vocab["token_ids"]))
        return "\n".join([
            f"train-spm {' '.join(self.corpus)} -> {self.out_dir}",
            f"  {self.config['model_type']} model, {self.pieces} pieces, split_digits and byte_fallback on, "
            f"normalization {self.config['normalization']}",
            f"  Hugging Face tokenizer encodes like sentencepiece on {self.parity.checked - self.parity.failed}/"
            f"{self.parity.checked} texts",
            f"  digit-level: {'yes' if self.digit_level else 'NO'}",
            f"  number vocabulary (number_vocab.json): {ids}",
        ])


def _sample_lines(files: list, limit: int, seed: int = 0) -> list[str]:
    """A uniform sample of `limit` corpus lines (all lines when `limit` is 0), in corpus order.

    Reservoir sampling keeps memory at `limit` lines however large the corpus, and a fixed seed makes
    training reproducible.
    """
    if not limit:
        return list(iter_corpus_lines(files))
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for index, line in enumerate(iter_corpus_lines(files)):
        if index < limit:
            reservoir.append((index, line))
        else:
            slot = rng.randint(0, index)
            if slot < limit:
                reservoir[slot] = (index, line)
    return [line for _, line in sorted(reservoir)]


def _train(lines, config: SpmTrainConfig) -> bytes:
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines, model_writer=model, vocab_size=config.vocab_size, model_type=config.model_type,
            character_coverage=config.character_coverage, normalization_rule_name=config.normalization,
            split_digits=True, byte_fallback=True, required_chars="0123456789", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            input_sentence_size=0, shuffle_input_sentence=False,  # already sampled by _sample_lines
            max_sentence_length=config.max_sentence_length, num_threads=config.num_threads or os.cpu_count() or 1,
            minloglevel=2)
    except RuntimeError as error:
        message = str(error)
        too_high = re.search(r"Vocabulary size (?:is )?too high \((\d+)\).*?<= (\d+)", message)
        if too_high:
            raise ValueError(f"--vocab-size {too_high.group(1)} is too large for this corpus: SentencePiece can find "
                             f"at most {too_high.group(2)} pieces in it. Use a smaller --vocab-size or more text"
                             ) from None
        raise ValueError(f"SentencePiece training failed: {message}") from None
    return model.getvalue()


def train_spm(corpus: list[str | os.PathLike] | str | os.PathLike, out_dir: str | os.PathLike,
              config: SpmTrainConfig | None = None, force: bool = False) -> SpmTrainReport:
    """Train on the corpus files (plain text or JSON lines) and write a tokenizer folder to `out_dir`.

    The folder holds `tokenizer.json`, `tokenizer_config.json`, the SentencePiece `tokenizer.model`,
    `number_vocab.json` and `train_spm.json` (this report).
    """
    config = config or SpmTrainConfig()
    files = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not files:
        raise ValueError("train-spm needs at least one corpus file")
    check_output_dir(out_dir, force)
    samples = [text for path in files for text in read_corpus(path, max_samples=PARITY_SAMPLES, lines_per_sample=1)]
    model_bytes = _train(iter(_sample_lines(files, config.max_sentences)), config)
    with atomic_output_dir(out_dir, force) as staging:
        model_path = staging / SENTENCEPIECE_MODEL
        model_path.write_bytes(model_bytes)
        converted = load_tokenizer(staging)  # transformers' SentencePiece -> tokenizers conversion
        converted.save_pretrained(str(staging))
        load_verbatim(staging)
        tokenizer = load_tokenizer(staging)  # what the trainer will load: tokenizer.json + tokenizer_config.json
        processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        parity = CheckResult("sentencepiece_parity")
        for text in samples[:PARITY_SAMPLES] + list(SAMPLE_CORPUS):
            parity.checked += 1
            expected = processor.encode(text)
            got = tokenizer.encode(text, add_special_tokens=False)
            if expected != got:
                parity.fail(f"{text[:60]!r}: sentencepiece {processor.encode(text, out_type=str)[:12]} vs "
                            f"transformers {tokenizer.convert_ids_to_tokens(got)[:12]}")
        if not parity.passed:
            raise RuntimeError("the Hugging Face conversion of the trained model does not encode like sentencepiece: "
                               + "; ".join(parity.examples))
        number_vocab = NumberVocab.from_tokenizer(tokenizer)
        number_vocab.save(staging)
        report = SpmTrainReport(corpus=[str(f) for f in files], out_dir=str(out_dir), config=asdict(config),
                                pieces=processor.get_piece_size(), digit_level=is_digit_level(tokenizer),
                                parity=parity, number_vocab=number_vocab.to_dict())
        if not report.digit_level:
            raise RuntimeError("the trained tokenizer is not digit-level although split_digits was on")
        (staging / REPORT_FILENAME).write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return report
