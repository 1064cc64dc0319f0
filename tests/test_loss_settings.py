"""The NTL settings and the NTL weight are checked once (`NTLSettings`, `check_ntl_weight`), and every entry point
goes through that check: the functions, `HFTrainerLoss`, the ntloss drop-ins and the trainer's config
(issue 40 items 5 and 13: each case is an input that used to be taken)."""

from __future__ import annotations

import math

import pytest
import torch

from ntl_pretrain.config import ConfigError, LossConfig
from ntl_pretrain.loss import HFTrainerLoss, NTLoss, NTLSettings, NumberLevelLoss, ce_ntl_loss, number_token_loss
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.trainer.training_objective import Objective

pytestmark = pytest.mark.fast

VOCAB = NumberVocab(tuple(range(3, 13)), tuple(float(v) for v in range(10)), 20)


def _batch():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 20, generator=generator)
    labels = torch.tensor([[3, 4, 1, 5, 12, -100], [7, 0, 8, 9, 2, 3]])
    return logits, labels


@pytest.mark.parametrize("weight, error, message", [
    (-5.0, ValueError, "ntl_weight must be >= 0 and finite (0 turns NTL off), got -5.0"),  # returned -13.54
    (math.nan, ValueError, "ntl_weight must be >= 0 and finite (0 turns NTL off), got nan"),  # returned nan
    (math.inf, ValueError, "ntl_weight must be >= 0 and finite (0 turns NTL off), got inf"),
    ("0.3", TypeError, "ntl_weight must be a number, got str '0.3'"),  # a raw TypeError in HFTrainerLoss
    (True, TypeError, "ntl_weight must be a number, got bool True"),
])
def test_ntl_weight_is_refused_alike_by_the_function_and_the_trainer_hook(weight, error, message):
    logits, labels = _batch()
    with pytest.raises(error) as function:
        ce_ntl_loss(logits, labels, VOCAB, ntl_weight=weight)
    with pytest.raises(error) as hook:
        HFTrainerLoss(VOCAB, ntl_weight=weight)
    assert str(function.value) == str(hook.value) == message


def test_a_valid_ntl_weight_still_weighs_ntl():
    logits, labels = _batch()
    ce = ce_ntl_loss(logits, labels, VOCAB, ntl_weight=0)
    ntl = number_token_loss(logits, labels, VOCAB)
    torch.testing.assert_close(ce_ntl_loss(logits, labels, VOCAB, ntl_weight=2), ce + 2 * ntl)


@pytest.mark.parametrize("settings, error, message", [
    ({"smoothing_sigma": math.nan}, ValueError, "smoothing_sigma must be >= 0 and finite"),  # was taken as sigma 0
    ({"smoothing_sigma": -0.5}, ValueError, "smoothing_sigma must be >= 0 and finite"),
    ({"squash_factor": math.inf}, ValueError, "squash_factor must be > 1 and finite"),  # passed "> 1", gave nan
    ({"squash_factor": math.nan}, ValueError, "squash_factor must be > 1 and finite"),
    ({"squash_factor": "4"}, TypeError, "squash_factor must be a number, got str '4'"),
    ({"variant": "number_level", "max_number_digits": 2.5}, TypeError,
     "max_number_digits must be a whole number, got float 2.5"),  # was used
    ({"variant": "number_level", "max_number_digits": 0}, ValueError, "max_number_digits must be >= 1, got 0"),
    ({"reweigh": "False"}, TypeError, "reweigh must be True or False, got str 'False'"),  # was taken as True
    ({"reweigh": 1}, TypeError, "reweigh must be True or False, got int 1"),
    ({"variant": "number_level", "float_level": "yes"}, TypeError, "float_level must be True or False"),
    ({"ignore_index": -100.0}, TypeError, "ignore_index must be a whole number, got float -100.0"),
    ({"variant": ["was"]}, ValueError, "unknown NTL variant ['was']"),
])
def test_bad_settings_are_refused_by_every_entry_point(settings, error, message):
    logits, labels = _batch()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        NTLSettings(**settings)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        number_token_loss(logits, labels, VOCAB, **settings)


