#!/usr/bin/env python
"""Run the arithmetic reproduction (configs/repro/*.yaml) and write its results table and figure.

    python tools/run_repro.py                      # CE, CE + NTL-WAS, CE + NTL-MSE with seed 1234
    python tools/run_repro.py --seeds 1234 5678    # a second seed of each
    python tools/run_repro.py --report-only        # rebuild the table and figure from finished runs

Each (seed, config) pair is one training run, started one after the other as
`NTL_CPU_PROCS=1 OMP_NUM_THREADS=1 nice -n 10 bash launch/pretrain.sh --config configs/repro/NAME.yaml
train.output_dir=OUT/seedS/NAME model.init_seed=S train.seed=S data.seed=S [overrides]` with its output in
`OUT/seedS/NAME.log`. The seed sets the
weight initialisation, the data order and the validation split; the generated corpus and the evaluation
problems are the same for every run, so runs are compared on identical problems. A run whose final
evaluation file exists is not run again (the script can be restarted after an interruption; a run cut
off midway is started afresh in a new folder).

The report is built from each run's final predictions (`eval/step_N.jsonl`): accuracy, MAE, sMAPE,
parseable share and digit accuracy per split (and accuracy per operation), the mean over seeds, and a
paired comparison with the CE run of the same seed on the same problems (problems only NTL solves vs
only CE solves, with an exact two-sided sign test). It goes to `--results-json`, to a marked block of
`--results-md` (text outside the markers is kept) and, with `--figure`, to a PNG of the runs' curves.
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
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ntl_pretrain.config import load_config  # noqa: E402
from ntl_pretrain.eval.metrics import arithmetic_scores  # noqa: E402
from ntl_pretrain.fs import write_text_atomic  # noqa: E402

DEFAULT_CONFIGS = ("ce", "ntl_was", "ntl_mse")
BASELINE = "ce"
SPLITS = ("interpolation", "extrapolation")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul", "+*": "add_mul", "-*": "sub_mul"}
BEGIN_MARK = "<!-- repro-results:begin (written by tools/run_repro.py) -->"
END_MARK = "<!-- repro-results:end -->"


def run_dir(out_dir: str, seed: int, name: str) -> str:
    return os.path.join(out_dir, f"seed{seed}", name)


def final_predictions(output_dir: str, max_steps: int) -> str:
    return os.path.join(output_dir, "eval", f"step_{max_steps:07d}.jsonl")


def train_command(config: str, output_dir: str, seed: int, overrides: Sequence[str]) -> list[str]:
    return ["bash", "launch/pretrain.sh", "--config", config, f"train.output_dir={output_dir}",
            f"model.init_seed={seed}", f"train.seed={seed}", f"data.seed={seed}", *overrides]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            raise SystemExit(f"error: {shown} ran longer than --timeout {timeout:.0f} s; see {log_path}") from None
        except BaseException:
            _stop(process)
            raise
    if returncode != 0:
        raise SystemExit(f"error: {shown} failed with exit code {returncode}; see {log_path}")
    return {"command": shown, "wall_s": time.time() - started, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


# ------------------------------------------------------------------------------------ report
def read_records(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def scores_of(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """split -> metrics (plus accuracy per op) of one run's arithmetic predictions."""
    result = {}
    for split in SPLITS:
        rows = [r for r in records if r.get("benchmark") == "arith" and r["split"] == split]
        if not rows:
            continue
        scores = arithmetic_scores([r["extracted"] for r in rows], [r["gold"] for r in rows])
        for op in sorted({r["op"] for r in rows}):
            op_rows = [r for r in rows if r["op"] == op]
            scores[f"{OP_NAMES.get(op, op)}_accuracy"] = sum(r["correct"] for r in op_rows) / len(op_rows)
        result[split] = scores
    return result


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: how likely a split of discordant pairs at least this uneven is by chance."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(0, min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _distance(record: dict[str, Any]) -> float:
    """How far an answer is from the gold one (an unparseable answer is farther than any number)."""
    return math.inf if record["extracted"] is None else abs(record["extracted"] - record["gold"])


def paired(records: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]], split: str) -> dict[str, float]:
    """This run against the baseline on the same problems: problems only it solves (wins) or only the
    baseline solves (losses), and problems where its answer is numerically closer to the gold one (closer)
    or farther (farther) than the baseline's; each pair of counts with its sign-test p."""
    base = {r["prompt"]: r for r in baseline if r.get("benchmark") == "arith" and r["split"] == split}
    wins = losses = closer = farther = 0
    for record in records:
        if record.get("benchmark") != "arith" or record["split"] != split or record["prompt"] not in base:
            continue
        other = base[record["prompt"]]
        wins += record["correct"] and not other["correct"]
        losses += other["correct"] and not record["correct"]
        closer += _distance(record) < _distance(other)
        farther += _distance(record) > _distance(other)
    return {"wins": wins, "losses": losses, "sign_test_p": sign_test_p(wins, losses),
            "closer": closer, "farther": farther, "closer_sign_test_p": sign_test_p(closer, farther)}


