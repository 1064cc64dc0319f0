"""Python environments that tests build (tests/test_install.py), made the way a user's would be.

A test's virtualenv is made from the BASE interpreter (the one behind the suite's virtualenv, `sys._base_executable`),
never from the suite's own interpreter with `--system-site-packages`: in a virtualenv that flag exposes the base
interpreter's packages, not the suite's, so such a test would pass or fail with whatever the machine's Python happens
to hold. The suite's packages (torch, DeepSpeed, ...) are named explicitly instead, by a `.pth` file listing the
suite's site-packages after the new environment's own, so what the new environment installs comes first.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import site
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import distribution
from pathlib import Path

BASE_PYTHON_VARIABLE = "NTL_TEST_BASE_PYTHON"


def base_interpreter() -> str:
    """The interpreter behind the suite's environment; ValueError in one line when it cannot be told.

    Checked by running it: its `sys.prefix` must be the suite's `sys.base_prefix` (a virtualenv's python reports
    the virtualenv there, so a wrong guess cannot pass)."""
    chosen = os.environ.get(BASE_PYTHON_VARIABLE) or getattr(sys, "_base_executable", "") or ""
    fix = (f"set {BASE_PYTHON_VARIABLE} to the python that made this environment (the one whose sys.prefix is "
           f"{sys.base_prefix})")
    if not chosen or not os.access(chosen, os.X_OK):
        raise ValueError(f"cannot tell the base interpreter of {sys.executable} (sys._base_executable={chosen!r}); {fix}")
    reported = subprocess.run([chosen, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                              timeout=60)
    prefix = reported.stdout.strip()
    if reported.returncode != 0 or os.path.realpath(prefix) != os.path.realpath(sys.base_prefix):
        raise ValueError(f"{chosen} is not the base interpreter of {sys.executable} (its prefix {prefix!r}, the base "
                         f"prefix {sys.base_prefix!r}); {fix}")
    return chosen


def suite_site_packages() -> list[str]:
    """The folders the suite imports installed packages from, in the suite's order."""
    folders = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [folder for folder in dict.fromkeys(folders) if os.path.isdir(folder)]


def make_virtualenv(path: Path) -> Path:
    """A new virtualenv from the base interpreter (seeded with its bundled pip, and setuptools where the base
    bundles it), seeing the suite's packages after its own. Returns its python."""
    made = subprocess.run([base_interpreter(), "-m", "venv", str(path)], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    python = path / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60)
    assert own.returncode == 0, own.stderr
    # plain folder lines: the suite's own .pth files (its editable install of this project) stay out
    Path(own.stdout.strip(), "zz_suite_packages.pth").write_text("\n".join(suite_site_packages()) + "\n")
    return python


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def wheel_of_installed(name: str, folder: Path) -> Path:
    """A wheel of the installed pure-Python distribution `name`, made from its installed files (its RECORD), so a
    test can put e.g. the build backend in a wheelhouse without a package index."""
    files = distribution(name).files or []
    info = next(entry.parts[0] for entry in files if len(entry.parts) == 2 and entry.parts[0].endswith(".dist-info")
                and entry.name == "METADATA")
    wheel_file = Path(distribution(name).locate_file(f"{info}/WHEEL")).read_text()
    tags = re.findall(r"^Tag: (\S+)$", wheel_file, flags=re.MULTILINE)
    assert "Root-Is-Purelib: true" in wheel_file and len(tags) == 1, f"{name} is not a pure-Python wheel: {wheel_file}"
    installer_only = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    wheel = folder / f"{info.removesuffix('.dist-info')}-{tags[0]}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for entry in files:
            relative = entry.as_posix()
            if (relative.startswith("../") or "__pycache__" in entry.parts or relative.endswith(".pyc")
                    or (entry.parts[0] == info and entry.name in installer_only)):
                continue
            data = Path(entry.locate()).read_bytes()
            archive.writestr(relative, data)
            record.append(f"{relative},{_record_hash(data)},{len(data)}")
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return wheel
