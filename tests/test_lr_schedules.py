"""optim.lr_schedule=wsd (warmup-stable-decay) and the re-warm start (optim.warmup_start_lr_ratio): the scheduler
DeepSpeed's engine builds from the run's config against a closed form written here, a resume mid-schedule, and the
config's checks."""

from __future__ import annotations

import math
import os
import typing

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
    """Warmup-stable-decay as the literature states it (MiniCPM; Hagele et al. 2024 for 1-sqrt), reaching the floor
    at step total + 1, one past the last (torchtitan's virtual last step)."""
    if step <= warmup:
        return start + (peak - start) * step / warmup
    if step <= total - decay:
        return peak
    x = min(1.0, (step - (total - decay)) / (decay + 1))
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
    assert lrs[39] > lrs[40] == pytest.approx(0.1 * peak)  # step 40, the last, above the floor; step 41 at it
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
    # step 11, one past the last: the end of the decay
    assert lr_text(schedule, 10) == f"{cfg.optim.min_lr_ratio * cfg.optim.lr:.3e}"


@pytest.mark.parametrize("override,message", [
    ("optim.decay_fraction=1.5", "optim.decay_fraction must be >= 0 and <= 1, got 1.5"),
    ("optim.warmup_start_lr_ratio=-0.1", "optim.warmup_start_lr_ratio must be >= 0 and <= 1, got -0.1"),
    ("optim.decay_shape=exp", "optim.decay_shape"),
])
def test_wsd_settings_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(DEMO, ["optim.lr_schedule=wsd", override])


def test_1_sqrt_makes_half_the_drop_in_the_first_quarter_of_the_decay():
    # 39 decay steps: decay step j trains at j/40 of the decay, so step 10 is at a quarter (Hagele et al. 2024)
    overrides = ["optim.lr_schedule=wsd", "train.max_steps=40", "optim.warmup_steps=1", "optim.decay_fraction=0.975",
                 "optim.decay_shape=1-sqrt", "optim.min_lr_ratio=0.1"]
    cfg = load_config(DEMO, overrides)
    assert lr_scheduler_section(cfg)["params"]["decay_num_steps"] == 39
    lrs = _engine_lrs(overrides, 40)
    peak, floor = cfg.optim.lr, 0.1 * cfg.optim.lr
    assert lrs[0] == pytest.approx(peak)  # step 1: the warm-up's end, the decay's start
    assert lrs[10] == pytest.approx(floor + 0.5 * (peak - floor))  # step 11, 10 of 40 decay iterations: half the drop
    assert lrs[30] == pytest.approx(floor + (1 - math.sqrt(0.75)) * (peak - floor))  # 3/4 of the way: 13% left


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_every_step_trains_with_min_lr_ratio_0(schedule):
    """The decay reaches its floor one step after the last: with optim.min_lr_ratio=0 no step runs at lr 0."""
    max_steps, warmup = 12, 3
    overrides = [f"optim.lr_schedule={schedule}", f"train.max_steps={max_steps}", f"optim.warmup_steps={warmup}"]
    overrides += [] if schedule == "linear" else ["optim.min_lr_ratio=0"]
    overrides += ["optim.decay_fraction=0.5"] if schedule == "wsd" else []
    peak = load_config(DEMO, overrides).optim.lr
    lrs = _engine_lrs(overrides, max_steps + 2)
    assert min(lrs[:max_steps]) > 0 and lrs[max_steps] == lrs[max_steps + 1] == 0.0, lrs
    if schedule == "cosine":
        # DeepSpeed's WarmupCosineLR counts its cosine from 1 at the step after the warm-up's last: step W is already
        # past the peak (never trained exactly); the floor at max_steps + 1 (total_num_steps = max_steps + 2)
        decay = max_steps + 2 - warmup
        expected = [peak * s / warmup for s in range(1, warmup)] + [
            peak * (1 + math.cos(math.pi * min(1.0, (s - warmup + 1) / decay))) / 2 for s in range(warmup, max_steps + 3)]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-18) and max(lrs) < peak
    if schedule == "linear":  # the peak at step W, then straight down to 0 at max_steps + 1
        expected = [peak * s / warmup for s in range(1, warmup)] + [
            peak * max(0.0, (max_steps + 1 - s) / (max_steps + 1 - warmup)) for s in range(warmup, max_steps + 3)]
        assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-18) and max(lrs) == pytest.approx(peak)


