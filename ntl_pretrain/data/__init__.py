"""Training data: `datasets` sources -> tokenized, packed, mixed, sharded by data-parallel rank, resumable.

Each source (local jsonl/json/parquet/text/csv files, a folder of them, or a hub dataset id; optionally
streamed) is split into held-out validation documents and training documents, tokenized, and packed
Megatron-style: documents are concatenated with an EOS token after each one and cut into samples of
`seq_len + 1` tokens where sample i covers tokens [i*seq_len, (i+1)*seq_len] (consecutive samples share
one token, none is lost). A sample gives `input_ids = s[:-1]` and `labels = s[1:]`, already aligned
with the logits, so the trainer never slices the `[B, S, V]` logits; the label after each EOS (a new
document's first token, which the previous document cannot predict) is ignored (-100).

A source with `prompt_field`, `completion_field` and `prompt_template` (supervised continued pretraining:
loss on the answer only) packs each row as its rendered prompt's tokens, its completion's tokens and EOS,
tokenized separately (the
completion's tokens are exactly what a model prompted with the prompt should generate). Beside the tokens
each sample keeps a same-length `targets` mask, true on completion and EOS tokens: the label of a
position is ignored when the token it predicts is not a target. The mask is cut with the same windows as
the tokens, so it is exact across sample boundaries (a completion split over two samples keeps every
target token). CE and NTL are normalised over the labels that are not ignored, as everywhere.

The global sample stream is a pure function of the seed: global sample g comes from the source a seeded draw (by
weight) assigns to it, and is that source's next sample in a per-epoch seeded permutation (streamed sources are
read in order); with `data.stages`, each stage's steps are drawn with its own weights (a segment of the stream a
stage, the sources read on across them: `stream.StagedMixture`). A step takes the next `micro_batch * dp *
grad_accum` global samples; data-parallel rank r takes its micro-batches from them, and every tensor-parallel
rank of a group takes the same ones. A streamed source is read per rank instead: rank r reads shards r, r + dp,
... (with fewer files than ranks, its contiguous byte range or row groups of them) and trains its own stream's
next sample wherever the mixture puts a sample of that source in its slices. A stream is packed continuously as
it is read; the stream position (samples consumed) and, per rank, where each streamed source's next sample
starts (its row's position in the files, and the tokens of that row already trained) are what a checkpoint needs
to resume without repeating, skipping or re-reading a sample.

Modules: `sources` (files, documents, bad rows, templates, packing), `stream` (mixture, order,
micro-batches, state), `streamed` (a streamed source: packing as it reads, its position, per-rank shares),
`reader` (rows of local files or a hub stream with their positions), `prepared` (corpora tokenized once by
tools/prepare_data.py), `description` (what a resume must find unchanged about the data), `documents` (position
ids that restart at each document: `data.document_mask`).
"""

from __future__ import annotations

from .sources import (  # noqa: F401 (the package's API)
    IGNORE_INDEX,
    TARGETS,
    TOKENS,
    DataError,
    Sample,
    completion_only,
    document_texts,
    load_documents,
    pack_documents,
    prepare_generated_corpus,
    resolve_files,
    text_columns,
)
from .description import data_description  # noqa: F401
from .documents import document_position_ids  # noqa: F401
from .stream import Mixture, MicroBatch, PretrainingData, StagedMixture  # noqa: F401
