"""What one micro-batch's forward saves for backward on one rank, traced on the meta device: one decoder layer (at
the rank's token count and tensor-parallel head and MLP widths), the embedding, final norm and LM head, and the
CE + NTL objective (full logits or the chunked head), run through the project's own code under torch's
saved-tensor hooks, each storage counted once and the parameters left out. Nothing is computed or allocated.

Attention other than `eager` is traced as a flash kernel (what `auto` picks on a GPU: flash_attention_2, or
sdpa's fused kernels): it saves its query, key, value, output and the float32 log-sum-exp of each row, never the
`[S, S]` probabilities. tests/test_plan_measured.py holds the total to a real step's saved bytes."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..core.numbers import NumberVocab
from ..loss.chunked import chunked_model_ce_ntl_sums, resolve_chunk_backward
from ..loss.ntl import NTLSettings
from ..loss.objective import ce_ntl_sums
from ..models.families import supports_sdpa
from .model import meta_model


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward by one micro-batch's forward on one rank."""

    per_layer: int  # one decoder layer
    rest: int  # embedding, rotary tables, final norm, LM head and the loss
    layer_input: int  # one layer's input hidden states (what activation checkpointing keeps per layer)


class _FlashAttention(torch.autograd.Function):
    """A flash kernel's shape on the meta device: output like the query, saving q, k, v, output and the float32
    log-sum-exp `[B, heads, S]` (key and value at their own, grouped, head count)."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = torch.empty_like(query)
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, lse)
        return output

    @staticmethod
    def backward(ctx, grad):  # the gradients' shapes, as the kernel's backward gives them (the plan traces forward)
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _flash_sdpa(query, key, value, *args, **kwargs):
    return _FlashAttention.apply(query, key, value)


# the attention function a model without an sdpa attention (Gemma2's) is traced with: the flash kernel's shape, as
# transformers' own attention functions return it ([B, S, heads, head_dim]); its name must not contain "flash"
# (transformers would look for a flash-attn kernel by it)
KERNEL_ATTENTION = "ntl_plan_kernel"


def _kernel_attention(module, query, key, value, attention_mask, **kwargs):
    return _FlashAttention.apply(query, key, value).transpose(1, 2), None


def _traced_attention(attn_implementation: str, config: Any) -> str:
    """The attention a layer is traced with: eager as asked; otherwise sdpa under `_attention_as_flash`, or, where
    the model has no sdpa, the flash kernel's shape registered as a transformers attention function."""
    if attn_implementation == "eager":
        return "eager"
    if supports_sdpa(config):
        return "sdpa"
    from transformers import AttentionInterface

    AttentionInterface.register(KERNEL_ATTENTION, _kernel_attention)
    return KERNEL_ATTENTION


@contextlib.contextmanager
def _attention_as_flash(enabled: bool) -> Iterator[None]:
    """While tracing, sdpa is the flash kernel (on the meta device it would take the math path)."""
    if not enabled:
        yield
        return
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`layers`: Llama and most; `h`: Falcon, GPT-2)."""
    base = model.base_model
    layers = getattr(base, "layers", None)
    return layers if layers is not None else base.h


class _SavedStorages:
    """Saved-tensor hooks counting each storage once, parameters left out, attributed to the decoder layers or
    the rest by the module running when it was saved."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.sizes: dict[int, tuple[int, str]] = {}
        self.region = "rest"
        self.handles = []
        for layer in decoder_layers(model):
            self.handles.append(layer.register_forward_pre_hook(lambda *_: self._enter("layers")))
            self.handles.append(layer.register_forward_hook(lambda *_: self._enter("rest")))

    def _enter(self, region: str) -> None:
        self.region = region

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(tensor) in self.params or id(base) in self.params:
            return tensor
        storage = tensor.untyped_storage()
        if storage.nbytes():
            self.sizes.setdefault(storage._cdata, (storage.nbytes(), self.region))
        return tensor

    def total(self, region: str) -> int:
        return sum(size for size, where in self.sizes.values() if where == region)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# the models whose attention takes its head width as hidden_size / heads (fewer heads would make them wider, not
# fewer): traced with all their heads at every tp_size, an upper bound (the plan says so)
HEAD_WIDTH_FROM_HIDDEN = ("gpt_neox", "falcon")
MLP_WIDTHS = ("intermediate_size", "ffn_hidden_size")  # the MLP's inner width (Falcon: ffn_hidden_size)


def rank_layer_config(config: Any, tp_size: int, split_attention: bool, split_mlp: bool, vocab_local: int) -> Any:
    """A one-layer copy of `config` as one tensor-parallel rank computes it: heads divided by `tp_size` where AutoTP
    splits the attention, the MLP's width where it splits the MLP (not a MoE's fused experts, which it leaves
    whole), the head's vocabulary shard `vocab_local`."""
    text = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    with contextlib.suppress(AttributeError):  # a property on some configs (Falcon's), already right there
        text.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:1])
    text.vocab_size = vocab_local
    text.pad_token_id = None  # a padding id past the rank's vocabulary shard; padding changes no activation
    text.tie_word_embeddings = False  # the head is its own shard under TP; ties change no activation
    if tp_size > 1:
        if split_attention and text.model_type not in HEAD_WIDTH_FROM_HIDDEN:
            text.num_attention_heads //= tp_size
            text.num_key_value_heads = max(1, (getattr(text, "num_key_value_heads", None)
                                               or config.num_attention_heads) // tp_size)
        for key in MLP_WIDTHS if split_mlp else ():
            if isinstance(getattr(text, key, None), int):
                setattr(text, key, -(-getattr(text, key) // tp_size))
    return text


def traced_saved_bytes(config: Any, *, dtype: str, attn_implementation: str, rows: int, tokens: int,
                       tp_size: int, split_attention: bool, split_mlp: bool, vocab_local: int, number_tokens: int,
                       settings: NTLSettings, with_ntl: bool, chunk_tokens: int, chunk_backward: str,
                       device_type: str) -> SavedBytes:
    """The bytes one micro-batch of `rows` x `tokens` (this rank's share of the sequence) saves for backward."""
    layer_config = rank_layer_config(config, tp_size, split_attention, split_mlp, vocab_local)
    attention = _traced_attention(attn_implementation, layer_config)
    model = meta_model(layer_config, dtype, attention)
    model.train()
    input_ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    labels = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    vocab = NumberVocab(token_ids=tuple(range(number_tokens)), values=tuple(range(number_tokens)),
                        vocab_size=vocab_local)
    saved = _SavedStorages(model)
    try:
        with _attention_as_flash(attention == "sdpa"), torch.autograd.graph.saved_tensors_hooks(
                saved.pack, lambda tensor: tensor):
            if chunk_tokens > 0:
                backward = resolve_chunk_backward(chunk_backward, chunk_tokens, rows * tokens, device_type)
                chunked_model_ce_ntl_sums(model, model.get_output_embeddings(), {"input_ids": input_ids}, labels,
                                          vocab, settings, chunk_tokens=chunk_tokens, with_ntl=with_ntl,
                                          check_inputs=False, backward=backward)
            else:
                ce_ntl_sums(model(input_ids=input_ids).logits, labels, vocab, settings, with_ntl=with_ntl,
                            check_inputs=False)
    finally:
        saved.close()
    itemsize = torch.empty((), dtype=next(model.parameters()).dtype, device="meta").element_size()
    return SavedBytes(per_layer=saved.total("layers"), rest=saved.total("rest"),
                      layer_input=rows * tokens * layer_config.hidden_size * itemsize)
