"""The evaluation hook the training loop (and tools/evaluate.py) calls: run the benchmarks, log, return metrics.

Every rank calls `run_evaluation` (generation runs collectives). It runs every benchmark of the registry
(`ntl_pretrain.eval.benchmarks.BENCHMARKS`) that the settings enable, in order. Rank 0 of the world writes
`output_dir/eval/step_<step, 7 digits>.jsonl` (one line per prediction: benchmark, prompt, output,
extracted answer, gold, correct) and logs to TensorBoard each benchmark's tags `eval/<name>/...`
(`eval/arith/<split>/<metric>`, `eval/arith/<split>/<op>/accuracy`, `eval/gsm8k/<filter>/accuracy`),
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

from ntl_pretrain.eval.benchmarks import EvalContext
from ntl_pretrain.eval.benchmarks.base import is_writer_rank
from ntl_pretrain.eval.config import EvalConfig
from ntl_pretrain.core.fs import atomic_write


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


def check_eval_tokenizer(cfg: EvalConfig, tokenizer: Any) -> None:
    """Refuse settings the tokenizer cannot serve (each benchmark's `check_tokenizer`; tools/evaluate.py calls
    this before the weights load)."""
    for benchmark, settings in cfg.enabled_benchmarks():
        benchmark.check_tokenizer(settings, tokenizer)


def run_evaluation(model_engine_or_module: Any, tokenizer: Any, cfg: EvalConfig, *, step: int, output_dir: str,
                   writer: Any = None, tp_group: Any = None, dp_group: Any = None,
                   final: bool = False, show_progress: bool = False, document_mask: bool = False) -> dict[str, float]:
    """Run the configured benchmarks on every rank; rank 0 writes predictions and TensorBoard logs.

    `document_mask`: the model was trained with attention inside each packed document (data.document_mask), so a
    prompt presented as a document starts alone, not after an EOS (`EvalContext.document_mask`).

    `final`: the evaluation after the last step (GSM8K then asks `cfg.gsm8k_final_limit` questions, the full test
    set by default, instead of `cfg.gsm8k_limit`).
    `show_progress`: rank 0 prints what each benchmark evaluates and its generation's progress
    (`eval.progress.GenerationProgress`; tools/evaluate.py).
    Returns {tag: value}, identical on every rank.
    """
    started = time.perf_counter()
    check_eval_tokenizer(cfg, tokenizer)
    context = EvalContext(batch_size=cfg.batch_size, max_length=cfg.max_length,
                          add_special_tokens=cfg.add_special_tokens, final=final, dp_group=dp_group,
                          tp_group=tp_group, show_progress=show_progress, document_mask=document_mask)
    metrics: dict[str, float] = {}
    records: list[dict[str, Any]] = []
    tokens, generation_seconds, truncated = 0, 0.0, 0
    for benchmark, settings in cfg.enabled_benchmarks():
        result = benchmark.run(model_engine_or_module, tokenizer, settings, context)
        metrics.update(result.metrics)
        records += result.records
        if result.generation is not None:
            tokens += result.generation.new_tokens
            generation_seconds += result.generation.seconds
            truncated += result.generation.truncated_prompts
    metrics["eval/generation/tokens_per_s"] = tokens / generation_seconds if generation_seconds > 0 else 0.0
    metrics["eval/generation/tokens"] = float(tokens)
    metrics["eval/generation/truncated_prompts"] = float(truncated)
    if is_writer_rank():
        _write_jsonl(predictions_path(output_dir, step), records)
    metrics["eval/time_s"] = time.perf_counter() - started
    if dist.is_available() and dist.is_initialized():
        # Wall times differ slightly per rank; everyone reports rank 0's so the dict is the same everywhere.
        shared = [metrics["eval/time_s"]]
        dist.broadcast_object_list(shared, src=0)
        metrics["eval/time_s"] = shared[0]
    if writer is not None and is_writer_rank():
        for tag, value in metrics.items():
            if math.isfinite(value):  # NaN (nothing parseable) and inf (beyond float) are not plotted
                writer.add_scalar(tag, value, step)
        for benchmark in cfg.benchmarks:
            benchmark_records = [r for r in records if r["benchmark"] == benchmark.name]
            if benchmark_records and cfg.samples_to_log > 0:
                writer.add_text(f"eval/samples/{benchmark.name}",
                                _samples_markdown(benchmark_records, cfg.samples_to_log), step)
        writer.flush()
    return metrics
