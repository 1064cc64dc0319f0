"""The number vocabulary: which token ids stand for numbers, and their values.

NTL needs, for a tokenizer, the ordered list of number-token ids and the numeric value of each.
Two modes, as in the reference implementation (`ntloss`):

- digit-level (the paper's default): exactly the ten tokens spelled "0".."9". A digit with a
  tokenizer's space marker ("Ġ7" in byte-level BPE, "▁7" in SentencePiece) is *not* a bare digit:
  its value is ambiguous at a number boundary, so it never counts.
- multi-digit: every token spelled as an ASCII decimal number: an optional "-", then ASCII digits
  with at most one "." among or around them ("12", "007", "3.5", "-7", ".5", "5."), which is what
  Python's `float()` (and so `ntloss`) reads less the spellings that are no number in text: no "+"
  ("+5"), no exponent ("1e5"), no "_" ("1_000"), no whitespace (" 12") or space marker ("Ġ12"), no
  other script's digits ("٣", "１"), no nan/inf.

Added tokens are matched before a tokenizer's pre-tokenizer splits digits, so an added token such
as "07" turns "2007" into "20" "07" and hides those digits from digit-level NTL;
`digit_hiding_added_tokens` finds them (the trainer refuses them at start-up, see
`preflight.number_vocab_for`).

Ids are kept in increasing order (the reference's order), so index k of the number vocabulary is
the same everywhere: on every tensor-parallel rank, in saved JSON, in the loss.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

DIGITS = tuple(str(d) for d in range(10))
NUMBER_VOCAB_FILENAME = "number_vocab.json"


_NUMBER_SPELLING = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")  # ASCII only: [0-9], not \d


def _parse_number(token: str) -> float | None:
    """The token's value if it is spelled as an ASCII decimal number (see the module doc), else None."""
    return float(token) if _NUMBER_SPELLING.fullmatch(token) else None


def digit_hiding_added_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's non-special added tokens that begin or end with an ASCII digit (other than the bare
    digits themselves): matched before the digits are split, they can take digits out of a number in the
    text ("07" in "2007"). Special tokens ("<extra_id_12>") and markup around digits cannot."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return sorted(token.content for token in added.values()
                  if not token.special and token.content not in DIGITS and token.content
                  and (token.content[0] in DIGITS or token.content[-1] in DIGITS))


class DigitsNotKeptError(ValueError):
    """The tokenizer has digit tokens but its normalizer or pre-tokenizer rewrites or drops the text's digits, so
    they never reach them; the message names the digit, what it became and the fix."""


class NumberTokenError(ValueError):
    """The tokenizer's number tokens cannot stand for numbers as they are (two share an id, or they are special
    tokens that decoding drops); the message names them and the fix to the tokenizer."""


def _check_number_tokens(tokenizer: Any, by_id: Mapping[int, list[str]], name: str) -> None:
    """Refuse number tokens that share an id (the id cannot say which number it is) or that are special added
    tokens: `decode(..., skip_special_tokens=True)`, as evaluation decodes, drops them ("12+3=15" -> "+=")."""
    shared = {token_id: tokens for token_id, tokens in by_id.items() if len(tokens) > 1}
    if shared:
        token_id, tokens = min(shared.items())
        raise NumberTokenError(
            f"the number tokens {sorted(tokens)} of tokenizer {name!r} share the id {token_id}: each needs its own "
            f"id, or NTL cannot tell which number it is; restore the tokenizer's vocabulary (tokenizer.json) from "
            f"its source")
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = sorted(by_id[token_id][0] for token_id in by_id
                     if token_id in added and getattr(added[token_id], "special", False))
    if special:
        raise NumberTokenError(
            f"the number tokens {special[:10]}{' ...' if len(special) > 10 else ''} of tokenizer {name!r} are special "
            f"added tokens, which decoding with skip_special_tokens=True (as evaluation decodes) drops: '12+3=15' "
            f"would read '+='; set \"special\": false for them in the added_tokens of its tokenizer.json")


def encode_plain(tokenizer: Any, text: str) -> Any:
    """The backend's encoding (a `tokenizers.Encoding`) of the whole text of a fast tokenizer, without special tokens,
    truncation or padding.

    A `tokenizer.json` may carry its own `truncation`/`padding` (e.g. `max_length: 128`), which the
    backend applies to every direct `encode`; the transformers wrapper clears them on its first call,
    so honouring them here would make every check depend on what ran before. They are switched off for
    this call and restored after it, so the caller's tokenizer is left as it was.
    """
    backend = tokenizer.backend_tokenizer
    truncation, padding = backend.truncation, backend.padding
    if truncation is None and padding is None:
        return backend.encode(text, add_special_tokens=False)
    backend.no_truncation()
    backend.no_padding()
    try:
        return backend.encode(text, add_special_tokens=False)
    finally:
        if truncation is not None:
            backend.enable_truncation(**truncation)
        if padding is not None:
            backend.enable_padding(**padding)


