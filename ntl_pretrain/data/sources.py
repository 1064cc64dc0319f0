"""Data sources: resolving files or hub ids, loading documents with `datasets`, checking their columns and
text, the generated arithmetic corpus, and tokenizing and packing documents into samples (with the targets
mask of prompt/completion sources)."""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
import sys
from typing import Any, Callable, Iterator

import numpy as np

from ..config import DataConfig, DataSourceConfig
from .errors import DataError
from .reader import first_bad_json_line
from ..config.schema import CHAT_TEMPLATE, PREPARED, TOKENIZED

logger = logging.getLogger(__name__)


TOKENS = "tokens"  # column of packed samples
TARGETS = "targets"  # column of prompt/completion samples: True where the token is a loss target
IGNORE_INDEX = -100  # label of positions without a target
INPUT_IDS, LOSS_MASK = "input_ids", "loss_mask"  # columns of a `format: tokenized` source (one document a row)
PREPARED_MANIFEST = "manifest.json"  # what tools/prepare_data.py writes beside a prepared corpus's samples
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv",
             ".jsonl.gz": "json", ".json.gz": "json"}


# ---------------------------------------------------------------------------------------------- sources
def _builder_for(path: str) -> str | None:
    lower = path.lower()
    for ext in sorted(_BUILDERS, key=len, reverse=True):
        if lower.endswith(ext):
            return _BUILDERS[ext]
    return None


def _looks_local(path: str) -> bool:
    """A path the user meant as a local file (a hub id has no file extension and no leading ./ / ~)."""
    return path.startswith((".", "/", "~")) or _builder_for(path) is not None or any(ch in path for ch in "*?[")


