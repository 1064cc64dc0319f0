#!/usr/bin/env python
"""Data path at cluster scale, measured on one machine: bytes each data-parallel rank reads, a resume's
reads, and the time to the first step from raw text against a prepared corpus.

    python tools/bench_data.py --shard-mb 1 4 --out bench_data.json
    python tools/bench_data.py --shards 2 --shard-mb 2 4 --parts a   # fewer files than ranks: byte ranges

For each size, writes a generated number-rich corpus of `--shards` jsonl shards (default 16, `--shard-mb` MB
each) and runs
each measurement as its own process (one per rank: a rank's stream is built for rank r of n without
launching the others), reading the process's `rchar` in /proc/self/io (bytes read through read
syscalls, page cache included) around the data work, with the GPT-2 tokenizer of ../shared/data:

(a) streamed, per rank: `--steps` steps of a fixed global batch (4 micro-batches of `--micro-batch`
    sequences of `--seq-len`: grad_accum 4/dp) at dp 1, 2 and 4: each rank's bytes, and the tokens/s of
    the data path on one rank (dp 1);
(b) resume at half: the dp-1 run stops after half the steps and saves its data state as the checkpoint
    does; a new process loads it and takes one step: its bytes up to the end of that step (the step's own
    data included), against the bytes the first half read and one of its steps read; and the same with
    the state a checkpoint of the previous version held (the position only: the stream re-read up to it);
(d) the trainer's own start-up reads (`--parts d`): the real `Trainer` in one process (a world of one, the demo's
    model, the GPT-2 tokenizer, the corpus streamed): bytes read by its imports, by `Trainer(cfg)` (tokenizer,
    model, DeepSpeed's start-up, the data's first reads) and by step 1. Run at two corpus sizes: start-up reads that
    do not grow with the corpus are not the corpus (about 100 MB of imports and 110 MB of start-up here, libraries
    and their data files, whatever the corpus size);
(c) time to the first step at 2 ranks (rank 0 then rank 1, as the trainer's local-rank-0-first order)
    from raw text (in-memory source: tokenized at start-up into a fresh cache) against a corpus made by
    tools/prepare_data.py (the preparation timed apart).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2_DIR = os.path.join(ROOT, "..", "shared", "data", "tokenizers", "gpt2")
GPT2 = os.path.join(GPT2_DIR, "tokenizer.json")
SHARDS = 16
WORDS = ("the", "total", "of", "sold", "price", "is", "and", "each", "year", "about", "percent", "rose", "to",
         "from", "in", "units", "between", "measured", "average", "km")


def write_corpus(folder: str, shard_bytes: int, doc_words: tuple[int, int] = (40, 400), seed: int = 0,
                 shards: int = SHARDS) -> int:
    """`shards` jsonl files of about `shard_bytes` each of generated number-rich documents; returns the bytes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    total = 0
    for shard in range(shards):
        lines, size = [], 0
        while size < shard_bytes:
            n = int(rng.integers(*doc_words))
            words = rng.choice(WORDS, size=n)
            numbers = rng.integers(0, 100000, size=n)
            text = " ".join(f"{w} {x}" if x % 3 == 0 else w for w, x in zip(words, numbers))
            line = json.dumps({"text": f"Shard {shard}: {text}."}) + "\n"
            lines.append(line)
            size += len(line)
        with open(os.path.join(folder, f"part-{shard:02d}.jsonl"), "w") as handle:
            handle.writelines(lines)
        total += size
    return total


def _rchar() -> int:
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("rchar:")).split()[1])


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=GPT2, eos_token="<|endoftext|>")


def _config(args: dict, source: dict):
    from ntl_pretrain.config import DataConfig, DataSourceConfig

    return DataConfig(sources=[DataSourceConfig(**source)], seq_len=args["seq_len"],
                      micro_batch_size=args["micro_batch"], validation_documents=20, seed=1,
                      cache_dir=args["cache"])


def rank_worker(args: dict) -> dict:
    """One rank's measurement (run in its own process): see the module's docstring."""
    from ntl_pretrain.data import PretrainingData

    import datasets  # noqa: F401  (what the data path imports is read before the measurement)
    import datasets.packaged_modules.json.json  # noqa: F401
    import pyarrow.json  # noqa: F401

    tokenizer = _tokenizer()
    dp, rank = args["dp"], args["rank"]
    accum = 4 // dp
    started, before = time.perf_counter(), _rchar()
    data = PretrainingData.build(_config(args, args["source"]), tokenizer, dp_rank=rank, dp_size=dp)
    if args.get("state"):
        with open(args["state"]) as handle:
            data.load_state_dict(json.load(handle))
    built, build_read = time.perf_counter(), _rchar() - before
    first_step_read = None
    tokens = 0
    for step in range(args["steps"]):
        batches = data.next_step(accum)
        tokens += sum(int(mb.input_ids.numel()) for mb in batches)
        if step == 0:
            first_step_read, first_step_s = _rchar() - before, time.perf_counter() - started
    out = {"read": _rchar() - before, "build_read": build_read, "first_step_read": first_step_read, "first_step_s": first_step_s,
           "build_s": built - started, "steps_s": time.perf_counter() - built, "tokens": tokens}
    if args.get("save_state"):
        with open(args["save_state"], "w") as handle:
            json.dump(data.state_dict(), handle)
    return out


