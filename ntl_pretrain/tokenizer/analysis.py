"""How a tokenizer treats digits, and the three checks a digit-splitting conversion must pass.

The checks, each on every sample text:

(a) digits: every ASCII digit of the (normalised) text is encoded as exactly one bare digit token
    "0".."9", in order, and no other token carries a digit (no "Ġ7", "▁12", "x86", "<0x37>").
(b) round trip: `decode(encode(text))` of the converted tokenizer equals the original's, where an
    "<unk>" of the original (e.g. for a digit missing from its vocabulary) may stand for any text.
(c) digit-free text: every token the original emits for text without digits (outside any
    whitespace-delimited word that holds a digit) is emitted by the converted tokenizer with the same
    id at the same character offsets. Words that hold a digit may change around it: in
    "▁abc123" the letters may merge differently once the digits are split off.

Only ASCII digits count: NTL's number vocabulary is the ten tokens "0".."9". Other numeric
characters ("²", "½", "٣") are ordinary text and must stay tokenized as before.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Iterable

from transformers.tokenization_utils_tokenizers import TokenizersBackend

from ntl_pretrain.core.numbers import DIGITS, encode_plain

ASCII_DIGITS = frozenset(DIGITS)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_WORD = re.compile(r"\S+")
MAX_EXAMPLES = 5


def token_digits(token: str) -> str:
    """The ASCII digits a vocabulary entry spells; a byte-fallback token "<0x37>" spells "7"."""
    match = _BYTE_FALLBACK.fullmatch(token)
    if match:
        char = chr(int(match.group(1), 16))
        return char if char in ASCII_DIGITS else ""
    return "".join(char for char in token if char in ASCII_DIGITS)


def has_digit(text: str) -> bool:
    return any(char in ASCII_DIGITS for char in text)


def normalize(tokenizer: TokenizersBackend, text: str) -> str:
    """The text as the tokenizer's normalizer sees it (e.g. NFKC maps "３" to "3")."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    return normalizer.normalize_str(text) if normalizer is not None else text


def digit_split_problems(tokenizer: TokenizersBackend, text: str) -> list[str]:
    """Check (a) on one text: an empty list when every digit is its own bare digit token."""
    encoding = encode_plain(tokenizer, text)
    problems: list[str] = []
    found: list[str] = []
    for token in encoding.tokens:
        digits = token_digits(token)
        if not digits:
            continue
        found.append(digits)
        if token not in ASCII_DIGITS:
            problems.append(f"token {token!r} is not a single bare digit")
    expected = "".join(char for char in normalize(tokenizer, text) if char in ASCII_DIGITS)
    if "".join(found) != expected:
        problems.append(f"the text's digits {expected!r} come out of the digit tokens as {''.join(found)!r}")
    written = "".join(char for char in text if char in ASCII_DIGITS)
    remaining = iter(expected)  # the normalizer may add digits (fullwidth '７' -> '7'), never rewrite or drop them
    if not all(digit in remaining for digit in written):
        problems.append(f"the normalizer turns the text's digits {written!r} into {expected!r} "
                        f"({normalize(tokenizer, text)!r}): NTL would never see them")
    return problems


def digit_free_tokens(tokenizer: TokenizersBackend, text: str) -> list[tuple[int, int, int]]:
    """(start, end, id) of the tokens that cover text without digits, outside words holding a digit."""
    encoding = encode_plain(tokenizer, text)
    digit_words = [(m.start(), m.end()) for m in _WORD.finditer(text) if has_digit(normalize(tokenizer, m.group()))]
    result = []
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
        if has_digit(normalize(tokenizer, text[start:end])):
            continue
        if any((start < word_end and word_start < end) or (start == end and word_start <= start <= word_end)
               for word_start, word_end in digit_words):
            continue
        result.append((start, end, token_id))
    return result


def round_trip(tokenizer: TokenizersBackend, text: str) -> str:
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


def digit_bearing_added_tokens(tokenizer: TokenizersBackend) -> list[str]:
    """Added tokens (special or not) whose content holds a digit, e.g. "<extra_id_12>"."""
    return [token for token in tokenizer.get_added_vocab() if has_digit(token)]


@dataclass
class CheckResult:
    """Outcome of one check over the sample texts."""

    name: str
    checked: int = 0
    failed: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.checked > 0 and self.failed == 0

    def fail(self, example: str) -> None:
        self.failed += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(example)


