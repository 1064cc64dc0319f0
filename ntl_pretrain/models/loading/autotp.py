"""AutoTP (T > 1) under ZeRO-3: linear and embedding weights built on the meta device, DeepSpeed's AutoTP
decides every slice inside `deepspeed.initialize`, then each rank reads exactly the rows/columns of its
slices from the files (before ZeRO-3 partitions them over the data-parallel group)."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator

import torch

from .reading import (
    READ_CHUNK_BYTES,
    Assembled,
    GrownRows,
    TensorReader,
    file_keys,
    heap_returned_to_os,
    load_buffers,
    safetensors_files,
)
from .zero3 import init_without_broadcast

logger = logging.getLogger(__name__)



PENDING_TP_LOAD = "_ntl_pending_tp_load"  # the model attribute the fill after AutoTP reads (and removes)


@contextlib.contextmanager
def sliced_parameters_on_meta() -> Iterator[None]:
    """The weights (and biases) of every `nn.Linear` and `nn.Embedding` built inside, and every parameter of three
    or more dimensions (the fused experts of an MoE, which AutoTP leaves whole), are meta tensors (no storage);
    every other parameter and every buffer is built on CPU as usual (RoPE tables are computed in `__init__`, norms
    are small). The meta ones are read after AutoTP: the ones it slices as this rank's slices, the others whole
    (and ZeRO-partitioned over the data-parallel group as soon as each is read)."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and (isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                                                        or param.dim() >= 3):
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
                 row_plan: Any | None, ds_config: dict, buffers: dict[str, torch.Tensor],
                 assembled: dict[str, Assembled]) -> None:
        self.folder, self.files, self.keys, self.vocab_params, self.row_plan = folder, files, keys, vocab_params, row_plan
        self.assembled = assembled  # the parameters the files hold as several tensors (`reading.Assembled`)
        self.ds_config = ds_config
        self.buffers = buffers  # every buffer by name, before AutoTP (its layers may copy one onto the meta device)


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
    with TensorReader(files) as reader:
        keys, vocab_params = file_keys(model, folder, files, reader, row_plan)
        for name, param in model.named_parameters():  # the parameters AutoTP never slices: read whole now
            if not param.is_meta:
                grown = GrownRows(row_plan, reader, keys[name]) if name in vocab_params else None
                _fill_slice(param, reader, keys[name], grown, None)
        load_buffers(model, files, reader)
        assembled = reader.assembled
    buffers = dict(model.named_buffers(remove_duplicate=False))
    setattr(model, PENDING_TP_LOAD, _PendingTPLoad(folder, files, keys, vocab_params, row_plan, ds_config, buffers,
                                                   assembled))
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


def _tp_pieces(param: torch.Tensor, name: str, tp_rank: int) -> list[tuple[int, int, int]] | None:
    """The ranges (dim, start, size) of the full tensor that AutoTP gave this rank as `param`, in `param`'s order:
    one for a plain split; one per sub-parameter of a fused one split along dim 0 (Phi-3's gate_up_proj: this rank's
    rows of the gate half, then of the up half), from DeepSpeed's recorded `sub_param_sizes` and per-rank widths;
    None when it is replicated."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(param, DS_AUTOTP_UC_META, None) or {}
    sizes, widths = meta.get("sub_param_sizes"), meta.get("sub_param_shard_widths")
    if meta.get("replicated") or not sizes or not widths or meta.get("partition_dim") != 0:
        single = _tp_slice(param, name, tp_rank)  # plain, replicated, or a fused layout it refuses
        return None if single is None else [single]
    pieces, offset = [], 0
    for size, per_rank in zip(sizes, widths, strict=True):
        pieces.append((0, offset + sum(int(n) for n in per_rank[:tp_rank]), int(per_rank[tp_rank])))
        offset += int(size)
    if offset != tuple(meta.get("original_shape") or (offset,))[0] or sum(p[2] for p in pieces) != param.shape[0]:
        raise ValueError(f"AutoTP gave {name!r} the shape {tuple(param.shape)}, not the sum of its sub-parameters' "
                         f"slices {pieces}; set model.partitioned_load=false")
    return pieces


def _fill_pieces(param: torch.Tensor, reader: TensorReader, key: str, grown: GrownRows | None,
                 pieces: list[tuple[int, int, int]] | None) -> torch.Tensor:
    """`_fill_slice` for the ranges `pieces` of the file's tensor (`_tp_pieces`), read one after the other into
    consecutive rows of `param`'s values; None: the whole tensor."""
    if pieces is None or len(pieces) == 1:
        return _fill_slice(param, reader, key, grown, pieces[0] if pieces else None)
    out = param.data if not param.is_meta else torch.empty(param.shape, dtype=param.dtype)
    row = 0
    for dim, start, size in pieces:
        if size:
            _fill_slice(out.narrow(0, row, size), reader, key, grown, (dim, start, size))
        row += size
    return out


