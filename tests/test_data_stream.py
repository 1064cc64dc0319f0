"""Streamed sources at cluster scale: each data-parallel rank reads only its own shard files (fewer files than
ranks: its byte range or row groups of them, every row read once), tensor-parallel peers agree, and a resume
seeks each rank's stream to its saved row, bitwise as an uninterrupted run, in each file format (and a hub
stream through `datasets`); odd files (BOM, CRLF, no final newline, a line longer than a range, truncated,
uneven shares) are read right or named; files that cannot be split are said at start-up."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from ntl_pretrain.config import DataConfig, DataSourceConfig
from ntl_pretrain.data import DataError, PretrainingData
from ntl_pretrain.data.stream import combine_rank_states
from ntl_pretrain.tokenizer.run import train_digit_bpe

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


def _reference_stream(tokenizer, files: list[int], held_out: int) -> list[int]:
    """The given files' documents in order, less the stream's first `held_out` (files 0, 1, ... in order),
    each + EOS, as transformers tokenizes them: one pass of a rank's share as one token stream."""
    texts = [_text(f, d) for f in files for d in range(DOCS_PER_FILE) if f * DOCS_PER_FILE + d >= held_out]
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


@pytest.mark.parametrize("dp, held_out", [(1, VAL), (2, VAL), (3, VAL), (4, VAL), (2, DOCS_PER_FILE + 10)])
def test_each_rank_reads_only_its_files_disjoint_and_together_the_stream(tokenizer, corpus, tmp_path, dp, held_out):
    cfg = _cfg(corpus, tmp_path, micro_batch_size=1, validation_documents=held_out)  # 50: file 0 and part of 1
    per_rank, files = [], []
    for rank in range(dp):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=rank, dp_size=dp)
        mine = list(range(rank, FILES, dp))
        assert data.sources[0].per_rank is (dp > 1)
        stream = _reference_stream(tokenizer, mine, held_out)
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


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_fewer_files_than_ranks_are_split_into_ranges_and_every_row_is_read_once(tmp_path, fmt):
    """Each rank reads a contiguous byte range (parquet: row groups) of fewer files than ranks; a line belongs
    to the range it starts in, so the ranks' rows in rank order are the files' rows, each once: with a BOM and
    CRLF endings (file 0), no final newline (file 1) and one line longer than a range (2 ranks and up)."""
    from ntl_pretrain.data.reader import LocalRows
    from ntl_pretrain.data.streamed import _ranges_of

    texts = [[_text(f, d) for d in range(n)] for f, n in enumerate([12, 30])]
    texts[1][9] = "a line longer than a range " * 120  # 3.2 KB of the 5.5 KB in all
    _write(tmp_path / "corpus", fmt, texts)
    files = sorted(str(p) for p in (tmp_path / "corpus").iterdir())
    builder = {"jsonl": "json", "txt": "text", "parquet": "parquet"}[fmt]
    everything = [t for file in texts for t in file]
    for dp in (1, 2, 3, 4):
        got = []
        for rank in range(dp):
            ranges = _ranges_of(builder, files, rank, dp, "data.sources.0")
            assert (ranges is not None) is (dp > 2)  # 2 files: split from 3 ranks on
            share = list(ranges) if ranges is not None else list(range(rank, len(files), dp))
            reader = LocalRows(files, builder, share, ranges=ranges)
            mine = list(reader.rows())
            got.extend(row["text"] for row, _, _ in mine)
            for k, (_, position, _) in enumerate(mine):  # every position resumes to the rest of the range
                reader.check(json.loads(json.dumps(position)), "data.sources.0")
                assert [row for row, _, _ in reader.rows(position)] == [row for row, _, _ in mine[k:]]
        if dp > 2:
            assert got == everything
        else:
            assert sorted(got) == sorted(everything)
    for dp in (8, 16):  # ranges smaller than the long line: some ranks read no row, none reads one twice
        ranks = [LocalRows(files, builder, list(r), ranges=r) for r in
                 (_ranges_of(builder, files, rank, dp, "data.sources.0") for rank in range(dp))] \
            if fmt != "parquet" else []
        if ranks:
            assert [row["text"] for reader in ranks for row, _, _ in reader.rows()] == everything


