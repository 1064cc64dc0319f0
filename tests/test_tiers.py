"""The test tiers of tests/conftest.py: a test that starts a launcher or a service must carry the slow marker,
or the collection fails naming it; marked slow (and not also fast) it is collected."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT

pytest_plugins = ["pytester"]

LAUNCHING_TEST = '''
import pytest
from helpers_stub import deepspeed_command, run

{marker}
def test_trains():
    run(deepspeed_command(2, "launch/pretrain.sh"))
'''

SERVICE_TEST = '''
import pytest
from helpers_stub import run

class local_cluster:
    @staticmethod
    def SlurmCluster(root):
        return root

@pytest.fixture
def cluster(tmp_path):
    return local_cluster.SlurmCluster(tmp_path)

def test_submits(cluster):
    run([])
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((REPO_ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(helpers_stub="def deepspeed_command(*args): return []\ndef run(command): pass\n")
    return pytester


@pytest.mark.parametrize("marker,collected", [("", False), ("@pytest.mark.slow", True),
                                              ("@pytest.mark.slow\n@pytest.mark.fast", False)])
def test_a_test_that_starts_a_launcher_needs_the_slow_marker(suite, marker, collected):
    suite.makepyfile(test_launching=LAUNCHING_TEST.format(marker=marker))
    result = suite.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    if collected:
        assert result.ret == 0 and "test_launching.py::test_trains" in output, output
    else:
        assert result.ret != 0 and "test_launching.py::test_trains" in output, output
        assert ("starts DeepSpeed's launcher without the slow marker" in output) != ("fast" in marker), output


def test_a_service_started_by_a_fixture_needs_the_slow_marker(suite):
    suite.makepyfile(test_service=SERVICE_TEST)
    result = suite.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret != 0 and "test_service.py::test_submits: starts an sshd or Slurm cluster" in output, output
