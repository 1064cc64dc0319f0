"""How a trainer turns a batch into the CE + NTL sums: through the model's full logits or through the chunked LM
head (`chunked.py`). One `LossHead` each, in one table (`LOSS_HEADS`); the objective picks one once, from the
`loss` section (`select_loss_head`: the first entry whose `from_loss` answers), and the training step calls it
without knowing which it is. A new head is one entry, before `full` (which answers every section)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..core.numbers import NumberVocab
from .chunked import chunked_model_ce_ntl_sums
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


@dataclass(frozen=True)
class ChunkedHead:
    """The model's forward with its LM head computing the loss over `chunk_tokens` rows at a time: the full logits
    never exist (docs/chunked.md)."""

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


def select_loss_head(loss: Any) -> LossHead:
    """The head a `loss` section (config.LossConfig or any object with its keys) asks for: chunked when
    `loss.chunk_tokens > 0`, else the full logits."""
    for head in LOSS_HEADS.values():
        chosen = head.from_loss(loss)
        if chosen is not None:
            return chosen
    raise ValueError("no loss head answers this loss section (LOSS_HEADS lacks its 'full' entry)")
