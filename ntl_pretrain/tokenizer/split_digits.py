"""Rewrite a Hugging Face fast tokenizer so that every digit is its own token.

The rewrite appends one pre-tokenization step, `Split("[0-9]", behavior="isolated")`, at the END of
the tokenizer's pre-tokenizer pipeline (creating one if there is none):

- byte-level BPE (GPT-2: `ByteLevel` with its regex): after the byte-to-unicode mapping ASCII digits
  are still "0".."9" and nothing else maps onto them, so " 2024" -> "Ġ", "2", "0", "2", "4";
- regex split then byte-level (Llama-3: `\\p{N}{1,3}` chunks): the chunks are split further;
- SentencePiece / Metaspace (T5, Llama-2 converted by transformers): "▁2024" -> "▁", "2", ...,
  as SentencePiece's own `split_digits` does.

Placing it last means a pre-token without a digit is handed to the model exactly as before, so the
tokenization of digit-free text does not change. It is a regex on ASCII digits rather than
`pre_tokenizers.Digits(individual_digits=True)` on purpose: `Digits` isolates every Unicode numeric
character, and after the byte-level mapping bytes such as 0xB2/0xB3/0xB9 are the characters
"²", "³", "¹", so it would cut UTF-8 text such as "ó" ("Ã³") apart.

Digits missing from the vocabulary are added to the model vocabulary (BPE, WordPiece, WordLevel,
and Unigram when its next id is free) or otherwise as non-special added tokens, with new ids after
all existing ones, so no existing id moves. Special tokens, added tokens, normalizer, decoder,
post-processor and the chat template are kept; the file's own `truncation` and `padding` are dropped
(transformers sets them per call; in the file they would cut or pad text for direct `tokenizers`
users, and they must not cut the verification texts). The result is saved with `tokenizer_class`
"PreTrainedTokenizerFast" so that transformers loads `tokenizer.json` verbatim instead of rebuilding
a model-specific pipeline (which would drop the new step).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ntl_pretrain.core.numbers import DIGITS, NumberVocab, check_digits_kept
from ntl_pretrain.tokenizer.analysis import VerificationReport, digit_split_problems, verify_conversion
from ntl_pretrain.tokenizer.corpus import SAMPLE_CORPUS, read_corpus
from ntl_pretrain.tokenizer.tiktoken_bpe import TIKTOKEN_SUFFIXES, is_tiktoken_bpe
from ntl_pretrain.tokenizer.loading import (atomic_output_dir, check_output_dir, load_tokenizer, save_verbatim,
                                            without_encoding_settings)

ISOLATE_DIGITS = {"type": "Split", "pattern": {"Regex": "[0-9]"}, "behavior": "Isolated", "invert": False}
REPORT_FILENAME = "split_digits.json"


class ConversionCheckError(ValueError):
    """The converted tokenizer failed a verification check; nothing was written."""

    def __init__(self, report: VerificationReport):
        super().__init__("the converted tokenizer failed verification, nothing was written:\n" + report.format())
        self.report = report


# ---------------------------------------------------------------------------------------------- pipeline
def _flatten(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [step for child in node.get(key, []) for step in _flatten(child, key)]
    return [node]


def _describe_step(step: dict) -> str:
    kind = step.get("type", "?")
    if kind == "ByteLevel":
        return f"ByteLevel(regex={'GPT-2' if step.get('use_regex', True) else 'off'})"
    if kind == "Split":
        pattern = step.get("pattern", {})
        text = pattern.get("Regex", pattern.get("String", ""))
        return f"Split({text[:40] + '...' if len(text) > 40 else text!r}, {step.get('behavior', '').lower()})"
    if kind == "Metaspace":
        return f"Metaspace(prepend={step.get('prepend_scheme', 'always')}, split={step.get('split', True)})"
    if kind == "Digits":
        return f"Digits(individual={step.get('individual_digits', False)})"
    if kind == "Replace":
        pattern = step.get("pattern", {})
        return f"Replace({pattern.get('String', pattern.get('Regex', ''))!r}->{step.get('content', '')!r})"
    return kind


def describe_pipeline(backend_json: dict) -> str:
    """One line: normalizer steps; pre-tokenizer steps; model type."""
    normalizer = [_describe_step(s) for s in _flatten(backend_json.get("normalizer"), "normalizers")]
    pre = [_describe_step(s) for s in _flatten(backend_json.get("pre_tokenizer"), "pretokenizers")]
    model = backend_json.get("model", {})
    model_text = model.get("type", "?") + ("(byte_fallback)" if model.get("byte_fallback") else "")
    return (f"normalizer: {' -> '.join(normalizer) or 'none'}; pre-tokenizer: {' -> '.join(pre) or 'none'}; "
            f"model: {model_text}")


def tokenizer_family(backend_json: dict) -> str:
    """A short name of how the pipeline treats numbers (for reports)."""
    steps = _flatten(backend_json.get("pre_tokenizer"), "pretokenizers")
    kinds = [step.get("type") for step in steps]
    normalizers = _flatten(backend_json.get("normalizer"), "normalizers")
    if "ByteLevel" in kinds:
        byte_level = steps[kinds.index("ByteLevel")]
        splits = [s for s in steps[:kinds.index("ByteLevel")] if s.get("type") == "Split"]
        if any("\\p{N}{1,3}" in s.get("pattern", {}).get("Regex", "") for s in splits):
            return "regex split with 1-3 digit chunks + byte-level BPE (Llama-3 style)"
        if splits:
            return "regex split + byte-level BPE"
        if byte_level.get("use_regex", True):
            return "byte-level BPE with the GPT-2 regex"
        return "byte-level BPE"
    if "Metaspace" in kinds:
        return f"SentencePiece-style Metaspace + {backend_json.get('model', {}).get('type', '?')}"
    if any(n.get("type") == "Replace" and n.get("content") == "▁" for n in normalizers):
        return f"SentencePiece-style (spaces escaped by the normalizer) + {backend_json.get('model', {}).get('type')}"
    return f"{' + '.join(k for k in kinds if k) or 'no pre-tokenizer'} + {backend_json.get('model', {}).get('type')}"


def _with_isolated_digits(pre_tokenizer: dict | None) -> tuple[dict, bool]:
    """The pre-tokenizer with the digit-isolating step appended last; False if it is already there."""
    steps = _flatten(pre_tokenizer, "pretokenizers")
    if steps and steps[-1] == ISOLATE_DIGITS:
        return pre_tokenizer, False
    return {"type": "Sequence", "pretokenizers": steps + [dict(ISOLATE_DIGITS)]}, True


def _add_missing_digits(backend_json: dict) -> tuple[dict[str, int], str]:
    """Add the digits absent from the vocabulary, with ids after every existing id."""
    model = backend_json["model"]
    added_tokens = backend_json.setdefault("added_tokens", [])
    kind = model.get("type")
    if kind == "Unigram":
        model_ids = {piece: index for index, (piece, _score) in enumerate(model["vocab"])}
    elif isinstance(model.get("vocab"), dict):
        model_ids = dict(model["vocab"])
    else:
        raise ValueError(f"cannot add digit tokens to a tokenizer model of type {kind!r}")
    present = set(model_ids) | {token["content"] for token in added_tokens}
    missing = [digit for digit in DIGITS if digit not in present]
    if not missing:
        return {}, ""
    next_id = max(list(model_ids.values()) + [token["id"] for token in added_tokens] + [-1]) + 1
    added: dict[str, int] = {}
    if kind == "Unigram" and len(model["vocab"]) == next_id:
        # Unigram ids are list positions: appending is possible only when no added token sits there.
        floor = min(score for _piece, score in model["vocab"])
        for digit in missing:
            model["vocab"].append([digit, floor])
            added[digit] = next_id
            next_id += 1
        return added, "model vocabulary"
    if kind != "Unigram":
        for digit in missing:
            model["vocab"][digit] = next_id
            added[digit] = next_id
            next_id += 1
        return added, "model vocabulary"
    for digit in missing:
        added_tokens.append({"id": next_id, "content": digit, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": True, "special": False})
        added[digit] = next_id
        next_id += 1
    return added, "added tokens"


@dataclass
class DigitSplitPlan:
    """The rewritten `tokenizers` pipeline and what changed."""

    backend_json: dict
    family: str
    pipeline_before: str
    pipeline_after: str
    step_added: bool
    added_digits: dict[str, int] = field(default_factory=dict)
    added_as: str = ""
    removed_settings: dict[str, dict] = field(default_factory=dict)
    """`truncation`/`padding` the original tokenizer.json carried, which the converted one drops."""


def plan_digit_split(tokenizer: TokenizersBackend, isolate_digits: bool = True) -> DigitSplitPlan:
    """Rewrite the tokenizer's pipeline in memory (the tokenizer itself is not modified); `isolate_digits=False`
    keeps the pre-tokenizer as it is (for a tokenizer that is digit-level already)."""
    backend_json = json.loads(tokenizer.backend_tokenizer.to_str())
    removed = without_encoding_settings(backend_json)
    before = describe_pipeline(backend_json)
    family = tokenizer_family(backend_json)
    step_added = False
    if isolate_digits:
        backend_json["pre_tokenizer"], step_added = _with_isolated_digits(backend_json.get("pre_tokenizer"))
    added, added_as = _add_missing_digits(backend_json)
    Tokenizer.from_str(json.dumps(backend_json))  # fail here, not after writing, if the rewrite is invalid
    return DigitSplitPlan(backend_json=backend_json, family=family, pipeline_before=before,
                          pipeline_after=describe_pipeline(backend_json), step_added=step_added,
                          added_digits=added, added_as=added_as, removed_settings=removed)


def save_split_tokenizer(tokenizer: TokenizersBackend, plan: DigitSplitPlan, folder: str | os.PathLike) -> None:
    """Write the tokenizer with the planned pipeline into `folder` (a fresh, empty folder)."""
    save_verbatim(tokenizer, folder, plan.backend_json)


# ---------------------------------------------------------------------------------------------- command
@dataclass
class SplitDigitsReport:
    """What `split-digits` did and verified."""

    source: str
    out_dir: str
    family: str
    pipeline_before: str
    pipeline_after: str
    digit_level_before: bool
    tokenizer_size_before: int
    tokenizer_size_after: int
    added_digits: dict[str, int]
    added_as: str
    corpus: str
    verification: VerificationReport
    number_vocab: dict
    removed_settings: dict[str, dict] = field(default_factory=dict)

    @property
    def needs_resize(self) -> bool:
        return self.tokenizer_size_after > self.tokenizer_size_before

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verification"] = self.verification.to_dict()
        data["needs_resize"] = self.needs_resize
        return data

    def format(self) -> str:
        lines = [
            f"split-digits {self.source} -> {self.out_dir}",
            f"  family:  {self.family}",
            f"  before:  {self.pipeline_before}",
            f"  after:   {self.pipeline_after}",
            f"  digit-level before: {'yes' if self.digit_level_before else 'no'}",
        ]
        if self.digit_level_before:
            lines.append(f"  ALREADY DIGIT-LEVEL: nothing to convert; the pipeline is left as it is and {self.out_dir} "
                         f"is a verified copy with number_vocab.json. The original works as it is (python "
                         f"tools/tokenizer.py number-vocab {self.source})")
        if self.added_digits:
            lines.append(f"  added digit tokens ({self.added_as}): "
                         + ", ".join(f"{d!r}={i}" for d, i in self.added_digits.items()))
        else:
            lines.append("  added digit tokens: none (all ten digits were in the vocabulary)")
        lines.append(f"  tokenizer size: {self.tokenizer_size_before} -> {self.tokenizer_size_after}")
        for key, value in self.removed_settings.items():
            lines.append(f"  removed from tokenizer.json: {key} {value} (transformers sets it per call)")
        lines.append(f"  corpus: {self.corpus}")
        lines += ["  " + line for line in self.verification.format().splitlines()]
        ids = ", ".join(f"{t}={i}" for t, i in zip(self.number_vocab["tokens"], self.number_vocab["token_ids"]))
        lines.append(f"  number vocabulary (number_vocab.json): {ids}")
        if self.needs_resize:
            lines.append(f"  NEXT: the tokenizer gained {self.tokenizer_size_after - self.tokenizer_size_before} "
                         f"tokens; resize the model's embeddings: python tools/tokenizer.py resize-model MODEL "
                         f"{self.out_dir} OUT_MODEL --pad-to-multiple-of 64")
        return "\n".join(lines)


def is_digit_level(tokenizer: TokenizersBackend, texts: tuple[str, ...] | list[str] = SAMPLE_CORPUS) -> bool:
    """All ten bare digits exist and every digit of every text is its own bare digit token."""
    vocab = tokenizer.get_vocab()
    return all(d in vocab for d in DIGITS) and not any(digit_split_problems(tokenizer, t) for t in texts)


def _is_tiktoken_file(source: str | os.PathLike) -> bool:
    """What `load_tokenizer` reads as a tiktoken file (a folder or a hub id is not one)."""
    path = Path(source)
    return path.is_file() and path.suffix in TIKTOKEN_SUFFIXES and is_tiktoken_bpe(path)


def split_digits(source: str | os.PathLike, out_dir: str | os.PathLike, corpus: str | os.PathLike | None = None,
                 force: bool = False, trust_remote_code: bool = False,
                 progress: Callable[[str], None] | None = None) -> SplitDigitsReport:
    """Convert the tokenizer at `source` to one digit per token, verify it, and save it to `out_dir`.

    `out_dir` receives the tokenizer files, `number_vocab.json` (read by the trainer) and
    `split_digits.json` (this report). Nothing is written if a check fails (`ConversionCheckError`).
    `progress` is told each phase as it starts (deriving the merges of a large tiktoken file is the longest).
    """
    say = progress or (lambda _message: None)
    check_output_dir(out_dir, force, sources=(source,))
    texts = read_corpus(corpus) if corpus is not None else list(SAMPLE_CORPUS)
    say(f"loading {source}" + (" (a tiktoken file: its merges are derived from its ranks first, the longest phase for a "
                               "large vocabulary)" if _is_tiktoken_file(source) else ""))
    original = load_tokenizer(source, trust_remote_code=trust_remote_code)
    check_digits_kept(original, str(source))  # a normalizer rewriting digits is not something a digit split fixes
    say(f"loaded {len(original)} tokens; planning the digit split")
    # already digit-level on the built-in sample and the corpus: the pipeline is kept as it is (the copy is
    # still verified and gets its number_vocab.json)
    digit_level_before = is_digit_level(original, list(SAMPLE_CORPUS) + list(texts))
    plan = plan_digit_split(original, isolate_digits=not digit_level_before)
    with atomic_output_dir(out_dir, force) as staging:
        say("writing the converted tokenizer and loading it back")
        save_split_tokenizer(original, plan, staging)
        converted = load_tokenizer(staging)  # verify exactly what the trainer will load
        loaded_pre = json.loads(converted.backend_tokenizer.to_str()).get("pre_tokenizer")
        if loaded_pre != plan.backend_json["pre_tokenizer"]:
            raise RuntimeError("transformers did not load the rewritten pre-tokenizer back from tokenizer.json; "
                               f"got {loaded_pre}")
        say(f"verifying on {len(texts)} texts")
        verification = verify_conversion(original, converted, texts)
        if not verification.passed:
            raise ConversionCheckError(verification)
        number_vocab = NumberVocab.from_tokenizer(converted)
        number_vocab.save(staging)
        report = SplitDigitsReport(
            source=str(source), out_dir=str(out_dir), family=plan.family, pipeline_before=plan.pipeline_before,
            pipeline_after=plan.pipeline_after, digit_level_before=digit_level_before,
            tokenizer_size_before=len(original), tokenizer_size_after=len(converted),
            added_digits=plan.added_digits, added_as=plan.added_as,
            corpus=str(corpus) if corpus is not None else f"built-in sample ({len(SAMPLE_CORPUS)} texts)",
            verification=verification, number_vocab=number_vocab.to_dict(), removed_settings=plan.removed_settings)
        (staging / REPORT_FILENAME).write_text(json.dumps(report.to_dict(), indent=1, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return report
