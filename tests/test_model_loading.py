"""Partitioned ZeRO-3 loading (`ntl_pretrain.models.loading`), 2 CPU ranks through real DeepSpeed.

The weights each rank ends up with, gathered after `deepspeed.initialize` (T=1: every parameter; AutoTP
T=2: DeepSpeed's own 16-bit export, which gathers the TP slices), must be the ones in the safetensors
files (read back with `safetensors` here), or, with a vocabulary resize, the ones the full-model resize
(`tokenizer.resize.resize_model_embeddings` on `from_pretrained`) gives, and the logits those of
`from_pretrained`. Before `deepspeed.initialize` each rank must hold only its share of every parameter
(T=1: half; T=2: nothing of the weights AutoTP slices, which it then reads, half of each). Through the
real `Trainer`, a checkpoint of the loaded model exported again with tools/export_hf.py equals the input.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.distributed import run_workers

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 420
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(3 * TIMEOUT)]
ARCH = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _save_model(folder: Path, vocab: int, tied: bool, max_shard_size: str = "5GB") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=vocab, tie_word_embeddings=tied, **ARCH)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def _file_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights = {}
    for path in folder.glob("*.safetensors"):
        weights.update(load_file(path))
    return weights


def _run(tmp_path: Path, model_dir: Path, tokenizer_dir: Path, resize: bool, tp: int = 1, world: int = 2) -> dict:
    out = tmp_path / "gathered.pt"
    run_workers("model_loading.py", world, [str(model_dir), str(tokenizer_dir), str(out), "1", "1" if resize else "0",
                                            str(tp)], timeout=TIMEOUT)
    return torch.load(out)


def _assert_held_a_share(result: dict) -> None:
    for rank, held in enumerate(result["held"]):
        for name, full in result["full"].items():
            assert held["before"][name] == -(-full // 2), f"{name}: rank {rank} held {held['before'][name]} of {full}"


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(24).remainder(model.config.vocab_size).reshape(2, 12)).logits


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    bpe_tokenizer.save_pretrained(folder)
    return folder


SCRATCH_ARCHITECTURE = {"model_type": "llama", **ARCH}


@pytest.fixture(scope="module")
def t1_loads(tmp_path_factory, tokenizer_dir, bpe_tokenizer) -> dict[str, tuple[Path | None, dict]]:
    """The three T=1 builds on 2 ranks in one launch (one DeepSpeed start): {case: (model folder, worker result)}:
    "sharded" (untied, several shards, no resize), "resized" (tied, 16 rows short of the tokenizer, grown while
    reading), "scratch" (no model.name_or_path: SCRATCH_ARCHITECTURE built partitioned)."""
    root = tmp_path_factory.mktemp("t1_loads")
    folders = {"sharded": _save_model(root / "sharded", len(bpe_tokenizer), tied=False, max_shard_size="30KB"),
               "resized": _save_model(root / "resized", len(bpe_tokenizer) - 16, tied=True), "scratch": None}
    jobs = {"sharded": ["0"], "resized": ["1"], "scratch": ["0", "1", json.dumps(SCRATCH_ARCHITECTURE)]}
    args: list[str] = []
    for name, folder in folders.items():
        (root / name / "out").mkdir(parents=True)
        args += ["--"] * bool(args) + [str(folder or "-"), str(tokenizer_dir), str(root / name / "out" / "gathered.pt"),
                                       "1", *(jobs[name] if name == "scratch" else [jobs[name][0], "1"])]
    run_workers("model_loading.py", 2, args, timeout=TIMEOUT + 120)
    return {name: (folder, torch.load(root / name / "out" / "gathered.pt")) for name, folder in folders.items()}


def test_sharded_checkpoint_loads_partitioned_with_the_files_values(t1_loads):
    from transformers import AutoModelForCausalLM

    model_dir, result = t1_loads["sharded"]
    assert (model_dir / "model.safetensors.index.json").is_file()  # several shards
    files = _file_weights(model_dir)
    assert set(result["state"]) == set(files)
    for name, tensor in files.items():
        assert torch.equal(result["state"][name], tensor), name
    _assert_held_a_share(result)
    assert result["report"]["parameters"] == sum(t.numel() for t in files.values())
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    torch.testing.assert_close(result["logits"], _logits(reference), rtol=1e-5, atol=1e-5)


def test_resize_while_loading_equals_the_full_model_resize(t1_loads, bpe_tokenizer):
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.tokenizer.resize import resize_model_embeddings

    old_rows = len(bpe_tokenizer) - 16
    model_dir, result = t1_loads["resized"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    resize = resize_model_embeddings(reference, bpe_tokenizer, 64, init="mean")
    expected = dict(reference.named_parameters())
    assert set(result["state"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result["state"][name], tensor.detach(), rtol=0, atol=1e-6, msg=name)
    assert result["tied"] and result["config_vocab"] == resize.new_rows
    # the tied head's own weight is never partitioned (tie_weights replaces it): that would be a second copy of
    # the embedding's share while the model is built
    assert result["converted_elements"] == sum(result["full"].values())
    assert result["report"]["resized_from"] == old_rows and result["report"]["vocab_size"] == resize.new_rows
    _assert_held_a_share(result)


def _assert_held_the_tp_slices(result: dict, sliced: set[str], tp: int = 2,
                               read_after: frozenset[str] = frozenset()) -> None:
    """Before initialize no rank held any element of the weights AutoTP slices (meta) nor of `read_after`
    (linear/embedding weights AutoTP leaves whole); after it each held its ZeRO share (over the world / T
    data-parallel ranks) of its TP slice of each sliced one, and its ZeRO share of the rest."""
    assert sliced
    dp = len(result["held"]) // tp
    for rank, held in enumerate(result["held"]):
        for name, full in result["full"].items():
            whole = full // tp if name in sliced else full
            expected = (0 if name in sliced | read_after else full, -(-whole // dp))
            assert (held["before"][name], held["after"][name]) == expected, (rank, name, held["before"][name],
                                                                             held["after"][name], full)


@pytest.mark.parametrize("world", [2, 4])
def test_autotp_load_reads_each_ranks_slices_with_the_resize(tmp_path, tokenizer_dir, bpe_tokenizer, world):
    """T=2, tied head, vocabulary grown 384 -> 448 rows while reading: the vocabulary-parallel embedding/head
    and the column- and row-parallel projections hold the rows/columns AutoTP gives each rank; with 4 ranks
    (2 data-parallel) each slice is also ZeRO-partitioned as it is read."""
    from transformers import AutoModelForCausalLM

    from ntl_pretrain.tokenizer.resize import resize_model_embeddings

    model_dir = _save_model(tmp_path / "model", len(bpe_tokenizer) - 16, tied=True, max_shard_size="30KB")
    result = _run(tmp_path, model_dir, tokenizer_dir, resize=True, tp=2, world=world)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    resize = resize_model_embeddings(reference, bpe_tokenizer, 64, init="mean")
    expected = reference.state_dict()
    assert resize.new_rows == 448 and result["config_vocab"] == 448 and result["tied"]
    assert set(result["state"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result["state"][name], tensor, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(result["logits"], _logits(reference), rtol=1e-5, atol=1e-5)
    _assert_held_the_tp_slices(result, {name for name in result["full"] if "proj" in name or "embed" in name})


def test_from_scratch_build_is_partitioned_with_the_whole_builds_weights(t1_loads, bpe_tokenizer):
    """No model.name_or_path, ZeRO-3, T=1: each rank holds half of every parameter before initialize, and
    the weights are those of the whole build (`build_model` without a DeepSpeed config) with the same seed (the
    launch's third job: the seed is the build's own, not the process's state after the two loads before it)."""
    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.models.build import build_model

    _, result = t1_loads["scratch"]
    whole, report = build_model(ModelConfig(architecture=SCRATCH_ARCHITECTURE, dtype="fp32", attn_implementation="eager"),
                                bpe_tokenizer, 1)
    expected = dict(whole.named_parameters())
    assert set(result["state"]) == set(expected) and result["report"] == asdict(report)
    for name, tensor in expected.items():
        assert torch.equal(result["state"][name], tensor.detach()), name
    _assert_held_a_share(result)
    torch.testing.assert_close(result["logits"], _logits(whole.eval()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_checkpoint_of_the_partitioned_load_exports_the_input(tmp_path, tokenizer_dir, bpe_tokenizer, tp):
    """One real Trainer step of the partitioned load (untied head), then its checkpoint exported again equals
    the input. T=1: each rank held half of every parameter before initialize; T=2: the head is
    vocabulary-parallel and the input embedding stays whole (AutoTP replicates it; read after AutoTP)."""
    model_dir = _save_model(tmp_path / "model", len(bpe_tokenizer), tied=False)
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(model_dir), "dtype": "fp32", "attn_implementation": "eager"},
        "tokenizer": {"name_or_path": str(tokenizer_dir), "digit_level": False},
        "data": {"sources": [{"path": str(tmp_path / "arithmetic.jsonl"), "generate_arithmetic": 200}],
                 "seq_len": 32, "micro_batch_size": 2, "validation_documents": 0, "cache_dir": str(tmp_path / "cache")},
        "loss": {"enabled": False},
        # one real step whose update (about lr) is far below the weights' float32 resolution: they stay as loaded
        "optim": {"lr": 1e-30, "weight_decay": 0.0},
        "parallel": {"tp_size": tp, "zero_stage": 3},
        "train": {"output_dir": str(run), "max_steps": 1, "val_every_n_steps": -1},
        "monitor": {"progress_bar": "never"},
    }), encoding="utf-8")
    out = tmp_path / "held.json"
    run_workers("trainer_start.py", 2, [str(config), "1", str(out)], timeout=TIMEOUT)
    held = json.loads(out.read_text())["held"]
    files = _file_weights(model_dir)
    for rank in range(2):
        for name, tensor in files.items():
            if tp == 1:
                expected = -(-tensor.numel() // 2)
            else:  # nothing of the linear and embedding weights (meta until AutoTP sliced them), the norms whole
                expected = tensor.numel() if "norm" in name else 0
            assert held[rank][name] == expected, (rank, name, held[rank][name])
    exported = tmp_path / "hf"
    result = subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), str(run / "global_step1"),
                             str(exported)], cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT,
                            env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    again = _file_weights(exported)
    assert set(again) == set(files)
    for name, tensor in files.items():
        assert torch.equal(again[name], tensor), name


