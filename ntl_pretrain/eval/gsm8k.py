"""GSM8K as lm-evaluation-harness (0.4.x) runs it: n-shot prompts, greedy answers, two answer filters.

Variants:
- "gsm8k" (lm-evaluation-harness `gsm8k`, v3, 5-shot): each exemplar is "Question: {q}\\nAnswer: {solution}"
  with the full train-split solution (its "#### N" line included), exemplars joined by a blank line,
  then "Question: {q}\\nAnswer:". Generation stops at "Question:", "</s>" or "<|im_end|>".
  Exemplars are drawn as lm-evaluation-harness's default `ContextSampler` draws them: ONE
  `random.Random(fewshot_seed)` (the harness's `fewshot_random_seed`, 1234), and for each test question
  in file order `rnd.sample(train_rows, num_fewshot)`. The harness passes no eval doc to exclude when
  the few-shot split (train) is not the test split, so nothing is removed. The result is the prompt
  list of a one-process harness run, whatever our number of ranks (every rank builds every prompt).
  `fewshot_sampler="per_question"` keeps this project's earlier form: `Random(f"{seed}:{index}")` per question.
- "gsm8k_cot" (lm-evaluation-harness `gsm8k_cot`, v3, 8-shot): "Q: {q}\\nA: {target}" with the harness's
  8 chain-of-thought exemplars (Wei et al.), taken in order (its `first_n` sampler), then "Q: {q}\\nA:".
  The exemplars are read from an installed lm-eval (`gsm8k_cot_exemplars="lm_eval"`, the optional
  extra `pip install -e .[lmeval]`) or from a user's YAML/JSON file; they are not copied into this
  project. `gsm8k_cot_exemplars="project"` selects 8 exemplars written for this project (not comparable
  to published numbers). Stops at "Q:", "</s>" or "<|im_end|>".

Answers are extracted with lm-evaluation-harness's filters: "strict-match" (first
`#### (-?[0-9.,]+)`; "The answer is (...)." for gsm8k_cot) and "flexible-extract" (last
`(-?[$0-9.,]{2,})|(-?[0-9]+)`), then normalised as its exact_match does: commas, "$", everything
up to "#### " and one trailing period removed, lower-cased. The gold answer is the solution
normalised the same way, so every row (test and train) must hold a "#### N" line: a row without
one could never be scored right, and is refused with its file and line (hub rows with their index).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence, get_args

from ..core.typed_yaml import load_yaml  # duplicate keys and alias bombs refused as in a run's config

logger = logging.getLogger("ntl_pretrain")

FILTERS = ("strict-match", "flexible-extract")
_STRICT = {"gsm8k": re.compile(r"#### (\-?[0-9\.\,]+)"),
           "gsm8k_cot": re.compile(r"The answer is (\-?[0-9\.\,]+).")}
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))
STOP_STRINGS = {"gsm8k": ("Question:", "</s>", "<|im_end|>"), "gsm8k_cot": ("Q:", "</s>", "<|im_end|>")}

# The project's own chain-of-thought exemplars (question, reasoning ending in "The answer is N."), selected by
# eval.gsm8k_cot_exemplars=project; the default is lm-evaluation-harness's (read from an installed lm-eval).
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


_FINAL_ANSWER = re.compile(r"#### \S")  # what normalize() strips up to; without it the gold is the whole solution
# What either filter can return once normalised (digits, '.', a leading '-'): a gold of any other form ("#### two",
# "#### 18 eggs", "#### 18\nmore text") is never matched, so such a row would only lower the accuracy.
_MATCHABLE_GOLD = re.compile(r"-?[0-9.]*[0-9][0-9.]*")


def has_final_answer(solution: str) -> bool:
    """Whether a GSM8K solution ends in a "#### N" line with a number N, the gold answer the filters can match."""
    return _FINAL_ANSWER.search(solution) is not None and _MATCHABLE_GOLD.fullmatch(gold_answer(solution)) is not None


def gold_answer(solution: str) -> str:
    """The normalised final answer of a GSM8K solution (the text after "#### ")."""
    return normalize(solution)


FewshotSampler = Literal["lm_eval", "per_question"]
FEWSHOT_SAMPLERS: tuple[str, ...] = get_args(FewshotSampler)
GSM8KVariant = Literal["gsm8k", "gsm8k_cot"]
# The task defaults of lm-evaluation-harness (its gsm8k.yaml and gsm8k-cot.yaml).
DEFAULT_NUM_FEWSHOT: dict[GSM8KVariant, int] = {"gsm8k": 5, "gsm8k_cot": 8}
LM_EVAL_COT_TASK = ("tasks", "gsm8k", "gsm8k-cot.yaml")


def default_num_fewshot(variant: str, num_fewshot: int | None) -> int:
    """`num_fewshot`, or the harness's default for the variant when it is None (gsm8k 5, gsm8k_cot 8)."""
    return DEFAULT_NUM_FEWSHOT[variant] if num_fewshot is None else num_fewshot


