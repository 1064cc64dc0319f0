"""DeepSpeed's universal checkpoint form of a checkpoint (unsharded fp32 weights and optimizer states per
parameter), through which a checkpoint loads with another data- or tensor-parallel size or ZeRO stage."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import pickle
import shutil
import time

import torch.distributed as dist

from ..core.fs import commit_directory, write_text_atomic
from .collective import is_collective
from .format import (FORMAT_VERSION, HF_DIR, MANIFEST_NAME, STAGING_MARKER, STAGING_SUFFIX, UNIVERSAL_SUFFIX,
                     AgreedCheckpointError, CheckpointError, UnsafeCheckpointError, check_output_outside, file_sizes,
                     saved_layout)
from .export import copy_regular_files, disk_full_error
from .integrity import hash_files, hash_record, verify_checkpoint
from .safe_loading import weights_only_loads
from .staging import make_staging, remove_staging

logger = logging.getLogger("ntl_pretrain")

CONVERSION_WAIT_HOURS = 24.0  # how long the other ranks wait for global rank 0's conversion (their own watchdog)
_POLL_SECONDS = 1.0  # how often a waiting rank looks for rank 0's outcome in the rendezvous store
_ACK_SECONDS = 60.0  # how long rank 0 waits for the others to read its error before raising it
_conversions = 0  # conversions started by this process: each one's store key is new


def universal_path(checkpoint_path: str) -> str:
    return checkpoint_path.rstrip("/") + UNIVERSAL_SUFFIX


def convert_to_universal(checkpoint_path: str, output_path: str | None = None, workers: int = 1,
                         verified: bool = False) -> str:
    """Convert a (complete) DeepSpeed checkpoint to DeepSpeed's universal form, once; returns its path.

    The conversion (`deepspeed.checkpoint.ds_to_universal`) writes full, unsharded fp32 weights and
    optimizer states per parameter, which any data- and tensor-parallel size can load. It is written
    to a staging folder and renamed, so an interrupted conversion is redone rather than used. Every file
    is read with weights-only unpickling; the universal folder gets a manifest with sizes and hashes.

    Args:
        verified: the checkpoint's contents were checked already (a resume); its sizes are checked again.
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    output_path = output_path or universal_path(checkpoint_path)
    check_output_outside(checkpoint_path, output_path, "universal")
    manifest = verify_checkpoint(checkpoint_path, content=not verified)
    if os.path.isfile(os.path.join(output_path, MANIFEST_NAME)):
        verify_checkpoint(output_path)
        return output_path
    if os.path.exists(output_path):
        raise CheckpointError(f"{output_path!r} exists but is not a finished universal checkpoint; remove it and "
                              f"run the conversion again")
    if manifest["layout"]["zero_stage"] == 0:
        raise CheckpointError(f"checkpoint {checkpoint_path!r} was saved with ZeRO stage 0, which DeepSpeed's universal "
                              f"checkpoints do not cover; resume it with the layout it was saved with "
                              f"({saved_layout(manifest).describe()})")
    staging = output_path + STAGING_SUFFIX
    remove_staging(staging)
    make_staging(staging)
    # Without tensor parallelism nothing is sliced, so the universal-checkpoint metadata that AutoTP
    # records (and DeepSpeed's ZeRO 1/2 conversion requires) is complete when it is just the version.
    args = argparse.Namespace(input_folder=checkpoint_path, output_folder=staging, num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              inject_missing_state=manifest["layout"]["tp_size"] == 1)
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), weights_only_loads():  # its prints would interleave with the log
            ds_to_universal(args)
    except pickle.UnpicklingError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise UnsafeCheckpointError(f"checkpoint {checkpoint_path!r} holds pickled Python objects that a weights-only "
                                    f"load refuses ({str(error).splitlines()[0]}); nothing was converted") from None
    except (OSError, RuntimeError, ValueError, KeyError, AssertionError) as error:
        full = disk_full_error(error, os.path.dirname(os.path.abspath(staging)))  # measured before the clean-up
        shutil.rmtree(staging, ignore_errors=True)
        if full is not None:  # another layout would need the same space: no hint about it
            raise full from None
        raise CheckpointError(f"converting {checkpoint_path!r} to a universal checkpoint failed ({type(error).__name__}: "
                              f"{error}); the checkpoint itself is unchanged. Free disk space, or resume with the "
                              f"layout it was saved with ({saved_layout(manifest).describe()})") from None
    # carry our own files (RNG, HF assets) and write a manifest of the universal folder
    # (regular files only, never through a symbolic link: what a link points to never enters the new folder)
    copy_regular_files(checkpoint_path, staging, wanted=lambda name: name.startswith("rng_state_"))
    if os.path.lexists(os.path.join(checkpoint_path, HF_DIR)):
        copy_regular_files(os.path.join(checkpoint_path, HF_DIR), os.path.join(staging, HF_DIR))
    sizes = file_sizes(staging)
    carried = {key: value for key, value in manifest.items() if key != "sha256"}  # format 2's hashes: of other files
    universal_manifest = dict(carried, format=FORMAT_VERSION, universal_of=os.path.basename(checkpoint_path.rstrip("/")),
                              files=sizes, **hash_record(hash_files(staging, sorted(sizes), sizes)))
    write_text_atomic(os.path.join(staging, MANIFEST_NAME), json.dumps(universal_manifest, indent=1))
    commit_directory(staging, output_path)
    with contextlib.suppress(OSError):  # committed: no longer "an interrupted conversion of ours" (left: harmless)
        os.remove(os.path.join(output_path, STAGING_MARKER))
    pointer = os.path.join(os.path.dirname(output_path), "latest_universal")  # ds_to_universal's, naming the staging folder
    if os.path.isfile(pointer):
        write_text_atomic(pointer, os.path.basename(output_path))
    logger.info("converted %s to a universal checkpoint %s in %.1f s", checkpoint_path, output_path,
                time.perf_counter() - started)
    return output_path


