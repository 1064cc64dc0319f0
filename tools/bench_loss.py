#!/usr/bin/env python
"""Benchmark the loss alone: forward + backward of CE only vs CE + NTL, ours vs `ntloss`.

For each vocabulary size and TP size, all methods are timed interleaved in the same process(es)
(round-robin over repetitions, so machine noise hits all alike): the cold first iteration, the
median of the warm ones with their spread (min-max), and ratios against CE alone measured in the same
run; each group's line gives the torch threads a process used and the machine's load average before and
after, since on a busy machine the spread, not the median, says how far a ratio can be trusted. Peak memory is
measured per method in a fresh process (per TP group: the largest rank's), on a second call after one
untimed warm-up (peak RSS above the inputs, with glibc's mmap threshold fixed at 64 KiB so freed
tensors leave the resident size), and the bytes each rank sends per collective are counted by
wrapping `torch.distributed.all_reduce`.

CE alone is `torch.nn.functional.cross_entropy` for TP=1 and DeepSpeed's
`deepspeed.sequence.cross_entropy.vocab_parallel_cross_entropy` on the same shard for TP>1. Our methods
run as the trainer calls them, with `check_inputs=False` (the shard layout is checked once at start-up).

The LM head + loss methods start from the hidden states `[n, H]` and the head's weight shard
`[V/T, H]` instead of the logits: `head_*` computes the full logits and the objective on them (for
TP>1 with DeepSpeed's column-parallel input, whose backward all-reduces the hidden gradient),
`chunked_*` the same objective with `ntl_pretrain.loss.chunked` (`--chunk-tokens` rows of logits at
a time; `--chunk-tokens 0`: as many rows as DeepSpeed's fused head takes by default; a suffix
`@rows` or `@vocab_blocks` fixes its gradient algorithm, none leaves it to `auto`), `ds_fused_ce`
DeepSpeed 0.19's fused head + CE (`deepspeed.sequence.linear_cross_entropy`, CE alone) on the same
hidden states and head shard. Each `chunked_*` row reports its time and peak memory relative to the
matching `head_*`, and every head row relative to `ds_fused_ce` when that was measured.

    python tools/bench_loss.py --tokens 4096 16384 --vocab 32000 128256 --tp 1 2 --json bench_loss.json
    python tools/bench_loss.py --tokens 16384 --vocab 128256 --tp 1 --hidden 256 --chunk-tokens 1024 \\
        --methods head_was chunked_was head_was_reweigh chunked_was_reweigh
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def digit_ids_start(vocab_size: int) -> int:
    """Number tokens sit in the middle of the vocabulary, so with TP=2 they straddle both shards."""
    return vocab_size // 2 - 5


def decimal_point_id(vocab_size: int) -> int:
    """The '.' token: just before the digits (del reads decimals after it)."""
    return digit_ids_start(vocab_size) - 1


NUMBER_SHARE = 0.2  # share of label positions that are number tokens
DOT_SHARE = 0.1  # share of those that are a '.' instead of a digit
HEAD_PREFIXES = ("head_", "chunked_", "ds_fused")  # methods that start from the hidden states and the head weight


def is_head_method(name: str) -> bool:
    return name.startswith(HEAD_PREFIXES)


# ------------------------------------------------------------------------------------ methods
def build_methods(tp: int, names: list[str]):
    """name -> (setup(inputs, labels, ctx) -> closure returning a loss); `inputs` are the logits, or
    (hidden, head) for the head methods."""
    import torch.nn.functional as F

    from ntl_pretrain.loss import NTLSettings, ce_ntl_loss
    from ntl_pretrain.loss.chunked import CHUNK_BACKWARDS, chunked_ce_ntl_sums

    def ours(variant: str | None, reweigh: bool = False):
        settings = NTLSettings(variant=variant or "was", reweigh=reweigh)
        weight = 0.0 if variant is None else 0.3
        return lambda logits, labels, ctx: (lambda: ce_ntl_loss(
            logits, labels, ctx["vocab"], ntl_weight=weight, settings=settings, shard=ctx["shard"],
            check_inputs=False))  # as the trainer calls it

    def ce(logits, labels, ctx):
        if tp == 1:
            return lambda: F.cross_entropy(logits, labels)
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

        return lambda: vocab_parallel_cross_entropy(logits, labels, tp_group=ctx["group"],
                                                    vocab_start_index=ctx["start"],
                                                    vocab_end_index=ctx["start"] + logits.shape[-1],
                                                    global_vocab_size=ctx["vocab_size"])

    def reference(reweigh: bool):
        def setup(logits, labels, ctx):
            import ntloss

            loss = ntloss.NTLoss(_BenchTokenizer(ctx["vocab_size"]), reweigh=reweigh)
            return lambda: F.cross_entropy(logits, labels) + 0.3 * loss(logits[None], labels[None])
        return setup

    def head(variant: str | None, reweigh: bool = False):
        settings = NTLSettings(variant=variant or "was", reweigh=reweigh)
        weight = 0.0 if variant is None else 0.3

        def setup(inputs, labels, ctx):
            hidden, module = inputs
            if tp == 1:
                return lambda: ce_ntl_loss(module(hidden), labels, ctx["vocab"], ntl_weight=weight, settings=settings,
                                           check_inputs=False)
            from deepspeed.module_inject.layers import ColumnParallel

            return lambda: ce_ntl_loss(module(ColumnParallel.apply(ctx["group"], hidden)), labels, ctx["vocab"],
                                       ntl_weight=weight, settings=settings, shard=ctx["shard"],
                                       check_inputs=False)
        return setup

    def chunked(variant: str | None, reweigh: bool = False, backward: str = "auto"):
        settings = NTLSettings(variant=variant or "was", reweigh=reweigh)
        weight = 0.0 if variant is None else 0.3

        def setup(inputs, labels, ctx):
            hidden, module = inputs

            def loss():
                # as the trainer calls it: the shard layout is checked once, not per call (no host sync)
                sums = chunked_ce_ntl_sums(hidden, module, labels, ctx["vocab"], settings,
                                           chunk_tokens=ctx["chunk_tokens"], shard=ctx["shard"],
                                           with_ntl=weight != 0, check_inputs=False, backward=backward)
                total = sums.ce_sum / sums.token_count.clamp_min(1)
                return total + weight * sums.ntl_sum / sums.ntl_count.clamp_min(1) if weight else total
            return loss
        return setup

    def deepspeed_fused_ce(inputs, labels, ctx):
        # DeepSpeed 0.19's fused LM head + CE (deepspeed/sequence/linear_cross_entropy.py), CE alone, on the same
        # hidden states and head shard; its default chunking unless --ds-chunk-tokens is given
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        hidden, module = inputs
        options = {"chunk_size": ctx["ds_chunk_tokens"]} if ctx["ds_chunk_tokens"] else {}
        return lambda: vocab_parallel_linear_cross_entropy(
            hidden, module.weight, labels, tp_group=ctx["group"], vocab_start_index=ctx["start"],
            vocab_end_index=ctx["start"] + module.weight.shape[0], **options)

    table = {"ce": ce, "ds_fused_ce": deepspeed_fused_ce, "ours_ce_only": ours(None), "ours_was": ours("was"),
             "ours_was_reweigh": ours("was", True),
             "ours_mse": ours("mse"), "ours_number_level": ours("number_level"),
             "ours_digit_entropy": ours("digit_entropy"), "ours_del": ours("del")}
    objectives = {"ce_only": (None, False), "was": ("was", False), "was_reweigh": ("was", True), "mse": ("mse", False),
                  "number_level": ("number_level", False), "number_level_reweigh": ("number_level", True),
                  "digit_entropy": ("digit_entropy", False), "del": ("del", False)}
    for objective, (variant, reweigh) in objectives.items():
        table[f"head_{objective}"] = head(variant, reweigh)
        table[f"chunked_{objective}"] = chunked(variant, reweigh)  # backward="auto"
        for backward in CHUNK_BACKWARDS[1:]:  # after "auto": e.g. chunked_was@vocab_blocks, that algorithm
            table[f"chunked_{objective}@{backward}"] = chunked(variant, reweigh, backward)
    if tp == 1:
        table.update({"ntloss_was": reference(False), "ntloss_was_reweigh": reference(True)})
    unknown = [name for name in names if name not in table and not name.startswith("ntloss")]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {sorted(table)}")
    return {name: table[name] for name in names if name in table}


class _BenchTokenizer:
    """What `ntloss` reads from a tokenizer: a vocabulary with the ten digits at `digit_ids_start`."""

    def __init__(self, size: int):
        self.vocab = {f"tok{i}": i for i in range(size)}
        for digit in range(10):
            del self.vocab[f"tok{digit_ids_start(size) + digit}"]
            self.vocab[str(digit)] = digit_ids_start(size) + digit

    def get_vocab(self):
        return dict(self.vocab)

    def add_tokens(self, tokens):
        return 0

    def __len__(self):
        return len(self.vocab)


def deepspeed_default_chunk_rows(tokens: int, vocab_size: int, tp: int, hidden: int) -> int:
    """The rows per chunk DeepSpeed's fused head picks by default: the chunks' float32 logits are about as large
    as the hidden states (`ceil(V / T / H)` chunks). `--chunk-tokens 0` gives our chunked head the same."""
    chunks = max(1, math.ceil(math.ceil(vocab_size / tp) / hidden))
    return max(1, math.ceil(tokens / chunks))


# ------------------------------------------------------------------------------------ child
def child(args) -> None:
    import torch
    import torch.distributed as dist

    from ntl_pretrain.loss import VocabShard
    from ntl_pretrain.numbers import NumberVocab

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.tp > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # T processes on one machine: one thread each unless told otherwise
    # else torch's own setting: OMP_NUM_THREADS when set, its default otherwise
    rank = 0
    group = None
    if args.tp > 1:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        rank, group = dist.get_rank(), dist.group.WORLD
    sent_bytes: list[int] = []
    original = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        sent_bytes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *a, **k)

    dist.all_reduce = counting_all_reduce
    vocab_size, n = args.vocab, args.tokens
    width = vocab_size // args.tp
    start = rank * width
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab_size, (n,), generator=generator)
    numbers = torch.rand(n, generator=generator) < NUMBER_SHARE
    labels[numbers] = digit_ids_start(vocab_size) + torch.randint(0, 10, (int(numbers.sum()),), generator=generator)
    labels[numbers & (torch.rand(n, generator=generator) < DOT_SHARE)] = decimal_point_id(vocab_size)  # decimals
    leaves = []  # tensors whose gradient each run recomputes
    logits = head_inputs = None
    if not all(is_head_method(name) for name in args.methods):
        full = torch.randn(n, vocab_size, generator=generator)
        logits = full[:, start:start + width].clone().requires_grad_()
        del full
        leaves.append(logits)
    if any(is_head_method(name) for name in args.methods):
        hidden = torch.randn(n, args.hidden, generator=generator).requires_grad_()
        module = torch.nn.Linear(args.hidden, width, bias=False)
        with torch.no_grad():  # this rank's rows of one full head: logits of about unit scale
            module.weight.copy_(torch.randn(width, args.hidden, generator=torch.Generator().manual_seed(1 + rank))
                                / args.hidden ** 0.5)
        head_inputs = (hidden, module)
        leaves += [hidden, module.weight]
    first_digit = digit_ids_start(vocab_size)
    ctx = {"vocab": NumberVocab(tuple(range(first_digit, first_digit + 10)),
                                tuple(float(d) for d in range(10)), vocab_size,
                                decimal_point_id=decimal_point_id(vocab_size)),
           "group": group, "start": start, "shard": VocabShard(group, start), "vocab_size": vocab_size,
           "ds_chunk_tokens": args.ds_chunk_tokens,
           "chunk_tokens": args.chunk_tokens or deepspeed_default_chunk_rows(n, vocab_size, args.tp, args.hidden)}
    methods = {name: setup(head_inputs if is_head_method(name) else logits, labels, ctx)
               for name, setup in build_methods(args.tp, args.methods).items()}

    def run_once(fn) -> float:
        for leaf in leaves:
            leaf.grad = None
        if group is not None:
            dist.barrier()
        begin = time.perf_counter()
        fn().backward()
        return time.perf_counter() - begin

    result: dict = {}
    if args.mode == "memory":
        (name, fn), = methods.items()
        # One untimed call first, so that one-time allocations (gloo's buffers, kernel caches, tables built on
        # first use) are not charged to the method; then its gradients are dropped and the second call measured.
        run_once(fn)
        for leaf in leaves:
            leaf.grad = None
        baseline = _rss_kib()
        peak_reset = _reset_peak_rss()  # else building the inputs may have set a higher peak already
        sent_bytes.clear()
        run_once(fn)
        peak = _peak_rss_kib() if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        per_rank = [(peak - baseline) / 1024]
        if group is not None:  # the largest rank's peak: TP ranks hold different columns and numbers
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, per_rank[0], group=group)
            per_rank = gathered
        result = {"peak_extra_mib": max(per_rank), "peak_extra_mib_per_rank": per_rank,
                  "bytes_per_collective": list(sent_bytes)}
    else:
        times = {name: [] for name in methods}
        cold = {name: run_once(fn) for name, fn in methods.items()}
        for _ in range(args.reps):
            for name, fn in methods.items():
                times[name].append(run_once(fn))
        result = {name: {"cold_s": cold[name], "median_s": statistics.median(times[name]), "min_s": min(times[name]),
                         "max_s": max(times[name]), "threads": torch.get_num_threads()} for name in methods}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _rss_kib(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss_kib() -> int:
    return _rss_kib("VmHWM:")


def _reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------ parent
def launch(args, mode: str, methods: list[str], vocab: int, tp: int) -> dict:
    from ntl_pretrain.runtime.supervisor import free_port

    port = free_port()
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--tokens", str(args.tokens), "--vocab", str(vocab),
           "--tp", str(tp), "--reps", str(args.reps), "--hidden", str(args.hidden), "--chunk-tokens",
           str(args.chunk_tokens), "--ds-chunk-tokens", str(args.ds_chunk_tokens), "--methods", *methods]
    procs = []
    for rank in range(tp):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
        # A fixed mmap threshold: glibc then returns every freed block of 64 KiB or more to the system at once,
        # so the resident size follows the live tensors (its default threshold grows after the first large free
        # and keeps later blocks in the heap, which made peaks depend on what ran before).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=args.timeout) for proc in procs]
    for proc, (_out, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise SystemExit(f"benchmark child failed:\n{err[-3000:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per rank (rows of the logits)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (processes)")
    parser.add_argument("--reps", type=int, default=7, help="warm repetitions per method")
    parser.add_argument("--methods", nargs="+", default=["ce", "ours_ce_only", "ours_was", "ours_was_reweigh",
                                                          "ntloss_was", "ntloss_was_reweigh"])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H of the head methods")
    parser.add_argument("--chunk-tokens", type=int, default=1024,
                        help="rows of logits per chunk (chunked_*); 0: DeepSpeed's default rows for the shape")
    parser.add_argument("--ds-chunk-tokens", type=int, default=0,
                        help="rows per chunk of ds_fused_ce (0: DeepSpeed's default)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory runs")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per process; 0 (default): torch's own setting (OMP_NUM_THREADS when set, "
                             "else its default) at TP=1, and 1 per rank at TP>1 unless OMP_NUM_THREADS is set")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.tokens = args.tokens[0]
        args.vocab = args.vocab[0]
        args.tp = args.tp[0]
        return child(args)

    rows = []
    token_counts = args.tokens
    for tokens, vocab, tp in ((n, v, t) for n in token_counts for v in args.vocab for t in args.tp):
        args.tokens = tokens  # what `launch` passes to the children of this run
        if vocab % tp:
            raise SystemExit(f"--vocab {vocab} is not divisible by --tp {tp}")
        methods = [m for m in args.methods if tp == 1 or not m.startswith("ntloss")]
        load_before = os.getloadavg()
        timing = launch(args, "time", methods, vocab, tp)
        load = {"load_average_before": list(load_before), "load_average_after": list(os.getloadavg())}
        print(f"n={tokens} V={vocab} tp={tp}: {timing[methods[0]]['threads']} torch thread(s) a process, "
              f"{args.reps} warm repetitions; load average (1/5/15 min) {_loads(load_before)} before, "
              f"{_loads(os.getloadavg())} after, on {os.cpu_count()} cores", flush=True)
        group_rows = []
        for name in methods:
            vs_ce = "ce" in timing and not is_head_method(name)
            row = {"tokens": args.tokens, "vocab": vocab, "tp": tp, "method": name, **timing[name], **load,
                   "ratio_vs_ce": timing[name]["median_s"] / timing["ce"]["median_s"] if vs_ce else None}
            if not args.no_memory:
                row.update(launch(args, "memory", [name], vocab, tp))
            group_rows.append(row)
        for row in group_rows:
            if row["method"].startswith("chunked_"):
                _add_ratios_vs_unchunked(row, group_rows)
            if is_head_method(row["method"]) and row["method"] != "ds_fused_ce":
                _add_ratios_vs_deepspeed_fused(row, group_rows)
            print(_format_row(row), flush=True)
        rows += group_rows
        if args.json:  # after every group: a long sweep stopped midway keeps what it measured
            _write_json(args.json, {"rows": rows, "cpu_count": os.cpu_count()})


def _loads(averages: tuple[float, ...]) -> str:
    return "/".join(f"{value:.2f}" for value in averages)


def _write_json(path: str, document: dict) -> None:
    from ntl_pretrain.core.fs import write_json_atomic

    write_json_atomic(path, document, indent=1)


def _add_ratios_vs_unchunked(row: dict, rows: list[dict]) -> None:
    """Time and peak memory of a chunked_* row relative to the head_* row of the same run (same vocabulary
    and TP size), if that was measured."""
    objective = row["method"][len("chunked_"):].split("@")[0]
    twin = next((other for other in rows if other["method"] == "head_" + objective), None)
    if twin is None:
        return
    row["time_vs_unchunked"] = row["median_s"] / twin["median_s"]
    if "peak_extra_mib" in row and twin.get("peak_extra_mib"):
        row["memory_vs_unchunked"] = row["peak_extra_mib"] / twin["peak_extra_mib"]


def _add_ratios_vs_deepspeed_fused(row: dict, rows: list[dict]) -> None:
    """Time and peak memory of a head row relative to DeepSpeed's fused head + CE of the same run."""
    fused = next((other for other in rows if other["method"] == "ds_fused_ce"), None)
    if fused is None:
        return
    row["time_vs_ds_fused"] = row["median_s"] / fused["median_s"]
    if "peak_extra_mib" in row and fused.get("peak_extra_mib"):
        row["memory_vs_ds_fused"] = row["peak_extra_mib"] / fused["peak_extra_mib"]


