"""The single-device loss: parity with `ntloss`, hand-computed cases, gradcheck, bad inputs."""

from __future__ import annotations

import itertools

import ntloss
import pytest
import torch
import torch.nn.functional as F

from helpers.variants import case_id, every_variant_settings, option_keywords
from ntl_pretrain.loss import (VARIANTS, NTLoss, NTLossDotProduct, NTLSettings, NumberLevelLoss, ObjectiveSums, VocabShard,
                               ce_ntl_loss, ce_ntl_sums, number_token_loss, vocab_shard_of)
from ntl_pretrain.numbers import NumberVocab

pytestmark = pytest.mark.fast
RTOL = 1e-6


def _batch(vocab_size: int, number_ids: list[int], seed: int = 0, batch: int = 3, length: int = 24,
           extra_columns: int = 0):
    """Random logits and labels with runs of number tokens (so multi-digit numbers occur)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab_size + extra_columns, generator=generator) * 3
    labels = torch.randint(0, vocab_size, (batch, length), generator=generator)
    ids = torch.tensor(number_ids)
    number_mask = torch.rand(batch, length, generator=generator) < 0.5
    labels[number_mask] = ids[torch.randint(0, len(ids), (int(number_mask.sum()),), generator=generator)]
    labels[0, :3] = -100
    weights = torch.rand(batch, length, generator=generator)
    return logits, labels, weights


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Agreement to float32 round-off: relative error of the whole tensor (its norm) at most 1e-6.

    Element-wise relative error is no measure here: two correct float32 evaluations in a different
    order differ by a few ulps of the tensor's largest entries, which is huge relative to entries near 0.
    """
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape
    error = (actual - expected).norm().item()
    assert error <= RTOL * expected.norm().item() + 1e-12, f"relative error {error / expected.norm().item():.2e}"


