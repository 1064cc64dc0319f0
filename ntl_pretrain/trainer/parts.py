"""The trainer's typed pieces, each with one owner (docs/architecture.md, "The trainer"):

- `TrainerParts` (frozen): what start-up builds, once (`startup.start`); the trainer and its job modules read it.
- `TrainingState`: what the optimizer steps change (step, tokens seen); only `advance` (one step) and `restore` (a
  resume) change it.
- `RunRecord`: what the run reports at its end (the run summary); each field has one writer, named beside it.
- `StepHooks` (frozen): the step's public extension points for benchmarks, tools and tests; the run itself keeps
  the defaults. `Trainer.with_hooks` replaces some for a block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager

if TYPE_CHECKING:  # annotations only (deepspeed and the trackers load with the engine, not with this module)
    import torch

    from ..checkpoint import CheckpointManager
    from ..config import Config
    from ..core.numbers import NumberVocab
    from ..data import MicroBatch, PretrainingData
    from ..loss.sequence_shard import SequenceShard
    from ..loss.shard import VocabShard
    from ..models.build import ModelReport
    from ..observability.monitor import Monitor
    from ..observability.throughput import ThroughputWindow
    from ..parallel.layout import ParallelGroups, ParallelLayout
    from ..parallel.ulysses import UlyssesAttention
    from ..runtime.lifecycle import RunLock
    from .preemption import PreemptionHandler
    from .step_guard import NonfiniteGuard
    from .training_objective import Objective


@dataclass(frozen=True)
class TrainerParts:
    """What start-up builds for one run on this process (`startup.start`), handed to the `Trainer` whole.

    Frozen: a part is never swapped behind the trainer's back; a benchmark that compares two objectives (or two
    document masks) swaps it for a block with `Trainer.with_parts`."""

    cfg: Config  # the resolved configuration (tp_size=auto and a user's DeepSpeed JSON applied), never changed
    ds_config: dict[str, Any]  # the DeepSpeed config as handed to deepspeed.initialize
    objective: Objective  # what a step optimises (NTL on/off, its weight schedule, the LM head)
    layout: ParallelLayout  # sizes and ranks
    groups: ParallelGroups  # every process group a reduction uses
    device: torch.device
    tokenizer: Any  # a transformers tokenizer
    data: PretrainingData  # the training stream and the held-out samples
    engine: Any  # the DeepSpeed engine
    model_report: ModelReport
    number_vocab: NumberVocab  # sized to the model's vocabulary
    vocab_shard: VocabShard  # this rank's columns of the LM head
    ulysses: UlyssesAttention | None  # DeepSpeed's Ulysses attention (parallel.sp_size > 1), else None
    sequence: SequenceShard  # this rank's slice of every row (the whole row without sequence parallelism)
    document_eos_id: int | None  # the EOS that ends each packed document under data.document_mask, else None
    checkpoints: CheckpointManager
    nonfinite: NonfiniteGuard  # the step guard: counts skipped updates, stops the run at the limit
    preemption: PreemptionHandler  # stop signals
    lock: RunLock  # one run per output folder (held by global rank 0)
    monitor: Monitor  # logging, TensorBoard and the trackers
    window: ThroughputWindow  # the logged step time, tokens/s and FLOP/s
    tensorboard_dir: str


class TrainingState:
    """What the optimizer steps change: the step (0 before the first; numbering from 1), the tokens trained on
    (all ranks together) and where this process started (0, or the step a resume restored). Read its properties;
    `advance` (`one_step.train_step`) and `restore` (`checkpointing.resume`) are the only writers."""

    __slots__ = ("_step", "_tokens_seen", "_start_step", "_inputs_checked")

    def __init__(self) -> None:
        self._step = 0
        self._tokens_seen = 0
        self._start_step = 0
        self._inputs_checked = False

    @property
    def step(self) -> int:
        """The optimizer steps done."""
        return self._step

    @property
    def tokens_seen(self) -> int:
        """The tokens of the steps done, summed over the data-parallel ranks."""
        return self._tokens_seen

    @property
    def start_step(self) -> int:
        """The step this process started at (a resume's step, else 0)."""
        return self._start_step

    def advance(self, tokens: int) -> int:
        """One optimizer step done, of `tokens` tokens (all ranks); returns the new step."""
        self._step += 1
        self._tokens_seen += tokens
        return self._step

    def restore(self, step: int, tokens_seen: int) -> None:
        """The step and tokens of a checkpoint this process resumes from (before its first step)."""
        self._step = self._start_step = step
        self._tokens_seen = tokens_seen

    def checks_inputs(self, every_step: bool) -> bool:
        """Whether this forward runs the loss's host checks: the first of the process, or every one with
        `every_step` (loss.check_every_step)."""
        first = not self._inputs_checked
        self._inputs_checked = True
        return every_step or first


@dataclass
class RunRecord:
    """What the run's summary reports (`Trainer.summary`). Each field has one writer, named beside it."""

    started: float  # the run's start (time.time() scale): the command's, else this process's (Trainer)
    stopped_by: str | None = None  # the signal that stopped the run early, None: ran to its end (the fit loop)
    last_scalars: dict[str, float] = field(default_factory=dict)  # the last logging step's figures (the fit loop)
    last_logged_step: int = 0  # (the fit loop)
    last_validation: dict[str, float] = field(default_factory=dict)  # (evaluation.log_validation)
    saved_tag: str | None = None  # the newest checkpoint committed (checkpointing)
    export_dir: str | None = None  # the Hugging Face export (checkpointing.export_final)


def _no_window() -> ContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepHooks:
    """The step's public extension points (`Trainer.hooks`; `Trainer.with_hooks` replaces some for a block).

    - `micro_batches(grad_accum_steps)`: this rank's micro-batches of the next optimizer step; None: the data
      stream's (`PretrainingData.next_step`). A test feeds a fixed batch here.
    - `around_micro_batch()`: a context manager entered around each micro-batch's forward, loss and backward (of
      a validation: its forward); a tool marks the micro-batch windows or counts host syncs inside them.
    - `after_step(state)`: called after each optimizer step (`Trainer.train_step`), with the advanced state.
    """

    micro_batches: Callable[[int], list[MicroBatch]] | None = None
    around_micro_batch: Callable[[], ContextManager[Any]] = _no_window
    after_step: Callable[[TrainingState], None] | None = None
