"""The patches of other packages' classes are checked by behaviour where they are installed: each probe passes on
the pinned versions and fails in one line, naming the versions, when the patched method stops doing what the patch
assumes (simulated here by changing DeepSpeed's method for the test)."""

from __future__ import annotations

import deepspeed
import pytest
import torch
from deepspeed.module_inject.layers import VocabParallelEmbedding

from ntl_pretrain.models import families
from ntl_pretrain.models.loading import autotp

pytestmark = pytest.mark.fast


@pytest.fixture
def unpatched(monkeypatch):
    """DeepSpeed's own `validate_embedding` for the test (the widened one again afterwards, when it was)."""
    own = VocabParallelEmbedding.validate_embedding
    own = getattr(own, "__wrapped__", own)  # installed by an earlier test of this process
    monkeypatch.setattr(VocabParallelEmbedding, "validate_embedding", staticmethod(own))
    return monkeypatch


def _one_line_naming_versions(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and f"DeepSpeed {deepspeed.__version__}" in message
    return message


def test_scaled_embedding_probe_passes_on_the_pinned_versions(unpatched):
    families.accept_scaled_embeddings()
    assert getattr(VocabParallelEmbedding.validate_embedding, "_ntl_scaled_embeddings", False)
    families.check_scaled_embeddings()


def test_scaled_embedding_probe_fails_when_the_layer_drops_embed_scale(unpatched):
    """A DeepSpeed whose vocabulary-parallel forward no longer multiplies by `embed_scale`."""
    unpatched.setattr(VocabParallelEmbedding, "forward",
                      lambda self, input: torch.nn.functional.embedding(input, self.weight))
    with pytest.raises(RuntimeError) as error:
        families.accept_scaled_embeddings()
    assert "gives another output" in _one_line_naming_versions(error)


def test_scaled_embedding_probe_fails_when_the_check_moves_out_of_validate_embedding(unpatched):
    """A DeepSpeed that keeps `validate_embedding` but checks the embedding's class elsewhere."""
    refuse = VocabParallelEmbedding.validate_embedding  # DeepSpeed's own
    init = VocabParallelEmbedding.__init__

    def checking_inline(self, module, mp_group=None, **kwargs):
        refuse(module)
        init(self, module, mp_group, **kwargs)

    unpatched.setattr(VocabParallelEmbedding, "__init__", checking_inline)
    with pytest.raises(RuntimeError) as error:
        families.accept_scaled_embeddings()
    assert "refuses it despite" in _one_line_naming_versions(error)


class _PendingModel(torch.nn.Module):
    """A model as `load_tp_sliced` hands it to `deepspeed.initialize`: a meta weight and the pending load."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False, device="meta")
        setattr(self, autotp.PENDING_TP_LOAD, object())


def test_fill_after_autotp_fails_when_the_wrapped_method_no_longer_slices(monkeypatch):
    """A DeepSpeed that keeps `_configure_tensor_parallel` but slices elsewhere: the fill would read nothing."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.setattr(DeepSpeedEngine, "_configure_tensor_parallel", lambda engine, model, tp_config: None)
    monkeypatch.setattr(autotp, "_FILL_INSTALLED", False)
    autotp._install_fill_after_autotp()
    with pytest.raises(RuntimeError) as error:
        DeepSpeedEngine._configure_tensor_parallel(None, _PendingModel(), None)
    assert "no parameter sliced" in _one_line_naming_versions(error)


def test_tp_load_filled_fails_when_initialize_never_ran_the_wrapped_method():
    """A DeepSpeed whose `deepspeed.initialize` no longer calls `_configure_tensor_parallel`."""
    model = _PendingModel()
    with pytest.raises(RuntimeError) as error:
        autotp.check_tp_load_filled(model)
    assert "without calling" in _one_line_naming_versions(error)
    delattr(model, autotp.PENDING_TP_LOAD)  # as `fill_tp_slices` leaves it
    autotp.check_tp_load_filled(model)