def trainer_worker(args: dict) -> dict:
    """(d): one process, a world of one: the trainer's reads by its imports, by Trainer(cfg) and by step 1."""
    before_imports = _rchar()
    from ntl_pretrain.config import load_config
    from ntl_pretrain.trainer.trainer import Trainer

    imports = _rchar() - before_imports
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args["port"]))
    cfg = load_config(os.path.join(ROOT, "configs", "demo.yaml"), [
        f"data.sources=[{{path: {args['source']['path']}, streaming: true}}]", f"tokenizer.name_or_path={GPT2_DIR}",
        "tokenizer.digit_level=false", "loss.enabled=false", "data.validation_documents=0", "train.val_every_n_steps=-1",
        "eval.at_end=false", f"train.output_dir={args['out']}", "train.max_steps=1", "monitor.progress_bar=never",
        "parallel.tp_size=1", f"data.seq_len={args['seq_len']}", f"data.micro_batch_size={args['micro_batch']}"])
    before = _rchar()
    trainer = Trainer(cfg)
    started = _rchar()
    trainer.train_step()
    return {"imports_read": imports, "startup_read": started - before, "step_read": _rchar() - started}


def _run(args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_DISABLE_PROGRESS_BARS="1")
    mode = "_trainer" if args.get("trainer") else "_rank"
    done = subprocess.run([sys.executable, os.path.abspath(__file__), mode, json.dumps(args)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"rank process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_size(work: str, shard_mb: float, steps: int, seq_len: int, micro_batch: int, words: tuple[int, int],
               parts: str, shards: int = SHARDS) -> dict:
    folder = os.path.join(work, f"corpus-{shards}x{shard_mb}mb")
    corpus_bytes = write_corpus(folder, int(shard_mb * 2**20), words, shards=shards)
    base = {"seq_len": seq_len, "micro_batch": micro_batch, "cache": os.path.join(work, f"cache-{shard_mb}"),
            "source": {"path": folder, "streaming": True}}
    result: dict = {"corpus_bytes": corpus_bytes, "steps": steps, "per_rank": {}}
    for dp in (1, 2, 4) if "a" in parts else ():  # (a)
        ranks = [_run({**base, "dp": dp, "rank": r, "steps": steps}) for r in range(dp)]
        result["per_rank"][dp] = {"read": [r["read"] for r in ranks], "build_read": [r["build_read"] for r in ranks],
                                  "tokens": [r["tokens"] for r in ranks],
                                  "steps_s": [r["steps_s"] for r in ranks]}
    if "a" in parts:
        one = result["per_rank"][1]
        result["tokens_per_s_per_rank"] = one["tokens"][0] / one["steps_s"][0]
    if "d" in parts:  # (d) the trainer's start-up
        from ntl_pretrain.runtime.launcher import free_port

        result["trainer"] = _run({**base, "trainer": True, "port": free_port(), "out": os.path.join(work, f"run-{shard_mb}")})
    if "b" not in parts:
        return result
    state = os.path.join(work, f"state-{shard_mb}.json")  # (b)
    half = _run({**base, "dp": 1, "rank": 0, "steps": steps // 2, "save_state": state})
    resumed = _run({**base, "dp": 1, "rank": 0, "steps": 1, "state": state})
    with open(state) as handle:
        old = {k: v for k, v in json.load(handle).items() if k != "streams"}  # the previous version's state
    old_state = os.path.join(work, f"state-old-{shard_mb}.json")
    with open(old_state, "w") as handle:
        json.dump(old, handle)
    reread = _run({**base, "dp": 1, "rank": 0, "steps": 1, "state": old_state})
    result["resume"] = {"first_half_read": half["read"] - half["build_read"],  # past the start-up reads
                        "step_read": (half["read"] - half["build_read"]) / (steps // 2),  # a step's own data
                        "resumed_first_step_read": resumed["first_step_read"] - resumed["build_read"],
                        "position_only_first_step_read": reread["first_step_read"] - reread["build_read"],
                        "resumed_first_step_s": resumed["first_step_s"], "position_only_first_step_s": reread["first_step_s"]}
    if "c" not in parts:
        return result
    # (c) raw text tokenized at start-up (fresh cache) vs prepared once
    raw = {**base, "cache": os.path.join(work, f"cache-raw-{shard_mb}"), "source": {"path": folder}}
    raw_ranks = [_run({**raw, "dp": 2, "rank": r, "steps": 1}) for r in range(2)]
    from ntl_pretrain.data.prepared import prepare_corpus

    started = time.perf_counter()
    prepared = prepare_corpus(_config({**raw, "cache": os.path.join(work, f"cache-prep-{shard_mb}")},
                                      {"path": folder}), _tokenizer(), os.path.join(work, f"prepared-{shard_mb}"), 1)
    prepare_s = time.perf_counter() - started
    prep = {**base, "source": {"path": prepared[0], "format": "prepared"}}
    prep_ranks = [_run({**prep, "dp": 2, "rank": r, "steps": 1}) for r in range(2)]
    result["first_step"] = {"raw_s": [r["first_step_s"] for r in raw_ranks],
                            "prepared_s": [r["first_step_s"] for r in prep_ranks], "prepare_s": prepare_s}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        print(json.dumps(rank_worker(json.loads(argv[1]))))
        return 0
    if argv[:1] == ["_trainer"]:
        print(json.dumps(trainer_worker(json.loads(argv[1]))), flush=True)
        os._exit(0)  # as the trainer's own processes end: without the interpreter's slow teardown
    parser = argparse.ArgumentParser(prog="tools/bench_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard-mb", type=float, nargs="+", default=[1.0, 4.0], help="MB per shard, one run each")
    parser.add_argument("--shards", type=int, default=SHARDS, help="jsonl files of the corpus (fewer than 4: (a)'s "
                        "dp 2 and 4 read byte ranges of them)")
    parser.add_argument("--steps", type=int, default=None, help="steps of (a) (default: half of one pass at dp 1)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--doc-words", type=int, nargs=2, default=[40, 400], help="words per document (range)")
    parser.add_argument("--parts", default="abc",
                        help="which measurements: a (per rank), b (resume), c (first step), d (the trainer's start-up)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each size's figures as soon as they are measured
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as work:
        for shard_mb in args.shard_mb:
            # ~0.3 GPT-2 tokens a byte of this text: half of the corpus in steps of 4 x micro_batch x seq_len
            steps = args.steps or max(2, int(args.shards * shard_mb * 2**20 * 0.3 / 2 / (4 * args.micro_batch * args.seq_len)))
            results[shard_mb] = result = bench_size(work, shard_mb, steps, args.seq_len, args.micro_batch,
                                                    tuple(args.doc_words), args.parts, args.shards)
            mb = result["corpus_bytes"] / 2**20
            print(f"corpus {mb:.0f} MB in {args.shards} shards, {steps} steps of {4 * args.micro_batch} x {args.seq_len} tokens")
            one = result["per_rank"].get(1)
            for dp, figures in result["per_rank"].items():
                one_steps = one["read"][0] - one["build_read"][0]
                steps_read = [r - b for r, b in zip(figures["read"], figures["build_read"])]
                print(f"  dp {dp}: MB read per rank {[round(r / 2**20, 2) for r in figures['read']]} (start-up "
                      f"{[round(r / 2**20, 2) for r in figures['build_read']]}, steps "
                      f"{[round(r / 2**20, 2) for r in steps_read]}); max/dp1 {max(figures['read']) / one['read'][0]:.3f}, "
                      f"steps only {max(steps_read) / one_steps:.3f} (1/dp = {1 / dp:.3f})")
            if one:
                print(f"  data path on one rank: {result['tokens_per_s_per_rank']:.0f} tokens/s")
            resume = result.get("resume")
            if resume:
                print(f"  resume at half (past the start-up reads): first half read {resume['first_half_read'] / 2**20:.2f} "
                      f"MB; the first resumed step {resume['resumed_first_step_read'] / 2**20:.2f} MB "
                      f"({resume['resumed_first_step_read'] / resume['first_half_read']:.1%}; one step of the first half read "
                      f"{resume['step_read'] / 2**20:.2f} MB); position only "
                      f"(previous version) {resume['position_only_first_step_read'] / 2**20:.2f} MB")
            trainer = result.get("trainer")
            if trainer:
                print(f"  trainer (world of one): imports {trainer['imports_read'] / 2**20:.1f} MB, Trainer(cfg) "
                      f"{trainer['startup_read'] / 2**20:.1f} MB, step 1 {trainer['step_read'] / 2**20:.2f} MB "
                      f"(corpus {mb:.0f} MB)")
            first = result.get("first_step")
            if first:
                print(f"  first step at 2 ranks: raw {sum(first['raw_s']):.1f} s (rank 0 {first['raw_s'][0]:.1f} s, then "
                      f"rank 1 {first['raw_s'][1]:.1f} s), prepared {max(first['prepared_s']):.1f} s (made once in "
                      f"{first['prepare_s']:.1f} s)")
            if args.out:
                from ntl_pretrain.core.fs import write_json_atomic

                write_json_atomic(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
