"""Worker: every registered NTL variant on a vocabulary shard over a TP group of 2, 3 or 4 ranks equals its
reference on the full logits (tests/helpers/variants.py: ntloss or plain torch): the CE + NTL sums and their logit
gradient (even and uneven cuts, digits and '.' in several shards), the NTL-only function, and the chunked head on
the shard's rows with its hidden gradient. Every case of `reference_cases()` in one launch; prints
`OK <n> cases` with the worst relative error.

    variant_shards.py --tp N   (WORLD_SIZE = N * dp processes; TP groups are consecutive ranks)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.distributed import tp_groups_from_args  # noqa: E402
from helpers.numeric import relative_error  # noqa: E402
from helpers.variants import (PADDED_VOCAB, case_id, option_keywords, reference_batch, reference_cases,  # noqa: E402
                              reference_of, reference_tokenizer, reference_vocab)
from ntl_pretrain.parallel import distributed  # noqa: E402
from ntl_pretrain.loss import VocabShard, ce_ntl_sums, number_token_loss  # noqa: E402
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums  # noqa: E402

UNEVEN_CUTS = {2: [0, 30, PADDED_VOCAB], 3: [0, 10, 41, PADDED_VOCAB], 4: [0, 10, 30, 50, PADDED_VOCAB]}
TOLERANCE = 1e-6  # ntloss computes in float32 where its inputs are float64


def check_case(settings, tokenizer, tp_group, tp_rank, tp_size, uneven: bool) -> float:
    cuts = UNEVEN_CUTS[tp_size] if uneven else [PADDED_VOCAB * r // tp_size for r in range(tp_size + 1)]
    start, end = cuts[tp_rank], cuts[tp_rank + 1]
    shard = VocabShard(tp_group, start, end - start)
    vocab = reference_vocab(tokenizer)
    hidden, weight, labels = reference_batch(tokenizer, seed=7 + uneven)
    reference_hidden = hidden.clone().requires_grad_()
    reference_logits = F.linear(reference_hidden, weight)
    reference = reference_of(settings.variant)(reference_logits, labels, tokenizer, settings)
    ce = F.cross_entropy(reference_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    reference_grad, reference_hidden_grad = torch.autograd.grad(ce + 0.7 * reference,
                                                                 (reference_logits, reference_hidden))

    logits = F.linear(hidden, weight)
    local = logits[..., start:end].clone().requires_grad_()
    sums = ce_ntl_sums(local, labels, vocab, settings, shard=shard)
    (grad,) = torch.autograd.grad(sums.ce_sum + 0.7 * sums.ntl_sum / sums.ntl_count, local)
    errors = [relative_error(sums.ntl_sum / sums.ntl_count, reference), relative_error(sums.ce_sum, ce),
              relative_error(grad, reference_grad[..., start:end])]

    alone = number_token_loss(logits[..., start:end], labels, vocab, shard=shard, **option_keywords(settings))
    errors.append(relative_error(alone, reference))

    head = torch.nn.Linear(hidden.shape[-1], end - start, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(weight[start:end])
    chunk_hidden = hidden.clone().requires_grad_()
    chunked = chunked_ce_ntl_sums(chunk_hidden, head, labels, vocab, settings, chunk_tokens=5, shard=shard)
    (hidden_grad,) = torch.autograd.grad(chunked.ce_sum + 0.7 * chunked.ntl_sum / chunked.ntl_count, chunk_hidden)
    errors += [relative_error(chunked.ntl_sum / chunked.ntl_count, reference), relative_error(chunked.ce_sum, ce),
               relative_error(hidden_grad, reference_hidden_grad)]
    assert max(errors) <= TOLERANCE, f"{case_id(settings)} T={tp_size} uneven={uneven}: relative errors {errors}"
    return max(errors)


def main() -> None:
    tp_group, tp_rank, tp_size, rank, _world = tp_groups_from_args()
    tokenizer = reference_tokenizer()
    cases = reference_cases()
    worst = max(check_case(settings, tokenizer, tp_group, tp_rank, tp_size, uneven)
                for settings in cases for uneven in (False, True))
    print(f"rank {rank}: OK {len(cases)} cases, worst relative error {worst:.2e}")


if __name__ == "__main__":
    distributed.run_process(main)
