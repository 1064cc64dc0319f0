"""The model a plan is made for, from its config.json alone: the causal LM built on the meta device (shapes, no
storage), each parameter's AutoTP slice (which dimension DeepSpeed's AutoTP splits over the tensor-parallel ranks)
and its ZeRO-3 partition over the data-parallel group, as the real engine makes them
(tests/test_plan_measured.py holds these to the engine's own `ds_tensor` sizes)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..models.build import DTYPES
from ..models.families import FAMILIES, family_of, tp_plan_styles

# the LM head AutoTP splits by vocabulary rows (the trainer sets tensor_parallel.vocab_parallel_lm_head)
HEAD_NAMES = ("lm_head", "embed_out")
# transformers tp_plan styles as DeepSpeed's TPPlanConverter takes them: the weight dimension they split (a column
# split also splits the bias; a row split leaves the bias whole), None: whole (an `embedding_rowwise` embedding is
# split only when the vocabulary-parallel head is tied to it). Other styles are refused at start-up
# (`models.families.check_tp_plan`).
TP_PLAN_DIMS = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "rowwise": 1, "embedding_rowwise": None,
                "replicated_with_grad_allreduce": None}
SPEC_DIMS = {"column": 0, "row": 1, "skip": None}


@dataclass(frozen=True)
class PlannedParameter:
    """One parameter of the model as one rank holds it."""

    name: str  # the parameter's name in the model (transformers' in-memory names)
    shape: tuple[int, ...]  # its full shape
    tp_dim: int | None  # the dimension AutoTP splits over the tensor-parallel ranks (None: replicated)
    tp_numel: int  # elements on one tensor-parallel rank (the largest share, when the split is uneven)
    layer: int | None  # the decoder layer it belongs to (None: embedding, final norm, head)


def meta_model(config: Any, dtype: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The causal LM of `config` on the meta device, in the run's dtype: shapes only, built in a second or two at
    any size."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn_implementation)


def _tp_rules(model: torch.nn.Module, config: Any) -> list[tuple[re.Pattern, int | None, bool]]:
    """(parameter-name pattern, split dimension, splits the bias too) in the order AutoTP applies them: a family's
    own layer specs (`models.families`), else the model's transformers tp_plan."""
    family = FAMILIES.get(family_of(config)[0])
    if family is not None and family.tp_layer_specs:
        rules = []
        for spec in family.tp_layer_specs:
            dim = SPEC_DIMS[spec["partition_type"]]
            for pattern in spec["patterns"]:
                rules.append((re.compile(pattern), dim, dim == 0))
        return rules
    plan = tp_plan_styles(config)
    if not plan:
        return _heuristic_tp_rules(model)
    prefix = getattr(model, "base_model_prefix", "model")
    rules = []
    for key, style in plan.items():
        dim = TP_PLAN_DIMS[style.lower()]
        escaped = re.escape(f"{prefix}.{key}").replace(r"\*", r"\d+")
        rules.append((re.compile(rf"^{escaped}\.(weight|bias)$"), dim, dim == 0))
    return rules


def _heuristic_tp_rules(model: torch.nn.Module) -> list[tuple[re.Pattern, int | None, bool]]:
    """The rules of DeepSpeed's heuristic AutoTP, which it falls back to for a model with neither layer specs nor a
    tp_plan (Falcon's): in each decoder layer the linear layers its `AutoTP.tp_parser` names (the attention's and
    the MLP's output projections) are split by rows of the input, every other linear layer by output columns."""
    from deepspeed.module_inject.auto_tp import AutoTP

    row_names = {layer_class: tuple(names) for layer_class, names in AutoTP.tp_parser(model)}
    rules = []
    for module_name, module in model.named_modules():
        names = row_names.get(type(module))
        if names is None:
            continue
        for child_name, child in module.named_modules():
            if isinstance(child, torch.nn.Linear):
                dim = 1 if any(f".{child_name}".endswith(row) for row in names) else 0
                rules.append((re.compile(rf"^{re.escape(f'{module_name}.{child_name}')}\.(weight|bias)$"), dim,
                              dim == 0))
    return rules


def _split_numel(shape: tuple[int, ...], dim: int, tp_size: int) -> int:
    """Elements of the largest share of a tensor split along `dim` over `tp_size` ranks."""
    return math.prod(shape) // shape[dim] * math.ceil(shape[dim] / tp_size)


def planned_parameters(model: torch.nn.Module, config: Any, tp_size: int) -> list[PlannedParameter]:
    """Every parameter (tied ones once) with its AutoTP slice at `tp_size`: the family's or the tp_plan's split
    linear layers, the LM head by vocabulary rows (and so the embedding when the head is tied to it), everything
    else (an untied embedding, norms) whole on every rank."""
    rules = _tp_rules(model, config) if tp_size > 1 else []
    tied = tied_embedding(model)
    found = []
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        dim = None
        if tp_size > 1:
            # the head, and an embedding tied to it: DeepSpeed's VocabParallelEmbedding shares the head's shard
            if name.split(".")[0] in HEAD_NAMES or name.split(".")[-2] in HEAD_NAMES or param is tied:
                dim = 0
            for pattern, rule_dim, splits_bias in rules:
                if pattern.search(name):
                    is_bias = name.endswith(".bias")
                    dim = None if rule_dim is None or (is_bias and not splits_bias) else rule_dim
                    if is_bias and dim is not None:
                        dim = 0
                    break
        layer = re.search(r"\.(?:layers|h)\.(\d+)\.", name)  # Falcon, GPT-2: `h`
        found.append(PlannedParameter(name=name, shape=shape, tp_dim=dim,
                                      tp_numel=math.prod(shape) if dim is None else _split_numel(shape, dim, tp_size),
                                      layer=int(layer.group(1)) if layer else None))
    return found


def tied_embedding(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The input embedding's weight when the LM head is tied to it (one parameter), else None."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return embedding.weight if head is not None and head.weight is embedding.weight else None


def zero3_partition(numel: int, partitions: int) -> int:
    """Elements of one rank's ZeRO-3 partition of a tensor of `numel` elements over `partitions` ranks: DeepSpeed
    pads each parameter to a multiple of the partition count (partition_parameters `_padding_size`)."""
    return math.ceil(numel / partitions)
