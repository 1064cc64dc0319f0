#!/usr/bin/env python
"""Run the arithmetic reproduction (configs/repro/*.yaml) and write its results table and figure.

    python tools/run_repro.py                      # every arm, seeds 1234 2345 3456, both phases, the table
    python tools/run_repro.py --jobs 2             # two runs at a time (one thread each)
    python tools/run_repro.py --report-only        # rebuild the table and figure from finished runs
    python tools/run_repro.py --quick --out-dir /tmp/repro   # the whole pipeline at toy size (a smoke test)

Arms: CE (`ce`), CE + 0.3 x NTL-WAS (`ntl_was`), CE + 0.3 / 0.15 x NTL-MSE (`ntl_mse`, `ntl_mse015`), each
trained from scratch on generated arithmetic with the loss on the answer only (prompt "a+b=", completion
"c"). The continued-pretraining phase (`--continue-at`, default 0.5): the CE run of each seed saves a
checkpoint at that fraction of its steps, which is exported as a Hugging Face folder
(`OUT/seedS/cpt_base_stepH`); every arm then starts from it (`cpt_ce`, `cpt_ntl_was`, ...: the same config
with `model.name_or_path` = that folder, a fresh optimizer) and trains the remaining steps, so all
continued arms see the same start and the same number of steps.

Each (seed, arm) pair is one training run,
`NTL_CPU_PROCS=1 OMP_NUM_THREADS=1 nice -n 10 bash launch/pretrain.sh --config configs/repro/NAME.yaml
train.output_dir=OUT/seedS/ARM model.init_seed=S train.seed=S data.seed=S [overrides]` with its output in
`OUT/seedS/ARM.log`. The seed sets the weight initialisation, the data order and the validation split;
the generated corpus (its own settings, `generate_options`) and the evaluation problems are the same for
every run, so runs are compared on identical problems. A run whose final evaluation file exists is not
run again (the script can be restarted after an interruption; a run cut off midway is started afresh in
a new folder).

The report is built from each run's final predictions (`eval/step_N.jsonl`): accuracy (exact match), MAE,
sMAPE, parseable share and digit accuracy per split (and accuracy per operation); per arm the mean and
standard deviation over seeds; and paired per-problem tests against the CE arm of the same phase, per seed
and pooled over seeds: an exact McNemar test on exact match (the two-sided binomial test of the problems
only one of the two solves), an exact sign test and a Wilcoxon signed-rank test (scipy) on the absolute
error (an unparseable answer is farther than any number). It goes to `--results-json`, to a marked block
of `--results-md` (text outside the markers is kept) and, with `--figure`, to a PNG of the runs' curves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.eval.metrics import arithmetic_scores  # noqa: E402
from ntl_pretrain.fs import write_text_atomic  # noqa: E402

DEFAULT_CONFIGS = ("ce", "ntl_was", "ntl_mse", "ntl_mse015")
DEFAULT_SEEDS = (1234, 2345, 3456)
BASELINE = "ce"  # the config of the baseline arm of each phase, and of the continued phase's start
CONTINUED = "cpt_"  # prefix of the continued-pretraining arms' names
SPLITS = ("interpolation", "extrapolation")
METRICS = ("accuracy", "mae", "smape", "digit_accuracy", "parseable")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "+*": "add_mul", "-*": "sub_mul"}
BEGIN_MARK = "<!-- repro-results:begin (written by tools/run_repro.py) -->"
END_MARK = "<!-- repro-results:end -->"
# --quick: the whole pipeline at toy size (a smoke test of the script, no result); {assets} is OUT/assets
QUICK = dict(configs=["ce", "ntl_was"], seeds=[1234], jobs=2, overrides=[
    "data.sources.0.path={assets}/arithmetic.jsonl", "data.sources.0.generate_arithmetic=400",
    "tokenizer.name_or_path={assets}/tokenizer", "tokenizer.train_vocab_size=300",
    "model.architecture.hidden_size=32", "model.architecture.intermediate_size=64",
    "model.architecture.num_hidden_layers=1", "data.seq_len=32", "data.micro_batch_size=2",
    "data.validation_documents=20", "train.max_steps=4", "optim.warmup_steps=1", "train.val_every_n_steps=-1",
    "eval.every_n_steps=0", "eval.arithmetic_n=6", "eval.batch_size=12", "eval.arithmetic_max_new_tokens=4"])


@dataclass(frozen=True)
class Arm:
    """One arm of the experiment: a config trained from scratch, or continued from the CE checkpoint."""

    config: str  # the config's name under --config-dir
    continued: bool = False

    @property
    def name(self) -> str:
        return CONTINUED + self.config if self.continued else self.config

    @property
    def baseline(self) -> str:
        return Arm(BASELINE, self.continued).name


def run_dir(out_dir: str, seed: int, name: str) -> str:
    return os.path.join(out_dir, f"seed{seed}", name)


def base_dir(out_dir: str, seed: int, step: int) -> str:
    """The Hugging Face export of the CE run's checkpoint at `step`: where every continued arm starts."""
    return os.path.join(out_dir, f"seed{seed}", f"cpt_base_step{step}")


