"""The reproduction's statistics and results table (tools/run_repro.py): scores of a run's final predictions, the exact sign test
(McNemar's on exact match is the same test on the discordant problems), Wilcoxon signed-rank on absolute error
(scipy), paired comparisons against the baseline arm, and mean and standard deviation over seeds."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from ntl_pretrain.eval.metrics import arithmetic_scores
from ntl_pretrain.core.fs import write_text_atomic

SPLITS = ("interpolation", "extrapolation")
METRICS = ("accuracy", "mae", "smape", "digit_accuracy", "parseable")
BEGIN_MARK = "<!-- repro-results:begin (written by tools/run_repro.py) -->"
END_MARK = "<!-- repro-results:end -->"
OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "+*": "add_mul", "-*": "sub_mul"}


def read_records(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _split_rows(records: Sequence[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("benchmark") == "arith" and r["split"] == split]


def scores_of(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """split -> metrics (plus accuracy per op) of one run's arithmetic predictions."""
    result = {}
    for split in SPLITS:
        rows = _split_rows(records, split)
        if not rows:
            continue
        scores = arithmetic_scores([r["extracted"] for r in rows], [r["gold"] for r in rows])
        for op in sorted({r["op"] for r in rows}):
            op_rows = [r for r in rows if r["op"] == op]
            scores[f"{OP_NAMES.get(op, op)}_accuracy"] = sum(r["correct"] for r in op_rows) / len(op_rows)
        result[split] = scores
    return result


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: how likely a split of discordant pairs at least this uneven is by chance.
    On the problems only one of two runs solves it is the exact McNemar test."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(0, min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _distance(record: dict[str, Any]) -> float:
    """How far an answer is from the gold one (an unparseable answer is farther than any number)."""
    return math.inf if record["extracted"] is None else abs(record["extracted"] - record["gold"])


def wilcoxon_p(differences: Sequence[float]) -> float | None:
    """Two-sided Wilcoxon signed-rank p of paired differences of absolute errors (zeros dropped), or None
    without scipy. Infinite differences (one answer unparseable) rank above every finite one."""
    try:
        from scipy.stats import wilcoxon
    except ImportError:
        return None
    finite = [abs(d) for d in differences if math.isfinite(d)]
    big = 2 * max(finite, default=0.0) + 1.0
    values = [d if math.isfinite(d) else math.copysign(big, d) for d in differences if d != 0 and not math.isnan(d)]
    if not values:
        return 1.0
    return float(wilcoxon(values, zero_method="wilcox").pvalue)


def pairs_of(records: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], split: str) -> list[tuple[dict, dict]]:
    """(this run's record, the baseline's record) of each problem both answered, matched by prompt."""
    base = {r["prompt"]: r for r in _split_rows(baseline, split)}
    return [(r, base[r["prompt"]]) for r in _split_rows(records, split) if r["prompt"] in base]


def compare(pairs: Sequence[tuple[dict, dict]]) -> dict[str, Any]:
    """Paired tests of a run against the baseline over (mine, baseline) record pairs: problems only it
    solves (wins) or only the baseline solves (losses) with the exact McNemar p; problems where its answer
    is closer to the gold one (closer) or farther (farther) with the exact sign-test p; and the Wilcoxon
    signed-rank p of the absolute errors."""
    wins = losses = closer = farther = 0
    differences = []
    for mine, other in pairs:
        wins += mine["correct"] and not other["correct"]
        losses += other["correct"] and not mine["correct"]
        a, b = _distance(mine), _distance(other)
        closer += a < b
        farther += a > b
        differences.append(0.0 if a == b else a - b)
    return {"n": len(pairs), "wins": wins, "losses": losses, "sign_test_p": sign_test_p(wins, losses),
            "closer": closer, "farther": farther, "closer_sign_test_p": sign_test_p(closer, farther),
            "wilcoxon_p": wilcoxon_p(differences)}


def paired(records: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], split: str) -> dict[str, Any]:
    """This run against the baseline on the same problems of one split (see `compare`)."""
    return compare(pairs_of(records, baseline, split))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1) of the finite values; std is nan for fewer than two."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return float("nan"), float("nan")
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))


