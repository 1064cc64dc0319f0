#!/usr/bin/env bash
# Installs ntl-pretrain (editable) and its dependencies; `--dev` adds the test dependencies.
# torch is installed first and explicitly: a bare `torch` requirement on a machine without torch
# pulls the multi-GB CUDA build. Without a GPU we ask for the CPU build of the pinned version
# (set TORCH_SPEC / PIP_EXTRA_INDEX_URL to choose another build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install "${TORCH_SPEC:-torch}"
    else
        pip install "${TORCH_SPEC:-torch==2.13.0}"
    fi
fi
pip install -q -e ".${extras}"