def convert_while_others_wait(checkpoint_path: str, is_main: bool, wait_hours: float = CONVERSION_WAIT_HOURS) -> str:
    """`convert_to_universal` of a verified checkpoint on global rank 0 while the other ranks wait outside any
    collective (every rank calls this); its error is raised on every rank. Returns the universal folder.

    The conversion of a model of billions of parameters takes longer than `train.dist_timeout_minutes`, so
    the others do not wait in a collective: they poll the rendezvous store (a host-side key, no device or
    process-group timeout) for rank 0's outcome, under a watchdog of their own of `wait_hours`. If rank 0
    dies, the store (which rank 0 hosts, or the launcher's agent) stops answering and the wait ends at once.
    Every rank then raises rank 0's error itself, as an `AgreedCheckpointError` (rank 0 once the others have
    read it, or after a minute).
    """
    global _conversions
    if not is_collective(True):
        return convert_to_universal(checkpoint_path, verified=True)
    _conversions += 1
    key = f"ntl_pretrain/universal_conversion/{_conversions}"
    store = dist.distributed_c10d._get_default_store()
    if is_main:
        message = ""
        try:
            convert_to_universal(checkpoint_path, verified=True)
        except CheckpointError as error:
            message = str(error)
        except (OSError, ValueError, RuntimeError) as error:
            message = f"{type(error).__name__}: {error}"
        store.set(key, "error:" + message if message else "done")
        if message:  # stay (and keep the store rank 0 hosts up) until every rank has read it, so all report it
            deadline = time.monotonic() + _ACK_SECONDS
            while store.add(key + "/read", 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
    else:
        deadline = time.monotonic() + wait_hours * 3600.0
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise CheckpointError(f"global rank 0 did not finish converting {checkpoint_path!r} to a universal "
                                      f"checkpoint within {wait_hours:g} h; convert it ahead of time with "
                                      f"tools/reshard.py and resume again")
            time.sleep(_POLL_SECONDS)
        outcome = store.get(key).decode()
        store.add(key + "/read", 1)
        message = outcome[len("error:"):] if outcome.startswith("error:") else ""
    if message:  # every rank has the same outcome, so no collective is needed to agree on it
        raise AgreedCheckpointError(message)
    return universal_path(checkpoint_path)
