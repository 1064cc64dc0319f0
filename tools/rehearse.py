#!/usr/bin/env python
"""Rehearse a run's start-up at full size on this machine: every rank of a --world-size run goes through the
trainer's start-up path in this one process (torch's fake process group, the model on the meta device: no GPU,
no weights, no communication), and each rank's share is checked to be complete and disjoint.

    python tools/rehearse.py --config configs/llama3_8b_cpt.yaml --world-size 256 \\
        --model-config /path/to/Meta-Llama-3-70B/config.json parallel.tp_size=8
    python tools/rehearse.py --config configs/long_context_cpt.yaml --world-size 64 --json > rehearsal.json

What each rank gets and how it is checked: docs/rehearsal.md. Exit status 0 when every share adds up, 1 when a
problem was found (each printed), 2 for a configuration the trainer would refuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.config import ConfigError, load_config  # noqa: E402


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/rehearse.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's YAML configuration (e.g. configs/llama3_8b_cpt.yaml)")
    parser.add_argument("--world-size", type=int, required=True, help="processes the run will have (e.g. 256)")
    parser.add_argument("--local-world-size", type=int, default=8, help="processes per node (default 8)")
    parser.add_argument("--model-config", default=None,
                        help="the model's config.json (or its folder), instead of model.name_or_path (a hub id not "
                             "cached here)")
    parser.add_argument("--rank", type=int, default=None,
                        help="the rank the summary shows and whose tensor-parallel group runs AutoTP (default 173, "
                             "or the last rank of a smaller world)")
    parser.add_argument("--all-ranks-autotp", action="store_true",
                        help="run AutoTP on every rank's own meta model (slow: about 2 s a rank for 80 layers)")
    parser.add_argument("--json", action="store_true", help="print the whole rehearsal as JSON instead of the summary")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    return parser.parse_intermixed_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    overrides = list(args.overrides)
    if args.world_size < 1 or not 1 <= args.local_world_size <= args.world_size:
        which = (f"--world-size {args.world_size} is not a number of processes; give 1 or more" if args.world_size < 1
                 else f"--local-world-size {args.local_world_size} is not a number of processes per node of a "
                      f"{args.world_size}-process run; give 1 to {args.world_size}")
        print(f"error: {which}", file=sys.stderr)
        return 2
    if args.model_config:
        folder = args.model_config if os.path.isdir(args.model_config) else os.path.dirname(args.model_config)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            print(f"error: --model-config {args.model_config!r}: no config.json there", file=sys.stderr)
            return 2
        overrides.append(f"model.name_or_path={os.path.abspath(folder)}")
    from ntl_pretrain.plan.report import stdout_to_stderr
    from ntl_pretrain.trainer.rehearsal import rehearse

    try:
        with stdout_to_stderr() if args.json else contextlib.nullcontext():  # --json: stdout is the JSON alone
            cfg = load_config(args.config, overrides)
            rehearsal = rehearse(cfg, args.world_size, local_world_size=args.local_world_size, focus_rank=args.rank,
                                 model_ranks="all" if args.all_ranks_autotp else "focus")
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rehearsal.to_json(), indent=1, default=list))
    else:
        print("\n".join(rehearsal.summary()))
    return 1 if rehearsal.problems else 0


if __name__ == "__main__":
    sys.exit(main())
