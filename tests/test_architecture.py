"""The package's shape (docs/architecture.md): every subpackage sits in a layer of pyproject.toml's import-linter
contract, no layer imports from a layer above it (`lint-imports`), and no modules import each other in a circle
(every import counts, also one inside a function)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.fast

PACKAGE = REPO_ROOT / "ntl_pretrain"
ROOT_MODULES = {"__init__", "cli", "numbers"}  # numbers: the public name of core.numbers

# Strongly connected groups of the package's import graph (grimp, as import-linter reads it); a module importing
# its own parent package is left out, as Python runs the parent's __init__ first whatever the module imports.
CIRCLES_SCRIPT = """
import grimp, networkx
graph = grimp.build_graph("ntl_pretrain", cache_dir=None)
edges = networkx.DiGraph()
for module in graph.modules:
    edges.add_node(module)
    for imported in graph.find_modules_directly_imported_by(module):
        if not module.startswith(imported + "."):
            edges.add_edge(module, imported)
for group in networkx.strongly_connected_components(edges):
    if len(group) > 1:
        print("circle:", " ".join(sorted(group)))
"""


def _checkout_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _layers() -> list[str]:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_every_subpackage_has_a_layer_and_the_root_holds_only_the_entry_points():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    root_modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert root_modules == ROOT_MODULES, "a new module belongs in the subpackage of its layer (docs/architecture.md)"
    assert subpackages | {"cli"} == set(_layers()), "each subpackage is named in one layer of [tool.importlinter]"


def test_no_layer_imports_from_a_layer_above_it():
    lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    run = subprocess.run([lint_imports, "--no-cache", "--no-logo", "pyproject.toml"], cwd=REPO_ROOT, env=_checkout_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_no_import_circles():
    run = subprocess.run([sys.executable, "-c", CIRCLES_SCRIPT], cwd=REPO_ROOT, env=_checkout_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "", run.stdout
