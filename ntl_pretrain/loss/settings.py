"""The NTL settings (`NTLSettings`) and the checks of every value a user gives the loss: built by every entry point
(the functions, `HFTrainerLoss`, the ntloss drop-ins, the trainer's config through `config.ntl_settings`), so their
checks run in this one place.

Its fields are the variant and `reweigh` (`VariantChoice`), every variant's options (`variants.VariantOptions`:
each defined once, with its default, doc and check, in its variant's module) and `ignore_index` (`LabelOptions`);
`number_token_loss` takes the same fields as keywords (`takes_settings_keywords`) and the config's `loss` section
holds the variants' options as keys."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ..core.options import (  # noqa: F401 (check_number, check_flag, check_whole_number: also imported from here)
    check_flag,
    check_number,
    check_whole_number,
    doc_of,
    merged_dataclass,
    option,
)
from .variants import REGISTRY, NTLVariant, VariantOptions, option_owners, variant_of


@dataclass(frozen=True)
class VariantChoice:
    """The first fields of `NTLSettings`: the variant, and the option every variant has."""

    variant: str = option('a registered variant (`VARIANTS`): "was" (Wasserstein, the paper\'s default), "mse", ...',
                          default="was")
    reweigh: bool = option("scale each term by the probability mass on number tokens (over the full vocabulary)",
                           default=False)


@dataclass(frozen=True)
class LabelOptions:
    """The last field of `NTLSettings`."""

    ignore_index: int = option("label that marks positions without a target", default=-100)


OPTION_DEFAULTS = {field.name: field.default for field in dataclasses.fields(VariantOptions)}


class NTLSettingsChecks:
    """The checks and methods of `NTLSettings`; which options a variant reads is its own (`variants/`)."""

    def __post_init__(self) -> None:
        variant = variant_of(self.variant)
        check_flag(self.reweigh, "reweigh")
        check_whole_number(self.ignore_index, "ignore_index")
        unknown = [name for name in variant.option_names if name not in OPTION_DEFAULTS]
        if unknown:
            raise ValueError(f"variant {variant.name!r} was registered after NTLSettings was built, so its options "
                             f"({', '.join(unknown)}) are no settings: put its module in ntl_pretrain/loss/variants/")
        for name, owners in option_owners().items():  # another variant's option, set: refused, naming its variants
            if variant.name not in owners and getattr(self, name) != OPTION_DEFAULTS[name]:
                said = [REGISTRY[owner].misuse[name] for owner in owners if name in REGISTRY[owner].misuse]
                applies = said[0] if said else f"applies to variant {' or '.join(map(repr, owners))} only"
                raise ValueError(f"{name} {applies}, not {self.variant!r}: leave it at its default "
                                 f"({OPTION_DEFAULTS[name]!r}) or choose variant {owners[0]!r}")
        variant.Options(**{name: getattr(self, name) for name in variant.option_names})  # checks them
        variant.check(self)
        if self.reweigh and type(variant).max_loss is NTLVariant.max_loss:  # refused here, not at the first step
            raise ValueError(f"reweigh does not apply to variant {variant.name!r} (it has no largest per-term loss); "
                             f"set reweigh=False")

    @property
    def ntl_variant(self) -> NTLVariant:
        """The registered variant these settings name."""
        return REGISTRY[self.variant]

    @property
    def variant_options(self) -> Any:
        """The variant's own options (its `Options`)."""
        variant = self.ntl_variant
        return variant.Options(**{name: getattr(self, name) for name in variant.option_names})

    def describe(self) -> str:
        """The effective settings in one line (those of other variants left out), e.g. for a start-up log:
        reweigh is always named, since ntloss's classes default to True and everything here to False."""
        return ", ".join([f"variant={self.variant}", f"reweigh={self.reweigh}", *self.ntl_variant.describe(self)])


NTLSettings = merged_dataclass(
    "NTLSettings", (VariantChoice, VariantOptions, LabelOptions), bases=(NTLSettingsChecks,), frozen=True,
    module=__name__, doc="Settings of the NTL term: the variant, `reweigh`, every variant's options (another "
                         "variant's must keep their defaults) and `ignore_index`; e.g. "
                         "NTLSettings(variant='was', squash_factor=4.0).")
SETTINGS_KEYWORDS = tuple(field.name for field in dataclasses.fields(NTLSettings))

KEYWORDS_DOC = "the `NTLSettings` fields, each a keyword (default and meaning):"
Function = TypeVar("Function", bound=Callable)


def takes_settings_keywords(function: Function) -> Function:
    """`function(..., **options)` shows `NTLSettings`' fields as its keyword-only parameters: in its signature and,
    after the line of its docstring that ends with `KEYWORDS_DOC`, one line each from their docs."""
    signature = inspect.signature(function)
    kept = [parameter for parameter in signature.parameters.values() if parameter.kind is not parameter.VAR_KEYWORD]
    fields = dataclasses.fields(NTLSettings)
    keywords = [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                  annotation=field.type) for field in fields]
    function.__signature__ = signature.replace(parameters=kept + keywords)
    lines = "".join(f"\n            {field.name}={field.default!r}: {doc_of(field)}" for field in fields)
    if function.__doc__ is None or KEYWORDS_DOC not in function.__doc__:
        raise ValueError(f"{function.__name__}'s docstring needs a line ending with {KEYWORDS_DOC!r}")
    function.__doc__ = function.__doc__.replace(KEYWORDS_DOC, KEYWORDS_DOC + lines, 1)
    return function


def settings_from_keywords(function_name: str, keywords: dict[str, Any]) -> NTLSettings:
    """The `NTLSettings` of a function's settings keywords; a keyword that is no setting is refused, naming them."""
    unknown = [name for name in keywords if name not in SETTINGS_KEYWORDS]
    if unknown:
        raise TypeError(f"{function_name}() got an unexpected keyword argument {unknown[0]!r}; its NTL settings "
                        f"keywords are {', '.join(SETTINGS_KEYWORDS)}")
    return NTLSettings(**keywords)


def check_ntl_weight(value: Any) -> float:
    """The NTL weight lambda of `CE + lambda * NTL` as a float: a finite number >= 0 (the one check of every entry
    point that takes it: `ce_ntl_loss`, `HFTrainerLoss`, the trainer's `loss.ntl_weight`)."""
    return check_number(value, "ntl_weight", "0 turns NTL off")
