"""Worker: models built one after another in one process under `deepspeed.zero.Init` (issue 41).

For each model type: the ZeRO-3-partitioned build from a config twice (and, with a model folder, the partitioned load
from files twice), each handed to its own DeepSpeed engine that runs a forward, backward and optimizer step. Every
entry into `deepspeed.zero.Init` is watched: the modules first imported while it was active are recorded. Writes
OUT.json: {case: {"losses": [...], "imported_inside": [...]} | {"error": traceback}}.

    zero_init_imports.py OUT.json MODEL_DIR|- TYPE [TYPE ...]   (one rank; tests/helpers/distributed.py)
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ntl_pretrain.models.loading import build_from_config_partitioned, load_partitioned  # noqa: E402
from test_model_families import TINY  # noqa: E402  (each family's tiny config: its test keeps one per family)

ARCH = dict(vocab_size=96, pad_token_id=0)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}

ATTENTION = {"gemma2": "eager"}  # transformers runs Gemma2 with eager attention only

IMPORTED_INSIDE: list[str] = []


def watch_zero_init() -> None:
    """Record the modules first imported while any `deepspeed.zero.Init` is active (the project's or DeepSpeed's)."""
    enter, exit_ = deepspeed.zero.Init.__enter__, deepspeed.zero.Init.__exit__
    before: list[set[str]] = []

    def watched_enter(self):
        before.append(set(sys.modules))
        return enter(self)

    def watched_exit(self, *args):
        result = exit_(self, *args)
        IMPORTED_INSIDE.extend(sorted(set(sys.modules) - before.pop()))
        return result

    deepspeed.zero.Init.__enter__, deepspeed.zero.Init.__exit__ = watched_enter, watched_exit


def train_one_step(model: torch.nn.Module) -> float:
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    ids = torch.arange(24).remainder(ARCH["vocab_size"]).reshape(2, 12)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    value = float(loss)
    engine.destroy()
    return value


def main() -> None:
    out, model_dir, model_types = sys.argv[1], sys.argv[2], sys.argv[3:]
    deepspeed.init_distributed(dist_backend="gloo")
    watch_zero_init()
    results = {}
    builds = [(f"{kind}:from_config", kind) for kind in model_types]
    if model_dir != "-":
        builds.append(("folder:load_partitioned", None))
    for case, kind in builds:
        IMPORTED_INSIDE.clear()
        try:
            losses = []
            for _ in range(2):
                torch.manual_seed(0)
                if kind is None:
                    config = AutoConfig.from_pretrained(model_dir)
                    model = load_partitioned(model_dir, config, DS_CONFIG, attn_implementation="sdpa",
                                             dtype=torch.float32, trust_remote_code=False)
                else:
                    config = AutoConfig.for_model(kind, **ARCH, **TINY[kind])
                    model = build_from_config_partitioned(config, DS_CONFIG,
                                                          attn_implementation=ATTENTION.get(kind, "sdpa"),
                                                          dtype=torch.float32, trust_remote_code=False)
                losses.append(train_one_step(model))
            results[case] = {"losses": losses, "imported_inside": list(IMPORTED_INSIDE)}
        except Exception:  # noqa: BLE001 (the test shows the trace of the case that failed)
            results[case] = {"error": traceback.format_exc()[-3000:]}
    with open(out, "w") as file:
        json.dump(results, file)


if __name__ == "__main__":
    main()