@dataclass
class VerificationReport:
    """The three checks of a conversion over a sample corpus."""

    samples: int
    skipped: int
    digits: CheckResult
    round_trip: CheckResult
    digit_free: CheckResult
    recovered: int = 0
    """Texts the converted tokenizer round-trips better than the original, which lost text to <unk>."""

    @property
    def passed(self) -> bool:
        return self.digits.passed and self.round_trip.passed and self.digit_free.passed

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        for name in ("digits", "round_trip", "digit_free"):
            data[name]["passed"] = getattr(self, name).passed
        return data

    def format(self) -> str:
        lines = [f"verification on {self.samples} sample texts"
                 + (f" ({self.skipped} skipped: they contain added tokens with digits)" if self.skipped else "")]
        described = {
            "digits": "(a) every digit is exactly one single-digit token",
            "round_trip": "(b) decode(encode(text)) matches the original tokenizer",
            "digit_free": "(c) tokens of digit-free text keep their ids and offsets",
        }
        for name, text in described.items():
            check: CheckResult = getattr(self, name)
            status = "PASS" if check.passed else "FAIL"
            lines.append(f"  {status} {text}: {check.checked - check.failed}/{check.checked} "
                         f"{'tokens' if name == 'digit_free' else 'texts'} ok")
            if name == "round_trip" and self.recovered:
                lines.append(f"       ({self.recovered} of them: the converted tokenizer restores text that the "
                             f"original lost, to <unk> or dropped)")
            lines += [f"       e.g. {example}" for example in check.examples]
        return "\n".join(lines)


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def verify_conversion(original: TokenizersBackend, converted: TokenizersBackend,
                      texts: Iterable[str]) -> VerificationReport:
    """Run checks (a), (b) and (c) on every text (see the module docstring)."""
    digits, trip, free = CheckResult("digits"), CheckResult("round_trip"), CheckResult("digit_free")
    skip_tokens = set(digit_bearing_added_tokens(original)) | set(digit_bearing_added_tokens(converted))
    samples = skipped = recovered = 0
    for text in texts:
        if any(token in text for token in skip_tokens):
            skipped += 1  # an added token such as "<extra_id_12>" legitimately keeps its digits
            continue
        samples += 1
        digits.checked += 1
        problems = digit_split_problems(converted, text)
        if problems:
            digits.fail(f"{_clip(text)}: {problems[0]}")
        trip.checked += 1
        expected, got = round_trip(original, text), round_trip(converted, text)
        if expected != got:
            if _matches_with_unknowns(original, expected, got) or _restores_lost_digits(expected, got):
                recovered += 1  # the original lost e.g. a missing digit (to <unk>, or dropped it); the added digit
                #                 token restores it
            else:
                trip.fail(f"{_clip(text)} decodes to {_clip(got)} instead of {_clip(expected)}")
        before = digit_free_tokens(original, text)
        after = set(_all_tokens(converted, text))
        free.checked += len(before)
        for start, end, token_id in before:
            if (start, end, token_id) not in after:
                free.fail(f"{_clip(text[start:end])} at {start}:{end} in {_clip(text, 50)} was token "
                          f"{original.convert_ids_to_tokens(token_id)!r} (id {token_id}) and changed")
    if samples == 0:
        raise ValueError("no sample text left to verify the conversion on; give a corpus with plain text")
    return VerificationReport(samples=samples, skipped=skipped, digits=digits, round_trip=trip, digit_free=free,
                              recovered=recovered)


def _restores_lost_digits(expected: str, got: str) -> bool:
    """`got` is `expected` with digits put back that the original dropped (a byte-level vocabulary without the
    bare digits has no <unk>: "2024" decodes to "")."""
    def without_digits(text: str) -> str:
        return "".join(char for char in text if char not in ASCII_DIGITS)

    return without_digits(expected) == without_digits(got) and len(got) > len(expected)


def _matches_with_unknowns(original: TokenizersBackend, expected: str, got: str) -> bool:
    """`got` equals `expected` where each "<unk>" of `expected` stands for any text the original lost."""
    unk = original.unk_token
    if not unk or unk not in expected:
        return False
    pattern = "(?:.+?)".join(re.escape(part) for part in expected.split(unk))
    return re.fullmatch(pattern, got, flags=re.DOTALL) is not None


def _all_tokens(tokenizer: TokenizersBackend, text: str) -> list[tuple[int, int, int]]:
    encoding = encode_plain(tokenizer, text)
    return [(start, end, token_id) for token_id, (start, end) in zip(encoding.ids, encoding.offsets)]
