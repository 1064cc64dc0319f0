#!/usr/bin/env python
"""PNG plots of training runs (TensorBoard event folders) and of the benchmark JSON files.

    # loss curves and evaluation metrics of several runs side by side
    python tools/plot_runs.py runs runs/repro/ce runs/repro/ntl_was runs/repro/ntl_mse --out docs/figures/repro.png
    # bar charts of tools/bench_loss.py / tools/bench_train.py results
    python tools/plot_runs.py bench bench_loss.json bench_train.json --out bench.png

`runs` takes run folders (`train.output_dir`: the event files are found below it) or event folders,
and draws one panel per tag (`--tags`; default: training CE and NTL, validation CE, and the arithmetic
accuracy, MAE and sMAPE on both evaluation splits), one line per run. A run that did not log a tag is
left out of that panel; NTL is drawn only for runs that trained with it (`train/ntl_lambda` > 0), since
CE-only runs log it as 0. Runs given the same `--labels` entry (e.g. seeds of one recipe) share a colour.

`bench` takes JSON written by `tools/bench_loss.py --json` (median time per method, one group of bars
per token count, vocabulary and TP size, the ratio to CE alone above each bar) and by
`tools/bench_train.py --out` (median step time with NTL on and off per file).

Needs matplotlib: `pip install -e ".[plots]"`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script
from ntl_pretrain.core.fs import atomic_write  # noqa: E402

DEFAULT_TAGS = (
    "train/ce", "train/ntl", "val/ce",
    "eval/arith/interpolation/accuracy", "eval/arith/interpolation/mae", "eval/arith/interpolation/smape",
    "eval/arith/extrapolation/accuracy", "eval/arith/extrapolation/mae", "eval/arith/extrapolation/smape",
)
# Tags whose values may span decades across a run or across runs: drawn on a log scale when they do.
LOG_SCALE_SUFFIXES = ("/mae",)
EVENT_FILE_MARK = "tfevents"


def _pyplot():
    """matplotlib's pyplot with a file-only backend, or a clear error naming the fix."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: tools/plot_runs.py needs matplotlib, which is not installed: "
                         "pip install 'matplotlib>=3.8' (or pip install -e '.[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------ reading runs
def find_event_dir(run: str) -> str:
    """The folder holding a run's TensorBoard event files: `run` itself or the one folder below it."""
    if not os.path.isdir(run):
        raise SystemExit(f"error: run folder {run!r} does not exist")
    holders = sorted({root for root, _, files in os.walk(run) if any(EVENT_FILE_MARK in f for f in files)})
    if not holders:
        raise SystemExit(f"error: no TensorBoard event files (*{EVENT_FILE_MARK}*) under {run!r}; "
                         f"pass a run's train.output_dir or its tensorboard folder")
    if len(holders) > 1:
        raise SystemExit(f"error: {run!r} holds event files in several folders {holders}; pass one of them")
    return holders[0]


