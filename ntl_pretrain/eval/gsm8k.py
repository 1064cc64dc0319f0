"""GSM8K as lm-evaluation-harness runs it: n-shot prompts, greedy answers, two answer filters.

Variants:
- "gsm8k" (lm-evaluation-harness `gsm8k`, v3): each exemplar is "Question: {q}\\nAnswer: {solution}"
  with the full train-split solution (its "#### N" line included), exemplars joined by a blank line,
  then "Question: {q}\\nAnswer:". Generation stops at "Question:", "</s>" or "<|im_end|>".
- "gsm8k_cot": "Q: {q}\\nA: {reasoning} The answer is N." with 8 fixed exemplars written for this
  project (lm-evaluation-harness's `gsm8k_cot` uses the exemplars of Wei et al., so scores are
  close in spirit but not identical). Stops at "Q:", "</s>" or "<|im_end|>".

Answers are extracted with lm-evaluation-harness's filters: "strict-match" (first
`#### (-?[0-9.,]+)`; "The answer is (...)." for gsm8k_cot) and "flexible-extract" (last
`(-?[$0-9.,]{2,})|(-?[0-9]+)`), then normalised as its exact_match does: commas, "$", everything
up to "#### " and one trailing period removed, lower-cased. The gold answer is the solution
normalised the same way.
"""

from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

FILTERS = ("strict-match", "flexible-extract")
_STRICT = {"gsm8k": re.compile(r"#### (\-?[0-9\.\,]+)"),
           "gsm8k_cot": re.compile(r"The answer is (\-?[0-9\.\,]+).")}
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))
STOP_STRINGS = {"gsm8k": ("Question:", "</s>", "<|im_end|>"), "gsm8k_cot": ("Q:", "</s>", "<|im_end|>")}

# The project's own chain-of-thought exemplars (question, reasoning ending in "The answer is N.").
COT_EXEMPLARS = (
    ("A baker makes 24 rolls in the morning and 18 in the afternoon. She sells 30 of them. How many rolls are left?",
     "The baker makes 24 + 18 = 42 rolls. After selling 30, she has 42 - 30 = 12 rolls. The answer is 12."),
    ("Tom reads 15 pages a day. How many pages does he read in 6 days?",
     "Each day he reads 15 pages, so in 6 days he reads 15 * 6 = 90 pages. The answer is 90."),
    ("A box holds 8 pencils. How many boxes are needed for 56 pencils?",
     "Each box holds 8 pencils, so 56 / 8 = 7 boxes are needed. The answer is 7."),
    ("Mia had $50. She bought a book for $12 and a lamp for $23. How much money does she have now?",
     "She spent 12 + 23 = 35 dollars, so she has 50 - 35 = 15 dollars left. The answer is 15."),
    ("A garden has 4 rows of 9 tulips and 3 rows of 5 roses. How many flowers are in the garden?",
     "There are 4 * 9 = 36 tulips and 3 * 5 = 15 roses, so 36 + 15 = 51 flowers. The answer is 51."),
    ("The temperature was 7 degrees at noon and fell by 11 degrees by midnight. What was it at midnight?",
     "It started at 7 degrees and fell by 11, so it was 7 - 11 = -4 degrees. The answer is -4."),
    ("A bus carries 45 passengers. At the first stop 12 get off and 8 get on. How many passengers are on the bus?",
     "After 12 get off there are 45 - 12 = 33 passengers, and after 8 get on there are 33 + 8 = 41. "
     "The answer is 41."),
    ("Sam runs 3 miles every weekday and 5 miles on each weekend day. How many miles does he run in a week?",
     "On the 5 weekdays he runs 3 * 5 = 15 miles and on the 2 weekend days 5 * 2 = 10 miles, so 15 + 10 = 25 "
     "miles. The answer is 25."),
)


def normalize(text: str) -> str:
    """lm-evaluation-harness's exact_match normalisation for GSM8K (regexes_to_ignore, then lower case)."""
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def extract_answer(text: str, mode: str = "strict", variant: str = "gsm8k") -> str | None:
    """The normalised answer in a model's output, or None when the filter finds none.

    mode "strict" (strict-match): the first "#### N" ("The answer is N." for gsm8k_cot);
    mode "flexible" (flexible-extract): the last number-like run in the text.
    """
    if variant not in _STRICT:
        raise ValueError(f"variant={variant!r} is not one of {tuple(_STRICT)}")
    if mode == "strict":
        match = _STRICT[variant].search(text)
        found = match.group(1) if match else None
    elif mode == "flexible":
        matches = _FLEXIBLE.findall(text)
        found = next((group for group in matches[-1] if group), None) if matches else None
    else:
        raise ValueError(f"mode={mode!r} must be 'strict' or 'flexible'")
    return None if found is None else normalize(found.strip())


