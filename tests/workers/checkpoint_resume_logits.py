"""Worker: resume a run with the real Trainer, train to its end, then write the trained model's logits on a
fixed input, gathered over the tensor-parallel shards (global rank 0 writes them).

    python checkpoint_resume_logits.py OUT.pt CONFIG.yaml key=value ...   (once per rank; tests/helpers/distributed.py)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ntl_pretrain.config import load_config
from ntl_pretrain.train import Trainer


def main() -> None:
    out_file, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    trainer = Trainer(load_config(config, overrides))
    trainer.fit()
    text = "12 + 345 = 357. The answer is 4096 and 17 - 9 = 8."
    input_ids = torch.tensor([trainer.tokenizer(text, add_special_tokens=False)["input_ids"]])
    trainer.engine.eval()
    with torch.no_grad():
        local = trainer.engine(input_ids=input_ids.to(trainer.device)).logits.float().cpu()
    if trainer.tp_group is not None:  # the vocabulary-parallel head returns this rank's columns
        shards = [torch.empty_like(local) for _ in range(dist.get_world_size(trainer.tp_group))]
        dist.all_gather(shards, local.contiguous(), group=trainer.tp_group)
        logits = torch.cat(shards, dim=-1)
    else:
        logits = local
    if dist.get_rank() == 0:
        torch.save({"input_ids": input_ids, "logits": logits, "step": trainer.step}, out_file)


if __name__ == "__main__":
    main()
