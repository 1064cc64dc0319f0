"""Trust and integrity of checkpoints (issue 13 items 1, 2, 7, 8), on a real 2-process run (T=1, ZeRO-1).

- item 1: a crafted pickle (os.system creating a marker file) in rng_state_0.pt under train.resume=auto,
  and in the model states under tools/export_hf.py, never runs, with a clear error; the manifest is
  updated with the file's size and hash, as an attacker would;
- item 2: the manifest names its content hash (xxh3_128) and records it for each file (checked here with
  xxhash itself); a shard corrupted in place (same size) is skipped by resume=auto with a warning naming
  it, and is an error for its tag;
- item 7: the start-up cleanup removes our own interrupted saves and nothing else of the run folder;
- item 8: a resume with another train.max_steps stops unless checkpoint.resume_lr_schedule says keep
  or replan (checked against DeepSpeed's own scheduler), and another data configuration is refused
  unless checkpoint.allow_data_change=true (data.stages: only a change of the steps already trained).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from ntl_pretrain.checkpoint import MANIFEST_NAME, CheckpointError, resolve_resume

from helpers.launch import REPO, demo_args, deepspeed_command, launch_env, run as run_command  # noqa: E402
from helpers.tensorboard import scalars  # noqa: E402

TIMEOUT = 400
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT)]
LR, MIN_RATIO = 3.0e-3, 0.1


def _args(assets: Path, out: Path, *extra: str) -> list[str]:
    return demo_args(assets, out, "parallel.tp_size=1", "parallel.zero_stage=1", "data.micro_batch_size=4",
                     "optim.warmup_steps=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", *extra)


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return run_command(deepspeed_command(2, *args), timeout=TIMEOUT)


def _lr_scalars(tensorboard_dir: Path) -> dict[int, float]:
    return dict(scalars(tensorboard_dir)["train/lr"])


def _deepspeed_lr(total_steps: int, step: int) -> float:
    """The lr DeepSpeed's WarmupCosineLR gives optimizer step `step` (from 1) of the demo's schedule: its
    iteration `step` (the trainer starts the scheduler at 1; DeepSpeed's own start, -1 and 0, has lr 0), with the
    floor one step past the last (the trainer gives DeepSpeed total_num_steps = max_steps + 2)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = WarmupCosineLR(optimizer, total_num_steps=max(total_steps, 2) + 2, warmup_num_steps=1,
                               warmup_min_ratio=0.0, cos_min_ratio=MIN_RATIO, warmup_type="linear",
                               last_batch_iteration=step)
    return scheduler.get_lr()[0]


@pytest.fixture(scope="module")
def run(assets, tmp_path_factory) -> Path:
    """3 steps, a checkpoint after each; the folder already holds a user's `*.partial` / `*.replaced`
    entries and an interrupted save of ours."""
    out = tmp_path_factory.mktemp("trust") / "run"
    (out / "mydata.partial").mkdir(parents=True)
    (out / "mydata.partial" / "keep.txt").write_text("user data")
    (out / "global_step7.replaced").mkdir()  # our pattern, but not made by us (no marker)
    (out / "notes.replaced").write_text("user notes")
    (out / "global_step9.partial").mkdir()  # an interrupted save of ours (checkpoint.make_staging's marker)
    (out / "global_step9.partial" / ".ntl_staging").write_text("made by ntl_pretrain.checkpoint")
    result = _launch(_args(assets, out, "train.max_steps=3"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out


def _copy(run: Path, tmp_path: Path, tags=("global_step2", "global_step3")) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    for tag in tags:
        shutil.copytree(run / tag, out / tag)
    (out / "latest").write_text(tags[-1])
    return out


def _rewrite_manifest(folder: Path, name: str) -> None:
    """What an attacker would do after replacing a file: record its new size and hash."""
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["files"][name] = (folder / name).stat().st_size
    manifest["hashes"][name] = xxhash.xxh3_128((folder / name).read_bytes()).hexdigest()
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---------------------------------------------------------------------------------------------- item 7
def test_cleanup_removes_only_our_own_interrupted_saves(run):
    assert (run / "mydata.partial" / "keep.txt").read_text() == "user data"
    assert (run / "notes.replaced").read_text() == "user notes"
    assert (run / "global_step7.replaced").is_dir()
    assert not (run / "global_step9.partial").exists()
    assert sorted(p.name for p in run.glob("global_step*")) == ["global_step1", "global_step2", "global_step3",
                                                                "global_step7.replaced"]


# ---------------------------------------------------------------------------------------------- item 2
def test_manifest_records_the_content_hash_of_every_file(run):
    manifest = json.loads((run / "global_step3" / MANIFEST_NAME).read_text())
    assert manifest["format"] == 3 and manifest["hash_algorithm"] == "xxh3_128"
    assert set(manifest["hashes"]) == set(manifest["files"])
    files = sorted(str(p.relative_to(run / "global_step3")) for p in (run / "global_step3").rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME)
    assert sorted(manifest["files"]) == files
    for name in files:
        assert manifest["hashes"][name] == xxhash.xxh3_128((run / "global_step3" / name).read_bytes()).hexdigest(), name


def test_a_shard_corrupted_in_place_is_skipped_by_auto_and_an_error_for_its_tag(run, tmp_path, caplog):
    out = _copy(run, tmp_path)
    shard = out / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as handle:  # 4 KB of random bytes in the middle, same size
        handle.seek(size // 2)
        handle.write(os.urandom(4096))
    assert shard.stat().st_size == size
    with caplog.at_level(logging.WARNING, logger="ntl_pretrain"):
        assert resolve_resume(str(out), "auto") == "global_step2"
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt differs from what was written" in caplog.text
    with pytest.raises(CheckpointError, match=r"global_step3' is damaged: the content of "
                                              r"zero_pp_rank_1_mp_rank_00_optim_states.pt differs"):
        resolve_resume(str(out), "global_step3")
    result = subprocess.run([sys.executable, "tools/export_hf.py", str(out / "global_step3"), str(tmp_path / "hf")],
                            cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2 and "differs from what was written" in result.stderr
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------- item 1
def test_code_in_the_rng_state_does_not_run_on_resume(run, assets, tmp_path):
    out = _copy(run, tmp_path)
    marker = tmp_path / "PWNED"
    torch.save({"python": _Payload(marker)}, out / "global_step3" / "rng_state_0.pt")
    _rewrite_manifest(out / "global_step3", "rng_state_0.pt")
    result = _launch(_args(assets, out, "train.max_steps=4", "train.resume=auto"))
    output = result.stdout + result.stderr
    assert not marker.exists()
    assert result.returncode != 0
    assert "error: checkpoint" in output and "rng_state_0.pt holds pickled Python objects that a weights-only load " \
                                              "refuses (posix.system)" in output, output[-4000:]
    assert not (out / "global_step4").exists()


def test_code_in_the_model_states_does_not_run_on_export(run, tmp_path):
    out = _copy(run, tmp_path, tags=("global_step3",))
    marker = tmp_path / "PWNED"
    states = out / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(states, weights_only=False)
    state["payload"] = _Payload(marker)
    torch.save(state, states)
    _rewrite_manifest(out / "global_step3", "mp_rank_00_model_states.pt")
    result = subprocess.run([sys.executable, "tools/export_hf.py", str(out / "global_step3"), str(tmp_path / "hf")],
                            cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert not marker.exists()
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mp_rank_00_model_states.pt holds pickled Python objects that a weights-only load refuses" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_weights_only_loads_override_deepspeeds_own_unsafe_calls(tmp_path):
    """The guard itself, without the static pre-check: torch.load(weights_only=False), as DeepSpeed's
    engine and ds_to_universal call it, refuses the payload inside `weights_only_loads`."""
    from ntl_pretrain.checkpoint import UnsafeCheckpointError, weights_only_loads

    marker = tmp_path / "PWNED"
    path = tmp_path / "payload.pt"
    torch.save({"x": _Payload(marker)}, path)
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False)
    assert not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored on exit
    assert issubclass(UnsafeCheckpointError, CheckpointError)


# ---------------------------------------------------------------------------------------------- item 8
def test_another_max_steps_stops_unless_the_schedule_choice_is_given(run, assets, tmp_path):
    from ntl_pretrain.checkpoint import CheckpointManager, lr_schedule_description
    from ntl_pretrain.data import data_description
    from ntl_pretrain.config import load_config
    from ntl_pretrain.parallel.layout import ParallelLayout
    from ntl_pretrain.trainer.ds_config import deepspeed_config

    out = _copy(run, tmp_path)
    saved = json.loads((out / "global_step3" / MANIFEST_NAME).read_text())
    layout = ParallelLayout.of(2, 0, 0, tp_size=1)

    def manager(*overrides: str) -> CheckpointManager:
        cfg = load_config(str(REPO / "configs" / "demo.yaml"), _args(assets, out, *overrides)[2:])
        return CheckpointManager(cfg.checkpoint, str(out), layout, 1, saved["fingerprint"], seed=cfg.train.seed,
                                 data=data_description(cfg.data),
                                 lr_schedule=lr_schedule_description(deepspeed_config(cfg, on_cpu=True)))

    assert manager("train.max_steps=3").resume_lr_schedule("global_step3") is None  # unchanged
    with pytest.raises(CheckpointError, match=r"another learning-rate schedule than this run's \(deepspeed.scheduler."
                                              r"params.total_num_steps: 5 -> 8\): lr of step 4 is .* Choose: "
                                              r"checkpoint.resume_lr_schedule=keep .* or =replan"):
        manager("train.max_steps=6").resume_lr_schedule("global_step3")
    assert manager("train.max_steps=6", "checkpoint.resume_lr_schedule=replan").resume_lr_schedule("global_step3") is None
    kept = manager("train.max_steps=6", "checkpoint.resume_lr_schedule=keep").resume_lr_schedule("global_step3")
    assert kept == saved["lr_schedule"]
    # the data configuration: another held-out count or weight is refused, unless allowed
    assert manager().plan_resume("global_step3") == "global_step3"
    with pytest.raises(CheckpointError, match=r"another data configuration than this run's \(data.validation_documents"
                                              r": 100 -> 90\).*checkpoint.allow_data_change=true"):
        manager("data.validation_documents=90").plan_resume("global_step3")
    with pytest.raises(CheckpointError, match=r"data.sources.0.weight: 1.0 -> 2.0"):
        manager("data.sources.0.weight=2.0").plan_resume("global_step3")
    assert manager("data.validation_documents=90", "checkpoint.allow_data_change=true").plan_resume(
        "global_step3") == "global_step3"
    # data.stages added by the resume: from step 4 on, a planned edit; from step 3, a change of what was trained
    assert manager("data.stages=[{start_step: 1, weights: [1.0]}, {start_step: 4, weights: [2.0]}]").plan_resume(
        "global_step3") == "global_step3"
    with pytest.raises(CheckpointError, match=r"trained steps 1-3 with data stages that this run changes \(data.stages.1: "
                                              r"none -> from step 3, weights \[2.0\]\)"):
        manager("data.stages=[{start_step: 1, weights: [1.0]}, {start_step: 3, weights: [2.0]}]").plan_resume(
            "global_step3")
    # the attention mode (data.document_mask): a switch is refused in one line naming the key, unless allowed
    with pytest.raises(CheckpointError, match=r"trained with data.document_mask=true, this run sets "
                                              r"data.document_mask=false: resume with data.document_mask=true, or set "
                                              r"checkpoint.allow_data_change=true"):
        manager("data.document_mask=false").plan_resume("global_step3")
    assert manager("data.document_mask=false", "checkpoint.allow_data_change=true").plan_resume(
        "global_step3") == "global_step3"


@pytest.mark.parametrize("choice", ["keep", "replan"])
def test_resume_with_more_steps_follows_the_chosen_schedule(choice, run, assets, tmp_path):
    reference = _lr_scalars(run / "tensorboard")
    assert [reference[s] for s in (1, 2, 3)] == pytest.approx([_deepspeed_lr(3, s) for s in (1, 2, 3)], rel=1e-6)
    out = _copy(run, tmp_path)
    shutil.copytree(run / "tensorboard", out / "tensorboard")
    result = _launch(_args(assets, out, "train.max_steps=5", "train.resume=auto",
                           f"checkpoint.resume_lr_schedule={choice}"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"checkpoint.resume_lr_schedule={choice}" in result.stdout + result.stderr
    got = _lr_scalars(out / "tensorboard")
    total = 3 if choice == "keep" else 5  # keep: the saved 3-step cosine, then its final lr
    assert [got[s] for s in (4, 5)] == pytest.approx([_deepspeed_lr(total, s) for s in (4, 5)], rel=1e-6)
    if choice == "keep":
        assert got[5] == pytest.approx(LR * MIN_RATIO, rel=1e-6)
