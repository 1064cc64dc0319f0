"""What the trainer supports of each open LLM family (by transformers `model_type`): tensor parallelism (AutoTP,
T > 1) and the partitioned ZeRO-3 load (`model.partitioned_load`, the default) at T = 1 and T > 1.

`FAMILIES` is the one table: the start-up check (`check_family`, run by the trainer and `--dry-run` before the
model is built), `parallel.tp_size=auto` (`tp_limit`), docs/training.md's table and tests/test_model_families.py
read it, and so does `build_model`, which hands AutoTP a family's own layer specs (`add_tp_partition_config`). A
family not listed is not checked (it runs as DeepSpeed and transformers allow).

`published_state_dict` turns a state dict in transformers 5's in-memory names into the layout the family's
`save_pretrained` writes (transformers' own reverse conversion: per-expert tensors, `embed_out`, ...).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError


@dataclass(frozen=True)
class Family:
    """One family's support; a `None` reason means supported."""

    name: str  # the family as users know it (for the docs and messages)
    no_tp: str | None = None  # why T > 1 cannot run (every load)
    no_partitioned_load: str | None = None  # why the partitioned load cannot read its files (T = 1 and T > 1)
    no_tp_partitioned_load: str | None = None  # why the partitioned load cannot read its AutoTP slices (T > 1)
    special: str = ""  # the published features the family test covers
    tp_layer_specs: tuple[dict, ...] = ()  # DeepSpeed partition_config layer_specs given to AutoTP (T > 1) in place
    # of the model's transformers tp_plan, for a family whose plan DeepSpeed 0.19 does not take; () uses the tp_plan


def _specs(partition_type: str, *patterns: str) -> dict:
    """One DeepSpeed partition_config layer spec: `patterns` (parameter-name regexes) split as `partition_type`."""
    return {"patterns": list(patterns), "partition_type": partition_type}


# Attention replicated on every TP rank (each computes all heads from the full hidden state: the same values and
# the same whole gradients on every rank, so no gradient all-reduce), MLP split: OLMo2's q/k norms normalise the
# whole projection (all heads at once), and Phi-3's attention cuts its fused qkv_proj at the model's full head
# counts, so neither computes correctly on a column shard of its projections.
_REPLICATED_ATTENTION = _specs("skip", r".*\.self_attn\.(q|k|v|o|qkv)_proj\.weight$")
_SPLIT_MLP = (_specs("column", r".*\.mlp\.(gate|up)_proj\.weight$"), _specs("row", r".*\.mlp\.down_proj\.weight$"))
# MoE: attention split by heads as for Llama (Qwen3-MoE's per-head q/k norms replicated, their gradients summed
# over the TP group as transformers' plan says); the router and the fused experts are not nn.Linear, so AutoTP
# leaves them whole: every rank runs every expert on the full hidden state (experts replicated across TP)
_SPLIT_ATTENTION = (_specs("column", r".*\.self_attn\.[qkv]_proj\.weight$"),
                    _specs("row", r".*\.self_attn\.o_proj\.weight$"),
                    {**_specs("skip", r".*\.self_attn\.[qk]_norm\.weight$"), "grad_allreduce": True})

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 3.x", special="untied head, GQA"),
    "qwen2": Family("Qwen2.5", special="tied head, q/k/v biases"),
    "qwen3": Family("Qwen3", special="tied head, per-head q/k norms"),
    "mistral": Family("Mistral", special="sliding window"),
    "granite": Family("Granite", special="embedding, residual, attention and logit multipliers"),
    "smollm3": Family("SmolLM3", special="tied head, layers without RoPE"),
    "starcoder2": Family("StarCoder2", special="LayerNorm, biases, GELU MLP, sliding window"),
    "gemma3_text": Family("Gemma3 (text)", special="tied scaled embedding, q/k norms, sliding/global layers"),
    "gemma2": Family("Gemma2", special="tied scaled embedding, attention and logit soft-capping, sliding window"),
    "phi3": Family("Phi-3 / Phi-3.5 / Phi-4-mini", special="fused qkv_proj and gate_up_proj, partial RoPE, tied head",
                   tp_layer_specs=(_REPLICATED_ATTENTION,
                                   {**_specs("column", r".*\.mlp\.gate_up_proj\.weight$"), "shape": [2, -1],
                                    "partition_dim": 0},  # [gate; up]: each rank the same rows of both halves
                                   _specs("row", r".*\.mlp\.down_proj\.weight$"))),
    "olmo2": Family("OLMo2", special="q/k norms over the whole projection, post-norms",
                    tp_layer_specs=(_REPLICATED_ATTENTION, *_SPLIT_MLP)),
    "qwen3_moe": Family("Qwen3-MoE", special="MoE (fused experts), q/k norms", tp_layer_specs=(*_SPLIT_ATTENTION, *_SPLIT_MLP)),
    "mixtral": Family("Mixtral", special="MoE (fused experts), sliding window", tp_layer_specs=(*_SPLIT_ATTENTION, *_SPLIT_MLP)),
    "gpt_neox": Family("GPT-NeoX / Pythia", special="fused query_key_value, parallel residual, partial RoPE, "
                                                    "untied embed_out"),
    "falcon": Family("Falcon", special="fused query_key_value, parallel attention/MLP"),
}


