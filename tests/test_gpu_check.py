"""The GPU check (tools/gpu_check.sh) on CPU with --tiny, so it cannot rot while no GPU runs it: every part
has a status and finite figures, the parts that need CUDA say so, the loss benchmark's methods compute the
losses of their references (torch CE, ntloss, the unchunked head), and a part that runs out of time is
recorded as such while the next part still runs. Timings are measured by the script, never asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from helpers.distributed import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

sys.path.insert(0, str(REPO_ROOT / "tools"))

import gpu_check  # noqa: E402


def run_check(tmp_path, *extra: str, timeout: float = 900) -> tuple[dict, str]:
    out = tmp_path / "gpu_check.json"
    command = ["bash", "tools/gpu_check.sh", "--cpu", "--tiny", "--out", str(out), "--workdir", str(tmp_path / "work"),
               "--master-port", str(free_port()), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(out.read_text()), completed.stdout


def numbers(value, path=""):
    """Every number in a JSON tree, with its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def test_every_part_runs_on_cpu_tiny(tmp_path):
    report, stdout = run_check(tmp_path)
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    for name, record in parts.items():
        assert record["status"] in gpu_check.STATUSES, (name, record)
        assert name in stdout  # the printed table has a line per part
    for path, value in numbers(report):
        assert math.isfinite(value), path
    expected_skips = {"sync_debug", "train_flash_attention_2"}  # need CUDA
    for name in set(parts) - expected_skips:
        assert parts[name]["status"] == "ok", (name, parts[name])
    sync = parts["sync_debug"]
    assert sync["status"] == "skipped" and sync["detail"].startswith("CPU")
    # what runs on CPU of it: the hooks that bracket each micro-batch's forward and backward saw both, in order
    assert sync["micro_batch_windows"] == sync["grad_accum_steps"] == gpu_check.TINY.grad_accum_steps == 2
    assert sync["micro_batch_windows_well_formed"] is True
    assert parts["train_flash_attention_2"]["status"] == "skipped"

    environment = parts["environment"]
    assert environment["cuda_available"] is False and environment["deepspeed_accelerator"] == "cpu"
    training = parts["train_sdpa"]
    sizes = gpu_check.TINY
    assert (training["zero_stage"], training["world_size"], training["attention"]) == (3, 1, "sdpa")
    assert training["steps"] == len(training["loss_curve"]) == sizes.curve_steps
    assert training["tokens_per_step"] == sizes.seq_len * sizes.micro_batch_size * sizes.grad_accum_steps
    assert training["vocab_size"] % sizes.pad_vocab_to_multiple_of == 0
    assert training["vocab_size"] >= training["tokenizer_size"]
    assert training["model_tflops_per_s"] == pytest.approx(
        training["model_flops_per_token"] * training["tokens_per_s"] / 1e12)
    assert training["mfu"] is None and training["peak_memory_gib"] > 0
    chunked = parts["chunked_head"]
    assert chunked["chunk_tokens"] == sizes.chunk_tokens and chunked["steps_each"] == sizes.chunked_steps // 2
    assert parts["generation"]["generated_tokens"] > 0 and parts["generation"]["prompts"] == sizes.eval_prompts
    ntl = parts["ntl_on_off"]  # tools/bench_train.py's own JSON, with the peak memory it now reports
    assert (ntl["zero_stage"], ntl["tp_size"], ntl["world_size"], ntl["measured_steps"]) == (3, 1, 1, sizes.ntl_steps)
    assert ntl["peak_memory_gib"] > 0

    bench = parts["loss_bench"]
    assert (bench["tokens"], bench["vocab"], bench["dtype"]) == (sizes.loss_tokens, sizes.loss_vocab, "float32")
    methods = bench["methods"]
    for name in ("ce", "ours_ce_only", "ours_was", "head_ce_only", "head_was", "chunked_ce_only", "chunked_was"):
        assert methods[name]["status"] == "ok", (name, methods[name])
    assert methods[gpu_check.LIGER_METHOD]["status"] == "skipped"
    # each method computes the loss of its reference on the same inputs (fp32 on CPU)
    compared = 0
    for name, reference in gpu_check.SAME_LOSS_AS.items():
        if methods.get(name, {}).get("status") == "ok":
            assert methods[name]["loss"] == pytest.approx(methods[reference]["loss"], rel=1e-5), name
            assert methods[name][f"loss_rel_diff_vs_{reference}"] < 1e-5
            compared += 1
    assert compared >= 3


def test_a_part_out_of_time_is_recorded_and_the_next_still_runs(tmp_path):
    report, _ = run_check(tmp_path, "--parts", "ntl_on_off", "loss_bench", "--part-budget", "ntl_on_off=3",
                          timeout=300)
    parts = report["parts"]
    assert list(parts) == ["ntl_on_off", "loss_bench"]
    assert parts["ntl_on_off"]["status"] == "timeout" and "3 s" in parts["ntl_on_off"]["detail"]
    assert parts["loss_bench"]["status"] == "ok"


def test_part_budget_errors_name_the_fix():
    args = gpu_check.parse_args(["--part-budget", "nope=3"])
    with pytest.raises(SystemExit, match="NAME=SECONDS"):
        gpu_check.part_budgets(args)
    args = gpu_check.parse_args(["--part-budget", "loss_bench=soon"])
    with pytest.raises(SystemExit, match="not a number"):
        gpu_check.part_budgets(args)
