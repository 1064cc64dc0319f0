"""The start-up rehearsal at full size (ntl_pretrain/trainer/rehearsal.py): every rank of a 256-rank Llama-3-70B
run (tp 8) and of a 64-rank Llama-3-8B run with sequence parallelism (sp 8) goes through the project's start-up
in this process (torch's fake process group, the model on the meta device), and every share must be complete and
disjoint. The expected values of single ranks come from the layout conventions (Megatron's and DeepSpeed's: tp
ranks contiguous, g = (dp * sp + sp_rank) * tp + tp_rank) and the models' sizes, not from the rehearsal's output;
a deliberately broken share of each kind must be reported."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from ntl_pretrain.config import load_config
from ntl_pretrain.models.loading.zero3 import init_without_broadcast, zero3_partition_numel
from ntl_pretrain.trainer.rehearsal import check_shares, rehearse, simulated_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "llama3_8b_cpt.yaml")

# Llama-3's shapes (meta-llama/Meta-Llama-3-70B and -8B config.json)
LLAMA3_70B = dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA3_8B = dict(LLAMA3_70B, num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=14336)


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    """The two model folders (config.json only) and two local streamed sources: one jsonl file (fewer files than
    data-parallel ranks: split by byte range) and a folder of 40 files (each rank its own files)."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("rehearsal")
    for name, sizes in (("llama3-70b", LLAMA3_70B), ("llama3-8b", LLAMA3_8B)):
        LlamaConfig(**sizes).save_pretrained(root / name)
    (root / "one").mkdir()
    with open(root / "one" / "web.jsonl", "w", encoding="utf-8") as handle:
        for i in range(3000):
            handle.write(json.dumps({"text": f"document {i}: {i * 7} apples " * 8}) + "\n")
    (root / "many").mkdir()
    for k in range(40):
        with open(root / "many" / f"part-{k:03d}.jsonl", "w", encoding="utf-8") as handle:
            for i in range(20):
                handle.write(json.dumps({"text": f"part {k} row {i}: {k * i} " * 8}) + "\n")
    return root


def _config(root, model: str, *overrides: str):
    sources = (f"data.sources=[{{path: {root / 'one'}, text_field: text, streaming: true, weight: 0.6}}, "
               f"{{path: {root / 'many'}, text_field: text, streaming: true, weight: 0.4}}]")
    return load_config(CONFIG, [f"model.name_or_path={root / model}", sources, "data.validation_documents=10",
                                *overrides])


@pytest.fixture(scope="module")
def llama70b_256(run_inputs):
    return rehearse(_config(run_inputs, "llama3-70b", "parallel.tp_size=8"), 256)


@pytest.fixture(scope="module")
def llama8b_sp_64(run_inputs):
    return rehearse(_config(run_inputs, "llama3-8b", "parallel.tp_size=1", "parallel.sp_size=8"), 64)