def _read_jsonl(data_file: str) -> list[dict[str, Any]]:
    """Rows of a local .jsonl file; a line that is not a JSON object is an error naming the file and line."""
    rows = []
    try:
        with open(data_file, encoding="utf-8-sig") as handle:  # a BOM is no part of line 1's JSON
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"GSM8K file {data_file} line {number} is not valid JSON ({error.msg}, column "
                                     f"{error.colno}): fix or remove that line") from None
                if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "answer")):
                    raise ValueError(f"GSM8K file {data_file} line {number} is not an object with string 'question' "
                                     f"and 'answer' fields: fix or remove that line")
                if not has_final_answer(row["answer"]):
                    raise ValueError(f"GSM8K file {data_file} line {number}: the answer does not end in a '#### N' line with "
                                     f"a number N, so its gold answer could never be matched: fix or remove that line")
                rows.append(row)
    except UnicodeDecodeError as error:
        raise ValueError(f"GSM8K file {data_file} is not UTF-8 text (byte {error.start}): convert it to UTF-8") from None
    if not rows:
        raise ValueError(f"GSM8K file {data_file} holds no rows; give a .jsonl file with one "
                         f'{{"question": ..., "answer": ...}} object per line')
    return rows


def local_split_file(path: str, split: str) -> str | None:
    """The local .jsonl file of `split` for eval.gsm8k_path (None: the path is a datasets hub id)."""
    if os.path.isdir(path):
        return os.path.join(path, f"{split}.jsonl")
    if os.path.isfile(path):
        return path if split == "test" else os.path.join(os.path.dirname(path), f"{split}.jsonl")
    if os.path.exists(path):  # /dev/null, a FIFO: nothing to read rows from
        raise ValueError(f"eval.gsm8k_path={path!r} is neither a folder nor a regular file; give a folder with "
                         f"test.jsonl and train.jsonl, a test .jsonl file, or a datasets hub id such as openai/gsm8k")
    if os.path.isabs(path) or path.startswith((".", "~")) or path.endswith((".jsonl", ".json")):
        raise ValueError(f"eval.gsm8k_path={path!r} does not exist; give a folder with test.jsonl and train.jsonl, "
                         f"a test .jsonl file, or a datasets hub id such as openai/gsm8k")
    return None


@functools.lru_cache(maxsize=8)
def _load_split(path: str, split: str, dataset_config: str) -> tuple[dict[str, str], ...]:
    data_file = local_split_file(path, split)
    if data_file is not None:
        if not os.path.isfile(data_file):
            raise ValueError(
                f"GSM8K {split} split not found at {data_file}: eval.gsm8k_path={path!r} must be a folder with "
                f"test.jsonl and train.jsonl (the train split gives the few-shot exemplars), or a datasets id")
        return tuple({"question": row["question"], "answer": row["answer"]} for row in _read_jsonl(data_file))
    import datasets

    dataset = datasets.load_dataset(path, dataset_config, split=split)
    missing = {"question", "answer"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"GSM8K data at {path!r} ({split}) lacks columns {sorted(missing)}; each row needs "
                         f"'question' and 'answer'")
    rows = tuple({"question": row["question"], "answer": row["answer"]} for row in dataset)
    for index, row in enumerate(rows):
        if not (isinstance(row["question"], str) and isinstance(row["answer"], str) and has_final_answer(row["answer"])):
            raise ValueError(f"GSM8K data at {path!r} ({split}) row {index}: not a string question and an answer ending "
                             f"in a '#### N' line with a number N, so it could never be scored; fix or filter that row")
    return rows


def load_gsm8k(path: str, split: str = "test", dataset_config: str = "main") -> list[dict[str, str]]:
    """Rows ({"question", "answer"}) of a GSM8K split from a local folder/jsonl or a `datasets` id."""
    if not path:
        raise ValueError("GSM8K path is empty: set eval.gsm8k_path to a folder with test.jsonl or to openai/gsm8k")
    return list(_load_split(path, split, dataset_config))


