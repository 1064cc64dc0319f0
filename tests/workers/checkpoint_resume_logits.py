"""Worker: run (or resume) a run with the real Trainer to its end, then write the trained model's logits on a
fixed input, gathered over the tensor-parallel shards (global rank 0 writes them).

    python checkpoint_resume_logits.py OUT.pt CONFIG.yaml key=value ... [-- OUT.pt CONFIG.yaml key=value ...]
    (once per rank; tests/helpers/distributed.py)

Runs separated by `--` share the process group, one Trainer after the other (one layout: DeepSpeed keeps its
tensor-parallel groups for the process).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ntl_pretrain.parallel import distributed
from ntl_pretrain.config import load_config
from ntl_pretrain.trainer.trainer import Trainer

TEXT = "12 + 345 = 357. The answer is 4096 and 17 - 9 = 8."


def run(out_file: str, config: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config(config, overrides))
    trainer.fit()
    input_ids = torch.tensor([trainer.parts.tokenizer(TEXT, add_special_tokens=False)["input_ids"]])
    trainer.parts.engine.eval()
    with torch.no_grad():
        local = trainer.parts.engine(input_ids=input_ids.to(trainer.parts.device)).logits.float().cpu()
    if trainer.parts.groups.tp_group is not None:  # the vocabulary-parallel head returns this rank's columns
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(trainer.parts.groups.tp_group))]
        dist.all_gather(shards, local.contiguous(), group=trainer.parts.groups.tp_group)
        logits = torch.cat(shards, dim=-1)
    else:
        logits = local
    if dist.get_rank() == 0:
        torch.save({"input_ids": input_ids, "logits": logits, "step": trainer.state.step}, out_file)
    dist.barrier()
    trainer.parts.lock.release()  # as the command line does: a later run of this process may use the folder


def main() -> None:
    args = sys.argv[1:]
    while args:
        end = args.index("--") if "--" in args else len(args)
        out_file, config, *overrides = args[:end]
        run(out_file, config, overrides)
        args = args[end + 1:]


if __name__ == "__main__":
    distributed.run_process(main)
