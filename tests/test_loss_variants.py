"""Every registered NTL variant (read from the registry: a new variant gets these checks without editing this file)
against its reference (tests/helpers/variants.py: ntloss or plain torch, written without ntl_pretrain.loss): on
one process through the CE + NTL sums and the NTL-only function, through the chunked head with either backward,
and on vocabulary shards over 2, 3 and 4 gloo processes (tests/workers/variant_shards.py, every variant in one
launch per layout). The sequence-parallel check of every variant is tests/test_sequence_parallel.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.distributed import run_workers
from helpers.numeric import relative_error
from helpers.variants import (REFERENCES, case_id, option_keywords, reference_batch, reference_cases, reference_of,
                              reference_tokenizer, reference_vocab)
from ntl_pretrain.loss import VARIANTS, ce_ntl_sums, number_token_loss
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums

CASES = reference_cases()
TOLERANCE = 1e-6  # ntloss computes in float32 where its inputs are float64


@pytest.fixture(scope="module")
def tokenizer():
    return reference_tokenizer()


@pytest.mark.fast
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_has_a_reference(variant):
    reference_of(variant)
    assert set(REFERENCES) <= set(VARIANTS), set(REFERENCES) - set(VARIANTS)  # none left for a removed variant


@pytest.mark.fast
def test_the_registry_holds_the_built_ins_first_then_every_module_by_name():
    """The order of `VARIANTS` (the config's choices, --help): the built-in modules' variants in their historic
    order, then each other module of loss/variants/ in name order (a new variant is appended)."""
    import pkgutil

    from ntl_pretrain.loss import variants

    modules = [name for name in variants._BUILT_IN]
    modules += sorted(info.name for info in pkgutil.iter_modules(variants.__path__)
                      if info.name not in modules + ["base"])
    by_module = [name for module in modules for name, variant in variants.REGISTRY.items()
                 if type(variant).__module__ == f"{variants.__name__}.{module}"]
    assert list(VARIANTS) == by_module and len(set(VARIANTS)) == len(VARIANTS)


@pytest.mark.fast
@pytest.mark.parametrize("settings", CASES, ids=case_id)
def test_one_process_equals_the_reference_with_its_gradient(settings, tokenizer):
    hidden, weight, labels = reference_batch(tokenizer, seed=1)
    logits = F.linear(hidden, weight)
    reference_logits = logits.clone().requires_grad_()
    reference = reference_of(settings.variant)(reference_logits, labels, tokenizer, settings)
    ce = F.cross_entropy(reference_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    (reference_grad,) = torch.autograd.grad(ce + 0.7 * reference, reference_logits)

    ours_logits = logits.clone().requires_grad_()
    sums = ce_ntl_sums(ours_logits, labels, reference_vocab(tokenizer), settings)
    mean = sums.ntl_sum / sums.ntl_count
    (grad,) = torch.autograd.grad(sums.ce_sum + 0.7 * mean, ours_logits)
    alone = number_token_loss(logits, labels, reference_vocab(tokenizer), **option_keywords(settings))
    errors = [relative_error(mean, reference), relative_error(sums.ce_sum, ce), relative_error(grad, reference_grad),
              relative_error(alone, reference)]
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.fast
@pytest.mark.parametrize("backward", ["rows", "vocab_blocks"])
@pytest.mark.parametrize("settings", CASES, ids=case_id)
def test_chunked_head_equals_the_reference(settings, backward, tokenizer):
    hidden, weight, labels = reference_batch(tokenizer, seed=2)
    reference_hidden = hidden.clone().requires_grad_()
    reference_logits = F.linear(reference_hidden, weight)
    reference = reference_of(settings.variant)(reference_logits, labels, tokenizer, settings)
    ce = F.cross_entropy(reference_logits.flatten(0, 1), labels.flatten(), reduction="sum")
    (reference_grad,) = torch.autograd.grad(ce + 0.7 * reference, reference_hidden)

    head = torch.nn.Linear(hidden.shape[-1], weight.shape[0], bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(weight)
    ours_hidden = hidden.clone().requires_grad_()
    sums = chunked_ce_ntl_sums(ours_hidden, head, labels, reference_vocab(tokenizer), settings, chunk_tokens=5,
                               backward=backward)
    mean = sums.ntl_sum / sums.ntl_count
    (grad,) = torch.autograd.grad(sums.ce_sum + 0.7 * mean, ours_hidden)
    errors = [relative_error(mean, reference), relative_error(sums.ce_sum, ce), relative_error(grad, reference_grad)]
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,tp_size", [
    pytest.param(2, 2, marks=pytest.mark.fast, id="2"),  # the fast tier: 2 shards; 3, 4 and dp x tp: the full suite
    pytest.param(3, 3, id="3"), pytest.param(4, 4, id="4"), pytest.param(4, 2, id="2x2")])
def test_vocabulary_shards_equal_the_reference(world_size, tp_size):
    """Each rank's vocabulary shard (even and uneven cuts, digits in every shard): the CE + NTL sums and their
    logit gradient, the NTL-only function and the chunked head with its hidden gradient equal the reference on
    the full logits, for every case of every variant."""
    outputs = run_workers("variant_shards.py", world_size, ["--tp", str(tp_size)], timeout=300)
    for out in outputs:
        assert f"OK {len(CASES)} cases" in out, out[-3000:]