@pytest.mark.parametrize("dp, held_out", [(3, 30), (4, VAL)])
def test_fewer_files_than_ranks_each_rank_trains_its_byte_range(tokenizer, tmp_path, dp, held_out):
    """Two files at 3 and 4 ranks through the trainer's data: each rank trains the documents whose lines start
    in its byte range (computed here from the files' bytes), less the held-out ones (the stream's first, on
    every rank); the ranks' samples are disjoint."""
    texts = [[_text(f, d) for d in range(60)] for f in range(2)]
    _write(tmp_path / "pair", "jsonl", texts)
    starts, total = [], 0  # (global byte offset of each document's line, the document), in stream order
    for f, file in enumerate(texts):
        raw = (tmp_path / "pair" / f"part-{f}.jsonl").read_bytes()
        at = [0] + [i + 1 for i, byte in enumerate(raw) if byte == ord("\n")]
        starts.extend((total + offset, text) for offset, text in zip(at, file))
        total += len(raw)
    cfg = _cfg(tmp_path / "pair", tmp_path, micro_batch_size=1, validation_documents=held_out)
    eos, samples, validation = tokenizer.eos_token_id, [], []
    for rank in range(dp):
        low, high = rank * total // dp, (rank + 1) * total // dp
        mine = [text for i, (offset, text) in enumerate(starts) if low <= offset < high and i >= held_out]
        stream = [t for text in mine for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
        expected = [tuple(stream[i * SEQ: (i + 1) * SEQ + 1]) for i in range((len(stream) - 1) // SEQ)]
        data = PretrainingData.build(cfg, tokenizer, dp_rank=rank, dp_size=dp)
        assert data.sources[0].per_rank and data.sources[0].reader.ranges
        got = _trained(data, len(expected))
        assert [g[:-1] for g in got] == [e[:-1] for e in expected]
        samples.append({g[:-1] for g in got})
        validation.append([s[0].tolist() for s in data.validation])
    assert all(v == validation[0] for v in validation) and validation[0]
    assert all(not samples[a] & samples[b] for a in range(dp) for b in range(a + 1, dp))


def test_tensor_parallel_peers_read_the_same_samples(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    peers = [PretrainingData.build(cfg, tokenizer, dp_rank=1, dp_size=2) for _ in range(2)]
    a, b = (_trained(p, 12, accum=2) for p in peers)
    assert a == b


@pytest.mark.parametrize("files", [FILES, 2])
def test_a_start_up_checks_samples_are_the_same_on_every_rank_and_leave_training_alone(tokenizer, corpus, tmp_path,
                                                                                       files):
    """`sample(g)` (what the digit-level check measures) is data-parallel rank 0's sample on every rank, of
    shard files or of byte ranges, and reading it does not move the stream a rank trains."""
    if files < FILES:
        (tmp_path / "few").mkdir()
        for f in range(files):
            (tmp_path / "few" / f"part-{f:02d}.jsonl").write_bytes((corpus / f"part-{f:02d}.jsonl").read_bytes())
        corpus = tmp_path / "few"
    cfg = _cfg(corpus, tmp_path)
    ranks = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=4) for r in range(4)]
    assert all(d.sources[0].per_rank for d in ranks)
    expected = [_trained(PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=4), 6) for r in range(4)]
    first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=4).sources[0]
    rank0 = [first.get(j)[0].tolist() for j in range(30)]  # one source: global sample g is its sample g
    assert all([d.sample(g).tolist() for g in range(30)] == rank0 for d in ranks)
    assert [_trained(d, 6) for d in ranks] == expected


def test_validation_is_the_streams_first_documents_on_every_rank(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path, micro_batch_size=1)
    single = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    ranks = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=4) for r in range(4)]
    reference = [s[0].tolist() for s in single.validation]
    assert reference and all([s[0].tolist() for s in r.validation] == reference for r in ranks)


@pytest.mark.parametrize("dp, files", [(1, FILES), (2, FILES), (4, 2)])
def test_resume_is_bitwise_and_reads_on_from_the_saved_state(tokenizer, corpus, tmp_path, dp, files):
    """Each rank resumes at its saved row: of its shard files, or inside its byte range of fewer files."""
    if files < FILES:  # the first files of the corpus: 2 files for 4 ranks, split by byte range
        (tmp_path / "few").mkdir()
        for f in range(files):
            (tmp_path / "few" / f"part-{f:02d}.jsonl").write_bytes((corpus / f"part-{f:02d}.jsonl").read_bytes())
        corpus = tmp_path / "few"
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
        assert starts[0] == saved and saved["offset"] > 0 and (saved["line"] is None or saved["line"] > 1)
        assert (data.sources[0].reader.ranges is not None) is (files < dp)
        assert all(start is None for start in starts[1:])  # a later pass starts at the share's start
    assert resumed == straight


