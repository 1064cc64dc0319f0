"""Loading checkpoint files without running code: every `torch.load` (ours, DeepSpeed's engine and its
universal conversion) unpickles with weights_only=True and an allow-list of the few DeepSpeed classes its
files hold; and each rank's RNG state, saved as plain tensors and numbers so that it loads that way."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
from typing import Any

import numpy as np
import torch

from .format import CheckpointError, UnsafeCheckpointError

RNG_FORMAT = 2  # plain tensors and numbers (format 1: python tuples and a numpy array, see load_rng_state)

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads it on every call
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _engine_safe_globals() -> list:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and plain containers (ZeRO optimizer
    states, loss scalers, universal-checkpoint metadata); constructing them runs no code of the file's."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, SubparamShape]


@contextlib.contextmanager
def weights_only_loads():
    """Every `torch.load` inside, including DeepSpeed's own (which pass weights_only=False), unpickles with
    weights_only=True: tensors, plain containers and the allow-listed DeepSpeed classes only.

    Uses torch's own switch (the TORCH_FORCE_WEIGHTS_ONLY_LOAD environment variable, read by every
    torch.load call) and allow-list (`torch.serialization.safe_globals`); both are process-wide while the
    context is open, and processes forked inside it (ds_to_universal's workers) inherit them.
    """
    saved = {key: os.environ.get(key) for key in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(_FORCE_NO_WEIGHTS_ONLY, None)
    try:
        with torch.serialization.safe_globals(_engine_safe_globals()):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def unsafe_pickle_globals(path: str) -> list[str]:
    """The globals of a torch.save file that a weights-only load would refuse (read statically, nothing is
    run); [] for files that are not torch zip archives (their load is still weights-only)."""
    if not path.endswith((".pt", ".pth", ".bin")):
        return []
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, RuntimeError):  # not a torch zip archive, or a damaged one (the load then fails safely)
        return []


def safe_load(path: str, what: str, mmap: bool = False) -> Any:
    """`torch.load` of one checkpoint file with weights_only=True (`mmap`: its tensors memory-mapped, read as
    they are touched); a refused pickle is a CheckpointError."""
    with weights_only_loads():
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"{what} {path!r} holds pickled Python objects that a weights-only load refuses; unpickling it "
                f"could run arbitrary code, so it was not loaded ({str(error).splitlines()[0]})") from None
        except (OSError, RuntimeError, EOFError) as error:
            raise CheckpointError(f"cannot read {what} {path!r}: {type(error).__name__}: {error}") from None


def rng_state() -> dict:
    """This process's random number generator states (python, numpy, torch CPU, accelerator) as tensors and
    plain numbers only, so that it loads with weights_only=True."""
    from deepspeed.accelerator import get_accelerator

    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {"format": RNG_FORMAT,
             "python": torch.tensor(internal, dtype=torch.int64), "python_version": int(version),
             "python_gauss": gauss,
             "numpy_kind": str(kind), "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
             "numpy_position": int(position), "numpy_has_gauss": int(has_gauss),
             "numpy_gauss": float(cached_gaussian),
             "torch": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        state["accelerator"] = accelerator.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate((state["python_version"], tuple(int(v) for v in state["python"].tolist()), state["python_gauss"]))
    np.random.set_state((state["numpy_kind"], state["numpy"].numpy().astype(np.uint32), state["numpy_position"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    accelerator = get_accelerator()
    if "accelerator" in state and accelerator.device_name() != "cpu":
        accelerator.set_rng_state(state["accelerator"])


def load_rng_state(path: str) -> dict:
    """A rank's saved RNG state, unpickled weights-only. Files of format 1 (python tuples and a numpy array)
    load with numpy's array reconstruction allow-listed for this file only, and are converted."""
    try:
        return safe_load(path, "RNG state")
    except UnsafeCheckpointError:
        if unsafe_pickle_globals(path) and set(unsafe_pickle_globals(path)) <= LEGACY_RNG_GLOBALS:
            with torch.serialization.safe_globals([np.dtype, np.ndarray, _numpy_reconstruct(), type(np.dtype(np.uint32))]):
                legacy = safe_load(path, "RNG state")
            version, internal, gauss = legacy["python"]
            kind, keys, position, has_gauss, cached_gaussian = legacy["numpy"]
            converted = {"python": torch.tensor(internal, dtype=torch.int64), "python_version": version,
                         "python_gauss": gauss, "numpy_kind": kind,
                         "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "numpy_position": position,
                         "numpy_has_gauss": has_gauss, "numpy_gauss": cached_gaussian, "torch": legacy["torch"]}
            if "accelerator" in legacy:
                converted["accelerator"] = legacy["accelerator"]
            return converted
        raise


LEGACY_RNG_GLOBALS = {"numpy.dtype", "numpy.ndarray", "numpy.core.multiarray._reconstruct",
                       "numpy._core.multiarray._reconstruct", "numpy.dtypes.UInt32DType"}


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def seed_generators(value: int) -> None:
    """Seed every generator a checkpoint's `rng_state_<rank>.pt` holds: Python's, NumPy's and torch's (each device's)."""
    random.seed(value)
    np.random.seed(value % 2**32)  # NumPy's legacy seed is 32 bits
    torch.manual_seed(value)


def reseed(seed: int, step: int, rank: int) -> None:
    """RNG states for a resume whose world differs from the saved one (each rank's own, reproducible)."""
    seed_generators((seed * 1_000_003 + step * 7919 + rank) % 2**31)
