"""The reproduction: its three configs differ only in the loss, and tools/run_repro.py runs real (tiny)
training runs through `launch/pretrain.sh`, then writes a results JSON, a markdown block and a PNG that
agree with the runs' own prediction files."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import run_repro  # noqa: E402

from ntl_pretrain.config import load_config  # noqa: E402

REPRO_CONFIGS = ("ce", "ntl_was", "ntl_mse")


def test_repro_configs_differ_only_in_the_loss_and_output_dir():
    configs = {name: asdict(load_config(REPO_ROOT / "configs" / "repro" / f"{name}.yaml")) for name in REPRO_CONFIGS}
    assert configs["ce"]["loss"]["enabled"] is False
    assert (configs["ntl_was"]["loss"]["enabled"], configs["ntl_was"]["loss"]["variant"]) == (True, "was")
    assert (configs["ntl_mse"]["loss"]["enabled"], configs["ntl_mse"]["loss"]["variant"]) == (True, "mse")
    assert configs["ntl_was"]["loss"]["ntl_weight"] == configs["ntl_mse"]["loss"]["ntl_weight"] > 0
    for config in configs.values():
        config.pop("loss")
        config["train"].pop("output_dir")
    assert configs["ce"] == configs["ntl_was"] == configs["ntl_mse"]
    # the evaluation's operand lengths are the training corpus's
    options = configs["ce"]["data"]["sources"][0]["generate_options"]
    assert list(options["train_digits"]) == configs["ce"]["eval"]["arithmetic_train_digits"]
    assert list(options["ops"]) == configs["ce"]["eval"]["arithmetic_ops"]


def test_sign_test_matches_scipy():
    import scipy.stats as scipy_stats  # a dev dependency: missing, the test fails (never skips)
    for wins, losses in ((0, 0), (0, 5), (3, 9), (12, 10), (40, 22)):
        expected = scipy_stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
        assert run_repro.sign_test_p(wins, losses) == pytest.approx(expected, rel=1e-12)


@pytest.mark.multiprocess
def test_run_repro_tiny_runs_write_table_json_and_png(tmp_path):
    import matplotlib  # noqa: F401  (a dev dependency: missing, the test fails)
    results_md = tmp_path / "results.md"
    results_md.write_text("# Results\n\nText the script keeps.\n")
    tiny = [f"data.sources.0.path={tmp_path / 'arith.jsonl'}", "data.sources.0.generate_arithmetic=400",
            f"tokenizer.name_or_path={tmp_path / 'tok'}", "tokenizer.train_vocab_size=300",
            "model.architecture.hidden_size=32", "model.architecture.intermediate_size=64",
            "model.architecture.num_hidden_layers=1", "data.seq_len=32", "data.micro_batch_size=2",
            "data.validation_documents=20", "train.max_steps=2", "train.val_every_n_steps=-1",
            "eval.every_n_steps=0", "eval.arithmetic_n=4", "eval.batch_size=8", "eval.arithmetic_max_new_tokens=4"]
    command = [sys.executable, str(REPO_ROOT / "tools" / "run_repro.py"), "--configs", "ce", "ntl_was",
               "--out-dir", str(tmp_path / "runs"), "--results-md", str(results_md), "--figure",
               str(tmp_path / "repro.png"), "--nice", "0", *tiny]
    subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=240, capture_output=True, text=True)

    report = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert [(run["config"], run["seed"]) for run in report["runs"]] == [("ce", 1234), ("ntl_was", 1234)]
    records = {}
    for run in report["runs"]:
        lines = (tmp_path / "runs" / "seed1234" / run["config"] / "eval" / "step_0000002.jsonl").read_text()
        records[run["config"]] = [json.loads(line) for line in lines.splitlines()]
        for split in ("interpolation", "extrapolation"):
            mine = [r for r in records[run["config"]] if r["split"] == split]
            assert len(mine) == 4
            assert run["scores"][split]["accuracy"] == pytest.approx(sum(r["correct"] for r in mine) / 4)
            assert run["scores"][split]["parseable"] == pytest.approx(
                sum(r["extracted"] is not None for r in mine) / 4)
        assert run["steps"] == 2 and run["wall_s"] > 0
    def distance(record):
        return float("inf") if record["extracted"] is None else abs(record["extracted"] - record["gold"])

    for split in ("interpolation", "extrapolation"):
        base = {r["prompt"]: r for r in records["ce"] if r["split"] == split}
        ntl = [r for r in records["ntl_was"] if r["split"] == split]
        versus = report["runs"][1]["vs_ce"][split]
        assert versus["wins"] == sum(r["correct"] and not base[r["prompt"]]["correct"] for r in ntl)
        assert versus["losses"] == sum(base[r["prompt"]]["correct"] and not r["correct"] for r in ntl)
        assert versus["closer"] == sum(distance(r) < distance(base[r["prompt"]]) for r in ntl)
        assert versus["farther"] == sum(distance(r) > distance(base[r["prompt"]]) for r in ntl)
    assert report["means"]["ce"]["seeds"] == 1
    assert (tmp_path / "repro.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    text = results_md.read_text()
    assert text.startswith("# Results\n\nText the script keeps.\n")
    assert text.count(run_repro.BEGIN_MARK) == 1 and "| ntl_was | 1234 |" in text
    assert "NTL_CPU_PROCS=1 OMP_NUM_THREADS=1 bash launch/pretrain.sh --config configs/repro/ce.yaml" in text

    # restart: finished runs are not trained again, the block is replaced, not appended
    results_md.write_text(text + "\nA closing paragraph.\n")
    done = subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=120, capture_output=True, text=True)
    assert "launch/pretrain.sh" not in done.stderr and "] NTL_CPU_PROCS" not in done.stdout
    again = results_md.read_text()
    assert again.count(run_repro.BEGIN_MARK) == 1 and again.endswith("A closing paragraph.\n")


def test_run_repro_refuses_unknown_config_names(tmp_path):
    completed = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "run_repro.py"), "--configs", "nope",
                                "--out-dir", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 2 and "configs/repro/nope.yaml" in completed.stderr
