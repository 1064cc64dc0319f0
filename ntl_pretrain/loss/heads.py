"""How a trainer turns a batch into the CE + NTL sums: through the model's full logits or through the chunked LM
head (`chunked.py`). One `LossHead` each, in one table (`LOSS_HEADS`); the objective picks one once, from the
`loss` section (`select_loss_head`), and the training step calls it without knowing which it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.numbers import NumberVocab
from .chunked import chunked_model_ce_ntl_sums
from .ntl import NTLSettings
from .objective import ObjectiveSums, ce_ntl_sums
from .shard import VocabShard
from .spans import NumberSpans


@dataclass(frozen=True)
class FullLogitsHead:
    """The model's own forward, then the loss on its `[B, S, V_local]` logits (`objective.ce_ntl_sums`)."""

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


LossHead = FullLogitsHead | ChunkedHead
LOSS_HEADS: dict[str, type] = {"full": FullLogitsHead, "chunked": ChunkedHead}


def select_loss_head(chunk_tokens: int, chunk_backward: str) -> LossHead:
    """The head the `loss` section asks for: chunked when `loss.chunk_tokens > 0`, else the full logits."""
    if chunk_tokens > 0:
        return LOSS_HEADS["chunked"](chunk_tokens, chunk_backward)
    return LOSS_HEADS["full"]()
