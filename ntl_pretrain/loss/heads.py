"""How a trainer turns a batch into the CE + NTL sums: through the model's full logits or through the chunked LM
head (`chunked.py`). One `LossHead` each, in one table (`LOSS_HEADS`); the objective picks one once, from the
`loss` section (`select_loss_head`: the first entry whose `from_loss` answers), and the training step calls it
without knowing which it is. A new head is one entry, before `full` (which answers every section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from ..core.numbers import NumberVocab
from ..core.options import merged_dataclass, option
from .chunked import CHUNK_BACKWARDS, chunked_model_ce_ntl_sums
from .ntl import NTLSettings
from .objective import ObjectiveSums, ce_ntl_sums
from .shard import VocabShard
from .spans import NumberSpans


class LossHead(Protocol):
    """What the training step calls (`one_step.py`) and the log shows."""

    def sums(self, model: Any, inputs: dict, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings,
             *, shard: VocabShard, with_ntl: bool, check_inputs: bool, spans: NumberSpans | None) -> ObjectiveSums:
        ...

    def describe(self) -> str:
        ...


@dataclass(frozen=True)
class FullLogitsHead:
    """The model's own forward, then the loss on its `[B, S, V_local]` logits (`objective.ce_ntl_sums`)."""

    @classmethod
    def from_loss(cls, loss: Any) -> "FullLogitsHead":
        """Every `loss` section: the head when no other entry answers."""
        return cls()

    def sums(self, model: Any, inputs: dict, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings,
             *, shard: VocabShard, with_ntl: bool, check_inputs: bool, spans: NumberSpans | None) -> ObjectiveSums:
        """The micro-batch's sums: `model(**inputs)` (a DeepSpeed engine or a HF model) against `labels`."""
        return ce_ntl_sums(model(**inputs).logits, labels, number_vocab, settings, shard=shard, with_ntl=with_ntl,
                           check_inputs=check_inputs, spans=spans)

    def describe(self) -> str:
        return "full logits"


ChunkBackward = Literal[CHUNK_BACKWARDS]


@dataclass(frozen=True)
class ChunkedHeadOptions:
    """The `loss` keys of the chunked head."""

    chunk_tokens: int = option("compute LM head + loss over chunks of this many tokens, never the full logits "
                               "(docs/chunked.md; 0 = off)", default=0)
    chunk_backward: ChunkBackward = option(
        "gradient of the chunked head: rows (formed per chunk in forward) | vocab_blocks (logits recomputed per "
        "vocabulary block in backward, DeepSpeed's fused-head scheme) | auto (vocab_blocks for chunks under 1024 "
        "tokens on GPUs, 32 on CPU)", default="auto")


@dataclass(frozen=True)
class ChunkedHead:
    """The model's forward with its LM head computing the loss over `chunk_tokens` rows at a time: the full logits
    never exist (docs/chunked.md)."""

    Options = ChunkedHeadOptions  # its keys of the `loss` section (LossHeadOptions merges every head's)
    chunk_tokens: int  # rows of logits at a time
    backward: str  # the gradient algorithm (chunked.CHUNK_BACKWARDS)

    @classmethod
    def from_loss(cls, loss: Any) -> "ChunkedHead | None":
        """A `loss` section with `chunk_tokens > 0`."""
        return cls(loss.chunk_tokens, loss.chunk_backward) if loss.chunk_tokens > 0 else None

    def sums(self, model: Any, inputs: dict, labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings,
             *, shard: VocabShard, with_ntl: bool, check_inputs: bool, spans: NumberSpans | None) -> ObjectiveSums:
        """As `FullLogitsHead.sums`; the LM head is the model's own (`get_output_embeddings()`, under an engine's
        `.module`)."""
        head = getattr(model, "module", model).get_output_embeddings()
        return chunked_model_ce_ntl_sums(model, head, inputs, labels, number_vocab, settings,
                                         chunk_tokens=self.chunk_tokens, shard=shard, with_ntl=with_ntl,
                                         check_inputs=check_inputs, backward=self.backward, spans=spans)

    def describe(self) -> str:
        return f"chunked LM head ({self.chunk_tokens} tokens a chunk, {self.backward} backward)"


# in the order asked: the first whose `from_loss` gives a head (not None) is the run's; `full` answers every section
LOSS_HEADS: dict[str, type] = {
    "chunked": ChunkedHead,
    "full": FullLogitsHead,
}


@dataclass(frozen=True)
class InputCheckOptions:
    """The `loss` key of every head: how often the labels and the vocabulary-shard layout are checked."""

    check_every_step: bool = option("debug: re-check labels and the vocabulary-shard layout on every micro-batch "
                                    "(host syncs; normally checked once at start-up)", default=False)


# The heads' keys of the `loss` section: each head's own `Options` (in LOSS_HEADS' order), then the input checks
# every head takes; config/schema.py's LossConfig composes them.
LossHeadOptions = merged_dataclass(
    "LossHeadOptions", [*(head.Options for head in LOSS_HEADS.values() if hasattr(head, "Options")),
                        InputCheckOptions], module=__name__,
    doc="The loss heads' keys of the `loss` section: each head's own options, then check_every_step.")


def select_loss_head(loss: Any) -> LossHead:
    """The head a `loss` section (config.LossConfig or any object with its keys) asks for: chunked when
    `loss.chunk_tokens > 0`, else the full logits."""
    for head in LOSS_HEADS.values():
        chosen = head.from_loss(loss)
        if chosen is not None:
            return chosen
    raise ValueError("no loss head answers this loss section (LOSS_HEADS lacks its 'full' entry)")
