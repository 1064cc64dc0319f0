"""Arithmetic problems for training and evaluation, generated in the project (seeded, deterministic).

One plain format everywhere: the prompt is the expression followed by "=" ("12+345="), the
completion is the integer result ("357"); a training document is the two concatenated
("12+345=357"). The benchmark prompts the model with the prompt and reads the number it generates.

Splits:
- "train" and "interpolation" draw operands with lengths in `train_digits`; a problem belongs to
  one or the other by a hash of its canonical form (operands of a commutative product or sum in
  sorted order: 3+12 and 12+3 are one problem, so are 5+2*7 and 5+7*2), so the two never share a
  problem or its commuted twin, whatever the seed or n.
- "extrapolation" draws operands with lengths in `extrapolation_digits`, longer than any in
  training, so it is disjoint from both by construction.

Operations: "+", "-", "*" on two operands, and the mixed expressions "+*" (a+b*c) and "-*"
(a-b*c) on three, with the usual precedence.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from ntl_pretrain.core.fs import atomic_write

SPLITS = ("train", "interpolation", "extrapolation")
BINARY_OPS = ("+", "-", "*")
MIXED_OPS = ("+*", "-*")
ALL_OPS = BINARY_OPS + MIXED_OPS
# One problem in this many (by hash) is held out of training for the interpolation split.
INTERPOLATION_SHARE = 8


@dataclass(frozen=True)
class ArithmeticProblem:
    """One arithmetic problem: `a op b` (or `a op[0] b op[1] c` for mixed ops) and its exact answer."""

    a: int
    b: int
    op: str
    answer: int
    c: int | None = None

    @property
    def expression(self) -> str:
        """The expression as written in the prompt, without "="."""
        if self.op in MIXED_OPS:
            return f"{self.a}{self.op[0]}{self.b}{self.op[1]}{self.c}"
        return f"{self.a}{self.op}{self.b}"

    @property
    def prompt(self) -> str:
        """What the model is given, e.g. "12+345="."""
        return f"{self.expression}="

    @property
    def completion(self) -> str:
        """What the model should generate, e.g. "357"."""
        return str(self.answer)

    @property
    def text(self) -> str:
        """One training document: prompt followed by completion."""
        return self.prompt + self.completion


def evaluate_expression(a: int, b: int, op: str, c: int | None = None) -> int:
    """The exact integer value of `a op b` (or of the mixed expression with `c`), with precedence."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "+*":
        return a + b * _require_c(c, op)
    if op == "-*":
        return a - b * _require_c(c, op)
    raise ValueError(f"unknown arithmetic op {op!r}; use one of {ALL_OPS}")


def _require_c(c: int | None, op: str) -> int:
    if c is None:
        raise ValueError(f"op {op!r} is a mixed expression and needs a third operand c")
    return c


def make_problem(a: int, b: int, op: str, c: int | None = None) -> ArithmeticProblem:
    """A problem with its answer computed exactly."""
    if op in BINARY_OPS and c is not None:
        raise ValueError(f"op {op!r} takes two operands; got a third (c={c})")
    return ArithmeticProblem(a=a, b=b, op=op, answer=evaluate_expression(a, b, op, c), c=c)


def canonical_form(problem: ArithmeticProblem) -> str:
    """One string for a problem and the problems that differ from it only by commuting operands.

    "+" and "*" sort their two operands; in a+b*c and a-b*c the product b*c sorts b and c (a stays:
    the format always writes the lone operand first, and "-" does not commute).
    """
    if problem.op in ("+", "*"):
        low, high = sorted((problem.a, problem.b))
        return f"{low}{problem.op}{high}"
    if problem.op in MIXED_OPS:
        low, high = sorted((problem.b, _require_c(problem.c, problem.op)))
        return f"{problem.a}{problem.op[0]}{low}{problem.op[1]}{high}"
    return problem.expression


