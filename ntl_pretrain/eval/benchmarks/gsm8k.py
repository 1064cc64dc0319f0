"""The GSM8K benchmark ("gsm8k"), run as lm-evaluation-harness runs its gsm8k and gsm8k_cot tasks: prompts, data
and answer filters are `ntl_pretrain.eval.gsm8k`'s."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from ntl_pretrain.eval import gsm8k
from ntl_pretrain.eval.benchmarks.base import (Benchmark, BenchmarkResult, EvalContext, InputChecks, check_at_least,
                                               setting)
from ntl_pretrain.eval.gsm8k import FEWSHOT_SAMPLERS, FewshotSampler, GSM8KVariant

GSM8K_VARIANTS: tuple[str, ...] = typing.get_args(GSM8KVariant)


@dataclass
class Gsm8kSettings:
    """The GSM8K benchmark's eval.* keys."""

    gsm8k_path: str = setting(
        "GSM8K source: a local folder with test.jsonl/train.jsonl, a test .jsonl file, or a datasets id such "
        "as openai/gsm8k; empty skips GSM8K", default="")
    gsm8k_dataset_config: str = setting("configuration name when gsm8k_path is a datasets hub id", default="main")
    gsm8k_variant: GSM8KVariant = setting(
        "gsm8k: lm-evaluation-harness's gsm8k task ('Question: ...\\nAnswer: ...', train-split exemplars); "
        "gsm8k_cot: its gsm8k_cot task ('Q: ... A: ... The answer is N.', 8 fixed exemplars)", default="gsm8k")
    gsm8k_limit: int = setting("at most this many GSM8K test problems in periodic evaluations (0: all)", default=100)
    gsm8k_final_limit: int = setting("at most this many GSM8K test problems in the final evaluation (0: all 1,319)",
                                     default=0)
    num_fewshot: int | None = setting(
        "worked examples before each GSM8K question (null: the harness's default, gsm8k 5, gsm8k_cot 8)",
        default=None)
    fewshot_seed: int = setting("seed that picks the few-shot examples from the train split (gsm8k variant; the "
                                "harness's fewshot_random_seed is 1234)", default=1234)
    fewshot_sampler: FewshotSampler = setting(
        "lm_eval: one generator draws every question's exemplars in test order, as lm-evaluation-harness does "
        "in one process (prompts equal its prompts); per_question: a generator per question index", default="lm_eval")
    gsm8k_cot_exemplars: str = setting(
        "gsm8k_cot exemplars: lm_eval (read from the installed lm-eval, extra [lmeval]), project (this project's "
        "own 8, not comparable to published numbers), or a YAML/JSON file of {question, target}", default="lm_eval")
    gsm8k_max_new_tokens: int = setting("tokens generated at most per GSM8K answer", default=256)

    def __post_init__(self) -> None:
        check_at_least(self, 0, "gsm8k_limit", "gsm8k_final_limit", "num_fewshot")
        check_at_least(self, 1, "gsm8k_max_new_tokens")
        if self.gsm8k_variant not in GSM8K_VARIANTS:
            raise ValueError(f"eval.gsm8k_variant={self.gsm8k_variant!r} must be one of {GSM8K_VARIANTS}")
        if self.fewshot_sampler not in FEWSHOT_SAMPLERS:
            raise ValueError(f"eval.fewshot_sampler={self.fewshot_sampler!r} must be one of {FEWSHOT_SAMPLERS}")
        if not self.gsm8k_cot_exemplars:
            raise ValueError("eval.gsm8k_cot_exemplars is empty; use lm_eval, project or a YAML/JSON file")

    @property
    def shots(self) -> int:
        """Worked examples per question: num_fewshot, or the harness's default for the variant."""
        return gsm8k.default_num_fewshot(self.gsm8k_variant, self.num_fewshot)

    @property
    def needs_train_split(self) -> bool:
        """Whether the prompts draw exemplars from the train split (the gsm8k variant with shots)."""
        return self.gsm8k_variant == "gsm8k" and self.shots > 0


