"""The versions of the libraries whose internals the trainer relies on, checked at start-up in one line.

The ranges are the tested ones, no wider: pyproject.toml declares the same (a test keeps the two equal) and
constraints.txt pins the exact set the suite passed with, which tools/install.sh installs. DeepSpeed is used through
private parts of 0.19.8 (`DeepSpeedEngine._configure_tensor_parallel`, AutoTP's gather, zero.Init's class hooks, the
universal checkpoint layouts); transformers' minor releases change what model classes do at construction (5.25
wraps attention `__init__`s for `kernels`), so a later minor release is not assumed to work until the suite ran on
it. `NTL_ALLOW_UNTESTED_VERSIONS=1` turns the refusal into a warning (to try another version, at your risk).
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# distribution name -> the versions this code supports (the same text as in pyproject.toml's dependencies)
SUPPORTED = {
    "torch": ">=2.13,<2.14",
    "deepspeed": "==0.19.8",
    "transformers": ">=5.25,<5.26",
}
ALLOW_UNTESTED = "NTL_ALLOW_UNTESTED_VERSIONS"  # =1: outside SUPPORTED is a warning, not a refusal


class UnsupportedVersionError(ValueError):
    """An installed library is outside the supported range (exit 2, one line)."""


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution` (None when it is not installed)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def unsupported() -> list[str]:
    """`name version` of each installed library outside SUPPORTED (a local build such as 2.13.0+cpu or a
    release candidate counts as its release)."""
    found = []
    for name, spec in SUPPORTED.items():
        version = installed_version(name)
        try:
            ok = version is not None and Version(Version(version).base_version) in SpecifierSet(spec)
        except InvalidVersion:
            ok = False
        if not ok:
            found.append(f"{name} {version or '(not installed)'}")
    return found


def check_versions() -> None:
    """Raise UnsupportedVersionError naming what is installed, what is supported and the fix (a warning instead
    with NTL_ALLOW_UNTESTED_VERSIONS=1)."""
    wrong = unsupported()
    if wrong:
        ranges = ", ".join(f"{name}{spec}" for name, spec in SUPPORTED.items())
        pins = " ".join(f"'{name}{spec}'" for name, spec in SUPPORTED.items())
        message = (f"{', '.join(wrong)} installed; ntl-pretrain supports {ranges}: pip install {pins} (or bash "
                   f"tools/install.sh)")
        if os.environ.get(ALLOW_UNTESTED) == "1":
            logging.getLogger("ntl_pretrain").warning("%s; going on untested (%s=1)", message, ALLOW_UNTESTED)
            return
        raise UnsupportedVersionError(f"{message}, or set {ALLOW_UNTESTED}=1 to run untested")
