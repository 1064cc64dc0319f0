"""optim.lr_schedule=wsd (warmup-stable-decay) and the re-warm start (optim.warmup_start_lr_ratio): the scheduler
DeepSpeed's engine builds from the run's config against a closed form written here, a resume mid-schedule, and the
config's checks."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from helpers.distributed import free_port
from ntl_pretrain.checkpoint.fingerprint import lr_schedule_description, lr_text
from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.core.lr_schedules import WarmupStableDecayLR
from ntl_pretrain.trainer.ds_config import lr_scheduler_section

pytestmark = pytest.mark.fast
DEMO = "configs/demo.yaml"


def reference_lr(step: int, peak: float, warmup: int, total: int, decay: int, start: float, final: float,
                 shape: str) -> float:
    """Warmup-stable-decay as the literature states it (MiniCPM; Hagele et al. 2024 for 1-sqrt)."""
    if step <= warmup:
        return start + (peak - start) * step / warmup
    if step <= total - decay:
        return peak
    x = min(1.0, (step - (total - decay)) / decay)
    factor = {"linear": 1 - x, "cosine": (1 + math.cos(math.pi * x)) / 2, "1-sqrt": 1 - math.sqrt(x)}[shape]
    return final + (peak - final) * factor


@pytest.fixture(autouse=True, scope="module")
def _world_of_one():
    """A world of one for DeepSpeed's engines of this module, taken down after it: a process group left up made
    later tests in the same process read world size 1 (test_train_errors' layout checks). One group for the whole
    module: DeepSpeed keeps the groups it saw, so the group is not rebuilt between tests."""
    names = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if started_here and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _engine_lrs(overrides: list[str], steps: int, resume_at: int | None = None) -> list[float]:
    """The lr DeepSpeed's engine sets for optimizer steps 1..steps (the trainer starts the scheduler at iteration 1),
    built from the run's own DeepSpeed config section; with `resume_at`, a second scheduler takes the first's state
    at that step (as a checkpoint restores it) and continues."""
    import deepspeed

    from ntl_pretrain.core.lr_schedules import register_with_deepspeed

    register_with_deepspeed()
    cfg = load_config(DEMO, overrides)

    def engine():
        model = torch.nn.Linear(2, 2)
        config = {"train_micro_batch_size_per_gpu": 1, "scheduler": lr_scheduler_section(cfg),
                  "optimizer": {"type": "AdamW", "params": {"lr": cfg.optim.lr, "torch_adam": True}}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    first = engine()
    assert isinstance(first.lr_scheduler, WarmupStableDecayLR) == ("optim.lr_schedule=wsd" in overrides)
    first.lr_scheduler.step(1)
    lrs, current = [], first
    for step in range(1, steps + 1):
        lrs.append(current.get_lr()[0])
        if step == resume_at:
            state = current.lr_scheduler.state_dict()
            current = engine()
            current.lr_scheduler.load_state_dict(state)
        current.lr_scheduler.step()
    return lrs


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_follows_the_closed_form_and_resumes_mid_decay(shape):
    overrides = ["optim.lr_schedule=wsd", "train.max_steps=40", "optim.warmup_steps=5", "optim.decay_fraction=0.25",
                 f"optim.decay_shape={shape}", "optim.min_lr_ratio=0.1", "optim.warmup_start_lr_ratio=0.2"]
    peak = load_config(DEMO, overrides).optim.lr
    lrs = _engine_lrs(overrides, 44)
    expected = [reference_lr(s, peak, 5, 40, 10, 0.2 * peak, 0.1 * peak, shape) for s in range(1, 45)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert max(lrs) == pytest.approx(peak) and lrs[-1] == pytest.approx(0.1 * peak)  # held at the end past max_steps
    assert _engine_lrs(overrides, 44, resume_at=33) == lrs  # a checkpoint's state, mid-decay


def test_rewarm_start_applies_to_every_schedule():
    for schedule in ("cosine", "linear", "constant"):
        overrides = [f"optim.lr_schedule={schedule}", "train.max_steps=20", "optim.warmup_steps=4",
                     "optim.warmup_start_lr_ratio=0.5"]
        peak = load_config(DEMO, overrides).optim.lr
        lrs = _engine_lrs(overrides, 4)
        assert lrs[0] == pytest.approx(0.5 * peak + 0.5 * peak / 4), schedule  # a quarter of the way from half
        assert lrs[:3] == sorted(lrs[:3]) and max(lrs) <= peak * (1 + 1e-12), schedule  # rising towards the peak


def test_a_resume_message_computes_the_wsd_lr():
    cfg = load_config(DEMO, ["optim.lr_schedule=wsd", "train.max_steps=10", "optim.warmup_steps=2",
                             "optim.decay_fraction=0.5"])
    schedule = lr_schedule_description({"scheduler": lr_scheduler_section(cfg), "optimizer": {"params": {
        "lr": cfg.optim.lr}}})
    assert lr_text(schedule, 9) == f"{cfg.optim.min_lr_ratio * cfg.optim.lr:.3e}"  # step 10: the end of the decay


@pytest.mark.parametrize("override,message", [
    ("optim.decay_fraction=1.5", "optim.decay_fraction must be >= 0 and <= 1, got 1.5"),
    ("optim.warmup_start_lr_ratio=-0.1", "optim.warmup_start_lr_ratio must be >= 0 and <= 1, got -0.1"),
    ("optim.decay_shape=exp", "optim.decay_shape"),
])
def test_wsd_settings_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(DEMO, ["optim.lr_schedule=wsd", override])
