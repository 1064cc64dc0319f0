"""The global sample stream: the seeded mixture of sources, per-epoch permutations (streamed sources in
order), micro-batches for one data-parallel rank, and the resumable stream position."""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import DataConfig
from ..config.schema import PREPARED
from .prepared import load_prepared
from .sources import IGNORE_INDEX, DataError, Sample, _sample_of, pack_in_memory
from .streamed import StreamedSource, open_stream

logger = logging.getLogger(__name__)

_MIX_BLOCK = 4096  # global samples whose sources are drawn together


class Mixture:
    """Which source each sample of a mixture comes from, and its index within that source (seeded, by weight).

    `key` tells mixtures of one seed apart (a staged mixture's segments; the run's first segment has none, so a run
    without stages draws what it always drew); `first` is the global index of the mixture's first sample (which
    data-parallel rank trains a sample depends on it)."""

    def __init__(self, weights: list[float], seed: int, key: tuple[int, ...] = (), first: int = 0) -> None:
        total = float(sum(weights))
        self.probabilities = np.asarray(weights, dtype=np.float64) / total
        self.seed, self.key, self.first = seed, tuple(key), first
        self._block_offsets: list[np.ndarray] = [np.zeros(len(weights), dtype=np.int64)]
        self._block_cache: dict[int, np.ndarray] = {}
        self._rank_offsets: dict[tuple[int, int], list[np.ndarray]] = {}  # (dp, micro_batch) -> [source, rank]

    def _block(self, block: int) -> np.ndarray:
        choice = self._block_cache.get(block)
        if choice is None:
            if len(self.probabilities) == 1:
                choice = np.zeros(_MIX_BLOCK, dtype=np.int64)
            else:
                rng = np.random.default_rng([self.seed, *self.key, block])
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
        """(source, index within the source) of the mixture's sample g."""
        block, within = divmod(g, _MIX_BLOCK)
        choice = self._block(block)
        source = int(choice[within])
        before = int(np.count_nonzero(choice[:within] == source))
        return source, int(self._offsets(block)[source]) + before

    def counts(self, n: int) -> np.ndarray:
        """How many of the mixture's first n samples each source gives."""
        block, within = divmod(n, _MIX_BLOCK)
        return self._offsets(block) + np.bincount(self._block(block)[:within], minlength=len(self.probabilities))

    def _owners(self, block: int, dp: int, micro_batch: int) -> np.ndarray:
        """The data-parallel rank that trains each sample of a block: global sample g is in micro-batch slice
        g // micro_batch, and slices go to ranks 0..dp-1 in turn (whatever the accumulation steps)."""
        first = self.first + block * _MIX_BLOCK
        return (np.arange(first, first + _MIX_BLOCK) // micro_batch) % dp

    def _rank_block_offsets(self, block: int, dp: int, micro_batch: int) -> np.ndarray:
        offsets = self._rank_offsets.setdefault((dp, micro_batch), [np.zeros((len(self.probabilities), dp), np.int64)])
        while len(offsets) <= block:
            b = len(offsets) - 1
            counts = np.bincount(self._block(b) * dp + self._owners(b, dp, micro_batch),
                                 minlength=len(self.probabilities) * dp).reshape(-1, dp)
            offsets.append(offsets[-1] + counts)
        return offsets[block]

    def locate_on_rank(self, g: int, rank: int, dp: int, micro_batch: int) -> tuple[int, int]:
        """(source, index within what `rank` reads of the source) of the mixture's sample g that `rank` trains: the
        number of earlier samples of that source that `rank` trained (a source read per rank)."""
        block, within = divmod(g, _MIX_BLOCK)
        choice = self._block(block)
        source = int(choice[within])
        owners = self._owners(block, dp, micro_batch)
        before = int(np.count_nonzero((choice[:within] == source) & (owners[:within] == rank)))
        return source, int(self._rank_block_offsets(block, dp, micro_batch)[source, rank]) + before

    def rank_counts(self, n: int, dp: int, micro_batch: int) -> np.ndarray:
        """[source, rank]: how many of the mixture's first n samples of each source each rank trains."""
        block, within = divmod(n, _MIX_BLOCK)
        counts = np.bincount(self._block(block)[:within] * dp + self._owners(block, dp, micro_batch)[:within],
                             minlength=len(self.probabilities) * dp).reshape(-1, dp)
        return self._rank_block_offsets(block, dp, micro_batch) + counts


class StagedMixture:
    """The run's mixture: segments of the global stream, each a `Mixture` of one stage's weights from its first
    global sample on (the last one open-ended). A source's index carries on across segments: it is read on from
    where the segments before left it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.firsts: list[int] = []
        self.segments: list[Mixture] = []
        self._offsets: list[np.ndarray] = []  # per segment: each source's samples in the segments before it
        self._rank_offsets: dict[tuple[int, int], list[np.ndarray]] = {}

    def add(self, first: int, weights: list[float], key: tuple[int, ...]) -> None:
        """A segment from global sample `first` on (after every segment so far) with these weights."""
        if self.segments:
            length = first - self.firsts[-1]
            self._offsets.append(self._offsets[-1] + self.segments[-1].counts(length))
        else:
            self._offsets.append(np.zeros(len(weights), dtype=np.int64))
        self.firsts.append(first)
        self.segments.append(Mixture(weights, self.seed, key, first))
        self._rank_offsets.clear()

    def _segment(self, g: int) -> int:
        return bisect.bisect_right(self.firsts, g) - 1

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index within the source) of global sample g."""
        k = self._segment(g)
        source, j = self.segments[k].locate(g - self.firsts[k])
        return source, int(self._offsets[k][source]) + j

    def counts(self, g: int) -> np.ndarray:
        """How many of the first g global samples each source gives."""
        k = self._segment(g)
        return self._offsets[k] + self.segments[k].counts(g - self.firsts[k])

    def locate_on_rank(self, g: int, rank: int, dp: int, micro_batch: int) -> tuple[int, int]:
        """(source, index within what `rank` reads of the source) of global sample g that `rank` trains."""
        k = self._segment(g)
        source, j = self.segments[k].locate_on_rank(g - self.firsts[k], rank, dp, micro_batch)
        offsets = self._rank_offsets.setdefault((dp, micro_batch), [])
        while len(offsets) <= k:
            i = len(offsets)
            offsets.append(np.zeros((len(self._offsets[0]), dp), np.int64) if i == 0 else offsets[-1] +
                           self.segments[i - 1].rank_counts(self.firsts[i] - self.firsts[i - 1], dp, micro_batch))
        return source, int(offsets[k][source, rank]) + j


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

    Build with `PretrainingData.build(cfg, tokenizer, dp_rank=..., dp_size=...)`: every rank builds the
    same in-memory sources and global order, so the split of each batch over data-parallel ranks is
    consistent; a streamed source read per rank is each rank's own share (`_trained_sample`).
    """

    def __init__(self, cfg: DataConfig, sources: list[Any], validation: list[Sample], *, dp_rank: int,
                 dp_size: int, eos_id: int, validation_sources: list[int] | None = None) -> None:
        self.cfg = cfg
        self.boundary_id = eos_id if cfg.mask_document_start else None
        self.sources = sources
        self.validation = validation
        # the data.sources index each validation sample was held out of (packed per source: a sample holds one
        # source's documents); None (a rehearsal's numbered samples): the mixture's figures only
        self.validation_sources = [-1] * len(validation) if validation_sources is None else validation_sources
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.stages = cfg.stage_table()
        self._stage_starts = [stage.start_step for stage in self.stages]
        self.position = 0  # global samples consumed
        self.steps_done = 0  # optimizer steps drawn (the stage of the next one is that of steps_done + 1)
        self._shares_from = 0  # the position `stage_figures` last counted the sources from
        self._use_segments([{"stage": 0, "first": 0, "weights": list(self.stages[0].weights)}])

    # ------------------------------------------------------------------ stages
    def _use_segments(self, segments: list[dict]) -> None:
        """The mixture of these segments (each: the stage it belongs to, its first global sample, its weights)."""
        self.segments = [dict(segment) for segment in segments]
        self.mixture = StagedMixture(self.cfg.seed)
        for segment in self.segments:
            first, stage = int(segment["first"]), int(segment["stage"])
            # the run's first segment draws what a run without stages draws; a later one has its own draws
            key = () if (stage, first) == (0, 0) else (stage, first)
            self.mixture.add(first, [float(w) for w in segment["weights"]], key)

    def stage_of(self, step: int) -> int:
        """The index in data.stages of the stage optimizer step `step` (from 1) trains in."""
        return bisect.bisect_right(self._stage_starts, step) - 1

    def _enter(self, step: int) -> None:
        """Open a segment with step's stage's weights when the stream is not in it yet (its first step, or a
        resume whose current stage's weights were changed), at the current position: a step's samples are all
        drawn with its own stage's weights."""
        k = self.stage_of(step)
        weights = list(self.stages[k].weights)
        last = self.segments[-1]
        if (int(last["stage"]), [float(w) for w in last["weights"]]) == (k, weights):
            return
        self.segments.append({"stage": k, "first": self.position, "weights": weights})
        self.mixture.add(self.position, weights, (k, self.position))
        if self.dp_rank == 0:
            total = sum(weights)
            logger.info("step %d: data stage %d begins (%s)", step, k, ", ".join(
                f"{name} {w / total:.3f}" for name, w in zip(self.cfg.source_names(), weights)))

    def stage_figures(self) -> dict[str, float]:
        """TensorBoard's data/* scalars: the stage of the last step drawn and each source's share of the global
        samples drawn since the last call (host arithmetic on the seeded mixture: no device read)."""
        counts = self.mixture.counts(self.position) - self.mixture.counts(self._shares_from)
        self._shares_from = self.position
        total = max(int(counts.sum()), 1)
        return {"data/stage": float(self.segments[-1]["stage"]),
                **{f"data/source_share/{name}": float(count) / total for name, count in zip(self.cfg.source_names(), counts)}}

    @classmethod
    def build(cls, cfg: DataConfig, tokenizer: Any, *, dp_rank: int, dp_size: int) -> "PretrainingData":
        """Load, split, tokenize and pack every source (deterministic: every rank gets the same in-memory
        sources, and a streamed one's own share of it).

        The trainer runs this on local rank 0 first, which fills the `datasets` cache the others then read.
        """
        sources: list[Any] = []
        validation: list[Sample] = []
        validation_sources: list[int] = []
        for i, source in enumerate(cfg.sources):
            key = f"data.sources.{i}"
            if source.format == PREPARED:  # tokenized and packed by tools/prepare_data.py: memory-mapped as it is
                packed, held_packed = load_prepared(source, key, cfg, tokenizer)
                sources.append(_MapSource(packed, cfg.seed, i))
                validation.extend(_sample_of(s) for s in held_packed)
            elif not source.streaming:
                packed, held_packed = pack_in_memory(cfg, source, key, tokenizer, cfg.num_proc)
                sources.append(_MapSource(packed, cfg.seed, i))
                validation.extend(_sample_of(s) for s in held_packed)
            else:
                stream, held_samples = open_stream(source, key, cfg, tokenizer, dp_rank=dp_rank, dp_size=dp_size)
                sources.append(stream)
                validation.extend(held_samples)
            validation_sources.extend([i] * (len(validation) - len(validation_sources)))
        return cls(cfg, sources, validation, dp_rank=dp_rank, dp_size=dp_size, eos_id=tokenizer.eos_token_id,
                   validation_sources=validation_sources)

    # ------------------------------------------------------------------ training
    def sample_with_targets(self, g: int) -> Sample:
        """Global sample g: its tokens and their targets mask (None: every token is a target), the same on every
        rank: from a streamed source, sample j of it (j: g's index within the source) as data-parallel rank 0
        reads it, read apart from the stream this rank trains (a start-up check does not move it)."""
        source, j = self.mixture.locate(g)
        stream = self.sources[source]
        return (stream.agreed() if isinstance(stream, StreamedSource) else stream).get(j)

    def sample(self, g: int) -> np.ndarray:
        """The tokens of global sample g (`sample_with_targets`)."""
        return self.sample_with_targets(g)[0]

    def _trained_sample(self, g: int) -> Sample:
        """Global sample g as this rank trains it: from a source read per rank, the rank's next own sample."""
        source, j = self.mixture.locate(g)
        if getattr(self.sources[source], "per_rank", False):
            j = self.mixture.locate_on_rank(g, self.dp_rank, self.dp_size, self.cfg.micro_batch_size)[1]
        return self.sources[source].get(j)

    def next_step(self, grad_accum_steps: int) -> list[MicroBatch]:
        """This rank's micro-batches of the next optimizer step, drawn with its stage's weights; advances the
        stream position."""
        mbs, dp = self.cfg.micro_batch_size, self.dp_size
        self._enter(self.steps_done + 1)
        base = self.position
        batches = []
        for m in range(grad_accum_steps):
            first = base + (m * dp + self.dp_rank) * mbs
            batches.append(_to_micro_batch([self._trained_sample(first + i) for i in range(mbs)],
                                           self.boundary_id))
        self.position = base + grad_accum_steps * dp * mbs
        self.steps_done += 1
        return batches

    def rank_state(self) -> dict:
        """This rank's part of the state: where each streamed source stands (key -> its state)."""
        return {"dp_rank": self.dp_rank, "streams": {source.key: source.state_dict() for source in self.sources
                                                     if isinstance(source, StreamedSource)}}

    def state_dict(self) -> dict:
        """The stream position and every data-parallel rank's streamed-source states, for the checkpoint.
        A collective when the run is distributed: call it on every rank."""
        streamed = any(isinstance(source, StreamedSource) for source in self.sources)  # the same on every rank
        return combine_rank_states(self, _gather_objects(self.rank_state()) if streamed else [self.rank_state()])

    def load_state_dict(self, state: dict, steps_done: int | None = None) -> None:
        """Resume at a checkpoint's data state; `steps_done`: the optimizer steps it had trained (the trainer's
        step; default: the state's own count)."""
        if state.get("seed") != self.cfg.seed or state.get("seq_len") != self.cfg.seq_len:
            raise DataError(f"the checkpoint's data stream (seed {state.get('seed')}, seq_len {state.get('seq_len')}) "
                            f"differs from data.seed={self.cfg.seed}, data.seq_len={self.cfg.seq_len}; a resume "
                            f"would repeat or skip samples")
        streams = state.get("streams") or {}  # absent in checkpoints of older versions: the streams are re-read
        for source in self.sources:
            saved = streams.get(source.key) if isinstance(source, StreamedSource) else None
            if saved is not None and (saved["per_rank"] or source.per_rank) and \
                    (saved["per_rank"], len(saved["ranks"])) != (source.per_rank, self.dp_size):
                raise DataError(f"the checkpoint's {source.key} was read "
                                f"{_reading(saved['per_rank'], len(saved['ranks']))}, this run reads it "
                                f"{_reading(source.per_rank, self.dp_size)}: a rank's place in its part of the files "
                                f"cannot be carried over; resume with the same data-parallel size, or train from a "
                                f"corpus made by tools/prepare_data.py (it resumes at any size)")
        self.position = self._shares_from = int(state["position"])
        self.steps_done = int(state.get("steps", 0) if steps_done is None else steps_done)
        segments = state.get("segments")  # absent before staged mixtures: one mixture by the sources' weights
        if not segments or any(len(segment["weights"]) != len(self.sources) for segment in segments):
            if segments:
                logger.warning("the checkpoint's data stream mixed %d source(s), this run has %d: its mixture "
                               "restarts from this run's stages at the resumed position (checkpoint.allow_data_change)",
                               len(segments[-1]["weights"]), len(self.sources))
            segments = [{"stage": 0, "first": 0, "weights": list(self.stages[0].weights)}]
        self._use_segments(segments)
        for source in self.sources:
            saved = streams.get(source.key) if isinstance(source, StreamedSource) else None
            if saved is not None:
                source.load_state_dict(saved["ranks"][self.dp_rank if source.per_rank else 0])

    # ------------------------------------------------------------------ validation
    def _aligned_validation(self) -> list[int]:
        """The validation samples' indices, each source's cut to whole micro-batches: every micro-batch then holds
        one source's samples, so the sums of its one forward are that source's (a source's last samples short
        of a micro-batch are left out; none with micro_batch_size 1)."""
        mbs, kept, start = self.cfg.micro_batch_size, [], 0
        while start < len(self.validation):
            end = start
            while end < len(self.validation) and self.validation_sources[end] == self.validation_sources[start]:
                end += 1
            kept.extend(range(start, start + (end - start) // mbs * mbs))
            start = end
        return kept

    def validation_plan(self, max_batches: int) -> list[tuple[MicroBatch, int, bool]]:
        """This rank's validation micro-batches, each with (the data.sources index of its samples or -1, whether
        it counts for the mixture's figures); the same count on every rank (collectives stay matched).

        The mixture's are today's: its first `max_batches` micro-batches per rank in the held-out order. A source
        gets those of its samples plus, up to `max_batches` micro-batches' worth per rank of its own held-out
        samples, micro-batches of its next samples, run only for its own figures; a rank short of one in the
        last round runs its first again, counted for nothing (every rank takes part in each forward)."""
        mbs, dp = self.cfg.micro_batch_size, self.dp_size
        kept = self._aligned_validation()
        count = min(max_batches, len(kept) // (mbs * dp))
        if count == 0:
            return []
        mixture_rows = kept[: count * mbs * dp]
        chunks = [(mixture_rows[(m * dp + r) * mbs: (m * dp + r + 1) * mbs], True)
                  for m in range(count) for r in range(dp)]
        in_mixture = {self.validation_sources[i]: 0 for i in kept}
        for i in mixture_rows:
            in_mixture[self.validation_sources[i]] += 1
        extra: list[list[int]] = []
        for source, taken in in_mixture.items():
            if source < 0:
                continue
            rows = [i for i in kept if self.validation_sources[i] == source]
            wanted = min(len(rows), max_batches * mbs * dp)
            extra.extend(rows[first: first + mbs] for first in range(taken, wanted - mbs + 1, mbs))
        rounds = -(-len(extra) // dp)
        extra += [[]] * (rounds * dp - len(extra))
        chunks += [(rows, False) for rows in extra]
        plan = []
        for index in range(self.dp_rank, len(chunks), dp):
            rows, counted = chunks[index]
            if not rows:  # the filler: this rank's first micro-batch again, counted for nothing
                plan.append((_to_micro_batch([self.validation[i] for i in chunks[self.dp_rank][0]],
                                             self.boundary_id), -1, False))
                continue
            plan.append((_to_micro_batch([self.validation[i] for i in rows], self.boundary_id),
                         self.validation_sources[rows[0]], counted))
        return plan

    def validation_micro_batches(self, max_batches: int) -> list[MicroBatch]:
        """This rank's micro-batches of the mixture's validation; the same count on every rank."""
        return [batch for batch, _, counted in self.validation_plan(max_batches) if counted]

    def check_validation(self, max_batches: int) -> None:
        if not self.validation_micro_batches(max_batches):
            raise DataError(f"the validation split has {len(self.validation)} samples of seq_len + 1 tokens, fewer "
                            f"than one micro-batch per data-parallel rank ({self.cfg.micro_batch_size} x {self.dp_size}); "
                            f"raise data.validation_documents or set train.val_every_n_steps=-1")


def _reading(per_rank: bool, ranks: int) -> str:
    return f"per rank by {ranks} data-parallel ranks (each its own part of the files)" if per_rank else \
        "in full by every rank"


def _gather_objects(value: Any) -> list[Any]:
    """`value` of every rank (in rank order), or [value] when the run is not distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def combine_rank_states(data: PretrainingData, rank_states: list[dict]) -> dict:
    """The checkpoint's data state from every rank's `rank_state()` (tensor-parallel peers hold the same):
    key -> {per_rank, ranks: [state of data-parallel rank 0, 1, ...] when read per rank, else [the one state]}."""
    by_rank = {state["dp_rank"]: state["streams"] for state in rank_states}
    streams = {}
    for source in data.sources:
        if isinstance(source, StreamedSource):
            ranks = range(data.dp_size) if source.per_rank else range(1)
            streams[source.key] = {"per_rank": source.per_rank, "ranks": [by_rank[r][source.key] for r in ranks]}
    return {"position": data.position, "seed": data.cfg.seed, "seq_len": data.cfg.seq_len, "dp_size": data.dp_size,
            "streams": streams, "steps": data.steps_done, "segments": [dict(segment) for segment in data.segments]}
