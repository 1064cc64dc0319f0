"""Rows of a streamed source read in order, each with the position it starts at, so that a resume seeks there
instead of re-reading what was consumed.

`LocalRows` reads local files itself (JSON lines, text, csv: a byte offset; parquet: a row group and a row in
it; `.gz`: an offset in the decompressed stream, which a seek decompresses up to), whole or a range of each
(`contiguous_ranges`: a rank's part of fewer files than ranks); `DatasetRows` reads a hub
dataset's `datasets` stream (its own `state_dict()` is the position). A position is a small JSON-able dict
stored in the checkpoint; every row comes with its place (`'FILE' line N`) for the bad-row warnings."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import zlib
from typing import Any, Iterator

from .errors import DataError

Position = dict  # JSON-able: where a row starts
Row = tuple[Any, Position, str]  # (the row: a dict, or a str saying why it is not one; its position; its place)

_JSON, _TEXT, _CSV, _PARQUET = "json", "text", "csv", "parquet"
_BOM = b"\xef\xbb\xbf"


def open_data_file(path: str) -> io.BufferedReader:
    """A data file opened for reading by its real path, refusing a link put in its place since it was listed
    (O_NOFOLLOW), and never blocking on a FIFO."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise DataError(f"cannot open the data file {path!r} ({error.strerror}); fix or remove it") from None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _compressed(path: str) -> bool:
    return path.lower().endswith(".gz")


def _decompressed(handle: io.BufferedReader, path: str) -> Any:
    return gzip.GzipFile(fileobj=handle, mode="rb") if _compressed(path) else handle


def contiguous_ranges(lengths: list[int], parts: int, part: int) -> dict[int, tuple[int, int]]:
    """Part `part` of `parts` of the concatenation of items of `lengths` (bytes of files, row groups), as
    item index -> [begin, end) within that item: each part about 1/parts of the total, together all of it."""
    total = sum(lengths)
    low, high = part * total // parts, (part + 1) * total // parts
    out, before = {}, 0
    for index, length in enumerate(lengths):
        begin, end = max(low, before) - before, min(high, before + length) - before
        if begin < end:
            out[index] = (begin, end)
        before += length
    return out


def splittable(builder: str, files: list[str]) -> str | None:
    """The unit a source's files split into ranges by ("bytes", "row groups"), or None: a csv field may span
    lines and a .gz stream has no offset to seek to, so those are read whole."""
    if builder == _CSV or any(_compressed(name) for name in files):
        return None
    return "row groups" if builder == _PARQUET else "bytes"


def row_groups(path: str) -> int:
    """How many row groups a parquet file has (its footer read only)."""
    import pyarrow.parquet as pq

    with open_data_file(path) as raw:
        try:
            return pq.ParquetFile(raw).metadata.num_row_groups
        except (OSError, ValueError) as error:
            raise DataError(f"{path!r} is not a readable parquet file ({error}); copy or download it again, or "
                            f"remove it") from None


