#!/usr/bin/env bash
# Installs ntl-pretrain (editable) and its dependencies.
#   bash tools/install.sh [--dev] [--latest] [--wheelhouse DIR]
# By default every package comes at the version in constraints.txt: the set the test suite passed with (CI installs
# exactly this), so a new release of a dependency cannot change a fresh install under you. --latest drops the
# constraints and installs the newest versions pyproject.toml allows (to try new releases; then run the tests).
# --dev adds the test dependencies. --wheelhouse DIR installs offline from a folder of wheels only (no package
# index is contacted): build that folder on a connected machine as docs/training.md ("Installing without
# internet") shows.
# torch is installed first and explicitly: a bare `torch` requirement on a machine without torch
# pulls the multi-GB CUDA build. Without a GPU we ask for the CPU build of the pinned version
# (set TORCH_SPEC / PIP_EXTRA_INDEX_URL to choose another build).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash tools/install.sh [--dev] [--latest] [--wheelhouse DIR]"
extras=""
wheelhouse=""
latest=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dev) extras="[dev]"; shift ;;
        --latest) latest=1; shift ;;
        # an empty value (--wheelhouse=$WH with WH unset) must not fall through to an online install
        --wheelhouse|--wheelhouse=*)
            if [[ "$1" == --wheelhouse ]]; then wheelhouse="${2:-}"; shift $(( $# > 1 ? 2 : 1 )); else wheelhouse="${1#*=}"; shift; fi
            if [[ -z "$wheelhouse" ]]; then
                echo "error: --wheelhouse needs a folder of wheels (got none or an empty one, e.g. --wheelhouse=\$WH with WH unset); $usage" >&2
                exit 2
            fi ;;
        *) echo "error: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
done
constraints=(-c constraints.txt)
if [[ -n "$latest" ]]; then
    constraints=()
elif [[ ! -f constraints.txt ]]; then
    echo "error: constraints.txt (the tested versions) is missing from $(pwd); restore it from git, or pass --latest" >&2
    exit 2
fi
if [[ -n "$wheelhouse" ]]; then
    if ! ls "$wheelhouse"/*.whl >/dev/null 2>&1; then
        echo "error: --wheelhouse $wheelhouse holds no wheels (*.whl); build it on a connected machine as" \
             "docs/training.md (Installing without internet) shows" >&2
        exit 2
    fi
    offline=(--no-index --find-links "$(cd "$wheelhouse" && pwd)")
    # the editable install's build backend comes from the wheelhouse (or the environment), never an index
    if ! pip install -q "${offline[@]}" "${constraints[@]}" "setuptools>=68"; then
        echo "error: the build backend setuptools>=68 is neither in this environment nor in --wheelhouse $wheelhouse;" \
             "add its wheel there as docs/training.md (Installing without internet) shows" >&2
        exit 2
    fi
    pip install -q "${offline[@]}" "${constraints[@]}" --no-build-isolation -e ".${extras}"
    exit 0
fi
if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip install "${constraints[@]}" "${TORCH_SPEC:-torch}"
    else
        tested_torch="$(sed -n 's/^torch==//p' constraints.txt 2>/dev/null)"
        pip install "${constraints[@]}" "${TORCH_SPEC:-torch==${tested_torch:-2.13.0}}"
    fi
fi
pip install -q "${constraints[@]}" -e ".${extras}"
