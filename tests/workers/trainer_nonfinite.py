"""Worker: the real Trainer meets non-finite weights (a corrupted shard): every later step's loss is NaN, its
update is skipped (the finite weights stay bitwise as they were), a checkpoint of them is refused, and the run
stops after `train.max_nonfinite_steps` such steps in a row (at that step, whether it logs or not).

    python trainer_nonfinite.py OUT.json CONFIG.yaml key=value ...   (once per rank; tests/helpers/distributed.py)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ntl_pretrain.parallel import distributed
from ntl_pretrain.config import load_config
from ntl_pretrain.trainer.trainer import Trainer, TrainingDiverged


def weight_tensors(trainer: Trainer) -> list[torch.Tensor]:
    """This rank's model partitions (ZeRO-3) or parameters, and the optimizer's (master) weights."""
    tensors = [getattr(p, "ds_tensor", p.data) for p in trainer.parts.engine.module.parameters()]
    optimizer = getattr(trainer.parts.engine.optimizer, "optimizer", trainer.parts.engine.optimizer)
    return tensors + [p for group in optimizer.param_groups for p in group["params"]]


def main() -> None:
    out_file, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer = Trainer(load_config(config, overrides))
    result: dict = {"first": trainer.train_step()}
    result["saved_finite"] = trainer.save_checkpoint()
    with torch.no_grad():  # a corrupted value in every rank's share of the weights (model and master copy)
        for tensor in weight_tensors(trainer):
            if tensor.numel():
                tensor.view(-1)[0] = float("nan")
    before = [t.detach().clone() for t in weight_tensors(trainer)]
    result["nonfinite"], result["nonfinite_totals"] = [], []
    for _ in range(trainer.parts.cfg.train.max_nonfinite_steps - 1):
        result["nonfinite"].append(trainer.train_step())  # None on a step that does not log
        result["nonfinite_totals"].append(trainer.parts.nonfinite.total)
    after = weight_tensors(trainer)
    result["unchanged"] = all(torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
                              for a, b in zip(before, after))
    try:
        trainer.save_checkpoint()
        result["save_refused"] = None
    except TrainingDiverged as error:
        result["save_refused"] = str(error)
    try:
        trainer.train_step()
        result["stopped"] = None
    except TrainingDiverged as error:
        result["stopped"] = str(error)
    result["nonfinite"] = [figures and {k: (v if math.isfinite(v) else str(v)) for k, v in figures.items()}
                           for figures in result["nonfinite"]]
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps(result, indent=1, default=str))
    dist.barrier()


if __name__ == "__main__":
    distributed.run_process(main)
