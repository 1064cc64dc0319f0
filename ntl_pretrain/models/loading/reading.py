"""Reading safetensors checkpoints by byte range: the file of each tensor, row ranges of a tensor at their
offsets in bounded chunks (dtype converted per chunk), the rows a vocabulary resize adds, and which file
tensor each parameter of a model is (shapes checked): what the ZeRO-3 and the AutoTP loads share."""

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



def read_safetensors_header(path: str) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file: its 8-byte header length, then a JSON mapping of tensor
    name to dtype, shape and data offsets. A file too short for its header, or a header that is not such a mapping,
    is a ValueError naming the file (a truncated download, or not a safetensors file)."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if size < 8 or not 2 <= length <= size - 8:
            raise ValueError(f"{path!r} is not a complete safetensors file ({size} bytes, header length {length}); "
                             f"download it again")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
    if not isinstance(header, dict) or not all(isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= set(entry)
                                               for name, entry in header.items() if name != "__metadata__"):
        raise ValueError(f"{path!r} has no valid safetensors header (truncated or not a safetensors file); download "
                         f"it again")
    data_bytes = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                     default=0)
    if 8 + length + data_bytes > size:
        raise ValueError(f"{path!r} is truncated ({size} bytes, its header describes {8 + length + data_bytes}); "
                         f"download it again")
    return 8 + length, header


def _index_weight_map(index: str) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index: tensor name -> a file name inside the model folder."""
    try:
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()):
        raise ValueError(f"{index!r} is not a safetensors index (a JSON object whose \"weight_map\" maps tensor names "
                         f"to file names); download it again or set model.partitioned_load=false")
    for file in set(weight_map.values()):
        parts = file.replace("\\", "/").split("/")
        if os.path.isabs(file) or not file or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{index!r} names the file {file!r}, which is not a file name inside the model folder; "
                             f"fix the index (its weight_map names shards beside it)")
    return weight_map


def safetensors_files(folder: str) -> dict[str, str]:
    """{tensor name: file path} of a local model folder's safetensors weights (sharded or not).

    Every file the index names is checked now, on every rank and before the model is built: it exists, its header
    is whole, and it holds the tensors the index puts in it (else one ValueError naming the file and the fix)."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        weight_map = _index_weight_map(index)
        names_by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            names_by_file.setdefault(file, []).append(name)
        for file, names in sorted(names_by_file.items()):
            path = os.path.join(folder, file)
            if not os.path.isfile(path):
                raise ValueError(f"{index!r} puts {len(names)} tensors (e.g. {names[0]!r}) in {file!r}, which is not "
                                 f"in {folder!r}: the download is incomplete; download the missing shard again")
            missing = [name for name in names if name not in read_safetensors_header(path)[1]]
            if missing:
                raise ValueError(f"{index!r} puts {missing[0]!r} ({len(missing)} tensors) in {file!r}, which does not "
                                 f"hold it: the index and the shards are from different downloads; download them again")
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, SAFETENSORS_SINGLE)
    if os.path.isfile(single):
        return {name: single for name in read_safetensors_header(single)[1] if name != "__metadata__"}
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


