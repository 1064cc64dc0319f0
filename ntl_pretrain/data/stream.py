"""The global sample stream: the seeded mixture of sources, per-epoch permutations (streamed sources in
order), micro-batches for one data-parallel rank, and the resumable stream position."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..config import DataConfig

from .sources import (IGNORE_INDEX, DataError, Sample, _encoding_error, _sample_of, load_documents,
                      pack_documents)

logger = logging.getLogger(__name__)

_MIX_BLOCK = 4096  # global samples whose sources are drawn together


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
