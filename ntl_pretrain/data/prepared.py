"""A corpus tokenized and packed once (tools/prepare_data.py) and memory-mapped by every rank of every run
that trains from it (`format: prepared`), checked against the run's tokenizer and settings first."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

from ..config import DataConfig, DataSourceConfig
from ..config.schema import PREPARED
from ..core.fs import atomic_directory
from .sources import PREPARED_MANIFEST, DataError, pack_in_memory, prepare_generated_corpus, resolve_files

logger = logging.getLogger(__name__)

MANIFEST = PREPARED_MANIFEST
TRAIN, VALIDATION = "train", "validation"  # the sample folders (datasets save_to_disk), fixed names
MANIFEST_VERSION = 1


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of everything that decides the tokenizer's ids (its serialised fast tokenizer, or its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def run_settings(cfg: DataConfig, tokenizer: Any) -> dict[str, Any]:
    """What a prepared corpus must have been made with to train this run (compared key by key)."""
    return {"tokenizer": tokenizer_fingerprint(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "seq_len": cfg.seq_len, "validation_documents": cfg.validation_documents,
            "max_document_chars": cfg.max_document_chars}


def _source_record(source: DataSourceConfig, key: str) -> dict[str, Any]:
    """The source a corpus was made from: its settings, and its local files with their sizes."""
    record = {field: getattr(source, field) for field in ("path", "name", "split", "format", "text_field",
                                                          "prompt_field", "completion_field", "prompt_template")}
    resolved = resolve_files(source, key)
    record["files"] = [{"path": os.path.abspath(name), "bytes": os.path.getsize(name)}
                       for name in (resolved[1] if resolved else [])]
    return record


def prepare_corpus(cfg: DataConfig, tokenizer: Any, out_dir: str, num_proc: int) -> list[str]:
    """Tokenize and pack every source of `cfg` (read whole, `num_proc` processes) into `out_dir/source-I`,
    each with its manifest; returns the folders. A folder is written under a temporary name and renamed
    when complete; an existing non-empty one is refused (FileExistsError)."""
    settings = run_settings(cfg, tokenizer)
    written = []
    for i, source in enumerate(cfg.sources):
        key = f"data.sources.{i}"
        if source.format == PREPARED:
            raise DataError(f"{key}.path={source.path!r} is already prepared (format: prepared); list the raw source")
        prepare_generated_corpus(source, key)  # a generated corpus the config asks for, as a run writes it
        whole = dataclasses.replace(source, streaming=False)  # prepared once, read whole
        packed, held_packed = pack_in_memory(cfg, whole, key, tokenizer, num_proc)
        target = os.path.join(out_dir, f"source-{i}")
        with atomic_directory(target) as staging:
            packed.save_to_disk(os.path.join(staging, TRAIN), num_proc=num_proc if num_proc > 1 else None)
            held_packed.save_to_disk(os.path.join(staging, VALIDATION))
            manifest = {"version": MANIFEST_VERSION, "settings": settings, "split_seed": cfg.seed,
                        "tokenizer_name": getattr(tokenizer, "name_or_path", None), "source": _source_record(source, key),
                        "completion_only": source.prompt_field is not None, "weight": source.weight,
                        "samples": {TRAIN: len(packed), VALIDATION: len(held_packed)}}
            with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as handle:
                json.dump(manifest, handle, indent=1)
        logger.info("%s: %d training and %d validation samples of %d tokens in %s", key, len(packed),
                    len(held_packed), cfg.seq_len + 1, target)
        written.append(target)
    return written


def load_prepared(source: DataSourceConfig, key: str, cfg: DataConfig, tokenizer: Any) -> tuple[Any, Any]:
    """(training samples, validation samples) of a prepared corpus, memory-mapped; refused (every differing
    key named) when it was made with another tokenizer or settings than this run's."""
    folder = os.path.expanduser(source.path)
    manifest_path = os.path.join(folder, MANIFEST)
    resolve_files(source, key)  # a folder with a manifest
    for part in (TRAIN, VALIDATION):
        if os.path.islink(os.path.join(folder, part)) or not os.path.isdir(os.path.join(folder, part)):
            raise DataError(f"{key}.path={source.path!r}: {part}/ is missing or a link; prepare the corpus again")
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        made_with = dict(manifest["settings"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{key}.path={source.path!r}: unreadable {MANIFEST} ({error}); prepare the corpus again") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise DataError(f"{key}.path={source.path!r}: its {MANIFEST} is of version {manifest.get('version')!r}, this "
                        f"ntl_pretrain reads version {MANIFEST_VERSION}; prepare the corpus again with this version")
    wanted = run_settings(cfg, tokenizer)
    differing = [f"{name} (prepared {made_with.get(name)!r}, this run {value!r})" for name, value in wanted.items()
                 if made_with.get(name) != value]
    if differing:
        raise DataError(f"{key}.path={source.path!r} was prepared with other settings than this run's: "
                        f"{'; '.join(differing)}; prepare it again with this config (tools/prepare_data.py) or "
                        f"train with the settings it was made with")
    parts = {part: _load_part(folder, part, key, source) for part in (TRAIN, VALIDATION)}
    recorded = manifest.get("samples") if isinstance(manifest.get("samples"), dict) else {}
    for part, dataset in parts.items():  # a split swapped or copied from another corpus
        if part in recorded and recorded[part] != len(dataset):
            raise DataError(f"{key}.path={source.path!r}: its {part}/ holds {len(dataset)} samples, its {MANIFEST} "
                            f"says {recorded[part]!r} (a part replaced or edited); prepare the corpus again")
    if not len(parts[TRAIN]):
        raise DataError(f"{key}.path={source.path!r}: its {TRAIN}/ holds no samples; prepare the corpus again")
    return parts[TRAIN], parts[VALIDATION]


def _load_part(folder: str, part: str, key: str, source: DataSourceConfig) -> Any:
    """One split of a prepared corpus, memory-mapped. A split of 0 samples (validation_documents too few to fill a
    sample, or 0) is saved by `datasets` without data files, which its `load_from_disk` cannot read back (a raw
    IndexError): it is rebuilt empty with its recorded features. A damaged file is one line naming the folder."""
    import datasets

    path = os.path.join(folder, part)
    try:
        with open(os.path.join(path, "state.json"), encoding="utf-8") as handle:
            empty = json.load(handle).get("_data_files") == []
        if empty:
            features = datasets.DatasetInfo.from_directory(path).features
            return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
        return datasets.load_from_disk(path)
    except Exception as error:  # pyarrow's and datasets' own errors for a truncated or replaced file
        raise DataError(f"{key}.path={source.path!r}: cannot read its {part}/ ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}); prepare the corpus again") from None
