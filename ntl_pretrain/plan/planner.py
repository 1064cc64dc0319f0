"""The plan of a run: per rank, the device bytes of each kind, the traffic of one optimizer step per group, and the
files of a checkpoint, for the run's layout (dp x sp x tp), micro batch, sequence length, dtype, activation
checkpointing, loss head and optimizer, from the model's config.json alone (docs/plan.md).

Everything is read from the run's own resolved configuration (`trainer.preflight`: the DeepSpeed config the run
hands to `deepspeed.initialize`) and DeepSpeed's own settings (`DeepSpeedZeroConfig`: its defaults for the keys
the config leaves out); the model is built on the meta device (`plan.model`), its activations traced there
(`plan.activations`). ZeRO stage 3 only (the project's layout for models that need a plan)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ConfigError, ntl_settings
from ..core.fs import local_or_hub
from ..loss.chunked import resolve_chunk_backward
from ..models.build import DTYPES, padded_vocab_size
from ..trainer.preflight import Preflight
from ..models.families import supports_sdpa
from .activations import HEAD_WIDTH_FROM_HIDDEN, traced_saved_bytes
from .model import PlannedParameter, meta_model, planned_parameters, tied_embedding, zero3_partition

FP32 = 4  # bytes: ZeRO's master weights, Adam's moments, the loss's compute dtype for bf16/fp16 logits
DIGITS = 10  # number tokens of digit-level NTL (the loss's packed table holds K + 2 columns a row)
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
ATTENTION_NAME = re.compile(r"\.(self_attn|attention|self_attention)\.")  # a decoder layer's attention module
EXPERTS_NAME = re.compile(r"\.(experts|router|gate)\.")  # a MoE block's experts and router
# the memory terms in the order they are shown; `transient` ones exist during part of the step only
MEMORY_TERMS = {
    "parameters": "ZeRO-3 partition of the parameters (model dtype)",
    "persistent_parameters": "parameters under stage3_param_persistence_threshold, kept whole",
    "gathered_parameters": "ZeRO-3 gathered-layer working set (max_live_parameters + prefetch_bucket_size)",
    "gradients": "ZeRO-3 gradient partition (gradient accumulation dtype)",
    "reduce_bucket": "gradient reduce-scatter bucket (reduce_bucket_size, communication dtype)",
    "master_weights": "fp32 master partition",
    "optimizer_moments": "Adam's two fp32 moments of the partition",
    "optimizer_step_gradient": "fp32 gradient of one optimizer sub-group during the step (sub_group_size)",
    "activations": "saved for backward by one micro-batch's forward (layers, embedding, norm, head, loss)",
    "logits": "the LM head's output (full head) or one chunk's float32 logits (chunked head)",
    "loss_gradients": "logits' gradient (full head) or the chunked head's float32 gradient accumulators",
}


@dataclass
class Plan:
    """A run's plan: sizes in bytes per rank unless said otherwise."""

    world_size: int
    dp_size: int
    sp_size: int
    tp_size: int
    model: dict[str, Any]  # the model's figures (parameters, layers, hidden size, vocabulary)
    batch: dict[str, Any]  # micro batch, sequence length, tokens per rank, accumulation, dtype, head
    deepspeed: dict[str, Any]  # the ZeRO-3 settings used (DeepSpeed's own names)
    memory: dict[str, int]  # device bytes per rank, by kind (MEMORY_TERMS)
    host_memory: dict[str, int]  # offloaded kinds, on the host
    traffic: list[dict[str, Any]]  # per optimizer step: group, kind, calls, bytes (the full tensor of each call)
    checkpoint: dict[str, Any]  # files, per-rank and total bytes
    notes: list[str] = field(default_factory=list)
    parameters: list[PlannedParameter] = field(default_factory=list, repr=False)  # each one's AutoTP slice (not in
    # the JSON: hundreds of entries for a large model)
    partitions: int = 1  # ZeRO-3 partition group size (dp x sp)

    @property
    def device_bytes(self) -> int:
        return sum(self.memory.values())

    @property
    def layout(self) -> str:
        return f"dp {self.dp_size} x sp {self.sp_size} x tp {self.tp_size}"

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "dp_size": self.dp_size, "sp_size": self.sp_size,
                "tp_size": self.tp_size, "model": self.model, "batch": self.batch, "deepspeed": self.deepspeed,
                "memory": self.memory, "device_bytes": self.device_bytes, "host_memory": self.host_memory,
                "traffic": self.traffic, "checkpoint": self.checkpoint, "notes": self.notes}