def is_interpolation_problem(problem: ArithmeticProblem) -> bool:
    """Whether a problem with in-range operands is held out for the interpolation split (by a hash of its
    canonical form, so a commuted twin is held out with it)."""
    digest = hashlib.sha256(canonical_form(problem).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % INTERPOLATION_SHARE == 0


def _validate(split: str, n: int, ops: tuple[str, ...], train_digits: tuple[int, int],
              extrapolation_digits: tuple[int, int]) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not ops:
        raise ValueError("ops is empty; give at least one of " + ", ".join(ALL_OPS))
    unknown = [op for op in ops if op not in ALL_OPS]
    if unknown:
        raise ValueError(f"unknown arithmetic ops {unknown}; use ops from {ALL_OPS}")
    for name, (low, high) in (("train_digits", train_digits), ("extrapolation_digits", extrapolation_digits)):
        if not 1 <= low <= high:
            raise ValueError(f"{name}=({low}, {high}) must satisfy 1 <= min <= max (operand lengths in digits)")
    if extrapolation_digits[0] <= train_digits[1]:
        raise ValueError(
            f"extrapolation_digits={tuple(extrapolation_digits)} must be longer than train_digits={tuple(train_digits)}: "
            f"set extrapolation_digits[0] > {train_digits[1]}")


def _random_operand(rng: random.Random, digits: tuple[int, int]) -> int:
    """A non-negative integer whose decimal length is uniform in [digits[0], digits[1]]."""
    length = rng.randint(digits[0], digits[1])
    if length == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (length - 1), 10 ** length - 1)


def generate_problems(split: str, n: int, seed: int, ops: tuple[str, ...] = BINARY_OPS,
                      train_digits: tuple[int, int] = (1, 4),
                      extrapolation_digits: tuple[int, int] = (5, 6)) -> list[ArithmeticProblem]:
    """`n` problems of `split`, deterministic in (split, n, seed, ops, digits).

    Ops cycle in the order given, so every op gets n/len(ops) problems. Evaluation splits hold no
    duplicates (an error if the operand space is too small for n); "train" may repeat problems
    when the space is small (e.g. single digits), as a training corpus does.
    """
    ops, train_digits, extrapolation_digits = tuple(ops), tuple(train_digits), tuple(extrapolation_digits)
    _validate(split, n, ops, train_digits, extrapolation_digits)
    # A string seed goes through SHA-512 inside `random`, so it is stable across runs and platforms.
    rng = random.Random(f"ntl-arithmetic:{split}:{seed}")
    digits = extrapolation_digits if split == "extrapolation" else train_digits
    unique = split != "train"
    problems: list[ArithmeticProblem] = []
    seen: set[str] = set()
    max_tries = 1000 * max(n, 1)
    tries = 0
    while len(problems) < n:
        tries += 1
        if tries > max_tries:
            raise ValueError(
                f"could not draw {n} distinct {split!r} problems with ops={ops} and operand lengths {digits}: "
                f"the space is too small; lower n or widen the digit range")
        op = ops[len(problems) % len(ops)]
        a, b = _random_operand(rng, digits), _random_operand(rng, digits)
        c = _random_operand(rng, digits) if op in MIXED_OPS else None
        problem = make_problem(a, b, op, c)
        if split != "extrapolation" and is_interpolation_problem(problem) != (split == "interpolation"):
            continue
        if unique:
            if problem.expression in seen:
                continue
            seen.add(problem.expression)
        problems.append(problem)
    return problems