def test_the_drop_ins_refuse_a_string_flag_and_a_fractional_length(word_tokenizer):
    with pytest.raises(TypeError, match="reweigh must be True or False, got str 'False'"):
        NTLoss(word_tokenizer, reweigh="False")
    with pytest.raises(TypeError, match="max_number_digits must be a whole number, got float 2.5"):
        NumberLevelLoss(word_tokenizer, max_number_length=2.5)
    with pytest.raises(ValueError, match="squash_factor must be > 1 and finite"):
        NTLoss(word_tokenizer, squash_factor=math.inf)


def test_the_trainers_objective_goes_through_the_same_check():
    # a LossConfig built in code skips the YAML loader's checks; the objective's settings still refuse it
    with pytest.raises(ConfigError, match=r"^loss.smoothing_sigma must be >= 0 and finite \(0 turns label smoothing off\)"):
        Objective.from_config(LossConfig(smoothing_sigma=math.nan))
    with pytest.raises(ConfigError, match="reweigh must be True or False, got str 'False'"):
        Objective.from_config(LossConfig(reweigh="False"))
    with pytest.raises(ConfigError, match=r"^loss.ntl_weight must be >= 0 and finite \(0 turns NTL off\), got -5.0$"):
        Objective.from_config(LossConfig(ntl_weight=-5.0))


def test_hf_trainer_loss_states_the_real_shape_rule_for_labels():
    logits, labels = _batch()
    with pytest.raises(ValueError) as short:
        HFTrainerLoss(VOCAB)({"logits": logits}, labels[:, 1:])  # labels shorter than the logits
    message = str(short.value)
    assert "already shifted" not in message
    assert message == ("labels of shape (2, 5) for logits of shape (2, 6, 20): HFTrainerLoss takes the Trainer's "
                       "unshifted labels, one per logit row (shape (2, 6)), and shifts them itself")
    torch.testing.assert_close(HFTrainerLoss(VOCAB)({"logits": logits}, labels),  # the right shape is taken
                               ce_ntl_loss(logits[:, :-1], labels[:, 1:], VOCAB))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_weight_is_refused_like_a_negative_one(bad):
    """Issue 40, go-beyond round: a nan (or inf) in loss_weights passed the ">= 0" check and returned nan."""
    logits, labels = _batch()
    weights = torch.ones(2, 6)
    weights[1, 2] = bad
    for loss in (number_token_loss, lambda *a, **k: ce_ntl_loss(*a, ntl_weight=0.3, **k)):
        with pytest.raises(ValueError, match=rf"^loss_weights must be >= 0 and finite, got {bad} "):
            loss(logits, labels, VOCAB, loss_weights=weights)


def test_hf_trainer_loss_refuses_a_negative_item_count_and_gives_0_for_a_step_without_labels():
    """num_items_in_batch=-3 returned a negative loss (the optimizer then climbed it); a step whose labels are all
    ignored (num_items_in_batch 0) returned nan, where the micro-batch mean and ce_ntl_loss give 0."""
    logits, labels = _batch()
    for bad in (-3, math.nan, "7", True):
        with pytest.raises(ValueError, match="num_items_in_batch must be a count of label tokens"):
            HFTrainerLoss(VOCAB, ntl_weight=0.3)({"logits": logits}, labels, num_items_in_batch=bad)
    ignored = torch.full_like(labels, -100)
    for count in (0, torch.tensor(0)):
        loss = HFTrainerLoss(VOCAB, ntl_weight=0.3)({"logits": logits}, ignored, num_items_in_batch=count)
        assert loss.item() == 0.0 == ce_ntl_loss(logits[:, :-1], ignored[:, 1:], VOCAB, ntl_weight=0.3).item()


