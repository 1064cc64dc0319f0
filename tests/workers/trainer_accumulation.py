"""Worker: the real Trainer at several batch splits of one global batch, each for a few logged steps; rank 0
writes OUT/<case>.json with each step's global figures (loss, ce, ntl, grad_norm, ...).

Several cases share the process group, one Trainer after the other (the same layout, other overrides).

    python trainer_accumulation.py OUT STEPS CONFIG.yaml CASES.json   (once per rank; tests/helpers/distributed.py)

CASES.json: [{"name": ..., "overrides": ["key=value", ...]}, ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from ntl_pretrain.config import load_config
from ntl_pretrain.parallel import distributed
from ntl_pretrain.trainer.trainer import Trainer


def run_case(out_file: Path, steps: int, config: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(config, overrides))
    figures = []
    for _ in range(steps):
        assert trainer.logs_at(trainer.state.step + 1)  # every step logs: its figures are global and on the host
        figures.append(trainer.train_step())
    if dist.get_rank() == 0:
        out_file.write_text(json.dumps({"figures": figures, "summary": trainer.summary()}, indent=1))
    trainer.parts.monitor.close()
    dist.barrier()


def main() -> None:
    out, steps, config, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    for case in json.loads(cases.read_text()):
        run_case(out / f"{case['name']}.json", steps, config, case["overrides"])


if __name__ == "__main__":
    distributed.run_process(main)
