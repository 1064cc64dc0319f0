"""lm-evaluation-harness tasks ("lm_eval"): any task lm-eval knows (or a local task YAML under
eval.lm_eval_include_path), run by lm-eval itself on the sharded model (`eval.lm_eval_model.ShardedLM`).

lm-eval (the optional extra [lmeval]) is imported only when tasks are named. Its metrics are logged as
`eval/lm_eval/<task>/<metric>` (`eval/lm_eval/<task>/<filter>/<metric>` for a filter other than "none"). lm-eval's
global seeds are left alone (the training run's random state is not touched); the few-shot draw uses lm-eval's
default seed 1234, and no bootstrap standard error is computed (it starts a process pool).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ntl_pretrain.eval.benchmarks.base import (Benchmark, BenchmarkResult, EvalContext, InputChecks, check_at_least,
                                               is_writer_rank, setting)

# lm-eval's fewshot_random_seed default (simple_evaluate's)
FEWSHOT_SEED = 1234
# lm-eval's TaskManager per (include path, whether lm-eval's own tasks are indexed): built once per process
_TASK_MANAGERS: dict[tuple[str | None, bool], Any] = {}


@dataclass
class LmEvalSettings:
    """The lm-evaluation-harness benchmark's eval.* keys."""

    lm_eval_tasks: list[str] = setting(
        "lm-evaluation-harness tasks (or groups) to run on the sharded model, e.g. [hellaswag, wikitext]; a task "
        "YAML under lm_eval_include_path counts too; empty: skip", default_factory=list)
    lm_eval_include_path: str = setting(
        "a folder of local lm-eval task YAMLs (searched before lm-eval's own tasks); empty: lm-eval's only",
        default="")
    lm_eval_limit: int | None = setting("at most this many documents per task (null: all)", default=None)
    lm_eval_num_fewshot: int | None = setting(
        "few-shot examples per prompt (null: each task's own; a task that sets 0 keeps 0, as lm-eval does)",
        default=None)
    lm_eval_max_gen_toks: int = setting(
        "tokens generated at most for generation requests whose task names no max_gen_toks (lm-eval's 256)",
        default=256)

    def __post_init__(self) -> None:
        self.lm_eval_tasks = [str(task) for task in self.lm_eval_tasks]
        check_at_least(self, 1, "lm_eval_limit", "lm_eval_max_gen_toks")
        check_at_least(self, 0, "lm_eval_num_fewshot")
        empty = [task for task in self.lm_eval_tasks if not task.strip()]
        if empty or len(set(self.lm_eval_tasks)) != len(self.lm_eval_tasks):
            raise ValueError(f"eval.lm_eval_tasks={self.lm_eval_tasks} holds an empty or repeated name; name each "
                             f"task once")


def task_manager(settings: LmEvalSettings) -> Any:
    """lm-eval's TaskManager for these settings, built once per process: the include path alone when it holds
    every named task (indexing lm-eval's 14,000 task names takes 10 s of CPU), else lm-eval's tasks too."""
    from lm_eval.tasks import TaskManager

    include = settings.lm_eval_include_path or None
    for defaults in ((False, True) if include else (True,)):
        key = (include, defaults)
        if key not in _TASK_MANAGERS:
            _TASK_MANAGERS[key] = TaskManager(include_path=include, include_defaults=defaults)
        manager = _TASK_MANAGERS[key]
        if defaults or not _unknown_tasks(manager, settings.lm_eval_tasks):
            return manager
    raise AssertionError("unreachable: the last manager includes lm-eval's tasks")


