#!/usr/bin/env python
"""Benchmark Ulysses sequence parallelism: peak memory per rank and tokens/s of one training step (forward,
CE + NTL on the sequence shard, backward, AdamW) at each sequence length, with sp = 1 and sp > 1.

The model is configs/demo.yaml's architecture (Llama, hidden 128, 4 layers, 4 heads, 2 kv heads; `--hidden`
and `--layers` make it larger), vocabulary `--vocab`, float32, sdpa attention, under DeepSpeed ZeRO-3 on CPU
ranks (gloo), one micro-batch of one packed row per sequence-parallel group and sp processes (dp = 1), with the
same functions the trainer calls (`ntl_pretrain.parallel.ulysses`, `loss.sequence_shard`).

Memory is the process's peak resident set (RSS, VmHWM, reset before the measured step: torch's CPU allocator
keeps no statistics) above its RSS just before that step, on the step after one untimed warm-up step, with
glibc's mmap threshold fixed at 64 KiB so freed tensors leave the resident set: through forward + backward
(activations, logits, the gradients being reduced and the temporaries: what sequence parallelism splits) and
through the whole step (also AdamW's temporaries over this rank's ZeRO partition). The largest rank's is
reported. Time is the median of `--steps` measured steps after
the warm-up; tokens/s counts the whole row (seq_len) per step, so sp ranks sharing one row is a speed-up only
where they run in parallel (each rank here has `--threads` threads; the machine's cores bound it).

    python tools/bench_sp.py --seq-len 4096 16384 --sp 1 2 --json bench_sp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss_kib(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


# ------------------------------------------------------------------------------------ child (one rank)
def child(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    from ntl_pretrain.loss import NTLSettings, ce_ntl_sums, scaled_micro_batch_loss
    from ntl_pretrain.loss.normalize import StepCounts
    from ntl_pretrain.loss.sequence_shard import SequenceShard, shard_term_positions
    from ntl_pretrain.numbers import NumberVocab
    from ntl_pretrain.parallel.ulysses import register_ulysses_attention, shard_inputs

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed("gloo")
    architecture = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["model"]["architecture"]
    architecture = {k: v for k, v in architecture.items() if k != "model_type"}
    architecture.update(max_position_embeddings=args.seq_len, vocab_size=args.vocab)
    if args.hidden:
        architecture.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        architecture.update(num_hidden_layers=args.layers)
    config = LlamaConfig(**architecture)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ulysses = register_ulysses_attention(model, args.sp, micro_batch_size=1) if args.sp > 1 else None
    mpu, shard = (ulysses.mpu, ulysses.shard) if ulysses else (None, SequenceShard())
    engine, *_ = deepspeed.initialize(model=model, mpu=mpu, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "sequence_parallel_size": args.sp})
    settings = NTLSettings(variant=args.variant)
    vocab = NumberVocab(tuple(range(10, 20)), tuple(float(v) for v in range(10)), args.vocab)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab, (1, args.seq_len + 1), generator=generator)
    labels = input_ids[:, 1:].contiguous()
    inputs = shard_inputs(input_ids[:, :-1].contiguous(), shard)
    local_labels = shard.split(labels)
    counts = torch.stack([(local_labels != -100).sum(), shard_term_positions(labels, shard, vocab, settings).sum()])
    counts = counts.double()
    if shard.size > 1:
        dist.all_reduce(counts, group=shard.group)
    counts = StepCounts(tokens=counts[0], ntl_positions=counts[1])

    peaks: list[float] = []  # of the measured step: [forward + backward, the whole step] above its start

    def step(baseline: int | None = None) -> float:
        start = time.perf_counter()
        logits = engine(**inputs.as_kwargs()).logits
        sums = ce_ntl_sums(logits, local_labels, vocab, settings, check_inputs=False)
        del logits
        engine.backward(scaled_micro_batch_loss(sums, counts, 0.3, engine.seq_dp_world_size, 1))
        if baseline is not None:
            peaks.append((_rss_kib("VmHWM:") - baseline) / 1024)
        engine.step()
        if baseline is not None:
            peaks.append((_rss_kib("VmHWM:") - baseline) / 1024)
        return time.perf_counter() - start

    step()  # warm-up: one-time allocations (optimizer states, gloo buffers) are not the step's
    baseline = _rss_kib()
    _reset_peak_rss()
    times = [step(baseline)]
    times += [step() for _ in range(args.steps - 1)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, peaks)
    if dist.get_rank() == 0:
        median = statistics.median(times)
        print("RESULT " + json.dumps({
            "seq_len": args.seq_len, "sp": args.sp, "peak_fwd_bwd_mib": max(p[0] for p in gathered),
            "peak_step_mib": max(p[1] for p in gathered), "peaks_per_rank": gathered,
            "step_s": median, "step_s_min": min(times), "step_s_max": max(times),
            "tokens_per_s": args.seq_len / median, "threads_per_rank": args.threads}), flush=True)


# ------------------------------------------------------------------------------------ parent
def launch(args, seq_len: int, sp: int) -> dict:
    from ntl_pretrain.runtime.launcher import free_port

    port = free_port()
    command = [sys.executable, __file__, "--child", "--seq-len", str(seq_len), "--sp", str(sp), "--steps",
               str(args.steps), "--threads", str(args.threads), "--vocab", str(args.vocab), "--hidden",
               str(args.hidden), "--layers", str(args.layers), "--variant", args.variant]
    procs = []
    for rank in range(sp):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(sp), LOCAL_WORLD_SIZE=str(sp),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))  # freed blocks leave the RSS at once
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=args.timeout) for proc in procs]
    for proc, (_out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"benchmark child (seq_len {seq_len}, sp {sp}) failed:\n{err[-3000:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (the demo tokenizer's)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (0: the demo's 128)")
    parser.add_argument("--layers", type=int, default=0, help="layers (0: the demo's 4)")
    parser.add_argument("--variant", default="was", help="NTL variant")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.seq_len = args.seq_len[0]
        args.sp = args.sp[0]
        child(args)
        return
    results = []
    print(f"{'seq_len':>8} {'sp':>3} {'fwd+bwd MiB':>12} {'vs sp=1':>8} {'step MiB':>9} {'vs sp=1':>8} "
          f"{'step s':>7} {'tokens/s':>9} {'vs sp=1':>8}")
    for seq_len in args.seq_len:
        base = None
        for sp in args.sp:
            result = launch(args, seq_len, sp)
            results.append(result)
            base = base or result
            print(f"{seq_len:>8} {sp:>3} {result['peak_fwd_bwd_mib']:>12.0f} "
                  f"{result['peak_fwd_bwd_mib'] / base['peak_fwd_bwd_mib']:>8.2f} {result['peak_step_mib']:>9.0f} "
                  f"{result['peak_step_mib'] / base['peak_step_mib']:>8.2f} {result['step_s']:>7.2f} "
                  f"{result['tokens_per_s']:>9.0f} {result['tokens_per_s'] / base['tokens_per_s']:>8.2f}", flush=True)
    if args.json:
        from ntl_pretrain.core.fs import write_json_atomic

        write_json_atomic(args.json, results, indent=1)


if __name__ == "__main__":
    main()
