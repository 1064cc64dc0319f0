"""Worker: the chunked CE + NTL head on a vocabulary shard of the LM head over a TP group equals the
single-process unchunked objective on the full head, with either gradient algorithm (rows, vocab blocks).

Every rank builds the same hidden states and full head, computes the reference (full logits,
`ce_ntl_sums`), then the chunked objective on its own rows of the head (a `VocabParallelLinear`-like
layout: even and uneven cuts, number tokens in several shards), and checks the sums, the hidden
gradient (all-reduced over TP inside backward) and the gradient of its weight rows. Also counts the
collectives of one call and checks that a bad layout fails on every rank.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from collections import Counter

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.distributed import tp_groups_from_args  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from helpers.variants import every_variant_settings  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import NTLSettings, VocabShard, ce_ntl_sums  # noqa: E402
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402

TOKENIZER_SIZE, VOCAB, HIDDEN, ROWS, LENGTH = 60, 64, 8, 2, 15
NUMBER_IDS = [3, 9, 17, 22, 30, 35, 41, 47, 52, 58]
DOT_ID = 1  # the '.' token (del reads decimals)
SETTINGS = every_variant_settings(NTLSettings(variant="was", squash_factor=3.0),
                                  NTLSettings(variant="was", smoothing_sigma=0.8))
BACKWARDS = ("rows", "vocab_blocks")


def make_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, LENGTH, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, TOKENIZER_SIZE, (ROWS, LENGTH), generator=generator)
    digits = torch.rand(ROWS, LENGTH, generator=generator) < 0.5
    labels[digits] = torch.tensor(NUMBER_IDS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[0, :6] = torch.tensor([0, 1, 2, 61, 62, 4])  # the first chunk(s) hold no number token
    labels[1, :2] = -100
    labels[1, 8] = DOT_ID
    return hidden, weight, labels


def shard_bounds(tp_rank: int, tp_size: int, uneven: bool) -> tuple[int, int]:
    if uneven:  # AutoTP may cut the vocabulary unevenly
        cuts = [0, 30, VOCAB] if tp_size == 2 else [0, 10, 30, 50, VOCAB]
        return cuts[tp_rank], cuts[tp_rank + 1]
    width = VOCAB // tp_size
    return tp_rank * width, (tp_rank + 1) * width


def objective(sums):
    return sums.ce_sum * sums.ntl_sum + 0.3 * sums.ce_sum - 0.7 * sums.ntl_sum


def check(settings, tp_group, tp_rank, tp_size, uneven, chunk_tokens, seed, backward) -> float:
    vocab = NumberVocab(tuple(NUMBER_IDS), tuple(float(v) for v in (7, 3, 0, 9, 1, 5, 2, 8, 4, 6)), TOKENIZER_SIZE,
                        decimal_point_id=DOT_ID)
    hidden, weight, labels = make_inputs(seed)
    start, end = shard_bounds(tp_rank, tp_size, uneven)

    full_hidden = hidden.clone().requires_grad_()
    full_weight = weight.clone().requires_grad_()
    reference = ce_ntl_sums(full_hidden @ full_weight.t(), labels, vocab, settings)
    ref_hidden_grad, ref_weight_grad = torch.autograd.grad(objective(reference), [full_hidden, full_weight])

    head = torch.nn.Linear(HIDDEN, end - start, bias=False, dtype=torch.float64)
    head.weight.data = weight[start:end].clone()
    ours_hidden = hidden.clone().requires_grad_()
    sums = chunked_ce_ntl_sums(ours_hidden, head, labels, vocab, settings, chunk_tokens=chunk_tokens,
                               shard=VocabShard(tp_group, start), backward=backward)
    objective(sums).backward()
    errors = [relative_error(objective(sums), objective(reference)),
              relative_error(ours_hidden.grad, ref_hidden_grad),
              relative_error(head.weight.grad, ref_weight_grad[start:end])]
    for name in ("ce_sum", "ntl_sum", "token_count", "ntl_count", "number_tokens", "abs_error_sum"):
        errors.append(relative_error(getattr(sums, name), getattr(reference, name)))
    return max(errors)


def main() -> None:
    tp_group, tp_rank, tp_size, rank, world = tp_groups_from_args()

    worst = 0.0
    cases = itertools.product(SETTINGS, (False, True), (4, 30), BACKWARDS)
    for index, (settings, uneven, chunk_tokens, backward) in enumerate(cases):
        # data-parallel groups see different data; TP ranks of a group the same
        worst = max(worst, check(settings, tp_group, tp_rank, tp_size, uneven, chunk_tokens,
                                 seed=index * 10 + rank // tp_size, backward=backward))
    assert worst < 1e-11, worst

    # collectives of one call: the layout check (one SUM, check_inputs=True by default), per chunk one MAX and
    # one SUM in forward, one SUM in backward
    calls = Counter()
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls["MAX" if op == dist.ReduceOp.MAX else "SUM"] += 1
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    chunks = -(-ROWS * LENGTH // 8)
    for backward in BACKWARDS:
        calls.clear()
        check(NTLSettings(variant="number_level", reweigh=True), tp_group, tp_rank, tp_size, False, 8, seed=99,
              backward=backward)
        assert dict(calls) == {"MAX": chunks, "SUM": chunks + 2}, (backward, dict(calls))
    dist.all_reduce = original

    # the full head passed as one shard of a TP group: every rank raises, none hangs
    vocab = NumberVocab(tuple(NUMBER_IDS), tuple(float(v) for v in range(10)), TOKENIZER_SIZE)
    hidden, weight, labels = make_inputs(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    try:
        chunked_ce_ntl_sums(hidden, head, labels, vocab, chunk_tokens=8,
                            shard=VocabShard(tp_group, tp_rank * VOCAB // tp_size))
    except ValueError as error:
        assert "do not tile the vocabulary" in str(error), error
    else:
        raise AssertionError("a full head passed as a shard was accepted")
    dist.barrier()
    print(f"rank {rank}: OK worst relative error {worst:.2e}", flush=True)


if __name__ == "__main__":
    distributed.run_process(main)
