#!/usr/bin/env python
"""Run the arithmetic reproduction (configs/repro/*.yaml) and write its results table and figure.

    python tools/run_repro.py                      # every arm, seeds 1234 2345 3456, both phases, the table
    python tools/run_repro.py --jobs 1             # one run at a time (default 2, one thread each)
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
import os
import platform
import shlex
import signal
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
from ntl_pretrain.core.fs import write_text_atomic  # noqa: E402
from ntl_pretrain.runtime.supervisor import free_port  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
from repro_stats import (BEGIN_MARK, END_MARK, METRICS, OP_NAMES, SPLITS, compare, markdown, mean_std, paired, pairs_of,  # noqa: E402, F401
                         read_records, scores_of, sign_test_p, update_results_md, wilcoxon_p)

DEFAULT_CONFIGS = ("ce", "ntl_was", "ntl_mse", "ntl_mse015")
DEFAULT_SEEDS = (1234, 2345, 3456)
BASELINE = "ce"  # the config of the baseline arm of each phase, and of the continued phase's start
CONTINUED = "cpt_"  # prefix of the continued-pretraining arms' names
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


_LIVE: set[subprocess.Popen] = set()  # runs in progress, stopped when this script stops
_LIVE_LOCK = threading.Lock()


def stop_process_group(process: subprocess.Popen) -> None:
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
            stop_process_group(process)
            raise SystemExit(f"error: {shown} ran longer than --timeout {timeout:.0f} s; see {log_path}") from None
        except BaseException:
            stop_process_group(process)
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
            stop_process_group(process)
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
                                pairs_of(records_of[(seed, arm.name)], records_of[(seed, arm.baseline)], split)])
                for split in SPLITS}}
    return {"runs": runs, "means": means, "stds": stds, "pooled": pooled}


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
    parser.add_argument("--jobs", type=int, default=None, help="runs trained at a time (default 2: one a core)")
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
    defaults = QUICK if args.quick else dict(configs=list(DEFAULT_CONFIGS), seeds=list(DEFAULT_SEEDS), jobs=2)
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
                        write_text_atomic(meta_path, json.dumps(runs_meta, indent=1))

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
    write_text_atomic(results_json, json.dumps(report, indent=1))
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
