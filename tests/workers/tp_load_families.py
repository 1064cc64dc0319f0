"""Worker: for each saved tiny model, build it with `model.build_model` at T=2 under ZeRO-3 twice, with the
partitioned load (each rank reads its AutoTP slices) and with the full load (`from_pretrained` on every rank,
then AutoTP slices it), hand each to `deepspeed.initialize`, and save per rank the local parameters (this rank's
TP slice of each, gathered over its data-parallel group), the elements of each it held before `deepspeed.initialize`,
and the logits of a fixed batch (the vocabulary shards
concatenated).

    tp_load_families.py ROOT TOKENIZER_DIR MODEL_TYPE [MODEL_TYPE ...]

ROOT/MODEL_TYPE is the saved model; writes ROOT/MODEL_TYPE_{partitioned,full}_rankR.pt.
"""

from __future__ import annotations

import gc
import os
import sys

import deepspeed
import torch
from transformers import AutoTokenizer

from ntl_pretrain.config import ModelConfig
from ntl_pretrain.models.build import build_model
from ntl_pretrain.parallel import distributed

TP = 2


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3}, "steps_per_print": 2**31 - 1,
            "tensor_parallel": {"autotp_size": TP, "vocab_parallel_lm_head": True}}


def run(root: str, tokenizer: object, model_type: str, partitioned: bool) -> None:
    from deepspeed.utils import groups

    rank = torch.distributed.get_rank()
    cfg = ModelConfig(name_or_path=os.path.join(root, model_type), dtype="fp32", attn_implementation="eager",
                      partitioned_load=partitioned)
    ds_config = _ds_config()
    model, _ = build_model(cfg, tokenizer, TP, ds_config)
    held_before = {name: 0 if param.is_meta else param.numel() for name, param in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.eval()
    local = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            local[name] = param.detach().clone()
    input_ids = torch.arange(24).remainder(len(tokenizer)).reshape(2, 12)
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.detach().clone()
    shards = [torch.empty_like(logits) for _ in range(TP)]
    torch.distributed.all_gather(shards, logits, group=groups.get_tensor_model_parallel_group())
    kind = "partitioned" if partitioned else "full"
    torch.save({"local": local, "logits": torch.cat(shards, dim=-1), "held_before": held_before},
               os.path.join(root, f"{model_type}_{kind}_rank{rank}.pt"))
    del engine, model
    gc.collect()


def main() -> None:
    root, tokenizer_dir, *model_types = sys.argv[1:]
    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for model_type in model_types:
        for partitioned in (True, False):
            run(root, tokenizer, model_type, partitioned)
    torch.distributed.barrier()


if __name__ == "__main__":
    distributed.run_process(main)
