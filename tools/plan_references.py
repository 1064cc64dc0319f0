"""The plan of a config beside the two published estimates for the same model (docs/plan.md, "Beside DeepSpeed's
estimator and Megatron's formula"):

- DeepSpeed's `estimate_zero3_model_states_mem_needs_all_live`/`_all_cold` (model states only: parameters, gradients and
  Adam's states partitioned over every GPU, plus the largest layer gathered; no tensor parallelism, no
  activations), called on the model built on the meta device;
- Megatron-LM's theoretical memory (the formula of Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", which `tools/report_theoretical_memory.py` reports), written here from the paper:
  weights and optimizer at 18 bytes a parameter (bf16 weights, fp32 gradients, fp32 master weights and Adam
  moments; 6 + 12 / dp with the distributed optimizer), the parameters split over the tensor-parallel ranks, and
  activations per layer of s*b*h*(34 + 5*a*s/h)/t bytes without recomputation (tensor and sequence parallel),
  34*s*b*h/t with selective recomputation, 2*s*b*h/t with full recomputation, plus the output layer's 4*s*b*h/t +
  4*s*b*v/t.

    python tools/plan_references.py --config configs/llama3_8b_cpt.yaml --world-size 32 [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.plan import make_plan  # noqa: E402
from ntl_pretrain.plan.model import meta_model  # noqa: E402
from ntl_pretrain.plan.planner import device_type_of_run  # noqa: E402
from ntl_pretrain.trainer.preflight import preflight  # noqa: E402

GIB = 2**30


def deepspeed_estimate(model, world_size: int) -> tuple[int, str]:
    """DeepSpeed's own estimator for ZeRO-3 on `world_size` GPUs (one node; its figures depend only on the total):
    its per-GPU bytes without offload, and what it printed. `estimate_zero3_model_states_mem_needs_all_live` counts
    the parameters by storage address, which meta tensors do not have (it would count one), so its `all_cold`
    twin gets the same two numbers counted the same way: parameters (tied ones once), largest module's own."""
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold)

    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=world_size, num_nodes=1)
    _, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world_size,
                                                             num_nodes=1, cpu_offload=False)
    return int(gpu_bytes), printed.getvalue()


def megatron_estimate(text, tp: int, dp: int, seq: int, micro: int, recompute: str, parameters: int,
                      distributed_optimizer: bool = True) -> dict[str, float]:
    """Megatron's theoretical bytes per GPU (pipeline size 1) from the paper's formulas (module docstring)."""
    h, a, v, layers = text.hidden_size, text.num_attention_heads, text.vocab_size, text.num_hidden_layers
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    weights_and_optimizer = parameters / tp * per_param
    sbh = seq * micro * h
    per_layer = {"none": sbh * (34 + 5 * a * seq / h) / tp, "selective": 34 * sbh / tp, "full": 2 * sbh / tp}[recompute]
    output_layer = 4 * sbh / tp + 4 * seq * micro * v / tp
    return {"weights_and_optimizer": weights_and_optimizer, "activations": layers * per_layer + output_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    checked = preflight(cfg, args.world_size, on_cpu=False, local_files_only=True)
    plan = make_plan(checked, args.world_size, device_type_of_run())
    text = checked.model_config.get_text_config()
    model = meta_model(text, checked.run.cfg.model.dtype)
    ds_bytes, ds_printed = deepspeed_estimate(model, args.world_size)
    recompute = "full" if plan.batch["gradient_checkpointing"] else "none"
    megatron = megatron_estimate(text, plan.tp_size, plan.dp_size * plan.sp_size, plan.batch["seq_len"] // plan.sp_size,
                                 plan.batch["micro_batch_size"], recompute, plan.model["parameters"])
    states = sum(plan.memory[k] for k in ("parameters", "persistent_parameters", "gathered_parameters", "gradients",
                                           "reduce_bucket", "master_weights", "optimizer_moments",
                                           "optimizer_step_gradient") if k in plan.memory)
    print(f"{args.config} at {args.world_size} ranks ({plan.layout}), per GPU:")
    print("| | model states | activations (+ logits, loss) | total |")
    print("|---|---|---|---|")
    rest = plan.device_bytes - states
    print(f"| this planner | {states / GIB:.2f} GiB | {rest / GIB:.2f} GiB | {plan.device_bytes / GIB:.2f} GiB |")
    print(f"| DeepSpeed `estimate_zero3_model_states_mem_needs_all_cold` ({args.world_size} GPUs, no TP) | "
          f"{ds_bytes / GIB:.2f} GiB | not estimated | {ds_bytes / GIB:.2f} GiB |")
    print(f"| Megatron's formula (tp {plan.tp_size}, distributed optimizer over {plan.dp_size * plan.sp_size}, "
          f"{recompute} recomputation) | {megatron['weights_and_optimizer'] / GIB:.2f} GiB | "
          f"{megatron['activations'] / GIB:.2f} GiB | "
          f"{(megatron['weights_and_optimizer'] + megatron['activations']) / GIB:.2f} GiB |")
    print("\nDeepSpeed's estimator printed:")
    print(ds_printed.strip())


if __name__ == "__main__":
    main()
