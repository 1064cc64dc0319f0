"""Where a process sits in the (data, sequence, tensor)-parallel mesh, and which group each reduction uses.

`ParallelLayout` is pure arithmetic (valid before any process group exists): global rank
g = (dp_rank * sp_size + sp_rank) * tp_size + tp_rank, so the ranks of a tensor-parallel group are contiguous
(DeepSpeed's AutoTP: tp_rank = g % T, dp_rank = g // T) and so are those of a sequence-parallel group
(DeepSpeed's Ulysses, `deepspeed/runtime/sequence_parallel/parallel_state_sp.py`: sp_rank = g % S,
dp_rank = g // S). sp > 1 together with tp > 1 is refused (`check_sequence_parallel`).

`ParallelGroups` holds the process groups once `deepspeed.initialize` built them
(`ParallelGroups.from_deepspeed(layout)`), checked against the layout's arithmetic. The trainer asks these two
objects for every group and size; the lower-level functions (loss, data) take an explicit group or int.

    reduction                                           taken from
    data sharding (tp and sp peers see the same rows)   layout.data_rank / layout.data_size
    token counts, loss sums, logged figures (SUM)       groups.loss_group   (dp x sp ranks of one tp index)
    undoing DeepSpeed's gradient averaging              layout.grad_average_size
    vocabulary-parallel loss (MAX/SUM over the head)    groups.vocab_group  (= tp_group)
    prompts split for generation                        groups.dp_group
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from ..config import ConfigError

GroupName = Literal["tp", "sp", "dp", "loss"]


def check_sequence_parallel(world_size: int, tp_size: int, sp_size: int) -> None:
    """Raise ConfigError (the same on every rank) naming the keys when parallel.sp_size does not fit the world
    size and parallel.tp_size (tp_size itself is checked by `distributed.check_tp_divides`)."""
    if sp_size < 1:
        raise ConfigError(f"parallel.sp_size must be >= 1, got {sp_size}")
    if sp_size > 1 and tp_size > 1:
        raise ConfigError(f"parallel.sp_size={sp_size} with parallel.tp_size={tp_size}: sequence parallelism "
                          f"together with tensor parallelism is not supported by DeepSpeed 0.19.8 (its Ulysses groups, "
                          f"parallel_state_sp, have no tensor-parallel dimension: ZeRO would partition and average "
                          f"over every rank, mixing AutoTP's different weight shards); set one of them to 1")
    if world_size % (tp_size * sp_size):
        fits = [s for s in range(1, world_size + 1) if world_size % (tp_size * s) == 0]
        raise ConfigError(f"parallel.sp_size={sp_size} does not divide the world size {world_size} "
                          f"(processes launched) / parallel.tp_size {tp_size}: set parallel.sp_size to one of "
                          f"{', '.join(map(str, fits))}")


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the (data_parallel, sequence_parallel, tensor_parallel) mesh: sizes and ranks
    only (build it with `ParallelLayout.of`; the columns of the vocabulary this rank's LM head holds are
    `loss.VocabShard`, found by `loss.vocab_shard_of`)."""

    world_size: int  # all processes
    rank: int  # global rank
    local_rank: int  # rank on this node
    tp_size: int  # tensor-parallel group size
    tp_rank: int  # rank inside the tensor-parallel group
    dp_size: int  # data-parallel size = world_size / (tp_size * sp_size)
    dp_rank: int  # data-parallel rank (which shard of the data)
    sp_size: int = 1  # sequence-parallel (Ulysses) group size: the ranks that share one sample's sequence
    sp_rank: int = 0  # rank inside the sequence-parallel group (which slice of the sequence)

    @classmethod
    def of(cls, world_size: int, rank: int, local_rank: int, tp_size: int, sp_size: int = 1) -> "ParallelLayout":
        """The layout of global rank `rank` (ConfigError when the sizes do not fit, `check_sequence_parallel`)."""
        check_sequence_parallel(world_size, tp_size, sp_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} processes")
        return cls(world_size=world_size, rank=rank, local_rank=local_rank, tp_size=tp_size, tp_rank=rank % tp_size,
                   dp_size=world_size // (tp_size * sp_size), dp_rank=rank // (tp_size * sp_size),
                   sp_size=sp_size, sp_rank=rank // tp_size % sp_size)

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that logs and writes run-level files."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which shard of the data this rank reads: the dp rank (tp and sp peers read the same samples)."""
        return self.dp_rank

    @property
    def data_size(self) -> int:
        """How many shards the data is split into (`PretrainingData.build(dp_size=...)`): the dp size."""
        return self.dp_size

    @property
    def loss_size(self) -> int:
        """The ranks holding different tokens (dp x sp), over which `ParallelGroups.loss_group` sums."""
        return self.dp_size * self.sp_size

    @property
    def grad_average_size(self) -> int:
        """What DeepSpeed 0.19.8 divides the summed gradients by (`loss.scaled_micro_batch_loss` multiplies it back):
        dp x sp.

        DeepSpeed sums the gradients over its sequence-data-parallel group (dp x sp ranks; the dp group when sp = 1).
        ZeRO-3 with `reduce_scatter` (its default) divides by that group's size, dp x sp (zero/stage3.py
        `__avg_scatter_grads` -> `reduce_scatter_coalesced`; measured: tests/test_sequence_parallel.py). ZeRO 0-2
        and ZeRO-3 without reduce_scatter divide by (dp x sp) / sp = dp (`__avg_scatter_contiguous_grads`,
        `allreduce_bucket`): the trainer refuses sp > 1 there (`parallel.ulysses.check_deepspeed_config`), so
        both agree whenever this is used.
        """
        return self.dp_size * self.sp_size

    def global_rank(self, dp_rank: int, sp_rank: int, tp_rank: int) -> int:
        """The global rank at mesh coordinates (dp_rank, sp_rank, tp_rank)."""
        return (dp_rank * self.sp_size + sp_rank) * self.tp_size + tp_rank

    def peers(self, group: GroupName) -> tuple[int, ...]:
        """The global ranks of this rank's `group` (itself included), ascending: what `ParallelGroups` must hold."""
        dps = range(self.dp_size) if group in ("dp", "loss") else [self.dp_rank]
        sps = range(self.sp_size) if group in ("sp", "loss") else [self.sp_rank]
        tps = range(self.tp_size) if group == "tp" else [self.tp_rank]
        return tuple(sorted(self.global_rank(d, s, t) for d in dps for s in sps for t in tps))

    def describe(self) -> str:
        """One line: the mesh and which ranks each reduction spans."""
        return (f"world {self.world_size} = dp {self.dp_size} x sp {self.sp_size} x tp {self.tp_size}; data sharded "
                f"{self.data_size} ways; token counts and losses summed over {self.loss_size} ranks (dp x sp); "
                f"DeepSpeed averages gradients over {self.grad_average_size}; vocabulary split over {self.tp_size}")


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of a `ParallelLayout`, as DeepSpeed built them (`from_deepspeed`). None: a group of one
    rank (no collective needed); the world group is `dist.group.WORLD`."""

    layout: ParallelLayout  # the sizes and ranks these groups realise
    tp_group: dist.ProcessGroup | None  # tensor-parallel peers (AutoTP); None with tp_size = 1
    sp_group: dist.ProcessGroup | None  # sequence-parallel peers (Ulysses all-to-all); None with sp_size = 1
    dp_group: dist.ProcessGroup | None  # data-parallel peers (same tp and sp rank): generation splits prompts here
    loss_group: dist.ProcessGroup | None  # token counts, loss sums and logged figures are SUMmed here (dp x sp)

    @property
    def vocab_group(self) -> dist.ProcessGroup | None:
        """The group the LM head's vocabulary is split over: the vocabulary-parallel loss reduces here (= tp_group)."""
        return self.tp_group

    @classmethod
    def from_deepspeed(cls, layout: ParallelLayout) -> "ParallelGroups":
        """The groups DeepSpeed built for `layout` (call after `deepspeed.initialize`, on every rank: with sp > 1
        the dp groups are created here); raises RuntimeError when their ranks differ from the layout's."""
        from deepspeed.utils import groups as ds_groups

        tp_group = sp_group = None
        dp_group = loss_group = dist.group.WORLD
        if layout.tp_size > 1:
            tp_group = ds_groups.get_tensor_model_parallel_group()
            dp_group = loss_group = ds_groups.get_data_parallel_group()
        elif layout.sp_size > 1:
            sp_group = ds_groups._get_sequence_parallel_group()
            loss_group = ds_groups._get_sequence_data_parallel_group()
            dp_group = None
            for sp_rank in range(layout.sp_size):  # DeepSpeed has no group of the same sp rank: every rank makes all
                ranks = [layout.global_rank(d, sp_rank, 0) for d in range(layout.dp_size)]
                made = dist.new_group(ranks)
                dp_group = made if sp_rank == layout.sp_rank else dp_group
        built = cls(layout=layout, tp_group=tp_group, sp_group=sp_group, dp_group=dp_group, loss_group=loss_group)
        built.check()
        return built

    def check(self) -> None:
        """Fail loudly when a group's ranks differ from the layout's (data or losses would be split wrongly)."""
        for name in ("tp", "sp", "dp", "loss"):
            group = getattr(self, f"{name}_group")
            ranks = (self.layout.rank,) if group is None else tuple(sorted(dist.get_process_group_ranks(group)))
            if ranks != self.layout.peers(name):
                raise RuntimeError(f"DeepSpeed's {name} group holds ranks {list(ranks)}, the layout "
                                   f"({self.layout.describe()}) expects {list(self.layout.peers(name))} on rank "
                                   f"{self.layout.rank}")
