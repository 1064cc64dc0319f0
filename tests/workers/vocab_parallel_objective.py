"""Worker: CE + NTL on vocabulary shards over a TP group equals the single-process result.

Every rank builds the same full logits, computes the single-process objective on them, then the
vocabulary-parallel objective on its own shard, and checks loss and logit gradients. Run with
WORLD_SIZE = dp * tp processes; TP groups are consecutive ranks. Also counts the collectives of one
objective call and checks that a full-vocabulary tensor passed as a shard fails on every rank.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.distributed import tp_groups_from_args  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from helpers.variants import every_variant_settings  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import HFTrainerLoss, NTLSettings, VocabShard, ce_ntl_sums, number_token_loss  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402

TOKENIZER_SIZE, PADDED_VOCAB = 60, 64  # the model's vocabulary is padded past the tokenizer's
PLACEMENTS = {
    "last_shard": list(range(50, 60)),
    "split": [3, 9, 17, 22, 30, 35, 41, 47, 52, 58],
    "not_rank0": list(range(33, 43)),
}
VALUE_ORDER = [7, 3, 0, 9, 1, 5, 2, 8, 4, 6]  # ids not in numeric order, like Llama-2's digits
DOT_ID = 1  # the '.' token (del reads decimals)
SETTINGS = every_variant_settings(NTLSettings(variant="was", squash_factor=3.0),
                                  NTLSettings(variant="was", smoothing_sigma=0.8))


def make_batch(number_ids: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 16, PADDED_VOCAB, generator=generator) * 2
    labels = torch.randint(0, TOKENIZER_SIZE, (2, 16), generator=generator)
    digits = torch.rand(2, 16, generator=generator) < 0.5
    labels[digits] = torch.tensor(number_ids)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[1, :4] = -100
    labels[0, 6] = DOT_ID
    return logits, labels


def shard_bounds(tp_rank: int, tp_size: int, uneven: bool) -> tuple[int, int]:
    if uneven:  # AutoTP may cut the vocabulary unevenly
        cuts = [0, 30, PADDED_VOCAB] if tp_size == 2 else [0, 10, 30, 50, PADDED_VOCAB]
        return cuts[tp_rank], cuts[tp_rank + 1]
    width = PADDED_VOCAB // tp_size
    return tp_rank * width, (tp_rank + 1) * width


def check_case(number_ids, settings, tp_group, tp_rank, tp_size, uneven, seed) -> float:
    vocab = NumberVocab(tuple(sorted(number_ids)), tuple(float(VALUE_ORDER[i]) for i in range(10)), TOKENIZER_SIZE,
                        decimal_point_id=DOT_ID)
    logits, labels = make_batch(number_ids, seed)
    start, end = shard_bounds(tp_rank, tp_size, uneven)

    full = logits.clone().requires_grad_()
    reference = ce_ntl_sums(full, labels, vocab, settings)
    ref_total = reference.ce_sum + 0.7 * reference.ntl_sum
    (ref_grad,) = torch.autograd.grad(ref_total, full)

    shard = logits[..., start:end].clone().requires_grad_()
    ours = ce_ntl_sums(shard, labels, vocab, settings, shard=VocabShard(tp_group, start, end - start))
    total = ours.ce_sum + 0.7 * ours.ntl_sum
    (grad,) = torch.autograd.grad(total, shard)

    errors = [relative_error(total, ref_total), relative_error(grad, ref_grad[..., start:end])]
    for name in ("token_count", "ntl_count", "number_tokens", "abs_error_sum"):
        errors.append(relative_error(getattr(ours, name), getattr(reference, name)))

    # the NTL-only entry point takes the shard too
    ntl = number_token_loss(shard, labels, vocab, variant=settings.variant, reweigh=settings.reweigh,
                            squash_factor=settings.squash_factor, smoothing_sigma=settings.smoothing_sigma,
                            shard=VocabShard(tp_group, start), reduction="none")
    ntl_ref = number_token_loss(logits, labels, vocab, variant=settings.variant, reweigh=settings.reweigh,
                                squash_factor=settings.squash_factor, smoothing_sigma=settings.smoothing_sigma,
                                reduction="none")
    errors.append(relative_error(ntl, ntl_ref))
    worst = max(errors)
    assert worst <= 1e-6, f"{settings} ids={number_ids} uneven={uneven}: relative errors {errors}"
    return worst


class _ParallelHead(torch.nn.Module):
    """The attributes of AutoTP's vocabulary-parallel head (`VocabParallelLinear`) that `vocab_shard_of` reads."""

    is_vocab_parallel_lm_head = True

    def __init__(self, tp_group, start: int, end: int) -> None:
        super().__init__()
        self.mp_group, self.vocab_start_index, self.vocab_end_index = tp_group, start, end


