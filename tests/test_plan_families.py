"""`--plan` for every family of `models.families.FAMILIES` (and a family DeepSpeed refuses): each parameter's
planned tensor-parallel slice is the one DeepSpeed's own AutoTP cuts (`DeepSpeedEngine._configure_tensor_parallel`
on the meta model, each tp rank in torch's fake process group, with the layer specs the trainer hands it), at
tp 2 for every family and at tp 4 for a tied head and Falcon's heuristic split; what AutoTP leaves whole on every
rank (a MoE's fused experts, Phi-3's and OLMo2's attention) is traced whole; and the start-up refusals the plan
makes before anything is built. Tiny shapes of each family's own transformers config class (test_model_families'
published features), so each case takes a second or two."""

from __future__ import annotations

import copy
import os

import pytest
from test_model_families import TINY

from ntl_pretrain.config import ConfigError, load_config
from ntl_pretrain.models.families import FAMILIES, accept_scaled_embeddings, add_tp_partition_config
from ntl_pretrain.plan import make_plan
from ntl_pretrain.trainer.preflight import preflight
from ntl_pretrain.trainer.rehearsal import (_autotp_training_mode, _engine_shell, _meta_model, _slice_numel,
                                            simulated_rank)

pytestmark = pytest.mark.fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "llama3_8b_cpt.yaml")
VOCAB = 256  # divisible by the tp sizes; the families' default padding ids (SmolLM3: 128004) are set below it


def _model_folder(tmp_path, model_type: str, **changes) -> str:
    from transformers import AutoConfig

    sizes = {"pad_token_id": None, **TINY[model_type], **changes}
    AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, **sizes).save_pretrained(
        tmp_path / model_type)
    return str(tmp_path / model_type)


def _plan(folder: str, tp: int, *overrides: str, world_size: int = 8):
    cfg = load_config(CONFIG, [f"model.name_or_path={folder}", f"parallel.tp_size={tp}", "data.seq_len=32",
                               "model.resize_embeddings=false", "model.attn_implementation=eager", *overrides])
    checked = preflight(cfg, world_size, on_cpu=False, local_files_only=True)
    return make_plan(checked, world_size), checked


def _deepspeed_slices(checked, tp: int) -> dict[str, int]:
    """{parameter: the most elements any tp rank holds of it} as DeepSpeed's AutoTP slices the meta model, with
    the DeepSpeed config the trainer hands deepspeed.initialize (the family's layer specs added, Gemma2's scaled
    embedding accepted, as build_model does)."""
    from deepspeed.utils import groups

    from ntl_pretrain.models.loading.autotp import _tp_pieces

    ds_config = copy.deepcopy(checked.run.ds_config)
    add_tp_partition_config(ds_config, checked.model_config.get_text_config().model_type)
    accept_scaled_embeddings()
    reference = _meta_model(checked.model_config)
    shapes = {name: tuple(param.shape) for name, param in reference.named_parameters()}
    largest: dict[str, int] = {}
    for rank in range(tp):
        with simulated_rank(rank, tp, tp):
            groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
            groups.mpu = groups
            shell = _engine_shell(ds_config, groups)
            model = copy.deepcopy(reference)
            with _autotp_training_mode():
                shell._configure_tensor_parallel(model, shell.tensor_parallel_config())
            for name, param in model.named_parameters():
                numel = _slice_numel(shapes[name], _tp_pieces(param, name, rank) or [])
                largest[name] = max(largest.get(name, 0), numel)
    return largest


CASES = [(model_type, 2, {}) for model_type in FAMILIES] + [("qwen2", 4, {"num_key_value_heads": 4}),
                                                             ("falcon", 4, {"num_kv_heads": 4})]


@pytest.mark.parametrize("model_type,tp,changes", CASES)
def test_planned_slices_are_deepspeeds_autotp(tmp_path, model_type, tp, changes):
    plan, checked = _plan(_model_folder(tmp_path, model_type, **changes), tp)
    planned = {p.name: p.tp_numel for p in plan.parameters}
    assert planned == _deepspeed_slices(checked, tp)
    assert plan.model["parameters_per_tp_rank"] == sum(planned.values())


