"""Evaluate a model on the project's benchmarks (the registry ntl_pretrain.eval.benchmarks.BENCHMARKS: arithmetic,
GSM8K): an exported HF folder or a training checkpoint.

One process (plain PyTorch), on the export a training run writes at its end (train.output_dir/hf_export):
    python tools/evaluate.py --model runs/demo/hf_export gsm8k_path=../shared/data/gsm8k
Several ranks (DeepSpeed ZeRO-3, optionally AutoTP with a vocabulary-parallel head; on CPU add
DS_ACCELERATOR=cpu):
    deepspeed --num_gpus 2 tools/evaluate.py --model DIR --tp 2 arithmetic_n=500
A training run's checkpoint (its config.yaml rebuilds tokenizer and model, and the checkpoint is checked and
loaded as a resume of the run would; launch the same number of processes as the training run):
    deepspeed --num_gpus 2 tools/evaluate.py --run runs/demo [--tag global_step150]

Settings: with --run, the run's `eval` section (its config.yaml); with --model, the training run's settings
saved beside the weights (ntl_eval.json, written into every checkpoint and so into its export) when the
folder has them (--default-settings ignores them), else the defaults. Trailing `key=value` arguments
override them (ntl_pretrain.eval.EvalConfig keys, with or without the `eval.` prefix; values are YAML).
The tool prints which settings it used, what it loads and how long that took, what each benchmark evaluates and
its progress (rank 0's batches: a tqdm bar on a terminal, else about ten lines a benchmark and a line a minute
while one batch is still generating). It runs the "final" evaluation (GSM8K: gsm8k_final_limit,
0 = all). Rank 0 prints a table, writes every prediction to OUTPUT_DIR/eval/step_<step, 7 digits>.jsonl
and the metrics to --json (default OUTPUT_DIR/eval_results_step_<step, 7 digits>.json). OUTPUT_DIR:
--output-dir; else the run folder (--run); else MODEL_eval beside a local model folder (runs/demo/hf_export
-> runs/demo/hf_export_eval), or runs/eval/<org>--<name> for a hub id.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import textwrap
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow  # noqa: E402

skip_autotuner_mlflow()  # an entry point: before anything imports DeepSpeed (core/deepspeed_imports.py)

from ntl_pretrain.config.parsing import parse_override  # noqa: E402
from ntl_pretrain.core.fs import STANDARD_STREAMS  # noqa: E402
from ntl_pretrain.eval.config import (EVAL_SETTINGS_FILE, EvalConfig, SharedSettings,  # noqa: E402
                                      eval_config_from_dict, load_eval_settings, trained_document_mask,
                                      validate_eval_inputs)


def settings_help() -> str:
    """The key=value settings by benchmark, from the registry (--help's epilog)."""
    groups = [(benchmark.name, benchmark.Settings) for benchmark in EvalConfig.benchmarks]
    groups.append(("every benchmark", SharedSettings))
    lines = ["settings (key=value) by benchmark; docs/evaluation.md and `launch/pretrain.sh --help` (eval.*) "
             "say what each means:"]
    for label, settings in groups:
        keys = ", ".join(f.name for f in dataclasses.fields(settings))
        lines.append(textwrap.fill(f"{label}: {keys}", width=110, initial_indent="  ", subsequent_indent="    "))
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, epilog=settings_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="exported Hugging Face model folder (or hub id) for from_pretrained")
    source.add_argument("--run", help="training run folder (train.output_dir) holding config.yaml and checkpoints")
    parser.add_argument("--tag", help="checkpoint tag in --run (default: DeepSpeed's 'latest')")
    parser.add_argument("--tokenizer", help="tokenizer folder for --model (default: the model folder)")
    parser.add_argument("--tp", type=int, default=1, help="AutoTP size for --model under several ranks (default 1)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="weights' dtype for --model (auto: bf16 on GPUs, fp32 on CPU)")
    parser.add_argument("--output-dir", help="where eval/step_<step, 7 digits>.jsonl goes (default: --run; for --model "
                        "MODEL_eval beside a local folder, runs/eval/<org>--<name> for a hub id)")
    parser.add_argument("--default-settings", action="store_true",
                        help="--model: start from the default evaluation settings, not the run's ntl_eval.json")
    parser.add_argument("--json", help="metrics JSON path; - or /dev/stdout prints it (default: "
                        "OUTPUT_DIR/eval_results_step_<step, 7 digits>.json)")
    parser.add_argument("--step", type=int, help="step number for file names (default: the tag's step, or 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    parser.add_argument("overrides", nargs="*", help="EvalConfig settings as key=value (e.g. arithmetic_n=500)")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after the options
    for option in ("model", "run", "tag", "tokenizer", "output_dir", "json"):
        value = getattr(args, option)
        if value is not None and not value.strip():  # `--json $OUT` with OUT unset: not the default, a mistake
            parser.error(f"--{option.replace('_', '-')} is empty ({value!r}); give a value or leave the option out")
    if args.step is not None and args.step < 0:
        parser.error(f"--step {args.step} is negative; give the step number the results are for (>= 0), or leave "
                     f"it out")
    return args


def eval_config(base: EvalConfig, overrides: Sequence[str]) -> EvalConfig:
    """`base` with `key=value` overrides (YAML values); unknown keys are named with the nearest valid one."""
    values = dataclasses.asdict(base)
    for item in overrides:
        if "=" not in item or not item.partition("=")[0].strip():
            raise ValueError(f"override {item!r} must look like key=value (e.g. arithmetic_n=500)")
        key, value = parse_override(item)  # the trainer's reading: duplicate keys and alias bombs refused
        values[key.removeprefix("eval.")] = value
    return eval_config_from_dict(values, where="the command line")


def model_eval_settings(args: argparse.Namespace) -> tuple[EvalConfig, str]:
    """(settings before overrides, where they come from) for --model."""
    if args.default_settings:
        return EvalConfig(), "the defaults (--default-settings)"
    saved = load_eval_settings(args.model) if os.path.isdir(args.model) else None
    if saved is None:
        return EvalConfig(), f"the defaults ({args.model} has no {EVAL_SETTINGS_FILE} from a training run)"
    return saved, f"the training run's, from {os.path.join(args.model, EVAL_SETTINGS_FILE)}"


def default_output_dir(model: str) -> str:
    """Where --model results go without --output-dir: beside a local folder, or under runs/eval for a hub id."""
    if os.path.isdir(model):
        folder = os.path.abspath(model).rstrip(os.sep)
        return folder + "_eval"
    return os.path.join("runs", "eval", model.replace("/", "--"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _accelerator_name() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def load_hf_model(args: argparse.Namespace, cfg: EvalConfig) -> tuple[Any, Any, str]:
    """(model or engine, tokenizer, description) for an exported HF folder; the tokenizer is loaded and checked
    against `cfg` first (a refusal before the weights load)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.eval.hooks import check_eval_tokenizer
    from ntl_pretrain.models.build import load_model_config
    from ntl_pretrain.tokenizer.loading import load_tokenizer
    from ntl_pretrain.trainer.preflight import grouped_experts_problem

    world = _world_size()
    if args.tp < 1 or world % args.tp != 0:  # before anything loads
        raise ValueError(f"--tp {args.tp} does not divide the {world} processes launched; choose a divisor")
    # the trainer's loader (folders our tools wrote load verbatim; a folder without tokenizer files is one line)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    check_eval_tokenizer(cfg, tokenizer)
    check_vocabulary_fits(args, tokenizer)
    on_cpu = _accelerator_name() == "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if on_cpu else "bf16")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    experts = {}
    problem = grouped_experts_problem(load_model_config(ModelConfig(name_or_path=args.model)), dtype)
    if problem is not None:  # grouped_mm would fail at the first batch; the plain loop over experts runs any size
        experts = {"experts_implementation": "eager"}
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: the model's {problem[0]}={problem[1]} is not a multiple of {problem[2]} ({dtype}), which "
                  f"torch's grouped_mm needs: its MoE experts run with experts_implementation=eager (slower)",
                  flush=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype, **experts)
    except OSError as error:  # no weights file in the folder, a hub id that does not exist
        raise ValueError(f"cannot load the model weights of {args.model!r}: {' '.join(str(error).split())}") from None
    if world == 1 and args.tp == 1:
        if not on_cpu:
            from deepspeed.accelerator import get_accelerator

            model = model.to(get_accelerator().current_device_name())
        return model.eval(), tokenizer, f"{args.model} ({dtype}, 1 process)"
    import deepspeed

    from ntl_pretrain.parallel.distributed import init_distributed

    init_distributed(timeout_minutes=30)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp, "vocab_parallel_lm_head": True}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine, tokenizer, f"{args.model} ({dtype}, {world} processes, ZeRO-3, tp={args.tp})"


def check_vocabulary_fits(args: argparse.Namespace, tokenizer: Any) -> None:
    """Refuse, before the weights load, a tokenizer whose token ids reach past the model's embedding rows (an
    IndexError inside the model's embedding at the first batch)."""
    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.models.build import load_model_config

    config = load_model_config(ModelConfig(name_or_path=args.model))
    rows = getattr(config.get_text_config(), "vocab_size", None)
    ids = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if isinstance(rows, int) and ids > rows:
        source = args.tokenizer or args.model
        raise ValueError(f"the tokenizer of {source!r} has token ids up to {ids - 1}, but the model {args.model!r} "
                         f"has {rows} embedding rows (vocab_size={rows}); pass the tokenizer the model was trained "
                         f"with (--tokenizer DIR), or resize the model to it first (tools/tokenizer.py resize-model "
                         f"{args.model} {source} OUT)")


def _checkpoint_tag(run_dir: str, tag: str | None) -> str:
    from ntl_pretrain.checkpoint import step_of_tag

    if tag:  # named as the user gave it: the trainer's train.resume, which this sets, was never written by them
        if step_of_tag(tag) is None:
            raise ValueError(f"--tag {tag!r} is not a checkpoint tag (global_stepN, a folder of the run); e.g. "
                             f"--tag global_step100, or leave --tag out for the run's 'latest'")
        if not os.path.isdir(os.path.join(run_dir, tag)):
            found = sorted((name for name in os.listdir(run_dir) if step_of_tag(name) is not None
                            and os.path.isdir(os.path.join(run_dir, name))), key=step_of_tag)
            raise ValueError(f"--tag {tag}: {run_dir!r} has no such checkpoint (it has: {', '.join(found) or 'none'})")
        return tag

    latest = os.path.join(run_dir, "latest")
    if os.path.islink(latest) or not os.path.isfile(latest):
        raise ValueError(f"{run_dir!r} has no 'latest' checkpoint file (a regular file, never a link); pass --tag "
                         f"(e.g. --tag global_step100)")
    with open(latest, encoding="utf-8", errors="replace") as handle:
        tag = handle.read(256).strip()
    if step_of_tag(tag) is None:  # '../../elsewhere': never taken as a checkpoint, nor quoted as a setting
        raise ValueError(f"{latest!r} names {tag[:80]!r}, which is not a checkpoint tag of the run (global_stepN, a "
                         f"folder inside it); pass --tag global_stepN")
    return tag


def load_run_checkpoint(args: argparse.Namespace) -> tuple[Any, Any, str, EvalConfig, str, Any, bool]:
    """(engine, tokenizer, description, the run's eval settings, tag, model config, whether it trained with
    data.document_mask: `run_document_mask`) for a training checkpoint.

    Built as the trainer builds a resume: the run's config.yaml resolved for the processes launched, the
    checkpoint verified (sizes and hashes of its files, no unsafe pickles), then the run's tokenizer, model
    and engine (`engine.build_engine`: the fingerprint of model, tokenizer and number vocabulary checked
    against the checkpoint's; its universal form when the layout differs and checkpoint.reshard_on_resume
    allows) and the checkpoint loaded through the checkpoint manager.
    """
    from deepspeed.accelerator import get_accelerator

    from ntl_pretrain.parallel import distributed
    from ntl_pretrain.runtime import launcher, lifecycle
    from ntl_pretrain.config import load_config
    from ntl_pretrain.models.build import load_run_tokenizer
    from ntl_pretrain.trainer.preflight import check_output_dir, number_vocab_for, preflight
    from ntl_pretrain.trainer.engine import build_engine

    config_path = os.path.join(args.run, "config.yaml")
    if not os.path.isfile(config_path):
        raise ValueError(f"{args.run!r} is not a training run folder: {config_path} is missing")
    tag = _checkpoint_tag(args.run, args.tag)
    # the run folder where it is now, and the checkpoint to load, as a resume of the run would name them; without
    # sequence parallelism (generation runs on whole prompts; a checkpoint loads at any sp size, docs/training.md)
    saved = load_config(config_path, [f"train.output_dir={args.run}", f"train.resume={tag}", "parallel.sp_size=1"])
    # `python tools/evaluate.py --run` without a launcher: a world of one, as `python launch/pretrain.sh` alone
    # (else DeepSpeed falls back to MPI discovery: a raw "No module named 'mpi4py'")
    launcher.use_world_of_one()
    world = _world_size()
    tp_size = saved.parallel.tp_size
    if isinstance(tp_size, int) and tp_size > 1 and world % tp_size:
        # preflight would name the trainer's fixes (its tp_size, launch/pretrain.sh); the fix here is the launch
        cpu = "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 " if get_accelerator().device_name() == "cpu" else ""
        raise ValueError(f"{args.run!r} trained with parallel.tp_size={tp_size}, which does not divide the {world} "
                         f"process(es) launched; evaluate it on {tp_size} processes: {cpu}deepspeed --num_gpus "
                         f"{tp_size} tools/evaluate.py --run {args.run}")
    checked = preflight(saved, world, get_accelerator().device_name() == "cpu", lifecycle.local_world_size())
    cfg = checked.run.cfg
    distributed.init_distributed(cfg.train.dist_timeout_minutes)
    check_output_dir(cfg)  # every rank: the checkpoint's files checked in shares, the result agreed
    tokenizer = load_run_tokenizer(cfg.tokenizer, cfg.model)
    built = build_engine(cfg, checked.run.ds_config, tokenizer, number_vocab_for(cfg, checked.objective, tokenizer),
                         distributed.layout(cfg.parallel), resume_tag=tag)
    built.checkpoints.load(built.engine, built.load_tag)
    description = f"{os.path.join(args.run, tag)} ({world} processes, tp={cfg.parallel.tp_size})"
    return built.engine, tokenizer, description, cfg.eval, tag, checked.model_config, run_document_mask(config_path, cfg)


def run_document_mask(config_path: str, cfg: Any) -> bool:
    """Whether the run trained with attention inside each packed document: its data.document_mask, false for a
    run whose config.yaml predates the key (attention then spanned the packed row)."""
    import yaml

    with open(config_path, encoding="utf-8") as handle:
        saved = yaml.safe_load(handle) or {}
    return cfg.data.document_mask if "document_mask" in (saved.get("data") or {}) else False


def format_table(metrics: dict[str, float]) -> str:
    """Metrics as an aligned two-column table."""
    width = max((len(k) for k in metrics), default=10)
    lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  {'-' * 12}"]
    lines += [f"{key.ljust(width)}  {value:.6g}" for key, value in metrics.items()]
    return "\n".join(lines)


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse, in one line, a --json that no file may replace (a device, fifo or folder: the shared writer refuses
    those) and a --output-dir or --json folder that cannot be written."""
    from ntl_pretrain.core.fs import not_a_file_problem, writable_problem

    problems = []
    if args.json:
        problems.append(not_a_file_problem(args.json))
        if args.json not in STANDARD_STREAMS:
            problems.append(writable_problem(os.path.dirname(os.path.abspath(args.json)), "--json's folder"))
    if args.output_dir:
        problems.append(writable_problem(args.output_dir, "--output-dir"))
    problem = next((p for p in problems if p), None)
    if problem:
        raise ValueError(problem)


def check_result_files(output_dir: str, step: int, json_path: str | None) -> None:
    """Refuse, before the evaluation, result files that exist and are not regular files (the shared writer would
    refuse them only after the generation, which can take hours)."""
    from ntl_pretrain.core.fs import not_a_file_problem
    from ntl_pretrain.eval.hooks import predictions_path

    paths = [predictions_path(output_dir, step)]
    if not json_path:
        paths.append(os.path.join(output_dir, f"eval_results_step_{step:07d}.json"))
    problem = next((p for p in map(not_a_file_problem, paths) if p), None)
    if problem:
        raise ValueError(problem)


def _notice(is_main: bool, text: str) -> None:
    """A start-up notice, printed once (by rank 0)."""
    if is_main:
        print(text, flush=True)


def _write_json(path: str, data: Any) -> None:
    from ntl_pretrain.core.fs import write_json_atomic

    write_json_atomic(path, data, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    from ntl_pretrain.parallel.distributed import shutdown_distributed
    from ntl_pretrain.runtime.lifecycle import stop_when_launchers_end

    # under `deepspeed`: a stop signal to its runner (which has no handler) ends the evaluation on every rank, not
    # only the runner (nothing to save: the results are written at the end or not at all)
    stop_when_launchers_end("evaluation (nothing written)")
    try:
        return _evaluate(parse_args(sys.argv[1:] if argv is None else argv))
    finally:
        shutdown_distributed()  # the process group is this call's, in-process callers (tests) included


def _evaluate(args: argparse.Namespace) -> int:
    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.eval.hooks import run_evaluation
    from ntl_pretrain.models.build import load_model_config, max_positions

    is_main = int(os.environ.get("RANK", "0")) == 0
    overridden = f", overridden by {' '.join(args.overrides)}" if args.overrides else ""
    started = time.monotonic()
    try:
        check_output_paths(args)  # before anything loads: an evaluation can take hours
        if args.model:
            base, settings_source = model_eval_settings(args)
            settings_source += overridden
            cfg = eval_config(base, args.overrides)
            # a broken GSM8K line, or no room for an answer within the model's positions, fails before the weights load
            positions = max_positions(load_model_config(ModelConfig(name_or_path=args.model)))
            validate_eval_inputs(cfg, max_position_embeddings=positions, read_hub=True)
            _notice(is_main, f"evaluation settings: {settings_source}")
            _notice(is_main, f"loading {args.model} on {_world_size()} process(es) ...")
            model, tokenizer, description = load_hf_model(args, cfg)
            # how the model trained decides how "document" prompts are encoded: a training run's export says
            # (ntl_eval.json), any other model is taken to have trained across documents (docs/evaluation.md)
            document_mask = os.path.isdir(args.model) and trained_document_mask(args.model)
            step = args.step if args.step is not None else 0
            output_dir = args.output_dir or default_output_dir(args.model)
        else:
            _notice(is_main, f"loading the checkpoint of {args.run} ({args.tag or 'latest'}) on {_world_size()} "
                             f"process(es): checking its files, building the model and engine ...")
            model, tokenizer, description, run_eval_cfg, tag, model_config, document_mask = load_run_checkpoint(args)
            settings_source = f"the training run's, from {os.path.join(args.run, 'config.yaml')}{overridden}"
            cfg = eval_config(run_eval_cfg, args.overrides)
            validate_eval_inputs(cfg, max_position_embeddings=max_positions(model_config), read_hub=True)
            _notice(is_main, f"evaluation settings: {settings_source}")
            match = re.search(r"(\d+)$", tag)
            step = args.step if args.step is not None else (int(match.group(1)) if match else 0)
            output_dir = args.output_dir or args.run
        check_result_files(output_dir, step, args.json)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    _notice(is_main, f"loaded {description} in {time.monotonic() - started:.1f} s; predictions go to "
                     f"{os.path.join(output_dir, 'eval')}")
    metrics = run_evaluation(model, tokenizer, cfg, step=step, output_dir=output_dir, final=True, show_progress=True,
                             document_mask=document_mask)
    if is_main:
        json_path = args.json or os.path.join(output_dir, f"eval_results_step_{step:07d}.json")  # as checked
        # NaN (e.g. MAE with no parseable answer) and inf (an MAE beyond float's range) are not JSON: write null.
        finite = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        _write_json(json_path, {"model": description, "step": step, "metrics": finite,
                                "eval_config": dataclasses.asdict(cfg), "eval_settings": settings_source,
                                "predictions": os.path.join(output_dir, "eval", f"step_{step:07d}.jsonl")})
        print(f"evaluated {description}")
        print(format_table(metrics))
        print(f"metrics: {json_path}")
    return 0


if __name__ == "__main__":
    from ntl_pretrain.parallel import distributed

    distributed.run_process(main)