def test_shard_none_is_the_full_vocabulary_in_every_loss_function():
    """Issue 40, go-beyond round: the chunked functions take `shard=None`, while ce_ntl_loss and number_token_loss
    raised a raw `AttributeError: 'NoneType' object has no attribute 'is_split'`."""
    logits, labels = _batch()
    torch.testing.assert_close(ce_ntl_loss(logits, labels, VOCAB, ntl_weight=0.3, shard=None),
                               ce_ntl_loss(logits, labels, VOCAB, ntl_weight=0.3))
    torch.testing.assert_close(number_token_loss(logits, labels, VOCAB, shard=None), number_token_loss(logits, labels, VOCAB))
    with pytest.raises(TypeError, match=r"^shard must be a VocabShard \(vocab_shard_of\(engine\)\) or None .*got int$"):
        ce_ntl_loss(logits, labels, VOCAB, shard=2)


def test_the_options_are_defined_once_by_their_variants():
    """Issue 48 item 1: each variant's `Options` is the one definition of its options; NTLSettings' fields,
    number_token_loss's keywords and the config's loss keys are built from them, and loss.max_number_digits reaches
    the settings from a config."""
    import dataclasses
    import inspect

    from ntl_pretrain.config import load_config, ntl_settings
    from ntl_pretrain.loss.variants import REGISTRY, VariantOptions

    own = {field.name: field.default for variant in REGISTRY.values() for field in dataclasses.fields(variant.Options)}
    assert {field.name: field.default for field in dataclasses.fields(VariantOptions)} == own
    settings = {field.name: field.default for field in dataclasses.fields(NTLSettings)}
    assert settings == {"variant": "was", "reweigh": False, **own, "ignore_index": -100}
    keywords = inspect.signature(number_token_loss).parameters
    assert {name: keywords[name].default for name in settings} == settings
    loss_keys = {field.name: field.default for field in dataclasses.fields(LossConfig)}
    assert all(loss_keys[name] == default for name, default in own.items())
    config = load_config(None, ["model.architecture={model_type: llama}", "tokenizer.name_or_path=t", "data.sources="
                                "[{path: c.jsonl}]", "loss.variant=digit_entropy", "loss.max_number_digits=3"])
    assert ntl_settings(config.loss).max_number_digits == 3
    logits, labels = _batch()
    with pytest.raises(TypeError, match=r"^number_token_loss\(\) got an unexpected keyword argument 'squash'; its "
                                        r"NTL settings keywords are variant, reweigh, squash_factor"):
        number_token_loss(logits, labels, VOCAB, squash=2.0)


def test_an_option_defined_twice_otherwise_is_refused():
    from dataclasses import dataclass

    from ntl_pretrain.core.options import merged_fields, option

    @dataclass(frozen=True)
    class First:
        depth: int = option("how deep", default=2)

    @dataclass(frozen=True)
    class Second:
        depth: int = option("how deep", default=3)

    @dataclass(frozen=True)
    class Shared(First):
        width: int = option("how wide", default=1)

    assert [name for name, _, _ in merged_fields((First, Shared))] == ["depth", "width"]  # a shared class: one field
    with pytest.raises(ValueError, match="option 'depth' of .*Second is also .*First's, defined otherwise"):
        merged_fields((First, Second))


def test_reweigh_with_a_variant_without_a_largest_loss_is_refused_when_built(monkeypatch):
    """A variant that gives no `max_loss` (the reweigh penalty's base) and does not refuse reweigh in its `check`:
    NTLSettings(reweigh=True) is refused in one line naming it, not by the first loss computed."""
    import torch

    from ntl_pretrain.loss.variants import REGISTRY
    from ntl_pretrain.loss.variants.base import NTLVariant

    class NoLargest(NTLVariant):
        name = "no_largest"

        def terms(self, inputs):
            return torch.zeros(inputs.slot.shape), inputs.slot >= 0

    monkeypatch.setitem(REGISTRY, "no_largest", NoLargest())
    assert NTLSettings(variant="no_largest").reweigh is False
    with pytest.raises(ValueError, match=r"^reweigh does not apply to variant 'no_largest' .*set reweigh=False$"):
        NTLSettings(variant="no_largest", reweigh=True)
