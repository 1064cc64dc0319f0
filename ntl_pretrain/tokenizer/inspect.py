"""Inspect how a tokenizer splits numbers, and whether NTL can use it as it is."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ntl_pretrain.core.numbers import DIGITS, DigitsNotKeptError, NumberTokenError, NumberVocab, digit_hiding_added_tokens
from ntl_pretrain.tokenizer.analysis import digit_split_problems, encode_plain, token_digits
from ntl_pretrain.tokenizer.split_digits import describe_pipeline, tokenizer_family

_LONG_NUMBER = "314159265358"
# (category, text) probes; integers of 1..12 digits come first.
PROBES: tuple[tuple[str, str], ...] = tuple(
    [(f"integer, {n} digit{'s' if n > 1 else ''}", _LONG_NUMBER[:n]) for n in range(1, 13)] + [
        ("decimal", "3.14159"),
        ("decimal", "0.5"),
        ("negative", "-42"),
        ("negative decimal", "-273.15"),
        ("after a space", "in 2024"),
        ("after a space", "costs 1999 dollars"),
        ("after letters", "x86"),
        ("after letters", "abc123"),
        ("thousands separators", "1,234,567"),
        ("thousands separators", "12,000.50"),
        ("date", "2024-03-15"),
        ("date", "15/03/2024"),
        ("time", "09:45:30"),
    ])
MAX_LISTED = 20
_SPACE_MARKERS = ("Ġ", "▁", " ")


@dataclass
class Probe:
    """How one probe text is tokenized."""

    category: str
    text: str
    tokens: list[str]
    ids: list[int]
    digit_level: bool


@dataclass
class InspectionReport:
    """Everything `inspect` finds out about a tokenizer's numbers."""

    source: str
    tokenizer_class: str
    tokenizer_size: int
    family: str
    pipeline: str
    probes: list[Probe]
    digit_token_ids: dict[str, int | None]
    multi_digit_tokens: int
    multi_digit_examples: list[str]
    space_marked_digit_tokens: int
    space_marked_digit_examples: list[str]
    other_digit_tokens: int
    other_digit_examples: list[str]
    special_digit_tokens: int  # special tokens whose name holds a digit ('[control_8]', '<|reserved_special_token_3|>')
    special_digit_examples: list[str]
    number_vocab: dict | None
    number_vocab_error: str | None
    multi_digit_number_vocab_size: int
    digit_level: bool
    advice: str
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, ensure_ascii=False)

    def format(self) -> str:
        lines = [f"tokenizer:  {self.source} ({self.tokenizer_class}, {self.tokenizer_size} tokens)",
                 f"family:     {self.family}",
                 f"pipeline:   {self.pipeline}",
                 "",
                 "how numbers are tokenized ('ok' = one token per digit):"]
        width = max(len(p.category) for p in self.probes)
        for probe in self.probes:
            mark = "ok " if probe.digit_level else "-- "
            lines.append(f"  {mark}{probe.category:<{width}}  {probe.text!r:<22} -> {' | '.join(probe.tokens)}")
        lines.append("")
        present = {d: i for d, i in self.digit_token_ids.items() if i is not None}
        missing = [d for d, i in self.digit_token_ids.items() if i is None]
        lines.append("digit tokens '0'..'9': " + (", ".join(f"{d}={i}" for d, i in present.items()) or "none")
                     + (f"; MISSING {missing}" if missing else ""))
        lines.append(f"multi-digit number tokens: {self.multi_digit_tokens}{_examples(self.multi_digit_examples)}"
                     + ("; they stay in the vocabulary but the probes never produce them"
                        if self.digit_level and self.multi_digit_tokens else ""))
        lines.append(f"digits with a space marker: {self.space_marked_digit_tokens}"
                     f"{_examples(self.space_marked_digit_examples)}")
        lines.append(f"other tokens holding digits: {self.other_digit_tokens}{_examples(self.other_digit_examples)}")
        lines.append(f"special tokens with digits in their name (not text, never numbers): {self.special_digit_tokens}"
                     f"{_examples(self.special_digit_examples)}")
        if self.number_vocab is not None:
            ids = ", ".join(f"{t}={i}" for t, i in zip(self.number_vocab["tokens"], self.number_vocab["token_ids"]))
            lines.append(f"NTL number vocabulary (digit-level, K={len(self.number_vocab['token_ids'])}): {ids}")
        else:
            lines.append(f"NTL number vocabulary: not available ({self.number_vocab_error})")
        lines.append(f"tokens that parse as numbers (multi-digit NTL vocabulary): {self.multi_digit_number_vocab_size}")
        lines.append("")
        lines.append(f"verdict: {'DIGIT-LEVEL' if self.digit_level else 'NOT digit-level'}")
        lines += [f"  - {problem}" for problem in self.problems]
        lines.append(self.advice)
        return "\n".join(lines)


