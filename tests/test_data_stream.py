"""Streamed sources at cluster scale: each data-parallel rank reads only its own shard files, tensor-parallel
peers agree, and a resume continues each rank's stream from its saved state, bitwise."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, PretrainingData
from ntl_pretrain.data.stream import combine_rank_states
from ntl_pretrain.model import train_digit_bpe

SEQ = 16
FILES = 4
DOCS_PER_FILE = 40
VAL = 5


def _text(file: int, doc: int) -> str:
    return f"file {file} doc {doc} holds {file * 1000 + doc} and {doc * 7 % 13} more words"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_digit_bpe([_text(f, d) for f in range(3) for d in range(50)], vocab_size=320, out_dir=str(out))
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for f in range(FILES):
        (folder / f"part-{f:02d}.jsonl").write_text("".join(json.dumps({"text": _text(f, d)}) + "\n"
                                                           for d in range(DOCS_PER_FILE)))
    return folder


def _cfg(corpus: Path, tmp_path: Path, **kwargs) -> DataConfig:
    settings = dict(seq_len=SEQ, micro_batch_size=2, validation_documents=VAL, seed=7, cache_dir=str(tmp_path / "c"))
    settings.update(kwargs)
    return DataConfig(sources=[DataSourceConfig(path=str(corpus), streaming=True)], **settings)


def _reference_stream(tokenizer, files: list[int], skip_first: int) -> list[int]:
    """The given files' documents in order (the held-out ones left out), each + EOS, as transformers tokenizes
    them: one pass of a rank's share as one token stream."""
    texts = [_text(f, d) for f in files for d in range(DOCS_PER_FILE)][skip_first:]
    eos = tokenizer.eos_token_id
    return [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]


def _trained(data: PretrainingData, steps: int, accum: int = 1) -> list[tuple[int, ...]]:
    """The samples (tokens + the label of the last) a rank trains in `steps` steps, in order."""
    out = []
    for _ in range(steps):
        for mb in data.next_step(accum):
            for inputs, labels in zip(mb.input_ids.tolist(), mb.labels.tolist()):
                out.append(tuple(inputs) + (labels[-1],))
    return out


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_rank_reads_only_its_files_disjoint_and_together_the_stream(tokenizer, corpus, tmp_path, dp):
    cfg = _cfg(corpus, tmp_path, micro_batch_size=1)
    per_rank, files = [], []
    for rank in range(dp):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=rank, dp_size=dp)
        mine = list(range(rank, FILES, dp))
        assert data.sources[0].per_rank is (dp > 1)
        stream = _reference_stream(tokenizer, mine, VAL if rank == 0 else 0)
        expected = [tuple(stream[i * SEQ: (i + 1) * SEQ + 1]) for i in range((len(stream) - 1) // SEQ)]
        got = _trained(data, len(expected))
        # the label of the last position is the window's last token unless it is a document start (masked)
        assert [g[:-1] for g in got] == [e[:-1] for e in expected]
        # one pass covers the share's stream but for its last partial sample (the documented remainder)
        assert len(stream) - len(got) * SEQ <= SEQ
        per_rank.append({g[:-1] for g in got})
        files.extend(mine)
    assert sorted(files) == list(range(FILES))  # the shares partition the files
    for a in range(dp):
        for b in range(a + 1, dp):
            assert not per_rank[a] & per_rank[b]


def test_tensor_parallel_peers_read_the_same_samples(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    peers = [PretrainingData.build(cfg, tokenizer, dp_rank=1, dp_size=2) for _ in range(2)]
    a, b = (_trained(p, 12, accum=2) for p in peers)
    assert a == b


def test_validation_is_the_streams_first_documents_on_every_rank(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path, micro_batch_size=1)
    single = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    ranks = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=4) for r in range(4)]
    reference = [s[0].tolist() for s in single.validation]
    assert reference and all([s[0].tolist() for s in r.validation] == reference for r in ranks)


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_is_bitwise_and_reads_on_from_the_saved_state(tokenizer, corpus, tmp_path, dp):
    cfg = _cfg(corpus, tmp_path)
    straight = [_trained(PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=dp), 40, accum=2)
                for r in range(dp)]  # crosses the end of each rank's share
    first = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=dp) for r in range(dp)]
    before = [_trained(d, 17, accum=2) for d in first]
    state = json.loads(json.dumps(combine_rank_states(first[0], [d.rank_state() for d in first])))
    resumed = []
    for r in range(dp):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=dp)
        data.load_state_dict(state)
        reader, starts = data.sources[0].reader, []
        rows = reader.rows
        reader.rows = lambda position=None, starts=starts, rows=rows: (starts.append(position), rows(position))[1]
        after = _trained(data, 23, accum=2)
        resumed.append(before[r] + after)
        # the resumed stream sought to its saved row (a line in the middle of a file), not to the file's start
        saved = state["streams"]["data.sources.0"]["ranks"][r if dp > 1 else 0]["at"]["row"]
        assert starts[0] == saved and saved["offset"] > 0 and saved["line"] > 1
        assert all(start is None for start in starts[1:])  # a later pass starts at the share's start
    assert resumed == straight


def test_resume_with_another_data_parallel_size_is_refused(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    ranks = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    for data in ranks:
        _trained(data, 3)
    state = combine_rank_states(ranks[0], [d.rank_state() for d in ranks])
    other = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match=r"read per rank by 2 data-parallel ranks \(each its own shard files\), "
                                        r"this run reads it per rank by 4"):
        other.load_state_dict(state)
    shared = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=8)  # 4 files: read in full by every rank
    with pytest.raises(DataError, match="this run reads it in full by every rank"):
        shared.load_state_dict(state)


def test_fewer_files_than_ranks_is_said_at_start_up(tokenizer, corpus, tmp_path, caplog):
    cfg = _cfg(corpus, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ntl_pretrain.data.stream"):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=8)
    assert not data.sources[0].per_rank
    assert "4 shard file(s) for 8 data-parallel ranks: every rank reads and tokenizes the whole stream" in caplog.text
    assert "tools/prepare_data.py" in caplog.text
    assert np.asarray(data.next_step(1)[0].input_ids).shape == (2, SEQ)
