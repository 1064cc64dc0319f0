#!/usr/bin/env python
"""Export a training checkpoint as a Hugging Face model folder (CPU only, one process).

    python tools/export_hf.py runs/demo/global_step700 runs/demo/hf_export [--dtype bf16] [--max-shard-size 5GB]
    python tools/export_hf.py runs/demo runs/demo/hf_export          # a run folder: its newest complete checkpoint

Works for checkpoints of any ZeRO stage 1-3 and any tensor-parallel size (ZeRO 0 with tp_size 1). Reads only
the model weights (the fp32 master partitions, memory-mapped; never the Adam moments), joins each parameter's
ZeRO partitions and tensor-parallel slices (DeepSpeed's own merge) and streams it into its safetensors shard:
no scratch beside the output, memory about one parameter plus the pages read since the last release. Writes
safetensors weights (sharded, with model.safetensors.index.json when there is more than one shard),
config.json, generation_config.json, the tokenizer and number_vocab.json; `from_pretrained` loads it.
The output folder must not exist (or be empty); nothing is overwritten. Everything is written into
OUT.partial and renamed at the end: an export that is killed leaves only OUT.partial, which the next
export to OUT removes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow  # noqa: E402

skip_autotuner_mlflow()  # an entry point: before anything imports DeepSpeed (core/deepspeed_imports.py)

from ntl_pretrain.checkpoint import CheckpointError, export_hf, list_checkpoints, step_of_tag  # noqa: E402
from ntl_pretrain.checkpoint.format import check_not_a_link  # noqa: E402


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (RUN/global_stepN) or a run folder (its newest one)")
    parser.add_argument("out_dir", help="the Hugging Face folder to write (must not exist or be empty)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="weights dtype (default: the training dtype)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    return parser.parse_args(list(argv))


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder as given, or the newest complete checkpoint of a run folder (neither a link)."""
    check_not_a_link(path, "checkpoint (or run)")
    if step_of_tag(os.path.basename(os.path.normpath(path))) is not None or path.rstrip("/").endswith("_universal"):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist")
    complete = list_checkpoints(path)
    if not complete:
        raise CheckpointError(f"{path!r} holds no complete checkpoint (global_stepN with a manifest)")
    return complete[-1].path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        report = export_hf(checkpoint, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {checkpoint} to {args.out_dir}: {report['parameters'] / 1e6:.2f}M parameters, "
          f"{report['bytes'] / 2**20:.1f} MiB, {len(report['files'])} files, {report['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
