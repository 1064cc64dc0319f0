"""Export of a checkpoint (any ZeRO stage 0-3, any TP size) as a Hugging Face model folder, and the assets
every checkpoint carries so that it exports on its own.

The export reads only the model weights: the fp32 master partitions of the optimizer files (never the Adam
moments), memory-mapped, one parameter at a time; it joins a parameter's ZeRO partitions, merges its
tensor-parallel slices with DeepSpeed's own merge (`ds_to_universal.merge_tp_slices`, the code of a universal
conversion) and streams it into the safetensors shard it belongs to. Nothing is written besides the export's
own `.partial` folder, and memory stays near one parameter plus the file pages read since the last release.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import json
import logging
import math
import os
import re
import shutil
import stat
import struct
import time
from typing import Any, Callable, Iterator

import torch

from ..core.fs import apply_umask_modes, commit_directory, is_full_disk, write_json_atomic
from .format import (HF_DIR, STAGING_MARKER, STAGING_SUFFIX, CheckpointError, check_not_a_link, check_output_outside,
                     folder_bytes)
from .integrity import verify_checkpoint
from .safe_loading import safe_load
from .staging import make_staging, remove_staging

logger = logging.getLogger("ntl_pretrain")

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # deepspeed.checkpoint.constants (imported lazily: slow)
MAPPED_READ_BUDGET = 64 * 2**20  # bytes read from memory-mapped files before their maps are dropped
_RANK_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")


def write_hf_assets(folder: str, model_config: Any, tokenizer: Any, number_vocab: Any) -> None:
    """What an export needs besides the weights: config.json, generation_config.json, the tokenizer and the
    NTL number vocabulary (a few files, saved into every checkpoint so that it exports on its own)."""
    from transformers import GenerationConfig

    os.makedirs(folder, exist_ok=True)
    model_config.save_pretrained(folder)
    GenerationConfig.from_model_config(model_config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    number_vocab.save(folder)


def copy_regular_files(source: str, destination: str, wanted: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Copy the `wanted` regular files directly inside `source` into `destination` (made if needed) without following
    a symbolic link anywhere: a link (to a key, a token, another run), a folder or a device node is skipped
    with a warning, so a planted link never puts its target into an export. Returns the names copied."""
    if os.path.islink(source) or not os.path.isdir(source):
        raise CheckpointError(f"{source!r} is not a folder (a symbolic link is not followed); restore the "
                              f"checkpoint's {HF_DIR}/ folder")
    os.makedirs(destination, exist_ok=True)
    copied = []
    for name in sorted(os.listdir(source)):
        if not wanted(name):
            continue
        path = os.path.join(source, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            logger.warning("not copied: %s is a symbolic link", path)
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            logger.warning("not copied: %s is not a regular file", path)
            continue
        with os.fdopen(fd, "rb") as reader:
            with open(os.path.join(destination, name), "xb") as writer:
                shutil.copyfileobj(reader, writer, 2**20)
        copied.append(name)
    return copied


def disk_full_error(error: BaseException, folder: str) -> CheckpointError | None:
    """The one-line error for a write that failed because `folder`'s file system is full (`fs.is_full_disk`);
    None otherwise."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if is_full_disk(error, free):
        return CheckpointError(f"no space left on {folder!r} ({free / 2**20:.1f} MiB free); free space there or "
                               f"write to another disk, then run it again (the partial output was removed)")
    return None


class _MappedFiles:
    """Checkpoint files loaded with `torch.load(mmap=True)` (weights-only, the allow-listed DeepSpeed classes),
    kept while they are read and dropped after MAPPED_READ_BUDGET bytes, so that the file pages read leave the
    process's resident memory instead of adding up to the whole checkpoint."""

    def __init__(self, budget: int = MAPPED_READ_BUDGET) -> None:
        self._loaded: dict[str, Any] = {}
        self._read = 0
        self._budget = budget

    def __getitem__(self, path: str) -> Any:
        if path not in self._loaded:
            self._loaded[path] = safe_load(path, "checkpoint file", mmap=True)
        return self._loaded[path]

    def account(self, nbytes: int) -> None:
        self._read += nbytes
        if self._read >= self._budget:
            self.release()

    def copy_range(self, path: str, flat: Callable[[Any], torch.Tensor], out: torch.Tensor, start: int) -> None:
        """Fill `out` from `flat(<file path loaded>)[start:]`, a piece of at most a quarter of the budget at a
        time, so that no more than the budget of its mapped pages is ever resident."""
        piece = max(1, self._budget // (4 * out.element_size()))
        for done in range(0, out.numel(), piece):
            count = min(piece, out.numel() - done)
            out[done:done + count].copy_(flat(self[path])[start + done:start + done + count])
            self.account(count * out.element_size())

    def release(self) -> None:
        self._loaded.clear()
        self._read = 0


def _rank_grid(checkpoint_path: str, kind: str) -> list[list[str]]:
    """`[tp][dp]` paths of the `*zero_pp_rank_<dp>_mp_rank_<tp>_<kind>_states.pt` files; a gap is an error."""
    grid: dict[int, dict[int, str]] = {}
    for name in os.listdir(checkpoint_path):
        match = _RANK_FILE_RE.match(name)
        if match and match.group(3) == kind:
            grid.setdefault(int(match.group(2)), {})[int(match.group(1))] = os.path.join(checkpoint_path, name)
    if not grid:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} has no ZeRO {kind}-states files")
    tp_size, dp_size = max(grid) + 1, max(max(ranks) for ranks in grid.values()) + 1
    missing = [(tp, dp) for tp in range(tp_size) for dp in range(dp_size) if dp not in grid.get(tp, {})]
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} lacks the {kind}-states file of (tp rank, dp rank) "
                              f"{missing[0]}")
    return [[grid[tp][dp] for dp in range(dp_size)] for tp in range(tp_size)]


