#!/usr/bin/env python
"""GPU check: what a GPU user asks of this project, measured by one command in at most ~8 minutes.

On a machine with one CUDA GPU and the project installed (`bash tools/install.sh`; DeepSpeed, if the
machine has no index to install it from, from a carried wheel: `pip install deepspeed-*.whl`):
    bash tools/gpu_check.sh --out gpu_check.json
The same recipe on CPU with a tiny model and a few steps (what tests/test_gpu_check.py runs):
    bash tools/gpu_check.sh --cpu --tiny --out /tmp/gpu_check.json
(`--tiny` without `--cpu`: a one-minute smoke test of the recipe on the GPU.) The exit status is 1 when a
part failed (timeouts and skips are recorded, not failures).

The parts, in this order. Each process below runs with its own time budget (seconds; change one with
`--part-budget NAME=SECONDS`, choose parts with `--parts`); a part that fails or runs out of time is
recorded so, and the next one still runs. Results go to one JSON (written after every part) and a table.

  environment        date, GPU, torch / CUDA / DeepSpeed / transformers / flash-attn / Liger versions
  -- one training process (DeepSpeed's launcher, 1 rank, ZeRO-3, bf16; SDPA attention):
  train_sdpa         a model with Qwen2.5-0.5B's architecture (hidden 896, 24 layers, 14 heads, 2 KV heads,
                     intermediate 4864, tied embeddings, rope_theta 1e6) and random weights, trained on the
                     demo's generated arithmetic corpus: a loss curve of 200+ steps, tokens/s, model TFLOP/s,
                     MFU, peak GPU memory. No hub: the tokenizer is the demo's digit-level BPE (512 tokens)
                     trained here, its vocabulary padded to Qwen2.5's 151936 rows (model.pad_vocab_to_multiple_of)
  chunked_head       the same engine, loss.chunk_tokens=0 vs 4096 in ABBA order: step time and peak memory
  generation         the same engine: greedy generation for evaluation (ntl_pretrain.eval), tokens/s
  sync_debug         the same engine, last (an error leaves the engine mid-step): host syncs of one step
                     counted (torch.cuda.set_sync_debug_mode("warn")), then one step with mode "error" around
                     each micro-batch's forward and backward; the error text, if any, is the finding
  -- then, each in its own process:
  ntl_on_off         tools/bench_train.py under DeepSpeed's launcher: NTL on/off step-time ratio (ABBA, one
                     process), with its model FLOPs, TFLOP/s, MFU and peak memory
  loss_bench         tools/bench_loss.py's methods (torch CE, ours CE / CE + NTL-WAS, ntloss, our full and
                     chunked head, DeepSpeed's fused linear_cross_entropy where bench_loss has it, Liger's fused
                     linear CE if it imports) on device tensors in bf16 at n=16384, V=128256, H=896:
                     median time, peak memory, the loss each computes
  train_flash_attention_2   the training figures again with flash-attention 2 (when flash_attn imports; last,
                     as it is optional: it gets what the overall budget, --budget-s, has left)

The optimizer is torch's fused AdamW through DeepSpeed (`torch_adam`), so nothing is JIT-compiled; with
`--optimizer deepspeed` it is DeepSpeed's FusedAdam (built on first use: needs nvcc and ninja).
Model FLOPs and MFU follow tools/bench_train.py (PaLM convention; peak from its GPU table or --peak-tflops).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import bench_loss  # noqa: E402  (stdlib only at import time)
from run_repro import free_port, stop_process_group  # noqa: E402

# Qwen2.5-0.5B's published architecture (config.json of Qwen/Qwen2.5-0.5B), written out: no hub access.
QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
QWEN25_05B_VOCAB = 151936
TINY_ARCHITECTURE = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}

STATUSES = ("ok", "partial", "skipped", "failed", "timeout")
# What each process measures (its parts, in order); "ntl_on_off" is tools/bench_train.py itself.
# Flash-attention comes last: optional, it gets what the overall budget has left.
PROCESSES = (("environment", ("environment",)),
             ("train_sdpa", ("train_sdpa", "chunked_head", "generation", "sync_debug")),
             ("ntl_on_off", ("ntl_on_off",)),
             ("loss_bench", ("loss_bench",)),
             ("train_flash_attention_2", ("train_flash_attention_2",)))
PARTS = tuple(part for _, parts in PROCESSES for part in parts)
# Seconds a process may take before its first part starts (imports, data, model build, deepspeed.initialize).
STARTUP_S = {"environment": 0, "train_sdpa": 100, "train_flash_attention_2": 100, "ntl_on_off": 0, "loss_bench": 20}
STARTUP_S_CPU = {"environment": 0, "train_sdpa": 150, "train_flash_attention_2": 150, "ntl_on_off": 0,
                 "loss_bench": 60}
# Seconds per part (ntl_on_off: its whole process, start-up included).
BUDGET_S = {"environment": 30, "train_sdpa": 80, "chunked_head": 30, "generation": 25, "sync_debug": 15,
            "train_flash_attention_2": 30, "ntl_on_off": 100, "loss_bench": 50}
BUDGET_S_CPU = {"environment": 60, "train_sdpa": 60, "chunked_head": 40, "generation": 40, "sync_debug": 10,
                "train_flash_attention_2": 60, "ntl_on_off": 200, "loss_bench": 60}


@dataclass(frozen=True)
class Sizes:
    """How big each part is: the real check, or `--tiny`."""

    architecture: dict  # model.architecture
    pad_vocab_to_multiple_of: int  # model.pad_vocab_to_multiple_of (the vocabulary's rows)
    tokenizer_tokens: int  # tokenizer.train_vocab_size of the demo tokenizer trained here
    corpus_documents: int  # generated arithmetic documents
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int  # train.grad_accum_steps
    lr: float
    warmup_steps: int
    curve_steps: int  # train_sdpa (at most; its budget may stop it earlier)
    flash_steps: int  # train_flash_attention_2
    chunk_tokens: int  # chunked_head's loss.chunk_tokens
    chunked_steps: int  # chunked_head (ABBA blocks of 4)
    ntl_steps: int  # tools/bench_train.py --steps
    ntl_warmup: int  # tools/bench_train.py --warmup
    eval_prompts: int  # arithmetic prompts generated for
    loss_tokens: int  # loss_bench n
    loss_vocab: int  # loss_bench V
    loss_hidden: int  # loss_bench H
    loss_chunk_tokens: int  # loss_bench rows per chunk of our chunked head
    loss_reps: int  # loss_bench warm repetitions per method


FULL = Sizes(QWEN25_05B, QWEN25_05B_VOCAB, 512, 20000, seq_len=1024, micro_batch_size=8, grad_accum_steps=1, lr=6e-4,
             warmup_steps=20,
             curve_steps=250, flash_steps=40, chunk_tokens=4096, chunked_steps=8, ntl_steps=40, ntl_warmup=5,
             eval_prompts=64, loss_tokens=16384, loss_vocab=128256, loss_hidden=896, loss_chunk_tokens=4096,
             loss_reps=5)
TINY = Sizes(TINY_ARCHITECTURE, 64, 300, 1000, seq_len=32, micro_batch_size=2, grad_accum_steps=2, lr=3e-3, warmup_steps=1,
             curve_steps=6, flash_steps=4, chunk_tokens=16, chunked_steps=4, ntl_steps=4, ntl_warmup=1,
             eval_prompts=4, loss_tokens=256, loss_vocab=1024, loss_hidden=32, loss_chunk_tokens=64, loss_reps=2)
# bench_loss methods this check runs, where tools/bench_loss.py has them (it is extended in parallel).
LOSS_METHODS = ("ce", "ours_ce_only", "ours_was", "ntloss_was", "head_ce_only", "head_was", "chunked_ce_only",
                "chunked_was", "chunked_was@vocab_blocks", "ds_fused_ce")
LIGER_METHOD = "liger_fused_ce"
# Each method's loss is compared with the method computing the same quantity the plain way.
SAME_LOSS_AS = {"ours_ce_only": "ce", "ntloss_was": "ours_was", "chunked_ce_only": "head_ce_only",
                "ds_fused_ce": "head_ce_only", LIGER_METHOD: "head_ce_only", "chunked_was": "head_was",
                "chunked_was@vocab_blocks": "head_was"}


# ================================================================================== the parent
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report (default: gpu_check.json)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (DS_ACCELERATOR=cpu, gloo): the test's mode")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps of every part")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    parser.add_argument("--part-budget", action="append", default=[], metavar="NAME=SECONDS",
                        help=f"seconds for one part (default GPU budgets: {BUDGET_S})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole check stops starting processes past this (default 500 s; 900 with --cpu)")
    parser.add_argument("--workdir", default=None,
                        help="folder for the generated corpus, tokenizer, runs and logs (default: a new temp folder)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="rendezvous port of the DeepSpeed processes (default: a free one per process)")
    parser.add_argument("--optimizer", choices=("torch", "deepspeed"), default="torch",
                        help="torch: torch's fused AdamW (nothing compiled); deepspeed: FusedAdam (JIT build)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak dense TFLOP/s of the GPU for MFU")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    return parser.parse_args(argv)


def part_budgets(args: argparse.Namespace) -> dict[str, float]:
    budgets = dict(BUDGET_S_CPU if args.cpu else BUDGET_S)
    for item in args.part_budget:
        name, sep, seconds = item.partition("=")
        if not sep or name not in budgets:
            raise SystemExit(f"--part-budget {item!r}: use NAME=SECONDS with NAME one of {', '.join(budgets)}")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"--part-budget {item!r}: {seconds!r} is not a number of seconds") from None
    return budgets


def training_overrides(sizes: Sizes, workdir: Path, cpu: bool, optimizer: str) -> list[str]:
    """The configs/demo.yaml overrides every training process of the check shares (`key=value`)."""
    overrides = [f"model.architecture.{key}={_yaml_scalar(value)}" for key, value in sizes.architecture.items()]
    overrides += [
        f"model.dtype={'fp32' if cpu else 'bf16'}", f"model.pad_vocab_to_multiple_of={sizes.pad_vocab_to_multiple_of}",
        f"tokenizer.name_or_path={workdir / 'assets' / 'tokenizer'}", f"tokenizer.train_vocab_size={sizes.tokenizer_tokens}",
        f"data.sources.0.path={workdir / 'assets' / 'arithmetic.jsonl'}",
        f"data.sources.0.generate_arithmetic={sizes.corpus_documents}", "data.validation_documents=20",
        f"data.seq_len={sizes.seq_len}", f"data.micro_batch_size={sizes.micro_batch_size}",
        f"train.grad_accum_steps={sizes.grad_accum_steps}",
        "parallel.tp_size=1", "parallel.zero_stage=3", f"optim.lr={sizes.lr}", f"optim.warmup_steps={sizes.warmup_steps}",
        "train.max_steps=100000", "train.val_every_n_steps=-1", "train.log_every_n_steps=1", "monitor.progress_bar=never",
        "checkpoint.save_final=false", "eval.at_end=false"]
    if optimizer == "torch":
        # torch.optim.AdamW(fused=True) through DeepSpeed's torch_adam switch: no FusedAdam JIT build (on CPU
        # too, where the trainer sets torch_adam anyway: the test then runs this file as the GPU check does)
        path = workdir / "ds_torch_fused_adamw.json"
        bench_loss._write_json(str(path), {"optimizer": {"params": {"torch_adam": True, "fused": True}}})
        overrides.append(f"deepspeed.config={path}")
    return overrides


def _yaml_scalar(value: Any) -> str:
    """`value` as an override's YAML text (YAML 1.1 reads 1e-06 without a dot as a string)."""
    return format(value, ".6e") if isinstance(value, float) else json.dumps(value)