def test_a_folder_without_safetensors_names_the_fix(tmp_path):
    from ntl_pretrain.models.loading import safetensors_files

    with pytest.raises(ValueError, match="model.partitioned_load=false"):
        safetensors_files(str(tmp_path))


def _damaged(source: Path, folder: Path, damage) -> str:
    import shutil

    shutil.copytree(source, folder)
    damage(folder)
    return str(folder)


def test_a_damaged_download_is_named_before_the_model_is_built(tmp_path):
    """An index naming a shard that is absent, outside the folder or without the tensor; an index or a shard that
    is not JSON / cut short: one ValueError naming the file (before: FileNotFoundError, JSONDecodeError, KeyError
    or AttributeError from inside the build), raised by `safetensors_files`, which every rank calls first."""
    from ntl_pretrain.models.loading import safetensors_files

    source = _save_model(tmp_path / "model", vocab=64, tied=False, max_shard_size="40KB")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and len(safetensors_files(str(source))) == len(index["weight_map"])

    def with_map(change):
        def damage(folder: Path) -> None:
            (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": change(
                dict(index["weight_map"]))}))
        return damage

    def cut(name: str, keep: int):
        return lambda folder: os.truncate(folder / name, keep)

    cases = {
        "missing shard": (lambda folder: (folder / shards[1]).unlink(), f"in '{shards[1]}', which is not in"),
        "name outside": (with_map(lambda m: {**m, "lm_head.weight": "../model/" + shards[0]}),
                         "'../model/" + shards[0] + "', which is not a file name inside the model folder"),
        "absolute name": (with_map(lambda m: {**m, "lm_head.weight": "/etc/passwd"}), "'/etc/passwd', which is not"),
        "tensor not in shard": (with_map(lambda m: {**m, "extra.weight": shards[0]}),
                                f"puts 'extra.weight' (1 tensors) in '{shards[0]}', which does not hold it"),
        "index not json": (lambda folder: (folder / "model.safetensors.index.json").write_text("{"),
                           'is not a safetensors index (a JSON object whose "weight_map"'),
        "weight_map list": (lambda folder: (folder / "model.safetensors.index.json").write_text('{"weight_map": []}'),
                            "is not a safetensors index"),
        "header cut": (cut(shards[0], 20), f"{shards[0]}' is not a complete safetensors file (20 bytes"),
        "data cut": (cut(shards[0], (source / shards[0]).stat().st_size - 8), f"{shards[0]}' is truncated"),
    }
    for label, (damage, message) in cases.items():
        with pytest.raises(ValueError) as info:
            safetensors_files(_damaged(source, tmp_path / label.replace(" ", "_"), damage))
        assert message in str(info.value), (label, str(info.value))
        assert "download" in str(info.value) or "fix the index" in str(info.value), label


