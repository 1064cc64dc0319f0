"""Learning-rate schedules of this project beside DeepSpeed's own, under the same interface and the same
config section (`{"scheduler": {"type": NAME, "params": {...}}}`).

`WarmupStableDecayLR` (warmup-stable-decay, as in MiniCPM and torchtitan): linear warm-up from `warmup_min_lr` to
`warmup_max_lr` over `warmup_num_steps`, the peak held, then a decay to `min_lr` over the last `decay_num_steps`
of `total_num_steps`: linear, cosine or 1-sqrt (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training
Beyond Fixed Training Durations": the lr falls by 1 - sqrt(x) of the drop at x of the decay, so half the drop comes
in the first quarter of the decay and the lr flattens towards the end). The decay reaches `min_lr` one iteration
after `total_num_steps` (a virtual last step, as torchtitan's): the last step still trains, also at `min_lr=0`.
A `warmup_min_lr` above 0 re-warms from the lr an earlier run ended at (continued pretraining: arXiv 2403.08763,
re-warming and re-decaying). Past `total_num_steps` the lr goes to `min_lr` and stays there.

DeepSpeed 0.19.8 builds a config's scheduler by looking its type up in `deepspeed.runtime.lr_schedules`
(`DeepSpeedEngine._scheduler_from_config`): `register_with_deepspeed` adds ours there (new names only, nothing of
DeepSpeed's is replaced), so the engine builds, saves and restores it as its own (`state_dict`:
`last_batch_iteration`, as DeepSpeed's schedulers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def schedule_lengths(warmup_steps: int, max_steps: int) -> tuple[int, int]:
    """(warmup_num_steps, total_num_steps) of a run's schedule: DeepSpeed's warm-ups need at least one step, and a
    schedule at least one step past its warm-up."""
    warmup = max(1, warmup_steps)
    return warmup, max(max_steps, warmup + 1)


def wsd_decay_num_steps(decay_fraction: float, total_num_steps: int, warmup_num_steps: int) -> int:
    """The decaying steps of warmup-stable-decay: `decay_fraction` of the steps, rounded, after the warm-up."""
    return min(round(decay_fraction * total_num_steps), total_num_steps - warmup_num_steps)


def wsd_lr(step: int, *, total_num_steps: int, warmup_num_steps: int, decay_num_steps: int, warmup_min_lr: float,
           warmup_max_lr: float, min_lr: float, decay_type: str = "linear") -> float:
    """The closed form: the lr at scheduler iteration `step` (the trainer runs optimizer step k at iteration k)."""
    if step < 0:
        return warmup_min_lr
    if step < warmup_num_steps:
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * step / warmup_num_steps
    decay_start = total_num_steps - decay_num_steps
    if step < decay_start or decay_num_steps == 0:
        return warmup_max_lr
    # the floor one iteration past the last step: decay step j of D trains at j / (D + 1) of the decay
    done = min(1.0, (step - decay_start) / (decay_num_steps + 1))
    if decay_type == "linear":
        left = 1.0 - done
    elif decay_type == "cosine":
        left = 0.5 * (1.0 + math.cos(math.pi * done))
    else:  # 1-sqrt (Hägele et al. 2024): half the drop in the first quarter of the decay
        left = 1.0 - math.sqrt(done)
    return min_lr + (warmup_max_lr - min_lr) * left


class WarmupStableDecayLR:
    """Warmup-stable-decay with DeepSpeed's scheduler interface (see the module)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_num_steps: int, decay_num_steps: int,
                 warmup_max_lr: float, min_lr: float = 0.0, warmup_min_lr: float = 0.0, decay_type: str = "linear",
                 last_batch_iteration: int = -1) -> None:
        if decay_type not in DECAY_SHAPES:
            raise ValueError(f"decay_type={decay_type!r} is not one of {DECAY_SHAPES}")
        if not (0 <= warmup_num_steps and 0 <= decay_num_steps and warmup_num_steps + decay_num_steps <= total_num_steps):
            raise ValueError(f"warmup_num_steps={warmup_num_steps} + decay_num_steps={decay_num_steps} must fit in "
                             f"total_num_steps={total_num_steps}")
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's wrappers hold the torch optimizer
        self.shape = dict(total_num_steps=total_num_steps, warmup_num_steps=warmup_num_steps,
                          decay_num_steps=decay_num_steps, warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                          min_lr=min_lr, decay_type=decay_type)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._set(self.get_lr())

    def get_lr(self) -> list[float]:
        return [wsd_lr(self.last_batch_iteration, **self.shape)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def _set(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._set(self.get_lr())

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


SCHEDULES = {"WarmupStableDecayLR": WarmupStableDecayLR}  # this project's, by the type name a config gives


@dataclass(frozen=True)
class LRSchedule:
    """One `optim.lr_schedule` name: the DeepSpeed `scheduler` section it builds (a type of DeepSpeed's, or of
    `SCHEDULES`) and the optim keys only some schedules read."""

    section: Callable[[Any, int, int], dict]  # (the optim section, warmup_num_steps, total_num_steps) -> section
    summary: str  # what it is, for --help
    reads: tuple[str, ...] = ()  # the optim keys it reads that not every schedule does (refused with another one)


# Each decay reaches its floor one iteration after the last step (a virtual last step, as torchtitan's), so the last
# step trains, also with optim.min_lr_ratio=0: DeepSpeed's WarmupCosineLR is at its floor from iteration
# total_num_steps - 1 on (its cosine counts from the iteration after the warm-up's last as 1), WarmupDecayLR from
# total_num_steps; WarmupStableDecayLR reaches min_lr at total_num_steps + 1 itself.
def _cosine(optim: Any, warmup: int, total: int) -> dict:
    return {"type": "WarmupCosineLR", "params": {
        "total_num_steps": total + 2, "warmup_num_steps": warmup, "warmup_min_ratio": optim.warmup_start_lr_ratio,
        "cos_min_ratio": optim.min_lr_ratio, "warmup_type": "linear"}}


def _linear(optim: Any, warmup: int, total: int) -> dict:
    return {"type": "WarmupDecayLR", "params": {
        "total_num_steps": total + 1, "warmup_num_steps": warmup, "warmup_min_lr": optim.warmup_start_lr_ratio * optim.lr,
        "warmup_max_lr": optim.lr, "warmup_type": "linear"}}


def _constant(optim: Any, warmup: int, total: int) -> dict:
    return {"type": "WarmupLR", "params": {
        "warmup_num_steps": warmup, "warmup_min_lr": optim.warmup_start_lr_ratio * optim.lr, "warmup_max_lr": optim.lr,
        "warmup_type": "linear"}}


def _wsd(optim: Any, warmup: int, total: int) -> dict:
    return {"type": "WarmupStableDecayLR", "params": {
        "total_num_steps": total, "warmup_num_steps": warmup,
        "decay_num_steps": wsd_decay_num_steps(optim.decay_fraction, total, warmup),
        "warmup_min_lr": optim.warmup_start_lr_ratio * optim.lr, "warmup_max_lr": optim.lr,
        "min_lr": optim.min_lr_ratio * optim.lr, "decay_type": optim.decay_shape}}


# optim.lr_schedule's names: the config's allowed values, --help, the keys each reads and the DeepSpeed section all
# read this table, so a new schedule is one entry (and its class in SCHEDULES when DeepSpeed has none)
LR_SCHEDULES: dict[str, LRSchedule] = {
    "cosine": LRSchedule(_cosine, "WarmupCosineLR", reads=("min_lr_ratio",)),
    "linear": LRSchedule(_linear, "WarmupDecayLR"),
    "constant": LRSchedule(_constant, "WarmupLR"),
    "wsd": LRSchedule(_wsd, "warmup-stable-decay: the peak held, decay_fraction of the steps decaying at the end",
                      reads=("decay_fraction", "decay_shape", "min_lr_ratio")),
}


def scheduler_class(name: str) -> Any:
    """The scheduler class of a config's `scheduler.type`: this project's, else DeepSpeed's own."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, name)


def register_with_deepspeed() -> None:
    """Make DeepSpeed's engine find this project's schedules by their type names (before deepspeed.initialize)."""
    from deepspeed.runtime import lr_schedules

    for name, cls in SCHEDULES.items():
        if getattr(lr_schedules, name, cls) is not cls:
            raise RuntimeError(f"DeepSpeed has its own {name}: this project's would shadow it; rename ours")
        setattr(lr_schedules, name, cls)
