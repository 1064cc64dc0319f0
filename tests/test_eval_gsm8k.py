"""GSM8K answer extraction (lm-evaluation-harness's strict-match and flexible-extract), prompts and loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ntl_pretrain.eval.gsm8k import build_prompts, extract_answer, gold_answer, load_gsm8k, score

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

# Solutions written for these tests in GSM8K's format (none is a GSM8K problem).
SOLUTIONS = {
    "commas": ("The farm had 1,200 hens and bought 300 more: 1,200+300=<<1200+300=1500>>1,500.\n#### 1,500", "1500"),
    "dollars": ("Each ticket is $4 and she buys 3, so she pays 4*3=$<<4*3=12>>12.\n#### 12", "12"),
    "negative": ("The temperature drops from 3 to -8 degrees, a change of -8-3=<<-8-3=-11>>-11.\n#### -11", "-11"),
    "decimal": ("Half of 7.5 is 7.5/2=<<7.5/2=3.75>>3.75 liters.\n#### 3.75", "3.75"),
    "large": ("Total: 2,000,000+500,000=<<2000000+500000=2500000>>2,500,000\n#### 2,500,000", "2500000"),
}


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_gold_solutions_extract_under_both_filters(name: str):
    solution, answer = SOLUTIONS[name]
    assert gold_answer(solution) == answer
    assert extract_answer(solution, "strict") == answer
    assert extract_answer(solution, "flexible") == answer


def test_strict_and_flexible_differ_where_lm_eval_differs():
    # No "####": strict finds nothing, flexible takes the last number-like run.
    assert extract_answer("She has 5 apples, so the answer is 17.", "strict") is None
    assert extract_answer("She has 5 apples, so the answer is 17.", "flexible") == "17"  # trailing period dropped
    # "$" is not part of the strict pattern, but flexible keeps it and normalisation removes it.
    assert extract_answer("#### $1,250", "strict") is None
    assert extract_answer("It costs $1,250", "flexible") == "1250"
    # strict takes the FIRST "#### N", flexible the LAST number of the text.
    rambling = "2+2=4\n#### 4\n\nNext she buys 9 more.\n#### 13"
    assert extract_answer(rambling, "strict") == "4"
    assert extract_answer(rambling, "flexible") == "13"
    # Nothing number-like at all.
    assert extract_answer("I do not know.", "strict") is None
    assert extract_answer("I do not know.", "flexible") is None
    # Negative and decimal numbers keep their sign and point; a lone digit is found by the second alternative.
    assert extract_answer("it is -0.5 now", "flexible") == "-0.5"
    assert extract_answer("x 7 y", "flexible") == "7"
    # The chain-of-thought variant's strict pattern.
    assert extract_answer("So 3 + 4 = 7. The answer is 7.", "strict", variant="gsm8k_cot") == "7"
    with pytest.raises(ValueError, match="mode='loose'"):
        extract_answer("1", "loose")


def test_score_counts_each_filter():
    outputs = ["... #### 12", "... the total is 12.", "no idea"]
    accuracy, details = score(outputs, ["12", "12", "12"])
    assert accuracy == {"strict-match": pytest.approx(1 / 3), "flexible-extract": pytest.approx(2 / 3)}
    assert details[1]["extracted"] == {"strict-match": None, "flexible-extract": "12"}
    assert details[2]["correct"] == {"strict-match": False, "flexible-extract": False}


def _write_rows(folder: Path, split: str, count: int) -> list[dict[str, str]]:
    rows = [{"question": f"Ann has {i} pens and finds {i + 1} more. How many pens?",
             "answer": f"{i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}"} for i in range(count)]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def test_prompts_follow_lm_eval_format_and_do_not_depend_on_limit(tmp_path: Path):
    train = _write_rows(tmp_path, "train", 20)
    test = _write_rows(tmp_path, "test", 6)
    assert load_gsm8k(str(tmp_path), "train") == train
    assert load_gsm8k(str(tmp_path / "test.jsonl"), "test") == test
    items = build_prompts(test, train, num_fewshot=3, fewshot_seed=1)
    prompt = items[4].prompt
    blocks = prompt.split("\n\n")
    assert len(blocks) == 4 and blocks[-1] == f"Question: {test[4]['question']}\nAnswer:"
    for block in blocks[:3]:
        question, answer = block.split("\nAnswer: ")
        row = next(r for r in train if f"Question: {r['question']}" == question)
        assert answer == row["answer"]  # the full solution, "#### N" included
    assert len(set(blocks[:3])) == 3
    assert [i.prompt for i in build_prompts(test, train, num_fewshot=3, fewshot_seed=1, limit=5)] == \
           [i.prompt for i in items[:5]]
    assert items[4].gold == "9"
    cot = build_prompts(test, [], variant="gsm8k_cot", num_fewshot=8)[0].prompt
    assert cot.count("Q: ") == 9 and cot.count("The answer is") == 8 and cot.endswith("\nA:")
    zero_shot = build_prompts(test, [], num_fewshot=0)[0].prompt
    assert zero_shot == f"Question: {test[0]['question']}\nAnswer:"


def test_missing_train_split_is_reported(tmp_path: Path):
    _write_rows(tmp_path, "test", 2)
    with pytest.raises(ValueError, match="train split not found"):
        load_gsm8k(str(tmp_path), "train")
    with pytest.raises(ValueError, match="gsm8k_path"):
        load_gsm8k("", "test")


def test_real_gsm8k_gold_solutions_score_one_under_both_filters():
    if not (SHARED_GSM8K / "test.jsonl").is_file():
        pytest.fail(f"{SHARED_GSM8K} is absent: the tests need ../shared/data beside the clone")
    rows = load_gsm8k(str(SHARED_GSM8K), "test")
    assert len(rows) == 1319
    accuracy, _ = score([row["answer"] for row in rows], [gold_answer(row["answer"]) for row in rows])
    assert accuracy == {"strict-match": 1.0, "flexible-extract": 1.0}
    train = load_gsm8k(str(SHARED_GSM8K), "train")
    items = build_prompts(rows, train, num_fewshot=5, limit=3)
    assert all(item.prompt.count("Question: ") == 6 for item in items)


def test_rows_without_a_final_answer_line_are_refused_naming_file_and_line(tmp_path: Path):
    """A solution without "#### N", or whose N is no number either filter can return ("two", "18 eggs", text after
    it): its gold could never be matched (the model's right answer scores 0), so the row is refused."""
    good = {"question": "1+1?", "answer": "1+1=2\n#### 2"}
    for answer in ("1+1=2, so the answer is 2", "1+1=2\n####2", "1+1=2\n#### ", "1+1=2\n#### two",
                   "1+1=2\n#### 2 apples", "1+1=2\n#### 2\nchecked by hand", "x\n#### -"):
        bad = {"question": "2+2?", "answer": answer}
        right = "1+1=2\n#### 2"  # the model's right answer: the filters read 2, never the malformed gold
        assert score([right], [gold_answer(answer)])[0] == {"strict-match": 0.0, "flexible-extract": 0.0}
        (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(row) for row in (good, good, bad)) + "\n")
        with pytest.raises(ValueError) as info:
            load_gsm8k(str(tmp_path / "test.jsonl"), "test")
        assert f"GSM8K file {tmp_path / 'test.jsonl'} line 3: the answer does not end in a '#### N' line with a number N" \
            in str(info.value)
    fine = [good, {"question": "q", "answer": "x\n#### 1,000"}, {"question": "q", "answer": "x\n#### $-2.5."}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in fine))
    assert load_gsm8k(str(tmp_path / "test.jsonl"), "test") == fine
    golds = [gold_answer(row["answer"]) for row in fine[1:]]
    assert score(["#### 1000", "The total is -2.5"], golds)[0]["flexible-extract"] == 1.0


