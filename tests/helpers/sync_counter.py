"""Count the tensor calls that force a device-to-host synchronisation, on any device (CPU included).

On a GPU each call in `SYNCING_OPS` waits for the stream: reading a value (`item`, `tolist`, `bool(t)`,
`int(t)`, `float(t)`, formatting, `torch.equal`, `allclose`), an op whose output size depends on the data
(`nonzero`, boolean-mask indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`), or
a copy of a device tensor to the host (`cpu()`, `.to("cpu")`, `numpy()`). On CPU nothing waits, but the
calls are the same, so counting them during a training step on CPU proves what the step would do on a GPU;
there every tensor counts as a device tensor (the host is the device).

Each call is attributed to the first stack frame outside torch: our package (`ntl_pretrain`),
DeepSpeed, or other code.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

Tensor = torch.Tensor
aten = torch.ops.aten
TORCH_DIR = os.path.dirname(torch.__file__)
# Without a GPU the host is the device: every copy to the host then stands for a device-to-host copy.
HOST_IS_DEVICE = not torch.cuda.is_available()


def _is_device_tensor(value: Any) -> bool:
    return torch.is_tensor(value) and (HOST_IS_DEVICE or value.device.type != "cpu")


def _is_cpu(value: Any) -> bool:
    return (isinstance(value, str) and value.split(":")[0] == "cpu") or (
        isinstance(value, torch.device) and value.type == "cpu")


def _has_bool_index(indices: Any) -> bool:
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _bool_indexed(args: tuple, kwargs: dict) -> bool:
    return len(args) > 1 and _has_bool_index(args[1])


def _without_output_size(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("output_size") is None


def _to_host(args: tuple, kwargs: dict) -> bool:
    """A blocking `tensor.to(...)` whose target device is the host (`"cpu"`, `torch.device("cpu")`, `device=`);
    `non_blocking=True` copies asynchronously (a later read of the copy is the sync)."""
    return (_is_device_tensor(args[0]) and not kwargs.get("non_blocking", False)
            and any(_is_cpu(a) for a in (*args[1:], kwargs.get("device"))))


def _always(args: tuple, kwargs: dict) -> bool:
    return True


@dataclass(frozen=True)
class SyncingOp:
    """One call that synchronises a device with the host."""

    name: str  # how user code spells it
    funcs: tuple  # the ATen overloads (seen by a dispatch mode, inside backward too) or Python-level Tensor methods
    when: Callable[[tuple, dict], bool] = _always  # (args, kwargs) -> whether this call syncs
    python_level: bool = False  # a Tensor method without an ATen op of its own (seen by a torch-function mode)


# THE list: every call that makes the host wait for the device. Value reads all end in _local_scalar_dense
# at the ATen level (item, bool(), int(), float(), is_nonzero, formatting).
SYNCING_OPS = (
    SyncingOp("item / bool / int / float / format (_local_scalar_dense)", (aten._local_scalar_dense.default,)),
    SyncingOp("torch.equal", (aten.equal.default,)),
    SyncingOp("torch.allclose", (aten.allclose.default,)),
    SyncingOp("nonzero / argwhere / torch.where(mask)", (aten.nonzero.default, aten.argwhere.default)),
    SyncingOp("masked_select", (aten.masked_select.default,)),
    SyncingOp("unique", (aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                         aten.unique_consecutive.default)),
    SyncingOp("boolean-mask indexing (t[mask], t[mask] = v)",
              (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default),
              _bool_indexed),
    SyncingOp("repeat_interleave without output_size",
              (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor), _without_output_size),
    SyncingOp("tolist", (Tensor.tolist,), python_level=True),
    SyncingOp("numpy", (Tensor.numpy,), lambda args, kwargs: _is_device_tensor(args[0]), python_level=True),
    SyncingOp("cpu()", (Tensor.cpu,), lambda args, kwargs: _is_device_tensor(args[0]), python_level=True),
    SyncingOp('.to("cpu")', (Tensor.to,), _to_host, python_level=True),
)


def _table(python_level: bool) -> dict:
    return {func: op for op in SYNCING_OPS if op.python_level == python_level for func in op.funcs}


def _origin() -> tuple[str, str]:
    """(package, 'file:line function') of the first caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != __file__ and "contextlib" not in name:
            package = ("ntl_pretrain" if f"{os.sep}ntl_pretrain{os.sep}" in name else
                       "deepspeed" if f"{os.sep}deepspeed{os.sep}" in name else "other")
            where = os.path.basename(name)
            if package == "ntl_pretrain":  # the path inside the package (data/stream.py), not only the file name
                where = name.rsplit(f"{os.sep}ntl_pretrain{os.sep}", 1)[1].replace(os.sep, "/")
            return package, f"{where}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "other", "?"


class _AtenCounter(TorchDispatchMode):
    def __init__(self, record: Callable[[SyncingOp], None]) -> None:
        super().__init__()
        self.record = record
        self.table = _table(python_level=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = self.table.get(func)
        if op is not None and op.when(args, kwargs or {}):
            self.record(op)
        return func(*args, **(kwargs or {}))


class _PythonCounter(TorchFunctionMode):
    def __init__(self, record: Callable[[SyncingOp], None]) -> None:
        super().__init__()
        self.record = record
        self.table = _table(python_level=True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        op = self.table.get(func)
        if op is not None and op.when(args, kwargs or {}):
            self.record(op)
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """`with SyncCounter() as counter:` ... `counter.by_package`, `counter.sites`, `counter.by_op`;
    `counter.phase` is a label (e.g. "micro_batch") that callers set around parts of the code to count them
    apart."""

    def __init__(self) -> None:
        self.phase = "step"
        self.by_package: Counter = Counter()  # (phase, package) -> calls
        self.sites: Counter = Counter()  # (phase, package, site) -> calls
        self.by_op: Counter = Counter()  # SyncingOp.name -> calls
        self._modes = [_AtenCounter(self._record), _PythonCounter(self._record)]

    def _record(self, op: SyncingOp) -> None:
        package, site = _origin()
        self.by_package[(self.phase, package)] += 1
        self.sites[(self.phase, package, site)] += 1
        self.by_op[op.name] += 1

    def __enter__(self) -> "SyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def summary(self) -> dict:
        return {"by_package": {f"{phase}/{package}": n for (phase, package), n in sorted(self.by_package.items())},
                "sites": {f"{phase}/{package}/{site}": n for (phase, package, site), n in sorted(self.sites.items())}}