def check_digits_kept(tokenizer: Any, name: str) -> None:
    """Refuse a tokenizer whose normalizer or pre-tokenizer rewrites or drops digits ("7" -> "seven", every digit ->
    "0"): its digit tokens exist but the text's digits never reach them, so NTL would silently act on nothing.
    Only digits that have a bare token are checked. A digit encoded into another token that still spells it ("Ġ7",
    "▁7") is left to the training data's digit-level check (tokenizer/coverage.py). Slow tokenizers and bare
    vocabularies (no `backend_tokenizer`) are not checked."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:  # a slow tokenizer or a bare vocabulary
        return
    vocab = tokenizer.get_vocab()
    for digit in (d for d in DIGITS if d in vocab):  # a digit without a token is what split-digits adds
        text = digit  # alone: a word-level vocabulary without an unknown token cannot encode anything else
        try:  # the backend itself: the transformers call would clear the file's truncation/padding
            ids = encode_plain(tokenizer, text).ids
            round_trip = tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001 -- the backend cannot encode the digit at all: the training data check says so
            return
        if digit not in round_trip:
            raise DigitsNotKeptError(
                f"tokenizer {name!r} does not keep digits: {text!r} encodes to {ids} and decodes to {round_trip!r} "
                f"(its normalizer or pre-tokenizer rewrites or drops '{digit}'), so NTL would never see a digit token; "
                f"remove that rule from the normalizer / pre_tokenizer of its tokenizer.json, or use another tokenizer")


def _is_bare_digit(token: str) -> bool:
    return len(token) == 1 and token in DIGITS


@dataclass(frozen=True)
class NumberVocab:
    """Token ids that stand for numbers, their values, and the vocabulary size they live in.

    `token_ids` is strictly increasing; `values[k]` is the value of `token_ids[k]`.
    `vocab_size` is the width of the logits the ids index (the model's, possibly padded, vocabulary
    or the tokenizer's length); every id is below it.
    """

    token_ids: tuple[int, ...]
    values: tuple[float, ...]
    vocab_size: int
    digit_level: bool = True
    tokens: tuple[str, ...] = ()
    decimal_point_id: int | None = None  # id of the "." token (number-level NTL with float_level)
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        ids, values = tuple(int(i) for i in self.token_ids), tuple(float(v) for v in self.values)
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if not ids:
            raise ValueError("NumberVocab needs at least one number token; got none")
        if len(ids) != len(values):
            raise ValueError(f"NumberVocab has {len(ids)} token ids but {len(values)} values")
        if self.tokens and len(self.tokens) != len(ids):
            raise ValueError(f"NumberVocab has {len(ids)} token ids but {len(self.tokens)} token strings")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"NumberVocab token ids must be strictly increasing, got {list(ids)}")
        if ids[0] < 0:
            raise ValueError(f"NumberVocab token ids must be >= 0, got {ids[0]}")
        if ids[-1] >= self.vocab_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary: number token id "
                f"{ids[-1]} does not fit. Pass the model's vocabulary size (config.vocab_size), which must be "
                f"at least len(tokenizer); resize the model's embeddings if the tokenizer gained tokens.")
        if len(ids) >= self.vocab_size:
            raise ValueError(
                f"every one of the {self.vocab_size} tokens is a number token; at least one non-number token is "
                f"needed (labels outside the number vocabulary are what NTL ignores)")
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"NumberVocab values must be finite, got {list(values)}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tokenizer(cls, tokenizer: Any, digit_level: bool = True, vocab_size: int | None = None,
                       require_digits_kept: bool = True) -> "NumberVocab":
        """Build the number vocabulary of a Hugging Face tokenizer.

        Args:
            tokenizer: any `transformers` tokenizer (or object with `get_vocab()` and `__len__`).
            digit_level: only the ten bare digits "0".."9" (True), or every token that parses as a
                finite number (False).
            vocab_size: width of the logits (the model's vocabulary, possibly padded); defaults to
                `len(tokenizer)`. Must not be smaller than the tokenizer's vocabulary.
            require_digits_kept: refuse (`DigitsNotKeptError`) a tokenizer whose normalizer or pre-tokenizer rewrites
                or drops digits ("7" -> "seven"), so that its digit tokens never occur; off for a CE-only run, whose
                number tokens are only monitored.
        """
        vocab: Mapping[str, int] = tokenizer.get_vocab()
        tokenizer_size = max(len(tokenizer), max(vocab.values()) + 1)
        if vocab_size is None:
            vocab_size = tokenizer_size
        if vocab_size < tokenizer_size:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_size} tokens). "
                f"Resize the model's embeddings to at least {tokenizer_size} (tools/tokenizer.py resize-model).")
        found: dict[int, tuple[str, float]] = {}
        by_id: dict[int, list[str]] = {}
        for token, token_id in vocab.items():
            value = (float(token) if _is_bare_digit(token) else None) if digit_level else _parse_number(token)
            if value is not None:
                found[token_id] = (token, value)
                by_id.setdefault(token_id, []).append(token)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        _check_number_tokens(tokenizer, by_id, name)
        if not found:
            raise ValueError(
                f"tokenizer {name!r} has no {'bare digit' if digit_level else 'number'} tokens, so NTL has nothing "
                f"to act on. Make it digit-level first: python tools/tokenizer.py split-digits {name} OUT_DIR")
        if digit_level:
            present = {tok for tok, _ in found.values()}
            if len(found) != 10 or present != set(DIGITS):
                missing = [d for d in DIGITS if d not in present]
                raise ValueError(
                    f"digit-level NTL needs the ten tokens '0'..'9' in tokenizer {name!r}; missing {missing}. "
                    f"Add them with: python tools/tokenizer.py split-digits {name} OUT_DIR")
        if require_digits_kept and any(_is_bare_digit(token) for token, _ in found.values()):
            check_digits_kept(tokenizer, name)
        if len(found) >= vocab_size or len(found) == len(vocab):
            raise ValueError(f"every token of tokenizer {name!r} is a number; NTL needs non-number tokens too")
        ids = sorted(found)
        return cls(token_ids=tuple(ids), values=tuple(found[i][1] for i in ids), vocab_size=int(vocab_size),
                   digit_level=digit_level, tokens=tuple(found[i][0] for i in ids), decimal_point_id=vocab.get("."))

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {"token_ids": list(self.token_ids), "values": list(self.values), "tokens": list(self.tokens),
                "vocab_size": self.vocab_size, "digit_level": self.digit_level,
                "decimal_point_id": self.decimal_point_id}

    def save(self, path: str | os.PathLike) -> str:
        """Write the vocabulary as JSON; a directory gets `number_vocab.json` inside it."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, NUMBER_VOCAB_FILENAME)
        from .fs import write_json_atomic

        return write_json_atomic(path, self.to_dict(), indent=1)  # never leaves a half-written file behind

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NumberVocab":
        """Read a vocabulary written by `save` (a JSON file or a directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, NUMBER_VOCAB_FILENAME)
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise FileNotFoundError(f"no number vocabulary at {path!r}; write one with NumberVocab.save") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path!r} is not valid number-vocabulary JSON: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path!r} holds a JSON {type(data).__name__}, not a number vocabulary object")
        try:
            return cls(token_ids=tuple(data["token_ids"]), values=tuple(data["values"]),
                       vocab_size=int(data["vocab_size"]), digit_level=bool(data.get("digit_level", True)),
                       tokens=tuple(data.get("tokens", ())), decimal_point_id=data.get("decimal_point_id"))
        except KeyError as error:
            raise ValueError(f"{path!r} lacks the key {error.args[0]!r} of a number vocabulary") from None
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path!r} is not a valid number vocabulary: {error}") from None

    # ------------------------------------------------------------------ tensors
    def __len__(self) -> int:
        return len(self.token_ids)

    def with_vocab_size(self, vocab_size: int) -> "NumberVocab":
        """The same numbers inside a wider (e.g. padded) logit vocabulary."""
        return NumberVocab(self.token_ids, self.values, vocab_size, self.digit_level, self.tokens,
                           self.decimal_point_id)

    def _cached(self, key: tuple, build) -> torch.Tensor:
        tensor = self._cache.get(key)
        if tensor is None:
            tensor = self._cache[key] = build()
        return tensor

    def ids_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Number-token ids, `[K]` long."""
        device = torch.device(device)
        return self._cached(("ids", device), lambda: torch.tensor(self.token_ids, dtype=torch.long, device=device))

    def values_tensor(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values of the number tokens, `[K]`."""
        device = torch.device(device)
        return self._cached(("values", device, dtype),
                            lambda: torch.tensor(self.values, dtype=dtype, device=device))

    def index_of(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Position k in the number vocabulary of each label, or -1 where the label is no number.

        Labels equal to `ignore_index` or outside `[0, vocab_size)` map to -1.
        """
        device = labels.device

        def build() -> torch.Tensor:
            table = torch.full((self.vocab_size,), -1, dtype=torch.long, device=device)
            table[self.ids_tensor(device)] = torch.arange(len(self), device=device)
            return table

        table = self._cached(("index", device), build)
        in_range = (labels >= 0) & (labels < self.vocab_size) & (labels != ignore_index)
        return torch.where(in_range, table[labels.clamp(0, self.vocab_size - 1)], -1)