def _lm_eval_cot_task_file() -> str:
    """Path of the installed lm-evaluation-harness's gsm8k-cot.yaml (found without importing lm_eval)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("eval.gsm8k_variant=gsm8k_cot reads lm-evaluation-harness's 8 chain-of-thought exemplars "
                         "from an installed lm-eval, which is missing: pip install -e '.[lmeval]' (or lm-eval), or "
                         "set eval.gsm8k_cot_exemplars to a YAML/JSON file of {question, target} exemplars")
    path = os.path.join(next(iter(spec.submodule_search_locations)), *LM_EVAL_COT_TASK)
    if not os.path.isfile(path):
        raise ValueError(f"the installed lm-eval has no {'/'.join(LM_EVAL_COT_TASK)} ({path}); install lm-eval 0.4.x "
                         f"or set eval.gsm8k_cot_exemplars to a YAML/JSON file of {{question, target}} exemplars")
    return path


@functools.lru_cache(maxsize=4)
def load_cot_exemplars(source: str = "lm_eval") -> tuple[tuple[str, str], ...]:
    """(question, target) chain-of-thought exemplars, in order.

    source: "lm_eval" (the installed harness's gsm8k-cot.yaml), "project" (this project's own 8), or a
    YAML/JSON file holding either a list of {question, target} or an lm-eval task (fewshot_config.samples).
    """
    if source == "project":
        return COT_EXEMPLARS
    path = _lm_eval_cot_task_file() if source == "lm_eval" else source
    if not os.path.isfile(path):
        raise ValueError(f"eval.gsm8k_cot_exemplars={source!r} is neither 'lm_eval', 'project' nor an existing file")
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            document = load_yaml(handle.read(), path)
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"chain-of-thought exemplars file {path} is not valid YAML/JSON: "
                         f"{' '.join(str(error).split())}") from None
    samples = document.get("fewshot_config", {}).get("samples") if isinstance(document, dict) else document
    if (not isinstance(samples, list) or not samples
            or not all(isinstance(s, dict) and isinstance(s.get("question"), str) and isinstance(s.get("target"), str)
                       for s in samples)):
        raise ValueError(f"chain-of-thought exemplars file {path} must hold a non-empty list of {{question, target}} "
                         f"strings (or an lm-eval task with fewshot_config.samples)")
    return tuple((s["question"], s["target"]) for s in samples)


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
                  num_fewshot: int | None = None, fewshot_seed: int = 1234, limit: int = 0,
                  fewshot_sampler: str = "lm_eval", cot_exemplars: str = "lm_eval") -> list[Gsm8kItem]:
    """n-shot prompts for the first `limit` test rows (0: all); `num_fewshot` None: the harness's default.

    gsm8k, fewshot_sampler "lm_eval": one generator seeded with `fewshot_seed` draws each question's
    exemplars in test-file order, as lm-evaluation-harness does in one process; the first k prompts
    do not depend on `limit`. "per_question": each question draws from `Random(f"{fewshot_seed}:{index}")`.
    gsm8k_cot: the first `num_fewshot` exemplars of `cot_exemplars` (see `load_cot_exemplars`).
    """
    if variant not in DEFAULT_NUM_FEWSHOT:
        raise ValueError(f"variant={variant!r} must be 'gsm8k' or 'gsm8k_cot'")
    if fewshot_sampler not in FEWSHOT_SAMPLERS:
        raise ValueError(f"fewshot_sampler={fewshot_sampler!r} must be one of {FEWSHOT_SAMPLERS}")
    shots_wanted = default_num_fewshot(variant, num_fewshot)
    rows = list(test_rows)[:limit] if limit > 0 else list(test_rows)
    pool = list(train_rows)
    # a test question that is also in the pool (eval.gsm8k_path naming train.jsonl, a test file copied from it) is
    # left out of its own exemplars, as lm-evaluation-harness does when both splits are one: drawn, it would put
    # the question with its answer into the prompt
    in_pool = {row["question"] for row in pool} if variant == "gsm8k" and shots_wanted > 0 else set()
    shared = sum(row["question"] in in_pool for row in rows)
    if shared:
        if shots_wanted >= len(pool):
            raise ValueError(f"num_fewshot={shots_wanted} but the train split has only {len(pool)} rows, and the test "
                             f"questions are among them (each is left out of its own exemplars); use distinct test "
                             f"and train files, or fewer shots")
        logger.warning("GSM8K: %d of the %d test questions are also in the train split the few-shot exemplars are "
                       "drawn from; each is left out of its own exemplars (give distinct test and train files)",
                       shared, len(rows))
    if variant == "gsm8k" and shots_wanted > len(pool):
        raise ValueError(f"num_fewshot={shots_wanted} but the train split has only {len(pool)} rows")
    exemplars = load_cot_exemplars(cot_exemplars) if variant == "gsm8k_cot" and shots_wanted > 0 else ()
    if variant == "gsm8k_cot" and shots_wanted > len(exemplars):
        raise ValueError(f"num_fewshot={shots_wanted} but the gsm8k_cot exemplars ({cot_exemplars}) number "
                         f"{len(exemplars)}; set eval.num_fewshot to at most {len(exemplars)}")
    shared_rng = random.Random(fewshot_seed)
    items = []
    for index, row in enumerate(rows):
        if variant == "gsm8k":
            if shots_wanted == 0:
                drawn: list[dict[str, str]] = []
            else:
                rng = shared_rng if fewshot_sampler == "lm_eval" else random.Random(f"{fewshot_seed}:{index}")
                own = row["question"] in in_pool
                drawn = rng.sample(pool, shots_wanted + own)
                if own:
                    drawn = [r for r in drawn if r["question"] != row["question"]][:shots_wanted]
            shots = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in drawn]
            query = f"Question: {row['question']}\nAnswer:"
        else:
            shots = [f"Q: {q}\nA: {a}" for q, a in exemplars[:shots_wanted]]
            query = f"Q: {row['question']}\nA:"
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