def test_70b_at_256_ranks_every_share_complete_and_disjoint(llama70b_256, run_inputs):
    rehearsal = llama70b_256
    assert rehearsal.problems == []
    assert (rehearsal.tp_size, rehearsal.sp_size, rehearsal.dp_size) == (8, 1, 32)
    assert rehearsal.model["parameters"] == 70_553_706_496  # Llama-3-70B's published count
    rank = rehearsal.shares[173]
    assert (rank.tp_rank, rank.dp_rank, rank.local_rank) == (173 % 8, 173 // 8, 173 % 8)
    assert rank.groups["tp"] == rank.groups["vocab"] == tuple(range(168, 176))
    assert rank.groups["dp"] == rank.groups["zero"] == rank.groups["loss"] == tuple(range(5, 256, 8))
    assert rank.vocab == (5 * 128256 // 8, 6 * 128256 // 8)
    assert rank.heads == {"attention": (40, 48), "key_value": (5, 6)}
    assert rehearsal.slices[5]["model.layers.0.self_attn.q_proj.weight"] == [(0, 5 * 1024, 1024)]
    assert rehearsal.slices[5]["model.layers.79.mlp.down_proj.weight"] == [(1, 5 * 28672 // 8, 28672 // 8)]
    assert rehearsal.slices[5]["model.norm.weight"] == []  # replicated
    q_partition = 1024 * 8192 // 32  # layer 0's q rows of tp rank 5, over its 32 ZeRO partitions
    assert rehearsal.zero_ranges[173]["model.layers.0.self_attn.q_proj.weight"] == [(21 * q_partition,
                                                                                       22 * q_partition)]
    assert sorted(rank.checkpoint_files) == sorted(["rng_state_173.pt", "zero_pp_rank_21_mp_rank_05_model_states.pt",
                                                    "bf16_zero_pp_rank_21_mp_rank_05_optim_states.pt"])
    assert sum(len(share.checkpoint_files) for share in rehearsal.shares) == 3 * 256
    # global batch of step s: samples (s - 1) * 128 + m * 32 + dp_rank, m < 4 accumulation steps
    assert len(rank.samples) == 2 * 4 and rank.samples == rehearsal.shares[168].samples
    assert [rehearsal.shares[r].samples for r in range(168, 176)] == [rank.samples] * 8
    # the prompts in contiguous chunks of ceil(n / 32) over the dp group: arithmetic 500 x 2 splits, GSM8K 200
    assert rank.eval_prompts == {"arith": (21 * 32, 22 * 32), "gsm8k": (21 * 7, 22 * 7)}
    start, stop = rehearsal.shares[31 * 8].eval_prompts["gsm8k"]
    assert stop == start  # dp rank 31 (7 x 31 > 200): none left
    assert rank.stream_files["data.sources.1"] == [(21, 0, -1)]  # 40 files over 32 ranks: file 21 only
    assert rehearsal.shares[0].stream_files["data.sources.1"] == [(0, 0, -1), (32, 0, -1)]
    size = os.path.getsize(run_inputs / "one" / "web.jsonl")  # one file over 32 ranks: 1/32 of its bytes each
    assert rank.stream_files["data.sources.0"] == [(0, 21 * size // 32, 22 * size // 32)]


def test_8b_with_sequence_parallelism_at_64_ranks(llama8b_sp_64):
    rehearsal = llama8b_sp_64
    assert rehearsal.problems == []
    assert (rehearsal.tp_size, rehearsal.sp_size, rehearsal.dp_size) == (1, 8, 8)
    assert rehearsal.model["parameters"] == 8_030_261_248  # Llama-3-8B's published count
    rank = rehearsal.shares[45]  # dp 5, sp 5
    assert (rank.tp_rank, rank.sp_rank, rank.dp_rank) == (0, 5, 5)
    assert rank.groups["sp"] == tuple(range(40, 48))
    assert rank.groups["tp"] == rank.groups["vocab"] == (45,)
    assert rank.groups["dp"] == tuple(range(5, 64, 8))  # the same sp rank in every sequence-parallel group
    assert rank.groups["zero"] == rank.groups["loss"] == tuple(range(64))  # ZeRO over dp x sp
    assert rank.sequence == (5 * 8192 // 8, 6 * 8192 // 8)
    assert rank.heads == {"attention": (20, 24), "key_value": (5, 6)}
    assert rank.vocab == (0, 128256)
    assert sorted(rank.checkpoint_files) == sorted(["rng_state_45.pt", "zero_pp_rank_45_mp_rank_00_model_states.pt",
                                                    "bf16_zero_pp_rank_45_mp_rank_00_optim_states.pt"])
    assert [rehearsal.shares[r].samples for r in range(40, 48)] == [rank.samples] * 8  # sp peers: the same rows
    assert rehearsal.shares[44].samples != rehearsal.shares[36].samples


def test_qwen_with_a_tied_head_at_16_ranks(run_inputs):
    """configs/qwen2.5_0.5b_cpt.yaml as written (tp 2) for a Qwen2.5-0.5B shape: the LM head is the embedding
    (tied), 14 heads and 2 key-value heads split over 2 tp ranks."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=32768).save_pretrained(run_inputs / "qwen2.5-0.5b")
    rehearsal = rehearse(load_config(os.path.join(ROOT, "configs", "qwen2.5_0.5b_cpt.yaml"),
                                     [f"model.name_or_path={run_inputs / 'qwen2.5-0.5b'}"]), 16)
    assert rehearsal.problems == []
    assert rehearsal.model["parameters"] == 494_032_768  # Qwen2.5-0.5B's count: the head is the embedding
    rank = rehearsal.shares[13]  # tp 1, dp 6
    assert (rank.tp_rank, rank.dp_rank) == (1, 6)
    assert rank.vocab == (151936 // 2, 151936)
    assert rank.heads == {"attention": (7, 14), "key_value": (1, 2)}


def test_deepspeeds_zero3_partitions_are_the_rehearsals(tmp_path):
    """DeepSpeed's own zero.Init, on rank 3 of a fake 7-rank world, gives each parameter the partition size the
    rehearsal uses (sizes that leave a remainder and one smaller than the ranks)."""
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with simulated_rank(3, 7, 8):
        with init_without_broadcast(ds_config):
            layers = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(13, 11, bias=False),
                                         torch.nn.Embedding(50, 7))
        held = {name: (param.ds_numel, param.ds_tensor.ds_numel) for name, param in layers.named_parameters()}
    assert held == {name: (numel, zero3_partition_numel(numel, 7)) for name, (numel, _) in held.items()}
    assert held["0.bias"] == (3, 1)  # fewer elements than ranks: one each, the last ranks padding only


BROKEN = {
    # name: (what to break, a word the problem must name)
    "vocabulary": (lambda r: _set(r.shares[173], "vocab", (r.shares[173].vocab[0] + 1, r.shares[173].vocab[1])),
                   "vocabulary columns"),
    "samples": (lambda r: _set_item(r.shares[173].samples, 0, r.shares[0].samples[0]), "samples"),
    "heads": (lambda r: _set(r.shares[173], "heads", {**r.shares[173].heads, "key_value": (4, 5)}), "key_value heads"),
    "tp group": (lambda r: _set(r.shares[173].groups, "tp", tuple(range(169, 177))), "tp group"),
    "AutoTP slice": (lambda r: _set(r.slices[5], "model.layers.3.mlp.up_proj.weight", [(0, 5 * 3584 + 1, 3584)]),
                     "do not tile"),
    "ZeRO partition": (lambda r: _set(r.zero_ranges[173], "model.layers.7.mlp.gate_proj.weight", [(0, 10)]),
                       "ZeRO-3 partitions"),
    "checkpoint file": (lambda r: _remove(r.shares[173].checkpoint_files, "zero_pp_rank_21_mp_rank_05_model_states.pt"),
                        "lacks 1 model-states file"),
    "streamed files": (lambda r: _set(r.shares[173], "stream_files", {**r.shares[173].stream_files,
                                                                       "data.sources.1": []}), "streamed files"),
    "prompts": (lambda r: _set(r.shares[173], "eval_prompts", {name: (0, stop) for name, (_, stop)
                                                                 in r.shares[173].eval_prompts.items()}), "prompts"),
}


def _set(holder, key, value):
    if isinstance(holder, dict):
        old = holder[key]
        holder[key] = value
        return lambda: holder.__setitem__(key, old)
    old = getattr(holder, key)
    setattr(holder, key, value)
    return lambda: setattr(holder, key, old)


def _set_item(items, index, value):
    old = items[index]
    items[index] = value
    return lambda: items.__setitem__(index, old)


def _remove(items, value):
    index = items.index(value)
    items.pop(index)
    return lambda: items.insert(index, value)


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_split_is_reported(llama70b_256, kind):
    """Each kind of share broken on one rank (rank 173) makes check_shares name it; restored, none is left."""
    breaking, named = BROKEN[kind]
    undo = breaking(llama70b_256)
    try:
        problems = check_shares(llama70b_256)
    finally:
        undo()
    assert problems and any(named in problem for problem in problems), problems
    assert check_shares(llama70b_256) == []


def test_rehearse_tool_prints_the_summary_and_json_zero2(run_inputs, capsys):
    """The tool's --json, for a ZeRO-2 layout: the weights whole on every rank, the model states written once per tp
    rank (by data-parallel rank 0), the optimizer states by every rank."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import rehearse as tool
    finally:
        sys.path.pop(0)
    code = tool.main(["--config", CONFIG, "--world-size", "8", "--model-config",
                      str(run_inputs / "llama3-8b" / "config.json"), "parallel.tp_size=2", "parallel.zero_stage=2",
                      f"data.sources=[{{path: {run_inputs / 'many'}, text_field: text, streaming: true}}]",
                      "data.validation_documents=10", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 8 and report["problems"] == []
    assert report["shares"][5]["groups"]["tp"] == [4, 5]
    assert report["autotp_ranks"] == [6, 7]  # the tensor-parallel group of the summary's rank, 7
    files = {share["rank"]: sorted(share["checkpoint_files"]) for share in report["shares"]}
    assert files[1] == ["bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", "mp_rank_01_model_states.pt",
                        "rng_state_1.pt"]
    assert files[5] == ["bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt", "rng_state_5.pt"]


@pytest.mark.fast
@pytest.mark.parametrize("sizes,named", [(["--world-size", "0"], "--world-size 0 is not a number of processes"),
                                         (["--world-size", "16", "--local-world-size", "0"],
                                          "--local-world-size 0 is not a number of processes per node"),
                                         (["--world-size", "16", "--local-world-size", "32"],
                                          "--local-world-size 32 is not a number of processes per node of a "
                                          "16-process run; give 1 to 16")])
def test_rehearse_tool_refuses_sizes_of_no_world(sizes, named, capsys):
    """A world of 0 said 'focus rank -1 is outside', --local-world-size 0 was a ZeroDivisionError traceback, and
    more processes per node than in the world rehearsed: one line each, before anything is read."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import rehearse as tool
    finally:
        sys.path.pop(0)
    assert tool.main(["--config", CONFIG, *sizes]) == 2
    assert f"error: {named}" in capsys.readouterr().err


def test_a_tp_group_across_two_nodes_is_reported(run_inputs):
    """12 ranks of 6 a node at tp 4: ranks 4-7 and 16-19... form tp groups that span nodes 0|1 (ranks 0-5 | 6-11):
    AutoTP's all-reduces would cross the network; the rehearsal names the first and the sizes that fit a node."""
    rehearsal = rehearse(_config(run_inputs, "llama3-8b", "parallel.tp_size=4"), 12, local_world_size=6)
    assert rehearsal.problems == ["1 tp group(s) span two nodes of 6 processes (first: ranks 4-7): AutoTP's "
                                  "per-layer all-reduces would cross the network; set parallel.tp_size to one of "
                                  "[1, 2] (dividing the processes per node)"]
    assert rehearse(_config(run_inputs, "llama3-8b", "parallel.tp_size=2"), 12, local_world_size=6).problems == []


@pytest.mark.parametrize("model_type", ["phi3", "olmo2", "gpt_neox", "falcon", "gemma2"])
def test_families_rehearse_at_tp_2(run_inputs, model_type):
    """The families the rehearsal could not run at tp 2 as the trainer does: Phi-3 and OLMo2 (their tp_plan, which
    DeepSpeed refuses, instead of their layer specs), Falcon (DeepSpeed's heuristic AutoTP outside its training
    mode), Gemma2 (its scaled embedding, and no sdpa attention); Phi-3's, OLMo2's and GPT-NeoX's heads (whole on
    every rank, or fused) are not reported as split wrongly."""
    from test_model_families import tiny_config

    tiny_config(model_type).save_pretrained(run_inputs / model_type)
    rehearsal = rehearse(_config(run_inputs, model_type, "parallel.tp_size=2", "data.seq_len=64",
                                 "model.resize_embeddings=false"), 4)
    assert rehearsal.problems == []
    assert sorted(rehearsal.slices) == [0, 1]
