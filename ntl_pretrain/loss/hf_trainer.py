"""CE + NTL as the Hugging Face `Trainer`'s `compute_loss_func` (TRL's trainers take the same hook).

The Trainer hands the hook the model's outputs, the UNSHIFTED labels of one micro-batch and
`num_items_in_batch`: the non-ignored shifted labels of the whole accumulated step (over all data-parallel
ranks when `average_tokens_across_devices`). It sums what the hook returns over the step's micro-batches and
does not divide by the accumulation steps. So the hook:

- shifts the labels as transformers' causal-LM loss does (`labels[..., 1:]`, the last position ignored);
- returns `(CE_sum + ntl_weight * NTL_mean * tokens) / num_items_in_batch` for the micro-batch: CE is then the
  mean over every token of the step, exactly transformers' own, and NTL the token-weighted mean of the
  micro-batches' NTL means (the batch's NTL mean when nothing is accumulated). Without `num_items_in_batch`
  (evaluation) it is `ce_ntl_loss` of the micro-batch;
- finds the model's vocabulary shard on every call (`vocab_shard_of`), so an AutoTP vocabulary-parallel
  head that replaces the model's head after the Trainer is built is used, and checks the shard layout and
  labels on its first call only (later calls do no host sync).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..core.numbers import NumberVocab
from .ntl import NTLSettings
from .objective import ce_ntl_sums, safe_mean
from .shard import VocabShard, vocab_shard_of


class HFTrainerLoss:
    """`Trainer(..., compute_loss_func=HFTrainerLoss(number_vocab, model=model, ntl_weight=0.3))`."""

    def __init__(self, number_vocab: NumberVocab, *, model: Any = None, ntl_weight: float = 0.3,
                 settings: NTLSettings = NTLSettings()) -> None:
        if not isinstance(number_vocab, NumberVocab):
            raise TypeError(f"number_vocab must be a NumberVocab (NumberVocab.from_tokenizer(tokenizer)), "
                            f"got {type(number_vocab).__name__}")
        if not ntl_weight >= 0:
            raise ValueError(f"ntl_weight must be >= 0, got {ntl_weight}")
        self.number_vocab = number_vocab
        self.model = model  # None: the logits hold the whole vocabulary
        self.ntl_weight = ntl_weight
        self.settings = settings
        self._checked = False  # the first call checks the shard layout and labels on the host

    def shard(self) -> VocabShard:
        """This rank's vocabulary columns of the model's head now (the whole vocabulary without a model)."""
        return VocabShard() if self.model is None else vocab_shard_of(self.model)

    def __call__(self, outputs: Any, labels: torch.Tensor,
                 num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The micro-batch's loss from the model's `outputs` (`.logits` or `["logits"]`) and its unshifted labels."""
        if labels is None:
            raise ValueError("HFTrainerLoss needs labels: give the Trainer a data collator that sets 'labels' "
                             "(e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False))")
        logits = outputs["logits"] if isinstance(outputs, dict) else getattr(outputs, "logits", outputs)
        ignore_index = self.settings.ignore_index
        shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
        sums = ce_ntl_sums(logits, shifted, self.number_vocab, self.settings, shard=self.shard(),
                           with_ntl=self.ntl_weight != 0, check_inputs=not self._checked)
        self._checked = True
        ntl_mean = safe_mean(sums.ntl_sum, sums.ntl_count)
        if num_items_in_batch is None:
            return safe_mean(sums.ce_sum, sums.token_count) + self.ntl_weight * ntl_mean
        items = torch.as_tensor(num_items_in_batch, device=logits.device, dtype=sums.ce_sum.dtype)
        return (sums.ce_sum + self.ntl_weight * ntl_mean * sums.token_count) / items