def _flat_shapes(param_shapes: Any) -> dict[str, tuple[int, ...]]:
    """DeepSpeed's `param_shapes` (a list of one ordered dict per parameter group, or one dict) as one dict."""
    groups = param_shapes if isinstance(param_shapes, list) else [param_shapes]
    return {name: tuple(shape) for group in groups for name, shape in group.items()}


class _WeightSource(abc.ABC):
    """Where a checkpoint keeps each parameter's fp32 weights: per tensor-parallel rank, the slice of every
    parameter (`tp_slices`), joined from its ZeRO partitions; `full` merges them into the parameter."""

    uc_info: dict = {}  # DeepSpeed's universal-checkpoint info: how each parameter is sliced over TP ranks
    tp_size = 1
    needs_merge = False  # run DeepSpeed's merge even for one slice (it also strips vocabulary padding)

    def __init__(self, checkpoint_path: str, files: _MappedFiles) -> None:
        self.path, self.files = checkpoint_path, files

    @abc.abstractmethod
    def names(self) -> set[str]:
        """The parameter names the checkpoint holds weights for."""

    @abc.abstractmethod
    def tp_slices(self, name: str) -> list[torch.Tensor]:
        """The parameter's fp32 slice of each tensor-parallel rank, its ZeRO partitions joined."""

    def full(self, name: str) -> torch.Tensor:
        slices = self.tp_slices(name)
        if len(slices) == 1 and not self.needs_merge:
            return slices[0]
        return merge_tp_slices(self.uc_info, name, slices)


class _Zero0Weights(_WeightSource):
    """ZeRO stage 0 (tp_size 1): the module state of `mp_rank_00_model_states.pt`, as a float."""

    def __init__(self, checkpoint_path: str, files: _MappedFiles) -> None:
        super().__init__(checkpoint_path, files)
        self.model_file = os.path.join(checkpoint_path, "mp_rank_00_model_states.pt")

    def names(self) -> set[str]:
        return set(self.files[self.model_file]["module"])

    def tp_slices(self, name: str) -> list[torch.Tensor]:
        tensor = self.files[self.model_file]["module"][name]
        self.files.account(tensor.nbytes)
        return [tensor.float().clone() if tensor.dtype == torch.float32 else tensor.float()]