def _unknown_tasks(manager: Any, tasks: list[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [task for task in tasks if task not in known]


def check_tasks(settings: LmEvalSettings) -> Any:
    """The TaskManager that knows every named task; ValueError naming the unknown ones and the nearest names."""
    import difflib
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"eval.lm_eval_tasks={settings.lm_eval_tasks} needs lm-evaluation-harness, which is not "
                         f"installed: pip install -e '.[lmeval]'")
    manager = task_manager(settings)
    unknown = _unknown_tasks(manager, settings.lm_eval_tasks)
    if unknown:
        hints = {task: difflib.get_close_matches(task, manager.all_tasks, n=1) for task in unknown}
        named = ", ".join(f"{task!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "") for task, hint in hints.items())
        where = f"{settings.lm_eval_include_path} nor " if settings.lm_eval_include_path else ""
        raise ValueError(f"eval.lm_eval_tasks names {named}, which neither {where}lm-eval {_lm_eval_version()} "
                         f"knows; fix the name or set eval.lm_eval_include_path to the folder of its task YAML")
    return manager


def _lm_eval_version() -> str:
    import lm_eval

    return getattr(lm_eval, "__version__", "?")


def load_tasks(settings: LmEvalSettings) -> dict[str, Any]:
    """lm-eval's loaded tasks ({"tasks", "groups", ...}) with the few-shot settings lm-eval's simple_evaluate
    applies: eval.lm_eval_num_fewshot over each task's own (except a task that sets 0), 0 where neither says,
    and the few-shot seed."""
    loaded = check_tasks(settings).load(list(settings.lm_eval_tasks))
    for task in loaded["tasks"].values():
        own = task.get_config("num_fewshot")
        if settings.lm_eval_num_fewshot is not None and own != 0:
            task.set_config(key="num_fewshot", value=settings.lm_eval_num_fewshot)
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return loaded


def metric_tags(results: dict[str, Any], prefix: str) -> dict[str, float]:
    """lm-eval's results ({task: {"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...}}) as tags
    `<prefix>/<task>/<metric>` (`<prefix>/<task>/<filter>/<metric>` for a filter other than "none"); only numbers."""
    tags = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # alias, sample counts without a filter, "N/A" standard errors
            where = metric if filter_name == "none" else f"{filter_name}/{metric}"
            tags[f"{prefix}/{task}/{where}"] = float(value)
    return tags


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str, ensure_ascii=False))


class LmEvalBenchmark(Benchmark):
    """Every metric lm-eval reports for each task: `eval/lm_eval/<task>/<metric>`."""

    name = "lm_eval"
    Settings = LmEvalSettings
    max_new_tokens_key = "lm_eval_max_gen_toks"

    def enabled(self, settings: LmEvalSettings) -> bool:
        return bool(settings.lm_eval_tasks)

    def check_inputs(self, settings: LmEvalSettings, inputs: InputChecks) -> list[str]:
        """Every named task is one lm-eval knows (or one in the include path): an unknown one fails here, before
        training, in one line."""
        check_tasks(settings)
        return [f"lm-eval tasks: {', '.join(settings.lm_eval_tasks)} (lm-eval {_lm_eval_version()})"]

    def run(self, model: Any, tokenizer: Any, settings: LmEvalSettings, context: EvalContext) -> BenchmarkResult:
        from lm_eval.evaluator import evaluate

        from ntl_pretrain.eval.lm_eval_model import ShardedLM

        lm = ShardedLM(model, tokenizer, batch_size=context.batch_size, max_length=context.max_length,
                       max_gen_toks=settings.lm_eval_max_gen_toks, add_bos_token=context.add_special_tokens,
                       dp_group=context.dp_group, tp_group=context.tp_group)
        if context.show_progress and is_writer_rank():
            print(f"eval {self.name}: tasks {', '.join(settings.lm_eval_tasks)}, limit {settings.lm_eval_limit}, "
                  f"batch size {context.batch_size}", flush=True)
        # lm-eval's per-task INFO lines would fill the training log at every evaluation; its warnings still show
        harness_logger = logging.getLogger("lm_eval")
        level = harness_logger.level
        if not context.show_progress:
            harness_logger.setLevel(max(level, logging.WARNING))
        try:
            results = evaluate(lm=lm, task_dict=load_tasks(settings), limit=settings.lm_eval_limit,
                               bootstrap_iters=0, log_samples=True)
        finally:
            harness_logger.setLevel(level)
        metrics = metric_tags(results["results"], f"eval/{self.name}")
        records = []
        for task, samples in results.get("samples", {}).items():
            for sample in samples:
                records.append(_json_safe({
                    "benchmark": self.name, "task": task, "index": sample["doc_id"], "filter": sample["filter"],
                    "prompt": sample["arguments"][0][0], "output": sample["resps"],
                    "extracted": sample["filtered_resps"], "gold": sample["target"],
                    "metrics": {metric: sample.get(metric) for metric in sample["metrics"]}}))
        return BenchmarkResult(metrics, records)


LM_EVAL = LmEvalBenchmark()
