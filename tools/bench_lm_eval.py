#!/usr/bin/env python
"""What an in-loop lm-evaluation-harness evaluation costs (not a timed test): the `lm_eval` benchmark on the sharded
model against lm-eval's own HFLM on the export, the same tasks, at two model sizes.

    python tools/bench_lm_eval.py                      # sizes small and medium, 2 processes, the demo tasks
    python tools/bench_lm_eval.py --sizes medium --procs 2 --repeat 2

For each size a Llama with random weights and the GPT-2 tokenizer of ../shared/data (nothing downloaded) is saved as
an HF folder (what tools/export_hf.py writes); then, each in fresh processes, the wall time of the evaluation alone
(model loading and lm-eval's task loading excluded, the fastest of --repeat):

- `hflm`: lm-eval's HFLM on the folder, one process with THREADS threads (default PROCS; what a user runs on an
  export);
- `sharded_1`: ShardedLM on the plain module, one process with THREADS threads (the class's own overhead);
- `in_loop`: the `lm_eval` benchmark through the evaluation hook (`run_evaluation`, as the training loop calls it)
  on PROCS ranks, DeepSpeed ZeRO-3 with AutoTP T=PROCS and the vocabulary-parallel head, one thread each.

Tasks: the local demo tasks of examples/lm_eval_tasks (multiple choice, rolling perplexity, generation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GPT2 = os.path.join(REPO, "..", "shared", "data", "tokenizers", "gpt2")
TASKS_DIR = os.path.join(REPO, "examples", "lm_eval_tasks")
TASKS = ["ntl_demo_choice", "ntl_demo_text", "ntl_demo_arithmetic"]
SIZES = {  # Llama widths; GPT-2's 50,257-token vocabulary
    "small": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4),
}
BATCH_SIZE, MAX_LENGTH, MAX_GEN_TOKS = 8, 256, 8


def save_model(size: str, folder: str) -> int:
    """A random-weight Llama of `size` with the GPT-2 tokenizer, saved as an HF folder; returns its parameters."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         initializer_range=0.1, **SIZES[size])
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _settings():
    from ntl_pretrain.eval.config import EvalConfig

    return EvalConfig(arithmetic_n=0, lm_eval_tasks=TASKS, lm_eval_include_path=TASKS_DIR,
                      lm_eval_max_gen_toks=MAX_GEN_TOKS, batch_size=BATCH_SIZE, max_length=MAX_LENGTH)