def _fill_slice(param: torch.Tensor, reader: TensorReader, key: str, grown: GrownRows | None,
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
    if grown is None and reader.dtype(key) == out.dtype and out.is_contiguous():
        # straight from the file into the slice: rows [start, start + size) are one range; a column slice is
        # one range per row
        with torch.no_grad():
            if dim == 0:
                reader.read_into(key, start * file_row, out)
            else:
                for row in range(rows_total):
                    reader.read_into(key, row * file_row + start, out[row])
        return out
    chunk_rows = max(1, READ_CHUNK_BYTES // (file_row * out.element_size()))
    with torch.no_grad():
        for chunk_first in range(first, last, chunk_rows):
            chunk_last = min(chunk_first + chunk_rows, last)
            values = reader.rows(key, chunk_first, chunk_last) if grown is None else grown.rows(chunk_first, chunk_last)
            if dim == 1:
                values = values.narrow(1, start, size)
            flat[chunk_first - first: chunk_last - first].copy_(values.to(out.dtype))
            del values  # before the next read: two read buffers at once were 2 x READ_CHUNK_BYTES of peak
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
        zero_init = init_without_broadcast(pending.ds_config, data_parallel_group=dp_group)
    with heap_returned_to_os(), TensorReader(pending.files, pending.assembled) as reader:
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
            grown = GrownRows(pending.row_plan, reader, key) if name in pending.vocab_params else None
            values = torch.nn.Parameter(_fill_pieces(param, reader, key, grown, _tp_pieces(param, name, tp_rank)),
                                        requires_grad=param.requires_grad)
            values.__dict__.update(param.__dict__)  # AutoTP's attributes (its gather functions, the layout)
            _replace_parameter(model, param, values, name)
            if zero_init is not None:
                zero_init._zero_init_param(values)
    _restore_meta_buffers(model, pending.buffers)
    delattr(model, PENDING_TP_LOAD)


def _restore_meta_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Give the buffers AutoTP's layers left on the meta device the values they had before it: its
    vocabulary-parallel embedding copies a scaled embedding's `embed_scale` (Gemma) to its weight's device,
    which is meta until the fill."""
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_meta:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            if full_name not in buffers or buffers[full_name].is_meta:
                raise ValueError(f"AutoTP left the buffer {full_name!r} without values, which the sliced load does not "
                                 f"hold; set model.partitioned_load=false")
            module._buffers[name] = buffers[full_name].clone()


def _replace_parameter(model: torch.nn.Module, old: torch.nn.Parameter, new: torch.nn.Parameter, name: str) -> None:
    """`new` in place of `old` in every module of `model` that holds it (a tied head and embedding share one)."""
    from deepspeed.utils import debug

    for module in model.modules():
        for attribute, param in module._parameters.items():
            if param is old:
                module._parameters[attribute] = new
    debug.param_names[new] = name  # DeepSpeed's name map for its messages (taken at engine start)


_FILL_INSTALLED = False
_FILL_ASSUMES = ("the sliced AutoTP load (models/loading/autotp.py) reads each rank's weights right after "
                 "DeepSpeedEngine._configure_tensor_parallel sliced the model, inside deepspeed.initialize; set "
                 "model.partitioned_load=false or use the DeepSpeed of constraints.txt")


def _install_fill_after_autotp() -> None:
    """Wrap `DeepSpeedEngine._configure_tensor_parallel` (DeepSpeed 0.19: AutoTP's slicing inside
    `deepspeed.initialize`, before ZeRO) so that a model built by `load_tp_sliced` gets its values right
    after AutoTP sliced it; any other model passes through unchanged. Installed once per process; what it assumes
    is checked by behaviour where it matters: the wrapped method must leave AutoTP's layout on the parameters
    (`_check_autotp_sliced`), and `deepspeed.initialize` must have run it (`check_tp_load_filled`)."""
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
            _check_autotp_sliced(model)
            fill_tp_slices(model)
        return result

    DeepSpeedEngine._configure_tensor_parallel = configure_then_fill
    _FILL_INSTALLED = True


def _check_autotp_sliced(model: torch.nn.Module) -> None:
    """The wrapped method did AutoTP's slicing: some parameter carries the layout DeepSpeed records on a slice."""
    import deepspeed
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    metas = [getattr(param, DS_AUTOTP_UC_META, None) for param in model.parameters()]
    if not any(meta and not meta.get("replicated") for meta in metas):
        raise RuntimeError(f"DeepSpeed {deepspeed.__version__}: DeepSpeedEngine._configure_tensor_parallel returned "
                           f"with no parameter sliced (none carries {DS_AUTOTP_UC_META}), but {_FILL_ASSUMES}")


def check_tp_load_filled(model: torch.nn.Module) -> None:
    """After `deepspeed.initialize`: a model of `load_tp_sliced` got its values (the wrapped method ran inside it)."""
    import deepspeed

    if hasattr(model, PENDING_TP_LOAD):
        raise RuntimeError(f"DeepSpeed {deepspeed.__version__}: deepspeed.initialize returned without calling "
                           f"DeepSpeedEngine._configure_tensor_parallel on the model, but {_FILL_ASSUMES}")