def test_an_untied_config_without_a_head_in_the_files_names_the_tie_setting(tmp_path, bpe_tokenizer):
    """A tied checkpoint (no lm_head.weight in its files) under a config saying tie_word_embeddings=false: the
    partitioned load told the user to set model.partitioned_load=false, whose from_pretrained then trained from a
    randomly initialised head (transformers only prints a report). Both loads name the tie setting instead, and
    with it set the files serve every parameter."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from ntl_pretrain.config import ModelConfig
    from ntl_pretrain.models.build import build_model
    from ntl_pretrain.models.loading.reading import TensorReader, file_keys, safetensors_files

    folder = _save_model(tmp_path / "model", vocab=64, tied=False)
    weights = _file_weights(folder)
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for tied in (False, True):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=64, tie_word_embeddings=tied,
                                                                      **ARCH))
        with TensorReader(safetensors_files(str(folder))) as reader:
            if tied:
                keys, _ = file_keys(model, str(folder), reader.files, reader, None)
                assert set(keys) == {name for name, _ in model.named_parameters()}
                continue
            with pytest.raises(ValueError) as info:
                file_keys(model, str(folder), reader.files, reader, None)
        assert "hold no output head (lm_head.weight) but the config has tie_word_embeddings=false" in str(info.value)
        assert "model.architecture.tie_word_embeddings=true" in str(info.value)
        assert "partitioned_load=false" not in str(info.value)
    with pytest.raises(ValueError, match=r"the checkpoint has no weights for \['lm_head.weight'\], which would start "
                                         r"from random values; if the checkpoint ties its head .*tie_word_embeddings=true"):
        build_model(ModelConfig(name_or_path=str(folder), dtype="fp32", resize_embeddings=True), bpe_tokenizer, 1)
    model, _ = build_model(ModelConfig(name_or_path=str(folder), dtype="fp32", resize_embeddings=True,
                                       architecture={"tie_word_embeddings": True}), bpe_tokenizer, 1)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_partitioned_load_applies_to_zero3_only():
    from ntl_pretrain.models.loading import partitioned_load_applies

    zero3 = {"zero_optimization": {"stage": 3}}
    assert partitioned_load_applies(zero3, 1)
    assert partitioned_load_applies({**zero3, "tensor_parallel": {"autotp_size": 2}}, 2)
    assert not partitioned_load_applies(zero3, 2)  # no AutoTP in the DeepSpeed config
    assert not partitioned_load_applies({"zero_optimization": {"stage": 2}}, 1)
    assert not partitioned_load_applies(None, 1)



def test_tp_slice_reads_deepspeeds_layout_and_refuses_a_fused_one():
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    from ntl_pretrain.models.loading import _tp_slice

    row_parallel = torch.empty(48, 20, device="meta")
    setattr(row_parallel, DS_AUTOTP_UC_META, {"partition_dim": 1, "partition_sizes": (28, 20), "replicated": False})
    assert _tp_slice(row_parallel, "o_proj.weight", 1) == (1, 28, 20)  # an uneven split: rank 1 starts at 28
    assert _tp_slice(torch.empty(48, device="meta"), "norm.weight", 1) is None  # no layout: replicated
    fused = torch.empty(36, 48, device="meta")
    setattr(fused, DS_AUTOTP_UC_META, {"partition_dim": 0, "partition_sizes": (36, 36), "sub_param_sizes": (24, 24, 24),
                                       "partition_type": "column"})
    with pytest.raises(ValueError, match="model.partitioned_load=false"):
        _tp_slice(fused, "qkv_proj.weight", 0)


_HEAP_SCRIPT = """
import torch
from ntl_pretrain.models.loading.reading import heap_returned_to_os

def rss_mib():
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024

def freed_block_resident():  # what a build does a module (or a read buffer) at a time
    before = rss_mib()
    block = torch.ones(2 * 2**20)
    del block
    return rss_mib() - before

big = torch.ones(4 * 2**20)
del big  # a freed 16 MiB block: glibc's dynamic mmap threshold now serves smaller blocks from the heap
plain = freed_block_resident()
with heap_returned_to_os():
    inside = freed_block_resident()
print(plain, inside)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heap policy is glibc's")
def test_blocks_freed_while_building_leave_the_resident_size():
    """`heap_returned_to_os` (around every partitioned build and read): a written and freed 8 MiB block stays
    resident in glibc's heap once a larger block has been freed, and leaves it inside the context."""
    result = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    plain, inside = map(float, result.stdout.split())
    assert plain > 6, f"the plain heap kept only {plain:.1f} MiB of 8: the test no longer shows what it guards"
    assert inside < 1, f"{inside:.1f} MiB of the freed 8 MiB block stayed resident inside heap_returned_to_os"