def test_resume_with_another_data_parallel_size_is_refused(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    ranks = [PretrainingData.build(cfg, tokenizer, dp_rank=r, dp_size=2) for r in range(2)]
    for data in ranks:
        _trained(data, 3)
    state = combine_rank_states(ranks[0], [d.rank_state() for d in ranks])
    other = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match=r"read per rank by 2 data-parallel ranks \(each its own part of the files\), "
                                        r"this run reads it per rank by 4"):
        other.load_state_dict(state)
    ranged = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=8)  # 4 files: byte ranges
    with pytest.raises(DataError, match="this run reads it per rank by 8"):
        ranged.load_state_dict(state)
    single = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match="this run reads it in full by every rank"):
        single.load_state_dict(state)


def test_fewer_files_than_ranks_that_cannot_be_split_are_said_at_start_up(tokenizer, tmp_path, caplog):
    """jsonl and txt split by bytes, parquet by row groups; .gz and csv cannot be, nor parquet of fewer row
    groups than ranks: every rank reads them whole, and start-up says so with the fix."""
    texts = [[_text(f, d) for d in range(20)] for f in range(2)]
    for fmt in ("jsonl", "jsonl.gz", "csv", "parquet"):
        _write(tmp_path / fmt, fmt, texts)  # parquet: 3 row groups a file, 6 in all
    fixes = {"jsonl.gz": ".gz files cannot be split by byte range (a compressed stream has no offsets); split it "
                         "into 8 or more files (a multiple of 8), decompress it",
             "csv": "csv files cannot be split by byte range (a quoted field may span lines); split it into 8 or "
                    "more files (a multiple of 8), convert it to jsonl",
             "parquet": "its 6 row group(s) are fewer than the ranks; write it with smaller row groups "
                        "(pyarrow.parquet.write_table(..., row_group_size=ROWS), at least 8 groups in all)"}
    for fmt, fix in fixes.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ntl_pretrain.data.streamed"):
            data = PretrainingData.build(_cfg(tmp_path / fmt, tmp_path, validation_documents=1), tokenizer,
                                         dp_rank=0, dp_size=8)
        assert not data.sources[0].per_rank
        assert ("2 shard file(s) for 8 data-parallel ranks: every rank reads and tokenizes the whole stream (8x the "
                "reads of one share) and discards the others' samples; " + fix) in caplog.text
        assert np.asarray(data.next_step(1)[0].input_ids).shape == (2, SEQ)
    for fmt, dp in (("jsonl", 8), ("parquet", 4)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ntl_pretrain.data.streamed"):
            data = PretrainingData.build(_cfg(tmp_path / fmt, tmp_path, validation_documents=1), tokenizer,
                                         dp_rank=0, dp_size=dp)
        assert data.sources[0].per_rank and data.sources[0].reader.ranges
        unit = "bytes" if fmt == "jsonl" else "row groups"
        assert f"2 file(s) for {dp} data-parallel ranks: each rank reads its own contiguous {unit}" in caplog.text
        assert "every rank reads" not in caplog.text


def _write(folder: Path, fmt: str, files: list[list[str]]) -> None:
    """`files` of documents as `fmt`, with what real corpora have: a BOM and CRLF endings in the first file, no
    newline at the end of the last, a csv field over two lines, parquet in row groups of 7 rows."""
    import gzip

    folder.mkdir()
    for f, texts in enumerate(files):
        name = folder / f"part-{f}.{fmt}"
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), name, row_group_size=7)
            continue
        if fmt == "csv":
            import csv
            import io

            out = io.StringIO()
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(["n", "text"])
            writer.writerows([i, text] for i, text in enumerate(texts))
            data = out.getvalue()
        else:
            data = "".join((text if fmt == "txt" else json.dumps({"text": text})) + "\n" for text in texts)
        if f == 0:
            data = "\ufeff" + data.replace("\n", "\r\n")
        if f == len(files) - 1:
            data = data.rstrip("\n")
        raw = data.encode("utf-8")
        if fmt == "jsonl.gz":
            raw = gzip.compress(raw)
        name.write_bytes(raw)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "txt", "csv", "parquet"])
