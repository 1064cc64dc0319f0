"""The versions of the libraries whose internals the trainer relies on, checked at start-up in one line.

pyproject.toml declares the same ranges (a test keeps the two equal): transformers 5 is the first with
`transformers.tokenization_utils_tokenizers.TokenizersBackend` and `transformers.initialization`; DeepSpeed is
used through private parts of 0.19 (`DeepSpeedEngine._configure_tensor_parallel`, AutoTP's gather, the
universal checkpoint layouts), so a later minor release is not assumed to work.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# distribution name -> the versions this code supports (the same text as in pyproject.toml's dependencies)
SUPPORTED = {
    "torch": ">=2.4",
    "deepspeed": ">=0.19.8,<0.20",
    "transformers": ">=5.0,<6",
}


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
    """Raise UnsupportedVersionError naming what is installed, what is supported and the fix."""
    wrong = unsupported()
    if wrong:
        ranges = ", ".join(f"{name}{spec}" for name, spec in SUPPORTED.items())
        pins = " ".join(f"'{name}{spec}'" for name, spec in SUPPORTED.items())
        raise UnsupportedVersionError(f"{', '.join(wrong)} installed; ntl-pretrain supports {ranges}: "
                                      f"pip install {pins} (or bash tools/install.sh)")
