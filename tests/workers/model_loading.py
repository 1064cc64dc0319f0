"""Worker: build the model with `model.build_model` under ZeRO-3 (2 CPU ranks), hand it to
`deepspeed.initialize`, then gather every parameter and save (rank 0) the full state dict, the logits of a
fixed batch, the model report and how much of each parameter this rank held before `deepspeed.initialize`.

    model_loading.py MODEL_DIR|- TOKENIZER_DIR OUT.pt PARTITIONED(0|1) RESIZE(0|1) [ARCH_JSON]

MODEL_DIR "-" builds from ARCH_JSON (model.architecture) instead of loading.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import deepspeed
import torch
from transformers import AutoTokenizer

from ntl_pretrain.config import ModelConfig
from ntl_pretrain import distributed
from ntl_pretrain.model import build_model


def main() -> None:
    model_dir, tokenizer_dir, out_path, partitioned, resize = sys.argv[1:6]
    architecture = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = ModelConfig(name_or_path=None if model_dir == "-" else model_dir, architecture=architecture, dtype="fp32",
                      attn_implementation="eager", resize_embeddings=resize == "1",
                      partitioned_load=partitioned == "1")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
                 "steps_per_print": 2**31 - 1}
    model, report = build_model(cfg, tokenizer, 1, ds_config)
    # what this rank holds of each parameter before DeepSpeed sees the model
    held = {name: int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else int(p.numel())
            for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.eval()
    input_ids = torch.arange(24).remainder(len(tokenizer)).reshape(2, 12)
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.detach().clone()
    state = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            state[name] = param.detach().clone()
    if rank == 0:
        torch.save({"state": state, "logits": logits, "report": asdict(report), "held": held,
                    "full": {name: int(t.numel()) for name, t in state.items()},
                    "tied": engine.module.get_output_embeddings().weight is engine.module.get_input_embeddings().weight,
                    "config_vocab": int(engine.module.config.vocab_size)}, out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        distributed.shutdown_distributed()
