"""End to end: the literal launcher commands with 2 CPU processes, ZeRO-3, AutoTP T=2 and T=1.

One T=2 run of configs/demo.yaml (through `deepspeed launch/pretrain.sh`) is checked for several things:
TensorBoard tags read back with tensorboard's event reader, losses finite and falling, the run folder,
the checkpoint. A T=1 run of the same config (through `deepspeed --hostfile` naming localhost) must give
the same losses for the first steps, and so must the run with the chunked head and a Ulysses sp=2 run (then
resumed at sp=1). The logged loss of a step is
recomputed in one process with plain torch and ntloss. `bash launch/pretrain.sh` then refuses the first run's
folder.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

from helpers.launch import demo_args, deepspeed_command, launch_env, run, run_ok
from helpers.distributed import free_port
from helpers.documents import document_slices
from helpers.tensorboard import scalars as read_scalars, tensor_tags
from ntl_pretrain.observability.monitor import STEP_TAGS, VAL_TAGS

TIMEOUT = 420  # a hang (a rank waiting on a dead one) fails the test instead of blocking the suite
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(3 * TIMEOUT)]


def _bash_env() -> dict:
    """`bash launch/pretrain.sh` on CPU: its DeepSpeed runner on a free port."""
    return launch_env(NTL_DEEPSPEED_ARGS=f"--master_port {free_port()}")


@pytest.fixture(scope="module")
def tp2_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "run"
    # a checkpoint at step 15 too: the weights that computed step 16's logged loss
    result = run_ok(deepspeed_command(2, *demo_args(
        assets, out, "train.max_steps=16", "train.val_every_n_steps=8", "checkpoint.every_n_steps=15",
        "eval.at_end=true", "eval.arithmetic_n=4", "eval.arithmetic_splits=[interpolation]",
        "eval.arithmetic_train_digits=[1, 2]", "eval.arithmetic_extrapolation_digits=[3, 3]")), timeout=TIMEOUT)
    return out, result


def test_tensorboard_has_every_tag_and_losses_fall(tp2_run):
    out, result = tp2_run
    scalars, tensors = read_scalars(out / "tensorboard"), tensor_tags(out / "tensorboard")
    # MFU needs the device's peak (throughput.py's table of GPUs); these CPU ranks have none, so it is never written
    assert "train/mfu" not in scalars
    for tag in [tag for tag in STEP_TAGS if tag != "train/mfu"] + list(VAL_TAGS):
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
    assert [v for _, v in scalars["train/ntl_lambda"]] == pytest.approx([0.3] * 16)
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


def test_logged_loss_equals_an_independent_computation(tp2_run, tmp_path):
    """Step 16's train/loss, train/ce and train/ntl recomputed in one process without the trainer's loss code:
    the step-15 checkpoint exported to Hugging Face (the weights step 16 started from), step 16's batch
    taken from the run's data stream, the model on each of its documents alone (data.document_mask), CE from
    torch's cross_entropy and NTL-WAS from the ntloss package."""
    import ntloss
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ntl_pretrain.config import load_config
    from ntl_pretrain.data import PretrainingData

    out, _ = tp2_run
    export = tmp_path / "hf"
    run_ok([sys.executable, "tools/export_hf.py", str(out / "global_step15"), str(export)], timeout=TIMEOUT)
    cfg = load_config(out / "config.yaml")
    assert cfg.loss.variant == "was" and not cfg.loss.reweigh and cfg.loss.ntl_schedule == "constant"
    tokenizer = AutoTokenizer.from_pretrained(export)
    data = PretrainingData.build(cfg.data, tokenizer, dp_rank=0, dp_size=1)  # T=2: one data-parallel rank
    data.position = 15 * cfg.data.micro_batch_size * cfg.train.grad_accum_steps
    (batch,) = data.next_step(cfg.train.grad_accum_steps)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert cfg.data.document_mask  # the demo's: attention inside each packed document, so each runs alone here
    logits = torch.empty(*batch.input_ids.shape, model.config.vocab_size)
    with torch.no_grad():
        for b, row in enumerate(batch.input_ids):
            for part in document_slices(row, tokenizer.eos_token_id):
                logits[b, part] = model(input_ids=row[part].unsqueeze(0)).logits[0]
    ce = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100).item()
    ntl = ntloss.NTLoss(tokenizer, vocab_size=logits.shape[-1], digit_level=True, reweigh=False)(
        logits, batch.labels).item()
    logged = {tag: dict(points)[16] for tag, points in read_scalars(out / "tensorboard").items()}
    assert logged["train/ce"] == pytest.approx(ce, rel=1e-5)
    assert logged["train/ntl"] == pytest.approx(ntl, rel=1e-5)
    assert logged["train/loss"] == pytest.approx(ce + cfg.loss.ntl_weight * ntl, rel=1e-5)


