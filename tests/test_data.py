"""The data pipeline: packing, label alignment, mixing, DP sharding, determinism, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, Mixture, PretrainingData
from ntl_pretrain.model import train_digit_bpe

SEQ = 16


def _documents(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {i}: {rng.integers(0, 10**6)} plus {rng.integers(0, 999)} is a number" for i in range(n)]


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe(_documents(300, seed=1), vocab_size=320, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


def _cfg(sources: list[DataSourceConfig], tmp_path: Path, **kwargs) -> DataConfig:
    defaults = dict(seq_len=SEQ, micro_batch_size=2, validation_documents=5, seed=7, cache_dir=str(tmp_path / "cache"))
    defaults.update(kwargs)
    return DataConfig(sources=sources, **defaults)


def test_digit_bpe_splits_every_digit(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("In 2024, 12345 and x7")["input_ids"])
    assert [t for t in tokens if any(c.isdigit() for c in t)] == list("2024") + list("12345") + ["7"]
    assert tokenizer.decode(tokenizer("In 2024, 12345 and x7")["input_ids"]) == "In 2024, 12345 and x7"


def test_packing_matches_a_plain_reference(tokenizer, tmp_path):
    import datasets

    texts = _documents(60)
    path = _write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=0)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    source = data.sources[0]
    # reference: the documents in the split's (seeded) order, each followed by EOS, as one token stream;
    # sample i is the window [i*SEQ, (i+1)*SEQ] (consecutive samples share one token), the tail is dropped
    order = datasets.Dataset.from_dict({"text": texts}).shuffle(seed=cfg.seed)["text"]
    stream = [t for text in order for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    expected = [stream[i * SEQ: (i + 1) * SEQ + 1] for i in range((len(stream) - 1) // SEQ)]
    packed = [np.asarray(source.samples[i]["tokens"]).tolist() for i in range(source.size)]
    assert packed == expected
    assert sum(s.count(tokenizer.eos_token_id) for s in expected) >= len(texts) - 1


def test_labels_are_inputs_shifted_by_one_and_skip_document_starts(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(80))
    eos = tokenizer.eos_token_id
    for mask in (True, False):
        cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, mask_document_start=mask)
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        batches = [data.next_step(1)[0] for _ in range(6)]
        assert batches[0].input_ids.shape == batches[0].labels.shape == (2, SEQ)
        for step, batch in enumerate(batches):
            for row in range(2):
                window = data.sample(step * 2 + row).tolist()
                want = [-100 if mask and prev == eos else nxt for prev, nxt in zip(window[:-1], window[1:])]
                assert batch.input_ids[row].tolist() == window[:-1] and batch.labels[row].tolist() == want
        assert sum(int((b.input_ids == eos).sum()) for b in batches) > 0  # the check above did see boundaries


def test_dp_ranks_split_the_global_batch_and_tp_ranks_agree(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(120))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    single = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    cfg_mb1 = _cfg([DataSourceConfig(path=str(path))], tmp_path, micro_batch_size=1)
    ranks = [PretrainingData.build(cfg_mb1, tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    tp_twin = PretrainingData.build(cfg_mb1, tokenizer, dp_rank=1, dp_size=2)  # another TP rank of DP rank 1
    for _ in range(3):
        whole = single.next_step(2)  # 2 micro-batches x 2 sequences = 4 sequences
        parts = [r.next_step(2) for r in ranks]  # 2 ranks x 2 micro-batches x 1 sequence
        twin = tp_twin.next_step(2)
        merged = sorted(tuple(row) for p in parts for mb in p for row in mb.input_ids.tolist())
        assert merged == sorted(tuple(row) for mb in whole for row in mb.input_ids.tolist())
        assert [mb.input_ids.tolist() for mb in twin] == [mb.input_ids.tolist() for mb in parts[1]]
        assert parts[0][0].input_ids.tolist() != parts[1][0].input_ids.tolist()


def test_same_seed_same_stream_other_seed_other_order(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    make = lambda seed: PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path, seed=seed),
                                              tokenizer, dp_rank=0, dp_size=1)
    a, b, c = make(3), make(3), make(4)
    steps = lambda d: [mb.input_ids.tolist() for _ in range(4) for mb in d.next_step(1)]
    first = steps(a)
    assert first == steps(b) and first != steps(c)


def test_resume_continues_without_repeating_or_skipping(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    straight = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    expected = [straight.next_step(1)[0].input_ids.tolist() for _ in range(40)]  # crosses an epoch boundary
    first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    got = [first.next_step(1)[0].input_ids.tolist() for _ in range(17)]
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    resumed.load_state_dict(state)
    got += [resumed.next_step(1)[0].input_ids.tolist() for _ in range(23)]
    assert got == expected
    other = PretrainingData.build(_cfg([DataSourceConfig(path=str(path))], tmp_path, seed=99), tokenizer,
                                  dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="differs from data.seed=99"):
        other.load_state_dict(state)


def test_mixture_follows_the_weights_and_counts_per_source():
    mixture = Mixture([1.0, 3.0], seed=5)
    located = [mixture.locate(g) for g in range(10000)]
    share = np.mean([s for s, _ in located])
    assert abs(share - 0.75) < 0.02
    for source in (0, 1):  # each source's samples are consumed in order 0, 1, 2, ... without gaps
        indices = [j for s, j in located if s == source]
        assert indices == list(range(len(indices)))


def test_two_sources_are_both_used(tokenizer, tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [f"alpha {i} " * 4 for i in range(60)])
    b = _write_jsonl(tmp_path / "b.jsonl", [f"beta {i} " * 4 for i in range(60)])
    cfg = _cfg([DataSourceConfig(path=str(a)), DataSourceConfig(path=str(b), weight=1.0)], tmp_path)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    text = " ".join(tokenizer.decode(mb.input_ids[0]) for _ in range(30) for mb in data.next_step(1))
    assert "alpha" in text and "beta" in text


def test_text_files_parquet_and_streaming(tokenizer, tmp_path):
    import datasets

    texts = _documents(50)
    (tmp_path / "c.txt").write_text("\n".join(texts) + "\n")
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "c.parquet"))
    for source in (DataSourceConfig(path=str(tmp_path / "c.txt")),
                   DataSourceConfig(path=str(tmp_path / "c.parquet"), text_field="body"),
                   DataSourceConfig(path=str(tmp_path / "c.parquet"), text_field="body", streaming=True)):
        data = PretrainingData.build(_cfg([source], tmp_path), tokenizer, dp_rank=0, dp_size=1)
        batches = [data.next_step(1)[0] for _ in range(30)]  # streaming wraps around its end
        assert all(b.input_ids.shape == (2, SEQ) for b in batches)
        assert len(data.validation) > 0


def test_validation_batches_are_the_same_count_on_every_rank(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(100))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=20)
    counts = [len(PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=3).validation_micro_batches(50))
              for r in range(3)]
    assert len(set(counts)) == 1 and counts[0] >= 1
    tiny = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=1)
    data = PretrainingData.build(tiny, tokenizer, dp_rank=0, dp_size=8)
    with pytest.raises(DataError, match="raise data.validation_documents"):
        data.check_validation(4)


# ---------------------------------------------------------------------------------------------- bad input
def test_missing_data_file_is_named(tokenizer, tmp_path):
    cfg = _cfg([DataSourceConfig(path=str(tmp_path / "nope.jsonl"))], tmp_path)
    with pytest.raises(DataError, match=r"data.sources.0.path='.*nope.jsonl': no such file"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_dataset_without_the_text_field(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(30), field="content")
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path)
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['content'\]\); set data.sources.0.text_field"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_empty_dataset(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = _cfg([DataSourceConfig(path=str(tmp_path / "empty.jsonl"))], tmp_path)
    with pytest.raises(DataError, match="empty.jsonl"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_too_few_tokens_for_one_sample(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", ["1", "2", "3"])
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=1, seq_len=64)
    with pytest.raises(DataError, match="fewer than data.seq_len"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)


def test_fewer_documents_than_held_out(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", _documents(4))
    cfg = _cfg([DataSourceConfig(path=str(path))], tmp_path, validation_documents=10)
    with pytest.raises(DataError, match="lower data.validation_documents"):
        PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