class TensorReader:
    """Row-range reads of tensors spread over safetensors files.

    Reads with plain file reads at the rows' byte offsets (the format is an 8-byte header length, a JSON
    header of dtype, shape and data offsets, then the raw data): a memory map would count every page a
    rank touches in its RSS and keep it mapped until the file is closed.
    """

    def __init__(self, files: dict[str, str], assembled: dict[str, "Assembled"] | None = None) -> None:
        self.files = files
        # parameters the files hold as several tensors, read under the parameter's name (`Assembled`)
        self.assembled: dict[str, Assembled] = dict(assembled or {})
        self._last_assembled: tuple[str, torch.Tensor] | None = None  # the one assembled tensor kept between reads
        self.stack = contextlib.ExitStack()
        self.handles: dict[str, Any] = {}
        self.headers: dict[str, tuple[int, dict]] = {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._last_assembled = None
        self.stack.close()

    def _assembled_value(self, name: str) -> torch.Tensor:
        """The whole assembled tensor `name`: its file tensors read whole and joined by transformers' conversion;
        the last one is kept, so a parameter read in several ranges (ZeRO shares, chunks) is assembled once."""
        if self._last_assembled is None or self._last_assembled[0] != name:
            self._last_assembled = None  # before the next one is built: one assembled tensor at a time
            self._last_assembled = (name, self.assembled[name].value(self))
        return self._last_assembled[1]

    def _entry(self, name: str) -> tuple[Any, int, dict]:
        path = self.files[name]
        if path not in self.handles:
            self.headers[path] = read_safetensors_header(path)
            self.handles[path] = self.stack.enter_context(open(path, "rb"))
        data_start, header = self.headers[path]
        return self.handles[path], data_start, header[name]

    def shape(self, name: str) -> list[int]:
        if name in self.assembled:
            return list(self.assembled[name].shape)
        return list(self._entry(name)[2]["shape"])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` as a 2-D tensor (a 1-D or 0-D tensor's elements are rows of width 1)."""
        if name in self.assembled:
            value = self._assembled_value(name)
            return value.reshape(value.shape[0] if value.dim() else 1, -1)[start:stop]
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

    def dtype(self, name: str) -> torch.dtype | None:
        """The torch dtype of tensor `name` in its file (None for one the partitioned load does not read)."""
        if name in self.assembled:
            return self.dtype(next(iter(self.assembled[name].sources)))
        return _SAFETENSORS_DTYPES.get(self._entry(name)[2]["dtype"])

    def read_into(self, name: str, first_element: int, out: torch.Tensor) -> None:
        """Elements `[first_element, first_element + out.numel())` of tensor `name` (row-major) straight into
        `out`, a contiguous CPU tensor of the file's dtype: one file read, no intermediate buffer (a buffer per
        read, freed and allocated again, fragments the heap: it was up to 0.1x of the model in peak RSS)."""
        if name in self.assembled:
            with torch.no_grad():
                out.view(-1).copy_(self._assembled_value(name).reshape(-1)[first_element:first_element + out.numel()])
            return
        handle, data_start, entry = self._entry(name)
        if out.dtype != _SAFETENSORS_DTYPES.get(entry["dtype"]) or not out.is_contiguous():
            raise ValueError(f"read_into needs a contiguous {entry['dtype']} tensor for {name!r}, got {out.dtype}")
        if not out.numel():
            return
        target = memoryview(out.view(-1).view(torch.uint8).numpy())
        handle.seek(data_start + entry["data_offsets"][0] + first_element * out.element_size())
        if handle.readinto(target) != len(target):
            raise ValueError(f"{self.files[name]!r} is truncated (tensor {name!r}); download it again")

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (for small ones: buffers)."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 1).reshape(shape)


class Assembled:
    """A parameter whose checkpoints hold it as several tensors that transformers' load conversion joins (Qwen3-MoE's
    and Mixtral's fused `experts.gate_up_proj`: one gate and one up projection per expert in the files): read whole
    from those tensors and assembled as `from_pretrained` does (`families.assemble_published`), then sliced or
    partitioned like any file tensor. Costs one whole parameter in memory while it is read (one layer's experts)."""

    def __init__(self, model: torch.nn.Module, name: str, shape: tuple[int, ...], sources: dict[str, str]) -> None:
        self.model, self.name, self.shape = model, name, tuple(shape)
        self.sources = sources  # {file key: the published name transformers' conversion reads it as}

    def value(self, reader: "TensorReader") -> torch.Tensor:
        from ..families import assemble_published

        value = assemble_published(self.model, self.name, {published: reader.tensor(key)
                                                           for key, published in self.sources.items()})
        if tuple(value.shape) != self.shape:
            raise ValueError(f"transformers' conversion of the files' {next(iter(self.sources))!r} ... gives "
                             f"{self.name!r} the shape {tuple(value.shape)}, not the model's {self.shape}; set "
                             f"model.partitioned_load=false")
        return value.contiguous()


def _file_key(name: str, files: dict[str, str], prefix: str) -> str | None:
    """The checkpoint key of model parameter `name` (checkpoints are saved with or without the base prefix)."""
    if name in files:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in files:
        return name[len(prefix) + 1:]
    if prefix and f"{prefix}.{name}" in files:
        return f"{prefix}.{name}"
    return None


class GrownRows:
    """Rows of a vocabulary tensor grown by a `RowPlan`: the file's row of the same index, another file row
    (a new digit copies another spelling), or the mean of the trained rows."""

    def __init__(self, plan: Any, reader: TensorReader, key: str, chunk_rows: int = 4096) -> None:
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


# glibc's mallopt parameters, and the values its dynamic mmap threshold ends at on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX;
# the trim threshold follows it at twice that)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_BUILD_MMAP_THRESHOLD = 2**20
_DYNAMIC_MMAP_THRESHOLD_MAX = 32 * 2**20


@contextlib.contextmanager
def heap_returned_to_os() -> Iterator[None]:
    """Inside: every allocation of 1 MiB or more is its own memory map, returned to the OS when freed; on
    leaving, the heap's free pages are handed back too (glibc; elsewhere nothing changes).

    A build allocates and frees a whole module (or a read buffer) at a time beside the partitions it keeps;
    with glibc's dynamic mmap threshold those come from the heap once a large block has been freed, and the
    heap they fragment stays resident: 0.6x of Qwen2.5-0.5B above its share, from scratch at 2 ranks.
    Setting a threshold fixes it for the process, so on leaving it is set to where the dynamic one ends in
    a process that frees large tensors (32 MiB, trim at 64 MiB) rather than left at 1 MiB for training."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, _BUILD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _DYNAMIC_MMAP_THRESHOLD_MAX)
        mallopt(_M_TRIM_THRESHOLD, 2 * _DYNAMIC_MMAP_THRESHOLD_MAX)
        malloc_trim(0)


def _check_shapes(params: dict[str, torch.Tensor], reader: TensorReader, keys: dict[str, str], grown: set[str],
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


def file_keys(model: torch.nn.Module, folder: str, files: dict[str, str], reader: TensorReader,
              row_plan: Any | None) -> tuple[dict[str, str], set[str]]:
    """{parameter name: file key} for every parameter of `model` (tied ones once) and the names of the
    vocabulary parameters a resize grows; raises naming the fix when a tensor is missing or mis-shaped. A parameter
    the files hold as several tensors is registered in `reader.assembled` and read under its own name."""
    prefix = getattr(model, "base_model_prefix", "")
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    keys = {name: key for name in params if (key := _file_key(name, files, prefix)) is not None}
    if len(keys) < len(params):  # a family whose checkpoints use other names (GPT-NeoX: embed_out for lm_head) or
        # several tensors for one parameter (Qwen3-MoE: one per expert for the fused experts)
        from ..families import published_layouts

        layouts = published_layouts(model, {name: full_shape(p) for name, p in params.items() if name not in keys})
        for name, layout in layouts.items():
            found = {published: _file_key(published, files, prefix) for published in layout}
            if None in found.values():
                continue
            for published, key in found.items():
                if reader.shape(key) != list(layout[published]):
                    raise ValueError(f"model.name_or_path: tensor {key!r} has shape {reader.shape(key)} in the files "
                                     f"but the model built from its config expects {list(layout[published])}; the "
                                     f"config does not match the weights (model.architecture overrides?)")
            if len(found) == 1 and next(iter(layout.values())) == tuple(full_shape(params[name])):
                keys[name] = next(iter(found.values()))  # renamed only
            else:
                reader.assembled[name] = Assembled(model, name, tuple(full_shape(params[name])),
                                                   {key: published for published, key in found.items()})
                keys[name] = name
    missing = sorted(set(params) - set(keys))
    head = model.get_output_embeddings()
    if missing and head is not None and [name for name in missing if params[name] is head.weight] == missing:
        # not a naming problem: transformers' own load would start the head from random values (with a report)
        raise ValueError(f"model.name_or_path={folder!r}: the safetensors files hold no output head ({missing[0]}) "
                         f"but the config has tie_word_embeddings=false; if the checkpoint ties its head to the "
                         f"input embedding, set model.architecture.tie_word_embeddings=true, else the files are "
                         f"incomplete (download them again)")
    if missing:
        raise ValueError(f"model.name_or_path={folder!r}: the safetensors files hold no tensor for the model's "
                         f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}; this checkpoint needs "
                         f"transformers' own loading: set model.partitioned_load=false")
    vocab_params = _vocab_parameter_names(model, params) if row_plan is not None else set()
    _check_shapes(params, reader, keys, vocab_params, row_plan.old_rows if row_plan else None)
    return keys, vocab_params


def load_buffers(model: torch.nn.Module, files: dict[str, str], reader: TensorReader) -> None:
    """Persistent buffers that the files hold (not partitioned; e.g. none for Llama or Qwen2)."""
    prefix = getattr(model, "base_model_prefix", "")
    for name, buffer in model.named_buffers():
        key = _file_key(name, files, prefix)
        if key is not None:
            with torch.no_grad():
                buffer.copy_(reader.tensor(key).to(buffer.dtype))
