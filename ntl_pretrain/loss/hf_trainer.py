"""CE + NTL as the Hugging Face `Trainer`'s `compute_loss_func` (TRL's trainers take the same hook).

The Trainer hands the hook the model's outputs, the UNSHIFTED labels of one micro-batch and
`num_items_in_batch`: the non-ignored shifted labels of the whole accumulated step (over all data-parallel
ranks when `average_tokens_across_devices`). It sums what the hook returns over the step's micro-batches and
does not divide by the accumulation steps. So the hook:

- shifts the labels as transformers' causal-LM loss does (`labels[..., 1:]`, the last position ignored);
- attached to the Trainer (`loss.attach(trainer)`, one line after building it), it counts the NTL terms of the
  whole accumulated step as the Trainer counts its label tokens (the same micro-batches, the same shift, summed
  over devices the same way) and returns `CE_sum / num_items_in_batch + ntl_weight * NTL_sum / step_terms`: CE is
  the mean over every token of the step, exactly transformers' own, and NTL the mean over every NTL term of the
  step, so neither changes with how the step is split into micro-batches (gradient accumulation invariant);
- not attached, it returns `(CE_sum + ntl_weight * NTL_mean * tokens) / num_items_in_batch`: NTL is then the
  label-token-weighted mean of the micro-batches' NTL means, exact without accumulation but not invariant under
  it (micro-batches with few number tokens weigh as much as number-dense ones of the same length). Without
  `num_items_in_batch` (evaluation) it is `ce_ntl_loss` of the micro-batch;
- finds the model's vocabulary shard on every call (`vocab_shard_of`), so an AutoTP vocabulary-parallel
  head that replaces the model's head after the Trainer is built is used, and checks the shard layout and
  labels on its first call only (later calls do no host sync).
"""

from __future__ import annotations

import math

from typing import Any

import torch
import torch.nn.functional as F

from ..core.numbers import NumberVocab
from .ntl import NTLSettings, check_ntl_weight, term_positions
from .objective import ce_ntl_sums, safe_mean
from .shard import VocabShard, vocab_shard_of