_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _special_kind(path: str) -> str | None:
    """What a path that exists but is neither a file nor a folder is (a FIFO, a device, a socket), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((kind for test, kind in _SPECIAL_FILES if test(mode)), None)


def _folder_files(folder: str, key: str, given: str) -> list[str]:
    """The data files under a folder, each once (by real path: a file linked twice is read once), following
    links to folders but refusing a link back to a folder above it (a loop) and naming special files."""
    files: dict[str, str] = {}  # real path -> the path found
    chain: dict[str, set[str]] = {folder: {os.path.realpath(folder)}}  # folder walked -> real paths of it and above
    walked: set[str] = set()
    for top, dirs, names in os.walk(folder, followlinks=True):
        walked.add(os.path.realpath(top))
        for name in list(dirs):
            child = os.path.join(top, name)
            real = os.path.realpath(child)
            if real in chain[top]:
                raise DataError(f"{key}.path={given!r}: {child!r} links to {real!r}, a folder it is inside (a symlink "
                                f"loop: its files would be read again and again); remove the link")
            if real in walked:  # reached twice through links: its files are listed once
                dirs.remove(name)
                continue
            chain[child] = chain[top] | {real}
        for name in names:
            found = os.path.join(top, name)
            if not _builder_for(found):
                continue
            kind = _special_kind(found)
            if kind is not None:
                raise DataError(f"{key}.path={given!r}: {found!r} is {kind}, not a file; remove it from the folder "
                                f"or copy its data into a file")
            if os.path.isfile(found):
                files.setdefault(os.path.realpath(found), found)
    return sorted(files.values())


def resolve_files(source: DataSourceConfig, key: str) -> tuple[str, list[str]] | None:
    """(datasets builder, files) of a local source, None for a hub dataset id; raises if a local path is missing.
    A prepared corpus gives ("prepared", its Arrow files and manifest)."""
    path = os.path.expanduser(source.path)
    if source.format == PREPARED:
        if not os.path.isfile(os.path.join(path, PREPARED_MANIFEST)):
            raise DataError(f"{key}.path={source.path!r} has no {PREPARED_MANIFEST}: not a corpus written by "
                            f"tools/prepare_data.py (format: prepared); prepare it, or set {key}.format to text or "
                            f"tokenized")
        return PREPARED, sorted(glob.glob(os.path.join(path, "*", "*.arrow"))) + [os.path.join(path, PREPARED_MANIFEST)]
    if os.path.isdir(path):
        files = _folder_files(path, key, source.path)
        if not files:
            raise DataError(f"{key}.path={source.path!r} is a folder without .jsonl/.json/.parquet/.txt/.csv files")
    elif os.path.isfile(path):
        files = [path]
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
        if not files:
            raise DataError(f"{key}.path={source.path!r} matches no file")
    elif _special_kind(path) is not None:
        raise DataError(f"{key}.path={source.path!r} is {_special_kind(path)}, not a file: the data must be read twice "
                        f"or more (checks, then training); write it to a file and point {key}.path there")
    elif os.path.islink(path):
        try:
            os.stat(path)
            why = "cannot be read"
        except OSError as error:
            why = ("is a symbolic link loop (it points back to itself through links)" if error.errno == errno.ELOOP
                   else f"is a symbolic link to {os.readlink(path)!r}, which does not exist")
        raise DataError(f"{key}.path={source.path!r} {why}; point {key}.path at the real file or folder")
    elif _looks_local(source.path):
        raise DataError(f"{key}.path={source.path!r}: no such file or folder (working directory {os.getcwd()}); "
                        f"fix the path, or use a hub dataset id")
    else:
        return None
    builders = {_builder_for(f) for f in files}
    if None in builders or len(builders) != 1:
        raise DataError(f"{key}.path={source.path!r} mixes or holds unsupported file types {sorted(map(str, builders))}; "
                        f"use one of {sorted(set(_BUILDERS))}")
    for name in files:
        if os.path.getsize(name) == 0:
            raise DataError(f"{key}.path={source.path!r}: the file {name!r} is empty (0 bytes); fill it, remove it, "
                            f"or point {key}.path elsewhere")
    return builders.pop(), files


_TEXT_BUILDERS = ("json", "text", "csv")


def _first_undecodable(files: list[str]) -> tuple[str, int, str] | None:
    """(file, line number, the error) of the first byte sequence in `files` that is not UTF-8, or None.
    Read only on the error path (a corpus is not decoded twice when it is fine)."""
    import codecs

    for name in files:
        if name.lower().endswith(".gz"):
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        line = 1
        with open(name, "rb") as handle:
            while True:
                chunk = handle.read(1 << 22)
                try:
                    text = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    good = chunk[:error.start]
                    return name, line + good.count(b"\n"), str(error)
                line += text.count("\n")
                if not chunk:
                    break
    return None


def _encoding_error(source: DataSourceConfig, key: str, error: UnicodeDecodeError) -> DataError:
    """A clear DataError for text that is not UTF-8, naming the file and line when it is local."""
    resolved = resolve_files(source, key)
    found = _first_undecodable(resolved[1]) if resolved is not None and resolved[0] in _TEXT_BUILDERS else None
    where = f"{found[0]!r} line {found[1]}" if found else f"{key}.path={source.path!r}"
    return DataError(f"{key}: {where} is not UTF-8 text ({found[2] if found else error}); re-encode it, e.g. "
                     f"`iconv -f latin1 -t utf-8 IN > OUT`, and point {key}.path at the result")


def _cause_of_type(error: BaseException, kind: type) -> Any:
    """The first exception of type `kind` in `error`'s cause/context chain, or None."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, kind):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def completion_only(source: DataSourceConfig) -> bool:
    """Whether the source's rows are prompt + completion with the loss on the completion only."""
    return source.prompt_field is not None and source.completion_field is not None


def text_columns(source: DataSourceConfig) -> dict[str, str]:
    """The config key (under the source) of each column the source reads -> the column name."""
    if completion_only(source):
        columns = {}
        if source.prompt_template != CHAT_TEMPLATE:
            import string

            for _, field, _, _ in string.Formatter().parse(source.prompt_template or ""):
                if field and field != "prompt":
                    columns.setdefault(f"prompt_template:{field}", field)
        # the completion last: what the loss trains on (checked for text)
        return {**columns, "prompt_field": source.prompt_field, "completion_field": source.completion_field}
    return {"text_field": source.text_field}


