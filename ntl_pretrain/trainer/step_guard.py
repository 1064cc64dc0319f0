"""The step's guard against non-finite losses, gradients and weights.

A non-finite loss or gradient norm skips the step's update (DeepSpeed's overflow check under ZeRO 1-3;
`update_skipped` without ZeRO) and `NonfiniteGuard` stops the run after `train.max_nonfinite_steps` such
steps in a row; `check_weights_finite` refuses to save non-finite weights as a checkpoint.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch

logger = logging.getLogger("ntl_pretrain")


class TrainingDiverged(RuntimeError):
    """The run produced non-finite losses, gradients or weights and stopped without saving them."""


def finite_step(ce_sum: float, ntl_sum: float, grad_norm: float | None) -> bool:
    """Whether the step's CE and NTL sums and its gradient norm (when there is one) are finite."""
    return math.isfinite(ce_sum) and math.isfinite(ntl_sum) and (grad_norm is None or math.isfinite(grad_norm))


def nan_gradient_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or, where it is not finite, a loss whose gradient is NaN everywhere: DeepSpeed's overflow
    check then skips the update (a non-finite loss can have a finite gradient). Decided on the device."""
    return loss * torch.where(torch.isfinite(loss), 1.0, float("nan")).to(loss.dtype)


@contextmanager
def update_skipped(engine: Any) -> Iterator[None]:
    """Let `engine.step()` close the accumulation (DeepSpeed's counters, zeroed gradients) without
    updating the weights or advancing the LR schedule, as DeepSpeed does for an overflow."""
    targets = [engine.optimizer] + ([engine.lr_scheduler] if engine.lr_scheduler is not None else [])
    for target in targets:
        target.step = lambda *args, **kwargs: None  # instance attribute: shadows the method for this call
    try:
        yield
    finally:
        for target in targets:
            del target.step


def unpartitioned_grad_norm(engine: Any) -> torch.Tensor:
    """Global gradient norm without ZeRO (DeepSpeed's engine keeps none then); TP-sharded parameters
    are summed over the TP group, replicated ones counted once. A device tensor (no host read)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    parameters = [p for p in engine.module.parameters() if p.grad is not None]
    return clip_grad_norm_(parameters, max_norm=float("inf"), mpu=engine.mpu)


def check_weights_finite(engine: Any, device: torch.device, step: int, output_dir: str) -> None:
    """Refuse to save non-finite weights: the model's (this rank's ZeRO-3 partitions) and the
    optimizer's fp32 master weights. Every rank calls it (one all-reduce)."""
    tensors = [getattr(p, "ds_tensor", p.data) for p in engine.module.parameters()]
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if optimizer is not None:
        tensors += [p for group in optimizer.param_groups for p in group["params"]]
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            bad += (~torch.isfinite(tensor.detach())).sum().to(bad)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(bad)
    if bad.item() > 0:
        raise TrainingDiverged(f"step {step}: {int(bad.item())} weights are not finite; refusing to save them as a "
                               f"checkpoint (the last checkpoint in {output_dir} stays the newest)")


class NonfiniteGuard:
    """Counts the optimizer steps whose loss or gradient norm was not finite (their updates were
    skipped) and stops the run once `limit` came in a row.

    It is told per step whether the update was skipped, a host value the step has without reading the
    device itself: under ZeRO 1-3 DeepSpeed's own overflow check decides (its read of the global gradient
    norm; a non-finite loss has a NaN gradient, `nan_gradient_if_nonfinite`), without ZeRO the trainer's
    read of the figures before the update. So the stop comes at the N-th step itself, never later.
    """

    def __init__(self, limit: int, output_dir: str, is_main: bool) -> None:
        self.limit = limit
        self.output_dir = output_dir
        self.is_main = is_main
        self.in_a_row = 0  # consecutive non-finite steps
        self.total = 0  # and in all

    def check(self, step: int, skipped: bool, what: str) -> None:
        """After step `step`: count it if its update was `skipped` (`what`: why, for the messages); raise
        TrainingDiverged at the limit."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise TrainingDiverged(
                f"step {step}: {self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm "
                f"({what}); stopping without saving (train.max_nonfinite_steps={self.limit}). The last checkpoint in "
                f"{self.output_dir} holds the weights before. Lower optim.lr, set optim.grad_clip, or check the data "
                f"and the resumed checkpoint.")
        if self.is_main:
            logger.warning("step %d: non-finite loss or gradient norm (%s): update skipped (%d in a row; the run "
                           "stops at train.max_nonfinite_steps=%d)", step, what, self.in_a_row, self.limit)


def describe_figures(ce_sum: float, ntl_sum: float, grad_norm: float | None) -> str:
    """The figures a non-finite step is reported with."""
    return (f"CE sum {ce_sum:.4g}, NTL sum {ntl_sum:.4g}, gradient norm "
            f"{'n/a' if grad_norm is None else f'{grad_norm:.4g}'}")
