"""How many of the training data's digits NTL can act on: the share that sit in number-vocabulary tokens.

Digit-level NTL acts on positions whose label is one of the ten bare tokens "0".."9". A tokenizer
that also has multi-digit or space-marked digit tokens ("Ġ2024", "12", "▁7") still has those ten
tokens, so `NumberVocab.from_tokenizer` succeeds, but NTL then sees only the digits that happen to be
tokenized alone (21-39 % of GSM8K's digits for GPT-2- and Llama-3-style tokenizers). The trainer
measures the share on the start of its own training stream and refuses such a run unless told
otherwise (`tokenizer.allow_non_digit_level=true`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ntl_pretrain.tokenizer.analysis import token_digits

logger = logging.getLogger(__name__)

DIGIT_LEVEL_SHARE = 0.99
"""Below this share of digits in single-digit tokens a tokenizer is not digit-level on the data."""
MAX_SAMPLE_TOKENS = 1 << 20
"""Tokens measured at most (from the start of the training stream)."""
MAX_SAMPLES = 4096
"""Training samples measured at most."""
MAX_EXAMPLES = 5


@dataclass
class DigitCoverage:
    """Digits of the measured training tokens, and how many of them sit in number-vocabulary tokens."""

    digits: int
    """ASCII digits spelled by the measured tokens (special tokens such as "<extra_id_12>" not counted)."""
    in_number_tokens: int
    """Of those, digits carried by tokens of the number vocabulary (for digit-level NTL: "0".."9")."""
    tokens: int
    samples: int
    examples: list[str] = field(default_factory=list)
    """The most frequent digit-bearing tokens outside the number vocabulary."""

    @property
    def share(self) -> float | None:
        return self.in_number_tokens / self.digits if self.digits else None

    def describe(self) -> str:
        if self.share is None:
            return f"no digits in the first {self.samples} distinct training samples ({self.tokens} tokens)"
        return (f"{100 * self.share:.1f}% of the {self.digits} digits in the first {self.samples} distinct training samples "
                f"({self.tokens} tokens) sit in number tokens")


def _digit_tables(tokenizer: Any, number_ids: tuple[int, ...], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: the number of ASCII digits it spells, and whether it is a number-vocabulary token."""
    digits = np.zeros(size, dtype=np.int64)
    for token, token_id in tokenizer.get_vocab().items():
        if 0 <= token_id < size:
            digits[token_id] = len(token_digits(token))
    special = [i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special]
    digits[[i for i in special if 0 <= i < size]] = 0  # "<extra_id_12>" is no number in the text
    is_number = np.zeros(size, dtype=bool)
    is_number[list(number_ids)] = True
    return digits, is_number


def digit_coverage(tokenizer: Any, number_vocab: Any, samples: list[np.ndarray]) -> DigitCoverage:
    """Count the digits of token-id `samples` and the share of them in `number_vocab`'s tokens."""
    ids = np.concatenate([np.asarray(s, dtype=np.int64).ravel() for s in samples]) if samples else np.zeros(0, np.int64)
    size = max(len(tokenizer), number_vocab.vocab_size, int(ids.max()) + 1 if ids.size else 0)
    digit_counts, is_number = _digit_tables(tokenizer, number_vocab.token_ids, size)
    per_token = digit_counts[ids]
    outside = ids[(per_token > 0) & ~is_number[ids]]
    examples: list[str] = []
    if outside.size:
        values, counts = np.unique(outside, return_counts=True)
        top = values[np.argsort(-counts, kind="stable")[:MAX_EXAMPLES]]
        examples = [str(t) for t in tokenizer.convert_ids_to_tokens([int(i) for i in top])]
    return DigitCoverage(digits=int(per_token.sum()), in_number_tokens=int(per_token[is_number[ids]].sum()),
                         tokens=int(ids.size), samples=len(samples), examples=examples)


def first_samples(sample: Callable[[int], np.ndarray], available: int | None) -> list[np.ndarray]:
    """The distinct samples among the first training samples `sample(0), sample(1), ...` read, up to MAX_SAMPLES /
    MAX_SAMPLE_TOKENS: a streamed corpus shorter than that restarts, and its samples count once, as what was read."""
    limit = MAX_SAMPLES if available is None else min(MAX_SAMPLES, available)
    out: list[np.ndarray] = []
    seen: set[bytes] = set()
    tokens = 0
    for g in range(limit):
        ids = np.ascontiguousarray(sample(g))
        key = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()
        if key not in seen:
            seen.add(key)
            out.append(ids)
        tokens += int(ids.size)
        if tokens >= MAX_SAMPLE_TOKENS:
            break
    return out


def require_digit_level(coverage: DigitCoverage, *, source: str, ntl_on: bool, allow: bool) -> None:
    """Log the share; refuse (ValueError) when digit-level NTL would see too few digits and `allow` is off."""
    share = coverage.share
    if share is None or share >= DIGIT_LEVEL_SHARE:
        logger.info("digit-level check of tokenizer %s: %s", source, coverage.describe())
        return
    examples = ", ".join(map(repr, coverage.examples))
    if not ntl_on or allow:
        logger.warning("tokenizer %s is not digit-level on the training data: %s (others in e.g. %s)%s", source,
                       coverage.describe(), examples,
                       "; training anyway (tokenizer.allow_non_digit_level=true)" if ntl_on else "")
        return
    raise ValueError(
        f"tokenizer {source!r} is not digit-level on the training data: only {coverage.describe()} '0'..'9', the "
        f"tokens digit-level NTL acts on; the others are in tokens such as {examples}. Make it digit-level with: "
        f"python tools/tokenizer.py split-digits {source} OUT_DIR (then tokenizer.name_or_path=OUT_DIR), or use "
        f"tokenizer.digit_level=false (NTL on multi-digit tokens), or set tokenizer.allow_non_digit_level=true to "
        f"train anyway")


def check_training_digits(tokenizer: Any, number_vocab: Any, data: Any, *, source: str, ntl_on: bool,
                          allow: bool) -> DigitCoverage:
    """Measure the labels of the first training samples of `data` (a `PretrainingData`) and apply
    `require_digit_level`.

    `data.sample(g)` is the same on every rank (a streamed source read per rank gives data-parallel rank 0's
    samples, read apart from the stream each rank trains), so every rank reaches the same verdict without a
    collective.
    """
    sizes = [getattr(s, "size", None) for s in data.sources]
    available = None if any(size is None for size in sizes) else sum(sizes)
    labels = [sample[1:] for sample in first_samples(data.sample, available)]  # what the loss sees; no overlap
    coverage = digit_coverage(tokenizer, number_vocab, labels)
    require_digit_level(coverage, source=source, ntl_on=ntl_on, allow=allow)
    return coverage