class LocalRows:
    """The rows of local files (one builder) in file order, from per-file start positions.

    `files` are the source's files (positions name them by index, and by path to check a resume against);
    `share` the indices this reader reads, in order; `starts` where reading a file begins (file index -> its
    position; absent: its beginning, or its range's). `ranges`: the part of each shared file this reader
    reads (file index -> [begin, end) in bytes, or in row groups for parquet; None: whole files); a line
    belongs to the range it starts in, as Hadoop's line readers split files. `columns`: the columns a parquet
    file is read for (None: all)."""

    def __init__(self, files: list[str], builder: str, share: list[int], starts: dict[int, Position] | None = None,
                 columns: list[str] | None = None, ranges: dict[int, tuple[int, int]] | None = None) -> None:
        if builder not in (_JSON, _TEXT, _CSV, _PARQUET):
            raise DataError(f"streaming reads jsonl, txt, csv and parquet files, not {builder} ({files[0]!r})")
        if ranges is not None and (builder == _CSV or any(_compressed(files[i]) for i in ranges)):
            raise ValueError("csv and .gz files are not split into ranges")  # the caller's bug, not the user's
        self.files, self.builder, self.share = files, builder, share
        self.starts = dict(starts or {})
        self.columns = columns
        self.ranges = ranges

    def start(self) -> Position:
        """Where the share's first row is."""
        return self.starts.get(self.share[0], self._file_start(self.share[0])) if self.share else {"file": -1}

    def _file_start(self, index: int) -> Position:
        begin = self.ranges[index][0] if self.ranges else 0
        if self.builder == _PARQUET:
            return {"file": index, "group": begin, "row": 0}
        # inside a file: the first line that starts at or after `from` (the line before belongs to the range before)
        return {"file": index, "offset": 0, "line": 1} if begin == 0 else {"file": index, "from": begin}

    def describe(self) -> str:
        """What this reader reads, for a message: its files, or its ranges of them."""
        def one(index: int) -> str:
            name = os.path.basename(self.files[index])
            if not self.ranges:
                return name
            unit = "row groups" if self.builder == _PARQUET else "bytes"
            return f"{unit} {self.ranges[index][0]}-{self.ranges[index][1]} of {name}"
        names = [one(i) for i in self.share]
        return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")

    def check(self, position: Position, key: str) -> None:
        """Refuse a position that does not name one of this reader's files, or that lies outside this reader's
        range of it (a checkpoint of other files, or of another split of them)."""
        index = position.get("file")
        inside = index in self.share and position.get("path") in (None, os.path.basename(self.files[index]))
        if inside and self.ranges:
            at = position.get("group") if self.builder == _PARQUET else position.get("from", position.get("offset"))
            inside = isinstance(at, int) and self.ranges[index][0] <= at < self.ranges[index][1]
        if not inside:
            raise DataError(f"{key}: the checkpoint's stream position {position!r} names a file this run does not read "
                            f"in this share; resume with the files the run was started with")

    def rows(self, position: Position | None = None) -> Iterator[Row]:
        """(row, its position, its place) from `position` (None: the share's start) to the end of the share."""
        position = position or self.start()
        if position["file"] not in self.share:
            return
        for index in self.share[self.share.index(position["file"]):]:
            begin = position if index == position["file"] else self.starts.get(index, self._file_start(index))
            if begin.get("end"):  # a file wholly held out for validation
                continue
            reader = self._parquet_rows if self.builder == _PARQUET else self._line_rows
            yield from reader(index, begin)

    def _line_rows(self, index: int, begin: Position) -> Iterator[Row]:
        path = self.files[index]
        name = os.path.basename(path)
        with open_data_file(path) as raw:
            handle = _decompressed(raw, path)
            header = None
            if self.builder == _CSV:  # the header row: the columns of every row of the file
                header = next(csv.reader([_decode(handle.readline(), path, 1, True)]), None)
                if not header:
                    return
                if begin["offset"] == 0:
                    begin = {"file": index, "offset": handle.tell(), "line": 2}
            if "from" in begin:  # a range's start: skip the line that straddles it (the range before reads it)
                handle.seek(begin["from"] - 1)
                offset, line = begin["from"] - 1 + len(handle.readline()), None  # line numbers: not counted
            else:
                if begin["offset"]:
                    handle.seek(begin["offset"])
                offset, line = begin["offset"], begin["line"]
            end = self.ranges[index][1] if self.ranges else None
            lines = _lines(handle, path, offset, line)
            if self.builder == _CSV:
                yield from _csv_rows(lines, header, index, name, path)
                return
            for start, number, text, _end in lines:
                if end is not None and start >= end:  # the next range's first line
                    return
                place = f"{path!r} line {number}" if number is not None else f"{path!r} line at byte {start}"
                here = {"file": index, "path": name, "offset": start, "line": number}
                if self.builder == _TEXT:
                    yield {"text": text}, here, place
                    continue
                if not text.strip():
                    continue
                row, why = json_row(text)
                if number == 1 and text.lstrip().startswith("[") and (
                        (why and "not an object" not in why) or (isinstance(row, list) and any(isinstance(v, dict)
                                                                                               for v in row))):
                    raise DataError(f"{path!r} is a JSON array, not JSON lines: a stream cannot seek in it; write it "
                                    f"one object a line (`jq -c '.[]' IN > OUT.jsonl`) or set streaming: false")
                yield (why or row), here, place

    def _parquet_rows(self, index: int, begin: Position) -> Iterator[Row]:
        import pyarrow.parquet as pq

        path = self.files[index]
        with open_data_file(path) as raw:
            try:
                yield from self._parquet_file_rows(pq.ParquetFile(raw), index, begin)
            except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
                if isinstance(error, DataError):
                    raise
                raise DataError(f"{path!r} is not a readable parquet file ({error}); copy or download it again, or "
                                f"remove it") from None

    def _parquet_file_rows(self, parquet: Any, index: int, begin: Position) -> Iterator[Row]:
        path = self.files[index]
        groups = parquet.metadata.num_row_groups
        columns = None if self.columns is None else [c for c in self.columns if c in parquet.schema_arrow.names]
        before = sum(parquet.metadata.row_group(g).num_rows for g in range(begin["group"]))
        end = min(self.ranges[index][1], groups) if self.ranges else groups
        for group in range(begin["group"], end):
            rows = parquet.read_row_group(group, columns=columns).to_pylist()
            first = begin["row"] if group == begin["group"] else 0
            for row_index in range(first, len(rows)):
                here = {"file": index, "path": os.path.basename(path), "group": group, "row": row_index}
                yield rows[row_index], here, f"{path!r} row {before + row_index + 1}"
            before += len(rows)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:  # json.loads keeps the last value silently; datasets' reader fails on the whole file
        raise ValueError(f"an object whose key {repeated[0]!r} appears twice")
    return dict(pairs)