def build_report(out_dir: str, seeds: Sequence[int], names: Sequence[str], max_steps: dict[str, int],
                 runs_meta: dict[str, Any]) -> dict[str, Any]:
    """Scores of every finished run, means over seeds, paired comparisons with the CE run of each seed."""
    runs = []
    records_of: dict[tuple[int, str], list] = {}
    for seed in seeds:
        for name in names:
            path = final_predictions(run_dir(out_dir, seed, name), max_steps[name])
            if not os.path.exists(path):
                continue
            records_of[(seed, name)] = read_records(path)
            run = {"seed": seed, "config": name, "predictions": path,
                   "scores": scores_of(records_of[(seed, name)]),
                   **runs_meta.get(run_dir(out_dir, seed, name), {})}
            if name != BASELINE and (seed, BASELINE) in records_of:
                run["vs_ce"] = {split: paired(records_of[(seed, name)], records_of[(seed, BASELINE)], split)
                                for split in SPLITS}
            runs.append(run)
    means = {}
    for name in names:
        mine = [run for run in runs if run["config"] == name]
        if not mine:
            continue
        means[name] = {split: {metric: _mean([run["scores"][split][metric] for run in mine])
                               for metric in mine[0]["scores"].get(split, {})}
                       for split in SPLITS if split in mine[0]["scores"]}
        means[name]["seeds"] = len(mine)
    return {"runs": runs, "means": means}


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _fmt(value: float, metric: str) -> str:
    if math.isnan(value):
        return "-"
    if metric == "mae":
        return f"{value:.4g}"
    return f"{value:.3f}"


def markdown(report: dict[str, Any], machine: dict[str, Any], commands: Sequence[str]) -> str:
    """The results block of docs/results.md."""
    lines = [BEGIN_MARK, ""]
    metrics = ("accuracy", "mae", "smape", "parseable", "digit_accuracy")
    header = "| run | seeds | " + " | ".join(f"{split[:6]}. {m}" for split in SPLITS for m in metrics) + " |"
    problems = sorted({int(scores["n"]) for run in report["runs"] for scores in run["scores"].values()})
    lines += [f"Mean over seeds of the final evaluation ({' / '.join(map(str, problems))} problems per split; "
              "MAE and sMAPE over parseable answers only):", "", header, "|" + "---|" * (2 + len(SPLITS) * len(metrics))]
    for name, mean in report["means"].items():
        cells = [_fmt(mean.get(split, {}).get(m, float("nan")), m) for split in SPLITS for m in metrics]
        lines.append(f"| {name} | {mean['seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "Every run, with accuracy per operation, and paired with the CE run of the same seed on the same "
              "problems: *solved* = problems only this run solves / only CE solves; *closer* = problems where "
              "this run's answer is nearer the true one / farther than CE's (ties left out); each with an exact "
              "two-sided sign-test p:", "",
              "| run | seed | interp. acc. | per op | extrap. acc. | per op | interp. solved vs CE | "
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        help="names under --config-dir; each run is paired with the 'ce' run of its seed")
    parser.add_argument("--config-dir", default="configs/repro")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--out-dir", default="runs/repro", help="runs go to OUT/seedS/NAME")
    parser.add_argument("--procs", type=int, default=1, help="CPU processes per run (NTL_CPU_PROCS)")
    parser.add_argument("--nice", type=int, default=10, help="nice level of the runs (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds one run may take before it is failed")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the finished runs")
    parser.add_argument("--results-json", default=None, help="default: OUT/results.json")
    parser.add_argument("--results-md", default="docs/results.md", help="markdown file whose results block is "
                        "rewritten ('' to skip)")
    parser.add_argument("--figure", default="docs/figures/repro.png", help="PNG of the runs' curves ('' to skip)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the run in progress is stopped with this script.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    configs = {name: os.path.join(args.config_dir, f"{name}.yaml") for name in args.configs}
    missing = [path for path in configs.values() if not os.path.exists(os.path.join(REPO, path))]
    if missing:
        parser.error(f"config files {missing} do not exist; --configs names files under --config-dir")
    max_steps = {name: load_config(os.path.join(REPO, path), list(args.overrides)).train.max_steps
                 for name, path in configs.items()}
    results_json = args.results_json or os.path.join(args.out_dir, "results.json")
    meta_path = os.path.join(args.out_dir, "runs_meta.json")
    runs_meta: dict[str, Any] = json.loads(Path(meta_path).read_text()) if os.path.exists(meta_path) else {}

    commands = []
    for seed in args.seeds:
        for name, config in configs.items():
            output_dir = run_dir(args.out_dir, seed, name)
            command = train_command(config, output_dir, seed, args.overrides)
            nice = ["nice", "-n", str(args.nice)] if args.nice else []
            commands.append(f"NTL_CPU_PROCS={args.procs} OMP_NUM_THREADS={args.threads} " + shlex.join(nice + command))
            if args.report_only or os.path.exists(final_predictions(output_dir, max_steps[name])):
                continue
            meta = run_one(config, output_dir, seed, args.overrides, args.procs, args.nice, args.threads,
                           args.timeout)
            runs_meta[output_dir] = {**meta, "steps": max_steps[name]}
            write_atomic(meta_path, json.dumps(runs_meta, indent=1))

    report = build_report(args.out_dir, args.seeds, list(configs), max_steps, runs_meta)
    if not report["runs"]:
        raise SystemExit(f"error: no finished runs under {args.out_dir} for seeds {args.seeds}; run without "
                         f"--report-only first")
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
                  title=f"Arithmetic from scratch: CE vs CE + NTL, same steps and data; "
                        f"{len({run['seed'] for run in finished})} seed(s), one line each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
