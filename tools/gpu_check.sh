#!/usr/bin/env bash
# The GPU check in one command (the recipe and its options: tools/gpu_check.py, or --help):
#   bash tools/gpu_check.sh --out gpu_check.json                  # one CUDA GPU, at most ~8 minutes
#   bash tools/gpu_check.sh --cpu --tiny --out /tmp/check.json    # CPU, tiny: every part in a few minutes
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
    if [[ "$arg" == "--cpu" ]]; then
        export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    fi
done
exec "${PYTHON:-python}" "$repo/tools/gpu_check.py" "$@"
