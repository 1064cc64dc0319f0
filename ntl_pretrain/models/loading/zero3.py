"""ZeRO-3 without tensor parallelism: the model built partitioned (from a config, with the whole build's
weights, or from files), each rank reading only the elements of its own partition of each parameter."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from .reading import (
    READ_CHUNK_BYTES,
    GrownRows,
    TensorReader,
    file_keys,
    full_numel,
    full_shape,
    heap_returned_to_os,
    load_buffers,
    safetensors_files,
)

logger = logging.getLogger(__name__)


def import_outside_zero_init(config: Any, *, attn_implementation: str, dtype: torch.dtype,
                             trust_remote_code: bool) -> None:
    """Import everything building `config`'s model imports, before any `deepspeed.zero.Init` is entered.

    DeepSpeed's zero.Init hooks the `__init__` of every module class and, on exit, puts back the `__init__` it
    saw when a class was created inside the context. transformers imports a family's modeling module lazily (in
    `from_config`), and decorators such as `kernels`' `use_kernelized_func` wrap `__init__` after the class is
    created: a class first created inside zero.Init loses that wrapper when the context ends, so the next model of
    that class in the process fails in its first forward (transformers 5.25: `'LlamaAttention' object has no
    attribute '_kernel_funcs'`). A first import of `torch._dynamo` inside the context fails the same way.

    So the model is built once on the meta device (no storage, weights not initialised, the random state
    untouched): the modeling module, its attention and mask helpers and a remote-code module are all imported
    here. Cost: one module tree of meta tensors, milliseconds for the demo, about a second for 80 layers."""
    import torch._dynamo  # noqa: F401  (imported inside zero.Init it fails on its patched signatures)
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with torch.random.fork_rng(devices=[]), torch.device("meta"), no_init_weights():
        AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                         trust_remote_code=trust_remote_code)


def partitioned_load_applies(ds_config: dict | None, tp_size: int) -> bool:
    """True when the model can be loaded partitioned: under ZeRO-3, its ZeRO share (T=1) or its AutoTP slice
    (T>1, the DeepSpeed config's `tensor_parallel.autotp_size`)."""
    if ds_config is None or int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 3:
        return False
    return tp_size == 1 or int(ds_config.get("tensor_parallel", {}).get("autotp_size", 0) or 1) == tp_size


def init_without_broadcast(ds_config: dict, data_parallel_group: Any = None,
                           tied_head_shape: tuple[int, int] | None = None) -> Any:
    """A `deepspeed.zero.Init` context that partitions each parameter as it is built without first
    broadcasting rank 0's values: every rank builds the same values (same seed), or the files overwrite
    them; a full tensor that is allocated but never written never becomes resident.

    `tied_head_shape` (`(vocab, hidden)` of a model that ties its output head to its input embedding, when
    the files give the values): the head `nn.Linear`'s own weight is left empty (`TIED_HEAD_PLACEHOLDER`)
    instead of partitioned, since `tie_weights` replaces it with the embedding's; its partition would be a
    second copy of the embedding's share until then (0.14x of Qwen2.5-0.5B)."""
    import deepspeed
    import torch._dynamo  # noqa: F401  (every entry into zero.Init: first imported inside it, it fails; see above)

    class InitWithoutBroadcast(deepspeed.zero.Init):
        def _post_init_method(self, module: torch.nn.Module) -> None:
            weight = getattr(module, "weight", None)
            if (tied_head_shape is not None and isinstance(module, torch.nn.Linear) and weight is not None
                    and tuple(weight.shape) == tied_head_shape):
                weight.data = torch.empty(0, dtype=weight.dtype)
                setattr(weight, TIED_HEAD_PLACEHOLDER, True)
            super()._post_init_method(module)

        def _zero_init_param(self, param: torch.nn.Parameter) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return InitWithoutBroadcast(config_dict_or_path=ds_config, data_parallel_group=data_parallel_group)


TIED_HEAD_PLACEHOLDER = "_ntl_tied_head_placeholder"  # marks the empty head weight that tie_weights must replace


def _tied_head_shape(config: Any) -> tuple[int, int] | None:
    """`(vocab, hidden)` of the output head when the config ties it to the input embedding, else None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return None
    vocab, hidden = getattr(text_config, "vocab_size", None), getattr(text_config, "hidden_size", None)
    return (int(vocab), int(hidden)) if vocab and hidden else None


def _check_tied_head_replaced(model: torch.nn.Module) -> None:
    """After `tie_weights`: no parameter is still the empty placeholder of a tied head."""
    left = [name for name, param in model.named_parameters() if getattr(param, TIED_HEAD_PLACEHOLDER, False)]
    if left:
        raise ValueError(f"the config ties the output head to the input embedding, but after tie_weights "
                         f"{', '.join(left)} is still its own (untied) parameter; set model.partitioned_load=false "
                         f"for this model")


def _prevent_arange_dtype_change() -> Any:
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:  # transformers 4: RoPE buffers are built in float32 there anyway
        return contextlib.nullcontext()
    return prevent_arange_dtype_change()


@contextlib.contextmanager
def zero3_construction(ds_config: dict, tied_head_shape: tuple[int, int] | None = None) -> Iterator[None]:
    """Models built inside are partitioned module by module as they are built (`deepspeed.zero.Init`),
    with weight initialisation skipped: transformers' own ZeRO-3 construction (`_from_config` under an
    active HfDeepSpeedConfig) minus its `initialize_weights_zero3`, which would gather every module on
    every rank to initialise weights that the files then overwrite."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    from transformers.modeling_utils import set_zero3_state

    with no_init_weights(), _prevent_arange_dtype_change(), init_without_broadcast(ds_config, None, tied_head_shape), \
            set_zero3_state():
        yield


