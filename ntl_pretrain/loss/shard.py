"""Where this rank's slice of the vocabulary is: `VocabShard`, the one object the loss, the chunked head
and evaluation take, and `vocab_shard_of`, the one place that finds it on a model.

Under AutoTP's vocabulary-parallel LM head (`tensor_parallel.vocab_parallel_lm_head`) TP rank r holds
the logit columns `[start, start + width)` of the vocabulary; without it every rank holds them all
(`VocabShard()`: no group, start 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of `group`; 1 for None or when torch.distributed is not initialised."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns of the vocabulary (of the LM head, and so of the logits).

    Checked on construction without touching a device; `check_tiling` checks the whole group once
    (a collective and a host read).
    """

    tp_group: dist.ProcessGroup | None = None  # the group the vocabulary is split over; None: not split
    start: int = 0  # first global vocabulary id of this rank's columns
    width: int | None = None  # this rank's column count; None: whatever the logits (or head) hold

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"VocabShard start must be a vocabulary id >= 0, got {self.start!r}")
        if self.width is not None and (isinstance(self.width, bool) or not isinstance(self.width, int)
                                       or self.width < 1):
            raise ValueError(f"VocabShard width must be a column count >= 1 (or None), got {self.width!r}")
        if not self.is_split and self.start != 0:
            raise ValueError(f"VocabShard(start={self.start}) without a tensor-parallel group: pass tp_group (the "
                             f"group that splits the vocabulary, e.g. vocab_shard_of(engine)), or start=0 for the "
                             f"full vocabulary")

    @property
    def size(self) -> int:
        """Ranks the vocabulary is split over (1: not split)."""
        return group_size(self.tp_group)

    @property
    def is_split(self) -> bool:
        """Whether each rank holds only its own columns (collectives over `tp_group` are needed)."""
        return self.size > 1

    def check_width(self, local_width: int, what: str) -> None:
        """The `local_width` columns of `what` (the logits, the head) are this shard's, when its width is known.
        Shapes only: no device work."""
        if self.width is not None and local_width != self.width:
            raise ValueError(f"{what} hold {local_width} vocabulary columns but this rank's shard has {self.width} "
                             f"([{self.start}, {self.start + self.width})); pass this rank's LOCAL shard (or the "
                             f"VocabShard that describes the tensor passed)")

    def check_tiling(self, device: torch.device | str = "cpu", local_width: int | None = None) -> int:
        """Check that the shards of the TP group tile `[0, V)` with no gap or overlap; return V.

        Every rank of the group calls it (one all-reduce of `2 T` integers and one read of them on the host),
        and every rank raises the same error, so none waits on another. Run it once where the layout is fixed
        (a trainer's start-up); the loss functions run it on every call unless told `check_inputs=False`.
        """
        width = self.width if local_width is None else local_width
        if width is None:
            raise ValueError("check_tiling needs the local width: give VocabShard a width or pass local_width")
        if not self.is_split:
            return width
        table = torch.zeros(self.size, 2, dtype=torch.long, device=device)
        table[dist.get_rank(self.tp_group)] = torch.tensor([self.start, width], device=device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self.tp_group)
        shards = sorted((start, held, rank) for rank, (start, held) in enumerate(table.tolist()))
        end = 0
        for start, held, _rank in shards:
            if start != end or held < 1:
                listed = ", ".join(f"rank {r}: [{a}, {a + w})" for a, w, r in sorted(shards, key=lambda t: t[2]))
                raise ValueError(
                    f"the vocabulary shards of the TP group do not tile the vocabulary ({listed}). Pass each rank's "
                    f"LOCAL logit shard (or head shard) with its own VocabShard (vocab_shard_of(engine)), not the "
                    f"full logits.")
            end = start + held
        return end

    def local_targets(self, targets: torch.Tensor, local_width: int,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(column, owned)` of each global target id in this shard: its local column (clamped into range where
        another shard owns it) and whether this shard owns it (never for `ignore_index`). No host sync."""
        shifted = targets - self.start
        owned = (targets != ignore_index) & (shifted >= 0) & (shifted < local_width)
        return shifted.clamp(0, local_width - 1), owned


def vocab_shard_of(model: Any) -> VocabShard:
    """This rank's vocabulary shard of a model's LM head: a DeepSpeed engine, a Hugging Face causal LM, or
    the head module itself.

    AutoTP's `VocabParallelLinear` gives its group (`mp_group`) and column range; any other head holds
    the whole vocabulary (its width is `out_features` when it has one).
    """
    head = model
    for holder in (model, getattr(model, "module", None)):  # an engine (or DDP) wraps the model in `.module`
        if hasattr(holder, "get_output_embeddings"):
            head = holder.get_output_embeddings()
            break
    if getattr(head, "is_vocab_parallel_lm_head", False) and getattr(head, "mp_group", None) is not None:
        start = int(head.vocab_start_index)
        return VocabShard(head.mp_group, start, int(head.vocab_end_index) - start)
    width = getattr(head, "out_features", None)
    return VocabShard(width=width if isinstance(width, int) and width > 0 else None)


def as_vocab_shard(shard: "VocabShard | None") -> VocabShard:
    """`shard` as the loss functions use it: None is the full vocabulary (as the chunked functions take it;
    `shard=None` was an AttributeError in ce_ntl_loss), anything but a VocabShard one line."""
    if shard is None:
        return VocabShard()
    if not isinstance(shard, VocabShard):
        raise TypeError(f"shard must be a VocabShard (vocab_shard_of(engine)) or None for the full vocabulary, got "
                        f"{type(shard).__name__}")
    return shard
