"""Planning a run before it has a cluster (`launch/pretrain.sh --plan --world-size N [--device-memory 80GiB] [--json]`,
docs/plan.md): per rank the device bytes of each kind, the traffic of a step per group, the checkpoint's files, and
the layouts that fit a device; from the model's config.json alone (the model on the meta device), checked against
real DeepSpeed steps by tests/test_plan_measured.py."""

from .planner import MEMORY_TERMS, Plan, make_plan, zero3_settings
from .report import candidate_layouts, parse_bytes, run_plan

__all__ = ["MEMORY_TERMS", "Plan", "candidate_layouts", "make_plan", "parse_bytes", "run_plan", "zero3_settings"]
