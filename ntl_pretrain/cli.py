"""The trainer's command line: `launch/pretrain.sh [--config X.yaml] [--dry-run [--world-size N]] [key.sub=value ...]`;
`--plan --world-size N [--device-memory 80GiB] [--json]` plans the run instead (docs/plan.md).

Started by DeepSpeed's launcher, torchrun, srun or `bash launch/pretrain.sh` (one process per rank), or as
`python launch/pretrain.sh` alone: a world of one process (`launcher.use_world_of_one`).

Exit codes: 0 done (or stopped by a pre-emption signal after saving), 2 an error a user can fix (printed
once, one line naming the key, file or value), 1 a bug (traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .checkpoint import CheckpointError
from .config import ConfigError, help_text, load_config
from .core.agreement import AgreedError
from .core.versions import UnsupportedVersionError, check_versions
from .observability.monitor import MonitorError
from .parallel import distributed
from .plan import run_plan
from .runtime import launcher, lifecycle, log_filter
from .trainer.preflight import dry_run
from .trainer.step_guard import TrainingDiverged
from .trainer.trainer import Trainer

# what a rank says after its collective failed because another rank ended or stalled (`distributed.run_process`)
LOST_PEER_HINT = ("once every rank has stopped, rerun the same command with train.resume=auto (it continues from the "
                  "last complete checkpoint)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/pretrain.sh",
        description="Continued pretraining / pretraining of a Hugging Face causal LM with CE + Number Token Loss "
                    "on DeepSpeed (ZeRO 0-3, AutoTP). Overrides: key.sub=value (values are YAML).",
        epilog="Configuration keys:\n" + help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="YAML run configuration (e.g. configs/demo.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the configuration and print it with the DeepSpeed config; load nothing")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run, --plan: number of processes the run will have (default: WORLD_SIZE or "
                             "tp_size)")
    parser.add_argument("--plan", action="store_true",
                        help="plan the run: per-rank memory by kind, traffic per group, checkpoint files; load "
                             "nothing but the model's config.json (docs/plan.md)")
    parser.add_argument("--device-memory", default=None,
                        help="--plan: memory of one device (e.g. 80GiB): whether the layout fits, and which do")
    parser.add_argument("--json", action="store_true", help="--plan: print the plan as JSON")
    parser.add_argument(log_filter.VERBOSE_FLAG, action="store_true",
                        help="show every line the libraries print (otherwise known-harmless ones are filtered: "
                             "docs/training.md, Launching)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by DeepSpeed's launcher (LOCAL_RANK is used)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    args = parser.parse_intermixed_args(list(argv))
    args.configs_given, args.config = args.config or [], (args.config or [None])[-1]
    return args


def check_arguments(args: argparse.Namespace) -> None:
    """One --config (given twice, argparse keeps the last one silently) and a positive --world-size (0 was taken
    as unset, -2 failed inside the dry run with "max() arg is an empty sequence")."""
    if len(args.configs_given) > 1:
        raise ConfigError(f"--config is given {len(args.configs_given)} times ({', '.join(args.configs_given)}); give "
                          f"one file and change single keys with key.sub=value overrides")
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size} is not a number of processes; give 1 or more")


def _report_error(error: BaseException) -> None:
    """Print a start-up or run error once: errors every rank raises together (configuration, agreed by a
    collective) are printed by global rank 0 only; those of every rank of a node (its library versions, how it
    was launched) by local rank 0; anything else by the rank that hit it."""
    shared = isinstance(error, (ConfigError, AgreedError))
    per_node = isinstance(error, (launcher.LauncherError, UnsupportedVersionError))
    rank = lifecycle.global_rank()
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    elif per_node:
        if lifecycle.local_rank() == 0:
            print(f"error: [rank {rank}] {error}", file=sys.stderr, flush=True)
    elif not shared:
        print(f"error: [rank {rank}] {error}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)  # --verbose: read by launch/pretrain.sh already
    trainer = None
    try:
        try:
            launcher.check_accelerate_launch()
            check_versions()
            check_arguments(args)
            cfg = load_config(args.config, args.overrides)
            if args.dry_run:
                dry_run(cfg, args.world_size)
                return 0
            if args.plan:
                return run_plan(cfg, args.world_size or int(os.environ.get("WORLD_SIZE", "0")), args.device_memory,
                                args.json, on_cpu=os.environ.get("DS_ACCELERATOR") == "cpu")
            launcher.use_world_of_one()
            try:
                launcher.check_rendezvous_port()
                trainer = Trainer(cfg)
            except RuntimeError as error:  # the store's bind: another process took the port after it was chosen
                taken = launcher.port_taken_message(error)
                if taken is None:
                    raise
                raise launcher.PortTakenError(taken) from error
        except launcher.PortTakenError as error:
            lifecycle.report_to_supervisor(launcher.PORT_TAKEN_EVENT, port=os.environ.get("MASTER_PORT"))
            _report_error(error)
            return 2
        except ValueError as error:  # ConfigError, DataError, CheckpointError, RunLockError, ...: exit 2
            _report_error(error)
            return 2
        try:
            trainer.fit()
        except (CheckpointError, TrainingDiverged, MonitorError) as error:
            _report_error(error)
            return 2
        lifecycle.report_to_supervisor("done", how="stopped" if trainer.record.stopped_by else "finished",
                                       step=trainer.state.step)
        return 0
    finally:
        if trainer is not None:
            trainer.close_after_failure()  # after a clean end (or a stop signal) the monitor is closed already
            trainer.parts.lock.release()
        if sys.exc_info()[1] is None:  # an exception on its way out: `distributed.run_process` first asks the
            distributed.shutdown_distributed()  # process group which rank stalled, then shuts it down


if __name__ == "__main__":
    distributed.run_process(main, lost_peer_hint=LOST_PEER_HINT)
