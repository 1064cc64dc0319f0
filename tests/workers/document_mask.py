"""Worker: packed documents under DeepSpeed ZeRO-3 with AutoTP (--tp 2) or Ulysses sequence parallelism (--sp 2)
equal the documents run one by one (data.document_mask).

Every rank first computes the reference with a plain `LlamaForCausalLM` (sdpa) on each document alone
(tests/helpers/documents.py), BEFORE DeepSpeed's Ulysses attention replaces sdpa in this process. Then a ZeRO-3
engine of the same weights runs the packed rows through the trainer's inputs (`model_inputs`: per-document
position ids, this rank's slice under sp); this rank's logits (its vocabulary shard under TP, its sequence slice
under sp) must equal the reference's, and the CE and NTL sums (was, number_level; summed over the sp group) the
reference's, to 1e-5. Prints `OK logits`, then `OK <variant>` per NTL variant.

    document_mask.py --tp T --sp S --seq-len N   (2 processes; tests/helpers/distributed.py)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.documents import SETTINGS, one_by_one, packed_rows  # noqa: E402
from helpers.models import char_tokenizer, tiny_llama  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from ntl_pretrain.loss import ce_ntl_sums, vocab_shard_of  # noqa: E402
from ntl_pretrain.loss.sequence_shard import SequenceShard, shard_number_spans  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.parallel.ulysses import model_inputs, register_ulysses_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    args = parser.parse_args()
    import deepspeed

    deepspeed.init_distributed("gloo")
    tokenizer = char_tokenizer()
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=True)
    eos = tokenizer.eos_token_id
    model = tiny_llama(len(tokenizer), max_position_embeddings=args.seq_len).train()
    model.config._attn_implementation = "sdpa"
    input_ids, labels = packed_rows(tokenizer, args.seq_len)
    reference_logits, reference = one_by_one(model, input_ids, labels, vocab, eos)

    config = {"train_micro_batch_size_per_gpu": input_ids.shape[0], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "steps_per_print": 2**31 - 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    ulysses, shard = None, SequenceShard()
    if args.sp > 1:
        ulysses = register_ulysses_attention(model, args.sp, input_ids.shape[0], document_mask=True)
        config["sequence_parallel_size"] = args.sp
        shard = ulysses.shard
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp, "vocab_parallel_lm_head": True}
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), model_parameters=None, config=config,
                                      mpu=ulysses.mpu if ulysses else None)
    vocab_shard = vocab_shard_of(engine)
    with torch.no_grad():
        logits = engine(**model_inputs(input_ids, shard, eos)).logits
        start, stop = shard.bounds(args.seq_len)
        width = logits.shape[-1]
        expected = reference_logits[:, start:stop, vocab_shard.start:vocab_shard.start + width]
        error = relative_error(logits, expected)
        assert error < 1e-5 and (logits - expected).abs().max() < 1e-5, ("logits", error)
        print(f"OK logits {error:.1e}", flush=True)
        for name, settings in SETTINGS.items():
            spans = shard_number_spans(labels, shard, vocab, settings) if settings.ntl_variant.needs_spans else None
            sums = ce_ntl_sums(logits, shard.split(labels), vocab, settings, shard=vocab_shard, spans=spans)
            both = torch.stack([sums.ce_sum, sums.ntl_sum]).double()
            if shard.size > 1:
                dist.all_reduce(both, group=shard.group)
            ce_error, ntl_error = (abs(float(v) - r) / abs(r) for v, r in zip(both, reference[name]))
            assert ce_error < 1e-5 and ntl_error < 1e-5, (name, ce_error, ntl_error)
            print(f"OK {name} ce={ce_error:.1e} ntl={ntl_error:.1e}", flush=True)


if __name__ == "__main__":
    distributed.run_process(main)
