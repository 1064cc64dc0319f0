"""Scores of arithmetic answers: exact match, MAE, symmetric MAPE, share parseable, per-digit accuracy.

A model's answer is the integer at the start of its output ("357", " -42 ..."); an output that does
not start with one is unparseable. Unparseable answers count as wrong for accuracy and digit
accuracy and are left out of MAE and sMAPE (which are means over parseable answers only; read
them beside `parseable`).
"""

from __future__ import annotations

import math

import re
from typing import Sequence

_LEADING_INTEGER = re.compile(r"\s*(-?\d+)")


def parse_integer_answer(output: str) -> int | None:
    """The integer a model's output starts with (after whitespace), or None."""
    match = _LEADING_INTEGER.match(output)
    return int(match.group(1)) if match else None


def symmetric_ape(prediction: int, gold: int) -> float:
    """|p - g| / ((|p| + |g|) / 2), in [0, 2]; 0 when both are 0."""
    denominator = abs(prediction) + abs(gold)  # integers to the division: exact for any number of digits
    return 0.0 if denominator == 0 else 2 * abs(prediction - gold) / denominator


def digit_accuracy(prediction: int | None, gold: int) -> float:
    """Share of digit positions right, aligned from the units digit over the longer number (sign ignored)."""
    if prediction is None:
        return 0.0
    predicted, expected = str(abs(prediction)), str(abs(gold))
    width = max(len(predicted), len(expected))
    predicted, expected = predicted.rjust(width, " "), expected.rjust(width, " ")
    return sum(p == e for p, e in zip(predicted, expected)) / width


def _mean(total: int, count: int) -> float:
    """`total / count` as a float; inf when it is beyond float's range (numbers of hundreds of digits: an
    extrapolation split of 400-digit operands, or a model that generates that many digits), not an OverflowError."""
    try:
        return total / count
    except OverflowError:
        return math.inf


def arithmetic_scores(predictions: Sequence[int | None], golds: Sequence[int]) -> dict[str, float]:
    """accuracy, mae, smape, parseable, digit_accuracy and n over paired predictions and gold answers."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} gold answers; pass one per problem")
    n = len(golds)
    parsed = [(p, g) for p, g in zip(predictions, golds) if p is not None]
    if n == 0:
        return {"accuracy": 0.0, "mae": 0.0, "smape": 0.0, "parseable": 0.0, "digit_accuracy": 0.0, "n": 0.0}
    return {
        "accuracy": sum(p == g for p, g in parsed) / n,
        "mae": _mean(sum(abs(p - g) for p, g in parsed), len(parsed)) if parsed else float("nan"),
        "smape": sum(symmetric_ape(p, g) for p, g in parsed) / len(parsed) if parsed else float("nan"),
        "parseable": len(parsed) / n,
        "digit_accuracy": sum(digit_accuracy(p, g) for p, g in zip(predictions, golds)) / n,
        "n": float(n),
    }
