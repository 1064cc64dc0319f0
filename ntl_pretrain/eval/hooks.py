"""The evaluation hook the training loop (and tools/evaluate.py) calls: run the benchmarks, log, return metrics.

Every rank calls `run_evaluation` (generation runs collectives). Rank 0 of the world writes
`output_dir/eval/step_<step, 7 digits>.jsonl` (one line per prediction: benchmark, prompt, output,
extracted answer, gold, correct) and logs to TensorBoard:
`eval/arith/<split>/<metric>`, `eval/arith/<split>/<op>/accuracy`, `eval/gsm8k/<filter>/accuracy`,
`eval/generation/tokens_per_s`, `eval/generation/truncated_prompts` (prompts cut to fit the length limit),
`eval/time_s`, and sample generations as text under `eval/samples/...`.
The returned dict (tag -> value) is the same on every rank.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch.distributed as dist

from ntl_pretrain.eval import gsm8k
from ntl_pretrain.eval.arithmetic import generate_problems
from ntl_pretrain.eval.config import EvalConfig
from ntl_pretrain.eval.generate import data_parallel_group, greedy_generate
from ntl_pretrain.eval.metrics import arithmetic_scores, parse_integer_answer
from ntl_pretrain.eval.progress import GenerationProgress
from ntl_pretrain.core.fs import atomic_write

OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "+*": "add_mul", "-*": "sub_mul"}
# Arithmetic answers end at the line or document end; the demo corpus has one problem per document.
ARITHMETIC_STOP = ("\n",)


def _is_writer_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def predictions_path(output_dir: str, step: int) -> str:
    """Where the predictions of the evaluation at `step` go."""
    return os.path.join(output_dir, "eval", f"step_{step:07d}.jsonl")


def _write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    """Write all records or nothing (temporary file, then rename)."""
    with atomic_write(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def _samples_markdown(records: list[dict[str, Any]], count: int) -> str:
    """A few predictions as a markdown table (TensorBoard renders text summaries as markdown)."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "⏎")[-300:]

    lines = ["| prompt (end) | output | extracted | gold |", "|---|---|---|---|"]
    for record in records[:count]:
        lines.append(f"| {cell(record['prompt'])} | {cell(record['output'])} | {cell(record['extracted'])} | "
                     f"{cell(record['gold'])} |")
    return "\n".join(lines)


def _progress(show: bool, label: str, what: str, model: Any, dp_group: Any) -> GenerationProgress | None:
    """A progress reporter on the writer rank when `show` (after a line saying what is evaluated), else None."""
    if not (show and _is_writer_rank()):
        return None
    if dist.is_available() and dist.is_initialized():
        split = dist.get_world_size(data_parallel_group(model, dp_group))
        what += (f"; {dist.get_world_size()} processes, the prompts split over {split} data-parallel rank(s), "
                 f"rank 0's progress shown")
    print(f"eval {label}: {what}", flush=True)
    return GenerationProgress(label)


def check_eval_tokenizer(cfg: EvalConfig, tokenizer: Any) -> None:
    """Refuse settings the tokenizer cannot serve (checked by tools/evaluate.py before the weights load)."""
    if cfg.arithmetic_n > 0 and cfg.arithmetic_splits and cfg.arithmetic_prompt_format == "document" \
            and tokenizer.eos_token_id is None:
        raise ValueError("eval.arithmetic_prompt_format=document puts the EOS token before each prompt, but the "
                         "tokenizer has no EOS token; set eval.arithmetic_prompt_format=plain")


