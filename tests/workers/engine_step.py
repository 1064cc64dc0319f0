"""Worker: one optimizer step of a tiny Llama through a real DeepSpeed engine with CE + NTL.

The global batch is fixed (a file); the worker splits it over data-parallel ranks and gradient
accumulation steps as asked, uses the trainer-side normalisation (`count_step`,
`scaled_micro_batch_loss`) and the vocabulary-parallel objective, and writes the step's global loss,
the grad norm and the full weights after the step (gathered over ZeRO-3 and TP) from rank 0.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.module_inject.layers import VocabParallelLinear
from deepspeed.utils import groups
from transformers import AutoModelForCausalLM

from ntl_pretrain.loss import NTLSettings, ce_ntl_sums, count_step, scaled_micro_batch_loss, vocab_shard_of
from ntl_pretrain import distributed
from ntl_pretrain.numbers import NumberVocab


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="HF folder with the initial weights")
    parser.add_argument("--batch", required=True, help="torch file with input_ids, labels [G, S] and the number vocab")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--variant", default="was")
    parser.add_argument("--ntl-weight", type=float, default=0.5)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    data = torch.load(args.batch)
    global_batch = data["input_ids"].shape[0]
    dp_size = world // args.tp
    micro_batch = global_batch // (dp_size * args.grad_accum)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp, "vocab_parallel_lm_head": True}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    # SGD: the update is proportional to the gradient, so a wrong normalisation shows in the weights
    # (Adam's first step would hide a constant factor).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    heads = [m for m in engine.module.modules() if isinstance(m, VocabParallelLinear)]
    shard = vocab_shard_of(engine)
    assert (len(heads) == 1) == (args.tp > 1), "AutoTP should have made exactly one vocab-parallel head"
    assert shard.is_split == (args.tp > 1) and (not heads or shard.start == heads[0].vocab_start_index), shard
    dp_group = groups._get_data_parallel_group()
    dp_rank = groups._get_data_parallel_rank()
    assert groups._get_data_parallel_world_size() == dp_size == engine.dp_world_size

    number_vocab = NumberVocab(**data["number_vocab"])
    settings = NTLSettings(variant=args.variant)
    micro_batches = []
    for index in range(args.grad_accum):
        first = (index * dp_size + dp_rank) * micro_batch
        micro_batches.append((data["input_ids"][first:first + micro_batch], data["labels"][first:first + micro_batch]))
    counts = count_step([labels for _, labels in micro_batches], number_vocab, settings, dp_group)

    ce_sum = ntl_sum = 0.0
    for input_ids, labels in micro_batches:
        logits = engine(input_ids=input_ids).logits
        sums = ce_ntl_sums(logits, labels, number_vocab, settings, shard=shard)
        loss = scaled_micro_batch_loss(sums, counts, args.ntl_weight, dp_size, args.grad_accum)
        engine.backward(loss)
        engine.step()
        ce_sum += sums.ce_sum.item()
        ntl_sum += sums.ntl_sum.item()
    totals = torch.tensor([ce_sum, ntl_sum], dtype=torch.float64)
    dist.all_reduce(totals, group=dp_group)
    tokens, ntl_positions = float(counts.tokens), float(counts.ntl_positions)
    global_loss = totals[0].item() / tokens + args.ntl_weight * totals[1].item() / ntl_positions
    grad_norm = engine.get_global_grad_norm()  # None without ZeRO (a plain torch optimizer keeps no norm)
    grad_norm = None if grad_norm is None else float(grad_norm)

    if args.zero_stage == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(state, f"{args.out}/weights.pt")
        with open(f"{args.out}/result.json", "w") as handle:
            json.dump({"loss": global_loss, "grad_norm": grad_norm, "tokens": tokens,
                       "ntl_positions": ntl_positions}, handle)
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        distributed.shutdown_distributed()
