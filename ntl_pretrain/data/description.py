"""What a resume must find unchanged about the data (`data_description`, saved in each checkpoint's manifest
and compared by `checkpoint.fingerprint.check_data`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..core.hashing import short_sha
from .sources import DataError, resolve_files

# data source keys newer than the first checkpoints: in a description only when not at their default
SOURCE_KEYS_RECORDED_WHEN_SET = ("format", "prompt_template")
SOURCE_KEYS_NOT_RECORDED = ("label",)  # a name only: the stages are recorded by source index


def data_description(data_cfg: Any) -> dict:
    """What a resume must find unchanged about the data: every key that decides which samples the stream
    holds (sources with their weights and the files they resolve to, held-out documents, seq_len, seed),
    not those that only decide how it is read (batch sizes, num_proc, cache_dir); and whether attention stays
    inside documents (`document_mask`: a checkpoint that does not record it was trained across them)."""
    sources = []
    for index, source in enumerate(data_cfg.sources):
        defaults = {f.name: f.default for f in dataclasses.fields(source)}
        # keys added after checkpoints existed are recorded only when set, so a checkpoint written before
        # them (which lacks them) still matches a source that leaves them at their defaults
        entry = {k: v for k, v in dataclasses.asdict(source).items()
                 if not (k in SOURCE_KEYS_RECORDED_WHEN_SET and v == defaults[k]) and k not in SOURCE_KEYS_NOT_RECORDED}
        try:
            resolved = resolve_files(source, f"data.sources.{index}")
        except DataError:
            resolved = None  # reported by the data pipeline itself
        if resolved is not None:
            files = [(os.path.basename(f), os.path.getsize(f)) for f in resolved[1]]
            entry["files"] = {"count": len(files), "bytes": sum(size for _, size in files), "names_and_sizes": short_sha(files)}
        sources.append(entry)
    described = {"sources": sources, "seq_len": data_cfg.seq_len, "validation_documents": data_cfg.validation_documents,
                 "mask_document_start": data_cfg.mask_document_start, "seed": data_cfg.seed,
                 # not the samples but what the model saw of them: a change is refused apart (check_data)
                 "document_mask": data_cfg.document_mask}
    # which documents are left out as too long decides the samples too (recorded when not the default)
    limit = next(f.default for f in dataclasses.fields(data_cfg) if f.name == "max_document_chars")
    if data_cfg.max_document_chars != limit:
        described["max_document_chars"] = data_cfg.max_document_chars
    if data_cfg.stages:  # [start step, weights in data.sources' order] (without stages: the sources' weights)
        described["stages"] = [[stage.start_step, list(stage.weights)] for stage in data_cfg.stage_table()]
    return described
