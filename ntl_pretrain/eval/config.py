"""Evaluation settings. The trainer's config embeds this as `eval`, so users write `eval.every_n_steps=100`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ntl_pretrain.eval.arithmetic import ALL_OPS, SPLITS

GSM8K_VARIANTS = ("gsm8k", "gsm8k_cot")


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
    gsm8k_path: str = _doc(
        "GSM8K source: a local folder with test.jsonl/train.jsonl, a test .jsonl file, or a datasets id such "
        "as openai/gsm8k; empty skips GSM8K", default="")
    gsm8k_dataset_config: str = _doc("configuration name when gsm8k_path is a datasets hub id", default="main")
    gsm8k_variant: str = _doc(
        "gsm8k: lm-evaluation-harness's n-shot 'Question: ...\\nAnswer: ...' with train-split exemplars; "
        "gsm8k_cot: 'Q: ... A: ... The answer is N.' with the project's 8 fixed exemplars", default="gsm8k")
    gsm8k_limit: int = _doc("at most this many GSM8K test problems in periodic evaluations (0: all)", default=100)
    gsm8k_final_limit: int = _doc("at most this many GSM8K test problems in the final evaluation (0: all 1,319)",
                                  default=0)
    num_fewshot: int = _doc("worked examples before each GSM8K question (gsm8k_cot: at most 8)", default=5)
    fewshot_seed: int = _doc("seed that picks the few-shot examples from the train split (gsm8k variant)",
                             default=1234)
    gsm8k_max_new_tokens: int = _doc("tokens generated at most per GSM8K answer", default=256)
    batch_size: int = _doc("prompts decoded together on each data-parallel rank", default=16)
    max_length: int = _doc(
        "prompt plus answer limit in tokens; longer prompts keep their end (0: the model's max_position_embeddings)",
        default=0)
    add_special_tokens: bool = _doc(
        "add the tokenizer's special tokens (e.g. BOS) to prompts; off by default because training packs "
        "documents without them", default=False)
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
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 0")
        for name in ("arithmetic_max_new_tokens", "gsm8k_max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        bad_splits = [s for s in self.arithmetic_splits if s not in SPLITS or s == "train"]
        if bad_splits:
            raise ValueError(f"eval.arithmetic_splits has {bad_splits}; use 'interpolation' and/or 'extrapolation'")
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
        if self.gsm8k_variant == "gsm8k_cot" and self.num_fewshot > 8:
            raise ValueError(f"eval.num_fewshot={self.num_fewshot} but gsm8k_cot has 8 exemplars; set at most 8")

    def is_due(self, step: int, *, final: bool = False) -> bool:
        """Whether the training loop should evaluate after `step` (`final`: after the last step)."""
        if final:
            return self.at_end
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0