def zero3_settings(ds_config: dict) -> dict[str, Any]:
    """The ZeRO-3 settings of `ds_config` with DeepSpeed's own defaults for the keys it leaves out."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    return {"stage": int(zero.stage), "stage3_param_persistence_threshold": int(zero.param_persistence_threshold),
            "stage3_prefetch_bucket_size": int(zero.prefetch_bucket_size),
            "stage3_max_live_parameters": int(zero.max_live_parameters),
            "stage3_max_reuse_distance": int(zero.max_reuse_distance),
            "reduce_bucket_size": int(zero.reduce_bucket_size), "sub_group_size": int(zero.sub_group_size),
            "offload_optimizer": zero.offload_optimizer.device.value if zero.offload_optimizer else "none",
            "offload_param": zero.offload_param.device.value if zero.offload_param else "none"}


def planned_vocab_size(cfg: Any, model_config: Any, tp_size: int) -> tuple[int, str | None]:
    """The vocabulary the run's model will have (as `models.build.build_model` sets it) and a note when it could
    not be known here: a model built from scratch gets its tokenizer's length padded; a loaded one keeps its
    config's, grown to the tokenizer's (padded) with model.resize_embeddings."""
    from ..tokenizer.loading import TokenizerLoadError, load_tokenizer
    from ..tokenizer.run import tokenizer_key, tokenizer_source

    model_vocab = int(model_config.get_text_config().vocab_size)
    source = tokenizer_source(cfg.tokenizer, cfg.model)
    try:
        tokenizer_size = len(load_tokenizer(local_or_hub(source, tokenizer_key(cfg.tokenizer)),
                                            trust_remote_code=cfg.model.trust_remote_code))
    except (TokenizerLoadError, ValueError, OSError):  # not on this machine (a cluster path, an uncached hub id)
        if cfg.model.name_or_path is None:
            raise ConfigError(f"--plan of a model built from scratch needs its tokenizer ({tokenizer_key(cfg.tokenizer)}"
                              f"={source!r}) for the vocabulary size; make it readable here") from None
        return model_vocab, (f"the tokenizer {source!r} is not readable here: vocabulary {model_vocab} from the "
                             f"model's config.json (a larger tokenizer with model.resize_embeddings grows it)")
    if cfg.model.name_or_path is None:
        return padded_vocab_size(tokenizer_size, cfg.model.pad_vocab_to_multiple_of, tp_size), None
    if tokenizer_size > model_vocab and cfg.model.resize_embeddings:
        return padded_vocab_size(tokenizer_size, math.lcm(cfg.model.pad_vocab_to_multiple_of, tp_size), 1), None
    return model_vocab, None


def _released_after_forward(params: list[PlannedParameter], layers: int, max_reuse_distance: int) -> set[str]:
    """Parameters ZeRO-3 releases after their forward use and gathers again in backward: those whose next use is
    further than stage3_max_reuse_distance elements of fetched parameters away (DeepSpeed keeps the others
    gathered). A parameter's next use is its backward: what is used after it in forward is fetched in between, in
    forward and again in backward (the embedding: every layer and the head; the final norm and head: nothing).
    `params` in the model's order."""
    first_layer = next((i for i, p in enumerate(params) if p.layer is not None), len(params))
    per_layer = [0] * layers
    for param in params:
        if param.layer is not None:
            per_layer[param.layer] += param.tp_numel
    after = sum(p.tp_numel for p in params[first_layer:] if p.layer is None)  # final norm, head
    released = set()
    for index, param in enumerate(params):
        if param.layer is not None:
            distance = 2 * (sum(per_layer[param.layer + 1:]) + after)
        elif index < first_layer:  # the embedding
            distance = 2 * (sum(per_layer) + after)
        else:
            distance = 0
        if distance > max_reuse_distance:
            released.add(param.name)
    return released