def _cell(model_type: str, tp_size: int) -> str:
    """How `model_type` runs at `tp_size`, for the docs table."""
    if family_problem(model_type, tp_size, partitioned_load=True) is None:
        return "trains"
    if family_problem(model_type, tp_size, partitioned_load=False) is None:
        return "trains with `model.partitioned_load=false`"
    return "refused at start-up"


def families_table() -> str:
    """docs/training.md's table of the families (a test keeps the page equal to it)."""
    rows = ["| family (`model_type`) | T=1 | T>1 | partitioned load | published features tested |",
            "|---|---|---|---|---|"]
    for model_type, family in FAMILIES.items():
        partitioned = ("no" if family.no_partitioned_load else
                       "T=1" if family.no_tp or family.no_tp_partitioned_load else "T=1 and T>1")
        rows.append(f"| {family.name} (`{model_type}`) | {_cell(model_type, 1)} | {_cell(model_type, 2)} | "
                    f"{partitioned} | {family.special} |")
    return "\n".join(rows)


# embeddings whose forward is nn.Embedding's lookup times their `embed_scale` buffer, as Gemma3's, which DeepSpeed
# 0.19's VocabParallelEmbedding accepts (it multiplies by `embed_scale` after the vocabulary-parallel lookup)
SCALED_EMBEDDINGS = {"transformers.models.gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding"}


def accept_scaled_embeddings() -> None:
    """Let DeepSpeed's vocabulary-parallel embedding take the embeddings of `SCALED_EMBEDDINGS` as it takes
    Gemma3's (its check names Gemma3's class only). Installed once per process, before `deepspeed.initialize`, and
    checked then by behaviour (`check_scaled_embeddings`)."""
    from deepspeed.module_inject.layers import VocabParallelEmbedding

    validate = VocabParallelEmbedding.validate_embedding
    if getattr(validate, "_ntl_scaled_embeddings", False):
        return

    def validate_embedding(module: torch.nn.Module) -> None:
        kind = type(module)
        plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
        if not (plain and f"{kind.__module__}.{kind.__qualname__}" in SCALED_EMBEDDINGS):
            validate(module)

    validate_embedding._ntl_scaled_embeddings = True  # type: ignore[attr-defined]
    validate_embedding.__wrapped__ = validate  # type: ignore[attr-defined]
    VocabParallelEmbedding.validate_embedding = staticmethod(validate_embedding)
    check_scaled_embeddings()


def check_scaled_embeddings() -> None:
    """What `accept_scaled_embeddings` assumes of DeepSpeed, tried on a tiny embedding of each class of
    `SCALED_EMBEDDINGS`: `VocabParallelEmbedding` (one rank, no group) gates its input by `validate_embedding` and
    gives the embedding's own output (the lookup times `embed_scale`). One line naming the versions otherwise."""
    import importlib

    import deepspeed
    import transformers
    from deepspeed.module_inject.layers import VocabParallelEmbedding

    ids = torch.tensor([[0, 3, 5, 7]])
    for path in sorted(SCALED_EMBEDDINGS):
        module_name, _, class_name = path.rpartition(".")
        embedding = getattr(importlib.import_module(module_name), class_name)(8, 4, padding_idx=0, embed_scale=3.0)
        try:
            with torch.no_grad():
                same = torch.equal(VocabParallelEmbedding(embedding, None)(ids), embedding(ids))
            why = "gives another output than the embedding's own (the lookup times embed_scale)"
        except NotImplementedError as error:
            same, why = False, f"refuses it despite the widened validate_embedding ({error})"
        if not same:
            raise RuntimeError(f"DeepSpeed {deepspeed.__version__} with transformers {transformers.__version__}: "
                               f"VocabParallelEmbedding {why} for {class_name}, which models/families.py's "
                               f"accept_scaled_embeddings assumes it does as for Gemma3's; set parallel.tp_size=1 or "
                               f"use the DeepSpeed of constraints.txt")


