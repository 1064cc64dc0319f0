"""Worker: start the real `Trainer` from a YAML config (one process per rank), run STEPS optimizer steps,
save a checkpoint, and write (rank 0) how many elements of each of the model's parameters each rank held
right after `build_model` (before `deepspeed.initialize`).

    trainer_start.py CONFIG.yaml STEPS OUT.json [key=value ...]
"""

from __future__ import annotations

import json
import sys

import torch

import ntl_pretrain.trainer.engine as engine
import ntl_pretrain.trainer.trainer as train
from ntl_pretrain.parallel import distributed
from ntl_pretrain.config import load_config

HELD: dict[str, int] = {}


def _recording_build_model(*args, **kwargs):
    model, report = BUILD_MODEL(*args, **kwargs)
    for name, param in model.named_parameters():
        if hasattr(param, "ds_tensor"):
            HELD[name] = int(param.ds_tensor.numel())
        else:  # a meta tensor (weights AutoTP slices, read inside deepspeed.initialize) holds nothing
            HELD[name] = 0 if param.is_meta else int(param.numel())
    return model, report


BUILD_MODEL = engine.build_model
engine.build_model = _recording_build_model


def main() -> None:
    config, steps, out_path, *overrides = sys.argv[1:]
    trainer = train.Trainer(load_config(config, overrides))
    for _ in range(int(steps)):
        trainer.train_step()
    trainer.save_checkpoint()
    held = [None] * trainer.parts.layout.world_size
    torch.distributed.all_gather_object(held, HELD)
    if trainer.parts.layout.is_main:
        with open(out_path, "w", encoding="utf-8") as handle:
            json.dump({"held": held, "step": trainer.state.step}, handle)


if __name__ == "__main__":
    distributed.run_process(main)
