"""Ulysses sequence parallelism: the slice of a packed batch, the refusals, and CE + NTL on sequence shards under
DeepSpeed ZeRO-3 against plain transformers on one process (tests/workers/sp_objective.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_workers
from ntl_pretrain.config import ConfigError
from ntl_pretrain.loss import VARIANTS, NTLSettings
from ntl_pretrain.loss.ntl import number_spans, term_positions
from ntl_pretrain.loss.sequence_shard import SequenceShard, shard_number_spans, shard_term_positions
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.parallel.ulysses import check_sequence_split, shard_inputs


@pytest.mark.fast
def test_shard_inputs_give_each_rank_its_slice_and_global_positions():
    input_ids = torch.arange(24).view(2, 12)
    pieces = [shard_inputs(input_ids, SequenceShard(rank=r, size=3)) for r in range(3)]
    assert torch.equal(torch.cat([p.input_ids for p in pieces], dim=1), input_ids)
    assert torch.equal(torch.cat([p.position_ids for p in pieces], dim=1), torch.arange(12).expand(2, -1))
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by the sequence-parallel size 5"):
        shard_inputs(input_ids, SequenceShard(rank=0, size=5))


@pytest.mark.fast
@pytest.mark.parametrize("kwargs,message", [
    (dict(sp_size=2, seq_len=513), r"data.seq_len=513 is not divisible by parallel.sp_size=2"),
    (dict(sp_size=4, seq_len=512, attention_heads=6), r"num_attention_heads=6 is not divisible by parallel.sp_size=4"),
    (dict(sp_size=4, seq_len=512, attention_heads=8, kv_heads=6), r"num_key_value_heads=6 and parallel.sp_size=4"),
    (dict(sp_size=0, seq_len=512), r"parallel.sp_size must be a positive integer"),
])
def test_refusals_name_the_keys(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        check_sequence_split(**kwargs)
    check_sequence_split(sp_size=4, seq_len=512, attention_heads=8, kv_heads=2)  # kv heads replicated: fine


@pytest.mark.fast
def test_slices_of_the_spans_tile_the_whole_row(word_tokenizer):
    vocab = NumberVocab.from_tokenizer(word_tokenizer, digit_level=True)
    digits = vocab.token_ids
    labels = torch.tensor([[2, digits[1], digits[2], digits[3], 3, digits[4], digits[5], 4],
                           [digits[6], digits[7], 2, -100, digits[8], digits[9], digits[0], digits[1]]])
    settings = NTLSettings(variant="number_level")
    slot = vocab.index_of(labels.reshape(-1))
    whole = number_spans(slot, labels, vocab.decimal_point_id, False)
    for size in (1, 2, 4):
        shards = [SequenceShard(rank=r, size=size) for r in range(size)]
        views = [shard_number_spans(labels, s, vocab, settings) for s in shards]
        for field, reference in zip(("is_start", "segment", "place"), whole):
            joined = torch.cat([getattr(v, field).view(2, -1) for v in views], dim=1).reshape(-1)
            assert torch.equal(joined, reference), (size, field)
        positions = torch.cat([shard_term_positions(labels, s, vocab, settings).view(2, -1) for s in shards], 1)
        assert torch.equal(positions.reshape(-1), term_positions(labels, vocab, settings)), size
        # no group needed for one shard; several need the exchange (built, run only under a process group)
        assert (views[0].combine is None) == (size == 1)


SP_CASES = ["ce", *VARIANTS, "number_level_float", "number_level_chunked"]  # the worker's CASES, in its order


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,cases", [
    # the fast tier's equivalent: one engine for number-level (CE + NTL, numbers across the boundary) instead of 8
    pytest.param(2, ["number_level"], marks=pytest.mark.fast, id="2-number_level"),
    pytest.param(2, SP_CASES, id="2"),  # every variant: the full suite
    pytest.param(4, SP_CASES, marks=pytest.mark.slow, id="4")])
def test_sequence_parallel_equals_one_process(world_size, cases):
    """sp=2 on 2 ranks and sp=2 x dp=2 on 4: loss, gradients and AdamW weights of CE and every NTL variant equal
    plain transformers on the whole batch (number-level with numbers across the boundary), and the number-level
    exchange is one all-reduce forward and one backward whether or not a number crosses; greedy generation with
    the attention unsharded gives plain transformers' tokens."""
    outputs = run_workers("sp_objective.py", world_size, ["--sp", "2", "--cases", ",".join(cases)], timeout=900)
    for rank, out in enumerate(outputs):
        assert [line.split()[1] for line in out.splitlines() if line.startswith("OK ")] == cases, out[-3000:]
        assert "COLLECTIVES numbers {'all_reduce': 2}" in out and "COLLECTIVES no_numbers {'all_reduce': 2}" in out
        assert "GENERATED [" in out, out[-3000:]  # generation with the plain attention equals plain transformers
        crossing = int(out.split("CROSSING ")[1].split()[0])
        assert crossing == (0 if rank % 2 == 0 else 3), (rank, crossing)  # rows 0, 1, 3 of the batch


