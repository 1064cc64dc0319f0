"""Worker: CE + NTL under Ulysses sequence parallelism (DeepSpeed ZeRO-3, gloo) equals plain transformers on one
process for the same global batch: the loss, every gradient (`safe_get_full_grad`) and the weights after one
AdamW step, for CE alone and every registered NTL variant (number-level with numbers across the shard boundaries).

Every rank first computes the reference on the whole global batch with a plain `LlamaForCausalLM` (sdpa) and
`torch.optim.AdamW`, BEFORE DeepSpeed's Ulysses attention replaces sdpa in this process. Then, per case, a
fresh DeepSpeed ZeRO-3 engine (`sequence_parallel_size`, the mpu of `register_ulysses_attention`) runs this
rank's rows (data-parallel rank = rank // sp) on its sequence slice, normalises with the global counts (the
slice's tokens and term positions, summed over all sp x dp ranks) and the scale DeepSpeed divides the gradient
by (the sequence-data-parallel world size), and steps; one case runs the chunked head. Prints
`OK <case> loss=.. grad=.. weights=.. update=..` (the largest relative errors) per case, `CROSSING n` (numbers
continuing from the previous slice into this rank's) and the all-reduces of one number-level objective call.

    sp_objective.py --sp N [--cases ce,was,...]   (WORLD_SIZE = N * dp processes; tests/helpers/distributed.py;
                                                   --cases: a subset of CASES, default all)
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import char_tokenizer, tiny_llama_config  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from helpers.variants import LARGE_TERM_OPTIONS, variant_settings  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import (VARIANTS, NTLSettings, ce_ntl_sums, chunked_model_ce_ntl_sums,  # noqa: E402
                               scaled_micro_batch_loss)
from ntl_pretrain.loss.normalize import StepCounts  # noqa: E402
from ntl_pretrain.loss.sequence_shard import shard_number_spans, shard_term_positions  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402
from ntl_pretrain.eval.generate import greedy_generate  # noqa: E402
from ntl_pretrain.parallel.ulysses import register_ulysses_attention, shard_inputs  # noqa: E402

SEQ_LEN = 24
# Rows of the global batch; with sp=2 the boundary falls between labels 11 and 12 (text characters 12 and 13),
# with sp=4 also at 5|6 and 17|18: row 0 has a 10-digit number across 12|13, row 1 a decimal number across it
# (one number for float_level), row 2 a number ending right at it, row 3 ignored labels and a long number
# crossing two boundaries of sp=4.
ROWS = ["abc 12+3=1234567890 xyz q..", "7.25 is 3.14159265 or 42. ok", "ab 0 cd 98765 z 554321,qq",
        "q 5 12345678901234567 ab 7 8x"]
# Adam's first step is lr * g / (|g| + eps): eps well above the float32 round-off of gradient entries (~1e-9 here),
# or entries of ~1e-8 turn that round-off into steps of lr / 2 that differ between two correct runs
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-5, 0.1
NTL_WEIGHT = 0.5
# CE alone, every registered variant (del's runs over the flattened batch, the authors'), and number-level's options
CASES = {"ce": None, **{variant: variant_settings(variant, LARGE_TERM_OPTIONS, reweigh=True) for variant in VARIANTS},
         "number_level_float": NTLSettings(variant="number_level", float_level=True, reweigh=True),
         "number_level_chunked": NTLSettings(variant="number_level", float_level=True)}

PROMPTS = ["1+2=", "12+345=", "7", "98-76=1"]  # several lengths: a left-padded batch
CHUNK_TOKENS = {"number_level_chunked": 7}  # the chunked head (loss.chunk_tokens), chunks not aligned with shards


def global_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([tokenizer(text)["input_ids"][:SEQ_LEN + 1] for text in ROWS])
    labels = ids[:, 1:].clone()
    labels[3, :3] = -100
    return ids[:, :-1].contiguous(), labels


def make_model(vocab_size: int):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size, max_position_embeddings=SEQ_LEN)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def global_counts(labels: torch.Tensor, positions: torch.Tensor, settings: NTLSettings, group=None) -> StepCounts:
    counts = torch.stack([(labels != -100).sum(), positions.sum()]).double()
    if group is not False:
        dist.all_reduce(counts, group=group)
    return StepCounts(tokens=counts[0], ntl_positions=counts[1])


def reference(model, input_ids, labels, vocab: NumberVocab, settings: NTLSettings | None):
    """(loss, grads, weights after AdamW) of plain transformers on the whole batch, one process."""
    from ntl_pretrain.loss.ntl import term_positions

    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    ntl = settings or NTLSettings()
    sums = ce_ntl_sums(model(input_ids=input_ids).logits, labels, vocab, ntl, with_ntl=settings is not None)
    counts = global_counts(labels, term_positions(labels, vocab, ntl), ntl, group=False)
    loss = sums.ce_sum / counts.tokens + (NTL_WEIGHT * sums.ntl_sum / counts.ntl_positions if settings else 0.0)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    return loss.item(), grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def deepspeed_config(rows: int, sp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3}, "sequence_parallel_size": sp,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WEIGHT_DECAY, "torch_adam": True}}}


def sharded(model, input_ids, labels, vocab, settings, sp: int, ulysses, chunk_tokens: int = 0):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    world = dist.get_world_size()
    dp, dp_rank = world // sp, dist.get_rank() // sp
    rows = input_ids.shape[0] // dp
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
    config = deepspeed_config(rows, sp)
    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model).train(), config=config, mpu=ulysses.mpu)
    shard = ulysses.shard
    ntl = settings or NTLSettings()
    row_labels = labels[mine]
    inputs = shard_inputs(input_ids[mine], shard)
    spans = shard_number_spans(row_labels, shard, vocab, ntl) if ntl.ntl_variant.needs_spans else None
    if chunk_tokens:
        sums = chunked_model_ce_ntl_sums(engine, engine.module.get_output_embeddings(), inputs.as_kwargs(),
                                         shard.split(row_labels), vocab, ntl, chunk_tokens=chunk_tokens,
                                         with_ntl=settings is not None, spans=spans)
    else:
        logits = engine(**inputs.as_kwargs()).logits
        sums = ce_ntl_sums(logits, shard.split(row_labels), vocab, ntl, with_ntl=settings is not None, spans=spans)
    counts = global_counts(shard.split(row_labels), shard_term_positions(row_labels, shard, vocab, ntl), ntl)
    divisor = engine.seq_dp_world_size  # what ZeRO-3 divides the summed gradient by (sp x dp)
    assert divisor == world, (divisor, world)
    engine.backward(scaled_micro_batch_loss(sums, counts, NTL_WEIGHT if settings else 0.0, divisor, 1))
    piece = (sums.ce_sum / counts.tokens + (NTL_WEIGHT * sums.ntl_sum / counts.ntl_positions if settings else 0.0))
    loss = piece.detach().reshape(1).double()
    dist.all_reduce(loss)
    grads = {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}
    engine.step()
    weights = engine._zero3_consolidated_16bit_state_dict()
    del engine
    return loss.item(), grads, weights


def count_collectives(fn) -> dict[str, int]:
    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        fn()
    finally:
        dist.all_reduce = original
    return calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES to run")
    args = parser.parse_args()
    sp, cases = args.sp, {name: CASES[name] for name in args.cases.split(",")}
    import deepspeed

    deepspeed.init_distributed("gloo")
    tokenizer = char_tokenizer()
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=True)
    input_ids, labels = global_batch(tokenizer)
    model = make_model(len(tokenizer))
    references = {name: reference(model, input_ids, labels, vocab, settings) for name, settings in cases.items()}

    generated = greedy_generate(copy.deepcopy(model), tokenizer, PROMPTS, max_new_tokens=6, batch_size=len(PROMPTS))

    rows = input_ids.shape[0] // (dist.get_world_size() // sp)
    ulysses = register_ulysses_attention(model, sp, micro_batch_size=rows)
    shard = ulysses.shard
    assert shard.size == sp and shard.rank == dist.get_rank() % sp, shard
    spans = shard_number_spans(labels, shard, vocab, NTLSettings(variant="number_level"))
    crossing = int((~spans.is_start & (spans.segment >= 0)).view(labels.shape[0], -1)[:, 0].sum())
    print(f"CROSSING {crossing}", flush=True)  # numbers continuing from the previous slice into this one

    # one number-level objective call: the exchange is its one all-reduce forward, whatever the data
    settings = NTLSettings(variant="number_level")
    logits = torch.randn(labels.shape[0], SEQ_LEN // sp, len(tokenizer), requires_grad=True)
    no_numbers = torch.full_like(labels, 20)  # a letter everywhere: no number at all
    def objective_call(rows: torch.Tensor) -> None:
        spans = shard_number_spans(rows, shard, vocab, settings)
        ce_ntl_sums(logits, shard.split(rows), vocab, settings, spans=spans, check_inputs=False).ntl_sum.backward()

    for name, batch_labels in (("numbers", labels), ("no_numbers", no_numbers)):
        print(f"COLLECTIVES {name} {count_collectives(lambda: objective_call(batch_labels))}", flush=True)  # noqa: B023

    for name, settings in cases.items():
        ref_loss, ref_grads, ref_weights = references[name]
        loss, grads, weights = sharded(model, input_ids, labels, vocab, settings, sp, ulysses, CHUNK_TOKENS.get(name, 0))
        loss_error = abs(loss - ref_loss) / abs(ref_loss)
        grad_error = max(relative_error(grads[k], ref_grads[k]) for k in ref_grads)
        assert set(grads) == set(ref_grads), (set(grads) ^ set(ref_grads))
        weight_error = update_error = 0.0
        if dist.get_rank() == 0:
            assert set(weights) == set(ref_weights), set(weights) ^ set(ref_weights)
            weight_error = max(relative_error(weights[k], ref_weights[k]) for k in ref_weights)
            # the update alone, too (small against the weights): Adam's g / (|g| + eps) still magnifies the round-off
            # of entries near eps, hence the looser bound
            initial = model.state_dict()
            update_error = max(relative_error(weights[k] - initial[k], ref_weights[k] - initial[k]) for k in ref_weights)
        assert loss_error < 1e-5 and grad_error < 1e-5 and weight_error < 1e-5 and update_error < 1e-3, (
            name, loss_error, grad_error, weight_error, update_error)
        print(f"OK {name} loss={loss_error:.1e} grad={grad_error:.1e} weights={weight_error:.1e} "
              f"update={update_error:.1e}", flush=True)


    # generation runs with the plain attention on whole prompts (ulysses.unsharded), each rank its share of the
    # prompts, under the same ZeRO-3 engine: the same greedy tokens as plain transformers
    import deepspeed

    engine, *_ = deepspeed.initialize(model=copy.deepcopy(model), config=deepspeed_config(rows, sp), mpu=ulysses.mpu)
    with ulysses.unsharded():
        sharded_generated = greedy_generate(engine, tokenizer, PROMPTS, max_new_tokens=6, batch_size=len(PROMPTS),
                                            dp_group=dist.group.WORLD)
    assert sharded_generated.texts == generated.texts, (sharded_generated.texts, generated.texts)
    print(f"GENERATED {sharded_generated.texts}", flush=True)


if __name__ == "__main__":
    distributed.run_process(main)
