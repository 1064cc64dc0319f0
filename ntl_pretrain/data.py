"""Training data: `datasets` sources -> tokenized, packed, mixed, sharded by data-parallel rank, resumable.

Each source (local jsonl/json/parquet/text/csv files, a folder of them, or a hub dataset id; optionally
streamed) is split into held-out validation documents and training documents, tokenized, and packed
Megatron-style: documents are concatenated with an EOS token after each one and cut into samples of
`seq_len + 1` tokens where sample i covers tokens [i*seq_len, (i+1)*seq_len] (consecutive samples share
one token, none is lost). A sample gives `input_ids = s[:-1]` and `labels = s[1:]`, already aligned
with the logits, so the trainer never slices the `[B, S, V]` logits; the label after each EOS (a new
document's first token, which the previous document cannot predict) is ignored (-100).

A source with `prompt_field` and `completion_field` (supervised continued pretraining: loss on the answer
only) packs each row as its prompt's tokens, its completion's tokens and EOS, tokenized separately (the
completion's tokens are exactly what a model prompted with the prompt should generate). Beside the tokens
each sample keeps a same-length `targets` mask, true on completion and EOS tokens: the label of a
position is ignored when the token it predicts is not a target. The mask is cut with the same windows as
the tokens, so it is exact across sample boundaries (a completion split over two samples keeps every
target token). CE and NTL are normalised over the labels that are not ignored, as everywhere.

The global sample stream is a pure function of the seed: global sample g comes from the source a
seeded draw (by weight) assigns to it, and is that source's next sample in a per-epoch seeded
permutation (streamed sources are read in order). A step takes the next `micro_batch * dp * grad_accum`
global samples; data-parallel rank r takes its micro-batches from them, and every tensor-parallel rank
of a group takes the same ones. The stream position (samples consumed) is all a checkpoint needs to
resume without repeating or skipping a sample.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from .config import DataConfig, DataSourceConfig

logger = logging.getLogger(__name__)

TOKENS = "tokens"  # column of packed samples
TARGETS = "targets"  # column of prompt/completion samples: True where the token is a loss target
IGNORE_INDEX = -100  # label of positions without a target
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv",
             ".jsonl.gz": "json", ".json.gz": "json"}
_MIX_BLOCK = 4096  # global samples whose sources are drawn together


class DataError(ValueError):
    """A data source cannot be used; the message names the source key and the fix."""


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


def resolve_files(source: DataSourceConfig, key: str) -> tuple[str, list[str]] | None:
    """(datasets builder, files) of a local source, None for a hub dataset id; raises if a local path is missing."""
    path = os.path.expanduser(source.path)
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and _builder_for(f))
        if not files:
            raise DataError(f"{key}.path={source.path!r} is a folder without .jsonl/.json/.parquet/.txt/.csv files")
    elif os.path.isfile(path):
        files = [path]
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
        if not files:
            raise DataError(f"{key}.path={source.path!r} matches no file")
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
        return {"prompt_field": source.prompt_field, "completion_field": source.completion_field}
    return {"text_field": source.text_field}


def document_texts(documents: Any, source: DataSourceConfig) -> Iterator[str]:
    """Each document's whole text (prompt + completion for a completion-only source), e.g. to train a tokenizer."""
    for row in documents:
        if completion_only(source):
            yield row[source.prompt_field] + row[source.completion_field]
        else:
            yield row[source.text_field]


