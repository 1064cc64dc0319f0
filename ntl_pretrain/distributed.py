"""Process groups and rank helpers for DeepSpeed's data- and tensor-parallel layout.

DeepSpeed's AutoTP lays the world out as a (data_parallel, tensor_parallel) mesh with the TP ranks of a
group contiguous: global rank g has tp_rank = g % T and dp_rank = g // T. All TP ranks of a group must see
identical batches, so data is sharded by DATA-parallel rank only.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the (data_parallel, tensor_parallel) mesh."""

    world_size: int  # all processes
    rank: int  # global rank
    local_rank: int  # rank on this node
    tp_size: int  # tensor-parallel group size
    tp_rank: int  # rank inside the tensor-parallel group
    dp_size: int  # data-parallel size = world_size / tp_size
    dp_rank: int  # data-parallel rank (which shard of the data)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that logs and writes run-level files."""
        return self.rank == 0


def check_tp_divides(world_size: int, tp_size: int) -> None:
    """Raise with the fix when the tensor-parallel size does not divide the number of processes."""
    if tp_size < 1 or world_size % tp_size != 0:
        hint = ""
        if world_size == 1:
            hint = (" With no GPU, start 2 CPU processes: `bash launch/pretrain.sh ...` or "
                    "`deepspeed --num_gpus 2 launch/pretrain.sh ...`.")
        raise ValueError(f"parallel.tp_size={tp_size} does not divide the world size {world_size} "
                         f"(processes launched); choose a tp_size that divides it.{hint}")


def layout(tp_size: int) -> ParallelLayout:
    """The layout implied by the launcher's environment (valid before DeepSpeed builds its groups)."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    check_tp_divides(world_size, tp_size)
    return ParallelLayout(world_size=world_size, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                          tp_size=tp_size, tp_rank=rank % tp_size, dp_size=world_size // tp_size,
                          dp_rank=rank // tp_size)


def init_distributed(timeout_minutes: int) -> None:
    """Start torch.distributed through DeepSpeed (nccl on GPUs, gloo/ccl on CPU) with a bounded timeout,
    so a rank that dies never leaves the others waiting forever."""
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


def deepspeed_groups(tp_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(tp_group, dp_group) as DeepSpeed built them; call after `deepspeed.initialize`.

    Without tensor parallelism there is no TP group (None) and the data-parallel group is the world.
    """
    if tp_size == 1:
        return None, dist.group.WORLD
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group(), groups.get_data_parallel_group()


def check_layout_matches_deepspeed(expected: ParallelLayout) -> None:
    """Fail loudly if DeepSpeed's mesh differs from the layout our data sharding assumed."""
    if expected.tp_size == 1:
        return
    from deepspeed.utils import groups

    actual = (groups.get_tensor_model_parallel_rank(), groups.get_data_parallel_rank(),
              groups.get_data_parallel_world_size())
    if actual != (expected.tp_rank, expected.dp_rank, expected.dp_size):
        raise RuntimeError(f"DeepSpeed's (tp_rank, dp_rank, dp_size) = {actual} differs from the assumed "
                           f"{(expected.tp_rank, expected.dp_rank, expected.dp_size)}; data would be sharded wrongly")


def broadcast_error(message: str | None) -> None:
    """Every rank calls this; if any rank reports an error, all raise it (nobody waits on a dead rank)."""
    if not dist.is_initialized():
        if message:
            raise ValueError(message)
        return
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    first = next((m for m in messages if m), None)
    if first:
        raise ValueError(first)


def all_reduce_sum(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    """SUM a few floats over a group in one collective (every rank of the group calls it)."""
    tensor = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, group=group)
    return tensor.tolist()
