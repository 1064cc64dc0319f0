#!/usr/bin/env bash
# Installs ntl-pretrain (editable) and its dependencies.
#   bash tools/install.sh [--dev] [--wheelhouse DIR]
# --dev adds the test dependencies. --wheelhouse DIR installs offline from a folder of wheels only (no package
# index is contacted): build that folder on a connected machine as docs/training.md ("Installing without
# internet") shows.
# torch is installed first and explicitly: a bare `torch` requirement on a machine without torch
# pulls the multi-GB CUDA build. Without a GPU we ask for the CPU build of the pinned version
# (set TORCH_SPEC / PIP_EXTRA_INDEX_URL to choose another build).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash tools/install.sh [--dev] [--wheelhouse DIR]"
extras=""
wheelhouse=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dev) extras="[dev]"; shift ;;
        --wheelhouse) wheelhouse="${2:?--wheelhouse needs a folder of wheels; $usage}"; shift 2 ;;
        --wheelhouse=*) wheelhouse="${1#*=}"; shift ;;
        *) echo "error: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
if [[ -n "$wheelhouse" ]]; then
    if ! ls "$wheelhouse"/*.whl >/dev/null 2>&1; then
        echo "error: --wheelhouse $wheelhouse holds no wheels (*.whl); build it on a connected machine as" \
             "docs/training.md (Installing without internet) shows" >&2
        exit 2
    fi
    offline=(--no-index --find-links "$(cd "$wheelhouse" && pwd)")
    # the editable install's build backend comes from the wheelhouse (or the environment), never an index
    pip install -q "${offline[@]}" "setuptools>=68"
    pip install -q "${offline[@]}" --no-build-isolation -e ".${extras}"
    exit 0
fi
if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install "${TORCH_SPEC:-torch}"
    else
        pip install "${TORCH_SPEC:-torch==2.13.0}"
    fi
fi
pip install -q -e ".${extras}"
