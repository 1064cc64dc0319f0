"""examples/hf_trainer.py runs as written after the documented install (`bash tools/install.sh`: transformers'
Trainer needs accelerate, a dependency of the project): a real `Trainer` with `HFTrainerLoss` as its
compute_loss_func trains a tiny Llama on CPU, and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(600)


def test_the_hf_trainer_example_trains_and_its_loss_falls(tmp_path):
    result = subprocess.run([sys.executable, "examples/hf_trainer.py", "--output-dir", str(tmp_path / "out"),
                             "--max-steps", "20"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = re.search(r"trained 20 steps: loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert found, result.stdout[-2000:]
    first, last = map(float, found.groups())
    assert last < first - 1.0, (first, last)  # from ~ln(300) + NTL towards the corpus's entropy