class HFTrainerLoss:
    """`loss = HFTrainerLoss(number_vocab, model=model, ntl_weight=0.3)`, then
    `trainer = Trainer(..., compute_loss_func=loss)` and `loss.attach(trainer)` (gradient accumulation invariant)."""

    def __init__(self, number_vocab: NumberVocab, *, model: Any = None, ntl_weight: float = 0.3,
                 settings: NTLSettings = NTLSettings()) -> None:
        if not isinstance(number_vocab, NumberVocab):
            raise TypeError(f"number_vocab must be a NumberVocab (NumberVocab.from_tokenizer(tokenizer)), "
                            f"got {type(number_vocab).__name__}")
        ntl_weight = check_ntl_weight(ntl_weight)
        if not isinstance(settings, NTLSettings):
            raise TypeError(f"settings must be an NTLSettings (NTLSettings(variant='was', ...)), got "
                            f"{type(settings).__name__}")
        self.number_vocab = number_vocab
        self.model = model  # None: the logits hold the whole vocabulary
        self.ntl_weight = ntl_weight
        self.settings = settings
        self._checked = False  # the first call checks the shard layout and labels on the host
        self._step_terms: torch.Tensor | None = None  # NTL terms of the current step (set when attached)
        self._attached = False

    def shard(self) -> VocabShard:
        """This rank's vocabulary columns of the model's head now (the whole vocabulary without a model)."""
        return VocabShard() if self.model is None else vocab_shard_of(self.model)

    def _shifted(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels aligned with the logits, as transformers' causal-LM loss shifts them (the last position ignored)."""
        return F.pad(labels, (0, 1), value=self.settings.ignore_index)[..., 1:]

    def attach(self, trainer: Any) -> "HFTrainerLoss":
        """Normalise NTL by the NTL terms of the whole accumulated step (see the module): wraps the Trainer's
        `get_batch_samples` (transformers 5: it collects a step's micro-batches and counts their label tokens) to
        count the step's terms too, on the device (no host sync). Returns self."""
        if self._attached:
            return self
        collect = trainer.get_batch_samples

        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
            batch_samples, num_items_in_batch = collect(epoch_iterator, num_batches, device)
            self._step_terms = None if num_items_in_batch is None else self._count_step_terms(trainer, batch_samples,
                                                                                               device)
            return batch_samples, num_items_in_batch

        trainer.get_batch_samples = get_batch_samples
        self._attached = True
        return self

    def _count_step_terms(self, trainer: Any, batch_samples: list, device: Any) -> torch.Tensor:
        """The step's NTL terms, counted and reduced as transformers counts `num_items_in_batch`."""
        count = torch.zeros((), dtype=torch.float32, device=device)
        for batch in batch_samples:
            labels = batch.get("shift_labels")
            if labels is None:
                labels = self._shifted(batch["labels"])
            count = count + term_positions(labels.to(device), self.number_vocab, self.settings).sum()
        args = trainer.args
        if args.average_tokens_across_devices and args.world_size > 1:
            count = trainer.accelerator.gather(count.reshape(1)).sum()
        sharing = 1
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):  # devices that see the same batch
            size = getattr(trainer, name, None)
            sharing *= int(size()) if callable(size) else 1
        return count / sharing

    def __call__(self, outputs: Any, labels: torch.Tensor,
                 num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The micro-batch's loss from the model's `outputs` (`.logits` or `["logits"]`) and its unshifted labels."""
        if labels is None:
            raise ValueError("HFTrainerLoss needs labels: give the Trainer a data collator that sets 'labels' "
                             "(e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False))")
        logits = outputs["logits"] if isinstance(outputs, dict) else getattr(outputs, "logits", outputs)
        if torch.is_tensor(logits) and torch.is_tensor(labels) and tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                             f"HFTrainerLoss takes the Trainer's unshifted labels, one per logit row (shape "
                             f"{tuple(logits.shape[:-1])}), and shifts them itself")
        shifted = self._shifted(labels).to(logits.device)
        sums = ce_ntl_sums(logits, shifted, self.number_vocab, self.settings, shard=self.shard(),
                           with_ntl=self.ntl_weight != 0, check_inputs=not self._checked)
        self._checked = True
        ntl_mean = safe_mean(sums.ntl_sum, sums.ntl_count)
        if num_items_in_batch is None:
            return safe_mean(sums.ce_sum, sums.token_count) + self.ntl_weight * ntl_mean
        if not torch.is_tensor(num_items_in_batch) and (
                isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float))
                or not math.isfinite(num_items_in_batch) or num_items_in_batch < 0):
            raise ValueError(f"num_items_in_batch must be a count of label tokens (>= 0), got "
                             f"{type(num_items_in_batch).__name__} {num_items_in_batch!r}; pass what the Trainer passes, "
                             f"or None for the micro-batch's mean")
        items = torch.as_tensor(num_items_in_batch, device=logits.device, dtype=sums.ce_sum.dtype)
        items = items.masked_fill(items == 0, 1.0)  # as `safe_mean`: labels all ignored give 0, not 0/0 = nan
        if self._step_terms is not None:  # attached: the mean over every NTL term of the step
            step_terms = self._step_terms.to(device=logits.device, dtype=sums.ce_sum.dtype)
            return sums.ce_sum / items + self.ntl_weight * sums.ntl_sum / step_terms.clamp_min(1.0)
        return (sums.ce_sum + self.ntl_weight * ntl_mean * sums.token_count) / items


def without_targets_after_padding(collator: Any) -> Any:
    """A data collator whose batches have no target right after a pad position: with LEFT padding (decoder models'
    usual side for generation), transformers' `DataCollatorForLanguageModeling` ignores the pads' labels but keeps
    each padded row's first real token as a target, predicted from a pad position. Whether a row is padded depends
    on the micro-batch it lands in, so those targets, `num_items_in_batch` and the update change with gradient
    accumulation (and teach nothing). This sets the labels after a pad (`attention_mask` 0) to -100; with right
    padding (transformers' default) or padding-free packing there are none and nothing changes."""

    def collate(features: Any) -> Any:
        batch = collator(features)
        mask = batch.get("attention_mask")
        if mask is not None and "labels" in batch:
            after_pad = torch.zeros_like(mask, dtype=torch.bool)
            after_pad[:, 1:] = mask[:, :-1] == 0
            batch["labels"] = batch["labels"].masked_fill(after_pad, -100)
        return batch

    return collate
