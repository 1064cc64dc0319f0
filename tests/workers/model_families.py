"""Worker: the real Trainer's first step (`Trainer.train_step`) for several model families in one process group
(one DeepSpeed start; one tensor-parallel size per launch, as DeepSpeed keeps its groups for the process).

Each case builds a `Trainer` from CONFIG.yaml + its overrides and runs one step on this rank's share of the fixed
batch (`trainer_step.fixed_batch`); a ValueError raised while the Trainer starts (a refusal) is recorded with
whether the model had been built by then, and so is any other error (then the case failed). Rank 0 writes
`OUT/<case>.json`: {"figures": step 1's figures, "split": the parameters AutoTP split} | {"refused": the message,
"built": bool} | {"error": ...}.

    model_families.py OUT BATCH.pt CONFIG.yaml CASES.json   (once per rank; tests/helpers/distributed.py)

CASES.json: [{"name": ..., "overrides": ["key=value", ...]}, ...]
"""

from __future__ import annotations

import gc
import json
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from trainer_step import fixed_batch

from ntl_pretrain.parallel import distributed
from ntl_pretrain.trainer import engine
from ntl_pretrain.checkpoint import export_hf
from ntl_pretrain.config import load_config
from ntl_pretrain.trainer.trainer import Trainer


def split_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the parameters AutoTP split over the tensor-parallel ranks (from the layout DeepSpeed records
    on each), layer 0's only (the other layers are split alike)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    return sorted(name for name, param in model.named_parameters() if re.search(r"\.[1-9]\d*\.", name) is None
                  if (getattr(param, DS_AUTOTP_UC_META, None) or {"replicated": True}).get("replicated") is False)


def run_case(out: Path, batch: dict, config: str, name: str, overrides: list[str], built: list[str],
             export: bool = False) -> None:
    trainer = None
    try:
        trainer = Trainer(load_config(config, [*overrides, f"train.output_dir={out / name}"]))
        with trainer.with_hooks(micro_batches=fixed_batch(trainer, batch)):
            result = {"figures": trainer.train_step(), "split": split_parameters(trainer.parts.engine.module)}
        if export:  # the checkpoint of step 1, exported as tools/export_hf.py does (one process)
            tag = trainer.save_checkpoint()
            if dist.get_rank() == 0:
                export_hf(str(out / name / tag), str(out / f"{name}_hf"))
            dist.barrier()
    except ValueError as error:
        result = {"refused": str(error), "built": name in built}
    except Exception:  # noqa: BLE001 (a family that crashes: the test shows its trace)
        result = {"error": traceback.format_exc()[-3000:]}
    if int(torch.distributed.get_rank() if dist.is_initialized() else 0) == 0:
        (out / f"{name}.json").write_text(json.dumps(result))
    if trainer is not None:
        trainer.parts.lock.release()
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    out, batch_file, config, cases_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    batch = torch.load(batch_file)
    built: list[str] = []  # the cases whose model was built (build_model called)
    build_model, current = engine.build_model, [""]

    def recording_build_model(*args, **kwargs):
        built.append(current[0])
        return build_model(*args, **kwargs)

    engine.build_model = recording_build_model
    for case in json.loads(Path(cases_file).read_text()):
        current[0] = case["name"]
        run_case(out, batch, config, case["name"], case["overrides"], built, case.get("export", False))


if __name__ == "__main__":
    distributed.run_process(main)