# Number-rich sentences whose numbers are consistent (the arithmetic in them is right), so a small
# model sees numbers in running text too. Fields: a, b (small counts), and the derived values.
_TEMPLATES = (
    "{name} had {a} {item} and bought {b} more, so {name} now has {sum} {item}.",
    "There were {a} {item} in the box. After {b} were taken out, {diff} {item} were left.",
    "Each of the {a} shelves holds {b} {item}, which makes {prod} {item} in total.",
    "The year {year} came {a} years after the year {year_minus_a}.",
    "A train travels {a} kilometres per hour for {b} hours and covers {prod} kilometres.",
    "{name} scored {a} points in the first game and {b} in the second, {sum} points in all.",
    "The price went from {a} dollars to {sum} dollars, an increase of {b} dollars.",
    "If {prod} {item} are shared equally among {b} people, each person gets {a} {item}.",
)
_NAMES = ("Ada", "Ben", "Chloe", "Dan", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jun")
_ITEMS = ("apples", "books", "coins", "pencils", "marbles", "stamps", "cards", "shells")


def template_sentence(rng: random.Random) -> str:
    """One plain-text sentence with consistent numbers, drawn from fixed templates."""
    a, b = rng.randint(2, 999), rng.randint(1, 99)
    if a < b:
        a, b = b, a
    year = rng.randint(1800, 2030)
    return rng.choice(_TEMPLATES).format(
        name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b, sum=a + b, diff=a - b, prod=a * b,
        year=year, year_minus_a=year - a)


_PROBLEM_TEXT = re.compile(r"(\d+)([+\-*])(\d+)(?:\*(\d+))?=-?\d+")


def held_out_problems_in(path: str) -> tuple[int, str | None]:
    """(how many documents of a .jsonl corpus are interpolation problems, the first one): 0 for any corpus
    `write_training_corpus` writes now; more for one written before the split used canonical forms."""
    count, first = 0, None
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                text = json.loads(line).get("text", "")
            except (json.JSONDecodeError, AttributeError):
                continue
            match = _PROBLEM_TEXT.fullmatch(text) if isinstance(text, str) else None
            if match is None:
                continue
            a, op, b, c = match.groups()
            if c is not None and op == "*":
                continue  # a*b*c is not a problem this module writes
            problem = make_problem(int(a), int(b), op + "*" if c is not None else op, int(c) if c is not None else None)
            if is_interpolation_problem(problem):
                count += 1
                first = first or text
    return count, first


CORPUS_OPTIONS = ("seed", "text_share", "ops", "train_digits", "extrapolation_digits")
CORPUS_SEED = 1234  # the generated corpus's seed when its options give none (never a run's data.seed)
# Bumped whenever the same settings would write other bytes (a file written by an older version is refused).
CORPUS_FORMAT = 2  # 2: rows {"text", "prompt", "completion"}
SETTINGS_SUFFIX = ".settings"  # the sidecar beside a generated corpus: its settings and content hash


def check_corpus_options(options: dict[str, Any], where: str = "generate_options") -> None:
    """Raise ValueError for an unknown key (naming the nearest valid one) or a bad value of the options
    `write_training_corpus` takes; `where` is the config key they come from."""
    import difflib

    for key in options:
        if key not in CORPUS_OPTIONS:
            nearest = difflib.get_close_matches(str(key), CORPUS_OPTIONS, n=1, cutoff=0.0)
            raise ValueError(f"{where}.{key} is not a corpus option; did you mean {where}.{nearest[0]}? "
                             f"Valid keys: {', '.join(CORPUS_OPTIONS)}")
    seed = options.get("seed", CORPUS_SEED)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{where}.seed={seed!r} must be an integer (the corpus's own seed, independent of data.seed)")
    share = options.get("text_share", 0.2)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise ValueError(f"{where}.text_share={share!r} must be a number in [0, 1] (share of plain-text documents)")
    for key in ("ops", "train_digits", "extrapolation_digits"):
        value = options.get(key)
        if value is not None and not (isinstance(value, (list, tuple))
                                      and all(isinstance(v, str if key == "ops" else int) for v in value)):
            kind = "operation strings, e.g. ['+', '-']" if key == "ops" else "integers [min, max]"
            raise ValueError(f"{where}.{key}={value!r} must be a list of {kind}")
    for key in ("train_digits", "extrapolation_digits"):
        if key in options and len(options[key]) != 2:
            raise ValueError(f"{where}.{key}={list(options[key])} must be [min, max]")
    try:
        _validate("train", 0, tuple(options.get("ops", BINARY_OPS)), tuple(options.get("train_digits", (1, 4))),
                  tuple(options.get("extrapolation_digits", (5, 6))))
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def corpus_settings(n: int, options: dict[str, Any]) -> dict[str, Any]:
    """Everything the content of a generated corpus depends on, defaults filled in (its identity)."""
    check_corpus_options(options)
    return {"format": CORPUS_FORMAT, "n": int(n), "seed": int(options.get("seed", CORPUS_SEED)),
            "text_share": float(options.get("text_share", 0.2)), "ops": list(options.get("ops", BINARY_OPS)),
            "train_digits": [int(d) for d in options.get("train_digits", (1, 4))],
            "extrapolation_digits": [int(d) for d in options.get("extrapolation_digits", (5, 6))]}


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_training_corpus(path: str, n: int, seed: int, text_share: float = 0.2,
                          **problem_kwargs: Any) -> str:
    """Write `n` training documents as jsonl to `path`, and its settings beside it; return the path.

    About `1 - text_share` of the documents are "train"-split arithmetic problems (never an
    interpolation or extrapolation problem), the rest template sentences rich in numbers. Each line is
    `{"text": prompt + completion, "prompt": ..., "completion": ...}`: a problem's prompt is "12+3=" and
    its completion "15"; a sentence has an empty prompt. So the file serves plain training (text) and
    completion-only training (prompt, completion). `problem_kwargs` go to `generate_problems` (ops,
    train_digits, extrapolation_digits). The content is a function of the arguments alone.

    `PATH.settings` records the settings and the content's SHA-256 (`check_training_corpus` compares
    them). Both appear complete or not at all: written to temporary names, then renamed, the settings
    first (a corpus never exists without them; settings without a corpus mean "generate it").
    """
    if not 0.0 <= text_share <= 1.0:
        raise ValueError(f"text_share={text_share} must be in [0, 1] (share of plain-text documents)")
    settings = corpus_settings(n, {"seed": seed, "text_share": text_share, **problem_kwargs})
    rng = random.Random(f"ntl-corpus:{seed}")
    n_text = round(n * text_share)
    problems = generate_problems("train", n - n_text, seed, **problem_kwargs)
    rows = [(p.prompt, p.completion) for p in problems] + [("", template_sentence(rng)) for _ in range(n_text)]
    rng.shuffle(rows)
    content = "".join(json.dumps({"text": prompt + completion, "prompt": prompt, "completion": completion}) + "\n"
                      for prompt, completion in rows).encode("utf-8")
    sidecar = path + SETTINGS_SUFFIX
    with atomic_write(sidecar) as handle:
        json.dump({"settings": settings, "sha256": hashlib.sha256(content).hexdigest()}, handle, indent=1)
    try:
        with atomic_write(path, "wb") as handle:
            handle.write(content)
    except BaseException:
        os.remove(sidecar)
        raise
    return path


def check_training_corpus(path: str, n: int, options: dict[str, Any], where: str = "the corpus") -> None:
    """Raise ValueError unless the corpus at `path` is exactly what `write_training_corpus` writes with
    these settings (its sidecar says so and its content hash matches): a corpus generated with other
    settings, by an older version or edited since is never silently trained on."""
    wanted = corpus_settings(n, options)
    sidecar = path + SETTINGS_SUFFIX
    fix = f"delete {path} (and a tokenizer trained on it) to generate it again, or point {where} at another file"
    try:
        with open(sidecar, encoding="utf-8") as handle:
            recorded = json.load(handle)
        found, sha256 = recorded["settings"], recorded["sha256"]
    except FileNotFoundError:
        raise ValueError(f"{path} has no {os.path.basename(sidecar)} beside it, so its generation settings are "
                         f"unknown (written by hand or by an older version); {fix}") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{sidecar} is unreadable ({error}); {fix}") from None
    if found != wanted:
        differ = ", ".join(f"{key} {found.get(key)!r} (this config: {wanted[key]!r})"
                           for key in wanted if found.get(key) != wanted[key])
        raise ValueError(f"{path} was generated with other settings: {differ}; {fix}")
    if _sha256_of(path) != sha256:
        raise ValueError(f"{path} differs from what was generated there (its SHA-256 does not match "
                         f"{os.path.basename(sidecar)}: edited since?); {fix}")
