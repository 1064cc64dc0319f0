"""Evaluation settings. The trainer's config embeds this as `eval`, so users write `eval.every_n_steps=100`."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable

from ntl_pretrain.eval.arithmetic import ALL_OPS, SPLITS
from ntl_pretrain.eval.gsm8k import FEWSHOT_SAMPLERS, FewshotSampler, GSM8KVariant
from ntl_pretrain.core.fs import write_json_atomic
from ntl_pretrain.core.typed_yaml import build_dataclass

GSM8K_VARIANTS: tuple[str, ...] = typing.get_args(GSM8KVariant)
# How arithmetic prompts are encoded (EvalConfig.arithmetic_prompt_format).
ArithmeticPromptFormat = typing.Literal["document", "plain"]
ARITHMETIC_PROMPT_FORMATS: tuple[str, ...] = typing.get_args(ArithmeticPromptFormat)
# The run's evaluation settings, written into every checkpoint's hf/ folder (and so into its export), so that
# tools/evaluate.py --model EXPORT evaluates as the run did.
EVAL_SETTINGS_FILE = "ntl_eval.json"


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose one-line doc is kept in its metadata (the run config's `--help` shows it)."""
    return field(metadata={"doc": text}, **kwargs)


@dataclass
class EvalConfig:
    """Which benchmarks run when, and how generation is done."""

    every_n_steps: int = _doc("evaluate every this many optimizer steps during training (0: never periodically)", default=0)
    at_end: bool = _doc("evaluate once more after the last training step", default=True)
    arithmetic_n: int = _doc("arithmetic problems per split (0: skip the arithmetic benchmark)", default=200)
    arithmetic_splits: list[str] = _doc(
        "held-out arithmetic splits: interpolation (training operand lengths) and/or extrapolation (longer)",
        default_factory=lambda: ["interpolation", "extrapolation"])
    arithmetic_ops: list[str] = _doc(
        "operations: +, -, * and the mixed expressions +* (a+b*c) and -* (a-b*c)",
        default_factory=lambda: ["+", "-", "*"])
    arithmetic_train_digits: list[int] = _doc(
        "[min, max] operand digits of the training corpus and the interpolation split",
        default_factory=lambda: [1, 4])
    arithmetic_extrapolation_digits: list[int] = _doc(
        "[min, max] operand digits of the extrapolation split (longer than any in training)",
        default_factory=lambda: [5, 6])
    arithmetic_seed: int = _doc("seed of the arithmetic problems (same seed, same benchmark)", default=1234)
    arithmetic_max_new_tokens: int = _doc("tokens generated at most per arithmetic answer", default=16)
    arithmetic_prompt_format: ArithmeticPromptFormat = _doc(
        "document: each prompt as the training stream presents a document, after the EOS that ends the one "
        "before it and without the tokenizer's special tokens; plain: the prompt alone, encoded as "
        "add_special_tokens says", default="document")
    gsm8k_path: str = _doc(
        "GSM8K source: a local folder with test.jsonl/train.jsonl, a test .jsonl file, or a datasets id such "
        "as openai/gsm8k; empty skips GSM8K", default="")
    gsm8k_dataset_config: str = _doc("configuration name when gsm8k_path is a datasets hub id", default="main")
    gsm8k_variant: GSM8KVariant = _doc(
        "gsm8k: lm-evaluation-harness's gsm8k task ('Question: ...\\nAnswer: ...', train-split exemplars); "
        "gsm8k_cot: its gsm8k_cot task ('Q: ... A: ... The answer is N.', 8 fixed exemplars)", default="gsm8k")
    gsm8k_limit: int = _doc("at most this many GSM8K test problems in periodic evaluations (0: all)", default=100)
    gsm8k_final_limit: int = _doc("at most this many GSM8K test problems in the final evaluation (0: all 1,319)",
                                  default=0)
    num_fewshot: int | None = _doc(
        "worked examples before each GSM8K question (null: the harness's default, gsm8k 5, gsm8k_cot 8)",
        default=None)
    fewshot_seed: int = _doc("seed that picks the few-shot examples from the train split (gsm8k variant; the "
                             "harness's fewshot_random_seed is 1234)", default=1234)
    fewshot_sampler: FewshotSampler = _doc(
        "lm_eval: one generator draws every question's exemplars in test order, as lm-evaluation-harness does "
        "in one process (prompts equal its prompts); per_question: a generator per question index", default="lm_eval")
    gsm8k_cot_exemplars: str = _doc(
        "gsm8k_cot exemplars: lm_eval (read from the installed lm-eval, extra [lmeval]), project (this project's "
        "own 8, not comparable to published numbers), or a YAML/JSON file of {question, target}", default="lm_eval")
    gsm8k_max_new_tokens: int = _doc("tokens generated at most per GSM8K answer", default=256)
    batch_size: int = _doc("prompts decoded together on each data-parallel rank", default=16)
    max_length: int = _doc(
        "prompt plus answer limit in tokens; longer prompts keep their end (0: the model's max_position_embeddings)",
        default=0)
    add_special_tokens: bool | None = _doc(
        "add the tokenizer's special tokens (e.g. BOS) to prompts; null: the tokenizer's default, as "
        "lm-evaluation-harness does (BOS for Llama-style tokenizers)", default=None)
    samples_to_log: int = _doc("sample generations per benchmark logged as text to TensorBoard", default=4)

    def __post_init__(self) -> None:
        self.arithmetic_splits = list(self.arithmetic_splits)
        self.arithmetic_ops = list(self.arithmetic_ops)
        self.arithmetic_train_digits = [int(d) for d in self.arithmetic_train_digits]
        self.arithmetic_extrapolation_digits = [int(d) for d in self.arithmetic_extrapolation_digits]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and how to fix it."""
        for name in ("every_n_steps", "arithmetic_n", "gsm8k_limit", "gsm8k_final_limit", "num_fewshot",
                     "max_length", "samples_to_log"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 0")
        for name in ("arithmetic_max_new_tokens", "gsm8k_max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        bad_splits = [s for s in self.arithmetic_splits if s not in SPLITS or s == "train"]
        if bad_splits:
            raise ValueError(f"eval.arithmetic_splits has {bad_splits}; use 'interpolation' and/or 'extrapolation'")
        if self.arithmetic_n > 0 and not self.arithmetic_splits:  # else "arithmetic on" evaluates nothing, silently
            raise ValueError(f"eval.arithmetic_splits is empty but eval.arithmetic_n={self.arithmetic_n}; name "
                             f"interpolation and/or extrapolation, or set eval.arithmetic_n=0 to skip arithmetic")
        bad_ops = [op for op in self.arithmetic_ops if op not in ALL_OPS]
        if bad_ops or not self.arithmetic_ops:
            raise ValueError(f"eval.arithmetic_ops={list(self.arithmetic_ops)} must be a non-empty list of {list(ALL_OPS)}")
        for name in ("arithmetic_train_digits", "arithmetic_extrapolation_digits"):
            digits = getattr(self, name)
            if len(digits) != 2 or not 1 <= digits[0] <= digits[1]:
                raise ValueError(f"eval.{name}={list(digits)} must be [min, max] with 1 <= min <= max")
        if self.arithmetic_extrapolation_digits[0] <= self.arithmetic_train_digits[1]:
            raise ValueError(
                f"eval.arithmetic_extrapolation_digits={list(self.arithmetic_extrapolation_digits)} must start above "
                f"eval.arithmetic_train_digits={list(self.arithmetic_train_digits)}: set its min to at least "
                f"{self.arithmetic_train_digits[1] + 1}")
        if self.gsm8k_variant not in GSM8K_VARIANTS:
            raise ValueError(f"eval.gsm8k_variant={self.gsm8k_variant!r} must be one of {GSM8K_VARIANTS}")
        if self.arithmetic_prompt_format not in ARITHMETIC_PROMPT_FORMATS:
            raise ValueError(f"eval.arithmetic_prompt_format={self.arithmetic_prompt_format!r} must be one of "
                             f"{ARITHMETIC_PROMPT_FORMATS}")
        if self.fewshot_sampler not in FEWSHOT_SAMPLERS:
            raise ValueError(f"eval.fewshot_sampler={self.fewshot_sampler!r} must be one of {FEWSHOT_SAMPLERS}")
        if not self.gsm8k_cot_exemplars:
            raise ValueError("eval.gsm8k_cot_exemplars is empty; use lm_eval, project or a YAML/JSON file")

    def is_due(self, step: int, *, final: bool = False) -> bool:
        """Whether the training loop should evaluate after `step` (`final`: after the last step)."""
        if final:
            return self.at_end
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0


def eval_config_from_dict(values: dict[str, Any], where: str = "eval") -> EvalConfig:
    """An EvalConfig from a mapping; an unknown key is an error naming the nearest valid one, and every value is
    type-checked as the trainer's config checks `eval.*` (`arithmetic_n=1.5` or `true` is refused, not used)."""
    names = [f.name for f in dataclasses.fields(EvalConfig)]
    for key in values:
        if key not in names:
            nearest = difflib.get_close_matches(str(key), names, n=1, cutoff=0.0)
            raise ValueError(f"unknown evaluation setting {key!r} in {where}; did you mean {nearest[0]!r}? "
                             f"Valid keys: {', '.join(names)}")
    return build_dataclass(EvalConfig, dict(values), "eval.")


