"""The loss heads (`loss.heads`): the objective picks one once from the `loss` section, and the full-logits head
and the chunked head give the same sums and gradients on a real (tiny) Llama, called as the training step calls
them."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama
from helpers.numeric import relative_error
from ntl_pretrain.config import LossConfig
from ntl_pretrain.loss import VARIANTS, NTLSettings
from ntl_pretrain.loss.heads import LOSS_HEADS, ChunkedHead, FullLogitsHead, select_loss_head
from ntl_pretrain.loss.shard import VocabShard
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.trainer.training_objective import Objective

pytestmark = pytest.mark.fast


def test_the_objective_chooses_the_head_once_from_the_loss_section():
    assert list(LOSS_HEADS)[-1] == "full"  # the one that answers every section, so the others are asked first
    assert select_loss_head(LossConfig()) == FullLogitsHead()
    assert select_loss_head(LossConfig(chunk_tokens=256, chunk_backward="rows")) == ChunkedHead(256, "rows")
    assert Objective.from_config(LossConfig()).head == FullLogitsHead()
    chunked = Objective.from_config(LossConfig(chunk_tokens=64, chunk_backward="vocab_blocks"))
    assert chunked.head == ChunkedHead(64, "vocab_blocks")
    assert chunked.describe().endswith(", chunked LM head (64 tokens a chunk, vocab_blocks backward)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_and_chunked_heads_agree_on_a_model(variant):
    model = tiny_llama(48, seed=3).double()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 48, (2, 12), generator=generator)
    labels = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    vocab = NumberVocab(tuple(range(20, 30)), tuple(float(v) for v in range(10)), 48, decimal_point_id=30)
    labels[0, 2:7] = torch.tensor([21, 23, 29, 30, 20])  # a decimal number
    settings = NTLSettings(variant=variant)
    results = []
    for head in (FullLogitsHead(), ChunkedHead(5, "rows"), ChunkedHead(5, "vocab_blocks")):
        model.zero_grad()
        sums = head.sums(model, {"input_ids": input_ids}, labels, vocab, settings, shard=VocabShard(),
                         with_ntl=True, check_inputs=True, spans=None)
        (sums.ce_sum + 0.3 * sums.ntl_sum).backward()
        results.append((sums.stack(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    for stack, grads in results[1:]:
        assert relative_error(stack, results[0][0]) <= 1e-12 and relative_error(grads, results[0][1]) <= 1e-10