class _Zero12Weights(_WeightSource):
    """ZeRO 1/2: each data-parallel rank's `single_partition_of_fp32_groups` holds fragments of parameters at
    the offsets its `param_slice_mappings` give; a tensor-parallel rank's slice is its fragments in dp order,
    shaped by `param_shapes` of `mp_rank_<tp>_model_states.pt`. Parameters the optimizer does not hold come
    from the module state of tp rank 0 (as in DeepSpeed's conversion)."""

    needs_merge = True  # as DeepSpeed's conversion, which always merges ZeRO 1/2 parameters

    def __init__(self, checkpoint_path: str, files: _MappedFiles) -> None:
        super().__init__(checkpoint_path, files)
        self.optim = _rank_grid(checkpoint_path, "optim")
        self.tp_size = len(self.optim)
        self.model_files = [os.path.join(checkpoint_path, f"mp_rank_{tp:02d}_model_states.pt") for tp in range(self.tp_size)]
        self.shapes, self.fragments = [], []
        for tp, model_file in enumerate(self.model_files):
            self.shapes.append(_flat_shapes(files[model_file]["param_shapes"]))
            where: dict[str, list[tuple[int, int, int, int]]] = {}  # name: (dp, group, start, numel)
            for dp, optim_file in enumerate(self.optim[tp]):
                for group, mapping in enumerate(files[optim_file]["optimizer_state_dict"]["param_slice_mappings"]):
                    for name, fragment in mapping.items():
                        where.setdefault(name, []).append((dp, group, int(fragment.start), int(fragment.numel)))
            self.fragments.append(where)
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE

        info = files[self.model_files[0]].get(UNIVERSAL_CHECKPOINT_INFO)
        if info is None and self.tp_size > 1:
            raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with tp_size {self.tp_size} but records no "
                                  f"{UNIVERSAL_CHECKPOINT_INFO}, which merging its tensor-parallel slices needs")
        # DeepSpeed's conversion injects the same when nothing is sliced (`inject_missing_state`)
        self.uc_info = info if info is not None else {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        self.module_names = set(files[self.model_files[0]].get("module") or {})
        files.release()

    def names(self) -> set[str]:
        return set(self.fragments[0]) | self.module_names

    def tp_slices(self, name: str) -> list[torch.Tensor]:
        if name not in self.fragments[0]:
            tensor = self.files[self.model_files[0]]["module"][name]
            self.files.account(tensor.nbytes)
            return [tensor.float().clone() if tensor.dtype == torch.float32 else tensor.float()]
        slices = []
        for tp in range(self.tp_size):
            shape = self.shapes[tp][name]
            out = torch.empty(math.prod(shape), dtype=torch.float32)
            position = 0
            for dp, group, start, numel in sorted(self.fragments[tp].get(name, [])):
                self.files.copy_range(self.optim[tp][dp], lambda state, group=group: state["optimizer_state_dict"][
                    "single_partition_of_fp32_groups"][group], out[position:position + numel], start)
                position += numel
            if position != out.numel():
                raise CheckpointError(f"checkpoint {self.path!r}: the ZeRO partitions of {name} (tp rank {tp}) hold "
                                      f"{position} values, its shape {shape} needs {out.numel()}")
            slices.append(out.view(shape))
        return slices


class _Zero3Weights(_WeightSource):
    """ZeRO 3: each data-parallel rank's `fp32_flat_groups[g]` holds, parameter after parameter of
    `param_shapes[g]`, its partition of ceil(numel / partition_count) values (the last one padded)."""

    def __init__(self, checkpoint_path: str, files: _MappedFiles) -> None:
        super().__init__(checkpoint_path, files)
        self.optim = _rank_grid(checkpoint_path, "optim")
        models = _rank_grid(checkpoint_path, "model")
        self.tp_size, self.dp_size = len(self.optim), len(self.optim[0])
        if (len(models), len(models[0])) != (self.tp_size, self.dp_size):
            raise CheckpointError(f"checkpoint {checkpoint_path!r}: its model-states files are for {len(models)} x "
                                  f"{len(models[0])} ranks, its optimizer files for {self.tp_size} x {self.dp_size}")
        self.shapes: list[dict[str, tuple[int, ...]]] = []
        self.where: list[dict[str, tuple[int, int, int]]] = []  # name: (group, offset, partition numel)
        for tp in range(self.tp_size):
            param_shapes = files[models[tp][0]]["param_shapes"]
            groups = files[self.optim[tp][0]]["optimizer_state_dict"].get("ds_zero_partition_groups") or []
            where = {}
            for group, shapes in enumerate(param_shapes):
                count = (groups[group] if group < len(groups) else {}).get("partition_count", self.dp_size)
                offset = 0
                for name, shape in shapes.items():
                    partition = math.ceil(math.prod(shape) / count)
                    where[name] = (group, offset, partition)
                    offset += partition
            self.shapes.append(_flat_shapes(param_shapes))
            self.where.append(where)
        self.needs_merge = self.tp_size > 1
        self.uc_info = (files[models[0][0]].get(UNIVERSAL_CHECKPOINT_INFO) or {}) if self.needs_merge else {}
        files.release()

    def names(self) -> set[str]:
        return set(self.where[0])

    def tp_slices(self, name: str) -> list[torch.Tensor]:
        slices = []
        for tp in range(self.tp_size):
            shape, (group, offset, partition) = self.shapes[tp][name], self.where[tp][name]
            numel = math.prod(shape)
            out = torch.empty(numel, dtype=torch.float32)
            for dp in range(self.dp_size):
                groups = self.files[self.optim[tp][dp]]["optimizer_state_dict"].get("ds_zero_partition_groups")
                rank = ((groups or [{}] * (group + 1))[group]).get("partition_rank", dp)
                held = max(0, min(partition, numel - rank * partition))  # without the padding
                self.files.copy_range(self.optim[tp][dp], lambda state, group=group: state["optimizer_state_dict"][
                    "fp32_flat_groups"][group], out[rank * partition:rank * partition + held], offset)
            slices.append(out.view(shape))
        return slices


class _UniversalWeights(_WeightSource):
    """A universal checkpoint (`tools/reshard.py`): `zero/<name>/fp32.pt`, a dict whose `param` is the full
    tensor, or (ZeRO-3 without tensor parallelism) the bare flat tensor."""

    def names(self) -> set[str]:
        zero = os.path.join(self.path, "zero")
        return {name for name in os.listdir(zero) if os.path.isfile(os.path.join(zero, name, "fp32.pt"))}

    def tp_slices(self, name: str) -> list[torch.Tensor]:
        path = os.path.join(self.path, "zero", name, "fp32.pt")
        stored = safe_load(path, "checkpoint file", mmap=True)
        tensor = stored["param"] if isinstance(stored, dict) else stored
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"universal checkpoint file {path!r} holds a {type(stored).__name__}, not a tensor "
                                  f"or a dict with 'param'")
        return [tensor.clone()]