def _initialize_gathered(module: torch.nn.Module, init_fn: Any) -> None:
    """transformers' `PreTrainedModel.initialize_weights` (post-order over the modules, a sub-model's own
    `_initialize_weights` below it) on ZeRO-3-partitioned modules: each module's parameters (and its direct
    children's, which `_init_weights` may touch) are gathered while `init_fn` runs, on every rank (same
    seed, same draws as the whole build), and rank 0's values kept."""
    import deepspeed
    from transformers import PreTrainedModel

    for child in module.children():
        _initialize_gathered(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init_fn)
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, PreTrainedModel):
            params.extend(child.parameters(recurse=False))
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        init_fn(module, False)


def build_from_config_partitioned(config: Any, ds_config: dict, *, attn_implementation: str, dtype: torch.dtype,
                                  trust_remote_code: bool) -> torch.nn.Module:
    """`AutoModelForCausalLM.from_config(config)` ZeRO-3-partitioned as it is built, with the same weights as
    the whole build after the same `torch.manual_seed` (and the same random state after it): every module is
    constructed whole (torch's default init draws as in the whole build) and partitioned at once, and each
    `post_init` initialises its model's modules one gathered module at a time, at the point where the whole
    build does (a transformers model initialises its inner model inside its own construction)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    import_outside_zero_init(config, attn_implementation=attn_implementation, dtype=dtype,
                             trust_remote_code=trust_remote_code)
    original = PreTrainedModel.init_weights

    def init_weights(model: PreTrainedModel) -> None:  # what PreTrainedModel.init_weights does, gathered
        with torch.no_grad():
            _initialize_gathered(model, model._initialize_weights)
        model.tie_weights(recompute_mapping=False)

    PreTrainedModel.init_weights = init_weights
    try:
        with heap_returned_to_os(), _prevent_arange_dtype_change(), init_without_broadcast(ds_config):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    finally:
        PreTrainedModel.init_weights = original
    return model


def zero3_partition_numel(numel: int, partitions: int) -> int:
    """The elements of each rank's ZeRO-3 partition of a parameter of `numel` elements over `partitions` ranks:
    DeepSpeed 0.19's rule (`partition_parameters.Init._partition_param`: the parameter padded to a multiple of
    the partitions, then split evenly), which DeepSpeed records as `param.ds_tensor.ds_numel`."""
    return -(-numel // partitions)


def zero3_partition_range(numel: int, partition_numel: int, partition_rank: int) -> tuple[int, int]:
    """`[start, stop)` of the flattened parameter (of `numel` elements) that ZeRO-3 partition `partition_rank`
    holds, its partitions `partition_numel` elements each; empty (start >= stop) for a partition of padding only."""
    start = partition_numel * partition_rank
    return start, min(start + partition_numel, numel)


def _fill_partition(param: torch.Tensor, reader: TensorReader, key: str, grown: GrownRows | None) -> None:
    """Write this rank's ZeRO-3 partition of `param` from the file (only its rows are read)."""
    import deepspeed.comm as dist

    shape = full_shape(param)
    numel = full_numel(param)
    rows_total = shape[0] if len(shape) else 1
    row = numel // rows_total
    partition = param.ds_tensor
    size = int(partition.ds_numel)
    start, stop = zero3_partition_range(numel, size, dist.get_rank(group=param.ds_process_group))
    with torch.no_grad():
        partition.zero_()  # the alignment padding past the last element
        if start >= stop:
            return
        if grown is None and reader.dtype(key) == partition.dtype:
            # the partition is a contiguous range of the flattened tensor, so of the file: read it in place
            reader.read_into(key, start, partition.narrow(0, 0, stop - start))
            return
        # rows [first, last) hold the elements [start, stop); read in chunks of about READ_CHUNK_BYTES
        first, last = start // row, -(-stop // row)
        chunk_rows = max(1, READ_CHUNK_BYTES // (row * partition.element_size()))
        for chunk_first in range(first, last, chunk_rows):
            chunk_last = min(chunk_first + chunk_rows, last)
            values = reader.rows(key, chunk_first, chunk_last) if grown is None else grown.rows(chunk_first, chunk_last)
            lo, hi = max(start, chunk_first * row), min(stop, chunk_last * row)
            flat = values.reshape(-1)[lo - chunk_first * row: hi - chunk_first * row]
            partition.narrow(0, lo - start, hi - lo).copy_(flat.to(partition.dtype))
            del values, flat  # before the next read: two read buffers at once were 2 x READ_CHUNK_BYTES of peak


def load_partitioned(folder: str, config: Any, ds_config: dict, *, attn_implementation: str, dtype: torch.dtype,
                     trust_remote_code: bool, row_plan: Any | None = None) -> torch.nn.Module:
    """The causal LM of the local folder `folder`, ZeRO-3-partitioned, each rank holding only its share.

    Args:
        folder: a local Hugging Face model folder with safetensors weights.
        config: its (possibly overridden) transformers config; with `row_plan`, `config.vocab_size` must
            already be the grown row count.
        ds_config: the DeepSpeed config the engine will use (ZeRO-3; its bf16/fp16 set the parameter dtype).
        row_plan: `tokenizer.resize.RowPlan` when the vocabulary grows (new rows per the plan), else None.
    """
    from transformers import AutoModelForCausalLM

    files = safetensors_files(folder)
    import_outside_zero_init(config, attn_implementation=attn_implementation, dtype=dtype,
                             trust_remote_code=trust_remote_code)
    with heap_returned_to_os():
        with zero3_construction(ds_config, _tied_head_shape(config)):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
        model.tie_weights()  # as transformers' ZeRO-3 construction does after building
        _check_tied_head_replaced(model)
        with TensorReader(files) as reader:
            keys, vocab_params = file_keys(model, folder, files, reader, row_plan)
            for name, param in model.named_parameters():
                grown = GrownRows(row_plan, reader, keys[name]) if name in vocab_params else None
                _fill_partition(param, reader, keys[name], grown)
            load_buffers(model, files, reader)
    return model
