"""A streamed source: its rows read in order (`reader`), tokenized as they come and packed continuously into
samples of seq_len + 1 tokens, with a position a resume seeks to (the row the next sample starts in and the
tokens of it already trained), and the split of a source's files into held-out rows and per-rank shares."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..config import DataConfig, DataSourceConfig
from ..config.schema import CHAT_TEMPLATE, TOKENIZED
from .reader import DatasetRows, ListRows, LocalRows, Position, contiguous_ranges, row_groups, splittable
from .sources import (INPUT_IDS, DataError, Sample, check_chat_template, completion_only, document_tokens, load_documents,
                      resolve_files, row_problem, text_columns, _check_columns)

logger = logging.getLogger(__name__)

_TOKENIZE_ROWS = 256  # rows tokenized together (one tokenizer call) at most
_READ_AHEAD = 8  # characters (or token ids) a tokenizer call reads at most, per token of a sample: a resume
#                  reads about this far past what its first step needs
PROGRESS_SECONDS = 60.0  # a stream logs what it has read this often (not a line per row)
_TEXT_PROBE = 1000  # rows of a stream checked for text at start-up


class SkippedRows:
    """Counts the rows of a stream left out as they are read; names the first ones (file and line), then logs
    the count at every doubling."""

    def __init__(self, key: str, quiet: bool = False) -> None:
        self.key, self.count, self.quiet = key, 0, quiet

    def __call__(self, place: str, column: str | None, why: str) -> None:
        self.count += 1
        if not self.quiet and (self.count <= 3 or self.count & (self.count - 1) == 0):
            what = f"column {column!r} holds {why}" if column else why
            logger.warning("%s: skipped a streamed row, %s: %s (%d row(s) skipped so far)", self.key, place, what,
                           self.count)


class StreamedSource:
    """Samples of a streamed source, read in order (read again from its start after its end).

    `per_rank`: the samples are this data-parallel rank's own share of the source (its shard files, or its
    ranges of fewer files), indexed by how many of them the rank has trained; otherwise every rank reads the
    whole stream. The state is where the next sample starts: the reader's position of its first row and the
    tokens of that row before it, so a resume seeks there instead of re-reading what was consumed."""

    def __init__(self, reader: Any, tokenizer: Any, source: DataSourceConfig, cfg: DataConfig, key: str,
                 per_rank: bool) -> None:
        self.reader, self.key, self.per_rank = reader, key, per_rank
        self.seq_len = cfg.seq_len
        self.read_ahead = _READ_AHEAD * (cfg.seq_len + 1)
        self.problem = row_problem(source, cfg.max_document_chars)
        self.tokens_of = document_tokens(tokenizer, source)
        self.skipped = SkippedRows(key)
        self._samples: Iterator[tuple[Sample, dict]] | None = None
        self._next = 0  # index of the sample the iterator yields next
        self._at: dict = {}  # where that sample starts: {"row": position, "skip": tokens}
        self._yielded_this_pass = 0
        self._origin: dict | None = None  # where a resume starts: a state_dict()
        self.make_agreed: Callable[[], StreamedSource] | None = None  # builds `agreed()`'s stream (None: self)
        self._agreed: StreamedSource | None = None
        self._said_resume = False
        self._read = {"rows": 0, "tokens": 0, "since": time.monotonic(), "reported": time.monotonic()}

    def agreed(self) -> "StreamedSource":
        """This source as data-parallel rank 0 reads it (every rank's stream when it is not read per rank), a
        stream apart from the one this rank trains (built on first use, its bad rows not named again): the
        samples a start-up check measures, the same on every rank, without moving the training stream."""
        if self.make_agreed is None:
            return self
        if self._agreed is None:
            self._agreed = self.make_agreed()
            self._agreed.skipped = SkippedRows(self.key, quiet=True)
        return self._agreed

    # ------------------------------------------------------------------ packing
    def packed(self, start: Position | None, skip: int) -> Iterator[tuple[Sample, dict]]:
        """(sample, where the next one starts) from the row at `start` (its first `skip` tokens left out) to
        the end of the rows; the tokens after the last whole sample are dropped (the pass's remainder)."""
        docs: deque = deque()  # [position, tokens, targets or None] of the rows not wholly trained
        available, need = -skip, self.seq_len + 1
        rows = self.reader.rows(start)
        done = False
        while True:
            while available < need and not done:
                added, done = self._tokenize(rows, docs)
                available += added
            if available < need:
                return
            parts, masks, taken, first = [], [], 0, skip
            for _position, tokens, targets in docs:
                piece = tokens[first: first + need - taken]
                parts.append(piece)
                masks.append(targets[first: first + len(piece)] if targets is not None else None)
                taken, first = taken + len(piece), 0
                if taken == need:
                    break
            skip += self.seq_len  # the next sample starts seq_len tokens on: pop the rows it no longer needs
            while skip >= len(docs[0][1]):
                skip -= len(docs.popleft()[1])
            available -= self.seq_len
            mask = None if all(m is None for m in masks) else np.concatenate(
                [np.ones(len(p), dtype=bool) if m is None else m for p, m in zip(parts, masks)])
            yield (np.concatenate(parts), mask), {"row": docs[0][0], "skip": int(skip)}

    def _tokenize(self, rows: Iterator, docs: deque) -> tuple[int, bool]:
        """Read up to _TOKENIZE_ROWS rows, append the usable ones' tokens to `docs`: (tokens added, rows ended)."""
        batch: list[tuple[dict, Position]] = []
        done, size = False, 0
        for row, position, place in rows:
            why = (None, row) if isinstance(row, str) else self.problem(row)
            if why is not None:
                self.skipped(place, *why)
                continue
            batch.append((row, position))
            size += sum(len(value) for value in row.values() if isinstance(value, (str, list)))
            if len(batch) == _TOKENIZE_ROWS or size >= self.read_ahead:
                break
        else:
            done = True
        if not batch:
            return 0, done
        columns = list(dict.fromkeys(c for row, _ in batch for c in row))
        ids, masks = self.tokens_of({c: [row.get(c) for row, _ in batch] for c in columns})
        added = 0
        for i, (_, position) in enumerate(batch):
            tokens = np.asarray(ids[i], dtype=np.int64)
            docs.append((position, tokens, None if masks is None else np.asarray(masks[i], dtype=bool)))
            added += len(tokens)
        self._progress(len(batch), added)
        return added, done

    def _progress(self, rows: int, tokens: int) -> None:
        read = self._read
        read["rows"] += rows
        read["tokens"] += tokens
        now = time.monotonic()
        if now - read["reported"] >= PROGRESS_SECONDS:
            read["reported"] = now
            logger.info("%s: tokenized %d rows, %d tokens since start-up (%.0f tokens/s); %d row(s) skipped", self.key,
                        read["rows"], read["tokens"], read["tokens"] / max(now - read["since"], 1e-9),
                        self.skipped.count)

    # ------------------------------------------------------------------ the source's samples
    def _restart(self, j: int) -> None:
        """A fresh pass at the resume point when j is not before it, else at the start of the stream."""
        origin = self._origin if self._origin is not None and j >= self._origin["index"] else None
        at = origin.get("at") if origin else None
        if origin is not None and at is None:  # a checkpoint of a previous version: its position only
            origin = None
        self._at = at or {"row": self.reader.start(), "skip": 0}
        self._samples = self.packed(self._at["row"], self._at["skip"])
        self._next = origin["index"] if origin else 0
        self._yielded_this_pass = origin["yielded_this_pass"] if origin else 0
        if origin is not None and not self._said_resume:
            self._said_resume = True
            logger.info("%s: this rank's stream resumes at its sample %d, sought to %s", self.key, origin["index"],
                        _where(at["row"]))

    def get(self, j: int) -> Sample:
        origin = self._origin if self._origin is not None and self._origin.get("at") is not None else None
        ahead = origin is not None and self._next < origin["index"] <= j  # the resume point is nearer: seek there
        if self._samples is None or j < self._next or ahead:  # (re)start: the stream is read in order only
            self._restart(j)
        while True:
            try:
                sample, at = next(self._samples)
            except StopIteration:
                if self._yielded_this_pass == 0:
                    raise DataError(f"{self.key} yields no sample of seq_len + 1 tokens; add data or lower "
                                    f"data.seq_len") from None
                self._at = {"row": self.reader.start(), "skip": 0}  # the next pass starts at the beginning
                self._samples, self._yielded_this_pass = self.packed(None, 0), 0
                continue
            self._yielded_this_pass += 1
            index, self._next, self._at = self._next, self._next + 1, at
            if index == j:
                return sample

    def state_dict(self) -> dict | None:
        """Where the stream stands (None before its first sample): the next sample's index and where it starts."""
        if self._samples is None:
            return self._origin
        return {"index": self._next, "yielded_this_pass": self._yielded_this_pass, "at": self._at}

    def load_state_dict(self, state: dict | None) -> None:
        if state is not None and state.get("at") is not None:
            self.reader.check(state["at"]["row"], self.key)
        self._origin, self._samples = state, None


def _where(position: Position) -> str:
    """A position, for a message."""
    if "datasets" in position:
        return "the hub stream's saved state"
    name = position.get("path", f"file {position.get('file')}")
    if "group" in position:
        return f"{name!r} row group {position['group']} row {position['row']}"
    return f"{name!r} byte {position.get('offset', position.get('from'))}"


def validation_samples(rows: list, tokenizer: Any, source: DataSourceConfig, cfg: DataConfig, key: str) -> list:
    """The samples of a stream's held-out rows, packed as the stream packs (every sample of one pass)."""
    held = StreamedSource(ListRows(rows), tokenizer, source, cfg, f"{key} (validation)", False)
    return [sample for sample, _ in held.packed(None, 0)]


def open_stream(source: DataSourceConfig, key: str, cfg: DataConfig, tokenizer: Any, *, dp_rank: int,
                dp_size: int) -> tuple[StreamedSource, list]:
    """(this rank's stream of a streamed source, the validation samples): local files read by LocalRows (each
    rank its own files when there are at least dp of them), a hub dataset by `datasets`' stream."""
    if source.prompt_template == CHAT_TEMPLATE and completion_only(source):
        check_chat_template(tokenizer, key)
    n_val = cfg.validation_documents
    resolved = resolve_files(source, key)
    if resolved is None:  # a hub dataset: `datasets` streams it (its shards split by rank)
        documents = load_documents(source, key, cfg.cache_dir)
        held_out, training, per_rank = split_hub_stream(documents, n_val, dp_rank, dp_size, key)
        reader: Any = DatasetRows(training)
        held = [(row, {}, f"held-out row {i + 1}") for i, row in enumerate(held_out)]

        def reader_of(rank: int) -> Any:
            return DatasetRows(split_hub_stream(documents, n_val, rank, dp_size, key, say=False)[1])
    else:
        builder, files = resolved
        own_share = rank_share(builder, files, dp_rank, dp_size, key)
        ranges, per_rank = own_share.ranges, own_share.per_rank
        if per_rank and ranges is None:
            _say_share(key, len(files), dp_size, per_rank)
            _say_uneven_shares(key, [os.path.getsize(name) for name in files], dp_size)
        columns = None if source.format == TOKENIZED else list(dict.fromkeys(text_columns(source).values()))
        everything = LocalRows(files, builder, list(range(len(files))), columns=columns)
        held, after = [], None
        for row in everything.rows():
            if len(held) == n_val:
                after = row[1]
                break
            held.append(row)
        _check_rows(everything, source, key)
        if n_val and after is None:
            raise DataError(f"{key}.path={source.path!r} has {len(held)} documents, not more than "
                            f"data.validation_documents={n_val}; lower data.validation_documents")

        def reader_of(rank: int) -> Any:
            """Data-parallel rank `rank`'s reader: its files, or its ranges of them, past the held-out rows."""
            share = own_share if rank == dp_rank else rank_share(builder, files, rank, dp_size, key, say=False)
            return LocalRows(files, builder, share.files, _starts_after(after, share.files, share.ranges, builder),
                             columns, share.ranges)

        reader = reader_of(dp_rank)
    stream = StreamedSource(reader, tokenizer, source, cfg, key, per_rank)
    stream.make_agreed = lambda: StreamedSource(reader_of(0), tokenizer, source, cfg, key, per_rank)  # own reader
    probe = StreamedSource(reader, tokenizer, source, cfg, key, per_rank)
    probe.skipped = SkippedRows(key, quiet=True)  # the stream names them when it trains
    if next(probe.packed(None, 0), None) is None:  # raised at start-up (agreed by every rank), not mid-step
        share = reader.describe() if isinstance(reader, LocalRows) and reader.share else ""
        files = "" if not share or (isinstance(reader, LocalRows) and reader.ranges) else "files "
        raise DataError(f"{key}: data-parallel rank {dp_rank} of {dp_size} reads "
                        f"{files + share if share else 'a share'}"
                        f" that yield no sample of data.seq_len + 1 = {cfg.seq_len + 1} tokens (held out, unusable or "
                        f"too short); add data, split it into evenly sized files, or lower data.validation_documents or "
                        f"data.seq_len")
    return stream, validation_samples(held, tokenizer, source, cfg, key) if n_val else []


@dataclass(frozen=True)
class RankShare:
    """What one data-parallel rank reads of a streamed source's local files (`rank_share`)."""

    files: list[int]  # indices into the source's files, in reading order
    ranges: dict[int, tuple[int, int]] | None  # file index -> [begin, end) bytes or row groups; None: whole files
    per_rank: bool  # each rank reads its own part (False: every rank reads every file)


def rank_share(builder: str, files: list[str], dp_rank: int, dp_size: int, key: str, say: bool = True) -> RankShare:
    """Data-parallel rank `dp_rank`'s part of a streamed source's local `files`: with at least as many files as
    ranks, files dp_rank, dp_rank + dp_size, ...; with fewer, its contiguous byte range or row groups of them
    (`_ranges_of`); every file when they cannot be split (said at start-up with `say`)."""
    ranges = _ranges_of(builder, files, dp_rank, dp_size, key, say=say)
    per_rank = dp_size > 1 and (len(files) >= dp_size or ranges is not None)
    if ranges is not None:
        return RankShare(list(ranges), ranges, per_rank)
    return RankShare(list(range(dp_rank, len(files), dp_size)) if per_rank else list(range(len(files))), None, per_rank)


def _ranges_of(builder: str, files: list[str], dp_rank: int, dp_size: int, key: str,
               say: bool = True) -> dict[int, tuple[int, int]] | None:
    """This rank's ranges of the files when there are fewer files than data-parallel ranks: contiguous byte
    ranges (jsonl, txt) or row groups (parquet), about 1/dp of the source each; None when the files are
    shared whole (enough of them, one rank) or cannot be split (.gz, csv; parquet of too few row groups),
    which is said at start-up (`say`)."""
    if dp_size == 1 or len(files) >= dp_size:
        return None
    unit = splittable(builder, files)
    if unit is None and say:
        kind = "csv" if builder == "csv" else ".gz"
        _say_share(key, len(files), dp_size, False, f"{kind} files cannot be split by byte range ("
                   f"{'a quoted field may span lines' if kind == 'csv' else 'a compressed stream has no offsets'}); "
                   f"split it into {dp_size} or more files (a multiple of {dp_size}), "
                   f"{'convert it to jsonl' if kind == 'csv' else 'decompress it'}, or train from "
                   f"tools/prepare_data.py's corpus")
    if unit is None:
        return None
    lengths = [row_groups(name) for name in files] if unit == "row groups" else \
        [os.path.getsize(name) for name in files]
    if unit == "row groups" and sum(lengths) < dp_size:
        if say:
            _say_share(key, len(files), dp_size, False, f"its {sum(lengths)} row group(s) are fewer than the "
                       f"ranks; write it with smaller row groups (pyarrow.parquet.write_table(..., "
                       f"row_group_size=ROWS), at least {dp_size} groups in all) or as {dp_size} or more files, or "
                       f"train from tools/prepare_data.py's corpus")
        return None
    if dp_rank == 0 and say:
        logger.info("%s: %d file(s) for %d data-parallel ranks: each rank reads its own contiguous %s of them "
                    "(about 1/%d of the source)", key, len(files), dp_size, unit, dp_size)
    return contiguous_ranges(lengths, dp_size, dp_rank)


def _starts_after(after: Position | None, share: list[int], ranges: dict[int, tuple[int, int]] | None,
                  builder: str) -> dict[int, Position]:
    """Where each file of a share starts reading, past the held-out rows (the stream's first, up to `after`):
    the files before `after`'s are held out, and so is a range of its file that ends before it."""
    if after is None:
        return {}
    starts: dict[int, Position] = {i: {"file": i, "end": True} for i in share if i < after["file"]}
    if after["file"] in share:
        starts[after["file"]] = after
        if ranges is not None:
            begin, end = ranges[after["file"]]
            at = after["group"] if builder == "parquet" else after["offset"]
            if at >= end:
                starts[after["file"]] = {"file": after["file"], "end": True}
            elif at < begin:  # held out before this range: the range starts as it would
                del starts[after["file"]]
    return starts


def _say_share(key: str, files: int, dp_size: int, per_rank: bool, fix: str | None = None) -> None:
    if dp_size > 1 and not per_rank:
        logger.warning("%s has %d shard file(s) for %d data-parallel ranks: every rank reads and tokenizes the "
                       "whole stream (%dx the reads of one share) and discards the others' samples; %s", key,
                       files, dp_size, dp_size, fix or f"split it into {dp_size} or more files (a multiple of "
                       f"{dp_size}), or train from tools/prepare_data.py's corpus")
    elif per_rank and files % dp_size:
        logger.info("%s: %d shard files over %d data-parallel ranks: ranks read %d or %d files each (a rank that "
                    "reaches the end of its share first starts it again)", key, files, dp_size, files // dp_size,
                    files // dp_size + 1)


UNEVEN_SHARES = 1.5  # ranks' shares of a stream this much apart in bytes are warned about


def _say_uneven_shares(key: str, sizes: list[int], dp_size: int) -> None:
    """Warn when the ranks' shares of shard files differ much in size: a rank restarts its share when it ends,
    so the smallest share is trained several times over while the largest is read once."""
    shares = [sum(sizes[rank::dp_size]) for rank in range(dp_size)]
    if min(shares) * UNEVEN_SHARES < max(shares):
        small, large = shares.index(min(shares)), shares.index(max(shares))
        logger.warning("%s: the data-parallel ranks' shares of its shard files are uneven: rank %d reads %.0f KB, "
                       "rank %d %.0f KB, so rank %d trains its share about %.1f times while rank %d reads its own "
                       "once; split the files into evenly sized shards (or a multiple of %d files), or prepare the "
                       "corpus with tools/prepare_data.py", key, small, min(shares) / 2**10, large,
                       max(shares) / 2**10, small, max(shares) / max(min(shares), 1), large, dp_size)


def _check_rows(reader: LocalRows, source: DataSourceConfig, key: str) -> None:
    """The first rows have the columns the source reads, and some text (a stream is checked on its start only)."""
    problem = row_problem(source, 1 << 62)
    seen, columns, has_text = 0, None, False
    field = list(text_columns(source).values())[-1]
    for row, _, _ in reader.rows():
        if isinstance(row, str):
            continue
        if columns is None:
            columns = list(row)
            if source.format == TOKENIZED:
                if INPUT_IDS not in columns:
                    raise DataError(f"{key}.path={source.path!r} has no column {INPUT_IDS!r} (columns: {columns}), "
                                    f"which format: tokenized reads; rename the column, or set {key}.format=text")
                return
            _check_columns(None, columns, source, key)
        seen += 1
        if problem(row) is None and isinstance(row.get(field), str) and row[field].strip():
            has_text = True
            break
        if seen == _TEXT_PROBE:
            break
    if columns is None:
        raise DataError(f"{key}.path={source.path!r} holds no documents")
    if not has_text:
        logger.warning("%s.path=%r: its first %d documents are empty or whitespace (column %r)", key, source.path,
                       seen, field)


def split_hub_stream(documents: Any, n_val: int, dp_rank: int, dp_size: int, key: str,
                     say: bool = True) -> tuple[Any, Any, bool]:
    """(held-out documents, this rank's training documents, whether they are its own share) of a hub stream.

    The held-out documents are the stream's first `n_val`, the same on every rank. With at least as many
    shards (files) as data-parallel ranks, rank r reads shards r, r + dp, ... only, less the held-out
    documents among them (always the first of its shards: they come first in the stream); with fewer, every
    rank reads the whole stream."""
    import datasets

    shards = documents.num_shards
    per_rank = dp_size > 1 and shards >= dp_size
    if say:
        _say_share(key, shards, dp_size, per_rank)
    if not per_rank:
        return documents.take(n_val), documents.skip(n_val), False
    held_out, skipped, wanted = [], 0, n_val
    for index in range(shards):  # the held-out documents, shard by shard: how many come from this rank's shards
        if wanted == 0:
            break
        taken = sum(1 for _ in documents.shard(num_shards=shards, index=index).take(wanted))
        held_out.append(documents.shard(num_shards=shards, index=index).take(taken))
        skipped += taken if index % dp_size == dp_rank else 0
        wanted -= taken
    mine = documents.shard(num_shards=dp_size, index=dp_rank, contiguous=False)
    validation = datasets.concatenate_datasets(held_out) if held_out else documents.take(0)
    return validation, mine.skip(skipped) if skipped else mine, True