def json_row(text: str) -> tuple[Any, str | None]:
    """(the row, None) for a line of JSON lines holding one object with distinct keys, else (the parsed value or
    None, why the line is not a row): not valid JSON, a key given twice, or JSON that is not an object."""
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys)
    except ValueError as error:
        return None, f"not valid JSON ({error})" if "appears twice" not in str(error) else str(error)
    if not isinstance(row, dict):
        return row, f"a JSON {type(row).__name__}, not an object"
    return row, None


def first_bad_json_line(files: list[str]) -> tuple[str, int, str] | None:
    """(file, line number, why) of the first non-blank line of the JSON-lines `files` that is not a row
    (`json_row`), or None. Read only on an error path: it names the line a whole-file reader failed on."""
    for path in files:
        with open_data_file(path) as raw:
            handle = _decompressed(raw, path)
            for number, data in enumerate(handle, 1):
                text = data.decode("utf-8-sig" if number == 1 else "utf-8", errors="replace")
                if not text.strip():
                    continue
                if number == 1 and text.lstrip().startswith("["):
                    break  # a .json file holding one array: datasets reads it whole
                _, why = json_row(text)
                if why is not None:
                    return path, number, why
    return None


def _decode(data: bytes, path: str, line: int | str, first: bool) -> str:
    if first and data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path!r} line {line} is not UTF-8 text ({error}); re-encode it, e.g. `iconv -f latin1 -t "
                        f"utf-8 IN > OUT`") from None


def _lines(handle: Any, path: str, offset: int, line: int) -> Iterator[tuple[int, int, str, int]]:
    """(byte offset, line number, text without its line ending, offset after it) of each line from `offset`;
    a BOM at the start of the file is dropped, CRLF endings are LF, a last line without a newline counts. A
    truncated or corrupt gzip file is named with the line it stops at."""
    lines = iter(handle)
    while True:
        try:
            data = next(lines)
        except StopIteration:
            return
        except (EOFError, OSError, zlib.error) as error:
            raise DataError(f"{path!r} cannot be read past line {line - 1} ({error}): a truncated or corrupt "
                            f"file; copy or download it again, or remove it") from None
        start = offset
        offset += len(data)
        where = line if line is not None else f"at byte {start}"
        yield start, line, _decode(data.rstrip(b"\n").rstrip(b"\r"), path, where, start == 0), offset
        line = None if line is None else line + 1


def _csv_rows(lines: Iterator[tuple[int, int, str, int]], header: list[str], index: int, name: str,
              path: str) -> Iterator[Row]:
    """The csv records of `lines` (a quoted field may span lines): each at the offset of its first line."""
    first: list[tuple[int, int]] = []  # (offset, line) of the record being read

    def texts() -> Iterator[str]:
        for start, number, text, _ in lines:
            if not first:
                first.append((start, number))
            yield text + "\n"

    for record in csv.reader(texts()):
        start, number = first.pop()
        if not record:
            continue
        here, place = {"file": index, "path": name, "offset": start, "line": number}, f"{path!r} line {number}"
        if len(record) != len(header):
            yield f"{len(record)} fields, not the header's {len(header)}", here, place
            continue
        yield dict(zip(header, record)), here, place


class DatasetRows:
    """The rows of a `datasets` IterableDataset (a hub stream), each at the dataset's own state before it.

    A resume loads that state: `datasets` continues from the shard it names, re-reading that shard up to the
    row (it has no byte offsets)."""

    def __init__(self, documents: Any) -> None:
        self.documents = documents

    def start(self) -> Position:
        return {"datasets": None}

    def check(self, position: Position, key: str) -> None:
        if "datasets" not in position:
            raise DataError(f"{key}: the checkpoint's stream position {position!r} is not a hub stream's; resume "
                            f"with the source the run was started with")

    def rows(self, position: Position | None = None) -> Iterator[Row]:
        self.documents.load_state_dict((position or self.start())["datasets"])
        number = 0
        iterator = iter(self.documents)
        while True:
            here = {"datasets": self.documents.state_dict()}  # a copy, at the row yielded last
            try:
                row = next(iterator)
            except StopIteration:
                return
            except UnicodeDecodeError as error:
                raise DataError(f"a streamed file is not UTF-8 text ({error}); re-encode it, e.g. `iconv -f latin1 "
                                f"-t utf-8 IN > OUT`") from None
            number += 1
            yield row, here, f"stream row {number}"


class ListRows:
    """Rows held in memory (a stream's held-out documents), positioned by index."""

    def __init__(self, rows: list[Row]) -> None:
        self.list = rows

    def start(self) -> Position:
        return {"index": 0}

    def rows(self, position: Position | None = None) -> Iterator[Row]:
        for i in range((position or self.start())["index"], len(self.list)):
            row, _, place = self.list[i]
            yield row, {"index": i}, place
