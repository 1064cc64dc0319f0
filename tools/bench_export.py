#!/usr/bin/env python
"""Benchmark of the Hugging Face export (not a timed test): time, peak extra disk and peak memory.

    python tools/bench_export.py                                   # Qwen2.5-0.5B and TinyLlama-1.1B, T=1 and T=2
    python tools/bench_export.py --arch qwen2.5-0.5b --layers 4    # the same architecture with fewer layers
    python tools/bench_export.py --old-tree /tmp/old               # also the export of another checkout ("before")

For each architecture (random weights in a published model's configuration, built from transformers' config
classes: nothing is downloaded) and each tensor-parallel size, 2 CPU processes train one step with ZeRO-3 (fp32,
AdamW) and save a checkpoint of this project's format; then, one after the other, in fresh processes:

- `io`: reading every file of the checkpoint once (16 MiB blocks) and writing as many bytes as the export
  holds, with an fsync: the floor the export is measured against;
- `after`: `export_hf` of this checkout; `before`: `export_hf` of `--old-tree` (e.g. `git archive <commit> |
  tar -x -C /tmp/old`: the export through DeepSpeed's universal conversion).

Peak RSS is the export process's own maximum (`ru_maxrss`), also shown above that of a process that only
imports what the export imports and builds the model on the meta device; peak extra disk is the most the output's parent
folder (which holds nothing else) held at any moment beyond the finished export, sampled every 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

ARCHITECTURES = {  # the published config.json values (vocabulary, widths, heads, depth, tied embeddings)
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def model_config(arch: str, layers: int | None):
    from transformers import AutoConfig

    values = dict(ARCHITECTURES[arch])
    if layers:
        values["num_hidden_layers"] = layers
    return AutoConfig.for_model(**values)


def make_checkpoint(run_dir: str, arch: str, layers: int | None, tp_size: int) -> None:
    """One rank of the checkpoint writer (started by `save_checkpoint` with torch.distributed's environment)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.checkpoint import CheckpointManager
    from ntl_pretrain.config.schema import CheckpointConfig
    from ntl_pretrain.parallel.layout import ParallelLayout

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(arch, layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                 "zero_optimization": {"stage": 3}, "steps_per_print": 2**31 - 1}
    if tp_size > 1:
        ds_config["tensor_parallel"] = {"autotp_size": tp_size}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    del model
    loss = engine(input_ids=torch.arange(8).unsqueeze(0)).logits.float().mean()
    engine.backward(loss)
    engine.step()
    layout = ParallelLayout.of(world, rank, rank, tp_size)
    manager = CheckpointManager(CheckpointConfig(), run_dir, layout, 3, {"bench": arch}, seed=0)

    def write_hf(folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        config.save_pretrained(folder)

    manager.save(engine, 1, {"step": 1, "tokens_seen": 8}, write_hf)
    dist.barrier()


def save_checkpoint(run_dir: str, arch: str, layers: int | None, tp_size: int, timeout: float) -> str:
    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        command = [sys.executable, os.path.abspath(__file__), "--make", run_dir, "--arch", arch, "--tp", str(tp_size)]
        if layers:
            command += ["--layers", str(layers)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        errors = [proc.communicate(timeout=timeout)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"saving the {arch} checkpoint failed:\n" + "\n".join(error[-3000:] for error in errors))
    return os.path.join(run_dir, "global_step1")


def folder_bytes(path: str) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed while walking
    return total


EXPORT = ("import sys; sys.path.insert(0, sys.argv[1]); from ntl_pretrain.checkpoint import export_hf; "
          "print('export_hf seconds', export_hf(sys.argv[2], sys.argv[3])['seconds'])")
BASELINE = ("import sys, os, torch; sys.path.insert(0, sys.argv[1]); import ntl_pretrain.checkpoint.export, "
            "deepspeed.checkpoint.ds_to_universal; from transformers import AutoConfig, AutoModelForCausalLM; "
            "config = AutoConfig.from_pretrained(os.path.join(sys.argv[2], 'hf'));\n"
            "with torch.device('meta'): AutoModelForCausalLM.from_config(config)")  # all an export imports and builds
IO_FLOOR = """
import os, sys
total = 0
for name in sorted(os.listdir(sys.argv[1])):
    path = os.path.join(sys.argv[1], name)
    if os.path.isfile(path):
        with open(path, "rb", buffering=0) as handle:
            while block := handle.read(16 << 20):
                total += len(block)
block, left = bytes(16 << 20), int(sys.argv[3])
with open(os.path.join(sys.argv[2], "floor.bin"), "wb") as handle:
    while left > 0:
        left -= handle.write(block[:min(left, len(block))])
    handle.flush(); os.fsync(handle.fileno())
"""


def measure(command: list[str], watch: str) -> dict:
    """Run `command` (a process of its own); its wall time, peak RSS and the peak bytes under `watch`."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], folder_bytes(watch))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    with tempfile.TemporaryFile() as errors, tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(command, stdout=output, stderr=errors,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak RSS, not the largest child's so far
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
        if proc.returncode:
            errors.seek(0)
            raise SystemExit(f"{command[:3]} failed:\n{errors.read().decode(errors='replace')[-3000:]}")
        output.seek(0)
        printed = [line.split()[-1] for line in output.read().decode().splitlines() if line.startswith("export_hf seconds")]
    return {"seconds": seconds, "peak_disk": max(peak[0], folder_bytes(watch)), "peak_rss": usage.ru_maxrss * 1024,
            "inside_seconds": float(printed[-1]) if printed else None}


def bench(checkpoint: str, work: str, trees: dict[str, str]) -> list[dict]:
    rows = []
    for label, tree in trees.items():
        out_parent = os.path.join(work, label)
        os.makedirs(out_parent)
        figures = measure([sys.executable, "-c", EXPORT, tree, checkpoint, os.path.join(out_parent, "hf")], out_parent)
        export = os.path.join(out_parent, "hf")
        shards = [os.path.getsize(os.path.join(export, n)) for n in os.listdir(export) if n.endswith(".safetensors")]
        figures.update(label=label, export_bytes=folder_bytes(export), largest_shard=max(shards))
        rows.append(figures)
        shutil.rmtree(out_parent)
    baseline = measure([sys.executable, "-c", BASELINE, REPO, checkpoint], work)["peak_rss"]
    floor_dir = os.path.join(work, "io")
    os.makedirs(floor_dir)
    floor = measure([sys.executable, "-c", IO_FLOOR, checkpoint, floor_dir, str(rows[0]["export_bytes"])], floor_dir)
    shutil.rmtree(floor_dir)
    for row in rows:
        row["io_seconds"], row["baseline_rss"] = floor["seconds"], baseline
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench_export.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", choices=sorted(ARCHITECTURES), help="default: all")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than published")
    parser.add_argument("--tp", action="append", type=int, choices=(1, 2), help="default: 1 and 2")
    parser.add_argument("--old-tree", default=None, help="a checkout whose export_hf is measured as 'before'")
    parser.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--checkpoint", default=None, help="measure this existing checkpoint instead of making ones")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (in --work)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for saving one checkpoint")
    parser.add_argument("--make", default=None, help=argparse.SUPPRESS)  # a rank of the checkpoint writer
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.make:
        make_checkpoint(args.make, args.arch[0], args.layers, args.tp[0])
        return 0
    trees = {"after": REPO, **({"before": os.path.abspath(args.old_tree)} if args.old_tree else {})}
    results = []
    if args.checkpoint:
        work = tempfile.mkdtemp(prefix="bench_export_", dir=args.work)
        try:
            for row in bench(os.path.abspath(args.checkpoint), work, trees):
                row.update(arch=args.checkpoint, tp="", checkpoint_bytes=folder_bytes(args.checkpoint))
                results.append(row)
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for arch in [] if args.checkpoint else args.arch or sorted(ARCHITECTURES):
        for tp in args.tp or (1, 2):
            work = tempfile.mkdtemp(prefix="bench_export_", dir=args.work)
            try:
                started = time.perf_counter()
                checkpoint = save_checkpoint(os.path.join(work, "run"), arch, args.layers, tp, args.timeout)
                print(f"{arch} T={tp}: checkpoint {folder_bytes(checkpoint) / 2**30:.2f} GiB in "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
                for row in bench(checkpoint, work, trees):
                    row.update(arch=arch + (f" ({args.layers} layers)" if args.layers else ""), tp=tp,
                               checkpoint_bytes=folder_bytes(checkpoint))
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
    print("\n| model | T | export | checkpoint | export (MiB) | largest shard (MiB) | time (s) | read+write once (s) "
          "| time / io | export_hf's own time (s) | peak extra disk / export | peak RSS (MiB) | RSS / largest shard "
          "| RSS above imports (MiB) | that / largest shard |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        mib = 2**20
        extra = max(0, row["peak_disk"] - row["export_bytes"])
        rss = row["peak_rss"]  # bytes
        print(f"| {row['arch']} | {row['tp']} | {row['label']} | {row['checkpoint_bytes'] / 2**30:.2f} GiB | "
              f"{row['export_bytes'] / mib:.0f} | {row['largest_shard'] / mib:.0f} | {row['seconds']:.1f} | "
              f"{row['io_seconds']:.1f} | {row['seconds'] / row['io_seconds']:.2f} | "
              f"{row['inside_seconds'] or 0:.1f} | {extra / row['export_bytes']:.2f} | "
              f"{rss / mib:.0f} | {rss / row['largest_shard']:.2f} | "
              f"{(rss - row['baseline_rss']) / mib:.0f} | {(rss - row['baseline_rss']) / row['largest_shard']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