def _format_row(row: dict) -> str:
    ratio = f"{row['ratio_vs_ce']:.3f}x" if row.get("ratio_vs_ce") is not None else "-"
    memory = f"  peak +{row['peak_extra_mib']:.0f} MiB" if "peak_extra_mib" in row else ""
    sent = row.get("bytes_per_collective") or []
    comm = f"  sent {sent} B" if 0 < len(sent) <= 8 else (
        f"  sent {len(sent)} collectives, {sum(sent)} B (all in the JSON)" if sent else "")
    versus = ""
    if "time_vs_unchunked" in row:
        versus = f"  vs unchunked: time {row['time_vs_unchunked']:.3f}x"
        if "memory_vs_unchunked" in row:
            versus += f", memory {row['memory_vs_unchunked']:.3f}x"
    if "time_vs_ds_fused" in row:
        versus += f"  vs ds_fused_ce: time {row['time_vs_ds_fused']:.3f}x"
        if "memory_vs_ds_fused" in row:
            versus += f", memory {row['memory_vs_ds_fused']:.3f}x"
    return (f"n={row['tokens']:<6} V={row['vocab']:<7} tp={row['tp']}  {row['method']:<34} "
            f"warm {row['median_s'] * 1e3:8.1f} ms (min-max {row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f})  "
            f"cold {row['cold_s'] * 1e3:8.1f} ms  {ratio:>8}{memory}{comm}"
            f"{versus}")


if __name__ == "__main__":
    from ntl_pretrain.parallel import distributed

    distributed.run_process(main)
