"""Drop-in replacements for the classes of `ntloss` 0.3 (`NTLoss`, `NTLossDotProduct`,
`NumberLevelLoss`): same constructor arguments, same call, same results, so that switching is a
change of import. They are thin front-ends over `number_token_loss`, which also runs on
vocabulary-parallel logit shards.

Differences, on purpose: the tokenizer is never modified (ntloss adds missing digit tokens to it
silently; here a tokenizer without the ten digits is an error that says how to fix it), logits may be
wider than the tokenizer (a padded vocabulary), and the maths runs in float32 whatever the logits'
dtype, so the loss is returned in float32.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..numbers import NumberVocab
from .ntl import NTLSettings, max_distance
from .objective import number_token_loss

_LP_VARIANTS: dict[Callable, str] = {F.mse_loss: "mse", F.l1_loss: "mae", F.huber_loss: "huber",
                                     F.smooth_l1_loss: "huber"}


class _NTLossBase:
    """Common front-end: holds the number vocabulary and the settings, calls `number_token_loss`."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, digit_level: bool, settings: NTLSettings) -> None:
        self.tokenizer = tokenizer
        self.number_vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=digit_level, vocab_size=vocab_size)
        self.vocab_size = self.number_vocab.vocab_size
        self.digit_level = digit_level
        self.settings = settings
        self.reweigh = settings.reweigh
        self.number_token_ids = self.number_vocab.ids_tensor()
        self.number_values_dense = self.number_vocab.values_tensor()
        self.max_dist = max_distance(self.number_vocab, settings, torch.device("cpu"))

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None,
                reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
        """NTL of `[B, T, V]` logits against `[B, T]` labels (already aligned with the logits)."""
        if logits.dim() != 3:
            raise ValueError(f"logits must be a [batch, sequence, vocab] tensor, got shape {tuple(logits.shape)}")
        s = self.settings
        return number_token_loss(logits, labels, self.number_vocab, variant=s.variant, reweigh=s.reweigh,
                                 squash_factor=s.squash_factor, loss_weights=loss_weights, reduction=reduction,
                                 ignore_index=ignore_index, float_level=s.float_level,
                                 max_number_digits=s.max_number_digits)

    __call__ = forward


class NTLoss(_NTLossBase):
    """NTL-WAS (Wasserstein-1 between the predicted distribution over number tokens and the target)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, digit_level: bool = True,
                 reweigh: bool = True, squash_factor: float | None = None) -> None:
        super().__init__(tokenizer, vocab_size, digit_level,
                         NTLSettings(variant="was", reweigh=reweigh, squash_factor=squash_factor))
        self.squash_factor = squash_factor


class NTLossDotProduct(_NTLossBase):
    """NTL-Lp: a regression loss between the expected number and the true one."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, digit_level: bool = True,
                 reweigh: bool = True, loss_function: Callable = F.mse_loss) -> None:
        variant = _LP_VARIANTS.get(loss_function)
        if variant is None:
            raise ValueError(f"loss_function {getattr(loss_function, '__name__', loss_function)!r} is not supported; "
                             f"use torch.nn.functional.mse_loss, l1_loss, huber_loss or smooth_l1_loss")
        super().__init__(tokenizer, vocab_size, digit_level, NTLSettings(variant=variant, reweigh=reweigh))
        self.loss_function = loss_function


class NumberLevelLoss(_NTLossBase):
    """Number-level NTL: digits of a number combined, symmetric MAPE per number."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, float_level: bool = False,
                 reweigh: bool = True, max_number_length: int = 20) -> None:
        super().__init__(tokenizer, vocab_size, True,
                         NTLSettings(variant="number_level", reweigh=reweigh, float_level=float_level,
                                     max_number_digits=max_number_length))
        self.float_level = float_level
        self.max_number_length = max_number_length