def _examples(tokens: list[str]) -> str:
    return f" (e.g. {', '.join(map(repr, tokens))})" if tokens else ""


def _surface(token: str) -> str:
    """A vocabulary entry without its leading space marker (byte-level "Ġ", SentencePiece "▁")."""
    return token[1:] if token[:1] in _SPACE_MARKERS else token


def inspect_tokenizer(tokenizer: TokenizersBackend, source: str = "") -> InspectionReport:
    """Probe the tokenizer's number handling and say whether NTL can use it (see `InspectionReport`)."""
    source = source or tokenizer.name_or_path
    probes = []
    for category, text in PROBES:
        encoding = encode_plain(tokenizer, text)
        probes.append(Probe(category, text, list(encoding.tokens), list(encoding.ids),
                            not digit_split_problems(tokenizer, text)))
    vocab = tokenizer.get_vocab()
    digit_ids = {d: vocab.get(d) for d in DIGITS}
    backend_json = json.loads(tokenizer.backend_tokenizer.to_str())
    special_tokens = set(tokenizer.all_special_tokens) | {
        added["content"] for added in backend_json.get("added_tokens") or [] if added.get("special")}
    multi, spaced, other, special = [], [], [], []
    for token, _token_id in sorted(vocab.items(), key=lambda item: item[1]):
        digits = token_digits(token)
        if not digits or token in DIGITS:
            continue
        surface = _surface(token)
        if token in special_tokens:
            special.append(token)
        elif surface.isascii() and surface.isdigit():
            (spaced if len(surface) == 1 else multi).append(token)
        else:
            other.append(token)
    number_token_problem = None
    try:
        number_vocab, number_vocab_error = NumberVocab.from_tokenizer(tokenizer).to_dict(), None
    except (NumberTokenError, DigitsNotKeptError) as error:  # the tokenizer itself must be fixed; split-digits cannot
        number_vocab, number_vocab_error, number_token_problem = None, str(error), str(error)
    except ValueError as error:
        number_vocab, number_vocab_error = None, str(error)
    try:
        multi_digit_size = len(NumberVocab.from_tokenizer(tokenizer, digit_level=False))
    except ValueError:
        multi_digit_size = 0
    problems = []
    missing = [d for d, i in digit_ids.items() if i is None]
    if missing:
        problems.append(f"the vocabulary lacks the bare digit tokens {missing}")
    failing = [p for p in probes if not p.digit_level]
    if failing and not number_token_problem:  # digits a normalizer rewrites fail the probes too: said once below
        problems.append(f"{len(failing)} of {len(probes)} probes put several digits (or a digit and other text) "
                        f"into one token, e.g. {failing[0].text!r} -> {failing[0].tokens}")
    if number_token_problem:  # digits that share an id, or special digit tokens: the tokenizer must be fixed first
        problems.append(number_token_problem)
    hiding = digit_hiding_added_tokens(tokenizer)  # the trainer refuses these at start-up with digit-level NTL
    if hiding:
        problems.append(f"{len(hiding)} added token(s) begin or end with a digit ({', '.join(map(repr, hiding[:5]))}"
                        f"{', ...' if len(hiding) > 5 else ''}): added tokens are matched before digits are split, so "
                        f"they hide digits ('2007' -> '20', '07'); remove them from tokenizer.json's added_tokens")
    digit_level = not problems
    if number_token_problem or hiding:
        advice = "NTL cannot use this tokenizer until the tokens named above are fixed"
    elif digit_level:
        advice = ("NTL can use this tokenizer as it is; write its number vocabulary with: "
                  f"python tools/tokenizer.py number-vocab {source}")
    else:
        advice = (f"to make it digit-level run: python tools/tokenizer.py split-digits {source} OUT_DIR"
                  + ("  (digits will be added: then resize the model with tools/tokenizer.py resize-model)"
                     if missing else ""))
    return InspectionReport(
        source=str(source), tokenizer_class=type(tokenizer).__name__, tokenizer_size=len(tokenizer),
        family=tokenizer_family(backend_json), pipeline=describe_pipeline(backend_json), probes=probes,
        digit_token_ids=digit_ids, multi_digit_tokens=len(multi), multi_digit_examples=multi[:MAX_LISTED],
        space_marked_digit_tokens=len(spaced), space_marked_digit_examples=spaced[:MAX_LISTED],
        other_digit_tokens=len(other), other_digit_examples=other[:MAX_LISTED], special_digit_tokens=len(special),
        special_digit_examples=special[:MAX_LISTED], number_vocab=number_vocab,
        number_vocab_error=number_vocab_error, multi_digit_number_vocab_size=multi_digit_size,
        digit_level=digit_level, advice=advice, problems=problems)
