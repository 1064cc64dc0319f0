"""Shared fixtures: tokenizers built in the test session (nothing downloaded; tests/helpers/models.py), the
shared data folder, the demo config's assets shared by every launched run, the trainer's dry run in this process
(`dry_run_here`), the DeepSpeed shared-memory clean-up;
the test tiers (`pytest -m fast`; a test that starts a launcher or a service must be marked slow)."""

from __future__ import annotations

import functools
import inspect
import os
import re
from pathlib import Path

import pytest

# Multi-process tests oversubscribe 2 cores unless each process runs one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _add_site_to_pythonpath() -> None:
    """Every process a test starts skips DeepSpeed's autotuner `import mlflow`, DeepSpeed's own runner and launch.py
    too (1.5 s a process; tests/helpers/site/sitecustomize.py): how fast a test starts, nothing it checks. Not when
    another sitecustomize is installed, which it would hide."""
    import importlib.util

    site = Path(__file__).resolve().parent / "helpers" / "site"
    parts = [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]
    if site.is_dir() and str(site) not in parts and importlib.util.find_spec("sitecustomize") is None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *parts])


_add_site_to_pythonpath()

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


@pytest.fixture
def dry_run_here(capsys, monkeypatch):
    """`launch/pretrain.sh --dry-run ARGS` as `cli.main` in this process, run in `cwd` (default the checkout) without
    a launcher's environment: the same exit code and lines as the subprocess (`helpers.launch.dry_run`) without
    starting an interpreter and its imports again (about 5 s each). Returns (returncode, stdout, stderr)."""
    from types import SimpleNamespace

    from ntl_pretrain import cli

    monkeypatch.setattr("sys.argv", ["launch/pretrain.sh"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def run(*args: str, cwd: Path = REPO_ROOT) -> SimpleNamespace:
        monkeypatch.chdir(cwd)
        capsys.readouterr()  # only this run's lines
        returncode = cli.main(["--dry-run", *args])
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=returncode, stdout=captured.out, stderr=captured.err)

    return run


# ---------------------------------------------------------------------------------------------- test tiers
# `pytest -m fast`: the quick tier (modules marked fast). A test that starts a launcher or a service must be
# marked slow (never fast): checked at collection from the source of the test, its fixtures and the helpers
# of its module that they call. What starts one, as written in the tests:
STARTS_A_LAUNCHER_OR_SERVICE = {
    "DeepSpeed's launcher": re.compile(r"(?<!def )deepspeed_command\(|\[\s*\"deepspeed\""),
    "torchrun": re.compile(r"\[\s*\"torchrun\""),
    "bash launch/pretrain.sh (DeepSpeed's launcher)": re.compile(
        r"\[\s*\"bash\",\s*(?:\"launch/pretrain\.sh\"|str\(REPO\s*/\s*\"launch\"\s*/\s*\"pretrain\.sh\"\))"
        r"(?![^\]\n]*--help)"),
    "an sshd or Slurm cluster (tools/local_cluster.py)": re.compile(r"local_cluster\.\w+\("),
    "tools/run_repro.py or tools/gpu_check.sh (launched runs)": re.compile(r"run_repro\.py\"|gpu_check\.sh\""),
}


CALLED_NAME = re.compile(r"\b(\w+)\(")


@functools.cache  # a function's source is read once, not once per test that names it
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _sources_run_by(item: pytest.Item) -> str:
    """The test's source, its fixtures' and those of the module-level functions of its module they name."""
    texts = [_source(item.function)]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        texts.append(_source(definitions[-1].func))
    module_functions = {name: value for name, value in vars(item.module).items()
                        if inspect.isfunction(value) and value.__module__ == item.module.__name__}
    seen: set[str] = set()
    pending = "\n".join(texts)
    while True:
        # the module's functions that `pending` calls (a whole identifier followed by "(")
        called = sorted(set(CALLED_NAME.findall(pending)) & module_functions.keys() - seen)
        if not called:
            return "\n".join(texts)
        seen.update(called)
        pending = "\n".join(_source(module_functions[name]) for name in called)
        texts.append(pending)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        slow, fast = item.get_closest_marker("slow"), item.get_closest_marker("fast")
        if slow and fast:
            wrong.append(f"{item.nodeid}: marked both fast and slow")
            continue
        if slow or not isinstance(item, pytest.Function):
            continue
        text = _sources_run_by(item)
        starts = [what for what, pattern in STARTS_A_LAUNCHER_OR_SERVICE.items() if pattern.search(text)]
        if starts:
            wrong.append(f"{item.nodeid}: starts {', '.join(starts)} without the slow marker "
                         f"(add `pytestmark = pytest.mark.slow` to its module or @pytest.mark.slow)")
    if wrong:
        raise pytest.UsageError("tests/conftest.py: test tiers:\n" + "\n".join(wrong))
    _refuse_environment_tests_without_a_base_interpreter(items)


def _refuse_environment_tests_without_a_base_interpreter(items: list[pytest.Item]) -> None:
    """Tests that build a Python environment make it from the interpreter behind the suite's (a user's virtualenv
    is made so): when that cannot be told, the suite stops here in one line rather than build from the wrong one."""
    if any("make_virtualenv(" in _sources_run_by(item) for item in items if isinstance(item, pytest.Function)):
        from helpers.environments import base_interpreter  # only when collected: a pytester copy has no helpers

        try:
            base_interpreter()
        except ValueError as error:
            raise pytest.UsageError(f"tests/conftest.py: {error}") from None