def test_each_format_streams_its_rows_and_resumes_bitwise(tokenizer, tmp_path, fmt):
    texts = [[_text(f, d) for d in range(n)] for f, n in enumerate([12, 30, 9])]  # one file larger than the others
    if fmt == "csv":
        texts[1][4] = "a field\nover two lines, with \"quotes\""
    _write(tmp_path / "corpus", fmt, texts)
    cfg = _cfg(tmp_path / "corpus", tmp_path, micro_batch_size=1, validation_documents=3)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    rows = [text for file in texts for text in file]
    eos = tokenizer.eos_token_id
    stream = [t for text in rows[3:] for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
    count = (len(stream) - 1) // SEQ
    straight = [data.sources[0].get(j)[0].tolist() for j in range(count + 5)]  # into the second pass
    assert straight[:count] == [stream[i * SEQ: (i + 1) * SEQ + 1] for i in range(count)]
    assert straight[count:] == straight[:5]
    held = [t for text in rows[:3] for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
    assert [s[0].tolist() for s in data.validation] == [held[i * SEQ: (i + 1) * SEQ + 1]
                                                        for i in range((len(held) - 1) // SEQ)]
    for stop in (count // 3, count - 1):  # in a middle file; at the end of the pass
        first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        for j in range(stop):
            first.sources[0].get(j)
        state = json.loads(json.dumps(first.sources[0].state_dict()))
        resumed = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        resumed.sources[0].load_state_dict(state)
        assert [resumed.sources[0].get(j)[0].tolist() for j in range(stop, count + 5)] == straight[stop:]


@pytest.mark.parametrize("dp", [1, 2])
def test_a_hub_stream_gives_the_samples_of_the_same_files_read_locally_and_resumes(tokenizer, corpus, tmp_path, dp):
    """A hub dataset streams through `datasets` (its state is the position); here a local folder loaded the
    way a hub id is, against the same files read by the local reader."""
    import datasets

    from ntl_pretrain.data.reader import DatasetRows
    from ntl_pretrain.data.streamed import StreamedSource, split_hub_stream

    cfg = _cfg(corpus, tmp_path)
    files = sorted(str(p) for p in corpus.glob("*.jsonl"))

    def hub(rank: int) -> StreamedSource:
        documents = datasets.load_dataset("json", data_files=files, split="train", streaming=True,
                                          cache_dir=str(tmp_path / "c"))
        _, training, per_rank = split_hub_stream(documents, VAL, rank, dp, "data.sources.0")
        return StreamedSource(DatasetRows(training), tokenizer, cfg.sources[0], cfg, "data.sources.0", per_rank)

    for rank in range(dp):
        local = PretrainingData.build(cfg, tokenizer, dp_rank=rank, dp_size=dp).sources[0]
        count = sum(1 for _ in local.packed(None, 0)) + 5  # into the second pass
        expected = [local.get(j)[0].tolist() for j in range(count)]
        stream = hub(rank)
        assert [stream.get(j)[0].tolist() for j in range(count)] == expected
        first = hub(rank)
        for j in range(count // 2):
            first.get(j)
        resumed = hub(rank)
        resumed.load_state_dict(first.state_dict())
        assert [resumed.get(j)[0].tolist() for j in range(count // 2, count)] == expected[count // 2:]


def test_a_long_stream_logs_progress_every_interval_not_every_row(tokenizer, corpus, tmp_path, caplog, monkeypatch):
    from ntl_pretrain.data import streamed

    cfg = _cfg(corpus, tmp_path, micro_batch_size=1)
    with caplog.at_level(logging.INFO, logger="ntl_pretrain.data.streamed"):
        data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
        _trained(data, 60)
        assert "tokenized" not in caplog.text  # within the interval: silent
        monkeypatch.setattr(streamed, "PROGRESS_SECONDS", 0.0)
        _trained(data, 60)
    lines = [r.getMessage() for r in caplog.records if "tokenized" in r.getMessage()]
    assert lines and all(re.fullmatch(r"data.sources.0: tokenized \d+ rows, \d+ tokens since start-up \(\d+ tokens/s\); "
                                      r"0 row\(s\) skipped", line) for line in lines)
    assert len(lines) < 60  # a line per tokenizer call at most (here, at an interval of 0 s)


def test_a_rank_whose_files_yield_no_sample_is_refused_at_start_up(tokenizer, corpus, tmp_path):
    """Every rank knows at start-up (an error there is agreed by all ranks), not one rank mid-step (a hang)."""
    cfg = _cfg(corpus, tmp_path, validation_documents=DOCS_PER_FILE * 2 + 1)  # files 0 and 1 held out
    PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=2)  # files 0, 2: file 2 is left
    four = _cfg(corpus, tmp_path, validation_documents=DOCS_PER_FILE)
    with pytest.raises(DataError, match=r"data.sources.0: data-parallel rank 0 of 4 reads files part-00.jsonl that "
                                        r"yield no sample of data.seq_len \+ 1 = 17 tokens \(held out, unusable or "
                                        r"too short\); add data"):
        PretrainingData.build(four, tokenizer, dp_rank=0, dp_size=4)
    PretrainingData.build(four, tokenizer, dp_rank=1, dp_size=4)
    # 8 ranks on 4 files: byte ranges; rank 0's (about the first half of file 0) is wholly held out
    eight = _cfg(corpus, tmp_path, validation_documents=DOCS_PER_FILE // 2 + 2)
    total = sum(path.stat().st_size for path in corpus.iterdir())
    with pytest.raises(DataError, match=rf"data-parallel rank 0 of 8 reads bytes 0-{total // 8} of part-00.jsonl "
                                        rf"that yield no sample"):
        PretrainingData.build(eight, tokenizer, dp_rank=0, dp_size=8)
    PretrainingData.build(eight, tokenizer, dp_rank=1, dp_size=8)


def test_a_sample_before_the_resume_point_then_one_after_it_seeks_back_to_it(tokenizer, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path)
    first = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1).sources[0]
    expected = [first.get(j)[0].tolist() for j in range(40)]
    source = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1).sources[0]
    for j in range(30):
        source.get(j)
    state = json.loads(json.dumps(source.state_dict()))
    resumed = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1).sources[0]
    resumed.load_state_dict(state)
    starts, rows = [], resumed.reader.rows
    resumed.reader.rows = lambda position=None: (starts.append(position), rows(position))[1]
    assert resumed.get(2)[0].tolist() == expected[2]  # before the resume point: from the start
    assert resumed.get(35)[0].tolist() == expected[35]  # after it: sought there again, not read on to it
    assert starts == [resumed.reader.start(), state["at"]["row"]]


@pytest.mark.parametrize("kind", ["jsonl.gz", "parquet"])
def test_a_truncated_file_is_named_not_a_traceback(tokenizer, tmp_path, kind):
    texts = [[_text(f, d) for d in range(300)] for f in range(2)]
    _write(tmp_path / "corpus", kind, texts)
    broken = tmp_path / "corpus" / f"part-1.{kind}"
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # a partial download
    cfg = _cfg(tmp_path / "corpus", tmp_path, micro_batch_size=1)
    data = PretrainingData.build(cfg, tokenizer, dp_rank=0, dp_size=1)
    what = r"cannot be read past line \d+ \(.*\): a truncated or corrupt file" if kind == "jsonl.gz" else \
        r"is not a readable parquet file \(.*\); copy or download it again"
    with pytest.raises(DataError, match=rf"'.*part-1.{kind}' {what}"):
        for j in range(10_000):
            data.sources[0].get(j)


def test_uneven_shares_are_warned_about(tokenizer, tmp_path, caplog):
    _write(tmp_path / "corpus", "jsonl", [[_text(f, d) for d in range(n)] for f, n in enumerate([10, 40, 10, 40])])
    with caplog.at_level(logging.WARNING, logger="ntl_pretrain.data.streamed"):
        PretrainingData.build(_cfg(tmp_path / "corpus", tmp_path, validation_documents=1), tokenizer, dp_rank=0,
                              dp_size=2)
    sizes = [(tmp_path / "corpus" / f"part-{f}.jsonl").stat().st_size for f in range(4)]
    small, large = sizes[0] + sizes[2], sizes[1] + sizes[3]
    assert (f"data.sources.0: the data-parallel ranks' shares of its shard files are uneven: rank 0 reads "
            f"{small / 1024:.0f} KB, rank 1 {large / 1024:.0f} KB, so rank 0 trains its share about {large / small:.1f} "
            f"times while rank 1 reads its own once; split the files") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ntl_pretrain.data.streamed"):  # files 0+1 and 2+3: even
        PretrainingData.build(_cfg(tmp_path / "corpus", tmp_path, validation_documents=1), tokenizer, dp_rank=0,
                              dp_size=1)
    assert "uneven" not in caplog.text