def launcher(port: int) -> list[str]:
    """DeepSpeed's launcher with one process (one GPU, or one CPU process with DS_ACCELERATOR=cpu)."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port)]


def run_logged(command: list[str], timeout: float, log_path: Path, env: dict) -> tuple[str, str]:
    """Run one process (its own process group, output to `log_path`): ("ok" | "failed" | "timeout", detail)."""
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            stop_process_group(process)  # the whole group: the launcher and its rank
            return "timeout", f"stopped after its budget of {timeout:.0f} s (log {log_path})"
    if code != 0:
        return "failed", f"exit code {code}: {log_tail(log_path)} (log {log_path})"
    return "ok", ""


def log_tail(path: Path, lines: int = 6, chars: int = 1500) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return " | ".join(line.strip() for line in text[-lines:])[-chars:]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    sizes = TINY if args.tiny else FULL
    budgets = part_budgets(args)
    startup = STARTUP_S_CPU if args.cpu else STARTUP_S
    out = Path(args.out).resolve()
    workdir = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    overrides = training_overrides(sizes, workdir, args.cpu, args.optimizer)
    report: dict[str, Any] = {
        "meta": {"command": " ".join(["tools/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])]),
                 "mode": ("cpu" if args.cpu else "gpu") + (" tiny" if args.tiny else ""), "sizes": asdict(sizes),
                 "budgets_s": budgets, "workdir": str(workdir), "optimizer": args.optimizer,
                 "model_note": ("architecture " + ("of Qwen2.5-0.5B" if not args.tiny else "tiny qwen2") +
                                ", random weights; tokenizer: the demo's digit-level BPE trained here "
                                f"({sizes.tokenizer_tokens} tokens), vocabulary padded to "
                                f"{sizes.pad_vocab_to_multiple_of} rows (model.pad_vocab_to_multiple_of)")},
        "parts": {}}
    deadline = time.monotonic() + (args.budget_s or (900.0 if args.cpu else 500.0))
    for process_name, parts in PROCESSES:
        chosen = [part for part in parts if part in args.parts]
        if not chosen:
            continue
        skip = skip_reason(process_name, args.cpu, report["parts"].get("environment", {}))
        if skip is not None:
            for part in chosen:
                report["parts"][part] = {"status": "skipped", "detail": skip}
        else:
            timeout = startup[process_name] + sum(budgets[part] for part in chosen)
            left = deadline - time.monotonic()
            if left < 5:
                records = {part: {"status": "timeout", "detail": "the check's overall budget (--budget-s) was spent"}
                           for part in chosen}
            else:
                records = run_parts(process_name, chosen, min(timeout, left), args, sizes, budgets, overrides,
                                    workdir, env)
            report["parts"].update(records)
        bench_loss._write_json(str(out), report)  # after every process: a cut-off check keeps what it measured
        checked = report["parts"].get("environment", {})
        if process_name == "environment" and not args.cpu and checked.get("status") == "ok" and not checked["cuda_available"]:
            print("error: no CUDA device is visible (torch.cuda.is_available() is False); on a machine without a "
                  "GPU run `bash tools/gpu_check.sh --cpu --tiny`", file=sys.stderr)
            return 2
    print(format_table(report))
    print(f"\nwritten: {out}")
    failed = [part for part, record in report["parts"].items() if record["status"] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)} (their records say why; logs in {workdir / 'logs'})", file=sys.stderr)
    return 1 if failed else 0


def skip_reason(process_name: str, cpu: bool, environment: dict) -> str | None:
    if process_name == "train_flash_attention_2":
        if cpu:
            return "CPU (flash-attention 2 needs CUDA)"
        if not environment:
            return "not checked whether flash_attn imports (add the environment part)"
        if not environment.get("flash_attn"):
            return f"flash_attn does not import ({environment.get('flash_attn_error', 'not checked')})"
    return None


def run_parts(process_name: str, parts: list[str], timeout: float, args: argparse.Namespace, sizes: Sizes,
              budgets: dict[str, float], overrides: list[str], workdir: Path, env: dict) -> dict[str, dict]:
    """Run one process of the check; its parts' records (a part it did not finish: failed / timeout)."""
    log_path = workdir / "logs" / f"{process_name}.log"
    result_path = workdir / f"{process_name}.result.json"
    result_path.unlink(missing_ok=True)
    port = args.master_port or free_port()
    if process_name == "ntl_on_off":
        command = [*launcher(port), "tools/bench_train.py", "--config", "configs/demo.yaml", "--steps",
                   str(sizes.ntl_steps), "--warmup", str(sizes.ntl_warmup), "--zero-stage", "3", "--tp", "1",
                   "--out", str(result_path), *(["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []),
                   *overrides]
    else:
        spec = {"process": process_name, "parts": parts, "budgets": {p: budgets[p] for p in parts},
                "sizes": asdict(sizes), "cpu": args.cpu, "peak_tflops": args.peak_tflops, "workdir": str(workdir),
                "result": str(result_path), "overrides": overrides + [f"train.output_dir={workdir / process_name}"],
                "attention": "flash_attention_2" if process_name == "train_flash_attention_2" else "sdpa"}
        spec_path = workdir / f"{process_name}.spec.json"
        bench_loss._write_json(str(spec_path), spec)
        child = [str(REPO / "tools" / "gpu_check.py"), "--child", process_name, "--spec", str(spec_path)]
        command = [*launcher(port), *child] if process_name.startswith("train_") else [sys.executable, *child]
    print(f"[{time.strftime('%H:%M:%S')}] {process_name}: {', '.join(parts)} (at most {timeout:.0f} s; log {log_path})",
          flush=True)
    status, detail = run_logged(command, timeout, log_path, env)
    result = read_json(result_path)
    if process_name == "ntl_on_off" and result:
        result = {"ntl_on_off": {"status": "ok", "detail": "ABBA, one process (tools/bench_train.py); goal: "
                                 "step-time ratio <= 1.01", **result}}
    records = {}
    for part in parts:
        record = result.get(part)
        if record is None or record.get("status") == "running":
            why = detail if status != "ok" else "the process ended without recording it"
            record = {**(record or {}), "status": status if status != "ok" else "failed", "detail": why}
        records[part] = record
    return records


# ------------------------------------------------------------------------------------------- the table
def format_table(report: dict) -> str:
    """One line per part: status and its headline figures."""
    lines = [f"GPU check ({report['meta']['mode']}): {report['meta']['model_note']}", ""]
    for part, record in report["parts"].items():
        status = record.get("status", "?")
        text = status if status == "ok" else f"{status}: {record.get('detail', '')}"
        figures = headline(part, record) if status in ("ok", "partial") else ""
        lines.append(f"{part:<24} {text[:110]}" + (f"\n{'':<24} {figures}" if figures else ""))
    return "\n".join(lines)


def _g(value: Any, fmt: str = ".4g") -> str:
    return "n/a" if value is None else format(value, fmt)


def headline(part: str, r: dict) -> str:
    if part == "environment":
        return (f"{r.get('date_utc')} gpu={r.get('gpu')} torch={r.get('torch')} cuda={r.get('cuda')} "
                f"deepspeed={r.get('deepspeed')} transformers={r.get('transformers')} flash_attn={r.get('flash_attn')}")
    if part.startswith("train_"):
        return (f"{r['steps']} steps, {_g(r['tokens_per_s'])} tok/s, {_g(r['model_tflops_per_s'])} TFLOP/s, "
                f"MFU {_g(r['mfu'], '.1%') if r['mfu'] is not None else 'n/a'}, peak {_g(r['peak_memory_gib'])} GiB, "
                f"loss {_g(r['loss_first_mean'])} -> {_g(r['loss_last_mean'])} (falls: {r['loss_falls']})")
    if part == "chunked_head":
        return (f"chunk_tokens={r['chunk_tokens']}: time {_g(r['step_time_ratio_chunked_over_full'])}x, "
                f"peak memory {_g(r['peak_memory_gib_chunked'])} vs {_g(r['peak_memory_gib_full'])} GiB")
    if part == "generation":
        return f"{r['generated_tokens']:.0f} tokens for {r['prompts']} prompts, {_g(r['tokens_per_s'])} tok/s"
    if part == "sync_debug":
        return (f"micro-batch under 'error': {r['micro_batch_error_mode']}; syncs per step ('warn'): "
                f"{r['syncs_per_step']} ({r['syncs_in_micro_batches']} inside the micro-batches)")
    if part == "ntl_on_off":
        return (f"on/off {_g(r['step_time_ratio_on_over_off'])}x (ABBA blocks {_g(r['median_abba_block_ratio'])}x), "
                f"{_g(r['median_tokens_per_s_ntl_on'])} tok/s, {_g(r['model_tflops_per_s_ntl_on'])} TFLOP/s, "
                f"peak {_g(r.get('peak_memory_gib'))} GiB")
    if part == "loss_bench":
        rows = [f"{name} {_g(m['median_s'] * 1e3, '.3g')} ms/{_g(m['peak_extra_gib'], '.3g')} GiB"
                for name, m in r["methods"].items() if m.get("status") == "ok"]
        return "; ".join(rows)
    return ""


# ================================================================================== the processes
def run_child(args: argparse.Namespace) -> int:
    if args.child == "environment":
        spec = json.loads(Path(args.spec).read_text())
        bench_loss._write_json(spec["result"], {"environment": environment()})
        return 0
    spec = json.loads(Path(args.spec).read_text())
    records = Records(spec["result"])
    if args.child == "loss_bench":
        run_recorded(records, "loss_bench", lambda: loss_bench(spec))
        return 0
    return training_process(spec, records)


class Records:
    """The parts' records of one process, rewritten (atomically) whenever one changes."""

    def __init__(self, path: str) -> None:
        self.path, self.parts = path, {}

    def set(self, part: str, record: dict) -> None:
        self.parts[part] = record
        bench_loss._write_json(self.path, self.parts)


def run_recorded(records: Records, part: str, measure: Callable[[], dict]) -> None:
    """Record `part` as running, then its figures, or its error (the process goes on with the next part)."""
    records.set(part, {"status": "running"})
    started = time.monotonic()
    try:
        record = measure()
    except Exception as error:  # noqa: BLE001 - any failure of a part is its finding; the next part still runs
        record = {"status": "failed", "detail": f"{type(error).__name__}: {str(error)[:1500]}",
                  "traceback": traceback.format_exc()[-4000:]}
    record.setdefault("status", "ok")
    record["seconds"] = time.monotonic() - started
    records.set(part, record)


def environment() -> dict:
    """Date, device and the versions that matter for the figures."""
    import datetime
    import platform

    import deepspeed
    import torch
    import transformers
    from deepspeed.accelerator import get_accelerator

    info: dict[str, Any] = {
        "status": "ok", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "gpu": None, "gpu_memory_gib": None,
        "deepspeed": deepspeed.__version__, "deepspeed_accelerator": get_accelerator().device_name(),
        "transformers": transformers.__version__, "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info.update(gpu=properties.name, gpu_memory_gib=properties.total_memory / 2**30,
                    gpu_count=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
    for module in ("flash_attn", "liger_kernel", "ntloss"):
        try:
            imported = __import__(module)
            info[module] = getattr(imported, "__version__", "imports")
        except Exception as error:  # noqa: BLE001 - an optional package that does not import is a finding
            info[module], info[f"{module}_error"] = None, f"{type(error).__name__}: {str(error)[:300]}"
    return info


# ------------------------------------------------------------------------------------------- memory
def reset_peak_memory(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        bench_loss._reset_peak_rss()  # VmHWM back to the current RSS


def peak_memory_gib(device: Any) -> float:
    """Peak since the last reset: torch.cuda.max_memory_allocated on a GPU, VmHWM (peak RSS) on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return bench_loss._peak_rss_kib() / 2**20


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ------------------------------------------------------------------------------------------- training parts
def training_process(spec: dict, records: Records) -> int:
    """Build the run's engine once (DeepSpeed ZeRO-3, 1 rank) and measure this process's parts on it."""
    from ntl_pretrain.config import load_config
    from ntl_pretrain.trainer.trainer import Trainer

    sizes = Sizes(**spec["sizes"])
    cfg = load_config(str(REPO / "configs" / "demo.yaml"),
                      spec["overrides"] + [f"model.attn_implementation={spec['attention']}"])
    trainer = Trainer(cfg)
    budgets = spec["budgets"]
    measures = {
        "train_sdpa": lambda: measure_training(trainer, sizes.curve_steps, budgets["train_sdpa"], spec),
        "train_flash_attention_2": lambda: measure_training(trainer, sizes.flash_steps,
                                                            budgets["train_flash_attention_2"], spec),
        "chunked_head": lambda: measure_chunked_head(trainer, sizes, budgets["chunked_head"]),
        "generation": lambda: measure_generation(trainer, sizes, Path(spec["workdir"]) / spec["process"]),
        "sync_debug": lambda: measure_sync_debug(trainer),
    }
    for part in spec["parts"]:
        if part == "sync_debug" and spec["cpu"]:
            # what CPU can check of this part: the hooks see each micro-batch's forward and backward
            records.set(part, {"status": "skipped", "detail": "CPU (torch.cuda.set_sync_debug_mode needs CUDA)",
                               **micro_batch_windows(trainer)})
            continue
        run_recorded(records, part, measures[part])
    trainer.parts.monitor.close()
    return 0


def measure_training(trainer: Any, steps: int, budget_s: float, spec: dict) -> dict:
    """`steps` optimizer steps (fewer if the budget runs out): loss curve, throughput, model FLOP/s, memory."""
    import bench_train

    reset_peak_memory(trainer.parts.device)
    losses, step_times, rates = [], [], []
    started = time.monotonic()
    for _ in range(steps):
        figures = trainer.train_step()
        losses.append(figures["train/loss"])
        step_times.append(figures["train/step_time_s"])
        rates.append(figures["train/tokens_per_s"])
        if time.monotonic() - started > budget_s:
            break
    warm = slice(min(5, len(rates) - 1), None)  # the first steps warm up the allocator and kernels
    tokens_per_s = statistics.median(rates[warm])
    flops_per_token = bench_train.model_flops_per_token(trainer)
    peak = bench_train.peak_tflops_per_device(spec["peak_tflops"])
    achieved = flops_per_token * tokens_per_s / 1e12
    window = max(1, min(10, len(losses) // 4))
    report = trainer.parts.model_report
    record = {
        "status": "ok" if len(losses) == steps else "partial",
        "detail": "" if len(losses) == steps else f"{len(losses)} of {steps} steps within the budget of {budget_s:.0f} s",
        "attention": report.attn_implementation, "dtype": report.dtype, "zero_stage": trainer.parts.cfg.parallel.zero_stage,
        "world_size": trainer.parts.layout.world_size, "parameters": report.parameters, "vocab_size": report.vocab_size,
        "tokenizer_size": report.tokenizer_size, "seq_len": trainer.parts.cfg.data.seq_len,
        "tokens_per_step": trainer.parts.cfg.data.seq_len * trainer.parts.cfg.data.micro_batch_size
        * trainer.parts.cfg.train.grad_accum_steps, "steps": len(losses),
        "median_step_time_s": statistics.median(step_times[warm]), "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops_per_token, "model_tflops_per_s": achieved, "peak_tflops_per_device": peak,
        "mfu": achieved / peak if peak else None, "peak_memory_gib": peak_memory_gib(trainer.parts.device),
        "loss_first_mean": _mean(losses[:window]), "loss_last_mean": _mean(losses[-window:]),
        "loss_window_steps": window, "loss_curve": [round(loss, 4) for loss in losses]}
    record["loss_falls"] = record["loss_last_mean"] < record["loss_first_mean"]
    return record


def measure_chunked_head(trainer: Any, sizes: Sizes, budget_s: float) -> dict:
    """The same engine with the full head (loss.chunk_tokens=0) and the chunked one, steps in ABBA order
    (chunked, full, full, chunked): median step time and peak memory of each."""
    times: dict[bool, list[float]] = {True: [], False: []}
    peaks = {True: 0.0, False: 0.0}
    original = trainer.parts.objective  # decides the head (Objective.chunk_tokens) at every micro-batch
    heads = {chunked: replace(original, chunk_tokens=sizes.chunk_tokens if chunked else 0)
             for chunked in (True, False)}
    started = time.monotonic()
    for i in range(max(4, sizes.chunked_steps - sizes.chunked_steps % 4)):
        chunked = (i % 4) in (0, 3)
        reset_peak_memory(trainer.parts.device)
        with trainer.with_parts(objective=heads[chunked]):
            figures = trainer.train_step()
        times[chunked].append(figures["train/step_time_s"])
        peaks[chunked] = max(peaks[chunked], peak_memory_gib(trainer.parts.device))
        if time.monotonic() - started > budget_s and i % 4 == 3:
            break
    full, chunked = statistics.median(times[False]), statistics.median(times[True])
    return {"chunk_tokens": sizes.chunk_tokens, "tokens_per_micro_batch": sizes.seq_len * sizes.micro_batch_size,
            "steps_each": len(times[True]), "median_step_time_s_full": full, "median_step_time_s_chunked": chunked,
            "step_time_ratio_chunked_over_full": chunked / full, "peak_memory_gib_full": peaks[False],
            "peak_memory_gib_chunked": peaks[True], "peak_memory_ratio_chunked_over_full": peaks[True] / peaks[False]}


def measure_generation(trainer: Any, sizes: Sizes, output_dir: Path) -> dict:
    """Greedy generation for the arithmetic evaluation through the trainer's evaluation hook (ZeRO-3 engine)."""
    from ntl_pretrain.eval.config import EvalConfig
    from ntl_pretrain.eval.hooks import run_evaluation

    cfg = EvalConfig(arithmetic_n=sizes.eval_prompts, arithmetic_splits=["interpolation"], arithmetic_ops=["+", "-"],
                     arithmetic_train_digits=[1, 2], arithmetic_extrapolation_digits=[3, 3],
                     arithmetic_max_new_tokens=8, samples_to_log=0)
    parts = trainer.parts
    metrics = run_evaluation(parts.engine, parts.tokenizer, cfg, step=trainer.state.step, output_dir=str(output_dir),
                             tp_group=parts.groups.tp_group, dp_group=parts.groups.dp_group, final=True)
    return {"prompts": sizes.eval_prompts, "max_new_tokens": cfg.arithmetic_max_new_tokens,
            "batch_size": cfg.batch_size, "generated_tokens": metrics["eval/generation/tokens"],
            "tokens_per_s": metrics["eval/generation/tokens_per_s"], "time_s": metrics["eval/time_s"],
            "accuracy": metrics["eval/arith/interpolation/accuracy"]}


@contextmanager
def around_micro_batches(trainer: Any, enter: Callable[[], None], leave: Callable[[], None]) -> Iterator[None]:
    """Call `enter` when a micro-batch's forward starts and `leave` when its backward returns (the trainer's
    `StepHooks.around_micro_batch`), for the steps run inside this block."""

    @contextmanager
    def window() -> Iterator[None]:
        enter()
        try:
            yield
        finally:
            leave()

    try:
        with trainer.with_hooks(around_micro_batch=window):
            yield
    finally:
        leave()


def micro_batch_windows(trainer: Any) -> dict:
    """One step inside `around_micro_batches` with hooks that only note the calls: how many micro-batch
    windows opened, and whether each closed before the next opened."""
    events: list[str] = []
    with around_micro_batches(trainer, lambda: events.append("enter"), lambda: events.append("leave")):
        trainer.train_step()
    events.pop()  # the block's own closing call
    windows = events.count("enter")
    return {"micro_batch_windows": windows, "micro_batch_windows_well_formed": events == ["enter", "leave"] * windows,
            "grad_accum_steps": trainer.parts.cfg.train.grad_accum_steps}


def measure_sync_debug(trainer: Any) -> dict:
    """Host syncs of one training step, then one step with syncs made errors inside the micro-batches."""
    import warnings

    import torch

    # 1. count: "warn" makes every synchronizing CUDA call a UserWarning at its Python call site
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with around_micro_batches(trainer, lambda: marks.append(len(caught)), lambda: marks.append(len(caught))):
                trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    is_sync = [("synchroniz" in str(w.message)) for w in caught]
    inside = sum(sum(is_sync[begin:end]) for begin, end in zip(marks[0::2], marks[1::2]))
    sites: dict[str, int] = {}
    for warning, sync in zip(caught, is_sync):
        if sync:
            where = os.path.relpath(warning.filename, REPO) if str(REPO) in warning.filename else warning.filename
            site = f"{where}:{warning.lineno}"
            sites[site] = sites.get(site, 0) + 1
    # 2. one step with syncs inside each micro-batch's forward/backward raising (last: an error leaves the step half done)
    error = None
    try:
        with around_micro_batches(trainer, lambda: torch.cuda.set_sync_debug_mode("error"),
                                  lambda: torch.cuda.set_sync_debug_mode(0)):
            trainer.train_step()
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:500]}\n" + "".join(
            traceback.format_tb(exc.__traceback__)[-4:])[-2000:]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"micro_batch_error_mode": "no sync" if error is None else "raised", "error": error,
            "micro_batch_windows": len(marks) // 2, "grad_accum_steps": trainer.parts.cfg.train.grad_accum_steps,
            "syncs_per_step": sum(is_sync), "syncs_in_micro_batches": inside,
            "sync_sites": dict(sorted(sites.items(), key=lambda item: -item[1])[:15])}


