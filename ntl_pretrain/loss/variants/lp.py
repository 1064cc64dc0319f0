"""`mse`, `mae`, `huber`: a regression loss between the expected number `sum_k q_k v_k` and the true one."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .base import NTLVariant, TermInputs, register


class Regression(NTLVariant):
    """NTL-Lp with `function(prediction, target)` per term."""

    def __init__(self, name: str, function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 torch_losses: tuple[Callable, ...]) -> None:
        self.name = name
        self.function = function
        self.torch_losses = torch_losses  # the torch.nn.functional losses ntloss's NTLossDotProduct takes for it

    def max_loss(self, number_vocab, settings, device, dtype) -> torch.Tensor:
        values = number_vocab.values_tensor(device, dtype)
        span = (values.max() - values.min())[None]
        return self.function(span, torch.zeros_like(span))[0]

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        positions = inputs.slot >= 0
        values = inputs.values
        probs = torch.softmax(torch.where(positions[:, None], inputs.number_logits, 0.0), dim=-1)
        return self.function(probs @ values, values[inputs.slot.clamp_min(0)]), positions


register(Regression("mse", lambda p, t: F.mse_loss(p, t, reduction="none"), (F.mse_loss,)))
register(Regression("mae", lambda p, t: F.l1_loss(p, t, reduction="none"), (F.l1_loss,)))
register(Regression("huber", lambda p, t: F.huber_loss(p, t, reduction="none", delta=1.0),
                    (F.huber_loss, F.smooth_l1_loss)))