def check_chat_template(tokenizer: Any, key: str) -> None:
    """prompt_template=chat needs a tokenizer that has one (a DataError otherwise)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{key}.prompt_template=chat needs a tokenizer with a chat template, and "
                        f"{getattr(tokenizer, 'name_or_path', None) or 'this tokenizer'!r} has none; write the "
                        f"template as a string instead, e.g. \"Question: {{prompt}}\\nAnswer: \"")


def prompts_and_completions(batch: dict, source: DataSourceConfig, tokenizer: Any) -> tuple[list[str], list[str]]:
    """The prompt and completion texts of a batch of rows of a completion-only source, joined by its
    `prompt_template`. Spaces that end a rendered prompt begin its completion instead: "Answer: " + "48"
    tokenizes as "Answer:" then " 48", the tokens a model prompted with "Answer:" generates."""
    prompts, completions = batch[source.prompt_field], batch[source.completion_field]
    if source.prompt_template == CHAT_TEMPLATE:
        check_chat_template(tokenizer, "the source")
        heads, tails = [], []
        for prompt, completion in zip(prompts, completions):
            turn = [{"role": "user", "content": prompt}]
            head = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
            whole = tokenizer.apply_chat_template(turn + [{"role": "assistant", "content": completion}],
                                                  tokenize=False)
            if not whole.startswith(head):
                raise DataError(f"the tokenizer's chat template renders a conversation that does not begin with its "
                                f"generation prompt ({head[-40:]!r}), so the completion cannot be cut from it; use "
                                f"a prompt_template string instead of chat")
            heads.append(head)
            tails.append(whole[len(head):])
        return heads, tails
    columns = list(batch)
    rendered = [source.prompt_template.format_map({**dict(zip(columns, values)), "prompt": prompt})
                for values, prompt in zip(zip(*batch.values()), prompts)]
    heads = [text.rstrip(" ") for text in rendered]
    return heads, [text[len(head):] + completion for text, head, completion in zip(rendered, heads, completions)]


def document_texts(documents: Any, source: DataSourceConfig, tokenizer: Any = None) -> Iterator[str]:
    """Each document's whole text (rendered prompt + completion for a completion-only source), e.g. to train
    a tokenizer (a chat template needs the tokenizer)."""
    for row in documents:
        if completion_only(source):
            heads, tails = prompts_and_completions({k: [v] for k, v in row.items()}, source, tokenizer)
            yield heads[0] + tails[0]
        else:
            yield row[source.text_field]


def _check_columns(documents: Any, columns: list[str], source: DataSourceConfig, key: str) -> None:
    """Every column the source reads exists and (when declared) holds strings."""
    features = getattr(documents, "features", None) or {}
    for setting, column in text_columns(source).items():
        if column not in columns and setting.startswith("prompt_template"):
            raise DataError(f"{key}.prompt_template={source.prompt_template!r} uses {{{column}}} but the dataset "
                            f"{source.path!r} has no column {column!r} (columns: {columns}); use one of them or "
                            f"{{prompt}}")
        if column not in columns:
            raise DataError(f"{key}: the dataset {source.path!r} has no column {column!r} (columns: {columns}); "
                            f"set {key}.{setting} to one of them")
        dtype = getattr(features.get(column), "dtype", "string")
        if dtype not in ("string", "large_string"):
            raise DataError(f"{key}.{setting}={column!r}: the column holds {dtype}, not text; store it as strings "
                            f"(e.g. \"357\", not 357)")


def _check_has_text(documents: Any, source: DataSourceConfig, key: str, streaming_probe: int = 1000) -> None:
    """Refuse a source whose documents are all empty or whitespace (it would train CE on blanks with
    NTL 0 and no warning). Reads until the first real document; a stream only its first documents.
    A completion-only source is checked on its completions (the only tokens it trains on)."""
    setting, field = list(text_columns(source).items())[-1]

    def blank(text: Any) -> bool:
        return not isinstance(text, str) or not text.strip()

    if source.streaming:
        seen = 0
        for row in documents.take(streaming_probe):
            seen += 1
            if not blank(row[field]):
                return
        if seen:
            logger.warning("%s.path=%r: its first %d documents are empty or whitespace (column %r)", key,
                           source.path, seen, field)
        return
    for batch in documents.select_columns([field]).iter(batch_size=1000):
        if not all(blank(text) for text in batch[field]):
            return
    raise DataError(f"{key}.path={source.path!r}: all {len(documents)} documents are empty or whitespace in column "
                    f"{field!r}; set {key}.{setting} to the column that holds the text, or fix the files")


def prepare_generated_corpus(source: DataSourceConfig, key: str) -> bool:
    """Write the generated arithmetic corpus of a source that asks for one when it is missing (True), or
    check that the one there was generated with exactly this source's settings (else a DataError).

    The corpus depends on `generate_arithmetic` and `generate_options` alone (its seed is
    `generate_options.seed`, never `data.seed`), so every run of a config trains on the same file,
    whichever run wrote it."""
    if source.generate_arithmetic <= 0:
        return False
    from ..eval.arithmetic import CORPUS_SEED, check_training_corpus, write_training_corpus

    if os.path.exists(source.path):
        try:
            check_training_corpus(source.path, source.generate_arithmetic, source.generate_options, f"{key}.path")
        except ValueError as error:
            raise DataError(f"{key}: {error}") from None
        return False
    options = dict(source.generate_options)
    seed = options.pop("seed", CORPUS_SEED)
    write_training_corpus(source.path, n=source.generate_arithmetic, seed=seed, **options)
    logger.info("wrote %d generated documents to %s (corpus seed %d)", source.generate_arithmetic, source.path, seed)
    return True


def load_documents(source: DataSourceConfig, key: str, cache_dir: str | None) -> Any:
    """The source's documents as a `datasets` Dataset (or IterableDataset when streaming)."""
    import datasets

    resolved = resolve_files(source, key)
    try:
        if resolved is None:
            documents = datasets.load_dataset(source.path, source.name, split=source.split,
                                              streaming=source.streaming, cache_dir=cache_dir)
        else:
            builder, files = resolved
            # utf-8-sig: a text file's BOM is not its first document's first character (json and csv drop it)
            documents = datasets.load_dataset(builder, data_files=files, split="train", streaming=source.streaming,
                                              cache_dir=cache_dir, **({"encoding": "utf-8-sig"} if builder == "text"
                                                                      else {}))
    except UnicodeDecodeError as error:
        raise _encoding_error(source, key, error) from None
    except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as error:
        raise DataError(f"cannot load {key}.path={source.path!r}: {error}") from None
    except Exception as error:  # pyarrow / json parser errors on malformed files
        cause = _cause_of_type(error, UnicodeDecodeError)  # datasets wraps it in a DatasetGenerationError
        if cause is not None:
            raise _encoding_error(source, key, cause) from None
        bad = first_bad_json_line(resolved[1]) if resolved and resolved[0] == "json" else None
        if bad is not None:  # datasets names no line: find the first one that is not a JSON object
            name, line, why = bad
            raise DataError(f"{key}.path={source.path!r}: {name!r} line {line} is {why}; every line of a JSON-lines "
                            f"file must be one object with distinct keys, e.g. {{\"text\": \"...\"}}: fix or remove "
                            f"that line") from None
        raise DataError(f"cannot read {key}.path={source.path!r} ({type(error).__name__}: {error}); "
                        f"check that the files are valid {resolved[0] if resolved else 'dataset'} data") from None
    columns = documents.column_names
    if columns is None:  # a stream without declared features: look at the first record
        first = next(iter(documents), None)
        columns = list(first) if first is not None else []
        if first is None:
            raise DataError(f"{key}.path={source.path!r} holds no documents")
    if source.format == TOKENIZED:
        if INPUT_IDS not in columns:
            raise DataError(f"{key}.path={source.path!r} has no column {INPUT_IDS!r} (columns: {columns}), which "
                            f"format: tokenized reads (one document's token ids a row, optionally {LOSS_MASK!r}); "
                            f"rename the column, or set {key}.format=text")
        return documents
    _check_columns(documents, columns, source, key)
    if not source.streaming and len(documents) == 0:
        raise DataError(f"{key}.path={source.path!r} holds no documents (empty dataset)")
    try:
        _check_has_text(documents, source, key)
    except UnicodeDecodeError as error:
        raise _encoding_error(source, key, error) from None
    return documents