def evaluate_arithmetic(model: Any, tokenizer: Any, cfg: EvalConfig, *, dp_group: Any = None,
                        tp_group: Any = None,
                        show_progress: bool = False) -> tuple[dict[str, float], list[dict[str, Any]], int, float, int]:
    """Arithmetic metrics per split (and accuracy per op), prediction records, tokens generated, seconds,
    truncated prompts."""
    problems = []
    for split in cfg.arithmetic_splits:
        for problem in generate_problems(split, cfg.arithmetic_n, cfg.arithmetic_seed, ops=tuple(cfg.arithmetic_ops),
                                         train_digits=tuple(cfg.arithmetic_train_digits),
                                         extrapolation_digits=tuple(cfg.arithmetic_extrapolation_digits)):
            problems.append((split, problem))
    if not problems:
        return {}, [], 0, 0.0, 0
    # Packed training puts every document right after the previous one's EOS and adds no special tokens
    # (data.sources), so "document" prompts are encoded that way: the model sees what it was trained on.
    as_document = cfg.arithmetic_prompt_format == "document"
    check_eval_tokenizer(cfg, tokenizer)
    progress = _progress(show_progress, "arith", f"{len(problems)} problems ({', '.join(cfg.arithmetic_splits)}), "
                         f"batch size {cfg.batch_size}, up to {cfg.arithmetic_max_new_tokens} new tokens each", model,
                         dp_group)
    generation = greedy_generate(model, tokenizer, [p.prompt for _, p in problems],
                                 max_new_tokens=cfg.arithmetic_max_new_tokens, stop=ARITHMETIC_STOP,
                                 batch_size=cfg.batch_size, max_length=cfg.max_length,
                                 add_special_tokens=False if as_document else cfg.add_special_tokens,
                                 prefix_ids=[tokenizer.eos_token_id] if as_document else (),
                                 dp_group=dp_group, tp_group=tp_group, progress=progress)
    records = []
    for (split, problem), output in zip(problems, generation.texts):
        prediction = parse_integer_answer(output)
        records.append({"benchmark": "arith", "split": split, "op": problem.op, "prompt": problem.prompt,
                        "output": output, "extracted": prediction, "gold": problem.answer,
                        "correct": prediction == problem.answer})
    metrics: dict[str, float] = {}
    for split in cfg.arithmetic_splits:
        split_records = [r for r in records if r["split"] == split]
        scores = arithmetic_scores([r["extracted"] for r in split_records], [r["gold"] for r in split_records])
        metrics.update({f"eval/arith/{split}/{name}": value for name, value in scores.items()})
        for op in cfg.arithmetic_ops:
            op_records = [r for r in split_records if r["op"] == op]
            metrics[f"eval/arith/{split}/{OP_NAMES[op]}/accuracy"] = (
                sum(r["correct"] for r in op_records) / len(op_records) if op_records else 0.0)
    return metrics, records, generation.new_tokens, generation.seconds, generation.truncated_prompts


def evaluate_gsm8k(model: Any, tokenizer: Any, cfg: EvalConfig, *, final: bool = False, dp_group: Any = None,
                   tp_group: Any = None,
                   show_progress: bool = False) -> tuple[dict[str, float], list[dict[str, Any]], int, float, int]:
    """GSM8K accuracy per filter, prediction records, tokens generated, seconds, truncated prompts."""
    shots = gsm8k.default_num_fewshot(cfg.gsm8k_variant, cfg.num_fewshot)
    test_rows = gsm8k.load_gsm8k(cfg.gsm8k_path, "test", cfg.gsm8k_dataset_config)
    train_rows = (gsm8k.load_gsm8k(cfg.gsm8k_path, "train", cfg.gsm8k_dataset_config)
                  if cfg.gsm8k_variant == "gsm8k" and shots > 0 else [])
    items = gsm8k.build_prompts(test_rows, train_rows, variant=cfg.gsm8k_variant, num_fewshot=shots,
                                fewshot_seed=cfg.fewshot_seed, fewshot_sampler=cfg.fewshot_sampler,
                                cot_exemplars=cfg.gsm8k_cot_exemplars,
                                limit=cfg.gsm8k_final_limit if final else cfg.gsm8k_limit)
    progress = _progress(show_progress, "gsm8k", f"{len(items)} problems ({cfg.gsm8k_variant}, {shots}-shot), "
                         f"batch size {cfg.batch_size}, up to {cfg.gsm8k_max_new_tokens} new tokens each", model,
                         dp_group)
    generation = greedy_generate(model, tokenizer, [item.prompt for item in items],
                                 max_new_tokens=cfg.gsm8k_max_new_tokens, stop=gsm8k.STOP_STRINGS[cfg.gsm8k_variant],
                                 batch_size=cfg.batch_size, max_length=cfg.max_length,
                                 add_special_tokens=cfg.add_special_tokens, dp_group=dp_group,
                                 tp_group=tp_group, progress=progress)
    accuracy, details = gsm8k.score(generation.texts, [item.gold for item in items], cfg.gsm8k_variant)
    records = [{"benchmark": "gsm8k", "index": item.index, "prompt": item.prompt, "output": output,
                "extracted": detail["extracted"], "gold": item.gold, "correct": detail["correct"]}
               for item, output, detail in zip(items, generation.texts, details)]
    metrics = {f"eval/gsm8k/{name}/accuracy": value for name, value in accuracy.items()}
    metrics["eval/gsm8k/n"] = float(len(items))
    return metrics, records, generation.new_tokens, generation.seconds, generation.truncated_prompts


