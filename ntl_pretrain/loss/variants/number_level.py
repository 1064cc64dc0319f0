"""`number_level`: the digits of a number combined (`sum digit x 10^place`), symmetric MAPE per number, its term on
the number's first digit (ntloss's NumberLevelLoss; digit-level vocabularies only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.options import check_flag, option
from .base import NTLVariant, SpanOptions, TermInputs, label_spans, register


@dataclass(frozen=True)
class Options(SpanOptions):
    """The options of "number_level"."""

    float_level: bool = option("a '.' between digits joins them into one number", default=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_flag(self.float_level, "float_level")


class NumberLevel(NTLVariant):
    name = "number_level"
    Options = Options
    single_digits_because = "composes numbers from single-digit tokens"
    needs_spans = True

    def check_vocab(self, number_vocab, settings) -> None:
        super().check_vocab(number_vocab, settings)
        if settings.float_level and number_vocab.decimal_point_id is None:
            raise ValueError("float_level number-level NTL needs the '.' token id: the tokenizer has no '.' token "
                             "(NumberVocab.decimal_point_id is None)")

    def max_loss(self, number_vocab, settings, device, dtype) -> torch.Tensor:
        return torch.tensor(1.0, device=device, dtype=dtype)  # symmetric MAPE is bounded by 1

    def term_positions(self, slot, labels, number_vocab, settings) -> torch.Tensor:
        return label_spans(slot, labels, number_vocab, settings).is_start

    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        slot, values = inputs.slot, inputs.values
        dtype = values.dtype
        spans = inputs.number_spans()
        digits = slot >= 0
        probs = torch.softmax(torch.where(digits[:, None], inputs.number_logits, 0.0), dim=-1)
        scale = torch.where(digits, torch.pow(10.0, spans.place.to(dtype)), 0.0)
        number_slot = spans.segment + 1  # slot 0: positions outside any number (their scale is 0)
        # row 0: the expected value of each number, row 1: its true value
        sums = values.new_zeros(2, spans.n_segments + 1).index_add(
            1, number_slot, torch.stack([probs @ values * scale, values[slot.clamp_min(0)] * scale]))
        expected, true = (sums if spans.combine is None else spans.combine(sums)).unbind()
        per_number = (expected - true).abs() / (expected.abs() + true.abs() + torch.finfo(dtype).eps)
        return per_number[number_slot], spans.is_start  # each number's term at its first digit (masked later)


register(NumberLevel())
