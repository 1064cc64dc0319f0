"""The run's DeepSpeed config and the run configuration resolved once from it.

`resolve_run` is the one place a `Config` becomes the configuration the run actually has: YAML +
overrides (already in `cfg`), `parallel.tp_size=auto` turned into a number, the user's DeepSpeed JSON
(`deepspeed.config`) merged over the config generated from the YAML, and what DeepSpeed derives from
it (the batch sizes). It returns a new `Config`; nothing assigns into a configuration afterwards.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

from ..config import Config, ConfigError
from ..core.lr_schedules import LR_SCHEDULES, schedule_lengths
from ..parallel import distributed


@dataclass(frozen=True)
class ResolvedRun:
    """The configuration a run has, and the DeepSpeed config it hands to `deepspeed.initialize`."""

    cfg: Config  # the YAML's keys that DeepSpeed owns read back from `ds_config`; tp_size a number
    ds_config: dict  # DeepSpeed's own key names and meaning
    tp_note: str | None  # what parallel.tp_size=auto chose (None: tp_size was a number)


def lr_scheduler_section(cfg: Config) -> dict[str, Any]:
    """DeepSpeed's `scheduler` section of optim.lr_schedule: its entry of `core/lr_schedules.LR_SCHEDULES` (a type
    of DeepSpeed's, or of core/lr_schedules.py). Optimizer step k runs at the scheduler's iteration k
    (trainer/startup.py)."""
    warmup, total = schedule_lengths(cfg.optim.warmup_steps, cfg.train.max_steps)
    return LR_SCHEDULES[cfg.optim.lr_schedule].section(cfg.optim, warmup, total)


def generated_deepspeed_config(cfg: Config, on_cpu: bool) -> dict:
    """The DeepSpeed config implied by the YAML (DeepSpeed's own key names and meaning)."""
    zero: dict[str, Any] = {"stage": cfg.parallel.zero_stage}
    if cfg.parallel.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": cfg.parallel.offload_optimizer, "pin_memory": not on_cpu}
    if cfg.parallel.offload_param != "none":
        zero["offload_param"] = {"device": cfg.parallel.offload_param, "pin_memory": not on_cpu}
    if cfg.parallel.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # a TP x ZeRO-3 run can export full weights
    adam: dict[str, Any] = {"lr": cfg.optim.lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                            "weight_decay": cfg.optim.weight_decay}
    if on_cpu:
        adam["torch_adam"] = True  # DeepSpeed's fused Adam needs a GPU
    scheduler = lr_scheduler_section(cfg)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": scheduler,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "fp16": {"enabled": cfg.model.dtype == "fp16"},
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own step prints would duplicate
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.tp_size > 1:
        ds["tensor_parallel"] = {"autotp_size": cfg.parallel.tp_size, "vocab_parallel_lm_head": True}
    if cfg.parallel.sp_size > 1:
        ds["sequence_parallel_size"] = cfg.parallel.sp_size  # Ulysses (parallel/ulysses.py)
    return ds


def _merge(base: dict, user: dict) -> dict:
    """`user` over `base`, recursively; a user value "auto" keeps the base's (the HF Trainer's convention)."""
    merged = dict(base)
    for key, value in user.items():
        if value == "auto":
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _refuse_duplicate_keys(path: str):
    """A json `object_pairs_hook`: a key given twice in one object is an error (json keeps the last)."""
    def build(pairs: list[tuple[str, Any]]) -> dict:
        built: dict = {}
        for key, value in pairs:
            if key in built:
                raise ConfigError(f"deepspeed.config={path!r}: key {key!r} is given twice in one object; keep one")
            built[key] = value
        return built
    return build


def _read_user_json(path: str) -> dict:
    if os.path.isdir(path):
        raise ConfigError(f"deepspeed.config={path!r} is a folder; give the path of a DeepSpeed JSON file")
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/zero, a FIFO: json.load would never return
        raise ConfigError(f"deepspeed.config={path!r} is not a regular file; give the path of a DeepSpeed JSON file")
    try:
        with open(path, encoding="utf-8") as handle:
            user = json.load(handle, object_pairs_hook=_refuse_duplicate_keys(path))
    except FileNotFoundError:
        raise ConfigError(f"deepspeed.config={path!r} does not exist") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"deepspeed.config={path!r} is not valid JSON: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"deepspeed.config={path!r} cannot be read: {error}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"deepspeed.config={path!r} must hold a JSON object")
    return user


