"""The NTL variants as the tests see them, read from the registry so that a new variant is covered without
editing a test: the settings the equivalence checks run (`every_variant_settings`, `reference_cases`), and each
variant's reference in `REFERENCES`, written independently of `ntl_pretrain.loss` (ntloss, or plain torch in
tests/helpers/del_reference.py and tests/helpers/digit_entropy.py).

A new variant's author adds its reference here (one function and one `REFERENCES` entry); until then the checks
that every variant gets (tests/test_loss_variants.py, tests/workers/variant_shards.py) fail naming it."""

from __future__ import annotations

from typing import Callable

import torch

from helpers.del_reference import del_reference
from helpers.digit_entropy import digit_entropy_reference
from ntl_pretrain.loss import VARIANTS, NTLSettings
from ntl_pretrain.loss.variants import REGISTRY, NTLVariant
from ntl_pretrain.numbers import NumberVocab


def options_of(variant: str) -> tuple[str, ...]:
    """The `NTLSettings` options `variant` reads besides reweigh (the one place the tests ask the registry)."""
    return REGISTRY[variant].option_names


def every_variant_settings(*extra: NTLSettings) -> list[NTLSettings]:
    """`NTLSettings` of each registered variant with its defaults, reweigh off and on (where allowed), then
    `extra`."""
    settings = []
    for variant in VARIANTS:
        for reweigh in (False, True):
            try:
                settings.append(NTLSettings(variant=variant, reweigh=reweigh))
            except ValueError:  # a variant that refuses reweigh (del, digit_entropy)
                assert reweigh, variant
    return settings + list(extra)


# Options that make a variant's term large enough against CE for a check to see it (the default del_scale: 0.01), and
# options under which its terms depend on each row alone (del's default runs over the flattened batch join rows and
# documents, which micro-batch splits and packing group differently): set where a variant reads them.
LARGE_TERM_OPTIONS = {"del_scale": 1.0}
ROW_LOCAL_OPTIONS = {"del_runs": "rows"}


def variant_settings(variant: str, *option_sets: dict, reweigh: bool = False) -> NTLSettings:
    """`NTLSettings` of `variant` with each of `option_sets`' options it reads, reweigh on if asked and allowed."""
    options = {key: value for chosen in option_sets for key, value in chosen.items()
               if key in options_of(variant)}
    try:
        return NTLSettings(variant=variant, reweigh=reweigh, **options)
    except ValueError:  # a variant that refuses reweigh (del, digit_entropy)
        assert reweigh, variant
        return NTLSettings(variant=variant, **options)


def one_variant_of_each_kind() -> list[str]:
    """The first registered variant of each kind that the trainer's paths treat differently (for the checks that
    cost a launch or a Trainer a variant): its terms' spans (none, the number runs of each row, its own), whether it
    reads the number-token mass, whether it needs single-digit tokens. Now: was, number_level, del, digit_entropy."""
    kinds: dict[tuple, str] = {}
    for name, variant in REGISTRY.items():
        own_spans = type(variant).spans is not NTLVariant.spans
        kind = (variant.needs_spans, own_spans, variant.reads_number_mass, variant.single_digits_because is None)
        kinds.setdefault(kind, name)
    return list(kinds.values())


# Options whose references exist (the first matching entry per variant is used): each variant's defaults are
# checked by `every_variant_settings`; these add one case with its options moved off their defaults.
OPTION_CASES = (dict(squash_factor=3.0), dict(float_level=True, max_number_digits=3), dict(max_number_digits=3),
                dict(del_runs="rows", del_scale=0.1))


def reference_cases() -> list[NTLSettings]:
    """The settings each variant's reference is checked with: its defaults with reweigh off and on (where allowed),
    and one case of its own options off their defaults (the first of `OPTION_CASES` it accepts)."""
    cases = every_variant_settings()
    for variant in VARIANTS:
        for options in OPTION_CASES:
            if set(options) <= set(options_of(variant)):
                cases.append(NTLSettings(variant=variant, **options))
                break
    return cases


def case_id(settings: NTLSettings) -> str:
    """A test id: the variant, then reweigh and the options set off their defaults ("was-reweigh")."""
    defaults = NTLSettings(variant=settings.variant)
    changed = [f"{option}={getattr(settings, option)}" for option in options_of(settings.variant)
               if getattr(settings, option) != getattr(defaults, option)]
    return "-".join([settings.variant, *(["reweigh"] if settings.reweigh else []), *changed])


def option_keywords(settings: NTLSettings) -> dict:
    """The keywords of `number_token_loss` that `settings` set: the variant, reweigh and the variant's options."""
    return {"variant": settings.variant, "reweigh": settings.reweigh,
            **{option: getattr(settings, option) for option in options_of(settings.variant)}}


