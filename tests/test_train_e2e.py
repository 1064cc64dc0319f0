"""End to end: the literal launcher commands with 2 CPU processes, ZeRO-3, AutoTP T=2 and T=1.

One T=2 run of configs/demo.yaml (through `deepspeed launch/pretrain.sh`) is checked for several things:
TensorBoard tags read back with tensorboard's event reader, losses finite and falling, the run folder,
the checkpoint. A T=1 run of the same config (through `deepspeed --hostfile` naming localhost) must give
the same losses for the first steps. `bash launch/pretrain.sh` then refuses the first run's folder.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

from ntl_pretrain.monitor import STEP_TAGS, VAL_TAGS
from distributed import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 420  # a hang (a rank waiting on a dead one) fails the test instead of blocking the suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]



def _env() -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "configs/demo.yaml",
            f"data.sources.0.path={assets / 'arithmetic.jsonl'}", "data.sources.0.generate_arithmetic=3000",
            f"tokenizer.name_or_path={assets / 'tokenizer'}", f"data.cache_dir={assets / 'cache'}",
            "data.validation_documents=100", f"train.output_dir={out}", "train.log_every_n_steps=1",
            "monitor.progress_bar=never", *extra]


def _run(command: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    return result


def _scalars(tensorboard_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    scalars = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    return scalars, accumulator.Tags()["tensors"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo_assets")


@pytest.fixture(scope="module")
def tp2_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "run"
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.sh",
               *_overrides(assets, out, "train.max_steps=16", "train.val_every_n_steps=8",
                           "eval.at_end=true", "eval.arithmetic_n=4", "eval.arithmetic_splits=[interpolation]",
                           "eval.arithmetic_train_digits=[1, 2]", "eval.arithmetic_extrapolation_digits=[3, 3]")]
    result = _run(command)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out, result


def test_tensorboard_has_every_tag_and_losses_fall(tp2_run):
    out, result = tp2_run
    scalars, tensors = _scalars(out / "tensorboard")
    for tag in list(STEP_TAGS) + list(VAL_TAGS):
        assert tag in scalars, f"{tag} missing from TensorBoard ({sorted(scalars)})"
        assert all(math.isfinite(v) for _, v in scalars[tag]), tag
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 17))
    assert [s for s, _ in scalars["val/loss"]] == [8, 16]
    assert any(t.startswith("config") for t in tensors)
    ce = [v for _, v in scalars["train/ce"]]
    ntl = [v for _, v in scalars["train/ntl"]]
    assert sum(ce[-4:]) / 4 < ce[0] - 1.0, ce
    assert sum(ntl[-4:]) / 4 < ntl[0] - 0.1, ntl
    assert scalars["val/ce"][1][1] < scalars["val/ce"][0][1]
    # loss = CE + lambda * NTL, as logged
    lam = scalars["train/ntl_lambda"][0][1]
    assert lam == pytest.approx(0.3)
    for (_, loss), (_, c), (_, n) in zip(scalars["train/loss"], scalars["train/ce"], scalars["train/ntl"]):
        assert loss == pytest.approx(c + lam * n, rel=1e-5)
    share = [v for _, v in scalars["train/number_token_share"]]
    assert all(0.2 < s < 0.9 for s in share)  # an arithmetic corpus: many label positions are digits
    assert any(tag.startswith("eval/arith") for tag in scalars)  # the evaluation hook ran at the end
    assert "step 16:" in result.stdout  # plain log lines when stdout is not a terminal


def test_run_folder_holds_config_and_checkpoint(tp2_run):
    out, _ = tp2_run
    from ntl_pretrain.config import load_config

    resolved = load_config(out / "config.yaml")
    assert resolved.parallel.tp_size == 2 and resolved.parallel.zero_stage == 3 and resolved.train.max_steps == 16
    assert (out / "latest").read_text().strip() == "global_step16"
    files = os.listdir(out / "global_step16")
    assert any("mp_rank_00" in f for f in files) and any("mp_rank_01" in f for f in files)  # one file set per TP rank
    assert (out / "number_vocab.json").is_file() and (out / "ds_config.json").is_file()
    assert not [p for p in out.rglob("*.tmp*")]


def test_tp1_through_a_localhost_hostfile_matches_tp2(tp2_run, assets, tmp_path):
    out2, _ = tp2_run
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out1 = tmp_path / "run"
    # the same global batch: T=2 has 1 DP rank x 8 sequences, T=1 has 2 DP ranks x 4
    command = ["deepspeed", "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "launch/pretrain.sh",
               *_overrides(assets, out1, "parallel.tp_size=1", "data.micro_batch_size=4", "train.max_steps=4",
                           "train.val_every_n_steps=-1", "checkpoint.save_final=false")]
    result = _run(command)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "dp=2 tp=1 zero=3" in result.stdout
    tp1, _ = _scalars(out1 / "tensorboard")
    tp2, _ = _scalars(out2 / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae"):
        got = [v for _, v in tp1[tag]]
        want = [v for _, v in tp2[tag][:4]]
        assert got == pytest.approx(want, rel=2e-4, abs=1e-6), tag


def test_zero0_with_gradient_accumulation_matches_zero3(tp2_run, assets, tmp_path):
    """No ZeRO, T=2, the same global batch as 2 micro-batches of 4: the same losses and gradient norms."""
    out2, _ = tp2_run
    out = tmp_path / "run"
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.sh",
               *_overrides(assets, out, "parallel.zero_stage=0", "data.micro_batch_size=4", "train.grad_accum_steps=2",
                           "train.max_steps=4", "train.val_every_n_steps=-1", "checkpoint.save_final=false")]
    result = _run(command)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "dp=1 tp=2 zero=0 micro_batch=4 grad_accum=2" in result.stdout
    zero0, _ = _scalars(out / "tensorboard")
    zero3, _ = _scalars(out2 / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm"):
        got = [v for _, v in zero0[tag]]
        want = [v for _, v in zero3[tag][:4]]
        assert got == pytest.approx(want, rel=2e-4, abs=1e-6), tag


def test_bash_form_refuses_a_folder_with_another_runs_checkpoints(tp2_run, assets):
    out, _ = tp2_run
    before = sorted(str(p) for p in out.rglob("*"))
    env_args = f"--master_port {free_port()}"
    result = subprocess.run(["bash", "launch/pretrain.sh", *_overrides(assets, out, "train.max_steps=2")], cwd=REPO,
                            env=dict(_env(), NTL_DEEPSPEED_ARGS=env_args), capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode != 0
    assert "no GPU found: starting 2 CPU processes" in result.stderr
    assert "already holds checkpoints of another run (global_step16)" in result.stdout + result.stderr
    assert sorted(str(p) for p in out.rglob("*")) == before


def test_bash_form_resumes_the_run(tp2_run, assets, tmp_path):
    import shutil

    import torch

    source, _ = tp2_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    env_args = f"--master_port {free_port()}"
    result = subprocess.run(["bash", "launch/pretrain.sh", *_overrides(assets, out, "train.max_steps=18",
                                                                       "train.resume=auto", "train.val_every_n_steps=-1",
                                                                       "eval.at_end=false",
                                                                       "checkpoint.resume_lr_schedule=replan")],
                            cwd=REPO, env=dict(_env(), NTL_DEEPSPEED_ARGS=env_args), capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "training steps 17..18" in result.stdout
    scalars, _ = _scalars(out / "tensorboard")
    assert sorted({s for s, _ in scalars["train/loss"]}) == list(range(1, 19))  # continues, no duplicate step
    assert (out / "latest").read_text().strip() == "global_step18"
    state = torch.load(out / "global_step18" / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    assert state["step"] == 18 and state["data"]["position"] == 18 * 8  # 8 sequences per step, none repeated
    # resuming a finished run does nothing and leaves its checkpoints alone
    before = {str(p): p.stat().st_mtime_ns for p in (out / "global_step18").iterdir()}
    again = subprocess.run(["bash", "launch/pretrain.sh", *_overrides(assets, out, "train.max_steps=18",
                                                                      "train.resume=auto", "eval.at_end=false")],
                           cwd=REPO, env=dict(_env(), NTL_DEEPSPEED_ARGS=f"--master_port {free_port()}"),
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "nothing to do: the run is at step 18" in again.stdout
    assert {str(p): p.stat().st_mtime_ns for p in (out / "global_step18").iterdir()} == before
