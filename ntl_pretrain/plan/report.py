"""`launch/pretrain.sh --plan`: the plan of the configured layout, whether it fits a device, and the layouts of the
same world size that fit; as text or JSON."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
from typing import Any, Iterator

from ..config import Config, ConfigError
from ..trainer.preflight import preflight
from .planner import MEMORY_TERMS, Plan, device_type_of_run, make_plan

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SHOWN_LAYOUTS = 6  # the fitting layouts listed (least model parallelism first)


def parse_bytes(text: str) -> int:
    """`80GiB`, `141GB`, `81920MiB` or a number of bytes, above 0; ConfigError naming the value otherwise."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    size = int(float(found.group(1)) * UNITS[found.group(2).lower()]) if found and found.group(2).lower() in UNITS else 0
    if size <= 0:  # '' and 0 too: no device holds nothing, and '' would silently plan without a verdict
        raise ConfigError(f"--device-memory {text!r} is not a size; give a device's memory above 0, e.g. 80GiB, "
                          f"141GB or a number of bytes")
    return size


def gib(size: float) -> str:
    """A size in the largest binary unit that keeps it at 1 or more (GiB, MiB, KiB) or in bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def _layout_config(cfg: Config, tp: int, sp: int) -> Config:
    changed = copy.deepcopy(cfg)
    changed.parallel.tp_size, changed.parallel.sp_size = tp, sp
    return changed


def candidate_layouts(cfg: Config, world_size: int, on_cpu: bool) -> list[tuple[Plan | None, str, tuple[int, int]]]:
    """Every dp x sp x tp of `world_size` (sp and tp dividing it, not both above 1: `parallel.layout`) as the run's
    own start-up checks take it (`trainer.preflight`): (its plan, "", (tp, sp)) or (None, why refused, (tp, sp))."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    found = []
    for tp in divisors:
        for sp in divisors:
            if (tp > 1 and sp > 1) or world_size % (tp * sp):
                continue
            try:
                checked = preflight(_layout_config(cfg, tp, sp), world_size, on_cpu, local_files_only=True)
                found.append((make_plan(checked, world_size, device_type_of_run()), "", (tp, sp)))
            except (ConfigError, ValueError) as error:
                found.append((None, str(error), (tp, sp)))
    return found


def plan_lines(plan: Plan) -> list[str]:
    """The plan as text."""
    model, batch = plan.model, plan.batch
    lines = [f"plan: {plan.world_size} ranks = {plan.layout}; {model['model_type']} {model['parameters'] / 1e9:.3f}B "
             f"parameters ({model['parameters_per_tp_rank'] / 1e9:.3f}B per tp rank), {model['layers']} layers, "
             f"hidden {model['hidden_size']}, vocabulary {model['vocab_size']} (from {model['source']})",
             f"  micro batch {batch['micro_batch_size']} x {batch['seq_len']} tokens ({batch['tokens_per_rank']} per "
             f"rank), {batch['grad_accum_steps']} accumulation steps, {batch['dtype']}, attention "
             f"{batch['attention']}, activation checkpointing {'on' if batch['gradient_checkpointing'] else 'off'}, "
             f"{batch['loss_head']}",
             "device memory per rank:"]
    for key, size in plan.memory.items():
        lines.append(f"  {key:<24} {gib(size):>12}  {MEMORY_TERMS[key]}")
    lines.append(f"  {'total':<24} {gib(plan.device_bytes):>12}")
    for key, size in plan.host_memory.items():
        lines.append(f"  host: {key:<18} {gib(size):>12}  (offloaded)")
    lines.append("traffic per optimizer step and rank (bytes of the full tensors):")
    for item in plan.traffic:
        calls = f"{item['calls']} call{'s' * (item['calls'] != 1)}" if item["calls"] is not None else "bucketed"
        lines.append(f"  {item['group']:<7} ({item['group_size']:>3}) {item['kind']:<14} {gib(item['bytes']):>12}  "
                     f"{calls}: {item['what']}")
    ckpt = plan.checkpoint
    names = sorted({re.sub(r"(?<=_)\d+", "N", f["name"]) for f in ckpt["files"]})
    lines.append(f"checkpoint: {len(ckpt['files'])} per-rank files ({', '.join(names)}), {gib(ckpt['bytes_per_rank'])} "
                 f"per rank, {gib(ckpt['bytes'])} in all; rank 0 adds {', '.join(ckpt['run_files'])}")
    lines.extend(f"note: {note}" for note in plan.notes)
    return lines


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """What is printed to stdout meanwhile (DeepSpeed's accelerator line, whose logger holds the process's stdout,
    and any library's print) goes to stderr instead, so that `--plan --json`'s stdout is the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        sys.__stdout__.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_plan(cfg: Config, world_size: int | None, device_memory: str | None, as_json: bool, on_cpu: bool) -> int:
    """Print the plan of `cfg` at `world_size` ranks; with `device_memory`, whether it fits and the layouts that
    do. Returns the exit status (0; 3 when a device memory is given and the configured layout does not fit)."""
    if not world_size:
        raise ConfigError("--plan needs --world-size N (the number of processes the run will have)")
    memory = parse_bytes(device_memory) if device_memory is not None else None
    with stdout_to_stderr() if as_json else contextlib.nullcontext():
        plan, fitting, refused = _plans(cfg, world_size, memory, on_cpu)
    fits = None if memory is None else plan.device_bytes <= memory
    if as_json:
        out: dict[str, Any] = {"plan": plan.to_dict()}
        if memory is not None:
            out.update(device_memory=memory, fits=fits, fitting_layouts=[
                {"dp_size": p.dp_size, "sp_size": p.sp_size, "tp_size": p.tp_size, "device_bytes": p.device_bytes}
                for p in fitting], refused_layouts=refused)
        print(json.dumps(out, indent=1))
    else:
        print("\n".join(plan_lines(plan)))
        if memory is not None:
            verdict = "fits" if fits else "does NOT fit"
            print(f"device memory {gib(memory)}: the configured layout {plan.layout} {verdict} "
                  f"({gib(plan.device_bytes)} per rank)")
            if fitting:
                print(f"layouts of {world_size} ranks that fit, least model parallelism first:")
                for p in fitting[:SHOWN_LAYOUTS]:
                    print(f"  {p.layout}: {gib(p.device_bytes)} per rank "
                          f"(activations {gib(p.memory['activations'])})")
            else:
                print(f"no layout of {world_size} ranks fits {gib(memory)}: lower data.micro_batch_size or "
                      f"data.seq_len, set model.gradient_checkpointing=true or loss.chunk_tokens, or add ranks")
    return 0 if fits is not False else 3


def _plans(cfg: Config, world_size: int, memory: int | None, on_cpu: bool) -> tuple[Plan, list[Plan], list[str]]:
    """The configured layout's plan; with `memory`, the layouts of `world_size` that fit it (least model
    parallelism first) and the trainer's refusals of the others."""
    plan = make_plan(preflight(cfg, world_size, on_cpu, local_files_only=True), world_size, device_type_of_run())
    fitting: list[Plan] = []
    refused: list[str] = []
    if memory is not None:
        for candidate, why, (tp, sp) in candidate_layouts(cfg, world_size, on_cpu):
            if candidate is None:
                refused.append(f"tp {tp} x sp {sp}: {why}")
            elif candidate.device_bytes <= memory:
                fitting.append(candidate)
        fitting.sort(key=lambda p: (p.tp_size * p.sp_size, p.device_bytes))
    return plan, fitting, refused