def make_plan(checked: Preflight, world_size: int, device_type: str = "cuda") -> Plan:
    """The plan of the run `checked` (its preflight at `world_size`) on `device_type` ranks."""
    cfg, ds_config, model_config = checked.run.cfg, checked.run.ds_config, checked.model_config
    if model_config is None:
        raise ConfigError(f"--plan needs the model's config.json, and model.name_or_path={cfg.model.name_or_path!r} "
                          f"is not cached here: point model.name_or_path at a folder holding its config.json "
                          f"(examples/model_configs/ has some) or run `huggingface-cli download "
                          f"{cfg.model.name_or_path} config.json`")
    zero = zero3_settings(ds_config)
    if zero["stage"] != 3:
        raise ConfigError(f"--plan plans ZeRO-3 runs; this one has parallel.zero_stage={zero['stage']}: set "
                          f"parallel.zero_stage=3")
    tp, sp = cfg.parallel.tp_size, cfg.parallel.sp_size
    dp = world_size // (tp * sp)
    partitions = dp * sp  # ZeRO-3 partitions over the sequence-data-parallel group
    notes: list[str] = []
    vocab, vocab_note = planned_vocab_size(cfg, model_config, tp)
    if vocab_note:
        notes.append(vocab_note)
    text = model_config.get_text_config()
    sized = type(text).from_dict({**text.to_dict(), "vocab_size": vocab})
    model = meta_model(sized, cfg.model.dtype, "eager")
    params = planned_parameters(model, sized, tp)
    layers = int(text.num_hidden_layers)
    hidden = int(text.hidden_size)
    bytes_model = torch.empty((), dtype=DTYPES[cfg.model.dtype]).element_size()
    grad_dtype = ds_config.get("data_types", {}).get("grad_accum_dtype")
    bytes_grad = {"fp32": 4, "bf16": 2, "fp16": 2}.get(grad_dtype, bytes_model)

    bytes_comm = gradient_comm_bytes(ds_config, sp, bytes_grad)
    partition = sum(zero3_partition(p.tp_numel, partitions) for p in params)
    persistent = [p for p in params if p.tp_numel <= zero["stage3_param_persistence_threshold"]]
    persistent_numel = sum(p.tp_numel for p in persistent)
    gathered_numel = sum(p.tp_numel for p in params) - persistent_numel
    working = min(zero["stage3_max_live_parameters"] + zero["stage3_prefetch_bucket_size"], gathered_numel)

    # activations of one micro-batch on this rank: its rows, its share of the sequence
    rows, tokens = cfg.data.micro_batch_size, cfg.data.seq_len // sp
    local_tokens = rows * tokens
    vocab_local = -(-vocab // tp)
    # what AutoTP splits of a layer, as planned per parameter: the attention (whole where the family's layer specs
    # replicate it: Phi-3, OLMo2) and the MLP (a MoE's fused experts stay whole on every rank)
    layer0 = [p for p in params if p.layer == 0 and p.tp_dim is not None]
    split_attention = any(ATTENTION_NAME.search(p.name) for p in layer0)
    split_mlp = any(".mlp." in p.name and not EXPERTS_NAME.search(p.name) for p in layer0)
    loss = cfg.loss
    settings = ntl_settings(loss)
    saved = traced_saved_bytes(sized, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                               rows=rows, tokens=tokens, tp_size=tp, split_attention=split_attention,
                               split_mlp=split_mlp,
                               vocab_local=vocab_local, number_tokens=DIGITS, settings=settings,
                               with_ntl=loss.ntl_on, chunk_tokens=loss.chunk_tokens,
                               chunk_backward=loss.chunk_backward, device_type=device_type)
    if cfg.model.gradient_checkpointing:  # each layer keeps its input; one layer's saved set while it recomputes
        activations = layers * saved.layer_input + saved.per_layer + saved.rest
    else:
        activations = layers * saved.per_layer + saved.rest
    if loss.chunk_tokens > 0:
        logits = min(loss.chunk_tokens, local_tokens) * vocab_local * FP32
        backward = resolve_chunk_backward(loss.chunk_backward, loss.chunk_tokens, local_tokens, device_type)
        loss_gradients = (vocab_local * hidden + local_tokens * hidden) * FP32 if backward == "rows" else 0
    else:
        logits = local_tokens * vocab_local * bytes_model
        loss_gradients = local_tokens * vocab_local * max(bytes_model, FP32)

    memory = {
        "parameters": partition * bytes_model,
        "persistent_parameters": persistent_numel * bytes_model,
        "gathered_parameters": working * bytes_model,
        "gradients": partition * bytes_grad,
        "reduce_bucket": zero["reduce_bucket_size"] * bytes_comm,  # DeepSpeed's bucket is in the communication dtype
        "master_weights": partition * FP32,
        "optimizer_moments": ADAM_MOMENTS * partition * FP32,
        "optimizer_step_gradient": min(zero["sub_group_size"], partition) * FP32,
        "activations": activations,
        "logits": logits,
        "loss_gradients": loss_gradients,
    }
    host_memory: dict[str, int] = {}
    if zero["offload_optimizer"] != "none":
        for key in ("master_weights", "optimizer_moments", "optimizer_step_gradient"):
            host_memory[key] = memory.pop(key)
    if zero["offload_param"] != "none":
        host_memory["parameters"] = memory.pop("parameters")

    traffic = step_traffic(cfg, params, zero, layers, hidden, partitions, tp, sp, local_tokens, bytes_model,
                           bytes_comm, text, tied_embedding=tied_embedding(model) is not None)
    optimizer = ds_config.get("optimizer", {})
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        notes.append(f"optimizer {optimizer.get('type')!r}: planned as Adam (two fp32 moments)")
    if cfg.model.gradient_checkpointing:
        notes.append("activation checkpointing: each layer keeps its input; one layer's saved set while it is "
                     "recomputed in backward")
    if cfg.model.attn_implementation == "auto" and not supports_sdpa(text):
        notes.append(f"model.attn_implementation=auto: {text.model_type} has no sdpa attention, so the run needs "
                     f"flash-attn on its GPU nodes (auto then picks flash_attention_2, as planned; without it the "
                     f"model cannot be built): else set model.attn_implementation=eager")
    if tp > 1 and split_attention and text.model_type in HEAD_WIDTH_FROM_HIDDEN:
        notes.append(f"{text.model_type} takes its head width from hidden_size / heads: its attention's activations "
                     f"are planned with all heads on every tp rank (an upper bound; AutoTP splits them)")
    if cfg.model.attn_implementation == "sdpa" and cfg.data.document_mask:
        notes.append("sdpa with data.document_mask=true: transformers builds a [rows, S, S] mask and repeats the "
                     "key-value heads, not planned (flash_attention_2, which auto picks on a GPU, needs neither)")
    return Plan(
        world_size=world_size, dp_size=dp, sp_size=sp, tp_size=tp,
        model={"model_type": text.model_type, "parameters": sum(math.prod(p.shape) for p in params),
               "parameters_per_tp_rank": sum(p.tp_numel for p in params), "layers": layers, "hidden_size": hidden,
               "vocab_size": vocab, "source": cfg.model.name_or_path or "model.architecture"},
        batch={"micro_batch_size": rows, "seq_len": cfg.data.seq_len, "tokens_per_rank": local_tokens,
               "grad_accum_steps": cfg.train.grad_accum_steps, "dtype": cfg.model.dtype,
               "gradient_checkpointing": cfg.model.gradient_checkpointing,
               "attention": cfg.model.attn_implementation,
               "loss_head": f"chunked ({loss.chunk_tokens} tokens)" if loss.chunk_tokens > 0 else "full logits",
               "activation_bytes_per_layer": saved.per_layer, "activation_bytes_outside_layers": saved.rest},
        deepspeed=zero, memory=memory, host_memory=host_memory, traffic=traffic,
        checkpoint=checkpoint_files(cfg, ds_config, partition, dp, sp, tp), notes=notes, parameters=params,
        partitions=partitions)


def gradient_comm_bytes(ds_config: dict, sp: int, bytes_grad: int) -> int:
    """Bytes an element of the gradient reduce-scatter has: DeepSpeed's `communication_data_type`, under sequence
    parallelism its `seq_parallel_communication_data_type` (float32 unless set), else the gradients' own."""
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.runtime.constants import (SEQ_PARALLEL_COMMUNICATION_DATA_TYPE,
                                             SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT)

    dtype = (get_communication_data_type(ds_config, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE,
                                         SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT) if sp > 1
             else get_communication_data_type(ds_config))
    return bytes_grad if dtype is None else torch.empty((), dtype=dtype).element_size()


def step_traffic(cfg: Any, params: list[PlannedParameter], zero: dict, layers: int, hidden: int, partitions: int,
                 tp: int, sp: int, tokens: int, bytes_model: int, bytes_grad: int, text: Any,
                 tied_embedding: bool = False) -> list[dict[str, Any]]:
    """The collectives of one optimizer step on one rank, per group and kind: how many calls and the bytes of the
    full tensor of each kind summed (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""
    micro = cfg.train.grad_accum_steps
    found: list[dict[str, Any]] = []

    def add(group: str, size: int, kind: str, calls: int | None, total: int, what: str) -> None:
        """`calls` None: as many as DeepSpeed's buckets make (the bytes are the plan)."""
        if size > 1 and total:
            found.append({"group": group, "group_size": size, "kind": kind, "calls": calls, "bytes": total,
                          "what": what})

    padded = [zero3_partition(p.tp_numel, partitions) * partitions for p in params]
    persistent = {p.name for p in params if p.tp_numel <= zero["stage3_param_persistence_threshold"]}
    released = _released_after_forward(params, layers, zero["stage3_max_reuse_distance"])
    forward_gather = sum(n for n, p in zip(padded, params) if p.name not in persistent) * micro + \
        sum(n for n, p in zip(padded, params) if p.name in persistent)
    backward_gather = sum(n for n, p in zip(padded, params) if p.name in released) * micro
    group = "dp x sp" if sp > 1 else "dp"
    add(group, partitions, "all_gather", None, forward_gather * bytes_model,
        "ZeRO-3 parameters gathered for forward (persistent ones once a step)")
    if backward_gather:
        add(group, partitions, "all_gather", None, backward_gather * bytes_model,
            "ZeRO-3 parameters gathered again for backward (released after forward: reuse distance beyond "
            "stage3_max_reuse_distance)")
    add(group, partitions, "reduce_scatter", None, sum(padded) * bytes_grad * micro,
        "ZeRO-3 gradients, once per micro-batch")
    if tp > 1:
        layer0 = [p for p in params if p.layer == 0 and p.name.endswith(".weight")]
        rows_split = sum(1 for p in layer0 if p.tp_dim == 1)
        columns_split = sum(1 for p in layer0 if p.tp_dim == 0)
        activation = tokens * hidden * bytes_model
        add("tp", tp, "all_reduce", layers * rows_split * micro, layers * rows_split * activation * micro,
            "forward: outputs of the row-split linear layers")
        if tied_embedding:  # DeepSpeed's VocabParallelEmbedding sums its shards' lookups (its backward sends nothing)
            add("tp", tp, "all_reduce", micro, activation * micro,
                "forward: the vocabulary-parallel embedding's output (the head is tied to it)")
        if cfg.model.gradient_checkpointing and rows_split > 1:
            # backward re-runs each layer's forward (models/build.py: torch's non-reentrant checkpoint), which stops
            # once it has recomputed the last tensor backward saves: the layer's last row-split output feeds only
            # the residual add, which saves nothing, so its all-reduce is not repeated (measured in
            # tests/test_plan_measured.py)
            recomputed = layers * (rows_split - 1) * micro
            add("tp", tp, "all_reduce", recomputed, recomputed * activation,
                "backward: the recomputed forward's row-split outputs but each layer's last (activation checkpointing)")
        # the full head's backward all-reduces its input gradient in the model dtype; the chunked head's own
        # gradient is float32 (loss/chunked.py), all-reduced in its backward instead
        head_backward = [activation] if cfg.loss.chunk_tokens <= 0 else [tokens * hidden * FP32]
        add("tp", tp, "all_reduce", (layers * columns_split + len(head_backward)) * micro,
            (layers * columns_split * activation + sum(head_backward)) * micro,
            "backward: input gradients of the column-split linear layers and of the vocabulary-parallel head")
        chunks = math.ceil(tokens / cfg.loss.chunk_tokens) if cfg.loss.chunk_tokens > 0 else 1
        add("tp", tp, "all_reduce", 2 * chunks * micro, tokens * (1 + DIGITS + 2) * FP32 * micro,
            "NTL + CE over the vocabulary shards: row maxima (MAX) and the packed [n, K + 2] table (SUM)")
        from deepspeed.runtime.zero.utils import get_norm_dtype

        add("tp", tp, "all_reduce", 1, torch.empty((), dtype=get_norm_dtype()).element_size(),
            "the gradient norm's sum of squares (one scalar in DeepSpeed's norm dtype), once a step")
    if sp > 1:
        heads, kv = int(text.num_attention_heads), int(getattr(text, "num_key_value_heads", None) or
                                                        text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        per_layer = tokens * head_dim * (2 * heads + 2 * kv) * bytes_model  # q, k, v in, output back
        # activation checkpointing re-runs each layer's attention in backward: its four all-to-alls and its gather
        runs = 2 if cfg.model.gradient_checkpointing else 1
        add("sp", sp, "all_to_all", (runs + 1) * 4 * layers * micro, (runs + 1) * per_layer * layers * micro,
            "Ulysses: q, k, v and the attention output, forward and backward"
            + (" (and the recomputed forward)" if runs == 2 else ""))
        # DeepSpeed's Ulysses attention gathers each layer's int64 position ids over the sequence
        add("sp", sp, "all_gather", runs * layers * micro,
            runs * layers * micro * cfg.data.micro_batch_size * cfg.data.seq_len * 8,
            "Ulysses: each attention's position ids (int64), gathered over the sequence"
            + (" (again when recomputed)" if runs == 2 else ""))
    return found


def checkpoint_files(cfg: Any, ds_config: dict, partition: int, dp: int, sp: int, tp: int) -> dict[str, Any]:
    """The files of one checkpoint (`checkpoint.manager.save`: DeepSpeed's per-rank files, each rank's RNG state,
    the Hugging Face assets and the manifest of rank 0) and the bytes of the tensors each per-rank file holds."""
    from ..checkpoint.format import HF_DIR, MANIFEST_NAME
    from ..checkpoint.safe_loading import rng_state

    bf16 = "bf16_" if cfg.model.dtype == "bf16" else ""
    # torch's AdamW (torch_adam, on CPU) keeps each group's step as a float32 tensor; DeepSpeed's fused Adam an int
    step_bytes = FP32 if ds_config.get("optimizer", {}).get("params", {}).get("torch_adam") else 0
    optim = partition * FP32 * (1 + ADAM_MOMENTS) + step_bytes
    rng = sum(v.numel() * v.element_size() for v in rng_state().values() if isinstance(v, torch.Tensor))
    files = []
    for zero_rank in range(dp * sp):
        for tp_rank in range(tp):
            files.append({"name": f"zero_pp_rank_{zero_rank}_mp_rank_{tp_rank:02d}_model_states.pt",
                          "tensor_bytes": 0})
            files.append({"name": f"{bf16}zero_pp_rank_{zero_rank}_mp_rank_{tp_rank:02d}_optim_states.pt",
                          "tensor_bytes": optim})
    files.extend({"name": f"rng_state_{rank}.pt", "tensor_bytes": rng} for rank in range(dp * sp * tp))
    return {"files": files, "run_files": [MANIFEST_NAME, f"{HF_DIR}/ (config.json, tokenizer, number vocabulary)"],
            "bytes_per_rank": optim + rng, "bytes": (optim + rng) * dp * sp * tp,
            "note": "tensor bytes; each torch file adds a few KiB of pickle (model_states: the module's "
                    "partitioned, empty parameters and the client state)"}


def device_type_of_run() -> str:
    """The device type the planned run's ranks use: a GPU unless DeepSpeed is told to run on CPU here."""
    return "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" else "cuda"