class _CausalLM(torch.nn.Module):
    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def check_hf_trainer_loss(tp_group, tp_rank, tp_size) -> float:
    """HFTrainerLoss on the model's vocabulary shard (found on its head) equals it on the full logits."""
    vocab = NumberVocab(tuple(PLACEMENTS["split"]), tuple(float(v) for v in VALUE_ORDER), TOKENIZER_SIZE)
    logits, labels = make_batch(PLACEMENTS["split"], 5)
    labels[labels == -100] = 7  # unshifted labels as a collator gives them; the hook shifts them
    start, end = shard_bounds(tp_rank, tp_size, uneven=True)
    full = logits.clone().requires_grad_()
    reference = HFTrainerLoss(vocab, settings=NTLSettings(reweigh=True))({"logits": full}, labels, 40)
    (ref_grad,) = torch.autograd.grad(reference, full)
    shard = logits[..., start:end].clone().requires_grad_()
    model = _CausalLM(_ParallelHead(tp_group, start, end))
    loss = HFTrainerLoss(vocab, model=model, settings=NTLSettings(reweigh=True))({"logits": shard}, labels, 40)
    (grad,) = torch.autograd.grad(loss, shard)
    errors = [relative_error(loss, reference), relative_error(grad, ref_grad[..., start:end])]
    assert max(errors) <= 1e-6, f"HFTrainerLoss on a vocabulary shard: relative errors {errors}"
    return max(errors)


def count_collectives(tp_group, tp_rank, tp_size, check_inputs: bool) -> dict[str, int]:
    counts: dict[str, int] = {}
    original = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        key = f"{'MAX' if op == dist.ReduceOp.MAX else 'SUM' if op == dist.ReduceOp.SUM else op}"
        counts[key] = counts.get(key, 0) + 1
        assert group is tp_group, "objective collectives must run on the TP group passed in"
        return original(tensor, op=op, group=group, async_op=async_op)

    for name in ("all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "all_to_all", "barrier"):
        setattr(dist, name, _forbidden(name))
    dist.all_reduce = counting_all_reduce
    vocab = NumberVocab(tuple(PLACEMENTS["split"]), tuple(float(v) for v in VALUE_ORDER), TOKENIZER_SIZE)
    logits, labels = make_batch(PLACEMENTS["split"], 0)
    start, end = shard_bounds(tp_rank, tp_size, False)
    shard = logits[..., start:end].clone().requires_grad_()
    sums = ce_ntl_sums(shard, labels, vocab, NTLSettings(reweigh=True), shard=VocabShard(tp_group, start),
                       check_inputs=check_inputs)
    (sums.ce_sum + sums.ntl_sum).backward()
    dist.all_reduce = original
    return counts


def _forbidden(name):
    def call(*args, **kwargs):
        raise AssertionError(f"the objective must not call dist.{name}")
    return call


def main() -> None:
    tp_group, tp_rank, tp_size, rank, world = tp_groups_from_args()

    worst = 0.0
    for (_placement, ids), settings in itertools.product(PLACEMENTS.items(), SETTINGS):
        worst = max(worst, check_case(ids, settings, tp_group, tp_rank, tp_size, uneven=False, seed=rank // tp_size))
    for settings in (NTLSettings(variant="was", reweigh=True), NTLSettings(variant="number_level")):
        worst = max(worst, check_case(PLACEMENTS["split"], settings, tp_group, tp_rank, tp_size, uneven=True, seed=3))

    worst = max(worst, check_hf_trainer_loss(tp_group, tp_rank, tp_size))

    # a full-vocabulary tensor passed where a shard is expected fails on every rank (no hang)
    vocab = NumberVocab(tuple(PLACEMENTS["split"]), tuple(float(v) for v in VALUE_ORDER), TOKENIZER_SIZE)
    logits, labels = make_batch(PLACEMENTS["split"], 0)
    try:
        ce_ntl_sums(logits, labels, vocab, shard=VocabShard(tp_group, tp_rank * (PADDED_VOCAB // tp_size)))
    except ValueError as error:
        assert "do not tile the vocabulary" in str(error), error
    else:
        raise AssertionError("full logits passed as a shard were accepted")

    # every path checks the layout, also NTL alone without reweigh (no log-sum-exp), which reduces nothing else
    # that could reveal a wrong layout: full logits as a shard, or every rank claiming the same shard
    width = PADDED_VOCAB // tp_size
    own_shard = logits[..., tp_rank * width:(tp_rank + 1) * width]
    for reweigh in (False, True):
        for case, wrong, wrong_start in (("full logits", logits, tp_rank * width), ("same start", own_shard, 0)):
            try:
                number_token_loss(wrong, labels, vocab, reweigh=reweigh, shard=VocabShard(tp_group, wrong_start))
            except ValueError as error:
                assert "do not tile the vocabulary" in str(error), error
            else:
                raise AssertionError(f"a wrong shard layout ({case}) was accepted with reweigh={reweigh}")

    counts = count_collectives(tp_group, tp_rank, tp_size, check_inputs=False)
    assert counts == {"MAX": 1, "SUM": 1}, counts
    # checked (the default): one more small SUM, the layout check
    assert count_collectives(tp_group, tp_rank, tp_size, check_inputs=True) == {"MAX": 1, "SUM": 2}
    print(f"rank {rank}: OK worst relative error {worst:.2e}, collectives per call {counts}")


if __name__ == "__main__":
    distributed.run_process(main)
