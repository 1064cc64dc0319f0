"""Worker: runs of the real Trainer one after the other in one process group, some with asynchronous saves.

    python checkpoint_async.py MODE CONFIG.yaml key=value ... [-- MODE CONFIG.yaml key=value ...]
    (once per rank; tests/helpers/distributed.py)

MODE says what the run's background writer does:
    plain      as shipped
    held       each background write starts only after the training thread has finished the next step, so
               the step's update lands on the tensors between the snapshot and the write
    fail-rank1 global rank 1's background write of the step-4 checkpoint fails (ENOSPC); the run's error is printed
               as `RUN FAILED: <message>` and the worker goes on with the next run
    kill9      every rank's background writer of the step-4 checkpoint writes half of its first file and then
               kills its process with SIGKILL (a job killed in the middle of a background write)
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

import torch.distributed as dist

from ntl_pretrain.checkpoint import CheckpointError
from ntl_pretrain.checkpoint.async_save import PendingSave
from ntl_pretrain.config import load_config
from ntl_pretrain.parallel import distributed
from ntl_pretrain.trainer.trainer import Trainer

_write_and_hash = PendingSave._write_and_hash


def held(trainer: Trainer) -> dict:
    """The writer of a save taken at step k waits until the training thread has finished step k + 1 (its step
    hooks: `StepHooks.after_step`)."""
    step_done = {"step": 0, "event": threading.Condition()}

    def stepped(state) -> None:
        with step_done["event"]:
            step_done["step"] = state.step
            step_done["event"].notify_all()

    def write_later(pending: PendingSave) -> None:
        with step_done["event"]:
            if trainer.state.step < trainer.parts.cfg.train.max_steps:  # the last step's save has no next step
                step_done["event"].wait_for(lambda: step_done["step"] > pending.step, timeout=120)
        print(f"writer of {pending.tag} starts after step {step_done['step']}", flush=True)
        _write_and_hash(pending)

    PendingSave._write_and_hash = write_later
    return {"after_step": stepped}


def fail_on_rank1(trainer: Trainer) -> dict:
    def write_fails(pending: PendingSave) -> None:
        if dist.get_rank() == 1 and pending.step == 4:
            pending.error = pending._describe_failure(OSError(errno.ENOSPC, "No space left on device"))
            return
        _write_and_hash(pending)

    PendingSave._write_and_hash = write_fails
    return {}


def kill9_in_writer(trainer: Trainer) -> dict:
    def write_half_and_die(pending: PendingSave) -> None:
        if pending.step != 4:
            _write_and_hash(pending)
            return
        path, buffer = pending._snapshots[0]
        with open(path, "wb") as handle, buffer.view() as data:
            handle.write(data[: data.nbytes // 2])
        print(f"rank {dist.get_rank()}: killed while writing {pending.tag}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    PendingSave._write_and_hash = write_half_and_die
    return {}


def run(mode: str, config: str, overrides: list[str]) -> None:
    PendingSave._write_and_hash = _write_and_hash
    trainer = Trainer(load_config(config, overrides))
    hooks = {"plain": lambda t: {}, "held": held, "fail-rank1": fail_on_rank1, "kill9": kill9_in_writer}[mode](trainer)
    try:
        with trainer.with_hooks(**hooks):
            trainer.fit()
    except CheckpointError as error:
        print(f"RUN FAILED: {error}", flush=True)
        trainer.close_after_failure()
    finally:
        PendingSave._write_and_hash = _write_and_hash
        trainer.parts.lock.release()  # as the command line does: a later run of this process may use the folder
    dist.barrier()


def main() -> None:
    args = sys.argv[1:]
    while args:
        end = args.index("--") if "--" in args else len(args)
        mode, config, *overrides = args[:end]
        run(mode, config, overrides)
        args = args[end + 1:]


if __name__ == "__main__":
    distributed.run_process(main)
