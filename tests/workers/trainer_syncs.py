"""Worker: build the real Trainer, run one warm-up step (a logging step, with the start-up checks of the
loss), then count the calls that would force a device-to-host sync (tests/helpers/sync_counter.py) during
`steps` more step boundaries as `Trainer.fit` runs them (the step, its log, the pre-emption agreement), each
apart: "plain" (no log) or "logging" steps, and inside them the micro-batch loop (the forward + loss and the
backward of each micro-batch).

Several cases (overrides of one layout) share the process group, one Trainer after the other; rank 0 writes
OUT/<case>.json for each.

    python trainer_syncs.py OUT STEPS CONFIG.yaml CASES.json   (once per rank; tests/helpers/distributed.py)

CASES.json: [{"name": ..., "overrides": ["key=value", ...]}, ...]
Each OUT/<case>.json also holds the run summary and the model's config (for the throughput figures).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.sync_counter import SyncCounter  # noqa: E402

from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.trainer.trainer import Trainer  # noqa: E402


def count_case(out_file: Path, steps: int, config: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(config, overrides))
    trainer.train_step()  # warm-up: first-use work (caches, DeepSpeed's lazy set-up, the loss's checks)
    counter = SyncCounter()

    def micro_batch_phase():  # each micro-batch's forward, loss and backward (StepHooks.around_micro_batch)
        return counter.in_phase(f"{counter.phase}/micro_batch")

    figures, kinds = [], []
    with counter, trainer.with_hooks(around_micro_batch=micro_batch_phase):
        for _ in range(steps):
            kinds.append("logging" if trainer.logs_at(trainer.state.step + 1) else "plain")
            with counter.in_phase(kinds[-1]):  # what Trainer.fit does at each step boundary
                figures.append(trainer.train_step())
                trainer.parts.monitor.log_step(trainer.state.step, figures[-1])
                assert trainer.parts.preemption.requested() is None
        with counter.in_phase("validation"):  # the held-out micro-batches, the mixture's and each source's
            validation = trainer.validate()
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps({
            "steps": kinds, **counter.summary(), "figures": figures, "validation": validation, "summary": trainer.summary(),
            "model_config": trainer.parts.engine.module.config.to_dict(), "world_size": dist.get_world_size()}, indent=1))
    trainer.parts.monitor.close()
    dist.barrier()


def main() -> None:
    out, steps, config, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    for case in json.loads(cases.read_text()):
        count_case(out / f"{case['name']}.json", steps, config, case["overrides"])


if __name__ == "__main__":
    distributed.run_process(main)
