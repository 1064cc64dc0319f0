"""Start-up and tear-down of torch.distributed, the size checks of the parallel layout, and a rank's exit
after a lost peer (errors agreed over every rank: `core.agreement`).

The layout itself (which rank holds what, and which group each reduction uses) is
`parallel.layout.ParallelLayout` / `ParallelGroups`; `layout` builds this process's from the environment.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from ..core.process_exit import exit_status, leave
from ..config import ConfigError, ParallelConfig
from ..models import families
from .layout import ParallelLayout


def _on_cpu() -> bool:
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def check_tp_divides(world_size: int, tp_size: int) -> None:
    """Raise (ConfigError, the same on every rank) with the fix when the tensor-parallel size does not
    divide the number of processes."""

    if tp_size >= 1 and world_size % tp_size == 0:
        return
    fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
    best = max(t for t in fits if t <= max(tp_size, 1))
    fix = f"set parallel.tp_size={best}"
    if len(fits) > 2:
        fix += f" (or another divisor of {world_size}: {', '.join(map(str, fits))})"
    fix += " or parallel.tp_size=auto (the largest size that divides the world size and the model's heads)"
    more = ""
    if _on_cpu():
        more = (f", or start {tp_size} CPU processes: `NTL_CPU_PROCS={tp_size} bash launch/pretrain.sh ...` or "
                f"`DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus {tp_size} launch/pretrain.sh ...`")
    elif world_size < tp_size:
        more = f", or launch on {tp_size} GPUs"
    raise ConfigError(f"parallel.tp_size={tp_size} does not divide the world size {world_size} "
                      f"(processes launched): {fix}{more}")


def _attention_heads(model_cfg) -> list[int]:
    """The model's attention and key-value head counts, from model.architecture and, for a local
    model folder, its config.json (empty when unknown, e.g. a hub id not read here)."""
    import json

    found = dict(model_cfg.architecture)
    if model_cfg.name_or_path and os.path.isfile(os.path.join(model_cfg.name_or_path, "config.json")):
        with open(os.path.join(model_cfg.name_or_path, "config.json"), encoding="utf-8") as handle:
            found = {**json.load(handle), **found}
    return [int(found[k]) for k in ("num_attention_heads", "num_key_value_heads") if isinstance(found.get(k), int)]


def resolve_tp_size(cfg, world_size: int, local_world_size: int | None = None) -> str | None:
    """Turn parallel.tp_size=auto into a number (in `cfg`): the largest size that divides the world
    size and the model's attention and key-value head counts, within one node. Returns a note saying
    what was chosen (None when tp_size was a number)."""
    if cfg.parallel.tp_size != "auto":
        return None
    node = local_world_size or world_size
    heads = _attention_heads(cfg.model)
    limit = families.tp_limit(cfg) or node  # a family that cannot run with tensor parallelism: 1
    limit = 1 if cfg.parallel.sp_size > 1 else limit  # sequence parallelism runs without tensor parallelism
    size = max(t for t in range(1, min(node, limit) + 1)
               if world_size % t == 0 and node % t == 0 and all(h % t == 0 for h in heads))
    cfg.parallel.tp_size = size
    why = f"the model's heads {heads}" if heads else "no head count known (model.architecture has none)"
    if cfg.parallel.sp_size > 1:
        why += f"; parallel.sp_size={cfg.parallel.sp_size} runs with tp_size=1"
    elif limit == 1:
        why += "; its family runs only at tp_size=1 with this load (docs/training.md)"
    return (f"parallel.tp_size=auto: using tp_size={size} for world size {world_size} "
            f"({node} processes per node, {why}); dp={world_size // (size * cfg.parallel.sp_size)}")


def layout(parallel: ParallelConfig) -> ParallelLayout:
    """This process's layout for the resolved `parallel` section (tp_size a number), from the launcher's
    environment (valid before DeepSpeed builds its groups; `ParallelGroups.from_deepspeed` then holds them)."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    check_tp_divides(world_size, parallel.tp_size)
    return ParallelLayout.of(world_size, rank, int(os.environ.get("LOCAL_RANK", "0")), parallel.tp_size,
                             parallel.sp_size)


def init_distributed(timeout_minutes: float) -> None:
    """Start torch.distributed through DeepSpeed (nccl on GPUs, gloo/ccl on CPU) with a bounded timeout,
    so a rank that dies never leaves the others waiting forever (the rendezvous itself is bounded by the
    caller's `lifecycle.StartupWatchdog`)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        # before the first collective: NCCL object collectives use the current device, which must be this rank's
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))


def shutdown_distributed() -> None:
    """Tear the process group down before the interpreter exits: left to interpreter shutdown, gloo's
    threads are sometimes destroyed while still joinable ("terminate called without an active exception",
    rc -6) after a run that succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


# A collective that failed because another rank ended (its connections closed) or stalled (the collective
# timeout): gloo raises plain RuntimeErrors naming its source file, NCCL and the rendezvous store torch's DistError.
_PEER_LOST_SIGNS = ("third_party/gloo", "Connection reset by peer", "Connection closed by peer", "Broken pipe",
                    "TCPStore", "NCCL communicator was aborted")