def test_chunked_head_logs_the_same_losses(tp2_run, assets, tmp_path):
    """`loss.chunk_tokens` (the head + loss over chunks of 100 of the 8 x 128 tokens of a micro-batch: they do
    not divide them) logs the same losses, grad norms and validation loss as the run on the full logits."""
    from ntl_pretrain.config import load_config

    full_run, _ = tp2_run
    out = tmp_path / "run"
    run_ok(deepspeed_command(2, *demo_args(assets, out, "loss.chunk_tokens=100", "train.max_steps=8",
                                           "train.val_every_n_steps=8", "checkpoint.save_final=false")), timeout=TIMEOUT)
    assert load_config(out / "config.yaml").loss.chunk_tokens == 100
    # the first 8 steps of both runs see the same lr: the demo's warm-up is 10 steps, whatever max_steps
    chunked, full = read_scalars(out / "tensorboard"), read_scalars(full_run / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae", "val/loss", "val/ntl"):
        got, want = chunked[tag], full[tag][:len(chunked[tag])]
        assert [s for s, _ in got] == ([8] if tag.startswith("val/") else list(range(1, 9))), tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=2e-4, abs=1e-6), tag


def test_tp1_through_a_localhost_hostfile_matches_tp2(tp2_run, assets, tmp_path):
    out2, _ = tp2_run
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out1 = tmp_path / "run"
    # the same global batch: T=2 has 1 DP rank x 8 sequences, T=1 has 2 DP ranks x 4
    command = ["deepspeed", "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "launch/pretrain.sh",
               *demo_args(assets, out1, "parallel.tp_size=1", "data.micro_batch_size=4", "train.max_steps=4",
                          "checkpoint.save_final=false")]
    result = run_ok(command, timeout=TIMEOUT)
    assert "dp=2 tp=1 zero=3" in result.stdout
    tp1, tp2 = read_scalars(out1 / "tensorboard"), read_scalars(out2 / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae"):
        got = [v for _, v in tp1[tag]]
        want = [v for _, v in tp2[tag][:4]]
        assert got == pytest.approx(want, rel=2e-4, abs=1e-6), tag


def test_sequence_parallel_run_matches_tp2_and_resumes_without_it(tp2_run, assets, tmp_path):
    """Ulysses sp=2 through `bash launch/pretrain.sh` (the same global batch: dp=1 x 8 sequences, each split over 2
    ranks) logs the T=2 run's losses and gradient norms, validates and generates (the evaluation at the end); its
    checkpoint then resumes at sp=1 (dp=2 x 4, the same ZeRO partitioning) and continues as the T=2 run does."""
    out2, _ = tp2_run
    out = tmp_path / "run"
    result = run_ok(["bash", "launch/pretrain.sh", *demo_args(
        assets, out, "parallel.sp_size=2", "parallel.tp_size=1", "train.max_steps=4", "train.val_every_n_steps=4",
        "eval.at_end=true", "eval.arithmetic_n=4", "eval.arithmetic_splits=[interpolation]")],
        env=_bash_env(), timeout=TIMEOUT)
    assert "dp=1 sp=2 tp=1 zero=3 micro_batch=8" in result.stdout
    assert "step 4: evaluation eval/arith/interpolation/accuracy=" in result.stdout
    resumed = run_ok(["bash", "launch/pretrain.sh", *demo_args(
        assets, out, "parallel.tp_size=1", "data.micro_batch_size=4", "train.max_steps=6", "train.resume=auto",
        "checkpoint.resume_lr_schedule=replan")], env=_bash_env(), timeout=TIMEOUT)
    assert "training steps 5..6: dp=2 tp=1" in resumed.stdout
    sp, tp2 = read_scalars(out / "tensorboard"), read_scalars(out2 / "tensorboard")
    assert [s for s, _ in sp["val/loss"]] == [4] and math.isfinite(sp["val/loss"][0][1])
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm", "train/number_mae"):
        assert [s for s, _ in sp[tag]] == list(range(1, 7)), tag
        # the lr of steps 1-6 is the warm-up's whatever max_steps: the T=2 run's steps 1-6 are the reference
        assert [v for _, v in sp[tag]] == pytest.approx([v for _, v in tp2[tag][:6]], rel=2e-4, abs=1e-6), tag


def test_zero0_with_gradient_accumulation_matches_zero3(tp2_run, assets, tmp_path):
    """No ZeRO, T=2, the same global batch as 2 micro-batches of 4: the same losses and gradient norms."""
    out2, _ = tp2_run
    out = tmp_path / "run"
    result = run_ok(deepspeed_command(2, *demo_args(
        assets, out, "parallel.zero_stage=0", "data.micro_batch_size=4", "train.grad_accum_steps=2",
        "train.max_steps=4", "checkpoint.save_final=false")), timeout=TIMEOUT)
    assert "dp=1 tp=2 zero=0 micro_batch=4 grad_accum=2" in result.stdout
    zero0, zero3 = read_scalars(out / "tensorboard"), read_scalars(out2 / "tensorboard")
    for tag in ("train/loss", "train/ce", "train/ntl", "train/grad_norm"):
        got = [v for _, v in zero0[tag]]
        want = [v for _, v in zero3[tag][:4]]
        assert got == pytest.approx(want, rel=2e-4, abs=1e-6), tag


def test_bash_form_refuses_a_folder_with_another_runs_checkpoints(tp2_run, assets):
    out, _ = tp2_run
    before = sorted(str(p) for p in out.rglob("*"))
    result = run(["bash", "launch/pretrain.sh", *demo_args(assets, out, "train.max_steps=2")], env=_bash_env(),
                 timeout=TIMEOUT)
    assert result.returncode != 0
    assert "no GPU found: starting 2 CPU processes" in result.stderr
    assert "already holds checkpoints of another run (global_step15, global_step16)" in result.stdout + result.stderr
    assert sorted(str(p) for p in out.rglob("*")) == before


def test_bash_form_resumes_the_run(tp2_run, assets, tmp_path):
    import shutil

    import torch

    source, _ = tp2_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    result = run_ok(["bash", "launch/pretrain.sh", *demo_args(assets, out, "train.max_steps=18", "train.resume=auto",
                                                               "checkpoint.resume_lr_schedule=replan")],
                    env=_bash_env(), timeout=TIMEOUT)
    assert "training steps 17..18" in result.stdout
    # lines a user cannot act on (issue 36 item 6): the runner's hostfile warning on one node, AutoTP's note that
    # the vocabulary-sharded head the trainer asks for replaces its preset's split, datasets' bars in a log file
    output = result.stdout + result.stderr
    for line in ("Unable to find hostfile", "vocab_parallel_lm_head supersedes", "Generating train split"):
        assert line not in output, line
    scalars = read_scalars(out / "tensorboard")
    assert sorted({s for s, _ in scalars["train/loss"]}) == list(range(1, 19))  # continues, no duplicate step
    assert (out / "latest").read_text().strip() == "global_step18"
    state = torch.load(out / "global_step18" / "zero_pp_rank_0_mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    assert state["step"] == 18 and state["data"]["position"] == 18 * 8  # 8 sequences per step, none repeated
    # resuming a finished run does nothing and leaves its checkpoints alone
    before = {str(p): p.stat().st_mtime_ns for p in (out / "global_step18").iterdir()}
    again = run_ok(["bash", "launch/pretrain.sh", *demo_args(assets, out, "train.max_steps=18", "train.resume=auto")],
                   env=_bash_env(), timeout=TIMEOUT)
    assert "nothing to do: the run is at step 18" in again.stdout
    assert {str(p): p.stat().st_mtime_ns for p in (out / "global_step18").iterdir()} == before
