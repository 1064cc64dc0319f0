"""Step time of the training loop with NTL on vs off (CE only), or with `--compare document_mask` attention inside
each packed document vs across the row (data.document_mask), same run otherwise.

Launch it like the trainer (one process per rank), e.g. on CPU:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 tools/bench_train.py --config configs/demo.yaml
It builds the run's engine once, trains `--warmup` steps, then `--steps` measured steps in ABBA order
(on, off, off, on, ...) so drift in machine load hits both sides equally, and prints (and writes with
`--out`) the median step time and tokens/s of each side, the ratio of the medians, and the median of
the per-block ratios (on+on)/(off+off), the figure least disturbed by other load on the machine. The keys name
the switch compared: `median_step_time_s_ntl_on`, ... or `median_step_time_s_document_mask_on`, ...

Every step is a logging step here (`train.log_every_n_steps=1`): its figures are read at its end, so the
step time the trainer reports (its logging window) is that of the one step.

`--zero-stage` and `--tp` set `parallel.zero_stage` and `parallel.tp_size` (the world size must be a
multiple of the TP size). Model FLOP/s are estimated per token as the training log does
(`ntl_pretrain/observability/throughput.py`: 6 x parameters in matrix products + 12 x layers x hidden x seq_len, the PaLM
MFU convention); on a GPU MFU divides them by the devices' peak dense bf16/fp16 FLOP/s (the package's
table of common GPUs, or `--peak-tflops` per device).
`peak_memory_gib` is rank 0's peak over the whole run: `torch.cuda.max_memory_allocated` on a GPU, the
process's peak resident set size (VmHWM) on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.core.fs import write_json_atomic  # noqa: E402
from ntl_pretrain.observability import throughput  # noqa: E402
from ntl_pretrain.observability.monitor import memory_gib  # noqa: E402
from ntl_pretrain.observability.throughput import PEAK_TFLOPS  # noqa: E402,F401 (the table, also as bench_train.PEAK_TFLOPS)
from ntl_pretrain.trainer.trainer import Trainer  # noqa: E402

def model_flops_per_token(trainer: Trainer) -> float:
    """Training FLOPs per token of the trainer's model (`throughput.model_flops_per_token`, as its log uses)."""
    return trainer.parts.window.flops_per_token


def peak_tflops_per_device(override: float | None) -> float | None:
    """Peak dense TFLOP/s of one device: `override`, else the package's table entry of this GPU, else None."""
    if override is not None:
        return override
    import torch

    if not torch.cuda.is_available():
        return None
    return throughput.peak_tflops_per_device(torch.device("cuda", torch.cuda.current_device()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=40, help="measured steps (half with the switch on, half off)")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage (parallel.zero_stage; default: the config's)")
    parser.add_argument("--tp", type=int, default=None, help="AutoTP size (parallel.tp_size; default: the config's)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense TFLOP/s of one device for MFU (default: table of common GPUs; none on CPU)")
    parser.add_argument("--compare", choices=("ntl", "document_mask"), default="ntl",
                        help="the switch turned on and off between steps: NTL (loss.ntl_weight) or attention inside "
                             "packed documents (data.document_mask)")
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()

    with tempfile.TemporaryDirectory(prefix="bench_train_") as scratch:
        overrides = [f"train.output_dir={scratch}/run", f"train.max_steps={args.warmup + args.steps}",
                     "monitor.progress_bar=never", "train.val_every_n_steps=-1", "train.log_every_n_steps=1"]
        if args.zero_stage is not None:
            overrides.append(f"parallel.zero_stage={args.zero_stage}")
        if args.tp is not None:
            overrides.append(f"parallel.tp_size={args.tp}")
        overrides += args.overrides
        cfg = load_config(args.config, overrides)
        if args.compare == "ntl" and not cfg.loss.ntl_on:
            parser.error("the config must have NTL on (loss.enabled=true, loss.ntl_weight > 0)")
        trainer = Trainer(cfg)
        cfg = trainer.parts.cfg  # as resolved (DeepSpeed's batch sizes, the TP size a user's JSON sets)
        # the two sides, swapped between steps: the run's objective and the same with NTL off (CE only), or the
        # EOS that position ids restart after (attention inside documents) and none (attention across the row)
        if args.compare == "ntl":
            objective = trainer.parts.objective
            sides = {True: objective, False: dataclasses.replace(objective, ntl_on=False)}
        else:
            sides = {True: trainer.parts.tokenizer.eos_token_id, False: None}
            if trainer.parts.ulysses is not None:
                parser.error("--compare document_mask runs without sequence parallelism (the Ulysses attention's "
                             "mask is chosen when it is registered)")
        for _ in range(args.warmup):
            trainer.train_step()
        times: dict[bool, list[float]] = {True: [], False: []}
        rates: dict[bool, list[float]] = {True: [], False: []}
        block_ratios = []  # (on + on) / (off + off) within each ABBA block: cancels slow drift in machine load
        block: list[float] = []
        for i in range(args.steps - args.steps % 4):
            switch_on = (i % 4) in (0, 3)  # ABBA
            with trainer.with_parts(**{"objective" if args.compare == "ntl" else "document_eos_id": sides[switch_on]}):
                figures = trainer.train_step()
            times[switch_on].append(figures["train/step_time_s"])
            rates[switch_on].append(figures["train/tokens_per_s"])
            block.append(figures["train/step_time_s"])
            if len(block) == 4:
                block_ratios.append((block[0] + block[3]) / (block[1] + block[2]))
                block = []
        trainer.parts.monitor.close()
    if trainer.parts.layout.is_main:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        name = args.compare
        result = {
            "config": args.config, "overrides": args.overrides, "world_size": trainer.parts.layout.world_size,
            "tp_size": trainer.parts.layout.tp_size, "zero_stage": cfg.parallel.zero_stage, "measured_steps": args.steps,
            "tokens_per_step": cfg.data.seq_len * cfg.data.micro_batch_size * cfg.train.grad_accum_steps
            * trainer.parts.layout.data_size,
            "compared": args.compare, "seq_len": cfg.data.seq_len,
            f"median_step_time_s_{name}_on": on, f"median_step_time_s_{name}_off": off,
            f"median_tokens_per_s_{name}_on": statistics.median(rates[True]),
            f"median_tokens_per_s_{name}_off": statistics.median(rates[False]),
            "step_time_ratio_on_over_off": on / off,
            "median_abba_block_ratio": statistics.median(block_ratios),
        }
        flops_per_token = model_flops_per_token(trainer)
        peak = peak_tflops_per_device(args.peak_tflops)
        result["peak_memory_gib"] = memory_gib(trainer.parts.device)
        result["peak_memory_measure"] = ("cuda max_memory_allocated" if trainer.parts.device.type == "cuda"
                                         else "host peak RSS (VmHWM)")
        result["model_parameters"] = trainer.parts.model_report.parameters
        result["vocab_size"] = trainer.parts.model_report.vocab_size
        result["model_flops_per_token"] = flops_per_token
        result["peak_tflops_per_device"] = peak
        for side in ("on", "off"):
            achieved = flops_per_token * result[f"median_tokens_per_s_{name}_{side}"] / 1e12
            result[f"model_tflops_per_s_{name}_{side}"] = achieved
            result[f"mfu_{name}_{side}"] = achieved / (peak * trainer.parts.layout.world_size) if peak else None
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            write_json_atomic(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
