"""Worker: the `del` NTL variant on a vocabulary shard over a TP group of 2, 3 or 4 ranks equals the plain-torch
reference on the full logits (tests/helpers/del_reference.py): the CE + NTL sums and their logit gradient (even and
uneven cuts, digits and '.' in several shards), the NTL-only function, and the chunked head on the shard's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.del_reference import del_reference  # noqa: E402
from helpers.distributed import tp_groups_from_args  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import NTLSettings, VocabShard, ce_ntl_sums, number_token_loss  # noqa: E402
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums  # noqa: E402
from ntl_pretrain.numbers import NumberVocab  # noqa: E402

TOKENIZER_SIZE, VOCAB, HIDDEN = 60, 64, 8
DIGIT_IDS = [41, 3, 22, 58, 9, 35, 17, 52, 30, 47]  # digit d is token DIGIT_IDS[d], spread over every shard
DOT_ID = 26
UNEVEN_CUTS = {2: [0, 30, VOCAB], 3: [0, 10, 41, VOCAB], 4: [0, 10, 30, 50, VOCAB]}  # AutoTP may cut unevenly


def number_vocab() -> NumberVocab:
    order = sorted(range(10), key=lambda d: DIGIT_IDS[d])
    return NumberVocab(tuple(DIGIT_IDS[d] for d in order), tuple(float(d) for d in order), TOKENIZER_SIZE,
                       decimal_point_id=DOT_ID)


def make_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 16, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, TOKENIZER_SIZE, (2, 16), generator=generator)
    digits = torch.rand(2, 16, generator=generator) < 0.6
    labels[digits] = torch.tensor(DIGIT_IDS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[0, 9] = labels[1, 6] = DOT_ID  # decimals
    labels[0, 14:] = torch.tensor(DIGIT_IDS[:2])  # row 0 ends in digits and row 1 starts with them
    labels[1, :2] = torch.tensor(DIGIT_IDS[5:7])
    labels[1, 10] = -100
    return hidden, weight, labels


def main() -> None:
    tp_group, tp_rank, tp_size, rank, _world = tp_groups_from_args()
    worst = 0.0
    for uneven in (False, True):
        cuts = UNEVEN_CUTS[tp_size] if uneven else [VOCAB * r // tp_size for r in range(tp_size + 1)]
        start, end = cuts[tp_rank], cuts[tp_rank + 1]
        shard = VocabShard(tp_group, start, end - start)
        for runs in ("batch", "rows"):
            settings = NTLSettings(variant="del", del_runs=runs, del_scale=0.1)
            hidden, weight, labels = make_inputs(seed=7 + uneven)
            logits = F.linear(hidden, weight)

            reference_logits = logits.clone().requires_grad_()
            ntl_total, ntl_count = del_reference(reference_logits, labels, DIGIT_IDS, DOT_ID, scale=0.1, runs=runs)
            ce_total = F.cross_entropy(reference_logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
            (reference_grad,) = torch.autograd.grad(ce_total + 0.7 * ntl_total, reference_logits)

            local = logits[..., start:end].clone().requires_grad_()
            sums = ce_ntl_sums(local, labels, number_vocab(), settings, shard=shard)
            (grad,) = torch.autograd.grad(sums.ce_sum + 0.7 * sums.ntl_sum, local)
            errors = [relative_error(sums.ntl_sum, ntl_total), relative_error(sums.ntl_count, ntl_count),
                      relative_error(sums.ce_sum, ce_total), relative_error(grad, reference_grad[..., start:end])]

            alone = number_token_loss(logits[..., start:end], labels, number_vocab(), variant="del", del_runs=runs,
                                      del_scale=0.1, shard=shard)
            errors.append(relative_error(alone, ntl_total / ntl_count))

            head = torch.nn.Linear(HIDDEN, end - start, bias=False, dtype=torch.float64)
            with torch.no_grad():
                head.weight.copy_(weight[start:end])
            chunk_hidden = hidden.clone().requires_grad_()
            chunked = chunked_ce_ntl_sums(chunk_hidden, head, labels, number_vocab(), settings, chunk_tokens=5,
                                          shard=shard)
            (hidden_grad,) = torch.autograd.grad(chunked.ce_sum + 0.7 * chunked.ntl_sum, chunk_hidden)
            reference_hidden_grad = reference_grad @ weight  # d loss / d hidden through the full head
            errors += [relative_error(chunked.ntl_sum, ntl_total), relative_error(chunked.ce_sum, ce_total),
                       relative_error(hidden_grad, reference_hidden_grad)]
            assert max(errors) <= 1e-10, f"T={tp_size} uneven={uneven} runs={runs}: relative errors {errors}"
            worst = max(worst, max(errors))
    print(f"rank {rank}: OK worst relative error {worst:.2e}")


if __name__ == "__main__":
    distributed.run_process(main)
