"""Count the tensor calls that force a device-to-host synchronisation, on any device (CPU included).

On a GPU each of these waits for the stream: reading a value (`item`, `tolist`, `bool(t)`, `int(t)`,
`float(t)`, formatting), or an op whose output size depends on the data (`nonzero`, boolean-mask
indexing, `masked_select`, `unique`). On CPU nothing waits, but the calls are the same, so counting
them during a training step on CPU proves what the step would do on a GPU.

Each call is attributed to the first stack frame outside torch: our package (`ntl_pretrain`),
DeepSpeed, or other code.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

Tensor = torch.Tensor
aten = torch.ops.aten
# Seen at the ATen level (also inside autograd backward, where torch-function modes are off): reading a
# value (item, bool(), int(), float(), formatting all end in _local_scalar_dense) and ops whose output size
# depends on the data.
SYNCING_ATEN = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
                aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                aten.unique_consecutive.default, aten.argwhere.default}
# Python-level calls that read the data without an ATen op.
SYNCING_PYTHON = {Tensor.tolist, Tensor.numpy, Tensor.cpu}
TORCH_DIR = os.path.dirname(torch.__file__)


def _has_bool_index(indices) -> bool:
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _is_syncing_aten(func, args, kwargs) -> bool:
    if func in SYNCING_ATEN:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return len(args) > 1 and _has_bool_index(args[1])
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return (kwargs or {}).get("output_size") is None
    return False


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
    def __init__(self, record) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_syncing_aten(func, args, kwargs):
            self.record()
        return func(*args, **(kwargs or {}))


class _PythonCounter(TorchFunctionMode):
    def __init__(self, record) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_PYTHON:
            self.record()
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """`with SyncCounter() as counter:` ... `counter.by_package`, `counter.sites`; `counter.phase` is a
    label (e.g. "micro_batch") that callers set around parts of the code to count them apart."""

    def __init__(self) -> None:
        self.phase = "step"
        self.by_package: Counter = Counter()  # (phase, package) -> calls
        self.sites: Counter = Counter()  # (phase, package, site) -> calls
        self._modes = [_AtenCounter(self._record), _PythonCounter(self._record)]

    def _record(self) -> None:
        package, site = _origin()
        self.by_package[(self.phase, package)] += 1
        self.sites[(self.phase, package, site)] += 1

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
