"""A plain-torch reference of the `digit_entropy` NTL variant (docs/loss.md), written from its definition with
Python loops and torch's own `binary_cross_entropy`, independent of `ntl_pretrain.loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def digit_entropy_reference(logits: torch.Tensor, labels: torch.Tensor, digit_ids: list[int], *,
                            loss_weights: torch.Tensor | None = None,
                            max_number_digits: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the weighted terms, sum of the weights) of `[B, S, V]` logits against `[B, S]` labels;
    `digit_ids[d]` is the token id of digit d. A number is a maximal run of digit labels in a row; its digit j
    places from the right has place j (at most max_number_digits - 1)."""
    digit_of = {token: digit for digit, token in enumerate(digit_ids)}
    total = logits.new_zeros(())
    weight_sum = logits.new_zeros(())
    for row in range(labels.shape[0]):
        position = 0
        while position < labels.shape[1]:
            if int(labels[row, position]) not in digit_of:
                position += 1
                continue
            end = position
            while end < labels.shape[1] and int(labels[row, end]) in digit_of:
                end += 1
            for at in range(position, end):
                place = min(end - 1 - at, max_number_digits - 1)
                digit_logits = logits[row, at, digit_ids]
                q = torch.softmax(digit_logits, dim=-1)
                target = F.one_hot(torch.tensor(digit_of[int(labels[row, at])]), len(digit_ids)).to(q.dtype)
                bce = F.binary_cross_entropy(q, target, reduction="sum")
                mass = torch.softmax(logits[row, at], dim=-1)[digit_ids].sum().detach()
                weight = 1.0 if loss_weights is None else loss_weights[row, at]
                total = total + weight * (1 + place) * mass * bce
                weight_sum = weight_sum + weight
            position = end
    return total, weight_sum
