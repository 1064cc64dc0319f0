"""tools/install.sh --wheelhouse DIR installs offline: every requirement comes from the folder, no index is
contacted (pip's index is pointed at a closed port). The project's copy gains a pure-Python requirement that only
the wheelhouse holds; a fresh virtualenv sees this environment's packages for the rest (torch, DeepSpeed, ...)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a virtualenv and two pip runs: a minute or more
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


def _probe_wheel(root: Path, wheelhouse: Path) -> None:
    source = root / "probe"
    (source / "ntl_wheelhouse_probe").mkdir(parents=True)
    (source / "ntl_wheelhouse_probe" / "__init__.py").write_text("FROM_THE_WHEELHOUSE = True\n")
    (source / "pyproject.toml").write_text(f'[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = '
                                           f'"setuptools.build_meta"\n\n[project]\nname = "{PROBE}"\nversion = "1.0"\n')
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                  str(wheelhouse), str(source)])
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]


def test_install_from_a_wheelhouse_uses_no_index(tmp_path):
    project, wheelhouse = _project_copy(tmp_path), tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    assert made.returncode == 0, made.stderr
    # Python 3.11's venv seeds setuptools 65, older than the build backend wants: this environment's is used
    seeded = _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"])
    assert seeded.returncode == 0, seeded.stderr
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv),
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="", PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_RETRIES="0", PIP_TIMEOUT="5")
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
    usage = _run(["bash", str(project / "tools" / "install.sh"), "--wheelhouse", str(tmp_path / "none")], env=env)
    assert usage.returncode == 2 and "holds no wheels" in usage.stderr
