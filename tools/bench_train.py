"""Step time of the training loop with NTL on vs off (CE only), same run otherwise.

Launch it like the trainer (one process per rank), e.g. on CPU:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 tools/bench_train.py --config configs/demo.yaml
It builds the run's engine once, trains `--warmup` steps, then `--steps` measured steps in ABBA order
(on, off, off, on, ...) so drift in machine load hits both sides equally, and prints (and writes with
`--out`) the median step time and tokens/s of each side, the ratio of the medians, and the median of
the per-block ratios (on+on)/(off+off), the figure least disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.train import Trainer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=40, help="measured steps (half with NTL, half without)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()

    with tempfile.TemporaryDirectory(prefix="bench_train_") as scratch:
        overrides = [f"train.output_dir={scratch}/run", f"train.max_steps={args.warmup + args.steps}",
                     "monitor.progress_bar=never", "train.val_every_n_steps=-1", *args.overrides]
        cfg = load_config(args.config, overrides)
        if not cfg.loss.enabled or cfg.loss.ntl_weight == 0:
            parser.error("the config must have NTL on (loss.enabled=true, loss.ntl_weight > 0)")
        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step(with_ntl=True)
        times: dict[bool, list[float]] = {True: [], False: []}
        rates: dict[bool, list[float]] = {True: [], False: []}
        block_ratios = []  # (on + on) / (off + off) within each ABBA block: cancels slow drift in machine load
        block: list[float] = []
        for i in range(args.steps - args.steps % 4):
            with_ntl = (i % 4) in (0, 3)  # ABBA
            figures = trainer.train_step(with_ntl=with_ntl)
            times[with_ntl].append(figures["train/step_time_s"])
            rates[with_ntl].append(figures["train/tokens_per_s"])
            block.append(figures["train/step_time_s"])
            if len(block) == 4:
                block_ratios.append((block[0] + block[3]) / (block[1] + block[2]))
                block = []
        trainer.monitor.close()
    if trainer.layout.is_main:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        result = {
            "config": args.config, "overrides": args.overrides, "world_size": trainer.layout.world_size,
            "tp_size": trainer.layout.tp_size, "zero_stage": cfg.parallel.zero_stage, "measured_steps": args.steps,
            "tokens_per_step": cfg.data.seq_len * cfg.data.micro_batch_size * cfg.train.grad_accum_steps
            * trainer.layout.dp_size,
            "median_step_time_s_ntl_on": on, "median_step_time_s_ntl_off": off,
            "median_tokens_per_s_ntl_on": statistics.median(rates[True]),
            "median_tokens_per_s_ntl_off": statistics.median(rates[False]),
            "step_time_ratio_on_over_off": on / off,
            "median_abba_block_ratio": statistics.median(block_ratios),
        }
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            tmp = f"{args.out}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(result, handle, indent=1)
            os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
