"""Worker: the `digit_entropy` NTL variant on a vocabulary shard over a TP group equals the plain-torch reference
on the full logits (tests/helpers/digit_entropy.py): the CE + NTL sums and their logit gradient (full-logits path,
even and uneven cuts, digits in both shards), the NTL-only function, and the chunked head on the shard's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.digit_entropy import digit_entropy_reference  # noqa: E402
from helpers.distributed import tp_groups_from_args  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import NTLSettings, VocabShard, ce_ntl_sums, number_token_loss  # noqa: E402
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402

TOKENIZER_SIZE, VOCAB, HIDDEN = 60, 64, 8
DIGIT_IDS = [41, 3, 22, 58, 9, 35, 17, 52, 30, 47]  # digit d is token DIGIT_IDS[d], in both halves of the vocabulary
SETTINGS = NTLSettings(variant="digit_entropy")


def number_vocab() -> NumberVocab:
    order = sorted(range(10), key=lambda d: DIGIT_IDS[d])
    return NumberVocab(tuple(DIGIT_IDS[d] for d in order), tuple(float(d) for d in order), TOKENIZER_SIZE)


def make_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 16, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, TOKENIZER_SIZE, (2, 16), generator=generator)
    digits = torch.rand(2, 16, generator=generator) < 0.6
    labels[digits] = torch.tensor(DIGIT_IDS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[1, :3] = -100
    return hidden, weight, labels


def main() -> None:
    tp_group, tp_rank, tp_size, rank, _world = tp_groups_from_args()
    worst = 0.0
    for uneven in (False, True):
        start, end = ((0, 30), (30, VOCAB))[tp_rank] if uneven else (tp_rank * VOCAB // 2, (tp_rank + 1) * VOCAB // 2)
        shard = VocabShard(tp_group, start, end - start)
        hidden, weight, labels = make_inputs(seed=7 + uneven)
        logits = F.linear(hidden, weight)

        reference_logits = logits.clone().requires_grad_()
        ntl_total, ntl_count = digit_entropy_reference(reference_logits, labels, DIGIT_IDS)
        ce_total = F.cross_entropy(reference_logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
        (reference_grad,) = torch.autograd.grad(ce_total + 0.7 * ntl_total, reference_logits)

        local = logits[..., start:end].clone().requires_grad_()
        sums = ce_ntl_sums(local, labels, number_vocab(), SETTINGS, shard=shard)
        (grad,) = torch.autograd.grad(sums.ce_sum + 0.7 * sums.ntl_sum, local)
        errors = [relative_error(sums.ntl_sum, ntl_total), relative_error(sums.ntl_count, ntl_count),
                  relative_error(sums.ce_sum, ce_total), relative_error(grad, reference_grad[..., start:end])]

        alone = number_token_loss(logits[..., start:end], labels, number_vocab(), variant="digit_entropy",
                                  shard=shard)
        errors.append(relative_error(alone, ntl_total / ntl_count))

        head = torch.nn.Linear(HIDDEN, end - start, bias=False, dtype=torch.float64)
        with torch.no_grad():
            head.weight.copy_(weight[start:end])
        chunked = chunked_ce_ntl_sums(hidden, head, labels, number_vocab(), SETTINGS, chunk_tokens=5, shard=shard)
        errors += [relative_error(chunked.ntl_sum, ntl_total), relative_error(chunked.ce_sum, ce_total)]
        assert max(errors) <= 1e-10, f"uneven={uneven}: relative errors {errors}"
        worst = max(worst, max(errors))
    print(f"rank {rank}: OK worst relative error {worst:.2e}")


if __name__ == "__main__":
    distributed.run_process(main)
