"""Worker: the real Trainer's optimizer step (`Trainer.train_step`) on a fixed global batch, for several
configurations in one process group (one DeepSpeed start for all of them).

Each case builds a `Trainer` from CONFIG.yaml + the case's overrides, feeds its steps (`StepHooks.micro_batches`)
this rank's share of the batch file (split over data-parallel ranks and accumulation steps as `PretrainingData.next_step`
splits a step), and runs steps on that same batch until one has a learning rate above 0 (the first one: the
trainer starts the schedule at iteration 1; a schedule that started at lr 0 would make every step until then
see the initial weights and the last one update them, Adam's moments holding that one gradient once a step).
Rank 0 writes `OUT/<case>/result.json` (each step's figures and the lr its update used) and
`OUT/<case>/weights.pt` (the weights after the last step, gathered over ZeRO-3 and TP). Each Trainer's
`ParallelGroups` are first checked against the groups DeepSpeed's engine built (`check_groups`).

    trainer_step.py OUT BATCH.pt CONFIG.yaml CASES.json   (once per rank; tests/helpers/distributed.py)

CASES.json: [{"name": ..., "overrides": ["key=value", ...]}, ...]
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ntl_pretrain.parallel import distributed
from ntl_pretrain.config import load_config
from ntl_pretrain.data import MicroBatch
from ntl_pretrain.trainer.trainer import Trainer


def fixed_batch(trainer: Trainer, batch: dict):
    """A `StepHooks.micro_batches` that hands this rank its micro-batches of `batch` (the same split as the data
    stream's `next_step`)."""
    micro, accumulation = trainer.parts.cfg.data.micro_batch_size, trainer.parts.cfg.train.grad_accum_steps
    dp_rank, dp_size = trainer.parts.layout.data_rank, trainer.parts.layout.data_size
    assert batch["input_ids"].shape[0] == micro * accumulation * dp_size, "the batch does not fill one step"

    def next_step(grad_accum_steps: int) -> list[MicroBatch]:
        assert grad_accum_steps == accumulation
        rows = [slice((m * dp_size + dp_rank) * micro, (m * dp_size + dp_rank + 1) * micro) for m in range(accumulation)]
        return [MicroBatch(input_ids=batch["input_ids"][r].clone(), labels=batch["labels"][r].clone()) for r in rows]

    return next_step


def gathered_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    engine = trainer.parts.engine
    if trainer.parts.cfg.parallel.zero_stage == 3:
        return engine._zero3_consolidated_16bit_state_dict()  # gathers over ZeRO-3 and the TP shards
    assert trainer.parts.cfg.parallel.tp_size == 1, "weights of TP without ZeRO-3 are not gathered here"
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def check_groups(trainer: Trainer) -> None:
    """The layout's groups are the ones DeepSpeed's engine uses: losses and counts are summed over the group it
    reduces gradients over, the loss scaling undoes its divisor, the vocabulary group is the LM head's."""
    from deepspeed.utils import groups as ds_groups

    def ranks(group) -> list[int]:
        return sorted(dist.get_process_group_ranks(group))

    engine, groups, layout = trainer.parts.engine, trainer.parts.groups, trainer.parts.layout
    assert ranks(groups.loss_group) == ranks(engine.seq_data_parallel_group), "losses summed off the gradient group"
    assert layout.grad_average_size == engine.seq_dp_world_size  # ZeRO-3's divisor (sp = 1 here: ZeRO 0-2's too)
    assert (layout.data_rank, layout.data_size) == (engine.seq_data_parallel_group.rank(), engine.seq_dp_world_size)
    if layout.tp_size > 1:
        assert ranks(groups.tp_group) == ranks(ds_groups.get_tensor_model_parallel_group())
        assert ranks(groups.vocab_group) == ranks(trainer.parts.vocab_shard.tp_group)
        assert ranks(groups.dp_group) == ranks(ds_groups.get_data_parallel_group())
    else:
        assert groups.tp_group is None and trainer.parts.vocab_shard.tp_group is None
        assert ranks(groups.dp_group) == list(range(dist.get_world_size()))


def run_case(out: Path, batch: dict, config: str, name: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(config, [*overrides, f"train.output_dir={out / name / 'run'}"]))
    check_groups(trainer)
    head = trainer.parts.engine.module.get_output_embeddings().weight
    if trainer.parts.cfg.parallel.zero_stage == 3:  # partitioned like a real head: the step must gather it
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        assert head.ds_status == ZeroParamStatus.NOT_AVAILABLE, head.ds_summary()
    lrs, figures = [], []
    with trainer.with_hooks(micro_batches=fixed_batch(trainer, batch)):
        while not lrs or lrs[-1] == 0.0:
            assert len(lrs) < 5, f"the learning rate stayed 0 for {lrs}"
            lrs.append(float(trainer.parts.engine.get_lr()[0]))  # what this step's update uses (the schedule moves after)
            figures.append(trainer.train_step())
    weights = gathered_weights(trainer)
    if dist.get_rank() == 0:
        torch.save(weights, out / name / "weights.pt")
        (out / name / "result.json").write_text(json.dumps({
            "figures": figures, "lrs": lrs, "dp_size": trainer.parts.layout.dp_size, "tp_size": trainer.parts.layout.tp_size,
            "zero_stage": trainer.parts.cfg.parallel.zero_stage, "chunk_tokens": trainer.parts.cfg.loss.chunk_tokens}))
    del trainer, weights
    gc.collect()
    dist.barrier()


def main() -> None:
    out, batch_file, config, cases_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    batch = torch.load(batch_file)
    for case in json.loads(Path(cases_file).read_text()):
        run_case(out, batch, config, case["name"], case["overrides"])


if __name__ == "__main__":
    distributed.run_process(main)