class Gsm8kBenchmark(Benchmark):
    """Accuracy per answer filter `eval/gsm8k/<filter>/accuracy`, and the questions asked `eval/gsm8k/n`."""

    name = "gsm8k"
    Settings = Gsm8kSettings
    max_new_tokens_key = "gsm8k_max_new_tokens"

    def enabled(self, settings: Gsm8kSettings) -> bool:
        return bool(settings.gsm8k_path)

    def check_inputs(self, settings: Gsm8kSettings, inputs: InputChecks) -> list[str]:
        """Every line of the GSM8K files (hub data with `read_hub`), one prompt built, the CoT exemplars."""
        checked: list[str] = []
        rows = {}
        for split in ["test"] + (["train"] if settings.needs_train_split else []):
            local = gsm8k.local_split_file(settings.gsm8k_path, split)
            if local is None and not inputs.read_hub:
                continue
            rows[split] = gsm8k.load_gsm8k(settings.gsm8k_path, split, settings.gsm8k_dataset_config)
            checked.append(f"GSM8K {split}: {local or settings.gsm8k_path} ({len(rows[split])} rows)")
        if "test" in rows:
            gsm8k.build_prompts(rows["test"][:1], rows.get("train", []), variant=settings.gsm8k_variant,
                                num_fewshot=settings.shots, fewshot_seed=settings.fewshot_seed,
                                fewshot_sampler=settings.fewshot_sampler, cot_exemplars=settings.gsm8k_cot_exemplars)
        if settings.gsm8k_variant == "gsm8k_cot" and settings.shots > 0:
            exemplars = gsm8k.load_cot_exemplars(settings.gsm8k_cot_exemplars)
            if settings.shots > len(exemplars):
                raise ValueError(f"eval.num_fewshot={settings.shots} but the gsm8k_cot exemplars "
                                 f"({settings.gsm8k_cot_exemplars}) number {len(exemplars)}; set eval.num_fewshot to "
                                 f"at most {len(exemplars)}")
            checked.append(f"gsm8k_cot exemplars: {settings.gsm8k_cot_exemplars} ({len(exemplars)})")
        return checked

    def run(self, model: Any, tokenizer: Any, settings: Gsm8kSettings, context: EvalContext) -> BenchmarkResult:
        test_rows = gsm8k.load_gsm8k(settings.gsm8k_path, "test", settings.gsm8k_dataset_config)
        train_rows = (gsm8k.load_gsm8k(settings.gsm8k_path, "train", settings.gsm8k_dataset_config)
                      if settings.needs_train_split else [])
        items = gsm8k.build_prompts(test_rows, train_rows, variant=settings.gsm8k_variant, num_fewshot=settings.shots,
                                    fewshot_seed=settings.fewshot_seed, fewshot_sampler=settings.fewshot_sampler,
                                    cot_exemplars=settings.gsm8k_cot_exemplars,
                                    limit=settings.gsm8k_final_limit if context.final else settings.gsm8k_limit)
        generation = context.generate(
            model, tokenizer, [item.prompt for item in items], label=self.name,
            what=f"{len(items)} problems ({settings.gsm8k_variant}, {settings.shots}-shot), batch size "
                 f"{context.batch_size}, up to {settings.gsm8k_max_new_tokens} new tokens each",
            max_new_tokens=settings.gsm8k_max_new_tokens, stop=gsm8k.STOP_STRINGS[settings.gsm8k_variant],
            add_special_tokens=context.add_special_tokens)
        accuracy, details = gsm8k.score(generation.texts, [item.gold for item in items], settings.gsm8k_variant)
        records = [{"benchmark": self.name, "index": item.index, "prompt": item.prompt, "output": output,
                    "extracted": detail["extracted"], "gold": item.gold, "correct": detail["correct"]}
                   for item, output, detail in zip(items, generation.texts, details)]
        metrics = {f"eval/{self.name}/{name}/accuracy": value for name, value in accuracy.items()}
        metrics[f"eval/{self.name}/n"] = float(len(items))
        return BenchmarkResult(metrics, records, generation)


GSM8K = Gsm8kBenchmark()
