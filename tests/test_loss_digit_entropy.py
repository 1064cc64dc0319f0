"""The `digit_entropy` NTL variant, added through the variant registry: against a plain-torch reference
(tests/helpers/digit_entropy.py) on the full logits, the chunked head and sequence slices, its settings and
vocabulary checks (vocabulary shards, like every variant's: tests/test_loss_variants.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.digit_entropy import digit_entropy_reference
from helpers.numeric import relative_error
from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.loss import VARIANTS, NTLSettings, ce_ntl_loss, ce_ntl_sums, number_token_loss
from ntl_pretrain.loss.chunked import chunked_ce_ntl_sums
from ntl_pretrain.loss.sequence_shard import SequenceShard, shard_number_spans
from ntl_pretrain.numbers import NumberVocab

VOCAB_SIZE = 40
DIGIT_IDS = [21, 4, 33, 9, 17, 28, 2, 36, 12, 25]  # digit d is token DIGIT_IDS[d]: ids out of value order
SETTINGS = NTLSettings(variant="digit_entropy")


def _vocab() -> NumberVocab:
    order = sorted(range(10), key=lambda d: DIGIT_IDS[d])
    return NumberVocab(tuple(DIGIT_IDS[d] for d in order), tuple(float(d) for d in order), VOCAB_SIZE)


def _batch(seed: int = 0, rows: int = 3, length: int = 24, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, length, VOCAB_SIZE, generator=generator) * 3).to(dtype)
    labels = torch.randint(0, VOCAB_SIZE, (rows, length), generator=generator)
    digits = torch.rand(rows, length, generator=generator) < 0.6  # runs of digits: numbers of several places
    labels[digits] = torch.tensor(DIGIT_IDS)[torch.randint(0, 10, (int(digits.sum()),), generator=generator)]
    labels[0, :3] = -100
    labels[1, 5:17] = torch.tensor(DIGIT_IDS)[torch.arange(12) % 10]  # a 12-digit number
    weights = torch.rand(rows, length, generator=generator, dtype=dtype)
    return logits, labels, weights


pytestmark = pytest.mark.fast


def test_it_is_registered_and_named_by_the_config():
    assert "digit_entropy" in VARIANTS  # the registry's order: tests/test_loss_variants.py
    config = load_config(None, ["model.architecture={model_type: llama}", "tokenizer.name_or_path=x",
                                "data.sources=[{path: corpus.jsonl}]", "loss.variant=digit_entropy"])
    assert config.loss.variant == "digit_entropy"
    with pytest.raises(ConfigError, match=r"loss.variant=digit_entropy scores each digit position over the ten "
                                          r"single-digit tokens and needs tokenizer.digit_level=true"):
        load_config(None, ["model.architecture={model_type: llama}", "tokenizer.name_or_path=x",
                           "data.sources=[{path: corpus.jsonl}]", "loss.variant=digit_entropy",
                           "tokenizer.digit_level=false"])
    assert SETTINGS.describe() == "variant=digit_entropy, reweigh=False, max_number_digits=20"


@pytest.mark.parametrize("max_number_digits", [20, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_equals_the_plain_torch_reference_with_its_gradient(max_number_digits, weighted):
    logits, labels, weights = _batch()
    loss_weights = weights if weighted else None
    ours_logits = logits.clone().requires_grad_()
    ours = number_token_loss(ours_logits, labels, _vocab(), variant="digit_entropy", loss_weights=loss_weights,
                             max_number_digits=max_number_digits)
    reference_logits = logits.clone().requires_grad_()
    total, count = digit_entropy_reference(reference_logits, labels, DIGIT_IDS, loss_weights=loss_weights,
                                           max_number_digits=max_number_digits)
    reference = total / count
    assert relative_error(ours, reference) <= 1e-12, (ours, reference)
    ours_grad, = torch.autograd.grad(ours, ours_logits)
    reference_grad, = torch.autograd.grad(reference, reference_logits)
    assert relative_error(ours_grad, reference_grad) <= 1e-10
    # and through the CE + NTL objective, in float32
    sums = ce_ntl_sums(logits.float(), labels, _vocab(), NTLSettings(variant="digit_entropy",
                       max_number_digits=max_number_digits), loss_weights=loss_weights)
    assert relative_error(sums.ntl_sum, total) <= 1e-6 and relative_error(sums.ntl_count, count) <= 1e-6


def test_place_and_mass_weigh_the_terms():
    # one number "7 3": the same logits at both digits; the tens digit's term is twice the units digit's
    logits = torch.zeros(1, 2, VOCAB_SIZE, dtype=torch.float64)
    logits[..., DIGIT_IDS[5]] = 2.0
    labels = torch.tensor([[DIGIT_IDS[7], DIGIT_IDS[3]]])
    terms = number_token_loss(logits, labels, _vocab(), variant="digit_entropy", reduction="none")
    torch.testing.assert_close(terms[0, 0], 2 * terms[0, 1])
    # a perfect digit prediction costs (almost) nothing; less mass on the digits weighs the term down
    sure = torch.full((1, 1, VOCAB_SIZE), -50.0, dtype=torch.float64)
    sure[..., DIGIT_IDS[4]] = 50.0
    assert number_token_loss(sure, labels[:, :1].clone().fill_(DIGIT_IDS[4]), _vocab(), variant="digit_entropy") < 1e-30
    elsewhere = logits.clone()
    elsewhere[..., 0] = 5.0  # a non-digit token takes most of the mass; the digits' logits are unchanged

    def digit_mass(values: torch.Tensor) -> torch.Tensor:
        return torch.softmax(values[0, 0], dim=-1)[DIGIT_IDS].sum()

    torch.testing.assert_close(number_token_loss(elsewhere, labels, _vocab(), variant="digit_entropy"),
                               number_token_loss(logits, labels, _vocab(), variant="digit_entropy")
                               * digit_mass(elsewhere) / digit_mass(logits))


@pytest.mark.parametrize("backward", ["rows", "vocab_blocks"])
def test_chunked_head_equals_full_logits(backward):
    generator = torch.Generator().manual_seed(1)
    _, labels, weights = _batch(seed=1)
    hidden = torch.randn(*labels.shape, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, VOCAB_SIZE, bias=False, dtype=torch.float64)
    full = ce_ntl_sums(head(hidden), labels, _vocab(), SETTINGS, loss_weights=weights)
    full_grads = torch.autograd.grad(full.ce_sum + 0.3 * full.ntl_sum, (hidden, head.weight))
    chunked = chunked_ce_ntl_sums(hidden, head, labels, _vocab(), SETTINGS, chunk_tokens=7, loss_weights=weights,
                                  backward=backward)
    chunked_grads = torch.autograd.grad(chunked.ce_sum + 0.3 * chunked.ntl_sum, (hidden, head.weight))
    assert relative_error(chunked.stack(), full.stack()) <= 1e-12
    assert max(relative_error(a, b) for a, b in zip(chunked_grads, full_grads)) <= 1e-12


def test_sequence_slices_with_the_whole_rows_spans_add_up_to_the_whole():
    # each slice's digits keep the place they have in the whole row (a number crossing the cut included)
    logits, labels, _ = _batch(seed=2, length=24)
    whole = ce_ntl_sums(logits, labels, _vocab(), SETTINGS)
    parts = []
    for rank in range(2):
        shard = SequenceShard(rank=rank, size=2)
        spans = shard_number_spans(labels, shard, _vocab(), SETTINGS)
        parts.append(ce_ntl_sums(shard.split(logits), shard.split(labels), _vocab(), SETTINGS, spans=spans))
    assert relative_error(sum(part.ntl_sum for part in parts), whole.ntl_sum) <= 1e-12
    assert labels[1, 11] in DIGIT_IDS and labels[1, 12] in DIGIT_IDS  # the 12-digit number crosses the cut


def test_settings_and_vocabulary_it_refuses():
    with pytest.raises(ValueError, match="reweigh does not apply to variant 'digit_entropy'"):
        NTLSettings(variant="digit_entropy", reweigh=True)
    with pytest.raises(ValueError, match="squash_factor applies to variant 'was' only, not 'digit_entropy'"):
        NTLSettings(variant="digit_entropy", squash_factor=3.0)
    with pytest.raises(ValueError, match="max_number_digits applies to variant 'number_level' or 'digit_entropy' "
                                         "only, not 'was'"):
        NTLSettings(variant="was", max_number_digits=4)
    multi_digit = NumberVocab((3, 4, 5), (1.0, 12.0, 7.0), VOCAB_SIZE, tokens=("1", "12", "7"))
    logits, labels, _ = _batch()
    with pytest.raises(ValueError, match=r"variant 'digit_entropy' scores each digit position over the ten "
                                         r"single-digit tokens, but the number vocabulary holds 1 other number tokens"):
        ce_ntl_loss(logits, labels, multi_digit, settings=SETTINGS)
