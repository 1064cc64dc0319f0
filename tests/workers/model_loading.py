"""Worker: build the model with `model.build_model` under ZeRO-3 (2 CPU ranks, T=1 or AutoTP T=2), hand it
to `deepspeed.initialize`, then save (rank 0) the full weights (T=1: every parameter gathered; T=2: DeepSpeed's
own 16-bit export, `engine.save_16bit_model`, which gathers the ZeRO partitions and the TP slices), the logits
of a fixed batch (the TP ranks' vocabulary shards concatenated), the model report, and how many elements of
each parameter each rank held before `deepspeed.initialize` and after it, and how many elements ZeRO-3
partitioned while the model was built (a tied head's own weight, replaced by `tie_weights`, must not be).

    model_loading.py MODEL_DIR|- TOKENIZER_DIR OUT.pt PARTITIONED(0|1) RESIZE(0|1) TP(1|2) [ARCH_JSON] [-- JOB ...]

MODEL_DIR "-" builds from ARCH_JSON (model.architecture) instead of loading. Several jobs separated by "--" run one
after the other in the same process group (one DeepSpeed start; the same TP size for all, as DeepSpeed keeps its
groups for the process).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from dataclasses import asdict

import deepspeed
import torch
from transformers import AutoTokenizer

from ntl_pretrain.config import ModelConfig
from ntl_pretrain.parallel import distributed
from ntl_pretrain.models.build import build_model


def _held(model: torch.nn.Module) -> dict[str, int]:
    """Elements of each parameter this rank holds in memory (its ZeRO partition; 0 for a meta tensor)."""
    held = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_tensor"):
            held[name] = int(param.ds_tensor.numel())
        else:
            held[name] = 0 if param.is_meta else int(param.numel())
    return held


def main() -> None:
    jobs: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == "--":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    if len({job[5] for job in jobs}) != 1:
        raise SystemExit("every job of one launch must have the same TP size")
    deepspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        run_job(*job)
        gc.collect()


def run_job(model_dir: str, tokenizer_dir: str, out_path: str, partitioned: str, resize: str, tp: str,
            architecture_json: str = "{}") -> None:
    architecture = json.loads(architecture_json)
    tp_size = int(tp)
    rank = torch.distributed.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = ModelConfig(name_or_path=None if model_dir == "-" else model_dir, architecture=architecture, dtype="fp32",
                      attn_implementation="eager", resize_embeddings=resize == "1",
                      partitioned_load=partitioned == "1")
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
                 "steps_per_print": 2**31 - 1}
    if tp_size > 1:
        ds_config["tensor_parallel"] = {"autotp_size": tp_size, "vocab_parallel_lm_head": True}
    converted = []  # full sizes of the parameters ZeRO-3 partitions while the model is built
    convert = deepspeed.zero.Init._convert_to_deepspeed_param

    def counting_convert(self, param):
        converted.append(int(param.numel()))
        return convert(self, param)

    deepspeed.zero.Init._convert_to_deepspeed_param = counting_convert
    model, report = build_model(cfg, tokenizer, tp_size, ds_config)
    deepspeed.zero.Init._convert_to_deepspeed_param = convert
    held_before = _held(model)  # what this rank holds of each parameter before DeepSpeed sees the model
    full = {name: int(p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    held_after = _held(engine.module)
    engine.eval()
    input_ids = torch.arange(24).remainder(len(tokenizer)).reshape(2, 12)
    with torch.no_grad():
        logits = engine(input_ids=input_ids).logits.detach().clone()
    if tp_size > 1:  # the vocabulary-parallel head gives each TP rank its shard of the vocabulary
        from deepspeed.utils import groups

        shards = [torch.empty_like(logits) for _ in range(tp_size)]
        torch.distributed.all_gather(shards, logits, group=groups.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
        export = os.path.join(os.path.dirname(out_path), "export16")
        engine.save_16bit_model(export, "weights.bin")
        state = torch.load(os.path.join(export, "weights.bin")) if rank == 0 else None
    else:
        state = {}
        for name, param in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                state[name] = param.detach().clone()
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, {"before": held_before, "after": held_after})
    if rank == 0:
        torch.save({"state": state, "logits": logits, "report": asdict(report), "held": held, "full": full,
                    "tied": engine.module.get_output_embeddings().weight is engine.module.get_input_embeddings().weight,
                    "config_vocab": int(engine.module.config.vocab_size), "converted_elements": sum(converted)},
                   out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    distributed.run_process(main)