def add_tp_partition_config(ds_config: dict, model_type: str) -> None:
    """Give AutoTP the family's own layer specs (`Family.tp_layer_specs`) in `ds_config` (DeepSpeed's
    tensor_parallel.partition_config, which it prefers to the model's tp_plan), unless the user's DeepSpeed config
    has its own partition_config or preset_model. Layers no spec names stay whole."""
    family = FAMILIES.get(model_type)
    tensor_parallel = ds_config.get("tensor_parallel")
    if family is None or not family.tp_layer_specs or tensor_parallel is None:
        return
    if "partition_config" not in tensor_parallel and "preset_model" not in tensor_parallel:
        tensor_parallel["partition_config"] = {"use_default_specs": False,
                                               "layer_specs": [dict(spec) for spec in family.tp_layer_specs]}


def family_of(config: Any) -> tuple[str, Family | None]:
    """The model_type of a transformers config (its text model's for a composite one) and its `FAMILIES` entry."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text_config, "model_type", "") or getattr(config, "model_type", ""))
    return model_type, FAMILIES.get(model_type)


def family_problem(model_type: str, tp_size: int, partitioned_load: bool) -> str | None:
    """One line saying why `model_type` cannot run at `tp_size` with this load, and the fix; None when it can.
    `partitioned_load`: the run reads a checkpoint with the partitioned load (model.name_or_path, ZeRO-3)."""
    family = FAMILIES.get(model_type)
    if family is None:
        return None
    if tp_size > 1 and family.no_tp:
        return (f"parallel.tp_size={tp_size}: {family.name} ({model_type}) cannot run with tensor parallelism: "
                f"{family.no_tp}; set parallel.tp_size=1 (ZeRO-3 still shards it over the ranks)")
    reason = family.no_partitioned_load or (family.no_tp_partitioned_load if tp_size > 1 else None)
    if partitioned_load and reason:
        return (f"model.partitioned_load=true: {family.name} ({model_type}) at parallel.tp_size={tp_size} cannot be "
                f"loaded partitioned: {reason}; set model.partitioned_load=false (every rank loads the full model "
                f"before DeepSpeed partitions it)")
    return None


def check_family(config: Any, tp_size: int, partitioned_load: bool) -> None:
    """Raise ConfigError (one line: the reason and the fix) when the run's model family cannot run at `tp_size`
    with this load; run before the model is built, the same on every rank."""
    problem = family_problem(family_of(config)[0], tp_size, partitioned_load)
    if problem is not None:
        raise ConfigError(problem)


def supports_sdpa(config: Any) -> bool:
    """Whether transformers' causal LM of `config` has an sdpa attention (Gemma2's has none)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return bool(getattr(model_class, "_supports_sdpa", True))


def check_attention(config: Any, attn_implementation: str) -> None:
    """Refuse (ConfigError, one line) model.attn_implementation=sdpa for a model without an sdpa attention, which
    transformers refuses when the model is built."""
    if attn_implementation == "sdpa" and not supports_sdpa(config):
        raise ConfigError(f"model.attn_implementation=sdpa: {family_of(config)[0]} has no sdpa attention in "
                          f"transformers; set model.attn_implementation=eager, or flash_attention_2 with flash-attn "
                          f"installed")


def tp_plan_styles(config: Any) -> dict[str, str]:
    """{module pattern: partition style} of the transformers tp_plan AutoTP reads for `config`'s model (its text
    model's), {} when it has none."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text_config, "base_model_tp_plan", None) or {})


def _refused_tp_styles(model_type: str, config: Any = None) -> list[str]:
    """The partition styles of the tp_plan AutoTP would read for `model_type` (its config class's, or `config`'s)
    that DeepSpeed's converter refuses; none for a family with its own layer specs."""
    family = FAMILIES.get(model_type)
    if family is not None and family.tp_layer_specs:
        return []
    if config is None:
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None  # (its .get is not lazy)
        styles = dict(getattr(config_class, "base_model_tp_plan", None) or {})
    else:
        styles = tp_plan_styles(config)
    from deepspeed.module_inject.tp_plan_converter import SUPPORTED_STYLES

    return sorted({style for style in styles.values() if style.lower() not in SUPPORTED_STYLES})