def save_eval_settings(folder: str, cfg: EvalConfig) -> str:
    """Write `cfg` as FOLDER/ntl_eval.json (atomically); returns the path."""
    return write_json_atomic(os.path.join(folder, EVAL_SETTINGS_FILE), dataclasses.asdict(cfg), indent=1)


def load_eval_settings(folder: str) -> EvalConfig | None:
    """The settings FOLDER/ntl_eval.json holds (a run's, saved with its checkpoints), or None without one."""
    path = os.path.join(folder, EVAL_SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it to evaluate with default settings") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of evaluation settings")
    try:
        return eval_config_from_dict(values, where=path)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if path in message else f"{path}: {message}") from None


def check_corpus_digits(cfg: EvalConfig, corpora: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Refuse arithmetic benchmark digits that disagree with a corpus the same config generates.

    `corpora`: (config key of the options, e.g. "data.sources.0.generate_options", the options). The
    interpolation split must use the corpus's operand lengths and the extrapolation split longer ones,
    else "extrapolation" problems are trained on (or "interpolation" is not the training distribution).
    """
    if cfg.arithmetic_n == 0:
        return
    for where, options in corpora:
        corpus_digits = [int(d) for d in options.get("train_digits", (1, 4))]
        if corpus_digits != cfg.arithmetic_train_digits:
            raise ValueError(
                f"eval.arithmetic_train_digits={cfg.arithmetic_train_digits} but {where}.train_digits="
                f"{corpus_digits} (the corpus this run generates): the interpolation split must use the training "
                f"operand lengths and the extrapolation split longer ones; set eval.arithmetic_train_digits="
                f"{corpus_digits} and eval.arithmetic_extrapolation_digits to start above {corpus_digits[1]}")


def validate_eval_inputs(cfg: EvalConfig, *, max_position_embeddings: int | None = None, read_hub: bool = False,
                         generated_corpora: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Check, before any training, what the evaluation will read: GSM8K files (every line), the
    chain-of-thought exemplars, that prompts have room under the length limit, and that existing
    generated corpora hold no interpolation problem.

    `max_position_embeddings`: the model's, when known (used when eval.max_length is 0). `read_hub`:
    also load a GSM8K given as a datasets hub id (else only local files are read). `generated_corpora`:
    (config key, path) of corpora the config generates, when they exist. Raises ValueError naming the
    file/line or key and the fix; returns one line per input checked.
    """
    from ntl_pretrain.eval import gsm8k
    from ntl_pretrain.eval.arithmetic import held_out_problems_in

    checked: list[str] = []
    if cfg.arithmetic_n > 0 and "interpolation" in cfg.arithmetic_splits:
        for where, path in generated_corpora:
            count, example = held_out_problems_in(path)
            if count:
                raise ValueError(
                    f"{path} ({where}) holds {count} problems of the interpolation split (e.g. {example!r}), so they "
                    f"would be trained on: it was generated before the split used canonical forms (or by hand); "
                    f"delete it and it is generated again")
            checked.append(f"generated corpus {path}: no interpolation problem")
    limit = cfg.max_length or max_position_embeddings or 0
    budgets = []
    if cfg.arithmetic_n > 0 and cfg.arithmetic_splits:
        budgets.append(("arithmetic_max_new_tokens", cfg.arithmetic_max_new_tokens))
    if cfg.gsm8k_path:
        budgets.append(("gsm8k_max_new_tokens", cfg.gsm8k_max_new_tokens))
    for key, max_new in budgets:
        if limit and max_new >= limit:
            source = "eval.max_length" if cfg.max_length else "the model's max_position_embeddings"
            raise ValueError(f"eval.{key}={max_new} leaves no room for the prompt within {limit} tokens ({source}); "
                             f"lower eval.{key} or raise eval.max_length (lm-evaluation-harness refuses the same)")
    if not cfg.gsm8k_path:
        return checked
    shots = gsm8k.default_num_fewshot(cfg.gsm8k_variant, cfg.num_fewshot)
    splits = ["test"] + (["train"] if cfg.gsm8k_variant == "gsm8k" and shots > 0 else [])
    rows = {}
    for split in splits:
        local = gsm8k.local_split_file(cfg.gsm8k_path, split)
        if local is None and not read_hub:
            continue
        rows[split] = gsm8k.load_gsm8k(cfg.gsm8k_path, split, cfg.gsm8k_dataset_config)
        checked.append(f"GSM8K {split}: {local or cfg.gsm8k_path} ({len(rows[split])} rows)")
    if "test" in rows:
        gsm8k.build_prompts(rows["test"][:1], rows.get("train", []), variant=cfg.gsm8k_variant, num_fewshot=shots,
                            fewshot_seed=cfg.fewshot_seed, fewshot_sampler=cfg.fewshot_sampler,
                            cot_exemplars=cfg.gsm8k_cot_exemplars)
    if cfg.gsm8k_variant == "gsm8k_cot" and shots > 0:
        exemplars = gsm8k.load_cot_exemplars(cfg.gsm8k_cot_exemplars)
        if shots > len(exemplars):
            raise ValueError(f"eval.num_fewshot={shots} but the gsm8k_cot exemplars ({cfg.gsm8k_cot_exemplars}) "
                             f"number {len(exemplars)}; set eval.num_fewshot to at most {len(exemplars)}")
        checked.append(f"gsm8k_cot exemplars: {cfg.gsm8k_cot_exemplars} ({len(exemplars)})")
    return checked
