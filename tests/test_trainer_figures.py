"""The logged figures are read from the step's sums by name, never by position (issue 48 item 2): `StepFigures`
has one field per `ObjectiveSums` field of the same name, `StepFigures.from_sums` follows the sums' own field
order (a reordered `ObjectiveSums` still logs each sum under its name) and refuses a renamed one; and the trainer's
state changes only through `TrainingState.advance` and `restore`."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ntl_pretrain.config import LossConfig
from ntl_pretrain.loss import ObjectiveSums, ce_ntl_loss
from ntl_pretrain.loss.objective import ce_ntl_sums
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.trainer import training_objective
from ntl_pretrain.trainer.parts import TrainingState
from ntl_pretrain.trainer.training_objective import Objective, StepFigures

pytestmark = pytest.mark.fast

VOCAB = NumberVocab(tuple(range(3, 13)), tuple(float(v) for v in range(10)), 20)


def _sums() -> tuple[torch.Tensor, torch.Tensor, ObjectiveSums]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 20, generator=generator)
    labels = torch.tensor([[3, 4, 1, 5, 12, -100], [7, 0, 8, 9, 2, 3]])
    return logits, labels, ce_ntl_sums(logits, labels, VOCAB)


def test_step_figures_has_one_field_per_objective_sum_of_the_same_name():
    sums = [f.name for f in dataclasses.fields(ObjectiveSums)]
    figures = [f.name for f in dataclasses.fields(StepFigures)]
    assert set(figures) == set(sums) | {"grad_norm"}, "a sum without its figure (or a figure without its sum)"
    with pytest.raises(TypeError):  # by keyword only: a positional copy could shift the figures
        StepFigures(*range(len(sums)))


def test_each_figure_is_the_sum_of_its_name():
    _, _, sums = _sums()
    figures = StepFigures.from_sums(sums.stack().double().tolist(), grad_norm=2.5)
    for field in dataclasses.fields(ObjectiveSums):
        assert getattr(figures, field.name) == pytest.approx(float(getattr(sums, field.name))), field.name
    assert figures.grad_norm == 2.5


def test_the_logged_losses_are_the_means_of_the_named_sums():
    logits, labels, sums = _sums()
    objective = Objective.from_config(LossConfig(ntl_weight=0.3))
    loss, ce, ntl = objective.losses(StepFigures.from_sums(sums.stack().double().tolist()), step=1)
    assert ce == pytest.approx(F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1)).item(), rel=1e-6)
    assert loss == pytest.approx(ce_ntl_loss(logits, labels, VOCAB, ntl_weight=0.3).item(), rel=1e-6)
    assert loss == pytest.approx(ce + 0.3 * ntl)


def _retyped(names: list[str]) -> type:
    """An `ObjectiveSums` whose fields are `names` (reordered or renamed), stacked in its own field order."""
    return dataclasses.make_dataclass("ObjectiveSums", names, namespace={"stack": ObjectiveSums.stack})


def test_a_reordered_objective_sums_still_logs_each_sum_under_its_name(monkeypatch):
    _, _, sums = _sums()
    names = [f.name for f in dataclasses.fields(ObjectiveSums)][::-1]
    reordered = _retyped(names)(**{name: getattr(sums, name) for name in names})
    monkeypatch.setattr(training_objective, "ObjectiveSums", reordered)
    figures = StepFigures.from_sums(reordered.stack().double().tolist())
    for name in names:
        assert getattr(figures, name) == pytest.approx(float(getattr(sums, name))), name


def test_a_renamed_objective_sum_is_refused(monkeypatch):
    names = [f.name for f in dataclasses.fields(ObjectiveSums)]
    monkeypatch.setattr(training_objective, "ObjectiveSums", _retyped(["tokens" if n == "token_count" else n
                                                                       for n in names]))
    with pytest.raises(TypeError, match="tokens"):
        StepFigures.from_sums([1.0] * len(names))
    with pytest.raises(ValueError, match="5 sums for the 6 fields of ObjectiveSums"):
        StepFigures.from_sums([1.0] * 5)


def test_the_training_state_changes_only_through_advance_and_restore():
    state = TrainingState()
    assert (state.step, state.tokens_seen, state.start_step) == (0, 0, 0)
    assert state.advance(64) == 1 and state.advance(64) == 2
    assert (state.step, state.tokens_seen, state.start_step) == (2, 128, 0)
    with pytest.raises(AttributeError):
        state.step = 5  # type: ignore[misc]
    resumed = TrainingState()
    resumed.restore(step=7, tokens_seen=448)
    resumed.advance(64)
    assert (resumed.step, resumed.tokens_seen, resumed.start_step) == (8, 512, 7)
    assert [resumed.checks_inputs(every_step=False) for _ in range(3)] == [True, False, False]
    assert resumed.checks_inputs(every_step=True)
