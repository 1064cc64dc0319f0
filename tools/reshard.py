#!/usr/bin/env python
"""Convert a training checkpoint to DeepSpeed's universal form, which loads on any data- and tensor-parallel size.

    python tools/reshard.py runs/demo/global_step700          # writes runs/demo/global_step700_universal

A run resumes through it by itself when its layout differs from the checkpoint's
(`checkpoint.reshard_on_resume=true`, the default: `train.resume=global_step700` or `auto` with another
`parallel.tp_size` or number of processes): global rank 0 converts while the other ranks wait outside
`train.dist_timeout_minutes` (docs/checkpoints.md, "Resharding"). This tool does the same conversion ahead
of time (CPU only, one process, `--workers` extraction processes), e.g. on a login node while the new job
waits in the queue; the resume then reuses its folder (the default `--output`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow  # noqa: E402

skip_autotuner_mlflow()  # an entry point: before anything imports DeepSpeed (core/deepspeed_imports.py)

from ntl_pretrain.checkpoint import (MANIFEST_NAME, CheckpointError, convert_to_universal, folder_bytes,  # noqa: E402
                                     list_checkpoints)


def check_not_a_run_folder(path: str) -> None:
    """A run folder given for one of its checkpoints was "incomplete: it has no ntl_checkpoint.json (its save was
    interrupted ...)", which sends the user looking for a failed save; name its checkpoints instead."""
    if (os.path.isdir(path) and not os.path.islink(path.rstrip("/") or path)
            and not os.path.lexists(os.path.join(path, MANIFEST_NAME))):
        complete = [info.tag for info in list_checkpoints(path)]
        if complete:
            raise CheckpointError(f"{path!r} is a run folder, not a checkpoint; pass one of its checkpoints, e.g. "
                                  f"{os.path.join(path, complete[-1])} (complete: {', '.join(complete[-5:])})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/reshard.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder, RUN/global_stepN")
    parser.add_argument("--output", default=None, help="universal folder (default: CHECKPOINT_universal beside it)")
    parser.add_argument("--workers", type=int, default=1, help="processes for the conversion")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    try:
        check_not_a_run_folder(args.checkpoint)
        out = convert_to_universal(args.checkpoint.rstrip("/"), args.output, workers=args.workers)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(f"universal checkpoint {out}: {folder_bytes(out) / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