def unusable(value: Any, limit: int) -> str | None:
    """Why a row's text field cannot be trained on (None: it can)."""
    if value is None:
        return "no text (null or missing)"
    if not isinstance(value, str):
        return f"a {'number' if isinstance(value, (int, float)) else type(value).__name__}, not text"
    if len(value) > limit:
        return f"{len(value)} characters, over data.max_document_chars={limit}"
    return None


def row_problem(source: DataSourceConfig, limit: int) -> Callable[[dict], tuple[str, str] | None]:
    """A function giving why a row cannot be trained on, as (column, reason), or None when it can."""
    if source.format == TOKENIZED:
        def token_ids_problem(row: dict) -> tuple[str, str] | None:
            ids, mask = row.get(INPUT_IDS), row.get(LOSS_MASK)
            if not isinstance(ids, list):
                return INPUT_IDS, "no token ids"
            if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
                return LOSS_MASK, "a loss_mask of another length"
            return None
        return token_ids_problem
    read = list(dict.fromkeys(text_columns(source).values()))

    def text_problem(row: dict) -> tuple[str, str] | None:
        return next(((column, reason) for column in read if (reason := unusable(row.get(column), limit)) is not None),
                    None)
    return text_problem


def document_tokens(tokenizer: Any, source: DataSourceConfig) -> Callable[[dict], tuple[list, list | None]]:
    """A function from a batch of usable rows (column -> values) to each document's token ids with EOS
    appended, and their targets masks (None: a source without one, every token a target)."""
    eos = tokenizer.eos_token_id
    # the closures hold the column names only: `datasets` fingerprints them for its cache (a source's weight
    # or path does not change how it is packed)
    text_field, source_format = source.text_field, source.format
    source = DataSourceConfig(prompt_field=source.prompt_field, completion_field=source.completion_field,
                              prompt_template=source.prompt_template)  # what packs it, fingerprinted alone

    def texts(batch: dict) -> tuple[list, None]:
        return [ids + [eos] for ids in tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]], None

    def completions(batch: dict) -> tuple[list, list]:
        prompt_texts, completion_texts = prompts_and_completions(batch, source, tokenizer)
        prompts = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
        answers = tokenizer(completion_texts, add_special_tokens=False)["input_ids"]
        return ([p + c + [eos] for p, c in zip(prompts, answers)],
                [[False] * len(p) + [True] * (len(c) + 1) for p, c in zip(prompts, answers)])

    def token_ids(batch: dict) -> tuple[list, list | None]:
        ids = [list(doc) + [eos] for doc in batch[INPUT_IDS]]
        if LOSS_MASK not in batch:
            return ids, None
        masks = batch[LOSS_MASK]
        return ids, [([True] * (len(doc) - 1) if mask is None else [bool(m) for m in mask]) + [True]
                     for doc, mask in zip(ids, masks)]

    if source_format == TOKENIZED:
        return token_ids
    return completions if completion_only(source) else texts


