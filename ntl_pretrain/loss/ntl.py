"""The NTL terms on the number-token logits only (DESIGN.md section 1), for whichever variant the settings name.

Everything here works on `[n, K]` number-token logits and `[n]` labels, which are identical on every
tensor-parallel rank once `parallel.shard_reductions` has run: this is small replicated math that
plain autograd differentiates. The full-vocabulary part (log-sum-exp for reweighing) arrives as an
input, so the same code serves one device and a vocabulary-sharded head. What differs between variants is
theirs (`variants/`, one module each); this module adds what they share: the loss weights, reweighing and the
masking of rows without a term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.numbers import NumberVocab
from .settings import NTLSettings, check_ntl_weight  # noqa: F401 (also imported from here)
from .spans import NumberSpans, number_spans  # noqa: F401 (likewise)
from .variants import VARIANTS, TermInputs
from .variants.was import distance_table  # noqa: F401 (ntloss's distance lookup, read by the drop-ins)

REWEIGH_MARGIN = 1.01  # a wrong non-number token costs a bit more than the worst number token


def max_distance(number_vocab: NumberVocab, settings: NTLSettings, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The largest per-token NTL a number prediction can cost (the reweigh penalty's base)."""
    return settings.ntl_variant.max_loss(number_vocab, settings, device, dtype)


@dataclass
class NTLTerms:
    """NTL per term (one per number token, or per number for "number_level"), each at its flat position.

    Shapes are those of the labels, whatever the data (no data-dependent sizes, so no host sync): a
    position without a term holds loss 0 and weight 0.
    """

    loss: torch.Tensor  # [n] per-term loss after reweighing, differentiable; 0 where no term sits
    weights: torch.Tensor  # [n] loss weight of each term; 0 where no term sits
    positions: torch.Tensor  # [n] bool: where a term sits


def term_positions(labels: torch.Tensor, number_vocab: NumberVocab, settings: NTLSettings) -> torch.Tensor:
    """`[n]` bool over the flattened labels: where an NTL term sits (each number token, or the first
    digit of each number for "number_level"). Trainers count these to normalise NTL globally."""
    slot = number_vocab.index_of(labels.reshape(-1), settings.ignore_index)
    return settings.ntl_variant.term_positions(slot, labels, number_vocab, settings)


def ntl_terms(number_logits: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
              settings: NTLSettings, *, number_mass: Callable[[], torch.Tensor] | None = None,
              loss_weights: torch.Tensor | None = None, spans: NumberSpans | None = None) -> NTLTerms:
    """Per-term NTL from `[n, K]` number logits and `[B, S]` (or `[n]`) labels aligned with them.

    `number_mass()` (the `[n]` full-vocabulary probability mass on number tokens at every row,
    `ShardStats.number_mass`) is needed when `settings.reweigh` or the variant reads it itself
    (`reads_number_mass`). Every row is computed and the rows without a term are masked (their number logits
    replaced by zeros first, so they get exactly zero gradient): `[n, K]` work with K ~ 10, and no host sync.
    `spans` (variants that read the numbers' spans): the numbers' spans when the labels are a slice of longer
    rows (a sequence shard); default: found in `labels`.
    """
    device, dtype = number_logits.device, number_logits.dtype
    flat_labels = labels.reshape(-1)
    slot = number_vocab.index_of(flat_labels, settings.ignore_index)
    weights_all = (torch.ones(flat_labels.shape, device=device, dtype=dtype) if loss_weights is None
                   else loss_weights.reshape(-1).to(device=device, dtype=dtype))
    variant = settings.ntl_variant
    variant.check_vocab(number_vocab, settings)
    loss, positions = variant.terms(TermInputs(number_logits, labels, slot, number_vocab, settings, spans,
                                               number_mass))
    if settings.reweigh:
        if number_mass is None:
            raise ValueError("reweigh needs the full-vocabulary number-token mass (number_mass)")
        mass = number_mass()
        loss = loss * mass + REWEIGH_MARGIN * max_distance(number_vocab, settings, device, dtype) * (1 - mass)
    return NTLTerms(loss=torch.where(positions, loss, 0.0), weights=torch.where(positions, weights_all, 0.0),
                    positions=positions)


__all__ = ["REWEIGH_MARGIN", "VARIANTS", "NTLSettings", "NTLTerms", "NumberSpans", "check_ntl_weight",
           "distance_table", "max_distance", "ntl_terms", "number_spans", "term_positions"]