def gold_answer(solution: str) -> str:
    """The normalised final answer of a GSM8K solution (the text after "#### ")."""
    return normalize(solution)


@functools.lru_cache(maxsize=8)
def _load_split(path: str, split: str, dataset_config: str) -> tuple[dict[str, str], ...]:
    import datasets

    if os.path.isdir(path):
        data_file = os.path.join(path, f"{split}.jsonl")
    elif os.path.isfile(path):
        data_file = path if split == "test" else os.path.join(os.path.dirname(path), f"{split}.jsonl")
    else:
        data_file = ""
    if data_file:
        if not os.path.isfile(data_file):
            raise FileNotFoundError(
                f"GSM8K {split} split not found at {data_file}: eval.gsm8k_path={path!r} must be a folder with "
                f"test.jsonl and train.jsonl (the train split gives the few-shot exemplars), or a datasets id")
        dataset = datasets.load_dataset("json", data_files=data_file, split="train")
    else:
        dataset = datasets.load_dataset(path, dataset_config, split=split)
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"GSM8K data at {path!r} ({split}) lacks columns {sorted(missing)}; each row needs "
                         f"'question' and 'answer'")
    return tuple({"question": row["question"], "answer": row["answer"]} for row in dataset)


def load_gsm8k(path: str, split: str = "test", dataset_config: str = "main") -> list[dict[str, str]]:
    """Rows ({"question", "answer"}) of a GSM8K split from a local folder/jsonl or a `datasets` id."""
    if not path:
        raise ValueError("GSM8K path is empty: set eval.gsm8k_path to a folder with test.jsonl or to openai/gsm8k")
    return list(_load_split(path, split, dataset_config))


@dataclass(frozen=True)
class Gsm8kItem:
    """One test question, the prompt the model sees, and the gold solution."""

    index: int
    question: str
    solution: str
    prompt: str

    @property
    def gold(self) -> str:
        """The normalised gold answer."""
        return gold_answer(self.solution)


def build_prompts(test_rows: Sequence[dict[str, str]], train_rows: Sequence[dict[str, str]], *, variant: str = "gsm8k",
                  num_fewshot: int = 5, fewshot_seed: int = 1234, limit: int = 0) -> list[Gsm8kItem]:
    """n-shot prompts for the first `limit` test rows (0: all).

    gsm8k: each question gets its own `num_fewshot` train exemplars, drawn with a generator seeded by
    (fewshot_seed, question index), so a question's prompt does not depend on `limit` or on ranks.
    """
    rows = list(test_rows)[:limit] if limit > 0 else list(test_rows)
    items = []
    for index, row in enumerate(rows):
        if variant == "gsm8k":
            if num_fewshot > len(train_rows):
                raise ValueError(f"num_fewshot={num_fewshot} but the train split has only {len(train_rows)} rows")
            rng = random.Random(f"{fewshot_seed}:{index}")
            shots = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rng.sample(list(train_rows), num_fewshot)]
            query = f"Question: {row['question']}\nAnswer:"
        elif variant == "gsm8k_cot":
            if num_fewshot > len(COT_EXEMPLARS):
                raise ValueError(f"num_fewshot={num_fewshot} but gsm8k_cot has {len(COT_EXEMPLARS)} exemplars")
            shots = [f"Q: {q}\nA: {a}" for q, a in COT_EXEMPLARS[:num_fewshot]]
            query = f"Q: {row['question']}\nA:"
        else:
            raise ValueError(f"variant={variant!r} must be 'gsm8k' or 'gsm8k_cot'")
        items.append(Gsm8kItem(index=index, question=row["question"], solution=row["answer"],
                               prompt="\n\n".join(shots + [query])))
    return items


def score(outputs: Sequence[str], golds: Sequence[str], variant: str = "gsm8k") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Accuracy per filter, and per output the extracted answers and whether each is right."""
    if len(outputs) != len(golds):
        raise ValueError(f"{len(outputs)} outputs for {len(golds)} gold answers; pass one per question")
    details = []
    correct = {name: 0 for name in FILTERS}
    for output, gold in zip(outputs, golds):
        extracted = {"strict-match": extract_answer(output, "strict", variant),
                     "flexible-extract": extract_answer(output, "flexible", variant)}
        right = {name: answer is not None and answer == gold for name, answer in extracted.items()}
        for name in FILTERS:
            correct[name] += right[name]
        details.append({"extracted": extracted, "correct": right})
    n = max(len(golds), 1)
    return {name: correct[name] / n for name in FILTERS}, details