def _packer(tokenizer: Any, source: DataSourceConfig, seq_len: int, limit: int):
    problem, tokens_of = row_problem(source, limit), document_tokens(tokenizer, source)

    def windows(flat: list) -> list[list]:
        return [flat[i * seq_len: (i + 1) * seq_len + 1] for i in range((len(flat) - 1) // seq_len)]

    def pack(batch: dict) -> dict:
        rows = len(next(iter(batch.values())))
        keep = [i for i in range(rows) if problem({column: values[i] for column, values in batch.items()}) is None]
        if len(keep) != rows:  # rows that are not usable text are left out before the tokenizer sees them
            batch = {column: [values[i] for i in keep] for column, values in batch.items()}
        docs, masks = tokens_of(batch)
        flat = [t for doc in docs for t in doc]
        if masks is None:
            return {TOKENS: windows(flat)}
        return {TOKENS: windows(flat), TARGETS: windows([m for mask in masks for m in mask])}

    return pack


PROGRESS_SECONDS = 60.0  # long tokenization logs a line this often (rows and tokens done), not one per row
PACK_CHUNK = 100_000  # documents packed per `datasets.map` call and process (a multiple of its batches of 1000)


def pack_documents(documents: Any, tokenizer: Any, source: DataSourceConfig, seq_len: int, num_proc: int,
                   description: str, max_document_chars: int) -> Any:
    """Tokenize and pack an in-memory source's documents into samples of seq_len + 1 tokens (batches of
    1000 documents, `num_proc` processes); a completion-only source's samples also get their `targets` mask.
    Rows that are not usable text are left out (`drop_unusable_rows` counts and names them).

    The documents are packed in chunks of PACK_CHUNK a process (whole batches: the samples are those of one
    `map`), logging the documents and tokens done every PROGRESS_SECONDS; `datasets`' progress bar is shown
    on a terminal only (in a log file it is one line per update)."""
    import time

    import datasets

    total, workers = len(documents), max(num_proc, 1)
    logger.info("%s: %d documents (%d process(es))", description, total, workers)
    pack = _packer(tokenizer, source, seq_len, max_document_chars)
    chunk = PACK_CHUNK * workers
    bars = datasets.is_progress_bar_enabled()
    if bars and not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        parts, started, reported = [], time.monotonic(), time.monotonic()
        for first in range(0, max(total, 1), chunk):
            rows = documents if total <= chunk else documents.select(range(first, min(first + chunk, total)))
            parts.append(rows.map(pack, batched=True, batch_size=1000, remove_columns=documents.column_names,
                                  num_proc=num_proc if num_proc > 1 and len(rows) > 1 else None, desc=description))
            done = min(first + chunk, total)
            if done < total and time.monotonic() - reported >= PROGRESS_SECONDS:
                reported = time.monotonic()
                logger.info("%s: %d of %d documents, %d samples of %d tokens (%.0f s)", description, done, total,
                            sum(len(p) for p in parts), seq_len + 1, reported - started)
    finally:
        if bars:
            datasets.enable_progress_bars()
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _row_places(files: list[str], builder: str, rows: list[int]) -> dict[int, str]:
    """'FILE line N' of the given rows (in the order `datasets` reads them) of local JSON-lines files; rows
    of other formats are named by their index. Read only on the warning path."""
    places = {row: f"row {row}" for row in rows}
    if builder != "json" or not rows:
        return places
    wanted, row = sorted(rows), 0
    for name in files:
        if name.lower().endswith(".gz"):
            return places
        with open(name, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                if line.lstrip().startswith(b"[") and row == 0 and number == 1:
                    return places  # a JSON array, not lines
                if row == wanted[0]:
                    places[row] = f"{name!r} line {number}"
                    wanted.pop(0)
                    if not wanted:
                        return places
                row += 1
    return places


def drop_unusable_rows(documents: Any, source: DataSourceConfig, key: str, limit: int) -> Any:
    """The documents without rows whose text fields are null, missing, not strings (a number, an object) or
    longer than `limit` characters; a warning counts them and names the first ones' file and line."""
    import pyarrow.compute as pc

    reasons: dict[int, str] = {}
    if source.format == TOKENIZED:  # token ids: rows without them (null or missing) are left out
        rows = np.flatnonzero(pc.is_null(documents.data.column(INPUT_IDS)).to_numpy(zero_copy_only=False))
        reasons = {int(row): f"column {INPUT_IDS!r} holds no token ids (null or missing)" for row in rows}
    for column in dict.fromkeys(text_columns(source).values()) if source.format != TOKENIZED else ():
        if getattr(documents.features.get(column), "dtype", None) in ("string", "large_string"):
            values = documents.data.column(column)  # vectorised: nulls and long texts only go through Python
            flagged = pc.or_kleene(pc.is_null(values), pc.greater(pc.utf8_length(values), limit))
            rows = np.flatnonzero(flagged.to_numpy(zero_copy_only=False))
            checked = ((int(r), documents[int(r)][column]) for r in rows)
        else:  # a column of mixed kinds (datasets' Json feature): every value checked
            checked = enumerate(v for batch in documents.select_columns([column]).iter(batch_size=10000)
                                for v in batch[column])
        for row, value in checked:
            why = unusable(value, limit)
            if why is not None and row not in reasons:
                reasons[row] = f"column {column!r} holds {why}"
    if not reasons:
        return documents
    resolved = resolve_files(source, key)
    first = sorted(reasons)[:3]
    places = _row_places(resolved[1], resolved[0], first) if resolved else {row: f"row {row}" for row in first}
    logger.warning("%s.path=%r: skipped %d of %d rows that are not usable text, e.g. %s", key, source.path,
                   len(reasons), len(documents), "; ".join(f"{places[row]}: {reasons[row]}" for row in first))
    keep = np.setdiff1d(np.arange(len(documents)), np.fromiter(reasons, dtype=np.int64))
    return documents.select(keep)


Sample = tuple[np.ndarray, "np.ndarray | None"]  # (seq_len + 1 tokens, their targets mask or None: all targets)


def _sample_of(row: dict) -> Sample:
    targets = row.get(TARGETS)
    return np.asarray(row[TOKENS]), None if targets is None else np.asarray(targets, dtype=bool)


def pack_in_memory(cfg: DataConfig, source: Any, key: str, tokenizer: Any, num_proc: int) -> tuple[Any, Any]:
    """(training samples, validation samples) of a source read whole: its usable rows, seeded-shuffled, the
    first `validation_documents` held out, each part tokenized and packed (`num_proc` processes)."""
    if source.prompt_template == CHAT_TEMPLATE and completion_only(source):
        check_chat_template(tokenizer, key)
    documents = drop_unusable_rows(load_documents(source, key, cfg.cache_dir), source, key, cfg.max_document_chars)
    n_val = cfg.validation_documents
    if len(documents) <= n_val:
        raise DataError(f"{key}.path={source.path!r} has {len(documents)} documents, not more than "
                        f"data.validation_documents={n_val}; lower data.validation_documents")
    documents = documents.shuffle(seed=cfg.seed)
    held_out, training = documents.select(range(n_val)), documents.select(range(n_val, len(documents)))
    try:
        packed = pack_documents(training, tokenizer, source, cfg.seq_len, num_proc, f"packing {key}",
                                cfg.max_document_chars)
        held_packed = pack_documents(held_out, tokenizer, source, cfg.seq_len, num_proc,
                                     f"packing {key} (validation)", cfg.max_document_chars)
    except UnicodeDecodeError as error:  # text the JSON reader passed through undecoded
        raise _encoding_error(source, key, error) from None
    if len(packed) == 0:
        raise DataError(f"{key}.path={source.path!r} has fewer than data.seq_len + 1 = {cfg.seq_len + 1} "
                        f"tokens after tokenization; add data or lower data.seq_len")
    return packed, held_packed
