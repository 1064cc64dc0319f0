"""Any number of models built one after another in one process under `deepspeed.zero.Init` (issue 41).

DeepSpeed's zero.Init puts back, when it ends, the `__init__` it saw when a module class was created inside it; a
modeling module first imported there loses the wrappers that decorators (transformers 5.25's `kernels`) put on its
classes, and the next model of that class fails in its first forward. The project imports what a build imports before
entering zero.Init (`models.loading.zero3.import_outside_zero_init`): here no modeling module (nor torch._dynamo) is first
imported inside any zero.Init of the partitioned builds, and the second engine of each family in the process trains
as the first did (same seed: the same loss).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.distributed import run_workers
from ntl_pretrain.models.families import FAMILIES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

MODEL_TYPES = list(FAMILIES)  # every family of the table (each its own modeling module), its tiny config
LAZY_IMPORTS = re.compile(r"^(transformers\.models\.|transformers_modules\.|torch\._dynamo)")


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("zero_init_imports")
    config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama")
    out = root / "results.json"
    run_workers("zero_init_imports.py", 1, [str(out), str(root / "llama"), *MODEL_TYPES], timeout=540)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", [f"{kind}:from_config" for kind in MODEL_TYPES] + ["folder:load_partitioned"])
def test_a_second_model_in_the_process_trains_as_the_first(builds, case):
    result = builds[case]
    assert "error" not in result, result.get("error")
    first, second = result["losses"]
    assert first == second, f"{case}: the second engine's loss {second} differs from the first's {first}"


@pytest.mark.parametrize("case", [f"{kind}:from_config" for kind in MODEL_TYPES] + ["folder:load_partitioned"])
def test_no_modeling_module_is_first_imported_inside_zero_init(builds, case):
    result = builds[case]
    assert "error" not in result, result.get("error")
    inside = [name for name in result["imported_inside"] if LAZY_IMPORTS.match(name)]
    assert not inside, f"{case}: first imported inside deepspeed.zero.Init: {inside}"
