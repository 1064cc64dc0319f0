#!/usr/bin/env python
"""Start-up time of a launch: what every process pays to import DeepSpeed, and a whole one-step run.

    python tools/bench_launch.py [--reps 3] [--procs 1 2] [--out bench_launch.json]

1. `import deepspeed` in a fresh interpreter, `--reps` times each, alternating: plain (DeepSpeed's autotuner then
   imports mlflow when it is installed) and after `import ntl_pretrain` (which skips that import:
   ntl_pretrain/core/deepspeed_imports.py). Every process of a launch imports DeepSpeed once: the runner,
   launch.py and each rank; the runner and the ranks import ntl_pretrain first.
2. `bash launch/pretrain.sh` on configs/demo.yaml made tiny (a generated corpus in a temporary folder, one step,
   no checkpoint), `--reps` times for each `--procs` (CPU processes): seconds until the step-1 line and until the
   command returns. The first run of the session writes the corpus, tokenizer and data cache: it is run once
   first and not counted.

Wall-clock figures of one machine; compare within one run (other jobs on the machine slow every figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ntl_pretrain.core.fs import write_text_atomic  # noqa: E402
from ntl_pretrain.runtime.supervisor import free_port  # noqa: E402


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _import_seconds(code: str) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=REPO)
    return time.perf_counter() - began


def _launch_seconds(procs: int, assets: Path, out: Path) -> tuple[float, float]:
    args = ["--config", "configs/demo.yaml", f"data.sources.0.path={assets / 'arithmetic.jsonl'}",
            "data.sources.0.generate_arithmetic=3000", f"tokenizer.name_or_path={assets / 'tokenizer'}",
            f"data.cache_dir={assets / 'cache'}", "data.validation_documents=100", f"train.output_dir={out}",
            "train.log_every_n_steps=1", "monitor.progress_bar=never", "train.val_every_n_steps=-1",
            "eval.at_end=false", "checkpoint.every_n_steps=0", "checkpoint.save_final=false", "train.max_steps=1"]
    env = _env(NTL_CPU_PROCS=str(procs), NTL_DEEPSPEED_ARGS=f"--master_port {free_port()}")
    began = time.perf_counter()
    job = subprocess.Popen(["bash", "launch/pretrain.sh", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    first_step, lines = None, []
    for line in job.stdout:
        lines.append(line)
        if first_step is None and line.startswith("step 1:"):
            first_step = time.perf_counter() - began
    if job.wait() != 0 or first_step is None:
        raise SystemExit(f"the {procs}-process launch failed:\n{''.join(lines)[-3000:]}")
    return first_step, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    mlflow_installed = importlib.util.find_spec("mlflow") is not None
    plain, skipped = [], []
    for _ in range(args.reps):
        plain.append(_import_seconds("import deepspeed"))
        skipped.append(_import_seconds("import ntl_pretrain, deepspeed"))
    result = {"mlflow_installed": mlflow_installed,
              "import_deepspeed_s": statistics.median(plain),
              "import_deepspeed_after_ntl_pretrain_s": statistics.median(skipped)}
    result["import_ratio"] = result["import_deepspeed_after_ntl_pretrain_s"] / result["import_deepspeed_s"]
    print(f"import deepspeed (mlflow installed: {mlflow_installed}): plain {result['import_deepspeed_s']:.2f} s, "
          f"after import ntl_pretrain {result['import_deepspeed_after_ntl_pretrain_s']:.2f} s "
          f"({result['import_ratio']:.2f}x); medians of {args.reps}")
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as folder:
        assets = Path(folder) / "assets"
        _launch_seconds(args.procs[0], assets, Path(folder) / "warm")  # writes the corpus, tokenizer and cache
        for procs in args.procs:
            runs = [_launch_seconds(procs, assets, Path(folder) / f"run{procs}_{rep}") for rep in range(args.reps)]
            row = {"to_step_1_s": statistics.median(r[0] for r in runs),
                   "to_exit_s": statistics.median(r[1] for r in runs)}
            result[f"launch_{procs}_procs"] = row
            print(f"bash launch/pretrain.sh, {procs} CPU process(es), one step: step 1 logged at "
                  f"{row['to_step_1_s']:.1f} s, returned at {row['to_exit_s']:.1f} s; medians of {args.reps}")
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
