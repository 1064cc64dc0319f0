#!/usr/bin/env bash
# ntl-pretrain launcher. This file is both a bash script and a Python script:
#
#   deepspeed launch/pretrain.sh --config configs/demo.yaml [key=value ...]
#       DeepSpeed's launcher runs `python -u launch/pretrain.sh --local_rank=N ...` once per rank;
#       Python reads this file and starts the trainer (the bash part below is a Python string).
#   deepspeed --hostfile hostfile launch/pretrain.sh --config ...      (several nodes)
#   torchrun --nproc_per_node N launch/pretrain.sh --config ...       (torch's launcher; the same run)
#   python launch/pretrain.sh --config ...                            (no launcher: a world of one process)
#   bash launch/pretrain.sh --config configs/demo.yaml [key=value ...]
#       starts DeepSpeed's launcher on this machine: all local GPUs, or NTL_CPU_PROCS (default 2)
#       CPU processes with DS_ACCELERATOR=cpu (gloo) when there is no GPU. --help, --dry-run, --plan run directly.
#       The launcher runs under ntl_pretrain/runtime/supervisor.py, which stays the parent: SIGTERM / Ctrl-C to
#       it (or to any process of the job) makes every rank save at its next step boundary; exit 0.
#   --verbose (any form) shows the libraries' known-harmless lines too (ntl_pretrain/runtime/log_filter.py).
""":"
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python_bin="${PYTHON:-python}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
    case "$arg" in
        -h|--help|--dry-run|--dry_run|--plan) exec "$python_bin" -u "$here/pretrain.sh" "$@" ;;
    esac
done
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    exec "$python_bin" -u -m ntl_pretrain.runtime.supervisor ${NTL_DEEPSPEED_ARGS:-} "$here/pretrain.sh" "$@"
fi
export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
procs="${NTL_CPU_PROCS:-2}"
if ! [[ "$procs" =~ ^[0-9]+$ ]] || (( 10#$procs < 1 )); then  # 0 divided by zero below, -1 started 1 process
    echo "error: NTL_CPU_PROCS='$procs' is not a positive number of CPU processes; set NTL_CPU_PROCS=N (default 2)" >&2
    exit 2
fi
procs="$(( 10#$procs ))"
# each CPU rank gets an equal share of the cores (oversubscribed BLAS threads make it crawl)
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / procs > 0 ? cores / procs : 1 ))}"
echo "no GPU found: starting $procs CPU processes (DS_ACCELERATOR=$DS_ACCELERATOR, OMP_NUM_THREADS=$OMP_NUM_THREADS)" >&2
exec "$python_bin" -u -m ntl_pretrain.runtime.supervisor --num_gpus "$procs" ${NTL_DEEPSPEED_ARGS:-} "$here/pretrain.sh" "$@"
":"""
# ---------------------------------------------------------------------------------------------- Python
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow  # noqa: E402

skip_autotuner_mlflow()  # before anything imports DeepSpeed (1.5 s a rank with mlflow installed)

from ntl_pretrain.runtime import log_filter  # noqa: E402

log_filter.install(verbose=log_filter.wants_verbose(sys.argv))  # first: the imports below already warn

from ntl_pretrain.cli import LOST_PEER_HINT, main  # noqa: E402
from ntl_pretrain.parallel.distributed import run_process  # noqa: E402

# main raises (traceback, exit 1) only on a bug; errors a user can fix return 2. By the time it returns the
# lock is released and TensorBoard closed; run_process leaves without the interpreter's teardown (and turns a
# collective that failed because another rank ended or stalled into one line with the resume hint).
run_process(main, lost_peer_hint=LOST_PEER_HINT)
