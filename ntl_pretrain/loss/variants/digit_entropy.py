"""`digit_entropy`: a digit-entropy place-value term in the spirit of DEL (arXiv 2605.20369).

At every label position that holds a digit, with `q = softmax` over the ten digit logits (the number-token
logits; a digit-level vocabulary), the term is

    (1 + place) * mass * BCE,   BCE = -sum_k [y_k log q_k + (1 - y_k) log(1 - q_k)],

`y` the one-hot target digit, each log clamped at -100 (as `torch.nn.functional.binary_cross_entropy`), `place`
the digit's power of ten within its number (units 0; at most `max_number_digits - 1`; found on the whole rows, so
a sequence shard passes their spans) and `mass` the full-vocabulary probability on the digit tokens at that
position, detached (a weight: lowering it cannot lower the loss). The terms are averaged over the digit positions
like the other token-level variants (weighted by `loss_weights`). Everything is computed from the replicated number
logits and the mass, so vocabulary-sharded logits give the same result. docs/loss.md has the definition.
"""

from __future__ import annotations

import math

import torch

from .base import NTLVariant, SpanOptions, TermInputs, register

LOG_FLOOR = -100.0  # log q and log(1 - q) are clamped here, as torch's binary_cross_entropy does


class DigitEntropy(NTLVariant):
    name = "digit_entropy"
    Options = SpanOptions
    single_digits_because = "scores each digit position over the ten single-digit tokens"
    needs_spans = True  # the place values
    reads_number_mass = True

    def check(self, settings) -> None:
        if settings.reweigh:
            raise ValueError("reweigh does not apply to variant 'digit_entropy': its terms are weighted by the "
                             "number-token mass already, and binary cross-entropy has no largest value for the "
                             "reweigh penalty; set reweigh=False")

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.number_mass is None:
            raise ValueError("variant 'digit_entropy' needs the full-vocabulary number-token mass (number_mass)")
        positions = inputs.slot >= 0
        log_q = torch.log_softmax(torch.where(positions[:, None], inputs.number_logits, 0.0), dim=-1)
        # log(1 - q) from log q: -expm1 keeps 1 - q precise where q is close to 1
        log_not_q = torch.log((-torch.expm1(log_q)).clamp_min(math.exp(LOG_FLOOR)))
        # the one-hot target by comparison: F.one_hot reads its input's range on the host (a sync per call)
        target = inputs.slot[:, None] == torch.arange(log_q.shape[-1], device=log_q.device)
        bce = -torch.where(target, log_q.clamp_min(LOG_FLOOR), log_not_q).sum(-1)
        place_weight = 1 + inputs.number_spans().place.to(log_q.dtype)
        return place_weight * inputs.number_mass().detach() * bce, positions


register(DigitEntropy())
