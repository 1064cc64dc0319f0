"""Partitioned model loading under ZeRO-3: each rank holds only its share of the weights.

The plain path (`from_pretrained` on every rank) gives every rank the whole model before
`deepspeed.initialize` partitions it: memory-mapped when the files' dtype is the training dtype (its
pages become resident as `deepspeed.initialize` broadcasts and partitions each parameter), a converted
copy in memory otherwise (e.g. fp32 or fp16 files trained in bf16), so 8 ranks hold 8 copies. Here:

1. the model is constructed under `deepspeed.zero.Init` as transformers does under ZeRO-3, without
   weight initialisation (each module is partitioned as soon as it is built: only one module is ever
   whole), and
2. each rank reads from the safetensors files only the elements of its own ZeRO-3 partition of each
   parameter (a row range read at its byte offset, at most two rows more than its share) and writes
   them into `param.ds_tensor`; no parameter is gathered and no rank reads the full file.

Vocabulary growth (`model.resize_embeddings`) is done while reading: the embedding (and untied head)
are constructed with the padded row count and each rank fills its rows with the file's row, the row of
another spelling of a new digit, or the mean of the trained rows, with the same plan as
`tokenizer.resize.resize_model_embeddings` (`plan_new_rows`).

`deepspeed.initialize` accepts the partitioned model as it is (it skips parameters that already have a
`ds_id`).

With tensor parallelism (AutoTP, T > 1) DeepSpeed 0.19 shards the model inside `deepspeed.initialize`
and has no pre-sharded entry point (`deepspeed.tp_model_init` only records arguments; a model built
under `zero.Init` is gathered module by module in `AutoTP._gather_zero3_params`, each rank then holding
its ZeRO share *and* its TP slice). Its layers do keep meta tensors on meta (`TensorParallel_Layer.move`),
slicing only their shape, and record each slice in `ds_autotp_uc_meta` (partition dim and sizes). So the
model's linear and embedding weights are built on the meta device (everything else, small, is read
whole), DeepSpeed's own AutoTP decides every slice, and right after it (a wrapper around
`DeepSpeedEngine._configure_tensor_parallel`, before ZeRO-3 partitions the slices over the data-parallel
group) each rank reads from the files exactly the rows/columns of its slices. No rank holds more than
its TP slice of any weight (1/T of the model); the vocabulary resize and padding happen while reading.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
READ_CHUNK_BYTES = 64 * 2**20  # the largest read at once: bounds the transient above the rank's share


def partitioned_load_applies(ds_config: dict | None, tp_size: int) -> bool:
    """True when the model can be loaded partitioned: under ZeRO-3, its ZeRO share (T=1) or its AutoTP slice
    (T>1, the DeepSpeed config's `tensor_parallel.autotp_size`)."""
    if ds_config is None or int(ds_config.get("zero_optimization", {}).get("stage", 0)) != 3:
        return False
    return tp_size == 1 or int(ds_config.get("tensor_parallel", {}).get("autotp_size", 0) or 1) == tp_size


def _init_without_broadcast(ds_config: dict, data_parallel_group: Any = None) -> Any:
    """A `deepspeed.zero.Init` context that partitions each parameter as it is built without first
    broadcasting rank 0's values: every rank builds the same values (same seed), or the files overwrite
    them; a full tensor that is allocated but never written never becomes resident."""
    import deepspeed

    class InitWithoutBroadcast(deepspeed.zero.Init):
        def _zero_init_param(self, param: torch.nn.Parameter) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return InitWithoutBroadcast(config_dict_or_path=ds_config, data_parallel_group=data_parallel_group)


def _prevent_arange_dtype_change() -> Any:
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:  # transformers 4: RoPE buffers are built in float32 there anyway
        return contextlib.nullcontext()
    return prevent_arange_dtype_change()


@contextlib.contextmanager
def zero3_construction(ds_config: dict) -> Iterator[None]:
    """Models built inside are partitioned module by module as they are built (`deepspeed.zero.Init`),
    with weight initialisation skipped: transformers' own ZeRO-3 construction (`_from_config` under an
    active HfDeepSpeedConfig) minus its `initialize_weights_zero3`, which would gather every module on
    every rank to initialise weights that the files then overwrite."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    from transformers.modeling_utils import set_zero3_state

    with no_init_weights(), _prevent_arange_dtype_change(), _init_without_broadcast(ds_config), set_zero3_state():
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

    original = PreTrainedModel.init_weights

    def init_weights(model: PreTrainedModel) -> None:  # what PreTrainedModel.init_weights does, gathered
        with torch.no_grad():
            _initialize_gathered(model, model._initialize_weights)
        model.tie_weights(recompute_mapping=False)

    PreTrainedModel.init_weights = init_weights
    try:
        with _prevent_arange_dtype_change(), _init_without_broadcast(ds_config):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    finally:
        PreTrainedModel.init_weights = original
    _release_freed_heap()
    return model


def safetensors_files(folder: str) -> dict[str, str]:
    """{tensor name: file path} of a local model folder's safetensors weights (sharded or not)."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        with open(single, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        return {name: single for name in header if name != "__metadata__"}
    raise ValueError(f"model.name_or_path={folder!r} holds no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}: the "
                     f"partitioned ZeRO-3 load reads safetensors weights; convert the checkpoint (save_pretrained "
                     f"with safe_serialization) or set model.partitioned_load=false")


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's full shape, also when ZeRO-3 has partitioned it (then `param.shape` is empty)."""
    return getattr(param, "ds_shape", param.shape)


def full_numel(param: torch.Tensor) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class _Reader:
    """Row-range reads of tensors spread over safetensors files.

    Reads with plain file reads at the rows' byte offsets (the format is an 8-byte header length, a JSON
    header of dtype, shape and data offsets, then the raw data): a memory map would count every page a
    rank touches in its RSS and keep it mapped until the file is closed.
    """

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.stack = contextlib.ExitStack()
        self.handles: dict[str, Any] = {}
        self.headers: dict[str, tuple[int, dict]] = {}

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()

    def _entry(self, name: str) -> tuple[Any, int, dict]:
        path = self.files[name]
        if path not in self.handles:
            handle = self.stack.enter_context(open(path, "rb"))
            length = int.from_bytes(handle.read(8), "little")
            self.handles[path] = handle
            self.headers[path] = (8 + length, json.loads(handle.read(length)))
        data_start, header = self.headers[path]
        return self.handles[path], data_start, header[name]

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)[2]["shape"])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` as a 2-D tensor (a 1-D or 0-D tensor's elements are rows of width 1)."""
        handle, data_start, entry = self._entry(name)
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {self.files[name]!r} has dtype {entry['dtype']}, which the "
                             f"partitioned load does not read; set model.partitioned_load=false")
        shape = entry["shape"]
        row_elements = math.prod(shape[1:]) if len(shape) > 1 else 1
        row_bytes = row_elements * torch.empty((), dtype=dtype).element_size()
        buffer = bytearray((stop - start) * row_bytes)
        handle.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
        if handle.readinto(buffer) != len(buffer):
            raise ValueError(f"{self.files[name]!r} is truncated (tensor {name!r}); download it again")
        if not buffer:
            return torch.empty(0, row_elements, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(stop - start, row_elements)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (for small ones: buffers)."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 1).reshape(shape)


def _file_key(name: str, files: dict[str, str], prefix: str) -> str | None:
    """The checkpoint key of model parameter `name` (checkpoints are saved with or without the base prefix)."""
    if name in files:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in files:
        return name[len(prefix) + 1:]
    if prefix and f"{prefix}.{name}" in files:
        return f"{prefix}.{name}"
    return None


class _GrownRows:
    """Rows of a vocabulary tensor grown by a `RowPlan`: the file's row of the same index, another file row
    (a new digit copies another spelling), or the mean of the trained rows."""

    def __init__(self, plan: Any, reader: _Reader, key: str, chunk_rows: int = 4096) -> None:
        self.plan, self.reader, self.key = plan, reader, key
        self.mean_rows = set(plan.mean_rows)
        # the mean of the trained rows, read in chunks, accumulated in float32 (as the in-memory resize does)
        trained = torch.tensor(plan.trained, dtype=torch.long)
        total = 0.0
        for start in range(0, plan.old_rows, chunk_rows):
            stop = min(start + chunk_rows, plan.old_rows)
            chosen = trained[(trained >= start) & (trained < stop)] - start
            if len(chosen):
                total = total + reader.rows(key, start, stop)[chosen].float().sum(dim=0)
        self.mean = total / len(plan.trained)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the grown tensor."""
        file_stop = min(stop, self.plan.old_rows)
        if start < file_stop:
            out = self.reader.rows(self.key, start, file_stop)
            if stop > file_stop:
                out = torch.cat([out, out.new_empty(stop - file_stop, out.shape[1])])
        else:
            out = self.mean.new_empty(stop - start, self.mean.numel())
        for row in range(start, stop):
            if row in self.plan.copy_from:
                source = self.plan.copy_from[row]
                out[row - start] = self.reader.rows(self.key, source, source + 1)[0]
            elif row in self.mean_rows:
                out[row - start] = self.mean.to(out.dtype)
        return out


def _fill_partition(param: torch.Tensor, reader: _Reader, key: str, grown: _GrownRows | None) -> None:
    """Write this rank's ZeRO-3 partition of `param` from the file (only its rows are read)."""
    import deepspeed.comm as dist

    shape = full_shape(param)
    numel = full_numel(param)
    rows_total = shape[0] if len(shape) else 1
    row = numel // rows_total
    partition = param.ds_tensor
    size = int(partition.ds_numel)
    start = size * dist.get_rank(group=param.ds_process_group)
    stop = min(start + size, numel)
    with torch.no_grad():
        partition.zero_()  # the alignment padding past the last element
        if start >= stop:
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


def _check_shapes(params: dict[str, torch.Tensor], reader: _Reader, keys: dict[str, str], grown: set[str],
                  old_rows: int | None) -> None:
    """Every file tensor has its parameter's shape (a grown vocabulary tensor: `old_rows` rows in the file)."""
    for name, param in params.items():
        expected = list(full_shape(param))
        if name in grown:
            expected[0] = old_rows
        found = reader.shape(keys[name])
        if expected != found:
            raise ValueError(f"model.name_or_path: tensor {keys[name]!r} has shape {found} in the files but the model "
                             f"built from its config expects {expected}; the config does not match the weights "
                             f"(model.architecture overrides?)")


def _vocab_parameter_names(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> set[str]:
    """Names of the parameters of the input embedding and the output head (the rows a resize grows)."""
    modules = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    return {name for name, p in params.items()
            if any(p is m.weight or p is getattr(m, "bias", None) for m in modules)}


def _file_keys(model: torch.nn.Module, folder: str, files: dict[str, str], reader: _Reader,
               row_plan: Any | None) -> tuple[dict[str, str], set[str]]:
    """{parameter name: file key} for every parameter of `model` (tied ones once) and the names of the
    vocabulary parameters a resize grows; raises naming the fix when a tensor is missing or mis-shaped."""
    prefix = getattr(model, "base_model_prefix", "")
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    keys = {name: key for name in params if (key := _file_key(name, files, prefix)) is not None}
    missing = sorted(set(params) - set(keys))
    if missing:
        raise ValueError(f"model.name_or_path={folder!r}: the safetensors files hold no tensor for the model's "
                         f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}; this checkpoint needs "
                         f"transformers' own loading: set model.partitioned_load=false")
    vocab_params = _vocab_parameter_names(model, params) if row_plan is not None else set()
    _check_shapes(params, reader, keys, vocab_params, row_plan.old_rows if row_plan else None)
    return keys, vocab_params


def _load_buffers(model: torch.nn.Module, files: dict[str, str], reader: _Reader) -> None:
    """Persistent buffers that the files hold (not partitioned; e.g. none for Llama or Qwen2)."""
    prefix = getattr(model, "base_model_prefix", "")
    for name, buffer in model.named_buffers():
        key = _file_key(name, files, prefix)
        if key is not None:
            with torch.no_grad():
                buffer.copy_(reader.tensor(key).to(buffer.dtype))


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
    with zero3_construction(ds_config):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()  # as transformers' ZeRO-3 construction does after building
    with _Reader(files) as reader:
        keys, vocab_params = _file_keys(model, folder, files, reader, row_plan)
        for name, param in model.named_parameters():
            grown = _GrownRows(row_plan, reader, keys[name]) if name in vocab_params else None
            _fill_partition(param, reader, keys[name], grown)
        _load_buffers(model, files, reader)
    _release_freed_heap()
    return model


# ------------------------------------------------------------------------------ AutoTP (T > 1): slices
PENDING_TP_LOAD = "_ntl_pending_tp_load"  # the model attribute the fill after AutoTP reads (and removes)


@contextlib.contextmanager
def sliced_parameters_on_meta() -> Iterator[None]:
    """The weights (and biases) of every `nn.Linear` and `nn.Embedding` built inside are meta tensors (no
    storage); every other parameter and every buffer is built on CPU as usual (RoPE tables are computed in
    `__init__`, norms are small). The meta ones are the parameters AutoTP may slice."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


class _PendingTPLoad:
    """What the fill after AutoTP needs: the files, the file key of each parameter, the resize plan."""

    def __init__(self, folder: str, files: dict[str, str], keys: dict[str, str], vocab_params: set[str],
                 row_plan: Any | None, ds_config: dict) -> None:
        self.folder, self.files, self.keys, self.vocab_params, self.row_plan = folder, files, keys, vocab_params, row_plan
        self.ds_config = ds_config


def load_tp_sliced(folder: str, config: Any, ds_config: dict, *, attn_implementation: str, dtype: torch.dtype,
                   trust_remote_code: bool, row_plan: Any | None = None) -> torch.nn.Module:
    """The causal LM of the local folder `folder` with its linear and embedding weights on the meta device,
    to be handed to `deepspeed.initialize` with AutoTP (T>1): right after DeepSpeed's AutoTP has sliced
    it, each rank reads its slices from the files (`fill_tp_slices`). Arguments as for `load_partitioned`.
    """
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    files = safetensors_files(folder)
    with no_init_weights(), sliced_parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()
    with _Reader(files) as reader:
        keys, vocab_params = _file_keys(model, folder, files, reader, row_plan)
        for name, param in model.named_parameters():  # the parameters AutoTP never slices: read whole now
            if not param.is_meta:
                grown = _GrownRows(row_plan, reader, keys[name]) if name in vocab_params else None
                _fill_slice(param, reader, keys[name], grown, None)
        _load_buffers(model, files, reader)
    setattr(model, PENDING_TP_LOAD, _PendingTPLoad(folder, files, keys, vocab_params, row_plan, ds_config))
    _install_fill_after_autotp()
    return model


def _tp_slice(param: torch.Tensor, name: str, tp_rank: int) -> tuple[int, int, int] | None:
    """(dim, start, size) of the full tensor that AutoTP gave this rank as `param`, from the layout DeepSpeed
    records on each sliced parameter (`ds_autotp_uc_meta`); None when it is replicated (not sliced)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(param, DS_AUTOTP_UC_META, None)
    if not meta or meta.get("replicated"):
        return None
    if meta.get("sub_param_sizes") or meta.get("sub_param_shard_widths") or meta.get("partition_dim") is None \
            or not meta.get("partition_sizes"):
        raise ValueError(f"AutoTP sliced {name!r} as a fused or reshaped parameter ({meta.get('partition_type')}), "
                         f"which the sliced load does not read; set model.partitioned_load=false")
    dim, sizes = int(meta["partition_dim"]), [int(n) for n in meta["partition_sizes"]]
    if tuple(param.shape)[dim] != sizes[tp_rank]:
        raise ValueError(f"AutoTP gave {name!r} the shape {tuple(param.shape)}, not the {sizes[tp_rank]} elements "
                         f"along dim {dim} its layout records; set model.partitioned_load=false")
    return dim, sum(sizes[:tp_rank]), sizes[tp_rank]


def _fill_slice(param: torch.Tensor, reader: _Reader, key: str, grown: _GrownRows | None,
                tp_slice: tuple[int, int, int] | None) -> torch.Tensor:
    """`param`'s values (a CPU tensor of its shape and dtype) read from the file: the whole tensor, or the
    slice `tp_slice` = (dim, start, size) of it (rows for dim 0; for dim 1, the columns of row chunks of about
    READ_CHUNK_BYTES). Written into `param` when it has storage; returned either way."""
    out = param.data if not param.is_meta else torch.empty(param.shape, dtype=param.dtype)
    rows_total = out.shape[0] if out.dim() else 1
    dim, start, size = tp_slice if tp_slice is not None else (0, 0, rows_total)
    if dim not in (0, 1) or (dim == 1 and out.dim() != 2):
        raise ValueError(f"tensor {key!r} is sliced along dim {dim} of {out.dim()}; set model.partitioned_load=false")
    first, last = (start, start + size) if dim == 0 else (0, rows_total)
    flat = out.view(rows_total if dim == 1 else size, -1)
    file_row = math.prod(reader.shape(key)[1:])  # elements of one row as read (the full width)
    chunk_rows = max(1, READ_CHUNK_BYTES // (file_row * out.element_size()))
    with torch.no_grad():
        for chunk_first in range(first, last, chunk_rows):
            chunk_last = min(chunk_first + chunk_rows, last)
            values = reader.rows(key, chunk_first, chunk_last) if grown is None else grown.rows(chunk_first, chunk_last)
            if dim == 1:
                values = values.narrow(1, start, size)
            flat[chunk_first - first: chunk_last - first].copy_(values.to(out.dtype))
    return out


def fill_tp_slices(model: torch.nn.Module) -> None:
    """Give every meta parameter of `model`, as DeepSpeed's AutoTP left it, this rank's values from the files.

    Runs inside `deepspeed.initialize`, after AutoTP and before ZeRO partitions the parameters (and before
    the engine reads `model.parameters()`). Each meta parameter is replaced by one with values and the same
    attributes in every module that holds it (tied modules included)."""
    from deepspeed.utils import groups

    pending: _PendingTPLoad = getattr(model, PENDING_TP_LOAD)
    tp_rank = groups.get_tensor_model_parallel_rank()
    dp_group = groups.get_data_parallel_group()  # the group ZeRO-3 partitions over (the engine passes groups as mpu)
    # with data parallelism inside the TP group (world > T), each slice is ZeRO-partitioned over the DP group as
    # soon as it is read, as ZeRO-3 would partition it in deepspeed.initialize (which skips parameters that
    # already have a ds_id), so no rank holds more than one whole slice at a time
    zero_init = None
    if torch.distributed.get_world_size(dp_group) > 1:
        zero_init = _init_without_broadcast(pending.ds_config, data_parallel_group=dp_group)
    with _Reader(pending.files) as reader:
        for name, param in model.named_parameters():
            if not param.is_meta:
                continue
            if name not in pending.keys:
                raise ValueError(f"AutoTP made a parameter {name!r} that the files do not hold; set "
                                 f"model.partitioned_load=false")
            if param._backward_hooks:
                raise ValueError(f"AutoTP registered a gradient hook on {name!r} before its values were read, which "
                                 f"the sliced load would drop; set model.partitioned_load=false")
            key = pending.keys[name]
            grown = _GrownRows(pending.row_plan, reader, key) if name in pending.vocab_params else None
            values = torch.nn.Parameter(_fill_slice(param, reader, key, grown, _tp_slice(param, name, tp_rank)),
                                        requires_grad=param.requires_grad)
            values.__dict__.update(param.__dict__)  # AutoTP's attributes (its gather functions, the layout)
            _replace_parameter(model, param, values, name)
            if zero_init is not None:
                zero_init._zero_init_param(values)
    delattr(model, PENDING_TP_LOAD)
    _release_freed_heap()


def _replace_parameter(model: torch.nn.Module, old: torch.nn.Parameter, new: torch.nn.Parameter, name: str) -> None:
    """`new` in place of `old` in every module of `model` that holds it (a tied head and embedding share one)."""
    from deepspeed.utils import debug

    for module in model.modules():
        for attribute, param in module._parameters.items():
            if param is old:
                module._parameters[attribute] = new
    debug.param_names[new] = name  # DeepSpeed's name map for its messages (taken at engine start)


_FILL_INSTALLED = False


def _install_fill_after_autotp() -> None:
    """Wrap `DeepSpeedEngine._configure_tensor_parallel` (DeepSpeed 0.19: AutoTP's slicing inside
    `deepspeed.initialize`, before ZeRO) so that a model built by `load_tp_sliced` gets its values right
    after AutoTP sliced it; any other model passes through unchanged. Installed once per process."""
    global _FILL_INSTALLED
    if _FILL_INSTALLED:
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    configure = getattr(DeepSpeedEngine, "_configure_tensor_parallel", None)
    if configure is None:
        raise ValueError("this DeepSpeed has no DeepSpeedEngine._configure_tensor_parallel, where the sliced AutoTP "
                         "load reads the weights (written for DeepSpeed 0.19); set model.partitioned_load=false")

    def configure_then_fill(engine: Any, model: torch.nn.Module, tp_config: Any) -> Any:
        result = configure(engine, model, tp_config)
        if hasattr(model, PENDING_TP_LOAD):
            fill_tp_slices(model)
        return result

    DeepSpeedEngine._configure_tensor_parallel = configure_then_fill
    _FILL_INSTALLED = True


def _release_freed_heap() -> None:
    """Hand the heap pages freed while building (reads, module by module construction) back to the OS, so
    they do not add to the RSS that `deepspeed.initialize` then builds on (glibc; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_pretrained_partitioned(cfg: Any, config: Any, tokenizer: Any, ds_config: dict, tp_size: int, *,
                                attn_implementation: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any | None]:
    """`model.name_or_path` loaded partitioned (T=1: each rank's ZeRO-3 share, `load_partitioned`; T>1: each
    rank's AutoTP slices, `load_tp_sliced`), its vocabulary grown to hold `tokenizer` (padded to a multiple of
    lcm(`pad_vocab_to_multiple_of`, T)) when `model.resize_embeddings` asks, as `model.build_model` does on
    the full model.

    Returns the model and the `ResizeReport` (None when nothing was resized).
    """
    from .tokenizer.resize import plan_new_rows

    folder = os.path.expanduser(cfg.name_or_path)
    if not os.path.isdir(folder):  # a hub id: the same files from_pretrained would fetch, into the HF cache
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])
    old_rows = int(config.vocab_size)
    plan = None
    if cfg.resize_embeddings and len(tokenizer) > old_rows:
        plan = plan_new_rows(tokenizer, old_rows, math.lcm(cfg.pad_vocab_to_multiple_of, tp_size))
        plan.check_mean()
        config.vocab_size = plan.new_rows
    if tp_size == 1:
        model = load_partitioned(folder, config, ds_config, attn_implementation=attn_implementation, dtype=dtype,
                                 trust_remote_code=cfg.trust_remote_code, row_plan=plan)
    else:
        model = load_tp_sliced(folder, config, ds_config, attn_implementation=attn_implementation, dtype=dtype,
                               trust_remote_code=cfg.trust_remote_code, row_plan=plan)
    if plan is None:
        return model, None
    input_embeddings, output_embeddings = model.get_input_embeddings(), model.get_output_embeddings()
    tied = output_embeddings is not None and output_embeddings.weight is input_embeddings.weight
    return model, plan.report("mean", tied, tokenizer)