# The reference tokenizer: one token per character, the ten digits spread over the vocabulary out of value order
# (like Llama-2's), a '.' token, 58 tokens in all; the model's logits are padded to 64 columns.
_FILLER = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN +=,"
_DIGITS = "7309152846"
REFERENCE_CHARS = "".join(_FILLER[4 * i:4 * i + 4] + _DIGITS[i] for i in range(10)) + "." + _FILLER[40:]
PADDED_VOCAB = 64


def reference_tokenizer():
    from helpers.models import char_tokenizer

    return char_tokenizer(REFERENCE_CHARS)


def reference_vocab(tokenizer) -> NumberVocab:
    return NumberVocab.from_tokenizer(tokenizer, digit_level=True)


def digit_ids(tokenizer) -> list[int]:
    """`[id of "0", ..., id of "9"]`."""
    return [tokenizer.convert_tokens_to_ids(str(digit)) for digit in range(10)]


def reference_batch(tokenizer, seed: int, rows: int = 2, length: int = 16, hidden_size: int = 8):
    """float64 hidden states `[rows, length, hidden]`, a head weight `[PADDED_VOCAB, hidden]` and labels with runs
    of digits, decimal points, ignored labels, and a number continuing from one row into the next."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(PADDED_VOCAB, hidden_size, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, len(tokenizer), (rows, length), generator=generator)
    digits = torch.tensor(digit_ids(tokenizer))
    numbers = torch.rand(rows, length, generator=generator) < 0.6
    labels[numbers] = digits[torch.randint(0, 10, (int(numbers.sum()),), generator=generator)]
    dot = tokenizer.convert_tokens_to_ids(".")
    labels[0, 6] = labels[1, 9] = dot  # decimals (float_level, del)
    labels[0, 5] = labels[0, 7] = labels[1, 8] = labels[1, 10] = digits[4]
    labels[0, -2:] = digits[:2]  # row 0 ends in digits and row 1 starts with them
    labels[1, :2] = digits[5:7]
    labels[1, 12] = -100
    return hidden, weight, labels


def _ntloss_was(logits, labels, tokenizer, settings):
    import ntloss

    return ntloss.NTLoss(tokenizer, vocab_size=logits.shape[-1], digit_level=True, reweigh=settings.reweigh,
                         squash_factor=settings.squash_factor)(logits.float(), labels)


def _ntloss_dot_product(logits, labels, tokenizer, settings):
    import ntloss

    loss_function = settings.ntl_variant.torch_losses[0]  # which torch.nn.functional loss ntloss takes for it
    return ntloss.NTLossDotProduct(tokenizer, vocab_size=logits.shape[-1], digit_level=True, reweigh=settings.reweigh,
                                   loss_function=loss_function)(logits.float(), labels)


def _ntloss_number_level(logits, labels, tokenizer, settings):
    import ntloss

    return ntloss.NumberLevelLoss(tokenizer, vocab_size=logits.shape[-1], float_level=settings.float_level,
                                  reweigh=settings.reweigh,
                                  max_number_length=settings.max_number_digits)(logits.float(), labels)


def _plain_del(logits, labels, tokenizer, settings):
    total, count = del_reference(logits, labels, digit_ids(tokenizer), tokenizer.convert_tokens_to_ids("."),
                                 scale=settings.del_scale, runs=settings.del_runs)
    return total / count


def _plain_digit_entropy(logits, labels, tokenizer, settings):
    total, count = digit_entropy_reference(logits, labels, digit_ids(tokenizer),
                                           max_number_digits=settings.max_number_digits)
    return total / count


# variant name -> its reference: (logits [B, S, V], labels [B, S], the tokenizer, NTLSettings) -> the mean NTL term
# over the batch (differentiable in the logits); the tokenizer's digits are single tokens. ntloss runs in float32
# (its huber loss refuses float64), the plain-torch references in the logits' dtype.
REFERENCES: dict[str, Callable[..., torch.Tensor]] = {
    "was": _ntloss_was,
    "mse": _ntloss_dot_product,
    "mae": _ntloss_dot_product,
    "huber": _ntloss_dot_product,
    "number_level": _ntloss_number_level,
    "del": _plain_del,
    "digit_entropy": _plain_digit_entropy,
}


def reference_of(variant: str) -> Callable[..., torch.Tensor]:
    """The reference of a registered variant, or a failure that says where to add one."""
    assert variant in REFERENCES, (f"NTL variant {variant!r} has no reference: add one (written without "
                                   f"ntl_pretrain.loss) to REFERENCES in tests/helpers/variants.py")
    return REFERENCES[variant]
