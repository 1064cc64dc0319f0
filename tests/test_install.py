"""tools/install.sh --wheelhouse DIR installs offline: every requirement comes from the folder, no index is
contacted (pip's index is pointed at a closed port). The project's copy gains a pure-Python requirement that only
the wheelhouse holds. The new virtualenv is made from the base interpreter, as a user's is, and keeps the older
setuptools that interpreter seeds: the build backend (setuptools>=68) must come from the wheelhouse, as
docs/training.md's recipe puts it there; it sees the suite's packages for the rest (torch, DeepSpeed, ...) after its
own (tests/helpers/environments.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from helpers.environments import make_virtualenv, wheel_of_installed

CLOSED_INDEX = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_NO_CACHE_DIR": "1",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "5"}
PROBE = "ntl-wheelhouse-probe"


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)


def _project_copy(root: Path) -> Path:
    """The project as a user's clone has it, with PROBE added to its requirements."""
    project = root / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(REPO_ROOT / name, project / name)
    shutil.copytree(REPO_ROOT / "ntl_pretrain", project / "ntl_pretrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (project / "tools").mkdir()
    shutil.copy2(REPO_ROOT / "tools" / "install.sh", project / "tools" / "install.sh")
    pyproject = (project / "pyproject.toml").read_text()
    assert "dependencies = [\n" in pyproject
    with_probe = pyproject.replace("dependencies = [\n", f'dependencies = [\n    "{PROBE}==1.0",\n', 1)
    (project / "pyproject.toml").write_text(with_probe)
    return project


def _setuptools_version(python: Path) -> str | None:
    """The setuptools version `python` imports from its own environment (None when it has none of its own)."""
    shown = _run([str(python), "-c", "import sys, setuptools; print(setuptools.__version__, "
                  "setuptools.__file__.startswith(sys.prefix))"], cwd="/")
    assert shown.returncode == 0, shown.stderr
    version, own = shown.stdout.split()
    return version if own == "True" else None


def _probe_wheel(root: Path, wheelhouse: Path) -> None:
    source = root / "probe"
    (source / "ntl_wheelhouse_probe").mkdir(parents=True)
    (source / "ntl_wheelhouse_probe" / "__init__.py").write_text("FROM_THE_WHEELHOUSE = True\n")
    (source / "pyproject.toml").write_text(f'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = '
                                           f'"setuptools.build_meta"\n\n[project]\nname = "{PROBE}"\nversion = "1.0"\n')
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                  str(wheelhouse), str(source)])
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]


@pytest.mark.fast
@pytest.mark.parametrize("arguments", [["--wheelhouse="], ["--wheelhouse"], ["--dev", "--wheelhouse", ""]])
def test_an_empty_wheelhouse_value_is_refused_not_installed_online(arguments):
    """`--wheelhouse=$WH` with WH unset was an online install with exit 0 (issue 47 item 2)."""
    refused = _run(["bash", str(REPO_ROOT / "tools" / "install.sh"), *arguments], env=dict(os.environ, **CLOSED_INDEX))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [refused.stderr.strip()] and "--wheelhouse needs a folder" in refused.stderr
    assert refused.stdout == ""  # pip never ran


@pytest.mark.slow
@pytest.mark.timeout(900)  # a virtualenv and two pip runs: a minute or more
def test_install_from_a_wheelhouse_uses_no_index(tmp_path):
    project, wheelhouse = _project_copy(tmp_path), tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    venv = tmp_path / "venv"
    python = make_virtualenv(venv)
    seeded = _setuptools_version(python)
    wheel_of_installed("setuptools", wheelhouse)  # what the recipe's `pip download ... "setuptools>=68"` fetches
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv), **CLOSED_INDEX)
    env.pop("PYTHONPATH", None)
    install = ["bash", str(project / "tools" / "install.sh"), "--wheelhouse", str(wheelhouse)]
    (wheelhouse / "placeholder.whl").write_bytes(b"")  # not a wheel of PROBE: the install must fail, offline
    missing = _run(install, env=env)
    assert missing.returncode != 0 and PROBE in missing.stderr, missing.stderr[-3000:]
    assert "127.0.0.1:9" not in missing.stdout + missing.stderr  # the index was never contacted
    (wheelhouse / "placeholder.whl").unlink()
    _probe_wheel(tmp_path, wheelhouse)
    installed = _run(install, env=env)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    found = _run([str(venv / "bin" / "python"), "-c", "import ntl_pretrain, ntl_wheelhouse_probe as p; "
                  "print(ntl_pretrain.__file__, p.FROM_THE_WHEELHOUSE)"], env=env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [str(project / "ntl_pretrain" / "__init__.py"), "True"]
    if seeded is not None:  # the base seeded an older setuptools (Python 3.11): the wheelhouse's replaced it
        assert _setuptools_version(python) == (installed_setuptools := version("setuptools")), (
            seeded, installed_setuptools)
    usage = _run(["bash", str(project / "tools" / "install.sh"), "--wheelhouse", str(tmp_path / "none")], env=env)
    assert usage.returncode == 2 and "holds no wheels" in usage.stderr