def _tp_size(ds: dict) -> int:
    return int(ds.get("tensor_parallel", {}).get("autotp_size", 0) or 1)


def _sp_size(ds: dict) -> int:
    return int(ds.get("sequence_parallel_size", 0) or 1)


def deepspeed_config(cfg: Config, on_cpu: bool, world_size: int | None = None) -> dict:
    """The generated DeepSpeed config with the user's JSON (deepspeed.config) merged over it. `cfg` is
    only read (`resolve_run` reads the merged result back into a resolved copy).

    With `world_size`, the batch sizes are resolved as DeepSpeed would (train_batch_size = micro batch x
    gradient accumulation x data-parallel size; a user's train_batch_size without one of the other two
    derives it) and a disagreement is a ConfigError now, not DeepSpeed's AssertionError after the build.
    """
    if isinstance(cfg.parallel.tp_size, str):
        raise ValueError("resolve parallel.tp_size=auto first (distributed.resolve_tp_size / resolve_run)")
    ds = generated_deepspeed_config(cfg, on_cpu)
    user: dict = {}
    if cfg.deepspeed.config:
        user = _read_user_json(cfg.deepspeed.config)
        ds = _merge(ds, user)
        if on_cpu and ds.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
            ds["optimizer"].setdefault("params", {})["torch_adam"] = True
    _resolve_batch_sizes(ds, user, cfg.deepspeed.config, world_size)
    if _tp_size(ds) > 1:
        ds["tensor_parallel"]["vocab_parallel_lm_head"] = True  # the loss needs the vocabulary-sharded head
    check_with_deepspeed(ds, cfg.deepspeed.config)
    return ds


def check_with_deepspeed(ds: dict, path: str | None) -> None:
    """Parse `ds` with DeepSpeed's own `DeepSpeedConfig` (its pydantic sections refuse unknown keys and
    out-of-range values, e.g. zero_optimization.stage=7), so the dry run and the trainer's start refuse
    what `deepspeed.initialize` would refuse after the model is built. One line naming the key."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    probe = copy.deepcopy(ds)
    # the batch sizes were checked against the real world size above; DeepSpeedConfig would check them
    # against the process group it finds (none before the start-up, all ranks rather than data-parallel after)
    probe.pop("train_batch_size", None)
    source = f"deepspeed.config={path!r}" if path else "the generated DeepSpeed config"
    try:
        DeepSpeedConfig(probe)
    except ValidationError as error:
        problem = error.errors()[0]
        key = _section_of(ds, problem) + ".".join(str(part) for part in problem["loc"])
        value = f"={problem['input']!r}" if problem["type"] != "missing" else ""
        why = "not a key DeepSpeed knows there (misspelt?)" if problem["type"] == "extra_forbidden" else problem["msg"]
        raise ConfigError(f"{source}: DeepSpeed refuses {key}{value}: {why} ({error.title})") from None
    except (DeepSpeedConfigError, ValueError, AssertionError, TypeError, KeyError) as error:
        raise ConfigError(f"{source}: DeepSpeed refuses it: {' '.join(str(error).split()) or type(error).__name__}") from None


def _section_of(ds: dict, problem: dict) -> str:
    """The top-level section ("zero_optimization.") whose value at a pydantic error's location is the
    refused input (pydantic names the location inside its own section model); "" when not one."""
    sections = []
    for name, node in ds.items():
        for part in problem["loc"]:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT and (problem["type"] == "missing" or node == problem.get("input")):
            sections.append(name)
    return f"{sections[0]}." if len(sections) == 1 else ""


_ABSENT = object()
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolve_batch_sizes(ds: dict, user: dict, path: str | None, world_size: int | None) -> None:
    """Make train_batch_size, the micro batch and the accumulation steps agree (in `ds`, the config being
    built), as DeepSpeed requires; only a user's JSON (read from `path`) can make them disagree."""
    given = {key: user[key] for key in _BATCH_KEYS if key in user and user[key] != "auto"}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"deepspeed.config={path!r}: {key}={value!r} must be an integer >= 1")
    if "train_batch_size" not in given:
        ds.pop("train_batch_size", None)  # DeepSpeed computes it from the other two
        return
    total = given["train_batch_size"]
    # the YAML's values stand in for the one the user did not give; with neither given, the YAML's micro batch
    if "train_micro_batch_size_per_gpu" not in given and "gradient_accumulation_steps" in given:
        ds.pop("train_micro_batch_size_per_gpu", None)
    elif "gradient_accumulation_steps" not in given:
        ds.pop("gradient_accumulation_steps", None)
    tp_size, sp_size = _tp_size(ds), _sp_size(ds)
    if world_size is None or world_size % (tp_size * sp_size):
        return  # DeepSpeed derives the missing one (a dry run without --world-size leaves it open)
    dp = world_size // (tp_size * sp_size)  # sequence-parallel peers share their samples
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps")
    where = (f"deepspeed.config={path!r}: train_batch_size={total} must equal "
             f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size "
             f"(world {world_size} / parallel.tp_size {tp_size} / parallel.sp_size {sp_size} = {dp})")
    if micro is not None and accum is not None:
        if micro * accum * dp != total:
            raise ConfigError(f"{where}, but {micro} x {accum} x {dp} = {micro * accum * dp}; set train_batch_size "
                              f"to {micro * accum * dp} or \"auto\", or leave out one of the three")
        return
    known, name = (micro, "gradient_accumulation_steps") if micro is not None else (accum, "train_micro_batch_size_per_gpu")
    if total % (known * dp):
        raise ConfigError(f"{where}; {total} is not a multiple of {known} x {dp} = {known * dp}, so {name} cannot be "
                          f"derived; choose train_batch_size as a multiple of {known * dp}")
    ds[name] = total // (known * dp)


