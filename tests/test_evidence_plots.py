"""Smoke tests of tools/plot_runs.py: PNGs from real TensorBoard event folders and real benchmark JSON,
and the errors a user can cause (missing matplotlib, no event files, mismatched labels)."""

from __future__ import annotations

import json
import subprocess
import sys


from conftest import REPO_ROOT

PLOT = REPO_ROOT / "tools" / "plot_runs.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

import matplotlib  # noqa: E402,F401  (a dev dependency: missing, the tests fail, never skip)


def write_run(folder, ntl_weight: float, steps: int = 20) -> None:
    """A run folder laid out as the trainer writes it: OUTPUT/tensorboard/events..."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder / "tensorboard"))
    for step in range(1, steps + 1):
        writer.add_scalar("train/ce", 3.0 / step, step)
        writer.add_scalar("train/ntl", 2.0 / step if ntl_weight else 0.0, step)
        writer.add_scalar("train/ntl_lambda", ntl_weight, step)
    for step in (10, 20):
        writer.add_scalar("eval/arith/interpolation/accuracy", step / 40, step)
        writer.add_scalar("eval/arith/interpolation/mae", 100.0 / step, step)
    writer.close()


def run_plot(*args, check=True):
    return subprocess.run([sys.executable, str(PLOT), *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=check)


def read_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    return matplotlib.image.imread(str(path))


def test_runs_plot_draws_each_run_and_skips_ntl_of_ce_only(tmp_path):
    write_run(tmp_path / "ce", ntl_weight=0.0)
    write_run(tmp_path / "ntl_was", ntl_weight=0.3)
    out = tmp_path / "fig" / "runs.png"
    completed = run_plot("runs", tmp_path / "ce", tmp_path / "ntl_was", "--out", out)
    panels = json.loads(completed.stdout.strip().splitlines()[-1])["panels"]
    assert panels["train/ce"] == ["ce", "ntl_was"]
    assert panels["train/ntl"] == ["ntl_was"]  # CE-only runs log NTL as 0: not drawn
    assert panels["eval/arith/interpolation/accuracy"] == ["ce", "ntl_was"]
    assert panels["val/ce"] == []  # not logged by these runs: an empty panel, no error
    image = read_png(out)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not list(out.parent.glob(".tmp-*"))


def test_runs_plot_labels_and_event_folder_directly(tmp_path):
    write_run(tmp_path / "a", ntl_weight=0.3)
    write_run(tmp_path / "b", ntl_weight=0.3)
    out = tmp_path / "two.png"
    completed = run_plot("runs", tmp_path / "a" / "tensorboard", tmp_path / "b", "--labels", "was", "was",
                         "--tags", "train/ce", "train/ntl", "--smooth", "0", "--out", out)
    assert json.loads(completed.stdout.strip().splitlines()[-1])["panels"] == {"train/ce": ["was", "was"],
                                                                               "train/ntl": ["was", "was"]}
    read_png(out)


def test_bench_plot_from_real_bench_loss_json_with_a_token_sweep(tmp_path):
    bench_json = tmp_path / "bench_loss.json"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_loss.py"), "--tokens", "32", "48", "--vocab",
                    "256", "--tp", "1", "--reps", "1", "--methods", "ce", "ours_was", "--no-memory", "--json",
                    str(bench_json)], check=True, timeout=300, capture_output=True)
    rows = json.loads(bench_json.read_text())["rows"]
    assert [(row["tokens"], row["method"]) for row in rows] == [(32, "ce"), (32, "ours_was"), (48, "ce"),
                                                               (48, "ours_was")]
    out = tmp_path / "bench.png"
    completed = run_plot("bench", bench_json, "--out", out)
    assert json.loads(completed.stdout.strip().splitlines()[-1])["groups"] == ["loss: n=32 V=256 TP=1",
                                                                               "loss: n=48 V=256 TP=1"]
    read_png(out)


def test_errors_name_the_problem(tmp_path):
    (tmp_path / "empty").mkdir()
    completed = run_plot("runs", tmp_path / "empty", "--out", tmp_path / "x.png", check=False)
    assert completed.returncode != 0 and "no TensorBoard event files" in completed.stderr
    write_run(tmp_path / "r", ntl_weight=0.3)
    completed = run_plot("runs", tmp_path / "r", "--labels", "a", "b", "--out", tmp_path / "x.png", check=False)
    assert completed.returncode != 0 and "--labels has 2 entries for 1 runs" in completed.stderr
    (tmp_path / "other.json").write_text(json.dumps({"something": 1}))
    completed = run_plot("bench", tmp_path / "other.json", "--out", tmp_path / "x.png", check=False)
    assert completed.returncode != 0 and "neither tools/bench_loss.py JSON" in completed.stderr
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_is_a_clear_error(tmp_path):
    write_run(tmp_path / "r", ntl_weight=0.3)
    # None in sys.modules makes `import matplotlib` raise ImportError, as on a machine without it.
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_runs.py', 'runs', {str(tmp_path / 'r')!r}, '--out', {str(tmp_path / 'x.png')!r}]; "
            f"runpy.run_path({str(PLOT)!r}, run_name='__main__')")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode != 0
    assert "needs matplotlib" in completed.stderr and "pip install" in completed.stderr
    assert not (tmp_path / "x.png").exists()