def worker(kind: str, folder: str, repeat: int) -> None:
    """One process (one rank of `in_loop`): time the evaluation `repeat` times; rank 0 prints the fastest as JSON."""
    from lm_eval.evaluator import evaluate

    from ntl_pretrain.eval.benchmarks.lm_eval import LM_EVAL, load_tasks

    settings = _settings()
    times = []

    def time_in_process(lm) -> float:
        """Time lm-eval's `evaluate` with `lm` `repeat` times (into `times`); the perplexity it gave."""
        for _ in range(repeat):
            tasks = load_tasks(settings.settings_of(LM_EVAL))
            started = time.perf_counter()
            results = evaluate(lm=lm, task_dict=tasks, bootstrap_iters=0, log_samples=False)
            times.append(time.perf_counter() - started)
        return results["results"]["ntl_demo_text"]["word_perplexity,none"]

    if kind == "hflm":
        from lm_eval.models.huggingface import HFLM

        check = time_in_process(HFLM(pretrained=folder, batch_size=BATCH_SIZE, max_length=MAX_LENGTH, device="cpu"))
    elif kind == "sharded_1":
        from transformers import AutoModelForCausalLM

        from ntl_pretrain.eval.lm_eval_model import ShardedLM
        from ntl_pretrain.tokenizer.loading import load_tokenizer

        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        check = time_in_process(ShardedLM(model, load_tokenizer(folder), batch_size=BATCH_SIZE, max_length=MAX_LENGTH))
    else:
        import deepspeed
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        from ntl_pretrain.eval.hooks import run_evaluation
        from ntl_pretrain.tokenizer.loading import load_tokenizer

        deepspeed.init_distributed(dist_backend="gloo")
        world = dist.get_world_size()
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "tensor_parallel": {"autotp_size": world, "vocab_parallel_lm_head": True},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
        model = AutoModelForCausalLM.from_pretrained(folder)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        tokenizer = load_tokenizer(folder)
        load_tasks(settings.settings_of(LM_EVAL))  # the task index built once, as at a run's start-up
        with tempfile.TemporaryDirectory() as out:
            for _ in range(repeat):
                dist.barrier()
                started = time.perf_counter()
                metrics = run_evaluation(engine, tokenizer, settings, step=0, output_dir=out)
                times.append(time.perf_counter() - started)
        check = metrics["eval/lm_eval/ntl_demo_text/word_perplexity"]
        if dist.get_rank() != 0:
            return
    # a figure of the results: the kinds did the same work (equal to float32 rounding)
    print(json.dumps({"kind": kind, "seconds": min(times), "word_perplexity": check}), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(kind: str, folder: str, procs: int, repeat: int, threads: int) -> float:
    """Run `worker(kind)` in fresh processes; the fastest evaluation's seconds."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", kind, folder, "--repeat", str(repeat)]
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    if kind != "in_loop":
        out = subprocess.run(command, env=dict(base, OMP_NUM_THREADS=str(threads)), capture_output=True, text=True,
                             check=False)
        outputs, codes = [out.stdout + out.stderr], [out.returncode]
    else:
        port = _free_port()
        ranks = [subprocess.Popen(command, env=dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(procs),
                                                    LOCAL_WORLD_SIZE=str(procs), MASTER_ADDR="127.0.0.1",
                                                    MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(procs)]
        outputs = [rank.communicate()[0] for rank in ranks]
        codes = [rank.returncode for rank in ranks]
    if any(codes):
        raise SystemExit(f"{kind} failed ({codes}):\n" + "\n----\n".join(o[-3000:] for o in outputs))
    for line in outputs[0].splitlines():
        if line.startswith('{"kind"'):
            result = json.loads(line)
            print(f"  {kind}: {result['seconds']:.2f} s (ntl_demo_text word_perplexity {result['word_perplexity']:.6g})",
                  flush=True)
            return result["seconds"]
    raise SystemExit(f"{kind} printed no result:\n{outputs[0][-3000:]}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium", help=f"comma-separated of {', '.join(SIZES)}")
    parser.add_argument("--procs", type=int, default=2, help="ranks of the in-loop run (AutoTP T=procs), threads else")
    parser.add_argument("--repeat", type=int, default=2, help="evaluations per measurement; the fastest counts")
    parser.add_argument("--threads", type=int, help="threads of the one-process kinds (default: --procs)")
    parser.add_argument("--kinds", default="hflm,sharded_1,in_loop", help="which of hflm, sharded_1, in_loop to time")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], args.repeat)
        return 0
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes {unknown} unknown; choose from {', '.join(SIZES)}")
    rows = []
    for size in sizes:
        folder = tempfile.mkdtemp(prefix=f"bench_lm_eval_{size}_")
        try:
            parameters = save_model(size, folder)
            seconds = {kind: measure(kind, folder, args.procs, args.repeat, args.threads or args.procs)
                       for kind in args.kinds.split(",")}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rows.append((size, parameters, seconds))
        print(json.dumps({"size": size, "parameters": parameters, **seconds}), flush=True)
    if len(rows[0][2]) < 3:
        return 0
    print(f"\n{'size':8} {'params':>10} {'hflm s':>8} {'sharded_1 s':>12} {'in_loop s':>10} "
          f"{'sharded_1/hflm':>15} {'in_loop/hflm':>13}")
    for size, parameters, s in rows:
        print(f"{size:8} {parameters / 1e6:9.1f}M {s['hflm']:8.2f} {s['sharded_1']:12.2f} {s['in_loop']:10.2f} "
              f"{s['sharded_1'] / s['hflm']:15.2f} {s['in_loop'] / s['hflm']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
