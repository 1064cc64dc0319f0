"""What an NTL variant is (`NTLVariant`) and the one table of them (`REGISTRY`).

A variant owns everything that differs between NTL variants: its options (`Options`, a small frozen dataclass: each
field with its default, a one-line doc and its check; `NTLSettings`, `number_token_loss`'s keywords and the config's
`loss.*` keys are built from them, and any other variant's option must keep its default), its checks that involve
the shared settings (`check`) and the number vocabulary, its per-term loss (`terms`), where its terms sit
(`term_positions`), its largest per-term loss (the base of the reweigh penalty) and its part of the settings'
one-line description. The loss functions, the chunked head, the vocabulary-parallel path, the ntloss drop-ins and
the config read this table; adding a variant is one module in this package that calls `register` (the package
imports every module in it) and its test.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...core.numbers import NumberVocab
from ...core.options import check_whole_number, option
from ..spans import MAX_NUMBER_DIGITS, NumberSpans, number_spans, rows_of

NTLSettings = Any  # loss.settings.NTLSettings, which reads this registry: named here, not imported (no circle)


@dataclass
class TermInputs:
    """What a variant's terms are computed from: replicated `[n, K]` number logits and the labels' number slots."""

    number_logits: torch.Tensor  # [n, K] in the compute dtype (max(float32, the logits' dtype))
    labels: torch.Tensor  # [B, S] (or [n]) labels aligned with the rows
    slot: torch.Tensor  # [n] index of each label in the number vocabulary, -1 for other labels
    number_vocab: NumberVocab
    settings: NTLSettings
    spans: NumberSpans | None  # the numbers' spans when the labels are a slice of longer rows; None: found here
    number_mass: Callable[[], torch.Tensor] | None  # [n] full-vocabulary mass on the number tokens (None: not computed)

    @property
    def values(self) -> torch.Tensor:
        """`[K]` the number tokens' values, in the logits' compute dtype."""
        return self.number_vocab.values_tensor(self.number_logits.device, self.number_logits.dtype)

    def number_spans(self) -> NumberSpans:
        """Where the numbers sit: the given spans, or those of `labels`."""
        if self.spans is not None:
            return self.spans
        return self.settings.ntl_variant.spans(self.slot, self.labels, self.number_vocab, self.settings)


@dataclass(frozen=True)
class NoOptions:
    """The options of a variant that has none of its own."""


@dataclass(frozen=True)
class SpanOptions:
    """The options shared by the variants that read the numbers' place values from `label_spans`."""

    max_number_digits: int = option("digits beyond this many share the highest place", default=MAX_NUMBER_DIGITS)

    def __post_init__(self) -> None:
        check_whole_number(self.max_number_digits, "max_number_digits", low=1)


def label_spans(slot: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
                settings: NTLSettings) -> NumberSpans:
    """The spans of the numbers in `labels` (rows never continue into each other), with the settings' options."""
    return NumberSpans(*number_spans(slot, rows_of(labels), number_vocab.decimal_point_id, settings.float_level,
                                     settings.max_number_digits), slot.numel())


class NTLVariant(abc.ABC):
    """One NTL variant; subclass it, set the class attributes, override what differs, and `register` an instance."""

    name: str = ""
    # its options (the NTLSettings fields it reads besides variant, reweigh and ignore_index): a frozen dataclass,
    # each field with a default and a one-line doc (`core.options.option`), checked in its `__post_init__`
    Options: type = NoOptions
    # how to say that one of its options was set for another variant (default: "applies to variant X only")
    misuse: dict[str, str] = {}
    # why it needs a vocabulary of single-digit number tokens ("composes numbers from single-digit tokens");
    # None: any number vocabulary
    single_digits_because: str | None = None
    needs_spans: bool = False  # reads the numbers' spans: a sequence shard must pass the whole rows' (`spans=`)
    reads_number_mass: bool = False  # reads the full-vocabulary number-token mass itself (needs the log-sum-exp)
    torch_losses: tuple[Callable, ...] = ()  # the torch.nn.functional losses ntloss's NTLossDotProduct takes for it

    @property
    def option_names(self) -> tuple[str, ...]:
        """The names of its options, in order."""
        return tuple(field.name for field in dataclasses.fields(self.Options))

    def check(self, settings: NTLSettings) -> None:
        """Checks of its options against the settings every variant has (reweigh); its options on their own and
        together: `Options.__post_init__`."""
        return None  # default: nothing to check

    def check_vocab(self, number_vocab: NumberVocab, settings: NTLSettings) -> None:
        """What it needs of the number vocabulary (host-side, on the vocabulary's Python tuples)."""
        if self.single_digits_because is not None:
            check_single_digits(number_vocab, self.name, self.single_digits_because)

    def describe(self, settings: NTLSettings) -> list[str]:
        """Its options as `key=value` parts of the settings' one-line description."""
        return [f"{name}={getattr(settings, name)}" for name in self.option_names]

    def max_loss(self, number_vocab: NumberVocab, settings: NTLSettings, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
        """The largest per-term loss a number prediction can cost (the reweigh penalty's base)."""
        raise ValueError(f"variant {self.name!r} has no largest per-term loss, so reweigh does not apply to it")

    def spans(self, slot: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
              settings: NTLSettings) -> NumberSpans:
        """Where the numbers of the whole `labels` sit, for a variant that reads them (`needs_spans`); a sequence
        shard slices these (default: the runs of number tokens in each row, `label_spans`)."""
        return label_spans(slot, labels, number_vocab, settings)

    def term_positions(self, slot: torch.Tensor, labels: torch.Tensor, number_vocab: NumberVocab,
                       settings: NTLSettings) -> torch.Tensor:
        """`[n]` bool: where its terms sit (default: at every number-token label)."""
        return slot >= 0

    @abc.abstractmethod
    def terms(self, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """`(loss [n], positions [n] bool)`: the per-term loss (any finite value where no term sits; it is masked)
        and where the terms sit. Rows without a term must get exactly zero gradient (mask their logits first)."""


REGISTRY: dict[str, NTLVariant] = {}  # name -> variant, in registration order


def register(variant: NTLVariant) -> NTLVariant:
    """Add `variant` to the table under its name (refusing a second variant of the same name)."""
    if not variant.name or variant.name in REGISTRY:
        raise ValueError(f"an NTL variant needs a new name, got {variant.name!r} (registered: {', '.join(REGISTRY)})")
    REGISTRY[variant.name] = variant
    return variant


def check_single_digits(number_vocab: NumberVocab, variant: str, because: str) -> None:
    """Refuse a number vocabulary with any token other than a single digit 0-9 (host-side checks of its tuples)."""
    tokens = number_vocab.tokens or tuple(f"{v:g}" for v in number_vocab.values)
    bad = [t for t, v in zip(tokens, number_vocab.values) if len(t) != 1 or v not in range(10)]
    if bad:
        raise ValueError(f"variant {variant!r} {because}, but the number "
                         f"vocabulary holds {len(bad)} other number tokens (e.g. {', '.join(map(repr, bad[:5]))}): "
                         f"use a digit-level vocabulary (NumberVocab.from_tokenizer(tok, digit_level=True), "
                         f"tokenizer.digit_level=true; tools/tokenizer.py split-digits for a tokenizer that merges "
                         f"digits) or a token-level variant ({', '.join(any_vocabulary_variants())})")


def any_vocabulary_variants() -> tuple[str, ...]:
    """The variants that work on any number vocabulary (multi-digit tokens too)."""
    return tuple(name for name, variant in REGISTRY.items() if variant.single_digits_because is None)
