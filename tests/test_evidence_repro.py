"""The reproduction: its four configs differ only in the loss and train on the answer only; tools/run_repro.py
runs the whole pipeline (scratch arms, the CE checkpoint exported, continued arms from it, report) at toy
size through `launch/pretrain.sh` (--quick), skips finished runs on a restart, and writes a results JSON, a
markdown block and a PNG that agree with the runs' own prediction files; its statistics match scipy."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))

import run_repro  # noqa: E402

from ntl_pretrain.config import load_config  # noqa: E402

REPRO_CONFIGS = ("ce", "ntl_was", "ntl_mse", "ntl_mse015")
ISSUE49_CONFIGS = ("del", "digit_entropy")  # the arms beside the four: CE + DEL (its authors' weight), digit_entropy
pytestmark = pytest.mark.slow  # tools/run_repro.py launches runs


def test_repro_configs_differ_only_in_the_loss_and_output_dir():
    assert tuple(run_repro.DEFAULT_CONFIGS) == REPRO_CONFIGS and len(run_repro.DEFAULT_SEEDS) >= 3
    configs = {name: asdict(load_config(REPO_ROOT / "configs" / "repro" / f"{name}.yaml"))
               for name in REPRO_CONFIGS + ISSUE49_CONFIGS}
    assert configs["ce"]["loss"]["enabled"] is False
    losses = {name: (c["loss"]["enabled"], c["loss"]["variant"], c["loss"]["ntl_weight"]) for name, c in configs.items()
              if name != "ce"}
    assert losses == {"ntl_was": (True, "was", 0.3), "ntl_mse": (True, "mse", 0.3), "ntl_mse015": (True, "mse", 0.15),
                      "del": (True, "del", 1.0), "digit_entropy": (True, "digit_entropy", 0.3)}
    assert (configs["del"]["loss"]["del_scale"], configs["del"]["loss"]["del_runs"]) == (0.01, "rows")
    for config in configs.values():
        config.pop("loss")
        config["train"].pop("output_dir")
    assert all(config == configs["ce"] for config in configs.values())
    source = configs["ce"]["data"]["sources"][0]
    # the loss on the answer only, on a corpus whose identity is its own settings
    assert (source["prompt_field"], source["completion_field"]) == ("prompt", "completion")
    assert source["generate_arithmetic"] > 0 and "seed" in source["generate_options"]
    # the evaluation's operand lengths are the training corpus's; extrapolation is one digit longer
    options = source["generate_options"]
    assert list(options["train_digits"]) == configs["ce"]["eval"]["arithmetic_train_digits"]
    assert configs["ce"]["eval"]["arithmetic_extrapolation_digits"][0] == options["train_digits"][1] + 1
    assert list(options["ops"]) == configs["ce"]["eval"]["arithmetic_ops"]


def test_sign_test_wilcoxon_and_spread_match_scipy():
    import scipy.stats as scipy_stats  # a dev dependency: missing, the test fails (never skips)
    for wins, losses in ((0, 0), (0, 5), (3, 9), (12, 10), (40, 22)):
        expected = scipy_stats.binomtest(wins, wins + losses, 0.5).pvalue if wins + losses else 1.0
        assert run_repro.sign_test_p(wins, losses) == pytest.approx(expected, rel=1e-12)
    differences = [3.0, -1.0, 0.0, 7.0, 2.5, -4.0, 11.0, 0.0, 6.0, -0.5, 9.0]
    assert run_repro.wilcoxon_p(differences) == pytest.approx(
        scipy_stats.wilcoxon([d for d in differences if d], zero_method="wilcox").pvalue, rel=1e-12)
    # an unparseable answer (infinite error) ranks above every finite difference, on its side
    with_inf = differences + [math.inf, -math.inf, math.inf]
    finite = differences + [23.0, -23.0, 23.0]
    assert run_repro.wilcoxon_p(with_inf) == pytest.approx(run_repro.wilcoxon_p(finite), rel=1e-12)
    assert run_repro.wilcoxon_p([0.0, 0.0]) == 1.0
    values = [0.31, 0.52, 0.47]
    assert run_repro.mean_std(values) == pytest.approx((statistics.mean(values), statistics.stdev(values)))
    assert math.isnan(run_repro.mean_std([0.4])[1]) and run_repro.mean_std([0.4])[0] == 0.4


def _distance(record):
    return float("inf") if record["extracted"] is None else abs(record["extracted"] - record["gold"])


@pytest.mark.multiprocess
def test_run_repro_quick_runs_every_stage_and_restarts_without_training(tmp_path):
    import matplotlib  # noqa: F401  (a dev dependency: missing, the test fails)
    out = tmp_path / "runs"
    results_md = tmp_path / "results.md"
    results_md.write_text("# Results\n\nText the script keeps.\n")
    command = [sys.executable, str(REPO_ROOT / "tools" / "run_repro.py"), "--quick", "--out-dir", str(out),
               "--results-md", str(results_md), "--figure", str(tmp_path / "repro.png"), "--nice", "0"]
    subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=600, capture_output=True, text=True)

    report = json.loads((out / "results.json").read_text())
    names = ["ce", "ntl_was", "cpt_ce", "cpt_ntl_was"]
    assert [(run["config"], run["seed"], run["steps"]) for run in report["runs"]] == [
        ("ce", 1234, 4), ("ntl_was", 1234, 4), ("cpt_ce", 1234, 2), ("cpt_ntl_was", 1234, 2)]
    seed_dir = out / "seed1234"
    # the CE run kept its checkpoint at half its steps; every continued arm started from its export
    assert (seed_dir / "ce" / "global_step2").is_dir() and (seed_dir / "cpt_base_step2" / "config.json").is_file()
    for name in names:
        resolved = load_config(seed_dir / name / "config.yaml")
        assert resolved.data.sources[0].prompt_field == "prompt"  # loss on the answer only
        assert resolved.model.name_or_path == (str(seed_dir / "cpt_base_step2") if name.startswith("cpt_") else None)
    records = {}
    for run in report["runs"]:
        lines = (seed_dir / run["config"] / "eval" / f"step_{run['steps']:07d}.jsonl").read_text()
        records[run["config"]] = [json.loads(line) for line in lines.splitlines()]
        for split in ("interpolation", "extrapolation"):
            mine = [r for r in records[run["config"]] if r["split"] == split]
            assert len(mine) == 6
            assert run["scores"][split]["accuracy"] == pytest.approx(sum(r["correct"] for r in mine) / 6)
            assert run["scores"][split]["parseable"] == pytest.approx(sum(r["extracted"] is not None for r in mine) / 6)
        assert run["wall_s"] > 0
    for arm, baseline in (("ntl_was", "ce"), ("cpt_ntl_was", "cpt_ce")):
        run = next(r for r in report["runs"] if r["config"] == arm)
        for split in ("interpolation", "extrapolation"):
            base = {r["prompt"]: r for r in records[baseline] if r["split"] == split}
            ntl = [r for r in records[arm] if r["split"] == split]
            versus = run["vs_ce"][split]
            assert versus["n"] == len(ntl) == 6
            assert versus["wins"] == sum(r["correct"] and not base[r["prompt"]]["correct"] for r in ntl)
            assert versus["losses"] == sum(base[r["prompt"]]["correct"] and not r["correct"] for r in ntl)
            assert versus["closer"] == sum(_distance(r) < _distance(base[r["prompt"]]) for r in ntl)
            assert versus["farther"] == sum(_distance(r) > _distance(base[r["prompt"]]) for r in ntl)
            assert report["pooled"][arm][split] == versus  # one seed: pooled = that seed's
        assert report["pooled"][arm]["baseline"] == baseline
    assert set(report["means"]) == set(names) and report["means"]["ce"]["seeds"] == 1
    assert (tmp_path / "repro.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    text = results_md.read_text()
    assert text.startswith("# Results\n\nText the script keeps.\n")
    assert text.count(run_repro.BEGIN_MARK) == 1 and "| cpt_ntl_was | 1234 |" in text
    assert "| cpt_ntl_was | cpt_ce | 1 | interpolation |" in text
    assert "NTL_CPU_PROCS=1 OMP_NUM_THREADS=1 bash launch/pretrain.sh --config configs/repro/ce.yaml" in text
    assert f"python tools/export_hf.py {seed_dir / 'ce'}/global_step2 {seed_dir / 'cpt_base_step2'}" in text

    # restart: finished runs are not trained again, the block is replaced, not appended
    results_md.write_text(text + "\nA closing paragraph.\n")
    done = subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=120, capture_output=True, text=True)
    assert "] NTL_CPU_PROCS" not in done.stdout and "exported" not in done.stdout
    again = results_md.read_text()
    assert again.count(run_repro.BEGIN_MARK) == 1 and again.endswith("A closing paragraph.\n")


def test_run_repro_refuses_unknown_config_names_and_a_continued_phase_without_ce(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "run_repro.py"), *args, "--out-dir",
                               str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)

    completed = run("--configs", "nope")
    assert completed.returncode == 2 and "configs/repro/nope.yaml" in completed.stderr
    completed = run("--configs", "ntl_was")
    assert completed.returncode == 2 and "add ce to --configs or pass --continue-at 0" in completed.stderr