def _grad(value: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(value.sum(), logits)[0]


CASES = [
    ("NTLoss", {}), ("NTLoss", {"squash_factor": 4.0}),
    ("NTLossDotProduct", {"loss_function": F.mse_loss}), ("NTLossDotProduct", {"loss_function": F.l1_loss}),
    ("NTLossDotProduct", {"loss_function": F.huber_loss}),
    ("NumberLevelLoss", {}), ("NumberLevelLoss", {"float_level": True}),
]


@pytest.mark.parametrize("tokenizer_name", ["word_tokenizer", "bpe_tokenizer"])
@pytest.mark.parametrize("class_name,kwargs", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("reweigh", [False, True])
def test_parity_with_ntloss(request, tokenizer_name, class_name, kwargs, reweigh):
    tokenizer = request.getfixturevalue(tokenizer_name)
    reference = getattr(ntloss, class_name)(tokenizer, reweigh=reweigh, **kwargs)
    ours = {"NTLoss": NTLoss, "NTLossDotProduct": NTLossDotProduct, "NumberLevelLoss": NumberLevelLoss}[class_name](
        tokenizer, reweigh=reweigh, **kwargs)
    number_ids = list(ours.number_vocab.token_ids)
    if kwargs.get("float_level"):
        number_ids.append(tokenizer.convert_tokens_to_ids("."))  # "." between digits joins them
    logits, labels, weights = _batch(len(tokenizer), number_ids)
    for reduction, use_weights in itertools.product(["mean", "sum", "none"], [False, True]):
        loss_weights = weights if use_weights else None
        expected_logits = logits.clone().requires_grad_()
        actual_logits = logits.clone().requires_grad_()
        expected = reference(expected_logits, labels, loss_weights=loss_weights, reduction=reduction)
        actual = ours(actual_logits, labels, loss_weights=loss_weights, reduction=reduction)
        assert actual.shape == expected.shape
        _assert_close(actual, expected)
        _assert_close(_grad(actual, actual_logits), _grad(expected, expected_logits))


def test_multi_digit_vocabulary_matches_ntloss(bpe_tokenizer):
    reference = ntloss.NTLoss(bpe_tokenizer, digit_level=False, reweigh=False)
    ours = NTLoss(bpe_tokenizer, digit_level=False, reweigh=False)
    assert ours.number_vocab.token_ids == tuple(reference.number_token_ids.tolist())
    assert len(ours.number_vocab) > 10  # the trained BPE merged digits into multi-digit tokens
    logits, labels, _ = _batch(len(bpe_tokenizer), list(ours.number_vocab.token_ids), seed=3)
    _assert_close(ours(logits, labels), reference(logits, labels))


def test_functional_api_equals_class_api(word_tokenizer):
    vocab = NumberVocab.from_tokenizer(word_tokenizer)
    logits, labels, weights = _batch(len(word_tokenizer), list(vocab.token_ids), seed=5)
    expected = ntloss.NTLossDotProduct(word_tokenizer, reweigh=True, loss_function=F.l1_loss)(
        logits, labels, loss_weights=weights, reduction="sum")
    actual = number_token_loss(logits, labels, vocab, variant="mae", reweigh=True, loss_weights=weights,
                               reduction="sum")
    _assert_close(actual, expected)


def _digit_vocab(vocab_size: int = 16, decimal_point_id: int | None = None) -> NumberVocab:
    # digits at ids 3..12, in an order that is not numeric (like Llama-2's)
    order = [7, 3, 0, 9, 1, 5, 2, 8, 4, 6]
    return NumberVocab(token_ids=tuple(range(3, 13)), values=tuple(float(v) for v in order), vocab_size=vocab_size,
                       decimal_point_id=decimal_point_id)


def _peaked_logits(vocab: NumberVocab, digit_values: list[int], vocab_size: int = 16) -> torch.Tensor:
    logits = torch.zeros(1, len(digit_values), vocab_size)
    for position, value in enumerate(digit_values):
        logits[0, position, vocab.token_ids[vocab.values.index(float(value))]] = 60.0
    return logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_perfect_prediction_costs_nothing(variant):
    vocab = _digit_vocab(decimal_point_id=15)  # del reads decimals
    digits = [4, 2, 9]
    labels = torch.tensor([[vocab.token_ids[vocab.values.index(float(d))] for d in digits]])
    loss = number_token_loss(_peaked_logits(vocab, digits), labels, vocab, variant=variant)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_one_digit_off_costs_one_under_was():
    vocab = _digit_vocab()
    labels = torch.tensor([[vocab.token_ids[vocab.values.index(5.0)]]])
    assert number_token_loss(_peaked_logits(vocab, [4]), labels, vocab).item() == pytest.approx(1.0, rel=1e-6)
    assert number_token_loss(_peaked_logits(vocab, [9]), labels, vocab).item() == pytest.approx(4.0, rel=1e-6)
    # squash factor 9 on digits 0..9 keeps the nearest wrong digit at 1 and the farthest (9 away) at 9
    squashed = number_token_loss(_peaked_logits(vocab, [0]), torch.tensor([[vocab.token_ids[vocab.values.index(9.0)]]]),
                                 vocab, squash_factor=9.0)
    assert squashed.item() == pytest.approx(9.0, rel=1e-6)


@pytest.mark.parametrize("settings", every_variant_settings(), ids=case_id)  # reweigh off and on where allowed
def test_batch_without_numbers_gives_zero_and_zero_gradient(settings):
    vocab = _digit_vocab(decimal_point_id=15)  # del reads decimals
    logits = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.tensor([[0, 1, 2, 13, 14], [15, -100, 0, 1, 2]])
    for reduction in ("mean", "sum"):
        loss = number_token_loss(logits, labels, vocab, reduction=reduction, **option_keywords(settings))
        (grad,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0 and torch.isfinite(loss)
        assert torch.equal(grad, torch.zeros_like(grad))
    sums = ce_ntl_sums(logits, labels, vocab, settings)
    (grad,) = torch.autograd.grad(sums.ntl_sum, logits, allow_unused=True)
    assert sums.ntl_count.item() == 0 and (grad is None or not grad.any())


@pytest.mark.parametrize("settings", [
    NTLSettings(variant="was"), NTLSettings(variant="was", squash_factor=3.0),
    NTLSettings(variant="was", smoothing_sigma=0.7), NTLSettings(variant="mse", reweigh=True),
    NTLSettings(variant="mae"), NTLSettings(variant="huber", reweigh=True), NTLSettings(variant="number_level"),
    NTLSettings(variant="was", reweigh=True),
], ids=repr)
def test_gradcheck_float64(settings):
    vocab = _digit_vocab()
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.tensor([[3, 4, 0, 5, 6, 7], [8, 9, 1, 10, 11, -100]])

    def objective(x):
        return ce_ntl_loss(x, labels, vocab, ntl_weight=0.5, settings=settings)

    assert torch.autograd.gradcheck(objective, (logits,))
    # and the analytical gradient equals autograd through a plain float64 reference of the same maths
    logits32 = logits.detach().float().requires_grad_()
    (ours,) = torch.autograd.grad(objective(logits32), logits32)
    reference = F.cross_entropy(logits32.view(-1, 16), labels.view(-1), ignore_index=-100)
    reference = reference + 0.5 * number_token_loss(logits32, labels, vocab, variant=settings.variant,
                                                     reweigh=settings.reweigh, squash_factor=settings.squash_factor,
                                                     smoothing_sigma=settings.smoothing_sigma)
    (expected,) = torch.autograd.grad(reference, logits32)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-7)


def test_combined_objective_is_cross_entropy_plus_weighted_ntl(bpe_tokenizer):
    vocab = NumberVocab.from_tokenizer(bpe_tokenizer)
    logits, labels, _ = _batch(len(bpe_tokenizer), list(vocab.token_ids), seed=7)
    ours_logits, ref_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = ce_ntl_loss(ours_logits, labels, vocab, ntl_weight=0.3, settings=NTLSettings(reweigh=True))
    reference = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100) + 0.3 * ntloss.NTLoss(
        bpe_tokenizer, reweigh=True)(ref_logits, labels)
    _assert_close(ours, reference)
    _assert_close(_grad(ours, ours_logits), _grad(reference, ref_logits))


def test_smoothed_wasserstein_tends_to_one_hot_form():
    vocab = _digit_vocab()
    logits = torch.randn(2, 6, 16)
    labels = torch.tensor([[3, 4, 0, 5, 6, 7], [8, 9, 1, 10, 11, 12]])
    one_hot = number_token_loss(logits, labels, vocab)
    sharp = number_token_loss(logits, labels, vocab, smoothing_sigma=0.05)
    wide = number_token_loss(logits, labels, vocab, smoothing_sigma=2.0)
    torch.testing.assert_close(sharp, one_hot, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(wide, one_hot)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_computed_in_float32(dtype):
    vocab = _digit_vocab()
    logits = torch.randn(2, 6, 16).to(dtype).requires_grad_()
    labels = torch.tensor([[3, 4, 0, 5, 6, 7], [8, 9, 1, 10, 11, 12]])
    loss = ce_ntl_loss(logits, labels, vocab, settings=NTLSettings(reweigh=True))
    loss.backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    upcast = logits.detach().float().requires_grad_()
    expected = ce_ntl_loss(upcast, labels, vocab, settings=NTLSettings(reweigh=True))
    torch.testing.assert_close(loss, expected)


def test_logits_are_not_modified():
    vocab = _digit_vocab()
    logits = torch.randn(2, 6, 16, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.tensor([[3, 4, 0, 5, 6, 7], [8, 9, 1, 10, 11, 12]])
    ce_ntl_loss(logits, labels, vocab, settings=NTLSettings(reweigh=True)).backward()
    assert torch.equal(logits.detach(), before)


def test_padded_vocabulary_columns_never_count():
    vocab = _digit_vocab(vocab_size=16)
    logits, labels, _ = _batch(16, list(vocab.token_ids), seed=2, extra_columns=8)  # model padded to 24
    padded = ce_ntl_sums(logits, labels, vocab)
    assert torch.isfinite(padded.ce_sum) and padded.number_tokens > 0
    # the padded model's loss equals the unpadded one when the padded columns carry no mass
    logits[..., 16:] = -1e9
    torch.testing.assert_close(ce_ntl_sums(logits, labels, vocab).ce_sum, ce_ntl_sums(logits[..., :16], labels, vocab)
                               .ce_sum)


# ---------------------------------------------------------------------------------- bad inputs
def test_bad_arguments_name_the_problem():
    vocab = _digit_vocab()
    logits, labels = torch.randn(2, 6, 16), torch.randint(0, 16, (2, 6))
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        number_token_loss(logits, labels, vocab, reduction="avg")
    with pytest.raises(ValueError, match="unknown NTL variant 'l3'"):
        number_token_loss(logits, labels, vocab, variant="l3")
    with pytest.raises(ValueError, match="loss_weights must be >= 0"):
        number_token_loss(logits, labels, vocab, loss_weights=-torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"loss_weights shape \(2, 5\)"):
        number_token_loss(logits, labels, vocab, loss_weights=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"labels shape \(2, 5\) does not match"):
        number_token_loss(logits, labels[:, :5], vocab)
    with pytest.raises(TypeError, match="floating-point"):
        number_token_loss(labels[..., None], labels, vocab)
    with pytest.raises(ValueError, match="squash_factor must be > 1"):
        number_token_loss(logits, labels, vocab, squash_factor=1.0)
    with pytest.raises(ValueError, match="squash_factor applies to variant 'was' only"):
        number_token_loss(logits, labels, vocab, variant="mse", squash_factor=3.0)
    with pytest.raises(ValueError, match="model's vocabulary is smaller than the tokenizer's"):
        number_token_loss(logits[..., :14], labels, vocab)
    with pytest.raises(ValueError, match=r"VocabShard\(start=4\) without a tensor-parallel group"):
        number_token_loss(logits, labels, vocab, shard=VocabShard(start=4))
    # a shard whose width is known is checked against the logits' columns with no device work
    with pytest.raises(ValueError, match="the logits hold 16 vocabulary columns but this rank's shard has 12"):
        ce_ntl_sums(logits, labels, vocab, shard=VocabShard(width=12), check_inputs=False)
    with pytest.raises(ValueError, match="label 99 is outside the vocabulary"):
        ce_ntl_loss(logits, torch.full((2, 6), 99), vocab)
    with pytest.raises(ValueError, match="loss_function 'poisson_nll_loss' is not supported"):
        NTLossDotProduct(_DigitsTokenizer(), loss_function=F.poisson_nll_loss)


def test_vocab_shard_of_a_full_head_and_sums_stack_round_trip():
    """A model without a vocabulary-parallel head has one shard, the whole vocabulary (its width known from the
    head), and passing it changes nothing; `ObjectiveSums.stack`/`unstack` keep every field and the gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    shard = vocab_shard_of(model)
    assert shard == VocabShard(width=16) == vocab_shard_of(model.get_output_embeddings())
    assert (shard.size, shard.is_split, shard.check_tiling()) == (1, False, 16)
    vocab = _digit_vocab()
    logits, labels, weights = _batch(16, list(vocab.token_ids))
    logits.requires_grad_()
    sums = ce_ntl_sums(logits, labels, vocab, NTLSettings(reweigh=True), shard=shard, loss_weights=weights)
    plain = ce_ntl_sums(logits, labels, vocab, NTLSettings(reweigh=True), loss_weights=weights)
    assert torch.equal(sums.stack(), plain.stack())
    again = ObjectiveSums.unstack(sums.stack())
    for name in ("ce_sum", "ntl_sum", "token_count", "ntl_count", "number_tokens", "abs_error_sum"):
        assert torch.equal(getattr(again, name), getattr(sums, name)), name
    stacked = torch.stack([sums.ce_sum, sums.ntl_sum])
    unstacked = ObjectiveSums.unstack(torch.cat([stacked, sums.stack()[2:]]))
    (grad,) = torch.autograd.grad(unstacked.ce_sum + 2 * unstacked.ntl_sum, logits)
    (expected,) = torch.autograd.grad(plain.ce_sum + 2 * plain.ntl_sum, logits)
    assert torch.equal(grad, expected)
    assert not unstacked.token_count.requires_grad


class _DigitsTokenizer:
    """Minimal tokenizer-like object: `get_vocab` and `len`."""

    def __init__(self, tokens=("a", "b") + tuple("0123456789")):
        self.vocab = {token: index for index, token in enumerate(tokens)}

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


# ------------------------------------------------------------ number_level on multi-digit vocabularies
def _split_number_case(tokenizer):
    """Label "1|23" and prediction "12|3": the same number 123 in two multi-digit tokenisations."""
    one, twenty_three, twelve, three = tokenizer.convert_tokens_to_ids(["1", "23", "12", "3"])
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=False)
    assert {twenty_three, twelve} <= set(vocab.token_ids)  # the vocabulary really holds multi-digit tokens
    logits = torch.full((1, 2, len(tokenizer)), -50.0)
    logits[0, 0, twelve] = logits[0, 1, three] = 50.0
    return logits, torch.tensor([[one, twenty_three]]), vocab


def test_number_level_refuses_multi_digit_vocabulary(shared_data):
    """Number-level NTL composes a number as sum(value x 10^place), valid for single-digit tokens only: on
    GPT-2's multi-digit vocabulary "1|23" vs "12|3" (both 123) gave 0.577 instead of 0. ntloss's
    NumberLevelLoss is digit-level only (it ignores "23" and "12"), so the combination is refused."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data / "tokenizers" / "gpt2")
    logits, labels, vocab = _split_number_case(tokenizer)
    with pytest.raises(ValueError, match=r"number_level.*single-digit.*984 other number tokens.*digit_level"):
        number_token_loss(logits, labels, vocab, variant="number_level")
    with pytest.raises(ValueError, match=r"number_level.*single-digit"):
        ce_ntl_sums(logits, labels, vocab, NTLSettings(variant="number_level"))
    # the token-level variants read each token's own value and stay valid on this vocabulary
    assert number_token_loss(logits, labels, vocab, variant="mae").item() > 0
    # a digit-level vocabulary of the same tokenizer is what number_level is for
    digits = NumberVocab.from_tokenizer(tokenizer)
    number_token_loss(logits, torch.tensor([[digits.token_ids[1], digits.token_ids[2]]]), digits,
                      variant="number_level")


def test_number_level_refuses_multi_digit_vocabulary_local(bpe_tokenizer):
    """The same refusal without the shared data: the test BPE merges digits into multi-digit tokens."""
    vocab = NumberVocab.from_tokenizer(bpe_tokenizer, digit_level=False)
    labels = torch.tensor([[max(vocab.token_ids)] * 2])
    with pytest.raises(ValueError, match=r"number_level.*single-digit"):
        number_token_loss(torch.randn(1, 2, len(bpe_tokenizer)), labels, vocab, variant="number_level")


def test_config_refuses_number_level_without_digit_level():
    from ntl_pretrain.config import ConfigError, load_config

    minimal = ["model.architecture.model_type=llama", "tokenizer.name_or_path=tok", "data.sources.0.path=c.jsonl"]
    with pytest.raises(ConfigError, match=r"loss.variant=number_level.*tokenizer.digit_level=false"):
        load_config(None, minimal + ["tokenizer.digit_level=false", "loss.variant=number_level"])
    load_config(None, minimal + ["tokenizer.digit_level=false", "loss.variant=was"])
    load_config(None, minimal + ["tokenizer.digit_level=false", "loss.variant=number_level", "loss.enabled=false"])


def test_reweigh_defaults_differ_between_the_drop_in_and_ours_and_the_start_up_line_names_it(word_tokenizer):
    # ntloss's NTLoss (and our drop-in) reweigh by default; number_token_loss, ce_ntl_loss and the trainer do not
    from ntl_pretrain.config import LossConfig
    from ntl_pretrain.trainer.training_objective import Objective

    vocab = NumberVocab.from_tokenizer(word_tokenizer)
    logits, labels, _ = _batch(len(word_tokenizer), list(vocab.token_ids), seed=3)
    drop_in = NTLoss(word_tokenizer)(logits, labels)
    torch.testing.assert_close(drop_in, ntloss.NTLoss(word_tokenizer)(logits, labels))
    torch.testing.assert_close(drop_in, number_token_loss(logits, labels, vocab, reweigh=True))
    assert not torch.allclose(drop_in, number_token_loss(logits, labels, vocab))
    for reweigh in (False, True):
        line = Objective.from_config(LossConfig(reweigh=reweigh, squash_factor=4.0)).describe()
        assert f"variant=was, reweigh={reweigh}, squash_factor=4.0, smoothing_sigma=0" in line and "\n" not in line


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.float64, torch.float64)])
def test_loss_dtype_is_float32_or_the_logits_wider_dtype(word_tokenizer, dtype, expected):
    # the documented rule (docs/loss.md, "Differences from ntloss"): computed in and returned as max(float32, dtype)
    vocab = NumberVocab.from_tokenizer(word_tokenizer)
    logits, labels, _ = _batch(len(word_tokenizer), list(vocab.token_ids), seed=5)
    logits = logits.to(dtype)
    results = {"ce_ntl_loss": ce_ntl_loss(logits, labels, vocab),
               "number_token_loss": number_token_loss(logits, labels, vocab, reweigh=True),
               "NTLoss": NTLoss(word_tokenizer)(logits, labels),
               "predict_numbers": NTLossDotProduct(word_tokenizer).predict_numbers(logits)[0],
               "ce_ntl_sums": ce_ntl_sums(logits, labels, vocab).stack()}
    assert {name: value.dtype for name, value in results.items()} == dict.fromkeys(results, expected)
    if dtype == torch.float64:  # ntloss computes in the logits' dtype: float64 agrees to float64 round-off
        torch.testing.assert_close(results["NTLoss"], ntloss.NTLoss(word_tokenizer)(logits, labels),
                                   rtol=1e-12, atol=1e-12)