def _fmt(value: float, metric: str) -> str:
    if math.isnan(value):
        return "-"
    if metric == "mae":
        return f"{value:.4g}"
    return f"{value:.3f}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def markdown(report: dict[str, Any], machine: dict[str, Any], commands: Sequence[str]) -> str:
    """The results block of docs/results.md."""
    lines = [BEGIN_MARK, ""]
    header = "| arm | seeds | " + " | ".join(f"{split[:6]}. {m}" for split in SPLITS for m in METRICS) + " |"
    problems = sorted({int(scores["n"]) for run in report["runs"] for scores in run["scores"].values()})
    lines += [f"Mean +- standard deviation over seeds of the final evaluation ({' / '.join(map(str, problems))} "
              "problems per split; accuracy = exact match; MAE and sMAPE over parseable answers only; `cpt_` arms "
              "start from the CE run's checkpoint):", "", header, "|" + "---|" * (2 + len(SPLITS) * len(METRICS))]
    for name, mean in report["means"].items():
        std = report["stds"][name]
        cells = []
        for split in SPLITS:
            for m in METRICS:
                value, spread = mean.get(split, {}).get(m, float("nan")), std.get(split, {}).get(m, float("nan"))
                cells.append(_fmt(value, m) + ("" if math.isnan(spread) else f" +- {_fmt(spread, m)}"))
        lines.append(f"| {name} | {mean['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "Paired per-problem tests against the CE arm of the same phase, pooled over seeds (each seed's "
              "problems paired with the CE run of that seed): *solved* = problems only this arm solves / only CE "
              "solves, with the exact McNemar p; *closer* = problems where this arm's answer is nearer the true one "
              "/ farther than CE's, with the exact sign-test p; *Wilcoxon p*: signed-rank test of the absolute "
              "errors (an unparseable answer is farther than any number):", "",
              "| arm | vs | seeds | split | solved vs CE | McNemar p | closer vs CE | sign p | Wilcoxon p |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, versus in report["pooled"].items():
        for split in SPLITS:
            v = versus[split]
            lines.append(f"| {name} | {versus['baseline']} | {versus['seeds']} | {split} | +{v['wins']} / -{v['losses']} "
                         f"| {_p(v['sign_test_p'])} | {v['closer']} / {v['farther']} | {_p(v['closer_sign_test_p'])} "
                         f"| {_p(v['wilcoxon_p'])} |")
    lines += ["", "Every run, with accuracy per operation and the same paired tests against the CE run of its seed "
              "and phase:", "",
              "| arm | seed | interp. acc. | per op | extrap. acc. | per op | interp. solved vs CE | "
              "interp. closer vs CE | extrap. solved vs CE | extrap. closer vs CE | steps | wall time | "
              "load avg before/after |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        cells = []
        for split in SPLITS:
            scores = run["scores"].get(split, {})
            cells.append(_fmt(scores.get("accuracy", float("nan")), "accuracy"))
            cells.append(", ".join(f"{k[:-len('_accuracy')]} {v:.3f}" for k, v in scores.items()
                                   if k.endswith("_accuracy") and k != "digit_accuracy"))
        for split in SPLITS:
            versus = run.get("vs_ce", {}).get(split)
            cells.append(f"+{versus['wins']} / -{versus['losses']} (p={versus['sign_test_p']:.2g})" if versus else "-")
            cells.append(f"{versus['closer']} / {versus['farther']} (p={versus['closer_sign_test_p']:.2g})"
                         if versus else "-")
        wall = f"{run['wall_s'] / 60:.1f} min" if "wall_s" in run else "-"
        load = f"{run['load_before']:.1f} / {run['load_after']:.1f}" if "load_before" in run else "-"
        lines.append(f"| {run['config']} | {run['seed']} | " + " | ".join(cells)
                     + f" | {run.get('steps', '-')} | {wall} | {load} |")
    if report.get("wall_s") is not None:
        lines += ["", f"Wall time of this invocation (runs trained in it): {report['wall_s'] / 60:.1f} min."]
    lines += ["", f"Machine: {machine['description']}.", "", "Commands (in the repository root):", "", "```bash"]
    lines += list(commands) + ["```", "", END_MARK]
    return "\n".join(lines)


def update_results_md(path: str, block: str) -> None:
    """Replace the marked block of `path` (or append it; create the file if missing), keep the rest."""
    text = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else "# Results\n\n"
    if BEGIN_MARK in text and END_MARK in text:
        head, rest = text.split(BEGIN_MARK, 1)
        tail = rest.split(END_MARK, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_text_atomic(path, text)