@pytest.mark.parametrize("overrides,message", [
    (["optim.decay_shape=1-sqrt"], "optim.decay_shape=1-sqrt has no effect with optim.lr_schedule=cosine (it applies "
                                   "to wsd only): remove it or set optim.lr_schedule=wsd"),
    (["optim.lr_schedule=constant", "optim.decay_fraction=0.2"],
     "optim.decay_fraction=0.2 has no effect with optim.lr_schedule=constant (it applies to wsd only)"),
    (["optim.lr_schedule=linear", "optim.min_lr_ratio=0"],
     "optim.min_lr_ratio=0.0 has no effect with optim.lr_schedule=linear (it applies to cosine and wsd only): remove it "
     "or set optim.lr_schedule=cosine"),
    (["optim.lr_schedule=wsd", "train.max_steps=100", "optim.decay_fraction=0.004"],
     "optim.decay_fraction=0.004 of train.max_steps=100 rounds to 0 decay steps: the lr would never decay; set "
     "optim.decay_fraction >= 0.01 (one step), or optim.decay_fraction=0 to hold the peak to the end"),
])
def test_a_schedule_key_that_would_change_nothing_is_refused(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_config(DEMO, overrides)
    assert message in str(raised.value)


def test_a_wsd_decay_of_0_is_allowed_on_purpose_and_one_step_is_enough():
    for fraction, decay_steps in (("0", 0), ("0.006", 1)):  # 0.6 of a step of 100 rounds to 1
        cfg = load_config(DEMO, ["optim.lr_schedule=wsd", "train.max_steps=100", f"optim.decay_fraction={fraction}"])
        assert lr_scheduler_section(cfg)["params"]["decay_num_steps"] == decay_steps


def test_a_wsd_decay_cut_short_by_the_warmup_is_said():
    from ntl_pretrain.trainer.preflight import config_warnings

    cfg = load_config(DEMO, ["optim.lr_schedule=wsd", "train.max_steps=100", "optim.warmup_steps=95",
                             "optim.decay_fraction=0.2"])
    assert lr_scheduler_section(cfg)["params"]["decay_num_steps"] == 5
    assert ("optim.decay_fraction=0.2 asks for 20 decay steps but only 5 follow optim.warmup_steps=95 in "
            "train.max_steps=100: the decay is 5 steps; lower optim.warmup_steps or optim.decay_fraction") in \
        config_warnings(cfg)
    assert not config_warnings(load_config(DEMO, ["optim.lr_schedule=wsd", "train.max_steps=100"]))


def test_generated_schedule_sections_unchanged_by_the_table():
    """Each optim.lr_schedule's DeepSpeed config, built through `core/lr_schedules.LR_SCHEDULES`, is byte for byte
    the one the code before the table generated (tests/data/lr_schedule_ds_configs.json: written by that code, commit
    ffe4f80, for the overrides stored beside each config), and the config's --help and key checks read the table."""
    import json

    from ntl_pretrain.config.schema import LRScheduleName, OptimConfig
    from ntl_pretrain.config.validation import _SCHEDULE_KEYS
    from ntl_pretrain.core.lr_schedules import LR_SCHEDULES
    from ntl_pretrain.trainer.ds_config import generated_deepspeed_config

    with open(os.path.join(os.path.dirname(__file__), "data", "lr_schedule_ds_configs.json"), encoding="utf-8") as f:
        stored = json.load(f)
    seen = set()
    for case in stored:
        cfg = load_config(DEMO, case["overrides"] + ["parallel.tp_size=1"])
        seen.add(cfg.optim.lr_schedule)
        assert json.dumps(generated_deepspeed_config(cfg, on_cpu=True)) == json.dumps(case["generated"]), case
    assert seen <= set(LR_SCHEDULES) and len(seen) == 4  # the four schedules of the code before the table
    assert typing.get_args(LRScheduleName) == tuple(LR_SCHEDULES)
    # the --help text and the keys refused with another schedule, as they were before (a new entry adds to them)
    assert OptimConfig.__dataclass_fields__["lr_schedule"].metadata["doc"].startswith(
        "cosine (WarmupCosineLR) | linear (WarmupDecayLR) | constant (WarmupLR) | wsd (warmup-stable-decay: the peak "
        "held, decay_fraction of the steps decaying at the end)")
    before = {"optim.decay_fraction": ("wsd",), "optim.decay_shape": ("wsd",), "optim.min_lr_ratio": ("cosine", "wsd")}
    assert {key: tuple(name for name in names if name in seen) for key, names in _SCHEDULE_KEYS.items()} == before