def _read_back(cfg: Config, ds: dict) -> Config:
    """A copy of `cfg` whose keys that DeepSpeed owns say what DeepSpeed will do with `ds`."""
    resolved = copy.deepcopy(cfg)
    resolved.parallel.tp_size = _tp_size(ds)
    resolved.parallel.sp_size = _sp_size(ds)
    resolved.parallel.zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    resolved.data.micro_batch_size = int(ds.get("train_micro_batch_size_per_gpu", cfg.data.micro_batch_size))
    resolved.train.grad_accum_steps = int(ds.get("gradient_accumulation_steps", cfg.train.grad_accum_steps))
    resolved.optim.grad_clip = float(ds.get("gradient_clipping", 0.0))
    resolved.model.dtype = ("bf16" if ds.get("bf16", {}).get("enabled") else
                            "fp16" if ds.get("fp16", {}).get("enabled") else "fp32")
    return resolved


def resolve_run(cfg: Config, on_cpu: bool, world_size: int, local_world_size: int | None = None) -> ResolvedRun:
    """The run's configuration as it will run on `world_size` processes (`local_world_size` per node:
    parallel.tp_size=auto stays within one node), built once; `cfg` itself is left as it was."""
    sized = copy.deepcopy(cfg)
    tp_note = distributed.resolve_tp_size(sized, world_size, local_world_size)
    ds = deepspeed_config(sized, on_cpu, world_size)
    return ResolvedRun(cfg=_read_back(sized, ds), ds_config=ds, tp_note=tp_note)


def resumed_deepspeed_config(ds: dict, kept_schedule: dict | None, load_universal: bool) -> dict:
    """The DeepSpeed config of a resume (a new dict): the checkpoint's learning-rate schedule when
    `checkpoint.resume_lr_schedule=keep` chose it (`CheckpointManager.resume_lr_schedule`), and
    DeepSpeed's universal-checkpoint load when the layout changed."""
    resumed = copy.deepcopy(ds)
    if kept_schedule is not None:
        if kept_schedule["scheduler"] is None:
            resumed.pop("scheduler", None)
        else:
            resumed["scheduler"] = kept_schedule["scheduler"]
        resumed["optimizer"].setdefault("params", {})["lr"] = kept_schedule["lr"]
    if load_universal:
        resumed.setdefault("checkpoint", {})["load_universal"] = True
    return resumed