def test_a_test_question_that_is_in_the_train_split_is_left_out_of_its_own_exemplars(tmp_path: Path, caplog):
    """Issue 40, go-beyond round: eval.gsm8k_path naming GSM8K's train.jsonl (its train split is then the same file)
    drew a question's own row as one of its exemplars, answer included, and counted the answer as right."""
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        pytest.fail(f"{SHARED_GSM8K} is absent: the tests need ../shared/data beside the clone")
    lines = (SHARED_GSM8K / "train.jsonl").read_text(encoding="utf-8").splitlines()[:7]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    test = load_gsm8k(str(tmp_path / "train.jsonl"), "test")  # the path names the train file
    train = load_gsm8k(str(tmp_path / "train.jsonl"), "train")
    assert test == train
    for sampler in ("lm_eval", "per_question"):
        with caplog.at_level("WARNING", logger="ntl_pretrain"):
            items = build_prompts(test, train, num_fewshot=5, fewshot_sampler=sampler)
        assert all(item.prompt.count(f"Question: {item.question}\n") == 1 for item in items)
        assert all(item.prompt.count("Question: ") == 6 for item in items)
        assert "7 of the 7 test questions are also in the train split" in caplog.text
    with pytest.raises(ValueError, match="num_fewshot=7 but the train split has only 7 rows, and the test questions"):
        build_prompts(test, train, num_fewshot=7)


def test_a_gsm8k_file_with_a_byte_order_mark_is_read(tmp_path: Path):
    """Issue 40, go-beyond round: a test.jsonl saved with a BOM (Windows editors) was refused as "line 1 is not valid
    JSON (Unexpected UTF-8 BOM ...): fix or remove that line", though the training data reader takes one."""
    if not (SHARED_GSM8K / "test.jsonl").is_file():
        pytest.fail(f"{SHARED_GSM8K} is absent: the tests need ../shared/data beside the clone")
    text = "\n".join((SHARED_GSM8K / "test.jsonl").read_text(encoding="utf-8").splitlines()[:5]) + "\n"
    (tmp_path / "test.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    (tmp_path / "plain.jsonl").write_text(text, encoding="utf-8")
    assert load_gsm8k(str(tmp_path / "test.jsonl")) == load_gsm8k(str(tmp_path / "plain.jsonl"))
