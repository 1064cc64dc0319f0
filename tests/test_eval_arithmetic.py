"""Arithmetic benchmark generator, demo training corpus and the arithmetic metrics."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ntl_pretrain.eval.arithmetic import (ArithmeticProblem, generate_problems, is_interpolation_problem,
                                          make_problem, write_training_corpus)
from ntl_pretrain.eval.metrics import arithmetic_scores, digit_accuracy, parse_integer_answer, symmetric_ape

OPERAND = re.compile(r"\d+")


def _operand_lengths(problem: ArithmeticProblem) -> list[int]:
    return [len(o) for o in OPERAND.findall(problem.expression)]


def test_problem_format_and_answers_match_python():
    problem = make_problem(12, 345, "+")
    assert (problem.prompt, problem.completion, problem.text) == ("12+345=", "357", "12+345=357")
    for ops in (("+", "-", "*"), ("+*", "-*")):
        for problem in generate_problems("interpolation", 60, seed=3, ops=ops):
            # Python's own evaluation of the written expression is the reference (precedence included).
            assert problem.answer == eval(problem.expression)  # noqa: S307 - digits and + - * only
            assert problem.text == problem.prompt + str(problem.answer)


def test_generation_is_deterministic_and_seeded():
    first = generate_problems("train", 50, seed=11)
    assert first == generate_problems("train", 50, seed=11)
    assert first != generate_problems("train", 50, seed=12)
    assert generate_problems("extrapolation", 20, seed=11) != generate_problems("interpolation", 20, seed=11)
    ops = [p.op for p in generate_problems("interpolation", 9, seed=0)]
    assert ops == ["+", "-", "*"] * 3


def test_splits_are_disjoint_and_use_their_operand_lengths():
    train = generate_problems("train", 3000, seed=5)
    interpolation = generate_problems("interpolation", 400, seed=5)
    extrapolation = generate_problems("extrapolation", 200, seed=5)
    train_set = {p.expression for p in train}
    assert not train_set & {p.expression for p in interpolation}
    assert not train_set & {p.expression for p in extrapolation}
    assert not any(is_interpolation_problem(p) for p in train)
    assert all(is_interpolation_problem(p) for p in interpolation)
    assert len({p.expression for p in interpolation}) == 400  # evaluation splits hold no duplicates
    assert all(1 <= n <= 4 for p in train + interpolation for n in _operand_lengths(p))
    assert all(5 <= n <= 6 for p in extrapolation for n in _operand_lengths(p))
    # Every length in range shows up, so the split really covers (1, 4).
    assert {n for p in interpolation for n in _operand_lengths(p)} == {1, 2, 3, 4}


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="split='test'"):
        generate_problems("test", 3, seed=0)
    with pytest.raises(ValueError, match=r"unknown arithmetic ops \['/'\]"):
        generate_problems("train", 3, seed=0, ops=("+", "/"))
    with pytest.raises(ValueError, match="must be longer than train_digits"):
        generate_problems("extrapolation", 3, seed=0, train_digits=(1, 5), extrapolation_digits=(5, 6))
    with pytest.raises(ValueError, match="space is too small"):
        generate_problems("interpolation", 200, seed=0, ops=("+",), train_digits=(1, 1), extrapolation_digits=(2, 2))
    with pytest.raises(ValueError, match="needs a third operand"):
        make_problem(1, 2, "+*")


def test_training_corpus_is_written_atomically_and_holds_only_train_problems(tmp_path: Path):
    path = write_training_corpus(str(tmp_path / "corpus" / "demo.jsonl"), n=500, seed=2)
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(lines) == 500 and all(set(line) == {"text", "prompt", "completion"} for line in lines)
    assert all(line["text"] == line["prompt"] + line["completion"] for line in lines)
    # no temporary file left behind; the settings beside the corpus
    assert sorted(os.listdir(tmp_path / "corpus")) == ["demo.jsonl", "demo.jsonl.settings"]
    arithmetic = [line["text"] for line in lines if re.fullmatch(r"[\d+\-*=]+", line["text"])]
    sentences = [line["text"] for line in lines if line["text"] not in arithmetic]
    assert len(sentences) == 100  # text_share 0.2
    assert all(re.search(r"\d", s) and s.endswith(".") for s in sentences)
    held_out = {p.text for split in ("interpolation", "extrapolation") for p in generate_problems(split, 300, seed=2)}
    for text in arithmetic:
        expression, answer = text.split("=")
        assert eval(expression) == int(answer)  # noqa: S307 - digits and + - * only
        assert text not in held_out
        assert not is_interpolation_problem(make_problem(*_split_binary(expression)))
    # A write that fails (the target is a directory: the shared writer refuses it) leaves nothing behind and keeps
    # what was there.
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="is a directory, not a regular file"):
        write_training_corpus(str(tmp_path / "taken"), n=10, seed=2)
    assert os.listdir(tmp_path / "taken") == [] and not (tmp_path / "taken.settings").exists()
    with pytest.raises(ValueError, match="text_share=1.5"):
        write_training_corpus(str(tmp_path / "x.jsonl"), n=10, seed=2, text_share=1.5)


def _split_binary(expression: str) -> tuple[int, int, str]:
    a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)", expression).groups()
    return int(a), int(b), op


def test_parse_integer_answer():
    assert parse_integer_answer("357") == 357
    assert parse_integer_answer(" -42 and more") == -42
    assert parse_integer_answer("12+3") == 12
    assert parse_integer_answer("abc 12") is None
    assert parse_integer_answer("") is None
    assert parse_integer_answer("-") is None


def test_arithmetic_scores_by_hand():
    predictions = [357, None, 12, -5]
    golds = [357, 10, 10, 5]
    scores = arithmetic_scores(predictions, golds)
    assert scores["accuracy"] == 0.25
    assert scores["parseable"] == 0.75
    assert scores["mae"] == pytest.approx((0 + 2 + 10) / 3)
    assert scores["smape"] == pytest.approx((0 + 2 / 11 + 10 / 5) / 3)
    # 357 vs 357: 3/3; unparseable: 0; "12" vs "10": 1/2; -5 vs 5: sign ignored, 1/1.
    assert scores["digit_accuracy"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert scores["n"] == 4
    assert digit_accuracy(1234, 34) == pytest.approx(2 / 4)  # aligned on the units digit
    assert symmetric_ape(0, 0) == 0.0 and symmetric_ape(1, -1) == 2.0
    with pytest.raises(ValueError, match="3 predictions for 2 gold"):
        arithmetic_scores([1, 2, 3], [1, 2])


@pytest.mark.parametrize("ops,digits", [(("+", "-"), (1, 2)), (("+", "*", "+*", "-*"), (1, 3))])
def test_commuted_twin_of_an_interpolation_problem_is_never_trained_on(ops, digits):
    from ntl_pretrain.eval.arithmetic import canonical_form

    held_out = generate_problems("interpolation", 200, seed=3, ops=ops, train_digits=digits,
                                 extrapolation_digits=(digits[1] + 1, digits[1] + 1))
    trained = {p.expression for p in generate_problems("train", 20000, seed=3, ops=ops, train_digits=digits,
                                                       extrapolation_digits=(digits[1] + 1, digits[1] + 1))}
    pairs = [(make_problem(p.b, p.a, p.op), p) for p in held_out if p.op in ("+", "*")]
    pairs += [(make_problem(p.a, p.c, p.op, p.b), p) for p in held_out if p.op in ("+*", "-*")]
    assert pairs and all(canonical_form(twin) == canonical_form(p) for twin, p in pairs)
    twins = [twin for twin, _ in pairs]
    leaked = [t.expression for t in twins if t.expression in trained]
    assert leaked == []
    assert all(is_interpolation_problem(t) for t in twins)


def test_an_error_beyond_floats_range_is_an_infinite_mae_not_an_overflow():
    """`eval.arithmetic_extrapolation_digits=[400, 400]` ended the evaluation with a raw OverflowError ("integer
    division result too large for a float") when the MAE was averaged; a model generating hundreds of digits does
    the same."""
    import math

    scores = arithmetic_scores([10 ** 400, 7], [3, 7])
    assert scores["mae"] == math.inf and scores["accuracy"] == 0.5
    assert scores["smape"] == pytest.approx((2 * (10 ** 400 - 3) / (10 ** 400 + 3) + 0) / 2)
    assert arithmetic_scores([10 ** 300], [0])["mae"] == 10.0 ** 300  # the largest errors a float holds stay exact
