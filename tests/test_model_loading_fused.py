"""The partitioned load of the families whose checkpoints are not one tensor per parameter slice: Qwen3-MoE
(per-expert tensors in the files, fused `experts.gate_up_proj`/`down_proj` in transformers 5) and the fused
`query_key_value` of GPT-NeoX (interleaved per head) and Falcon (grouped: each key-value group's queries, key,
value). The files' reader serves an MoE's fused experts as `from_pretrained` assembles them (transformers' own
conversion), in any element range. Each tiny model (its own config class, saved with save_pretrained in the
published layout) is built on 2 CPU ranks with AutoTP T=2 under ZeRO-3 by the partitioned load and by the full load
(`from_pretrained` on every rank, then AutoTP slices it): every rank holds bitwise the same parameters both ways,
and the logits are plain transformers'. The T=1 load, and the export after a step at T=1 and T=2 (the published
layout, which from_pretrained loads), are tested with every family in tests/test_model_families.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.distributed import run_workers
from test_model_families import WORDS, write_setup

MODEL_TYPES = ("qwen3_moe", "gpt_neox", "falcon")


@pytest.mark.fast
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_reader_serves_fused_experts_as_from_pretrained_assembles_them(tmp_path, model_type: str):
    """Each parameter (the fused experts too) read whole and as an element range (a ZeRO-3 share) from the files of
    per-expert tensors equals from_pretrained's; an expert tensor of the wrong shape is refused in one line."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.models.loading.reading import TensorReader, file_keys, safetensors_files
    from test_model_families import tiny_model

    tiny_model(model_type).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(reference.config)
    with TensorReader(safetensors_files(str(tmp_path))) as reader:
        keys, _ = file_keys(model, str(tmp_path), reader.files, reader, None)
        assert sorted(reader.assembled) == sorted(name for name, _ in model.named_parameters() if "experts" in name)
        for name, param in reference.named_parameters():
            assert torch.equal(reader.tensor(keys[name]).reshape(param.shape), param), name
            share = torch.empty(param.numel() // 2 - 1)
            reader.read_into(keys[name], param.numel() // 2, share)
            assert torch.equal(share, param.detach().reshape(-1)[param.numel() // 2:][:share.numel()]), name
    weights = load_file(tmp_path / "model.safetensors")
    expert = next(key for key in weights if ".experts.1." in key)
    weights[expert] = weights[expert][:-1]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with TensorReader(safetensors_files(str(tmp_path))) as reader, pytest.raises(ValueError) as info:
        file_keys(model, str(tmp_path), reader.files, reader, None)
    assert f"tensor {expert!r} has shape" in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The folder of the worker's records (`_partitioned_rankR.pt`, `_full_rankR.pt`): one 2-rank run for every
    family."""
    root, _, _ = write_setup(tmp_path_factory.mktemp("tp_load"), MODEL_TYPES)
    run_workers("tp_load_families.py", 2, [str(root), str(root / "tokenizer"), *MODEL_TYPES], timeout=420)
    return root


def _assert_ranks_hold_the_full_loads_parameters(root, model_type: str, world: int) -> None:
    for rank in range(world):
        partitioned = torch.load(root / f"{model_type}_partitioned_rank{rank}.pt")
        full = torch.load(root / f"{model_type}_full_rank{rank}.pt")
        assert partitioned["local"].keys() == full["local"].keys()
        for name, tensor in full["local"].items():
            assert partitioned["local"][name].shape == tensor.shape, (rank, name)
            assert torch.equal(partitioned["local"][name], tensor), (rank, name)
        assert torch.equal(partitioned["logits"], full["logits"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_moe_partitioned_load_with_data_parallel_ranks_inside_the_tp_group(tmp_path):
    """4 ranks, T=2 (2 data-parallel ranks in each TP group): the fused experts, read whole after AutoTP, are
    ZeRO-partitioned as each is read; every rank's TP slices are still the full load's."""
    root, _, _ = write_setup(tmp_path, ("qwen3_moe",))
    run_workers("tp_load_families.py", 4, [str(root), str(root / "tokenizer"), "qwen3_moe"], timeout=420)
    _assert_ranks_hold_the_full_loads_parameters(root, "qwen3_moe", 4)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_partitioned_load_at_t2_is_the_full_load_sliced_by_autotp(loaded, model_type: str):
    from transformers import AutoModelForCausalLM

    _assert_ranks_hold_the_full_loads_parameters(loaded, model_type, 2)
    records = [torch.load(loaded / f"{model_type}_partitioned_rank{rank}.pt") for rank in (0, 1)]
    for record in records:  # no rank held the projections, the embeddings or the fused experts before AutoTP
        held = [name for name, elements in record["held_before"].items() if elements]
        assert not [name for name in held if re.search(r"experts|proj|query_key_value|dense|embed|lm_head", name)], held
    # really sliced: the fused qkv / attention projections hold half of the rows on each rank
    reference = AutoModelForCausalLM.from_pretrained(loaded / model_type, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    shapes = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    local = records[0]["local"]
    assert any(tuple(local[name].shape) != shapes[name] for name in local if "attn" in name or "attention" in name)
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(24).remainder(len(WORDS)).reshape(2, 12)).logits
    torch.testing.assert_close(records[0]["logits"], expected, rtol=1e-5, atol=1e-5)