def check_tp_plan(config: Any, tp_size: int, ds_config: dict) -> None:
    """Refuse (ConfigError, one line) a run whose AutoTP would read a transformers tp_plan holding a partition
    style DeepSpeed's converter refuses (OLMoE's `rowwise_split_input`, DeepSeek's `mla_kv_a_proj`, ...): it would
    fail inside deepspeed.initialize, after the model was built. Not when the family has its own layer specs or
    the DeepSpeed config gives AutoTP a partition_config or preset_model (then the tp_plan is not read)."""
    tensor_parallel = ds_config.get("tensor_parallel") or {}
    if tp_size <= 1 or "partition_config" in tensor_parallel or "preset_model" in tensor_parallel:
        return
    import deepspeed

    model_type = family_of(config)[0]
    refused = _refused_tp_styles(model_type, config)
    if refused:
        raise ConfigError(f"parallel.tp_size={tp_size}: the transformers tp_plan of {model_type} has the partition "
                          f"style(s) {', '.join(refused)}, which DeepSpeed {deepspeed.__version__}'s AutoTP refuses "
                          f"(inside deepspeed.initialize); set parallel.tp_size=1 (ZeRO-3 still shards the model) or "
                          f"give AutoTP layer specs in the DeepSpeed config's tensor_parallel.partition_config")


def tp_limit(cfg: Any) -> int | None:
    """1 when the run's model family (model.architecture's model_type, or a local model.name_or_path's
    config.json) cannot run with tensor parallelism with the run's load (or its tp_plan has a style DeepSpeed
    refuses, `check_tp_plan`), else None (no limit known); what `parallel.tp_size=auto` may pick. `cfg`: the
    run's `Config`."""
    model = cfg.model
    model_type = model.architecture.get("model_type")
    path = model.name_or_path and os.path.join(os.path.expanduser(model.name_or_path), "config.json")
    if model_type is None and path and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            found = json.load(handle)
        model_type = (found.get("text_config") or {}).get("model_type") or found.get("model_type")
    partitioned = model.name_or_path is not None and model.partitioned_load and cfg.parallel.zero_stage == 3
    return 1 if family_problem(str(model_type), 2, partitioned) or _refused_tp_styles(str(model_type)) else None


def published_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (full tensors in the model's in-memory names, tied ones once) in the names and shapes the
    family's `save_pretrained` writes: transformers' reverse weight conversion (e.g. Qwen3-MoE's fused
    `experts.gate_up_proj` back to per-expert `gate_proj`/`up_proj`, GPT-NeoX's `lm_head` to `embed_out`)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state_dict))


def published_layouts(model: Any, shapes: dict[str, torch.Size]) -> dict[str, dict[str, tuple[int, ...]]]:
    """{in-memory name: {the name the family's checkpoints give each of its published tensors: shape}} for the
    parameters (of the given full shapes) whose published layout is not the in-memory one: transformers' reverse
    conversion renames them (GPT-NeoX's `lm_head` is `embed_out`) or splits them into several tensors (Qwen3-MoE's
    fused `experts.gate_up_proj` is one `gate_proj` and one `up_proj` per expert). Only shapes are used (meta
    tensors)."""
    from transformers.core_model_loading import revert_weight_conversion

    layouts = {}
    for name, shape in shapes.items():
        published = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
        if list(published) != [name]:
            layouts[name] = {key: tuple(tensor.shape) for key, tensor in published.items()}
    return layouts


def assemble_published(model: Any, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The in-memory parameter `name` from its published tensors `tensors` ({checkpoint name: tensor}, as
    `published_layouts` names them), by transformers' own load conversion (what `from_pretrained` does: e.g.
    Qwen3-MoE's per-expert tensors stacked and concatenated into `experts.gate_up_proj`)."""
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)  # as from_pretrained gets it
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    converter = None
    for key in sorted(tensors, key=dot_natural_key):  # from_pretrained's order (expert 10 after expert 9)
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, {name: True})
        if renamed != name or (pattern is None and len(tensors) > 1):
            raise ValueError(f"transformers' conversion of the checkpoint tensor {key!r} gives {renamed!r}, not the "
                             f"parameter {name!r}; set model.partitioned_load=false")
        if pattern is None:
            return tensors[key]
        if converter is None:
            converter = deepcopy(next(entry for entry in converters if pattern in entry.source_patterns))
        converter.add_tensor(renamed, key, pattern, tensors[key])
    realized = converter.convert(name, model=model, config=model.config)
    value = realized.get(name)
    value = value[0] if isinstance(value, list) else value
    if value is None or len(realized) != 1:
        raise ValueError(f"transformers' conversion of {sorted(tensors)[:2]} ... gives {sorted(realized)}, not the "
                         f"parameter {name!r}; set model.partitioned_load=false")
    return value
