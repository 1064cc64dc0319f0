"""Asynchronous checkpoint saves (`checkpoint.async_save`).

In one process (fast): the snapshot holds the tensors as they were at the save, whatever the training thread
does to them afterwards, and a failed background write is reported, not lost.

With the real Trainer on 2 gloo ranks (ZeRO-3, T=2; one worker pair, four runs in it): a synchronous run
saving at steps 2 and 4; the same run with asynchronous saves whose background writes start only after the
next step has updated the weights; a resume from that asynchronous step-2 checkpoint, which must train steps 3
and 4 bitwise as the synchronous run did; and an asynchronous save whose write fails on rank 1 (ENOSPC): both
ranks stop at the same step boundary with the one line, the previous checkpoint stays `latest` and verifies.
And a job killed (SIGKILL, every rank) in the middle of the background write of its step-4 checkpoint: the
step-2 checkpoint stays `latest` and verifies, and `train.resume=auto` resumes from it and commits step 4.
"""

from __future__ import annotations

import errno
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ntl_pretrain.checkpoint import MANIFEST_NAME, verify_checkpoint
from ntl_pretrain.checkpoint.async_save import PendingSave, snapshot_saves

from helpers.distributed import WORKERS, finish_ranks, run_workers, start_ranks  # noqa: E402
from helpers.launch import demo_args  # noqa: E402
from helpers.tensorboard import scalars as _scalars  # noqa: E402

TIMEOUT = 600


class _Engine:
    """A stand-in for DeepSpeed's engine as `snapshot_saves` sees it: its checkpoint engine writes with torch.save."""

    class _Writer:
        zipfile_serialization = True

        def save(self, state_dict, path):
            torch.save(state_dict, path)

    def __init__(self):
        self.checkpoint_engine = self._Writer()


@pytest.mark.fast
def test_snapshot_keeps_the_saved_values_while_training_changes_them(tmp_path):
    engine = _Engine()
    weights = torch.arange(6, dtype=torch.float32)
    state = {"weights": weights, "view": weights[2:4], "moments": {"exp_avg": torch.ones(3)}, "step": 7}
    buffers: list = []
    with snapshot_saves(engine, buffers) as snapshots:
        engine.checkpoint_engine.save(state, str(tmp_path / "optim_states.pt"))
        engine.checkpoint_engine.save({"step": 7}, str(tmp_path / "model_states.pt"))
    assert isinstance(engine.checkpoint_engine, _Engine._Writer)  # restored after the save
    assert not list(tmp_path.iterdir())  # nothing written on the training thread
    weights.add_(100.0)  # the next steps update the live tensors in place
    state["moments"]["exp_avg"].mul_(0.0)
    state["step"] = 8
    (tmp_path / "rng_state_0.pt").write_bytes(b"rng")
    pending = PendingSave("global_step7", 7, 0, str(tmp_path), snapshots.files, ["rng_state_0.pt"], repr, None)
    pending.wait()
    assert pending.error is None and len(buffers) == 2
    saved = torch.load(tmp_path / "optim_states.pt")
    assert torch.equal(saved["weights"], torch.arange(6, dtype=torch.float32)) and saved["step"] == 7
    assert torch.equal(saved["moments"]["exp_avg"], torch.ones(3))
    assert saved["view"].untyped_storage().data_ptr() == saved["weights"].untyped_storage().data_ptr()  # as torch.save
    assert sorted(pending.digests) == ["model_states.pt", "optim_states.pt", "rng_state_0.pt"]
    assert pending.all_written()  # no process group: this rank alone
    with snapshot_saves(engine, buffers) as again:  # the next save reuses the host memory
        engine.checkpoint_engine.save({"step": 8}, str(tmp_path / "model_states.pt"))
    assert again.files[0][1] is buffers[0] and len(buffers) == 2
    assert torch.load(io.BytesIO(bytes(buffers[0].view()))) == {"step": 8}


@pytest.mark.fast
def test_a_failed_background_write_is_kept_for_the_training_thread(tmp_path):
    engine = _Engine()
    with snapshot_saves(engine, []) as snapshots:
        engine.checkpoint_engine.save({"x": torch.zeros(2)}, str(tmp_path / "missing" / "optim_states.pt"))
    pending = PendingSave("global_step1", 1, 0, str(tmp_path), snapshots.files, [],
                          lambda exc: f"{type(exc).__name__}: {exc.errno == errno.ENOENT}", None)
    pending.wait()
    assert pending.error == "FileNotFoundError: True" and not pending.digests


def _hashes(checkpoint: Path) -> dict[str, str]:
    return json.loads((checkpoint / MANIFEST_NAME).read_text())["hashes"]


