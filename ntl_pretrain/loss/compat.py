"""Drop-in replacements for the classes of `ntloss` 0.3 (`NTLoss`, `NTLossDotProduct`,
`NumberLevelLoss`): same constructor arguments, same call, same results, so that switching is a
change of import. They are thin front-ends over `number_token_loss`, which also runs on
vocabulary-parallel logit shards. What users of ntloss read is here too: `predict_numbers` (the
expected-value readout of `NTLossDotProduct` and `NumberLevelLoss`), `number_token_ids`,
`number_values_dense`, `number_values`, `is_number_token`, `max_dist`, and `NTLoss`'s distance lookup
`dist_lookup` / `vocab_to_dist_idx`. ntloss's test suite, ported, runs against these classes
(tests/test_ntloss_suite.py).

Differences, on purpose (docs/loss.md, "Differences from ntloss"):

- the tokenizer is never modified (ntloss adds missing digit tokens to it silently; here a tokenizer
  without the ten digits is an error that says how to fix it);
- logits may be wider than the tokenizer (a padded vocabulary); ntloss requires the width to equal
  `vocab_size` exactly;
- the maths runs in max(float32, the logits' dtype), so losses and readouts are float32 for bf16/fp16/fp32
  logits and float64 for float64 logits (ntloss: the logits' dtype, bf16 included);
- a bad `squash_factor` (<= 1) raises `ValueError`, not ntloss's `AssertionError` (which `python -O`
  strips);
- ntloss's private helpers (`_validate_inputs`, `_prepare_number_token_targets`, `_get_dot_product`,
  `_apply_reduction`, `reweigh_fn`, `setup_distance_lookup`, `setup_max_dist`,
  `convert_digits_to_numbers`) are not provided: they work on ntloss's NaN-marked per-position
  tensors, an internal layout this implementation does not have.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, distance_table, max_distance
from .objective import ntl_with_settings
from .parallel import shard_reductions

_LP_VARIANTS: dict[Callable, str] = {F.mse_loss: "mse", F.l1_loss: "mae", F.huber_loss: "huber",
                                     F.smooth_l1_loss: "huber"}


class _NTLossBase:
    """Common front-end: holds the number vocabulary and the settings, calls `number_token_loss`'s maths
    (`ntl_with_settings`) with them."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, digit_level: bool, settings: NTLSettings) -> None:
        self.tokenizer = tokenizer
        self.number_vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=digit_level, vocab_size=vocab_size)
        self.vocab_size = self.number_vocab.vocab_size
        self.digit_level = digit_level
        self.settings = settings
        self.reweigh = settings.reweigh
        self.number_token_ids = self.number_vocab.ids_tensor()
        self.number_values_dense = self.number_vocab.values_tensor()
        # ntloss's per-vocabulary views: a mask of the number tokens and their values (NaN elsewhere)
        self.is_number_token = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.is_number_token[self.number_token_ids] = True
        self.number_values = torch.full((self.vocab_size,), float("nan"))
        self.number_values[self.number_token_ids] = self.number_values_dense
        self.max_dist = max_distance(self.number_vocab, settings, torch.device("cpu"))

    def _check_logits(self, logits: torch.Tensor) -> None:
        if logits.dim() != 3:
            raise ValueError(f"logits must be a [batch, sequence, vocab] tensor, got shape {tuple(logits.shape)}")

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor | None = None,
                reduction: str = "mean", ignore_index: int = -100) -> torch.Tensor:
        """NTL of `[B, T, V]` logits against `[B, T]` labels (already aligned with the logits)."""
        self._check_logits(logits)
        return ntl_with_settings(logits, labels, self.number_vocab, self.settings, loss_weights=loss_weights,
                                 reduction=reduction, ignore_index=ignore_index)

    __call__ = forward


class NTLoss(_NTLossBase):
    """NTL-WAS (Wasserstein-1 between the predicted distribution over number tokens and the target)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, digit_level: bool = True,
                 reweigh: bool = True, squash_factor: float | None = None) -> None:
        super().__init__(tokenizer, vocab_size, digit_level,
                         NTLSettings(variant="was", reweigh=reweigh, squash_factor=squash_factor))
        self.squash_factor = squash_factor
        # ntloss's distance lookup: dist_lookup[k, j] is the (squashed) distance between the values of number
        # tokens k and j; vocab_to_dist_idx maps a vocabulary id to its row k (-1 for other tokens)
        self.dist_lookup = distance_table(self.number_vocab, squash_factor, torch.device("cpu"))
        self.vocab_to_dist_idx = self.number_vocab.index_of(torch.arange(self.vocab_size))


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

    def predict_numbers(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ntloss's readout at every position of `[B, T, V]` logits (not only where a label is a number):
        the expected number `softmax(logits[number tokens]) @ values` and the probability mass the
        full-vocabulary softmax puts on the number tokens, each `[B, T]` in max(float32, the logits' dtype) and
        differentiable."""
        self._check_logits(logits)
        if logits.shape[-1] < self.vocab_size:
            raise ValueError(f"the logits have {logits.shape[-1]} columns, fewer than vocab_size={self.vocab_size}: "
                             f"the model's vocabulary is smaller than the tokenizer's; resize its embeddings "
                             f"(tools/tokenizer.py resize-model)")
        flat = logits.reshape(-1, logits.shape[-1])
        stats = shard_reductions(flat, self.number_vocab, need_lse=True)
        values = self.number_vocab.values_tensor(logits.device, stats.number_logits.dtype)
        expected = torch.softmax(stats.number_logits, dim=-1) @ values
        mass = stats.number_mass(torch.arange(flat.shape[0], device=logits.device))
        return expected.view(logits.shape[:-1]), mass.view(logits.shape[:-1])


class NumberLevelLoss(NTLossDotProduct):
    """Number-level NTL: digits of a number combined, symmetric MAPE per number (digit-level only, as in
    ntloss). A subclass of `NTLossDotProduct` as in ntloss; `predict_numbers` is the per-digit readout."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, float_level: bool = False,
                 reweigh: bool = True, max_number_length: int = 20) -> None:
        _NTLossBase.__init__(self, tokenizer, vocab_size, True,
                             NTLSettings(variant="number_level", reweigh=reweigh, float_level=float_level,
                                         max_number_digits=max_number_length))
        self.float_level = float_level
        self.max_number_length = max_number_length