def read_scalars(event_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar tag of an event folder -> (steps, values), in step order; a step written twice
    (e.g. a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(event_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    series = {}
    for tag in accumulator.Tags()["scalars"]:
        by_step = {event.step: event.value for event in accumulator.Scalars(tag)}
        steps = sorted(by_step)
        series[tag] = (steps, [by_step[s] for s in steps])
    return series


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing slider)."""
    if weight <= 0:
        return list(values)
    out, average, norm = [], 0.0, 0.0
    for value in values:
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def trained_with_ntl(series: dict[str, tuple[list[int], list[float]]]) -> bool:
    lambdas = series.get("train/ntl_lambda", ([], []))[1]
    return any(value > 0 for value in lambdas)


def plot_runs(runs: Sequence[str], out: str, labels: Sequence[str] | None = None,
              tags: Sequence[str] = DEFAULT_TAGS, smoothing: float = 0.9, title: str | None = None,
              columns: int = 3) -> dict[str, Any]:
    """Draw one panel per tag, one line per run; write a PNG to `out`. Returns what was drawn."""
    if labels is not None and len(labels) != len(runs):
        raise SystemExit(f"error: --labels has {len(labels)} entries for {len(runs)} runs; give one per run")
    labels = list(labels) if labels is not None else [os.path.basename(os.path.normpath(r)) for r in runs]
    data = [read_scalars(find_event_dir(run)) for run in runs]
    plt = _pyplot()
    distinct = list(dict.fromkeys(labels))
    colours = {label: f"C{i % 10}" for i, label in enumerate(distinct)}
    rows = math.ceil(len(tags) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.9 * rows), squeeze=False, dpi=80)
    drawn: dict[str, list[str]] = {}
    for index, tag in enumerate(tags):
        ax = axes[index // columns][index % columns]
        drawn[tag] = []
        labelled: set[str] = set()
        for label, series in zip(labels, data):
            if tag not in series or (tag == "train/ntl" and not trained_with_ntl(series)):
                continue
            steps, values = series[tag]
            is_train = tag.startswith("train/")
            values = smooth(values, smoothing) if is_train else values
            ax.plot(steps, values, color=colours[label], linewidth=1.2,
                    marker=None if is_train or len(steps) > 30 else "o", markersize=3,
                    label=None if label in labelled else label)
            labelled.add(label)
            drawn[tag].append(label)
        drawn_values = [v for line in ax.get_lines() for v in line.get_ydata() if v > 0]
        if tag.endswith(LOG_SCALE_SUFFIXES) and drawn_values and max(drawn_values) > 10 * min(drawn_values):
            ax.set_yscale("log")  # only when the values span more than a decade
        ax.set_title(tag, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if not drawn[tag]:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    for index in range(len(tags), rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles = [plt.Line2D([], [], color=colours[label], label=label) for label in distinct]
    figure.legend(handles=handles, loc="upper center", ncol=min(len(distinct), 6), fontsize=9,
                  bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        figure.suptitle(title, fontsize=10, y=1.04)
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    _save(figure, out)
    plt.close(figure)
    return {"out": out, "panels": drawn}


# ------------------------------------------------------------------------------------ benchmarks
def _bench_groups(path: str, document: dict[str, Any]) -> list[tuple[str, list[tuple[str, float, float | None]]]]:
    """(group title, [(bar label, seconds, ratio or None)]) from one benchmark JSON file."""
    if "rows" in document:  # tools/bench_loss.py
        groups: dict[tuple, list] = {}
        for row in document["rows"]:
            key = (row["tokens"], row["vocab"], row["tp"])
            groups.setdefault(key, []).append((row["method"], row["median_s"], row.get("ratio_vs_ce")))
        return [(f"loss: n={n} V={v} TP={t}", bars) for (n, v, t), bars in groups.items()]
    if "median_step_time_s_ntl_on" in document:  # tools/bench_train.py
        ratio = document["step_time_ratio_on_over_off"]
        title = (f"train step: {os.path.basename(document.get('config', path))} "
                 f"ZeRO-{document.get('zero_stage')} TP={document.get('tp_size')} x{document.get('world_size')}")
        return [(title, [("NTL off", document["median_step_time_s_ntl_off"], 1.0),
                         ("NTL on", document["median_step_time_s_ntl_on"], ratio)])]
    raise SystemExit(f"error: {path} is neither tools/bench_loss.py JSON (a 'rows' list) nor tools/bench_train.py "
                     f"JSON (median_step_time_s_ntl_on); pass the files those tools write")


def plot_bench(paths: Sequence[str], out: str, title: str | None = None) -> dict[str, Any]:
    """One bar chart per benchmark group (median seconds, ratio to the baseline on each bar); a PNG."""
    groups = []
    for path in paths:
        try:
            document = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"error: cannot read benchmark JSON {path!r}: {error}") from None
        groups += _bench_groups(path, document)
    if not groups:
        raise SystemExit(f"error: no benchmark rows in {list(paths)}")
    plt = _pyplot()
    columns = min(len(groups), 2)
    rows = math.ceil(len(groups) / columns)
    width = max(len(bars) for _, bars in groups)
    figure, axes = plt.subplots(rows, columns, figsize=(max(4.5, 0.9 * width + 1.5) * columns, 3.2 * rows),
                                squeeze=False, dpi=80)
    for index, (group_title, bars) in enumerate(groups):
        ax = axes[index // columns][index % columns]
        names = [name for name, _, _ in bars]
        milliseconds = [seconds * 1e3 for _, seconds, _ in bars]
        rects = ax.bar(range(len(bars)), milliseconds, color=[f"C{i % 10}" for i in range(len(bars))])
        for rect, (_, _, ratio) in zip(rects, bars):
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("median ms", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(group_title, fontsize=9)
        ax.margins(y=0.15)
    for index in range(len(groups), rows * columns):
        axes[index // columns][index % columns].axis("off")
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    _save(figure, out)
    plt.close(figure)
    return {"out": out, "groups": [group_title for group_title, _ in groups]}


def _save(figure, out: str) -> None:
    """Write the PNG whole or not at all (temporary name in the same folder, then rename)."""
    with atomic_write(out, "wb") as handle:
        figure.savefig(handle, format="png", bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="loss curves and eval metrics of runs (TensorBoard event folders)")
    runs.add_argument("runs", nargs="+", help="run folders (train.output_dir) or TensorBoard event folders")
    runs.add_argument("--out", required=True, help="PNG to write")
    runs.add_argument("--labels", nargs="+", help="one legend label per run (equal labels share a colour)")
    runs.add_argument("--tags", nargs="+", default=list(DEFAULT_TAGS), help="scalar tags, one panel each")
    runs.add_argument("--smooth", type=float, default=0.9, help="EMA weight for train/* curves (0: raw)")
    runs.add_argument("--columns", type=int, default=3, help="panels per row")
    runs.add_argument("--title", help="figure title")
    bench = commands.add_parser("bench", help="bar charts of tools/bench_loss.py / tools/bench_train.py JSON")
    bench.add_argument("files", nargs="+", help="benchmark JSON files")
    bench.add_argument("--out", required=True, help="PNG to write")
    bench.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    if args.command == "runs":
        if not 0 <= args.smooth < 1:
            parser.error(f"--smooth {args.smooth} must be in [0, 1)")
        if args.columns < 1:
            parser.error(f"--columns {args.columns} must be >= 1")
        result = plot_runs(args.runs, args.out, args.labels, args.tags, args.smooth, args.title, args.columns)
    else:
        result = plot_bench(args.files, args.out, args.title)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
