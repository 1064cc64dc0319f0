"""Shared fixtures: tokenizers built in the test session (nothing downloaded; tests/helpers/models.py), the
shared data folder, the demo config's assets shared by every launched run, the DeepSpeed shared-memory clean-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Multi-process tests oversubscribe 2 cores unless each process runs one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

DEEPSPEED_SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer_"


def _mapped_files() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines()
                          if DEEPSPEED_SHM_PREFIX in line)
        except OSError:  # the process ended while we read
            continue
    return mapped


@pytest.fixture(autouse=True)
def _remove_own_deepspeed_shm():
    """DeepSpeed's CPU all-reduce leaves a 66 MiB buffer per rank in /dev/shm (RAM) when its processes
    exit; a suite of multi-process tests would pile up gigabytes. Remove the unmapped buffers of the
    ports this test session handed out (tests/helpers/distributed.free_port), and no one else's."""
    from helpers.distributed import PORTS_USED

    yield
    in_use = _mapped_files()
    for port in list(PORTS_USED):
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
            if str(path) not in in_use:
                path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def word_tokenizer():
    from helpers.models import word_level_tokenizer

    return word_level_tokenizer()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    from helpers.models import byte_level_bpe_tokenizer

    return byte_level_bpe_tokenizer()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data folder {SHARED_DATA} is absent: the tests need ../shared/data beside the clone")
    return SHARED_DATA


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """configs/demo.yaml's corpus, tokenizer and data cache for `helpers.launch.demo_overrides`: written by the
    session's first launched run, reused by every later one (no run changes them)."""
    return tmp_path_factory.mktemp("demo_assets")