def final_predictions(output_dir: str, max_steps: int) -> str:
    return os.path.join(output_dir, "eval", f"step_{max_steps:07d}.jsonl")


def train_command(config: str, output_dir: str, seed: int, overrides: Sequence[str]) -> list[str]:
    return ["bash", "launch/pretrain.sh", "--config", config, f"train.output_dir={output_dir}",
            f"model.init_seed={seed}", f"train.seed={seed}", f"data.seed={seed}", *overrides]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_LIVE: set[subprocess.Popen] = set()  # runs in progress, stopped when this script stops
_LIVE_LOCK = threading.Lock()


def _stop(process: subprocess.Popen) -> None:
    """Terminate a run's process group, then kill it if it has not exited within 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_one(config: str, output_dir: str, seed: int, overrides: Sequence[str], procs: int, nice: int,
            threads: int, timeout: float) -> dict[str, Any]:
    """Train one run (its own log file), refusing to reuse a folder a cut-off run left behind."""
    command = train_command(config, output_dir, seed, overrides)
    if os.path.exists(output_dir):
        # A finished run is skipped by the caller; anything else here is a run cut off midway.
        stale = f"{output_dir}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(output_dir, stale)
        print(f"moved the unfinished run {output_dir} to {stale}", flush=True)
    os.makedirs(os.path.dirname(output_dir), exist_ok=True)
    log_path = f"{output_dir}.log"
    # One thread per process unless told otherwise: on a busy machine a descheduled OpenMP thread stalls
    # the others at every parallel region, which made steps several times slower here.
    env = {**os.environ, "NTL_CPU_PROCS": str(procs), "OMP_NUM_THREADS": str(threads)}
    # A free port of our own, so a run never collides with another DeepSpeed job on this machine.
    env.setdefault("NTL_DEEPSPEED_ARGS", f"--master_port {free_port()}")
    launched = ["nice", "-n", str(nice), *command] if nice else command
    shown = f"NTL_CPU_PROCS={procs} OMP_NUM_THREADS={threads} " + shlex.join(launched)
    print(f"[{time.strftime('%H:%M:%S')}] {shown}  > {log_path}", flush=True)
    started, load_before = time.time(), os.getloadavg()[0]
    with open(log_path, "w", encoding="utf-8") as log:
        # Its own process group, so that stopping this script (Ctrl-C, SIGTERM, timeout) stops the whole run.
        process = subprocess.Popen(launched, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(process)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            raise SystemExit(f"error: {shown} ran longer than --timeout {timeout:.0f} s; see {log_path}") from None
        except BaseException:
            _stop(process)
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(process)
    if returncode != 0:
        raise SystemExit(f"error: {shown} failed with exit code {returncode}; see {log_path}")
    return {"command": shown, "wall_s": time.time() - started, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def run_all(tasks: Sequence[Any], jobs: int) -> None:
    """Call every task (a function of no arguments), `jobs` at a time; the first failure stops the rest."""
    if jobs <= 1:
        for task in tasks:
            task()
        return
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for future in [pool.submit(task) for task in tasks]:
            future.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        with _LIVE_LOCK:
            live = list(_LIVE)
        for process in live:
            _stop(process)
        raise
    pool.shutdown(wait=True)


def export_base(checkpoint: str, out: str) -> None:
    """Export the CE checkpoint every continued arm starts from (skipped when it exists: the export is atomic)."""
    if os.path.isdir(out):
        return
    if not os.path.isdir(checkpoint):
        raise SystemExit(f"error: {checkpoint} does not exist: the CE run that the continued arms start from has no "
                         f"checkpoint there (finished with another --continue-at or train.max_steps?); delete its "
                         f"folder to train it again, or pass --continue-at 0 to skip the continued phase")
    from ntl_pretrain.checkpoint import export_hf

    report = export_hf(checkpoint, out)
    print(f"[{time.strftime('%H:%M:%S')}] exported {checkpoint} to {out} ({report['seconds']:.1f} s)", flush=True)


# ------------------------------------------------------------------------------------ report
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


def _pairs(records: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], split: str) -> list[tuple[dict, dict]]:
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
    return compare(_pairs(records, baseline, split))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1) of the finite values; std is nan for fewer than two."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return float("nan"), float("nan")
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))


def build_report(out_dir: str, seeds: Sequence[int], arms: Sequence[Arm], max_steps: dict[str, int],
                 runs_meta: dict[str, Any]) -> dict[str, Any]:
    """Scores of every finished run, mean and std over seeds per arm, and paired per-problem tests against
    the CE arm of the same phase: per seed (`runs[i].vs_ce`) and pooled over seeds (`pooled`)."""
    runs = []
    records_of: dict[tuple[int, str], list] = {}
    for seed in seeds:
        for arm in arms:
            path = final_predictions(run_dir(out_dir, seed, arm.name), max_steps[arm.name])
            if os.path.exists(path):
                records_of[(seed, arm.name)] = read_records(path)
    for seed in seeds:
        for arm in arms:
            if (seed, arm.name) not in records_of:
                continue
            run = {"seed": seed, "config": arm.name, "phase": "continued" if arm.continued else "scratch",
                   "predictions": final_predictions(run_dir(out_dir, seed, arm.name), max_steps[arm.name]),
                   "scores": scores_of(records_of[(seed, arm.name)]), "steps": max_steps[arm.name],
                   **runs_meta.get(run_dir(out_dir, seed, arm.name), {})}
            if arm.name != arm.baseline and (seed, arm.baseline) in records_of:
                run["vs_ce"] = {split: paired(records_of[(seed, arm.name)], records_of[(seed, arm.baseline)], split)
                                for split in SPLITS}
            runs.append(run)
    means, stds, pooled = {}, {}, {}
    for arm in arms:
        mine = [run for run in runs if run["config"] == arm.name]
        if not mine:
            continue
        means[arm.name], stds[arm.name] = {"seeds": len(mine)}, {"seeds": len(mine)}
        for split in SPLITS:
            if split not in mine[0]["scores"]:
                continue
            stats = {metric: mean_std([run["scores"][split][metric] for run in mine])
                     for metric in mine[0]["scores"][split]}
            means[arm.name][split] = {metric: stat[0] for metric, stat in stats.items()}
            stds[arm.name][split] = {metric: stat[1] for metric, stat in stats.items()}
        paired_seeds = [run["seed"] for run in mine if "vs_ce" in run]
        if paired_seeds:
            pooled[arm.name] = {"seeds": len(paired_seeds), "baseline": arm.baseline, **{
                split: compare([pair for seed in paired_seeds for pair in
                                _pairs(records_of[(seed, arm.name)], records_of[(seed, arm.baseline)], split)])
                for split in SPLITS}}
    return {"runs": runs, "means": means, "stds": stds, "pooled": pooled}


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


def write_atomic(path: str, text: str) -> None:
    write_text_atomic(path, text)


def update_results_md(path: str, block: str) -> None:
    """Replace the marked block of `path` (or append it; create the file if missing), keep the rest."""
    text = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else "# Results\n\n"
    if BEGIN_MARK in text and END_MARK in text:
        head, rest = text.split(BEGIN_MARK, 1)
        tail = rest.split(END_MARK, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_atomic(path, text)


def machine_description() -> dict[str, Any]:
    import deepspeed
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return {"description": f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, Python {platform.python_version()}, "
                           f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
                           f"transformers {transformers.__version__}",
            "cpu_count": os.cpu_count()}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=None,
                        help=f"names under --config-dir (default: {' '.join(DEFAULT_CONFIGS)}); each run is paired "
                             f"with the '{BASELINE}' run of its seed and phase")
    parser.add_argument("--config-dir", default="configs/repro")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"default: {' '.join(map(str, DEFAULT_SEEDS))}")
    parser.add_argument("--continue-at", type=float, default=0.5,
                        help="the continued arms start from the CE run's checkpoint at this fraction of its steps "
                             "and train the rest (0: no continued phase)")
    parser.add_argument("--out-dir", default="runs/repro", help="runs go to OUT/seedS/ARM")
    parser.add_argument("--jobs", type=int, default=None, help="runs trained at a time (default 1; --quick 2)")
    parser.add_argument("--procs", type=int, default=1, help="CPU processes per run (NTL_CPU_PROCS)")
    parser.add_argument("--nice", type=int, default=10, help="nice level of the runs (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds one run may take before it is failed")
    parser.add_argument("--quick", action="store_true",
                        help="toy sizes, seed 1234, arms ce and ntl_was, assets under OUT/assets: checks the whole "
                             "pipeline in about a minute; its numbers mean nothing")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the finished runs")
    parser.add_argument("--results-json", default=None, help="default: OUT/results.json")
    parser.add_argument("--results-md", default=None, help="markdown file whose results block is rewritten ('' to "
                        "skip; default docs/results.md, with --quick OUT/results.md)")
    parser.add_argument("--figure", default=None, help="PNG of the runs' curves ('' to skip; default "
                        "docs/figures/repro.png, with --quick OUT/repro.png)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run")
    args = parser.parse_args(argv)
    if args.quick:
        assets = os.path.join(os.path.abspath(args.out_dir), "assets")
        args.overrides = [o.format(assets=assets) for o in QUICK["overrides"]] + list(args.overrides)
    defaults = QUICK if args.quick else dict(configs=list(DEFAULT_CONFIGS), seeds=list(DEFAULT_SEEDS), jobs=1)
    for key in ("configs", "seeds", "jobs"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.results_md is None:
        args.results_md = os.path.join(args.out_dir, "results.md") if args.quick else "docs/results.md"
    if args.figure is None:
        args.figure = os.path.join(args.out_dir, "repro.png") if args.quick else "docs/figures/repro.png"
    if not 0.0 <= args.continue_at < 1.0:
        parser.error(f"--continue-at {args.continue_at} must be in [0, 1)")
    missing = [name for name in args.configs
               if not os.path.exists(os.path.join(REPO, args.config_dir, f"{name}.yaml"))]
    if missing:
        parser.error(f"config files {[os.path.join(args.config_dir, f'{n}.yaml') for n in missing]} do not exist; "
                     f"--configs names files under --config-dir")
    if args.continue_at > 0 and BASELINE not in args.configs:
        parser.error(f"the continued phase starts from the '{BASELINE}' run: add {BASELINE} to --configs or pass "
                     f"--continue-at 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the runs in progress are stopped with this script.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.time()
    configs = {name: os.path.join(args.config_dir, f"{name}.yaml") for name in args.configs}
    steps_of = {name: load_config(os.path.join(REPO, path), list(args.overrides)).train.max_steps
                for name, path in configs.items()}
    arms = [Arm(name) for name in configs]
    max_steps = {arm.name: steps_of[arm.config] for arm in arms}
    start_step = round(steps_of.get(BASELINE, 0) * args.continue_at)
    if args.continue_at > 0:
        if not 0 < start_step < steps_of[BASELINE]:
            raise SystemExit(f"error: --continue-at {args.continue_at} of {steps_of[BASELINE]} steps is step {start_step}"
                             f"; choose a fraction that falls strictly inside the CE run")
        arms += [Arm(name, continued=True) for name in configs]
        max_steps.update({Arm(name, True).name: steps_of[BASELINE] - start_step for name in configs})
    results_json = args.results_json or os.path.join(args.out_dir, "results.json")
    meta_path = os.path.join(args.out_dir, "runs_meta.json")
    runs_meta: dict[str, Any] = json.loads(Path(meta_path).read_text()) if os.path.exists(meta_path) else {}
    meta_lock = threading.Lock()

    def overrides_of(arm: Arm, seed: int) -> list[str]:
        if arm.continued:
            return [*args.overrides, f"model.name_or_path={base_dir(args.out_dir, seed, start_step)}",
                    "model.architecture={}", f"train.max_steps={max_steps[arm.name]}"]
        if arm.config == BASELINE and args.continue_at > 0:  # keep the checkpoint the continued arms start from
            return [*args.overrides, f"checkpoint.every_n_steps={start_step}", "checkpoint.keep_last=0"]
        return list(args.overrides)

    # three stages, each finished before the next: the scratch runs, the exports of the CE checkpoints, the
    # continued runs (every task is a function of no arguments; finished runs and exports are left out)
    commands: list[str] = []
    scratch: list[Any] = []
    exports: list[Any] = []
    continued_runs: list[Any] = []
    for continued in (False, True):
        for seed in args.seeds:
            if continued and args.continue_at > 0:
                checkpoint = f"{run_dir(args.out_dir, seed, BASELINE)}/global_step{start_step}"
                base = base_dir(args.out_dir, seed, start_step)
                commands.append(f"python tools/export_hf.py {checkpoint} {base}")
                exports.append(lambda checkpoint=checkpoint, base=base: export_base(checkpoint, base))
            for arm in (a for a in arms if a.continued == continued):
                output_dir, overrides = run_dir(args.out_dir, seed, arm.name), overrides_of(arm, seed)
                nice = ["nice", "-n", str(args.nice)] if args.nice else []
                commands.append(f"NTL_CPU_PROCS={args.procs} OMP_NUM_THREADS={args.threads} "
                                + shlex.join(nice + train_command(configs[arm.config], output_dir, seed, overrides)))
                if args.report_only or os.path.exists(final_predictions(output_dir, max_steps[arm.name])):
                    continue

                def train(arm=arm, seed=seed, output_dir=output_dir, overrides=overrides) -> None:
                    meta = run_one(configs[arm.config], output_dir, seed, overrides, args.procs, args.nice,
                                   args.threads, args.timeout)
                    with meta_lock:
                        runs_meta[output_dir] = {**meta, "steps": max_steps[arm.name]}
                        write_atomic(meta_path, json.dumps(runs_meta, indent=1))

                (continued_runs if continued else scratch).append(train)
    if not args.report_only:
        run_all(scratch, args.jobs)
        if continued_runs:
            run_all(exports, 1)
        run_all(continued_runs, args.jobs)
    trained = 0 if args.report_only else len(scratch) + len(continued_runs)

    report = build_report(args.out_dir, args.seeds, arms, max_steps, runs_meta)
    if not report["runs"]:
        raise SystemExit(f"error: no finished runs under {args.out_dir} for seeds {args.seeds}; run without "
                         f"--report-only first")
    report["wall_s"] = time.time() - started if trained else None
    machine = machine_description()
    report["machine"] = machine
    report["commands"] = commands
    write_atomic(results_json, json.dumps(report, indent=1))
    block = markdown(report, machine, commands)
    print(block, flush=True)
    if args.results_md:
        update_results_md(args.results_md, block)
    if args.figure:
        from plot_runs import plot_runs  # tools/ is this script's folder

        finished = report["runs"]
        plot_runs([run_dir(args.out_dir, run["seed"], run["config"]) for run in finished], args.figure,
                  labels=[run["config"] for run in finished],
                  title=f"Arithmetic, loss on the answer only: CE vs CE + NTL, same steps and data; "
                        f"{len({run['seed'] for run in finished})} seed(s), one line each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