@pytest.mark.fast
@pytest.mark.parametrize("zero,message", [
    ({"stage": 2}, r"parallel.sp_size=2 runs with ZeRO-3 only \(parallel.zero_stage=2\)"),
    ({"stage": 3, "reduce_scatter": False}, r"needs zero_optimization.reduce_scatter"),
])
def test_deepspeed_configs_whose_averaging_is_not_undone_are_refused(zero, message):
    from ntl_pretrain.parallel.ulysses import check_deepspeed_config

    with pytest.raises(ConfigError, match=message):
        check_deepspeed_config({"zero_optimization": zero}, 2)
    check_deepspeed_config({"zero_optimization": {"stage": 3}}, 2)
    check_deepspeed_config({"zero_optimization": zero}, 1)


@pytest.mark.fast
def test_dry_run_refuses_sequence_with_tensor_parallelism_and_says_why():
    from helpers.launch import dry_run

    result = dry_run("--config", "configs/long_context_cpt.yaml", "--world-size", "16", "parallel.tp_size=2")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "parallel.sp_size=8 with parallel.tp_size=2" in result.stderr
    assert "Ulysses groups, parallel_state_sp, have no tensor-parallel dimension" in result.stderr
    accepted = dry_run("--config", "configs/long_context_cpt.yaml", "--world-size", "8")
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    assert "world 8 = dp 1 x sp 8 x tp 1" in accepted.stdout and '"sequence_parallel_size": 8' in accepted.stdout


@pytest.mark.fast
def test_a_checkpoint_of_another_sp_size_over_the_same_ranks_loads_directly():
    """DeepSpeed partitions ZeRO-3 over dp x sp ranks and names its files by that rank (Ulysses counts as
    model-parallel size 1): another sp size over the same ranks reads the same files (the e2e resume runs it)."""
    from ntl_pretrain.checkpoint.format import SavedLayout, needs_reshard

    def manifest(**layout) -> dict:
        return {"tag": "global_step4", "layout": layout}

    sp2 = manifest(world_size=2, dp_size=1, tp_size=1, zero_stage=3, sp_size=2)
    older = manifest(world_size=2, dp_size=2, tp_size=1, zero_stage=3)  # saved before sp_size existed: sp 1
    for saved in (sp2, older):
        assert not needs_reshard(saved, SavedLayout(world_size=2, dp_size=2, tp_size=1, zero_stage=3))
        assert not needs_reshard(saved, SavedLayout(world_size=2, dp_size=1, tp_size=1, zero_stage=3, sp_size=2))
        assert needs_reshard(saved, SavedLayout(world_size=4, dp_size=2, tp_size=1, zero_stage=3, sp_size=2))
    assert SavedLayout(2, 1, 1, 3, sp_size=2).describe() == "world 2 = dp 1 x sp 2 x tp 1, ZeRO-3"