def _leaves(value, path: str = "") -> list[tuple[str, object]]:
    """(path, leaf) of a loaded checkpoint file: tensors as they are, objects by their attributes."""
    if isinstance(value, dict):
        return [leaf for key in value for leaf in _leaves(value[key], f"{path}/{key}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, f"{path}[{i}]")]
    if not isinstance(value, torch.Tensor) and hasattr(value, "__dict__"):
        return _leaves(vars(value), path)
    return [(path, value)]


def _same_contents(first: Path, second: Path) -> None:
    a, b = (_leaves(torch.load(p, map_location="cpu", weights_only=False)) for p in (first, second))
    assert [p for p, _ in a] == [p for p, _ in b], first.name
    for (where, x), (_, y) in zip(a, b):
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y or (x != x and y != y)
        assert same, f"{first.name}{where}"


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_async_checkpoint_resumes_as_the_sync_one_and_a_failed_write_stops_every_rank(assets, tmp_path):
    common = ("train.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0", "checkpoint.save_final=false")
    sync, background, failing = tmp_path / "sync", tmp_path / "async", tmp_path / "failing"

    def run_args(mode: str, out: Path, *extra: str) -> list[str]:
        return [mode, *demo_args(assets, out, *common, *extra)[1:]]

    outputs = run_workers("checkpoint_async.py", 2, [
        *run_args("plain", sync), "--",
        *run_args("held", background, "checkpoint.async_save=true"), "--",
        *run_args("plain", background, "train.resume=global_step2", "checkpoint.async_save=true"), "--",
        *run_args("fail-rank1", failing, "checkpoint.async_save=true", "train.max_steps=6")], timeout=TIMEOUT)
    # the asynchronous save of step 2 was written after step 3 had changed the weights and Adam moments
    assert "writer of global_step2 starts after step 3" in outputs[0] + outputs[1]
    assert "checkpoint global_step2: snapshot of" in outputs[0]
    # its files hold what the synchronous save's hold: the step-2 fp32 weights, Adam moments, RNG states (the
    # bytes differ only in names: the zip archive's, and ZeRO-3's `ds_id` of each partition, numbered per process)
    got, want = _hashes(background / "global_step2"), _hashes(sync / "global_step2")
    assert got.keys() == want.keys() and len([n for n in got if n.endswith("optim_states.pt")]) == 2
    for name in got:
        if name.endswith("optim_states.pt") or name.startswith("rng_state_"):
            _same_contents(background / "global_step2" / name, sync / "global_step2" / name)
        elif name.startswith("hf/"):
            assert got[name] == want[name], name
    verify_checkpoint(str(background / "global_step2"))
    # the resume from it trains steps 3 and 4 as the synchronous run did
    assert f"resumed from {background / 'global_step2'} at step 2" in outputs[0]
    resumed, straight = _scalars(background / "tensorboard"), _scalars(sync / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm"):
        assert [s for s, _ in resumed[tag]] == [1, 2, 3, 4], tag
        assert [v for _, v in resumed[tag]] == [v for _, v in straight[tag]], tag
    # a background write that fails on rank 1: every rank stops with the one line at the next step boundary
    line = "saving checkpoint global_step4 (written in the background) failed on rank 1: no space left on"
    for output in outputs:
        assert f"RUN FAILED: {line}" in output, output[-3000:]
        assert "the previous checkpoint global_step2 is intact" in output
    assert (failing / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in failing.iterdir() if p.name.startswith("global_step")) == [
        "global_step2", "global_step4.partial"]
    verify_checkpoint(str(failing / "global_step2"))
    assert not os.path.exists(failing / "global_step6")


@pytest.mark.multiprocess
@pytest.mark.timeout(TIMEOUT + 60)
def test_kill_9_in_the_middle_of_a_background_write_keeps_the_previous_checkpoint(assets, tmp_path):
    out = tmp_path / "run"
    args = demo_args(assets, out, "checkpoint.every_n_steps=2", "checkpoint.keep_last=0",
                     "checkpoint.async_save=true")[1:]
    procs = start_ranks([sys.executable, str(WORKERS / "checkpoint_async.py"), "kill9", *args, "train.max_steps=6"], 2)
    outputs = [text for text, _ in finish_ranks(procs, TIMEOUT, "the killed run")]
    assert [proc.returncode for proc in procs] == [-9, -9], outputs
    assert all("killed while writing global_step4" in text for text in outputs)
    assert (out / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("global_step")) == [
        "global_step2", "global_step4.partial"]
    verify_checkpoint(str(out / "global_step2"))
    outputs = run_workers("checkpoint_async.py", 2, ["plain", *args, "train.resume=auto", "train.max_steps=4"],
                          timeout=TIMEOUT)
    assert f"resumed from {out / 'global_step2'} at step 2" in outputs[0]
    assert (out / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("global_step")) == ["global_step2", "global_step4"]
    verify_checkpoint(str(out / "global_step4"))
