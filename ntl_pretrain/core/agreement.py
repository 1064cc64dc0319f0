"""Errors agreed over every rank: an error one rank finds is raised on every rank together, so none waits in a
later collective for a rank that stopped, and global rank 0 alone reports it."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def host_group() -> dist.ProcessGroup | None:
    """A gloo group of the whole world for flags agreed in host memory, with no device sync (None: the default
    group, already gloo, or no process group). Collective: every rank makes it at the same point, once."""
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


class AgreedError(ValueError):
    """An error that every rank raises together (`agree_on_error`), so global rank 0 alone reports it.

    A component with its own error type subclasses both (`class AgreedCheckpointError(AgreedError,
    CheckpointError)`): handlers of its type, and the exit code they give, still catch it.
    """


def agree_on_error(message: str | None, error_type: type[AgreedError] = AgreedError) -> None:
    """Every rank calls this with its error (None: none); if any rank reports one, every rank raises
    `error_type` with the first such message, so nobody waits in a later collective for a rank that stopped."""
    if not issubclass(error_type, AgreedError):
        raise TypeError(f"agree_on_error raises subclasses of AgreedError, not {error_type.__name__}")
    first = message
    if dist.is_initialized():
        messages: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        first = next((m for m in messages if m), None)
    if first:
        raise error_type(first)


def run_agreed(fn: Callable[[], T], run_here: bool, error_type: type[AgreedError] = AgreedError,
               catch: tuple[type[BaseException], ...] = (ValueError, OSError),
               plain: tuple[type[BaseException], ...] = ()) -> T | None:
    """Run `fn` on the ranks where `run_here` is true, then agree on its error (every rank calls this).

    An exception of a `catch` type on any rank is raised on every rank as `error_type`, with its message
    as is for an `AgreedError` or a `plain` type and prefixed with its type name otherwise. Returns
    `fn()` where it ran, None elsewhere.
    """
    result, message = None, None
    if run_here:
        try:
            result = fn()
        except catch as exc:
            message = str(exc) if isinstance(exc, (AgreedError, *plain)) else f"{type(exc).__name__}: {exc}"
    agree_on_error(message, error_type)
    return result
