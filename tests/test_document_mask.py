"""data.document_mask: attention stays inside each packed document. A packed row of 3 documents gives the same
per-token logits, CE and NTL (was, number_level) as the 3 documents run one by one (to 1e-5 in float32), through
the trainer's own model inputs (`parallel.ulysses.model_inputs`): in this process at T=1 (sdpa and eager), and in
gloo workers under DeepSpeed ZeRO-3 with AutoTP (T=2) and with Ulysses sequence parallelism (sp=2)
(tests/workers/document_mask.py). With the mode off the inputs are today's (attention across the row)."""

from __future__ import annotations

import pytest
import torch

from helpers.distributed import run_workers
from helpers.documents import SETTINGS, one_by_one, packed_rows
from helpers.models import char_tokenizer, tiny_llama
from helpers.numeric import relative_error
from ntl_pretrain.checkpoint.fingerprint import check_data
from ntl_pretrain.checkpoint.format import CheckpointError
from ntl_pretrain.data import document_position_ids
from ntl_pretrain.loss import ce_ntl_sums
from ntl_pretrain.loss.sequence_shard import SequenceShard
from ntl_pretrain.numbers import NumberVocab
from ntl_pretrain.parallel.ulysses import document_block_causal_mask, model_inputs, shard_inputs

SEQ_LEN = 40


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.fast
def test_positions_restart_after_each_eos():
    eos = 1
    rows = torch.tensor([[5, 6, eos, 7, 8, 9, eos, eos, 4], [2, 3, 4, 5, 6, 7, 8, 9, 2]])
    assert document_position_ids(rows, eos).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0], list(range(9))]
    # the rows' block-causal mask: causal, and no token sees an earlier document
    mask = document_block_causal_mask(document_position_ids(rows, eos))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False, False]
    assert torch.equal(document_block_causal_mask(torch.arange(9).expand(2, -1))[1, 0],
                       torch.ones(9, 9, dtype=torch.bool).tril())


@pytest.mark.fast
def test_sequence_slices_carry_the_rows_document_positions():
    rows = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 4], [1, 3, 4, 1, 6, 7, 8, 9]])
    positions = document_position_ids(rows, 1)
    pieces = [model_inputs(rows, SequenceShard(rank=r, size=2), 1) for r in range(2)]
    assert torch.equal(torch.cat([p["position_ids"] for p in pieces], dim=1), positions)
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces], dim=1), rows)
    assert all(p["use_cache"] is False for p in pieces)
    # the mode off: today's inputs (the rows alone; a slice with its global positions 0..S-1)
    assert model_inputs(rows, SequenceShard(), None).keys() == {"input_ids"}
    off = model_inputs(rows, SequenceShard(rank=1, size=2), None)
    assert torch.equal(off["position_ids"], shard_inputs(rows, SequenceShard(rank=1, size=2)).position_ids)


@pytest.mark.fast
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_documents_equal_documents_one_by_one(tokenizer, attention):
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=True)
    model = tiny_llama(len(tokenizer), max_position_embeddings=SEQ_LEN).train()  # training: no dropout here
    model.config._attn_implementation = attention
    input_ids, labels = packed_rows(tokenizer, SEQ_LEN)
    eos = tokenizer.eos_token_id
    reference_logits, reference = one_by_one(model, input_ids, labels, vocab, eos)
    with torch.no_grad():
        logits = model(**model_inputs(input_ids, SequenceShard(), eos)).logits
        across = model(**model_inputs(input_ids, SequenceShard(), None)).logits
    assert relative_error(logits, reference_logits) < 1e-5
    assert (logits - reference_logits).abs().max() < 1e-5
    for name, settings in SETTINGS.items():
        sums = ce_ntl_sums(logits, labels, vocab, settings)
        assert abs(float(sums.ce_sum) - reference[name][0]) <= 1e-5 * abs(reference[name][0]), name
        assert abs(float(sums.ntl_sum) - reference[name][1]) <= 1e-5 * abs(reference[name][1]), name
    # the mode off is the model's plain call, which attends across the documents: the check above would fail
    with torch.no_grad():
        assert torch.equal(across, model(input_ids=input_ids).logits)
    assert relative_error(across, reference_logits) > 1e-2


@pytest.mark.fast
def test_resume_refuses_to_switch_the_mode():
    described = {"sources": [], "seq_len": 8, "seed": 1}
    check_data({**described, "document_mask": True}, {**described, "document_mask": True}, "ckpt", False)
    check_data(described, {**described, "document_mask": False}, "ckpt", False)  # older: trained across documents
    with pytest.raises(CheckpointError, match=r"trained with data.document_mask=false \(it predates the key.*"
                                              r"resume with data.document_mask=false, or set "
                                              r"checkpoint.allow_data_change=true"):
        check_data(described, {**described, "document_mask": True}, "ckpt", False)
    with pytest.raises(CheckpointError, match=r"data.document_mask=true, this run sets data.document_mask=false"):
        check_data({**described, "document_mask": True}, {**described, "document_mask": False}, "ckpt", False)
    check_data(described, {**described, "document_mask": True}, "ckpt", True)  # allowed: a warning


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,sp", [(2, 1), (1, 2)], ids=["T2", "sp2"])
def test_packed_documents_equal_one_by_one_under_deepspeed(tp, sp):
    """ZeRO-3 with AutoTP (each TP rank its vocabulary shard of the logits) or Ulysses (each rank its sequence
    slice, attention after the all-to-all masked per document from the gathered positions): every rank's logits
    and the global CE / NTL sums equal plain transformers on each document alone."""
    outputs = run_workers("document_mask.py", 2, ["--tp", str(tp), "--sp", str(sp), "--seq-len", str(SEQ_LEN)],
                          timeout=240)
    for out in outputs:
        assert [line.split()[1] for line in out.splitlines() if line.startswith("OK ")] == ["logits", *SETTINGS], \
            out[-3000:]


@pytest.mark.fast
def test_a_checkpoints_eval_settings_say_how_the_run_trained(tmp_path):
    """ntl_eval.json (every checkpoint's hf/ folder and its export) records data.document_mask beside the settings,
    so tools/evaluate.py --model encodes prompts as the run trained; a file without the key: across documents."""
    from ntl_pretrain.eval.config import EvalConfig, load_eval_settings, save_eval_settings, trained_document_mask

    settings = EvalConfig(arithmetic_n=5)
    for mode in (True, False):
        save_eval_settings(str(tmp_path), settings, document_mask=mode)
        assert load_eval_settings(str(tmp_path)) == settings and trained_document_mask(str(tmp_path)) is mode
    (tmp_path / "ntl_eval.json").write_text('{"arithmetic_n": 5}')
    assert load_eval_settings(str(tmp_path)) == settings and trained_document_mask(str(tmp_path)) is False
    assert trained_document_mask(str(tmp_path / "missing")) is False
