"""Training stall per checkpoint save, synchronous vs asynchronous (`checkpoint.async_save`), at two model sizes.

Launch it like the trainer (one process per rank), e.g. on CPU:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 tools/bench_checkpoint_async.py --config configs/demo.yaml
(or `python tools/bench_checkpoint_async.py ...`: one process). For each size it trains the same run three times
in this process, in the order sync, async, none (no checkpoint), each `--saves` checkpoints `--every` steps
apart plus `--every - 1` steps after the last (so the last background save overlaps steps as the others do),
and prints (with `--out`, writes) per size and mode:

- `stall_s_per_save`: the time the step loop was blocked by checkpointing, per save: the whole save when
  synchronous; when asynchronous, the snapshot into host memory, the per-step poll while a save is written,
  any wait for a write still running at the next save or at the end, and the commit (manifest, rename,
  keep-last-K);
- `fit_s` and `extra_fit_s_per_save`: the wall time of `Trainer.fit` and its excess over the run without
  checkpoints per save: what a save costs the run in all, including the background writer's competition with
  the training for the cores and the disk;
- the ratios async / sync of both, per size.

Sizes: the config's model (`small`) and one with `--large` (hidden:intermediate:layers, default 384:1024:6,
about 10M parameters with the demo's 512-token vocabulary; the attention heads stay the config's).
Figures from one run on one machine: compare within a run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.core.fs import write_json_atomic  # noqa: E402
from ntl_pretrain.trainer.trainer import Trainer  # noqa: E402

MODES = ("sync", "async", "none")


def run_once(config: str, overrides: list[str]) -> dict:
    """Train one run to its end; its fit time, checkpoint stall, saves, bytes and parameters."""
    trainer = Trainer(load_config(config, overrides))
    started = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - started
    checkpoints = trainer.parts.checkpoints
    trainer.parts.lock.release()  # the next run of this process uses another folder; released as the command line does
    return {"fit_s": fit_s, "stall_s": checkpoints.stall_s, "saves": checkpoints.saves,
            "checkpoint_bytes": checkpoints.last_save.get("bytes"),  # all ranks' files (synchronous saves)
            "rank_bytes": checkpoints.last_save.get("rank_bytes"),  # this rank's snapshot (asynchronous saves)
            "parameters": trainer.parts.model_report.parameters,
            "world_size": trainer.parts.layout.world_size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per run")
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--large", default="384:1024:6", help="hidden:intermediate:layers of the large size")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    hidden, intermediate, layers = (int(x) for x in args.large.split(":"))
    sizes = {"small": [], "large": [f"model.architecture.hidden_size={hidden}",
                                    f"model.architecture.intermediate_size={intermediate}",
                                    f"model.architecture.num_hidden_layers={layers}"]}
    max_steps = args.saves * args.every + args.every - 1
    results: dict = {"config": args.config, "overrides": args.overrides, "saves": args.saves, "every": args.every,
                     "steps": max_steps, "sizes": {}}
    # one folder for all ranks of this launch (each rank's own temporary name would split the checkpoint)
    scratch = os.path.join(tempfile.gettempdir(), f"bench_ckpt_async_{os.environ.get('MASTER_PORT', os.getpid())}")
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        for size, model in sizes.items():
            figures = {}
            for mode in MODES:
                overrides = [f"train.output_dir={scratch}/{size}_{mode}", f"train.max_steps={max_steps}",
                             "monitor.progress_bar=never", "train.val_every_n_steps=-1", "eval.at_end=false",
                             "eval.every_n_steps=0", "checkpoint.save_final=false", "checkpoint.keep_last=2",
                             f"checkpoint.every_n_steps={0 if mode == 'none' else args.every}",
                             f"checkpoint.async_save={str(mode == 'async').lower()}", *model, *args.overrides]
                figures[mode] = run_once(args.config, overrides)
            none_s = figures["none"]["fit_s"]
            for mode in ("sync", "async"):
                f = figures[mode]
                f["stall_s_per_save"] = f["stall_s"] / max(f["saves"], 1)
                f["extra_fit_s_per_save"] = (f["fit_s"] - none_s) / max(f["saves"], 1)
            figures["stall_ratio_async_over_sync"] = (figures["async"]["stall_s_per_save"]
                                                      / figures["sync"]["stall_s_per_save"])
            figures["extra_fit_ratio_async_over_sync"] = (figures["async"]["extra_fit_s_per_save"]
                                                          / figures["sync"]["extra_fit_s_per_save"])
            results["sizes"][size] = figures
    finally:
        if main_rank:  # after the last run's end, which every rank reached together
            shutil.rmtree(scratch, ignore_errors=True)
    if main_rank:
        print(json.dumps(results, indent=1), flush=True)
        if args.out:
            write_json_atomic(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
