"""`was`: the Wasserstein-1 distance between the predicted distribution over the number tokens and the target
(the paper's default), optionally with a squashed distance or a Gaussian-smoothed target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.numbers import NumberVocab
from ...core.options import check_number, option
from .base import NTLVariant, TermInputs, register

# why smoothing_sigma and squash_factor exclude each other (also what setting smoothing_sigma for another variant says)
SMOOTHING_NEEDS = ("needs variant 'was' without squash_factor (the Wasserstein-1 form on sorted values has no "
                   "squashed distance)")


@dataclass(frozen=True)
class Options:
    """The options of "was"."""

    squash_factor: float | None = option("farthest wrong digit costs this many times the nearest", default=None)
    smoothing_sigma: float = option("Gaussian label smoothing of the target over number values", default=0.0)

    def __post_init__(self) -> None:
        if self.squash_factor is not None:
            check_number(self.squash_factor, "squash_factor", "1 would turn NTL into CE", low=1.0, low_allowed=False)
        check_number(self.smoothing_sigma, "smoothing_sigma", "0 turns label smoothing off")
        if self.smoothing_sigma > 0 and self.squash_factor is not None:
            raise ValueError(f"smoothing_sigma {SMOOTHING_NEEDS}; set squash_factor=None or smoothing_sigma=0")


def distance_table(number_vocab: NumberVocab, squash_factor: float | None, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`D[i, k] = |v_i - v_k|`, optionally squashed so the largest distance is `squash_factor` times the
    smallest non-zero one (zero stays zero). Built once per vocabulary, device and dtype (the range is
    found on the host from the vocabulary's values: no device sync)."""
    def build() -> torch.Tensor:
        values = number_vocab.values_tensor(device, dtype)
        diff = (values[:, None] - values[None, :]).abs()
        if squash_factor is None:
            return diff
        distances = [abs(a - b) for a in number_vocab.values for b in number_vocab.values if a != b]
        if not distances:
            raise ValueError("squash_factor needs at least two distinct number values")
        low, high = min(distances), max(distances)
        scaled = 1 + (diff - low) * ((squash_factor - 1) / (high - low) if high > low else 0.0)
        return torch.where(diff == 0, torch.zeros_like(diff), scaled)

    return number_vocab._cached(("distance_table", squash_factor, torch.device(device), dtype), build)


def wasserstein_smoothed(probs: torch.Tensor, target_values: torch.Tensor, values: torch.Tensor,
                         sigma: float) -> torch.Tensor:
    """1-D Wasserstein-1 distance between `probs` and a Gaussian-smoothed target, on sorted values."""
    order = torch.argsort(values)
    sorted_values = values[order]
    target = torch.softmax(-((sorted_values[None, :] - target_values[:, None]) ** 2) / (2 * sigma**2), dim=-1)
    cdf_gap = (probs[:, order].cumsum(-1) - target.cumsum(-1)).abs()[:, :-1]
    return (cdf_gap * sorted_values.diff()[None, :]).sum(-1)


class Wasserstein(NTLVariant):
    name = "was"
    Options = Options
    misuse = {"smoothing_sigma": SMOOTHING_NEEDS}

    def describe(self, settings) -> list[str]:
        return [f"squash_factor={settings.squash_factor}", f"smoothing_sigma={settings.smoothing_sigma:g}"]

    def max_loss(self, number_vocab, settings, device, dtype) -> torch.Tensor:
        return distance_table(number_vocab, settings.squash_factor, device, dtype).max()

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        settings, number_vocab = inputs.settings, inputs.number_vocab
        positions = inputs.slot >= 0
        target_slot = inputs.slot.clamp_min(0)
        probs = torch.softmax(torch.where(positions[:, None], inputs.number_logits, 0.0), dim=-1)
        if settings.smoothing_sigma > 0:
            values = inputs.values
            return wasserstein_smoothed(probs, values[target_slot], values, settings.smoothing_sigma), positions
        device, dtype = inputs.number_logits.device, inputs.number_logits.dtype
        return (probs * distance_table(number_vocab, settings.squash_factor, device, dtype)[target_slot]).sum(-1), \
            positions


register(Wasserstein())