def run_evaluation(model_engine_or_module: Any, tokenizer: Any, cfg: EvalConfig, *, step: int, output_dir: str,
                   writer: Any = None, tp_group: Any = None, dp_group: Any = None,
                   final: bool = False, show_progress: bool = False) -> dict[str, float]:
    """Run the configured benchmarks on every rank; rank 0 writes predictions and TensorBoard logs.

    `final` selects `cfg.gsm8k_final_limit` (the full test set by default) instead of `cfg.gsm8k_limit`.
    `show_progress`: rank 0 prints what each benchmark evaluates and its generation's progress
    (`eval.progress.GenerationProgress`; tools/evaluate.py).
    Returns {tag: value}, identical on every rank.
    """
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    records: list[dict[str, Any]] = []
    tokens, generation_seconds, truncated = 0, 0.0, 0
    benchmarks = []
    if cfg.arithmetic_n > 0 and cfg.arithmetic_splits:
        benchmarks.append(lambda: evaluate_arithmetic(model_engine_or_module, tokenizer, cfg, dp_group=dp_group,
                                                      tp_group=tp_group, show_progress=show_progress))
    if cfg.gsm8k_path:
        benchmarks.append(lambda: evaluate_gsm8k(model_engine_or_module, tokenizer, cfg, final=final,
                                                 dp_group=dp_group, tp_group=tp_group, show_progress=show_progress))
    for benchmark in benchmarks:
        bench_metrics, bench_records, bench_tokens, bench_seconds, bench_truncated = benchmark()
        metrics.update(bench_metrics)
        records += bench_records
        tokens, generation_seconds = tokens + bench_tokens, generation_seconds + bench_seconds
        truncated += bench_truncated
    metrics["eval/generation/tokens_per_s"] = tokens / generation_seconds if generation_seconds > 0 else 0.0
    metrics["eval/generation/tokens"] = float(tokens)
    metrics["eval/generation/truncated_prompts"] = float(truncated)
    if _is_writer_rank():
        _write_jsonl(predictions_path(output_dir, step), records)
    metrics["eval/time_s"] = time.perf_counter() - started
    if dist.is_available() and dist.is_initialized():
        # Wall times differ slightly per rank; everyone reports rank 0's so the dict is the same everywhere.
        shared = [metrics["eval/time_s"]]
        dist.broadcast_object_list(shared, src=0)
        metrics["eval/time_s"] = shared[0]
    if writer is not None and _is_writer_rank():
        for tag, value in metrics.items():
            if not math.isnan(value):
                writer.add_scalar(tag, value, step)
        for benchmark in ("arith", "gsm8k"):
            benchmark_records = [r for r in records if r["benchmark"] == benchmark]
            if benchmark_records and cfg.samples_to_log > 0:
                writer.add_text(f"eval/samples/{benchmark}", _samples_markdown(benchmark_records, cfg.samples_to_log),
                                step)
        writer.flush()
    return metrics