_TIMEOUT_SIGNS = ("Timed out", "timed out", "Timeout", "timeout")
STALL_REPORT_WAIT_S = 10.0  # how long a rank whose collective timed out waits for the others to say theirs did too


def lost_peer_message(error: BaseException) -> str | None:
    """One line for a collective that failed because another rank ended or stalled (None: another error).

    After a timeout the ranks that timed out report it in the rendezvous store and wait a few seconds for
    each other (`_ranks_not_reporting`): the ranks that did not report are the stalled ones; a store that
    cannot be reached means global rank 0, which holds it, is the one."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or any(sign in text for sign in _PEER_LOST_SIGNS)):
        return None
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(error).__name__)
    detail = detail.split(". This is typically")[0].rstrip(".")  # gloo's advice: replaced by ours
    if any(sign in text for sign in _TIMEOUT_SIGNS):
        return f"a collective timed out ({detail}): {_stalled_ranks()} stalled (stopped, swapped out or stuck in I/O)"
    return (f"another rank ended while this one waited in a collective ({detail}); that rank printed its own error "
            f"(above, or in its node's log)")


def _stalled_ranks() -> str:
    """Which rank(s) stalled, as far as the rendezvous store tells (see `lost_peer_message`)."""
    found: list[list[int] | None] = []

    def ask() -> None:
        try:
            found.append(_ranks_not_reporting())
        except ValueError:  # this process's group is already shut down: the store is out of reach
            found.append(None)
        except (RuntimeError, dist.DistError):  # the store's holder, global rank 0, is gone
            pass

    # a thread: a store request to a stopped process blocks whatever the store's timeout (os._exit ends it)
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(STALL_REPORT_WAIT_S + 5)
    if not found:
        return "global rank 0 (the rendezvous store it holds does not answer)"
    silent = found[0]
    if silent is None:
        return "a rank (which one is unknown: this process had shut its process group down before asking)"
    if not silent:
        return "another rank"
    return f"global rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"


def _ranks_not_reporting() -> list[int]:
    """The global ranks that have not reported a timed-out collective within STALL_REPORT_WAIT_S."""
    store = dist.distributed_c10d._get_default_store()  # torch's rendezvous store: every rank reaches it
    store.set(f"ntl_timed_out/{dist.get_rank()}", "1")
    keys = [f"ntl_timed_out/{rank}" for rank in range(dist.get_world_size())]
    deadline = time.monotonic() + STALL_REPORT_WAIT_S
    silent = [rank for rank, key in enumerate(keys) if not store.check([key])]
    while silent and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            silent = [rank for rank in silent if not store.check([keys[rank]])]
        except (RuntimeError, dist.DistError):
            # global rank 0 waited as long, reported and exited with the store it holds: what was seen stands
            return silent
    store.set(f"ntl_stall_asked/{dist.get_rank()}", "1")
    if dist.get_rank() == 0:
        # global rank 0 holds the store (env:// rendezvous): leaving before the others finished asking would cut
        # them off mid-request, and torch's store client prints its own warning lines then (seen on a loaded machine,
        # where the ranks' deadlines drift apart by seconds)
        asked = [f"ntl_stall_asked/{rank}" for rank in range(dist.get_world_size()) if rank not in silent]
        deadline = time.monotonic() + STALL_REPORT_WAIT_S
        while not store.check(asked) and time.monotonic() < deadline:
            time.sleep(0.2)
    return silent


def run_process(main: Callable[[], int | None], lost_peer_hint: str = "") -> NoReturn:
    """Run `main` as the whole of a distributed process, then end the process with its exit code (None: 0)
    without the interpreter's teardown.

    Once `main` is back the work is done: here the process group is destroyed and stdout, stderr and logging
    are flushed. What is skipped is the destruction of torch/gloo/DeepSpeed objects at interpreter exit,
    which is slow (a full garbage collection) and has aborted ranks of finished runs ("terminate called
    without an active exception", rc -6) even after `destroy_process_group`; atexit handlers are skipped
    too and threads still running are not waited for, so `main` closes and joins what it opened. As at a
    normal exit, an exception prints its traceback and exits 1 (KeyboardInterrupt: 130), and SystemExit
    keeps its code (a message: printed, exit 1). A collective that failed because another rank ended or
    stalled is one `error:` line instead (`lost_peer_message`, then `lost_peer_hint`, e.g. how to resume).
    """
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + 2  # as a shell reports a process that SIGINT ended
    except BaseException as error:  # noqa: BLE001 - any failure: its traceback, exit 1, like the interpreter's own
        lost = lost_peer_message(error)
        if lost:
            rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")
            print(f"error: [rank {rank}] {lost}{'; ' + lost_peer_hint if lost_peer_hint else ''}", file=sys.stderr)
        else:
            traceback.print_exc()
        code = 1
    code = exit_status(code)
    try:
        shutdown_distributed()
    except Exception:  # noqa: BLE001 - the run's own result stands; a failed teardown is reported
        traceback.print_exc()
        code = code or 1
    leave(code)


def all_reduce_sum(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """SUM a few floats over a group in one collective (every rank of the group calls it)."""
    tensor = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()