# ------------------------------------------------------------------------------------------- the loss benchmark
def loss_methods(device_type: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """bench_loss's methods this check wants that it has ({name: setup}), and why the others are missing."""
    methods, missing = {}, {}
    for name in LOSS_METHODS:
        try:
            found = bench_loss.build_methods(1, [name])
        except SystemExit:
            found = {}
        if name in found:
            methods[name] = found[name]
        else:
            missing[name] = "not a method of tools/bench_loss.py" + (" (ntloss not installed?)" if "ntloss" in name else "")
    if device_type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        methods[LIGER_METHOD] = _liger_fused_linear_ce
    else:
        missing[LIGER_METHOD] = "liger_kernel is not installed" if device_type == "cuda" else "CPU (Liger is Triton)"
    return methods, missing


def _liger_fused_linear_ce(inputs: Any, labels: Any, ctx: dict) -> Callable:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    hidden, module = inputs
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda: loss(module.weight, hidden, labels)


def _is_head(name: str) -> bool:
    return name == LIGER_METHOD or bench_loss.is_head_method(name)


def loss_bench(spec: dict) -> dict:
    """bench_loss's methods on device tensors, timed round-robin (same inputs for all), then the peak memory of
    one forward + backward of each and the loss it computed."""
    import torch

    from ntl_pretrain.loss import VocabShard
    from ntl_pretrain.numbers import NumberVocab

    sizes = Sizes(**spec["sizes"])
    device = torch.device("cpu" if spec["cpu"] else "cuda")
    dtype = torch.float32 if spec["cpu"] else torch.bfloat16
    n, vocab, hidden_size = sizes.loss_tokens, sizes.loss_vocab, sizes.loss_hidden
    generator = torch.Generator(device=device).manual_seed(0)
    first_digit = bench_loss.digit_ids_start(vocab)
    labels = torch.randint(0, vocab, (n,), generator=generator, device=device)
    numbers = torch.rand(n, generator=generator, device=device) < bench_loss.NUMBER_SHARE
    labels = torch.where(numbers, first_digit + torch.randint(0, 10, (n,), generator=generator, device=device), labels)
    logits = torch.randn(n, vocab, generator=generator, device=device, dtype=dtype).requires_grad_()
    hidden = torch.randn(n, hidden_size, generator=generator, device=device, dtype=dtype).requires_grad_()
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=dtype)
    with torch.no_grad():  # logits of about unit scale, as in bench_loss
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=generator, device=device, dtype=dtype)
                          / hidden_size ** 0.5)
    leaves = [logits, hidden, head.weight]
    ctx = {"vocab": NumberVocab(tuple(range(first_digit, first_digit + 10)), tuple(float(d) for d in range(10)), vocab),
           "group": None, "start": 0, "shard": VocabShard(), "vocab_size": vocab, "chunk_tokens": sizes.loss_chunk_tokens,
           "ds_chunk_tokens": 0}
    available, missing = loss_methods(device.type)
    results: dict[str, dict] = {name: {"status": "skipped", "detail": why} for name, why in missing.items()}

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_once(fn: Callable) -> tuple[float, Any]:
        for leaf in leaves:
            leaf.grad = None
        synchronize()
        begin = time.perf_counter()
        loss = fn()
        loss.backward()
        synchronize()
        return time.perf_counter() - begin, loss.detach()

    closures, times = {}, {}
    for name, setup in available.items():
        try:
            closures[name] = setup((hidden, head) if _is_head(name) else logits, labels, ctx)
            times[name] = [run_once(closures[name])[0]]  # cold: first call (kernel builds, autotuning)
        except Exception as error:  # noqa: BLE001 - a method that fails is recorded; the others still run
            closures.pop(name, None)
            results[name] = {"status": "failed", "detail": f"{type(error).__name__}: {str(error)[:500]}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    started, reps = time.monotonic(), 0
    for _ in range(sizes.loss_reps):
        for name, fn in closures.items():
            times[name].append(run_once(fn)[0])
        reps += 1
        if time.monotonic() - started > spec["budgets"]["loss_bench"] / 2:
            break
    for name, fn in closures.items():
        for leaf in leaves:  # the previous run's gradients are not this method's memory
            leaf.grad = None
        reset_peak_memory(device)
        base = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else bench_loss._rss_kib() / 2**20
        _, loss = run_once(fn)
        results[name] = {"status": "ok", "cold_s": times[name][0], "median_s": statistics.median(times[name][1:] or times[name]),
                         "peak_extra_gib": peak_memory_gib(device) - base, "loss": float(loss.float())}
    for name, row in results.items():
        if row["status"] != "ok":
            continue
        same = SAME_LOSS_AS.get(name)
        if results.get(same, {}).get("status") == "ok":
            row[f"loss_rel_diff_vs_{same}"] = abs(row["loss"] - results[same]["loss"]) / abs(results[same]["loss"])
        reference = "ds_fused_ce" if _is_head(name) else "ce"
        if results.get(reference, {}).get("status") == "ok" and name != reference:
            row[f"time_vs_{reference}"] = row["median_s"] / results[reference]["median_s"]
            if results[reference]["peak_extra_gib"] > 0:
                row[f"memory_vs_{reference}"] = row["peak_extra_gib"] / results[reference]["peak_extra_gib"]
    return {"status": "ok" if reps == sizes.loss_reps else "partial",
            "detail": "" if reps == sizes.loss_reps else f"{reps} of {sizes.loss_reps} repetitions within the budget",
            "tokens": n, "vocab": vocab, "hidden": hidden_size, "dtype": str(dtype).removeprefix("torch."),
            "device": device.type, "chunk_tokens": sizes.loss_chunk_tokens, "warm_repetitions": reps,
            "methods": results}


if __name__ == "__main__":
    from ntl_pretrain.parallel import distributed

    distributed.run_process(main)