def test_a_tied_head_splits_the_embedding_and_all_reduces_its_lookup(tmp_path):
    """Qwen2 with a tied head at tp 2: the embedding is the head's vocabulary shard (DeepSpeed's
    VocabParallelEmbedding shares it) and its lookup is summed over the tp group once a micro-batch."""
    plan, checked = _plan(_model_folder(tmp_path, "qwen2"), 2)
    embedding = next(p for p in plan.parameters if p.name == "model.embed_tokens.weight")
    assert embedding.tp_numel == VOCAB // 2 * TINY["qwen2"]["hidden_size"]
    lookups = [t for t in plan.traffic if "vocabulary-parallel embedding" in t["what"]]
    rows, seq, hidden = 1, 32, TINY["qwen2"]["hidden_size"]  # the config's micro batch, seq_len; bf16
    assert lookups == [{"group": "tp", "group_size": 2, "kind": "all_reduce", "calls": 4,
                        "bytes": 4 * rows * seq * hidden * 2,
                        "what": "forward: the vocabulary-parallel embedding's output (the head is tied to it)"}]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_experts_are_traced_whole_on_every_tp_rank(tmp_path, model_type):
    """AutoTP leaves a MoE's fused experts whole (their parameters are planned whole above, as DeepSpeed slices
    them); the traced layer keeps their width at tp 2, where only the attention's heads are halved (Mixtral's
    experts were traced at intermediate_size / tp)."""
    from ntl_pretrain.plan.activations import rank_layer_config

    plan, checked = _plan(_model_folder(tmp_path, model_type), 2)
    experts = [p for p in plan.parameters if ".experts." in p.name]
    assert experts and all(p.tp_dim is None for p in experts)
    text = checked.model_config.get_text_config()
    layer = rank_layer_config(text, 2, split_attention=True, split_mlp=False, vocab_local=VOCAB // 2)
    for key in ("intermediate_size", "moe_intermediate_size"):
        assert getattr(layer, key, None) == getattr(text, key, None)
    assert layer.num_attention_heads == text.num_attention_heads // 2
    whole, _ = _plan(_model_folder(tmp_path, model_type), 1)
    # the experts' share of the layer is the same at tp 1 and 2: only attention shrinks
    assert 0.5 * whole.batch["activation_bytes_per_layer"] < plan.batch["activation_bytes_per_layer"] < \
        whole.batch["activation_bytes_per_layer"]


def test_a_padding_id_past_the_vocabulary_shard_plans(tmp_path):
    """SmolLM3's padding id lies in the upper half of its vocabulary: the rank's traced layer has no padding id
    (it was an AssertionError from nn.Embedding at tp 2)."""
    plan, _ = _plan(_model_folder(tmp_path, "smollm3", pad_token_id=VOCAB - 2), 2)
    assert plan.memory["activations"] > 0


def test_a_tp_plan_deepspeed_refuses_is_refused_before_anything_is_built(tmp_path):
    """OLMoE's tp_plan has `rowwise_split_input`, which DeepSpeed's converter refuses inside deepspeed.initialize:
    --plan (and the trainer's start-up) refuses tp 2 in one line; tp 1 plans."""
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from transformers import OlmoeConfig

    OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                pad_token_id=None).save_pretrained(tmp_path / "olmoe")
    with pytest.raises(ValueError, match="rowwise_split_input"):
        TPPlanConverter.convert(OlmoeConfig.base_model_tp_plan)  # DeepSpeed's own refusal
    with pytest.raises(ConfigError, match=r"parallel.tp_size=2: the transformers tp_plan of olmoe has the partition "
                                          r"style\(s\) rowwise_split_input, which DeepSpeed .* refuses"):
        _plan(str(tmp_path / "olmoe"), 2)
    assert _plan(str(tmp_path / "olmoe"), 1)[0].tp_size == 1
    assert _plan(str(tmp_path / "olmoe"), "auto")[0].tp_size == 1  # auto picks a size AutoTP takes


@pytest.mark.parametrize("attention", ["auto", "eager"])
def test_gemma2_plans_with_its_attention_choices(tmp_path, attention):
    """Gemma2 has no sdpa attention in transformers: auto plans the flash kernel (with a note that the run needs
    flash-attn), eager its own; sdpa is refused (below)."""
    plan, _ = _plan(_model_folder(tmp_path, "gemma2"), 2, f"model.attn_implementation={attention}")
    assert plan.memory["activations"] > 0
    assert any("has no sdpa attention" in note for note in plan.notes) == (attention == "auto")


def test_gemma2_with_sdpa_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="model.attn_implementation=sdpa: gemma2 has no sdpa attention"):
        _plan(_model_folder(tmp_path, "gemma2"), 1, "model.attn_implementation=sdpa")