def _check_columns(documents: Any, columns: list[str], source: DataSourceConfig, key: str) -> None:
    """Every column the source reads exists and (when declared) holds strings."""
    features = getattr(documents, "features", None) or {}
    for setting, column in text_columns(source).items():
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
    from .eval.arithmetic import CORPUS_SEED, check_training_corpus, write_training_corpus

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
            documents = datasets.load_dataset(builder, data_files=files, split="train",
                                              streaming=source.streaming, cache_dir=cache_dir)
    except UnicodeDecodeError as error:
        raise _encoding_error(source, key, error) from None
    except (FileNotFoundError, ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as error:
        raise DataError(f"cannot load {key}.path={source.path!r}: {error}") from None
    except Exception as error:  # pyarrow / json parser errors on malformed files
        cause = _cause_of_type(error, UnicodeDecodeError)  # datasets wraps it in a DatasetGenerationError
        if cause is not None:
            raise _encoding_error(source, key, cause) from None
        raise DataError(f"cannot read {key}.path={source.path!r} ({type(error).__name__}: {error}); "
                        f"check that the files are valid {resolved[0] if resolved else 'dataset'} data") from None
    columns = documents.column_names
    if columns is None:  # a stream without declared features: look at the first record
        first = next(iter(documents), None)
        columns = list(first) if first is not None else []
        if first is None:
            raise DataError(f"{key}.path={source.path!r} holds no documents")
    _check_columns(documents, columns, source, key)
    if not source.streaming and len(documents) == 0:
        raise DataError(f"{key}.path={source.path!r} holds no documents (empty dataset)")
    try:
        _check_has_text(documents, source, key)
    except UnicodeDecodeError as error:
        raise _encoding_error(source, key, error) from None
    return documents


def _packer(tokenizer: Any, source: DataSourceConfig, seq_len: int):
    eos = tokenizer.eos_token_id
    # the closures hold the column names only: `datasets` fingerprints them for its cache (a source's weight
    # or path does not change how it is packed)
    text_field, prompt_field, completion_field = source.text_field, source.prompt_field, source.completion_field

    def windows(flat: list) -> list[list]:
        return [flat[i * seq_len: (i + 1) * seq_len + 1] for i in range((len(flat) - 1) // seq_len)]

    def pack(batch: dict) -> dict:
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        flat: list[int] = []
        for doc in ids:
            flat.extend(doc)
            flat.append(eos)
        return {TOKENS: windows(flat)}

    def pack_completions(batch: dict) -> dict:
        prompts = tokenizer(batch[prompt_field], add_special_tokens=False)["input_ids"]
        completions = tokenizer(batch[completion_field], add_special_tokens=False)["input_ids"]
        flat: list[int] = []
        targets: list[bool] = []
        for prompt, completion in zip(prompts, completions):
            flat.extend(prompt)
            flat.extend(completion)
            flat.append(eos)
            targets.extend([False] * len(prompt) + [True] * (len(completion) + 1))
        return {TOKENS: windows(flat), TARGETS: windows(targets)}

    return pack_completions if completion_only(source) else pack


def pack_documents(documents: Any, tokenizer: Any, source: DataSourceConfig, seq_len: int, num_proc: int,
                   description: str) -> Any:
    """Tokenize and pack documents into samples of seq_len + 1 tokens (batches of 1000 documents); a
    completion-only source's samples also get their `targets` mask."""
    import datasets

    kwargs: dict[str, Any] = dict(batched=True, batch_size=1000, remove_columns=documents.column_names)
    if isinstance(documents, datasets.Dataset):
        kwargs.update(num_proc=num_proc if num_proc > 1 else None, desc=description)
    return documents.map(_packer(tokenizer, source, seq_len), **kwargs)


Sample = tuple[np.ndarray, "np.ndarray | None"]  # (seq_len + 1 tokens, their targets mask or None: all targets)


def _sample_of(row: dict) -> Sample:
    targets = row.get(TARGETS)
    return np.asarray(row[TOKENS]), None if targets is None else np.asarray(targets, dtype=bool)


# ---------------------------------------------------------------------------------------------- ordering
class Mixture:
    """Which source each global sample comes from, and its index within that source (seeded, by weight)."""

    def __init__(self, weights: list[float], seed: int) -> None:
        total = float(sum(weights))
        self.probabilities = np.asarray(weights, dtype=np.float64) / total
        self.seed = seed
        self._block_offsets: list[np.ndarray] = [np.zeros(len(weights), dtype=np.int64)]
        self._block_cache: dict[int, np.ndarray] = {}

    def _block(self, block: int) -> np.ndarray:
        choice = self._block_cache.get(block)
        if choice is None:
            if len(self.probabilities) == 1:
                choice = np.zeros(_MIX_BLOCK, dtype=np.int64)
            else:
                rng = np.random.default_rng([self.seed, block])
                choice = rng.choice(len(self.probabilities), size=_MIX_BLOCK, p=self.probabilities)
            if len(self._block_cache) > 8:
                self._block_cache.clear()
            self._block_cache[block] = choice
        return choice

    def _offsets(self, block: int) -> np.ndarray:
        while len(self._block_offsets) <= block:
            b = len(self._block_offsets) - 1
            counts = np.bincount(self._block(b), minlength=len(self.probabilities))
            self._block_offsets.append(self._block_offsets[-1] + counts)
        return self._block_offsets[block]

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index within the source) of global sample g."""
        block, within = divmod(g, _MIX_BLOCK)
        choice = self._block(block)
        source = int(choice[within])
        before = int(np.count_nonzero(choice[:within] == source))
        return source, int(self._offsets(block)[source]) + before


class _MapSource:
    """Samples of an in-memory (arrow) source, in a fresh seeded permutation each epoch."""

    def __init__(self, samples: Any, seed: int, index: int) -> None:
        self.samples = samples.with_format("numpy")
        self.size = len(samples)
        self.seed, self.index = seed, index
        self._permutations: dict[int, np.ndarray] = {}

    def get(self, j: int) -> Sample:
        epoch, position = divmod(j, self.size)
        permutation = self._permutations.get(epoch)
        if permutation is None:
            self._permutations = {epoch: np.random.default_rng([self.seed, self.index, epoch]).permutation(self.size)}
            permutation = self._permutations[epoch]
        return _sample_of(self.samples[int(permutation[position])])


class _StreamSource:
    """Samples of a streamed source, read in order (re-read from the start after its end)."""

    def __init__(self, samples: Any, key: str) -> None:
        self.samples, self.key = samples, key
        self._iterator: Iterator[dict] | None = None
        self._next = 0  # index of the sample the iterator yields next
        self._yielded_this_pass = 0

    def get(self, j: int) -> Sample:
        if self._iterator is None or j < self._next:  # (re)start: the stream is read in order only
            self._iterator, self._next, self._yielded_this_pass = iter(self.samples), 0, 0
        while True:
            try:
                sample = next(self._iterator)
            except UnicodeDecodeError as error:  # a streamed file read only now, past the first documents
                raise DataError(f"{self.key}: a streamed file is not UTF-8 text ({error}); re-encode it, e.g. "
                                f"`iconv -f latin1 -t utf-8 IN > OUT`") from None
            except StopIteration:
                if self._yielded_this_pass == 0:
                    raise DataError(f"{self.key} yields no sample of seq_len + 1 tokens; add data or lower "
                                    f"data.seq_len") from None
                self._iterator, self._yielded_this_pass = iter(self.samples), 0
                continue
            self._yielded_this_pass += 1
            index, self._next = self._next, self._next + 1
            if index == j:
                return _sample_of(sample)


@dataclass
class MicroBatch:
    """One micro-batch: input ids and labels of the same length (labels already shifted)."""

    input_ids: torch.Tensor  # [micro_batch_size, seq_len] long
    labels: torch.Tensor  # [micro_batch_size, seq_len] long


def _to_micro_batch(samples: list[Sample], boundary_id: int | None) -> MicroBatch:
    """Inputs and shifted labels; with `boundary_id` (EOS), the label after it is ignored (-100): the first
    token of a document cannot be predicted from the document before it. A label whose token is not a
    target (a prompt token of a completion-only source) is ignored too."""
    stacked = torch.from_numpy(np.stack([tokens for tokens, _ in samples]).astype(np.int64))
    input_ids, labels = stacked[:, :-1].clone(), stacked[:, 1:].clone()  # own storage: labels are edited below
    if boundary_id is not None:
        labels[input_ids == boundary_id] = IGNORE_INDEX
    if any(targets is not None for _, targets in samples):
        targets = np.stack([np.ones(len(tokens), dtype=bool) if mask is None else mask for tokens, mask in samples])
        labels[~torch.from_numpy(targets[:, 1:])] = IGNORE_INDEX
    return MicroBatch(input_ids=input_ids, labels=labels)


class PretrainingData:
    """The run's training and validation samples for one data-parallel rank.

    Build with `PretrainingData.build(cfg, tokenizer, dp_rank=..., dp_size=...)`; every rank builds the
    same streams, so the split of each batch over data-parallel ranks is consistent.
    """

    def __init__(self, cfg: DataConfig, sources: list[Any], validation: list[Sample], *, dp_rank: int,
                 dp_size: int, eos_id: int) -> None:
        self.cfg = cfg
        self.boundary_id = eos_id if cfg.mask_document_start else None
        self.sources = sources
        self.validation = validation
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.mixture = Mixture([s.weight for s in cfg.sources], cfg.seed)
        self.position = 0  # global samples consumed

    @classmethod
    def build(cls, cfg: DataConfig, tokenizer: Any, *, dp_rank: int, dp_size: int) -> "PretrainingData":
        """Load, split, tokenize and pack every source (deterministic: every rank gets the same streams).

        The trainer runs this on local rank 0 first, which fills the `datasets` cache the others then read.
        """
        sources: list[Any] = []
        validation: list[Sample] = []
        for i, source in enumerate(cfg.sources):
            key = f"data.sources.{i}"
            documents = load_documents(source, key, cfg.cache_dir)
            n_val = cfg.validation_documents
            if source.streaming:
                held_out, training = documents.take(n_val), documents.skip(n_val)
            else:
                if len(documents) <= n_val:
                    raise DataError(f"{key}.path={source.path!r} has {len(documents)} documents, not more than "
                                    f"data.validation_documents={n_val}; lower data.validation_documents")
                documents = documents.shuffle(seed=cfg.seed)
                held_out, training = documents.select(range(n_val)), documents.select(range(n_val, len(documents)))
            try:
                packed = pack_documents(training, tokenizer, source, cfg.seq_len, cfg.num_proc,
                                        f"packing {key}")
            except UnicodeDecodeError as error:  # text the JSON reader passed through undecoded
                raise _encoding_error(source, key, error) from None
            if source.streaming:
                sources.append(_StreamSource(packed, key))
            else:
                if len(packed) == 0:
                    raise DataError(f"{key}.path={source.path!r} has fewer than data.seq_len + 1 = {cfg.seq_len + 1} "
                                    f"tokens after tokenization; add data or lower data.seq_len")
                sources.append(_MapSource(packed, cfg.seed, i))
            if n_val:
                held_packed = pack_documents(held_out, tokenizer, source, cfg.seq_len, cfg.num_proc,
                                             f"packing {key} (validation)")
                validation.extend(_sample_of(s) for s in held_packed)
        return cls(cfg, sources, validation, dp_rank=dp_rank, dp_size=dp_size, eos_id=tokenizer.eos_token_id)

    # ------------------------------------------------------------------ training
    def sample_with_targets(self, g: int) -> Sample:
        """Global sample g: its tokens and their targets mask (None: every token is a target)."""
        source, j = self.mixture.locate(g)
        return self.sources[source].get(j)

    def sample(self, g: int) -> np.ndarray:
        """The tokens of global sample g."""
        return self.sample_with_targets(g)[0]

    def next_step(self, grad_accum_steps: int) -> list[MicroBatch]:
        """This rank's micro-batches of the next optimizer step; advances the stream position."""
        mbs, dp = self.cfg.micro_batch_size, self.dp_size
        base = self.position
        batches = []
        for m in range(grad_accum_steps):
            first = base + (m * dp + self.dp_rank) * mbs
            batches.append(_to_micro_batch([self.sample_with_targets(first + i) for i in range(mbs)],
                                           self.boundary_id))
        self.position = base + grad_accum_steps * dp * mbs
        return batches

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.cfg.seed, "seq_len": self.cfg.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.cfg.seed or state.get("seq_len") != self.cfg.seq_len:
            raise DataError(f"the checkpoint's data stream (seed {state.get('seed')}, seq_len {state.get('seq_len')}) "
                            f"differs from data.seed={self.cfg.seed}, data.seq_len={self.cfg.seq_len}; a resume "
                            f"would repeat or skip samples")
        self.position = int(state["position"])

    # ------------------------------------------------------------------ validation
    def validation_micro_batches(self, max_batches: int) -> list[MicroBatch]:
        """This rank's validation micro-batches; the same count on every rank (collectives stay matched)."""
        mbs, dp = self.cfg.micro_batch_size, self.dp_size
        count = min(max_batches, len(self.validation) // (mbs * dp))
        batches = []
        for m in range(count):
            first = (m * dp + self.dp_rank) * mbs
            batches.append(_to_micro_batch(self.validation[first: first + mbs], self.boundary_id))
        return batches

    def check_validation(self, max_batches: int) -> None:
        if not self.validation_micro_batches(max_batches):
            raise DataError(f"the validation split has {len(self.validation)} samples of seq_len + 1 tokens, fewer "
                            f"than one micro-batch per data-parallel rank ({self.cfg.micro_batch_size} x {self.dp_size}); "
                            f"raise data.validation_documents or set train.val_every_n_steps=-1")