def _weight_source(checkpoint_path: str, manifest: dict, files: _MappedFiles) -> _WeightSource:
    layout = manifest["layout"]
    if manifest.get("universal_of"):
        return _UniversalWeights(checkpoint_path, files)
    if layout["zero_stage"] == 0 and layout["tp_size"] != 1:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0 and tp_size "
                              f"{layout['tp_size']}; export covers ZeRO 1-3 with any tp_size and ZeRO 0 with tp_size 1")
    return WEIGHT_SOURCES[layout["zero_stage"]](checkpoint_path, files)


WEIGHT_SOURCES: dict[int, type[_WeightSource]] = {0: _Zero0Weights, 1: _Zero12Weights, 2: _Zero12Weights,
                                                  3: _Zero3Weights}  # ZeRO stage: where its weights are


class _Merged(Exception):
    """Carries the merged fp32 parameter out of DeepSpeed's merge before it goes on to the Adam moments."""

    def __init__(self, record: dict) -> None:
        super().__init__()
        self.record = record


def merge_tp_slices(uc_info: dict, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """One parameter from its tensor-parallel slices, by DeepSpeed's own merge (`ds_to_universal.merge_tp_slices`:
    replicated, averaged, row- or column-parallel, sub-parameters, affine maps, vocabulary padding).

    DeepSpeed's function reads the slices from fragment files and writes `fp32.pt`, `exp_avg.pt` and
    `exp_avg_sq.pt`; here its file reader is given the slices in memory and its writer hands back the first
    record (fp32) and stops it, so nothing touches the disk and the moments are never merged."""
    from deepspeed.checkpoint import ds_to_universal

    def read_slices(_path: str, state: str, _tp_degree: int, _shapes: Any = None) -> list:
        return list(slices) if state == "fp32" else []

    def capture(_path: str, record: dict) -> None:
        raise _Merged(record)

    saved = ds_to_universal._merge_zero_shards, ds_to_universal._save_checkpoint
    ds_to_universal._merge_zero_shards, ds_to_universal._save_checkpoint = read_slices, capture
    try:
        ds_to_universal.merge_tp_slices(uc_info, "", "", len(slices), (name, [tuple(s.shape) for s in slices]))
    except _Merged as merged:
        return merged.record["param"]
    except (AssertionError, ValueError, RuntimeError, KeyError) as error:
        raise CheckpointError(f"merging the {len(slices)} tensor-parallel slices of {name} failed "
                              f"({type(error).__name__}: {error})") from None
    finally:
        ds_to_universal._merge_zero_shards, ds_to_universal._save_checkpoint = saved
    raise CheckpointError(f"DeepSpeed's merge wrote no fp32 weights for {name}")


def write_safetensors(path: str, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file whose tensors (name: dtype, shape) are made one at a time by `produce`, in
    the order given: the header is known from the shapes, so each tensor is written and dropped before the
    next is made (the safetensors library writes a file only from a dict of all of its tensors)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "xb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name, (dtype, shape) in tensors.items():
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, the shard planned "
                                      f"{tuple(shape)} {dtype}")
            if tensor.numel():
                handle.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
            del tensor
        handle.flush()
        os.fsync(handle.fileno())


@contextlib.contextmanager
def _export_errors(checkpoint_path: str, folder: str) -> Iterator[None]:
    """A full disk said as such (with the free space), not as torch's or the OS's raw error."""
    try:
        yield
    except OSError as error:
        full = disk_full_error(error, folder)
        if full is not None:
            raise full from None
        raise CheckpointError(f"exporting {checkpoint_path!r} failed while writing into {folder!r} "
                              f"({type(error).__name__}: {error}); the partial output was removed") from None


def revert_to_published(model: Any, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter (in-memory name) as the family's checkpoints store it: transformers' reverse weight
    conversion (`revert_weight_conversion`), which renames it or splits a fused tensor into several."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor})


def published_layout(model: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{published name: (in-memory name, shape)} for the parameters of `shapes`, in their order, each
    parameter's published tensors together (the export writes them one after another from one conversion)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        for published, tensor in revert_to_published(model, name, torch.empty(shape, device="meta")).items():
            if published in layout:
                raise CheckpointError(f"two parameters ({layout[published][0]}, {name}) are both published as "
                                      f"{published!r}; this model family's conversion is not supported by the export")
            layout[published] = (name, tuple(tensor.shape))
    return layout


def max_shard_bytes(size: str | int) -> int:
    """`max_shard_size` in bytes: a positive number of bytes (an int or a string of digits) or a number with one of
    the units KB, MB, GB, TB (huggingface_hub's reading, as `save_pretrained` reads it). Refused otherwise: a size
    below one byte ("0GB", "-5GB", which huggingface_hub accepts) would put every tensor in a file of its own."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)
    if isinstance(size, int) and not isinstance(size, bool):
        size_bytes = size
    else:
        try:
            size_bytes = parse_size_to_int(size)
        except (ValueError, OverflowError, TypeError, AttributeError):
            size_bytes = 0
    if size_bytes < 1:
        raise CheckpointError(f"max_shard_size={size!r} is not a size: give a positive number of bytes or a number "
                              f"with one of the units KB, MB, GB, TB (e.g. 5GB, 500MB)")
    return size_bytes


def _check_export_folder(checkpoint_path: str, out_dir: str) -> None:
    """Refuse an export folder that exists with content or lies inside the checkpoint (the export would add an
    unlisted folder to it, and verification then refuses the checkpoint: the run could not resume from it)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"export folder {out_dir!r} is a file, not a folder; choose another path (nothing was "
                              f"overwritten)")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"export folder {out_dir!r} already exists and is not empty; choose another one "
                              f"(nothing was overwritten)")
    check_output_outside(checkpoint_path, out_dir, "export")


def export_hf(checkpoint_path: str, out_dir: str, *, dtype: str | None = None, max_shard_size: str | int = "5GB") -> dict:
    """Export a checkpoint folder (any ZeRO stage 1-3, any TP size; CPU only) as a Hugging Face model folder.

    Writes safetensors weights sharded by `max_shard_size` (with `model.safetensors.index.json` when there
    are several shards), config.json, generation_config.json, the tokenizer and number_vocab.json, all
    into `out_dir` (which must not exist or be empty; written under `out_dir.partial` and renamed).

    Args:
        checkpoint_path: `RUN/global_stepN` (or its universal form).
        out_dir: the new Hugging Face folder.
        dtype: bf16 | fp16 | fp32; default: the training dtype recorded in the checkpoint's config.json.
        max_shard_size: largest shard, e.g. "5GB" or a number of bytes (`max_shard_bytes`).
    Returns:
        {"seconds", "bytes", "parameters", "files"} of the export.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not one of {', '.join(EXPORT_DTYPES)}")
    shard_bytes = max_shard_bytes(max_shard_size)  # the arguments first: before a checkpoint is hashed
    check_not_a_link(checkpoint_path)
    _check_export_folder(checkpoint_path, out_dir)
    manifest = verify_checkpoint(checkpoint_path)
    assets = os.path.join(checkpoint_path, HF_DIR)
    config_file = os.path.join(assets, "config.json")
    if os.path.islink(assets) or os.path.islink(config_file) or not os.path.isfile(config_file):
        raise CheckpointError(f"checkpoint {checkpoint_path!r} has no {HF_DIR}/config.json (a regular file, not a "
                              f"symbolic link) to export with")
    config = AutoConfig.from_pretrained(assets)
    saved_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    target = EXPORT_DTYPES[dtype] if dtype else (saved_dtype if isinstance(saved_dtype, torch.dtype) else
                                                 getattr(torch, str(saved_dtype or "float32").replace("torch.", "")))
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in reference.state_dict().items()}
    tied = set(getattr(reference, "_tied_weights_keys", None) or []) if getattr(config, "tie_word_embeddings", False) else set()
    if tied:
        tied |= {"lm_head.weight"}  # the tied copy holds the input embedding's values
    files = _MappedFiles()
    source = _weight_source(checkpoint_path, manifest, files)
    held = source.names()
    missing = sorted(set(expected) - held - tied)
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} lacks weights the model needs: {missing[:5]}")
    names = sorted(name for name in held if name in expected and name not in tied)
    # the family's published names and shapes (what its save_pretrained writes: GPT-NeoX's embed_out, Qwen3-MoE's
    # per-expert tensors), from transformers' own reverse conversion of each parameter; {published: in-memory}
    layout = published_layout(reference, {name: expected[name] for name in names})
    shapes = {published: shape for published, (_, shape) in layout.items()}
    plan = {published: torch.empty(shape, dtype=target, device="meta") for published, shape in shapes.items()}
    split = split_torch_state_dict_into_shards(plan, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=shard_bytes)

    def full(name: str) -> torch.Tensor:
        tensor = source.full(name)
        if tuple(tensor.shape) != expected[name]:
            if source.tp_size == 1 and tensor.dim() == 1 and tensor.numel() == math.prod(expected[name]):
                tensor = tensor.view(expected[name])  # a universal checkpoint of ZeRO-3 stores it flat
            else:
                raise CheckpointError(f"checkpoint {checkpoint_path!r}: {name} has shape {tuple(tensor.shape)}, the "
                                      f"model expects {expected[name]}")
        return tensor

    converted: dict[str, torch.Tensor] = {}  # the published tensors of the last parameter that expands into several

    def produce(published: str) -> torch.Tensor:
        name, _ = layout[published]
        if published == name:
            return full(name).to(target)
        if published not in converted:  # a parameter's published tensors are planned one after another
            converted.clear()
            converted.update(revert_to_published(reference, name, full(name)))
        return converted.pop(published).to(target)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.abspath(out_dir).rstrip("/") + STAGING_SUFFIX
    remove_staging(staging)  # an interrupted export of ours; anything else there is refused, not deleted
    try:
        with _export_errors(checkpoint_path, parent):
            make_staging(staging)
            for filename, shard_names in split.filename_to_tensors.items():
                write_safetensors(os.path.join(staging, filename), {name: (target, shapes[name]) for name in shard_names},
                                  produce, {"format": "pt"})
                files.release()
            if split.is_sharded:
                write_json_atomic(os.path.join(staging, "model.safetensors.index.json"),
                                  {"metadata": {**split.metadata, "format": "pt"}, "weight_map": split.tensor_to_filename},
                                  indent=2)
            config.dtype = target
            config.architectures = [type(reference).__name__]
            config.save_pretrained(staging)
            copy_regular_files(assets, staging, wanted=lambda name: name != "config.json")
            apply_umask_modes(staging)  # files the libraries write privately: teammates read the export
            commit_directory(staging, out_dir)  # replaces an empty out_dir (checked above)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        files.release()
    # the marker goes only after the rename: a kill before it leaves OUT.partial still marked as ours (removed by
    # the next export), a kill after it a complete export holding a stray marker, never an unremovable OUT.partial
    os.remove(os.path.join(out_dir, STAGING_MARKER))
    return {"seconds": time.perf_counter() - started, "bytes": folder_bytes(out_dir),
            "parameters": sum(math.prod(shape) for shape in shapes.values()), "files": sorted(os.listdir(out_dir))}
