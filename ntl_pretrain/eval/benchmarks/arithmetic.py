"""The arithmetic benchmark ("arith"): held-out problems the project generates (`ntl_pretrain.eval.arithmetic`),
scored by exact match, MAE, sMAPE, share parseable and digit accuracy (`ntl_pretrain.eval.metrics`), per split
and per operation."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from ntl_pretrain.eval.arithmetic import ALL_OPS, SPLITS, generate_problems, held_out_problems_in
from ntl_pretrain.eval.benchmarks.base import (Benchmark, BenchmarkResult, EvalContext, InputChecks, check_at_least,
                                               setting)
from ntl_pretrain.eval.metrics import arithmetic_scores, parse_integer_answer

# How arithmetic prompts are encoded (eval.arithmetic_prompt_format).
ArithmeticPromptFormat = typing.Literal["document", "plain"]
ARITHMETIC_PROMPT_FORMATS: tuple[str, ...] = typing.get_args(ArithmeticPromptFormat)
OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "+*": "add_mul", "-*": "sub_mul"}
# Arithmetic answers end at the line or document end; the demo corpus has one problem per document.
ARITHMETIC_STOP = ("\n",)


@dataclass
class ArithmeticSettings:
    """The arithmetic benchmark's eval.* keys."""

    arithmetic_n: int = setting("arithmetic problems per split (0: skip the arithmetic benchmark)", default=200)
    arithmetic_splits: list[str] = setting(
        "held-out arithmetic splits: interpolation (training operand lengths) and/or extrapolation (longer)",
        default_factory=lambda: ["interpolation", "extrapolation"])
    arithmetic_ops: list[str] = setting(
        "operations: +, -, * and the mixed expressions +* (a+b*c) and -* (a-b*c)",
        default_factory=lambda: ["+", "-", "*"])
    arithmetic_train_digits: list[int] = setting(
        "[min, max] operand digits of the training corpus and the interpolation split",
        default_factory=lambda: [1, 4])
    arithmetic_extrapolation_digits: list[int] = setting(
        "[min, max] operand digits of the extrapolation split (longer than any in training)",
        default_factory=lambda: [5, 6])
    arithmetic_seed: int = setting("seed of the arithmetic problems (same seed, same benchmark)", default=1234)
    arithmetic_max_new_tokens: int = setting("tokens generated at most per arithmetic answer", default=16)
    arithmetic_prompt_format: ArithmeticPromptFormat = setting(
        "document: each prompt as the training stream presents a document, without the tokenizer's special tokens "
        "and after the EOS that ends the one before it (not with data.document_mask: a document then starts "
        "alone); plain: the prompt alone, encoded as add_special_tokens says", default="document")

    def __post_init__(self) -> None:
        self.arithmetic_splits = list(self.arithmetic_splits)
        self.arithmetic_ops = list(self.arithmetic_ops)
        self.arithmetic_train_digits = [int(d) for d in self.arithmetic_train_digits]
        self.arithmetic_extrapolation_digits = [int(d) for d in self.arithmetic_extrapolation_digits]
        check_at_least(self, 0, "arithmetic_n")
        check_at_least(self, 1, "arithmetic_max_new_tokens")
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
        if self.arithmetic_prompt_format not in ARITHMETIC_PROMPT_FORMATS:
            raise ValueError(f"eval.arithmetic_prompt_format={self.arithmetic_prompt_format!r} must be one of "
                             f"{ARITHMETIC_PROMPT_FORMATS}")


class ArithmeticBenchmark(Benchmark):
    """Metrics per split `eval/arith/<split>/<metric>` and accuracy per operation `eval/arith/<split>/<op>/accuracy`."""

    name = "arith"
    Settings = ArithmeticSettings
    max_new_tokens_key = "arithmetic_max_new_tokens"

    def enabled(self, settings: ArithmeticSettings) -> bool:
        return settings.arithmetic_n > 0 and bool(settings.arithmetic_splits)

    def check_tokenizer(self, settings: ArithmeticSettings, tokenizer: Any) -> None:
        if settings.arithmetic_prompt_format == "document" and tokenizer.eos_token_id is None:
            raise ValueError("eval.arithmetic_prompt_format=document puts the EOS token before each prompt, but the "
                             "tokenizer has no EOS token; set eval.arithmetic_prompt_format=plain")

    def check_inputs(self, settings: ArithmeticSettings, inputs: InputChecks) -> list[str]:
        """A corpus the run generates must hold no interpolation problem (else it would be trained on)."""
        checked = []
        if "interpolation" in settings.arithmetic_splits:
            for where, path in inputs.generated_corpora:
                count, example = held_out_problems_in(path)
                if count:
                    raise ValueError(
                        f"{path} ({where}) holds {count} problems of the interpolation split (e.g. {example!r}), so "
                        f"they would be trained on: it was generated before the split used canonical forms (or by "
                        f"hand); delete it and it is generated again")
                checked.append(f"generated corpus {path}: no interpolation problem")
        return checked

    def run(self, model: Any, tokenizer: Any, settings: ArithmeticSettings, context: EvalContext) -> BenchmarkResult:
        problems = []
        for split in settings.arithmetic_splits:
            for problem in generate_problems(split, settings.arithmetic_n, settings.arithmetic_seed,
                                             ops=tuple(settings.arithmetic_ops),
                                             train_digits=tuple(settings.arithmetic_train_digits),
                                             extrapolation_digits=tuple(settings.arithmetic_extrapolation_digits)):
                problems.append((split, problem))
        # Packed training puts every document right after the previous one's EOS and adds no special tokens
        # (data.sources), so "document" prompts are encoded that way: the model sees what it was trained on. With
        # attention inside documents (data.document_mask) a document never sees that EOS: the prompt starts alone.
        as_document = settings.arithmetic_prompt_format == "document"
        after_eos = as_document and not context.document_mask
        generation = context.generate(
            model, tokenizer, [p.prompt for _, p in problems], label=self.name,
            what=f"{len(problems)} problems ({', '.join(settings.arithmetic_splits)}), batch size {context.batch_size}, "
                 f"up to {settings.arithmetic_max_new_tokens} new tokens each",
            max_new_tokens=settings.arithmetic_max_new_tokens, stop=ARITHMETIC_STOP,
            add_special_tokens=False if as_document else context.add_special_tokens,
            prefix_ids=[tokenizer.eos_token_id] if after_eos else ())
        records = []
        for (split, problem), output in zip(problems, generation.texts):
            prediction = parse_integer_answer(output)
            records.append({"benchmark": self.name, "split": split, "op": problem.op, "prompt": problem.prompt,
                            "output": output, "extracted": prediction, "gold": problem.answer,
                            "correct": prediction == problem.answer})
        metrics: dict[str, float] = {}
        for split in settings.arithmetic_splits:
            split_records = [r for r in records if r["split"] == split]
            scores = arithmetic_scores([r["extracted"] for r in split_records], [r["gold"] for r in split_records])
            metrics.update({f"eval/{self.name}/{split}/{name}": value for name, value in scores.items()})
            for op in settings.arithmetic_ops:
                op_records = [r for r in split_records if r["op"] == op]
                metrics[f"eval/{self.name}/{split}/{OP_NAMES[op]}/accuracy"] = (
                    sum(r["correct"] for r in op_records) / len(op_records) if op_records else 0.0)
        return BenchmarkResult(metrics, records, generation)


ARITHMETIC = ArithmeticBenchmark()
