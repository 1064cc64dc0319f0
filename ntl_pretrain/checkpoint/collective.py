"""How the ranks share a checkpoint operation: global rank 0 acts while the others wait, the files are
hashed or checked in shares, and an error on any rank is raised on every rank (`core.agreement.run_agreed`)
as an `AgreedCheckpointError`, so nobody waits in a collective for a rank that stopped.

Every rank calls each function here at the same point.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from ..core.agreement import agree_on_error, run_agreed
from .format import AgreedCheckpointError, CheckpointError


def is_collective(requested: bool) -> bool:
    """Whether a `collective=True` operation really spans several processes."""
    return requested and dist.is_initialized() and dist.get_world_size() > 1


def my_share(names: list[str], sizes: dict[str, int], collective: bool) -> list[str]:
    """This rank's share of files for hashing or checking (largest first, dealt round-robin)."""
    if not is_collective(collective):
        return names
    ordered = sorted(names, key=lambda n: (-sizes.get(n, 0), n))
    return ordered[dist.get_rank()::dist.get_world_size()]


def gather(mine: dict, collective: bool) -> dict:
    """The union of every rank's dict (with `collective`, all ranks call this)."""
    if not is_collective(collective):
        return dict(mine)
    parts: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict = {}
    for part in parts:
        merged.update(part or {})
    return merged


def agree(error: str | None) -> None:
    """An error on any rank is raised on all as an AgreedCheckpointError."""
    agree_on_error(error, AgreedCheckpointError)


def run_on_main(is_main: bool, fn: Callable[[], Any]) -> Any:
    """Run `fn` on global rank 0 while the others wait; its error is raised on every rank."""
    return run_agreed(fn, is_main, AgreedCheckpointError, catch=(OSError, ValueError, RuntimeError),
                      plain=(CheckpointError,))


def broadcast_from_main(is_main: bool, fn: Callable[[], Any]) -> Any:
    """`fn()` on global rank 0, its result on every rank (its error raised on every rank)."""
    result = run_on_main(is_main, fn)
    if not is_collective(True):
        return result
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]
