"""A plain-torch reference of the `del` NTL variant: the Digit Entropy Loss as its authors define it (arXiv
2605.20369 and their training code, github PolyU-VCLab/DEL; docs/loss.md), written from that definition with
Python lists and loops and torch's own `binary_cross_entropy_with_logits`, independent of `ntl_pretrain.loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def del_place_weights(symbols: list[str]) -> list[float | None]:
    """The place weight of each symbol of one run of number labels ('0'..'9' and '.'); None for a '.'.

    The run's decimal point is its first '.', unless the run starts with '.' (then it has none and every digit
    counts as an integer place, the dots included in the count). Before the point a digit `d` places left of it
    (units: 1) weighs `2 d`; after it, the k-th digit weighs `1.02 ** -(k + 1)`."""
    point = symbols.index(".") if "." in symbols else None
    if point == 0:  # a leading '.' is no decimal point
        point = None
    end = len(symbols) if point is None else point
    weights: list[float | None] = []
    for j, symbol in enumerate(symbols):
        if symbol == ".":
            weights.append(None)
        elif j < end:
            weights.append(2.0 * (end - j))
        else:
            weights.append(1.02 ** -((j - point) + 1))
    return weights


def del_reference(logits: torch.Tensor, labels: torch.Tensor, digit_ids: list[int], dot_id: int, *,
                  scale: float = 0.01, runs: str = "batch", loss_weights: torch.Tensor | None = None,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the weighted terms, sum of the weights) of `[B, S, V]` logits against `[B, S]` labels; `digit_ids[d]`
    is the token id of digit d. Unweighted, the quotient is the authors' loss: `scale` times the mean over the
    N digit labels x 10 classes of `place weight * q_k * BCEWithLogits(z_k, [k = digit])`, `z` the ten digit logits
    and `q` their softmax.

    `runs="batch"`: a run is a maximal stretch of digit or '.' labels in the list of the non-ignored labels of the
    flattened batch; `"rows"`: in the list of each row's labels, ignored ones breaking it."""
    symbol_of = {token: str(digit) for digit, token in enumerate(digit_ids)}
    symbol_of[dot_id] = "."
    rows, length = labels.shape
    if runs == "batch":
        sequences = [[(row, at) for row in range(rows) for at in range(length)
                      if int(labels[row, at]) != ignore_index]]
    else:
        sequences = [[(row, at) for at in range(length)] for row in range(rows)]
    total = logits.new_zeros(())
    weight_sum = logits.new_zeros(())
    for sequence in sequences:
        index = 0
        while index < len(sequence):
            if int(labels[sequence[index]]) not in symbol_of:
                index += 1
                continue
            end = index
            while end < len(sequence) and int(labels[sequence[end]]) in symbol_of:
                end += 1
            run = sequence[index:end]
            places = del_place_weights([symbol_of[int(labels[where])] for where in run])
            for where, place in zip(run, places):
                if place is None:
                    continue
                digit_logits = logits[where][digit_ids]
                target = F.one_hot(torch.tensor(int(symbol_of[int(labels[where])])), 10).to(digit_logits.dtype)
                bce = F.binary_cross_entropy_with_logits(digit_logits, target, reduction="none")
                q = torch.softmax(digit_logits, dim=-1)
                weight = 1.0 if loss_weights is None else loss_weights[where]
                total = total + weight * scale * place * (q * bce).sum() / 10
                weight_sum = weight_sum + weight
            index = end
    return total, weight_sum
