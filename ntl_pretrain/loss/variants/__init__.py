"""The NTL variants: one module each, registered by name in `REGISTRY` (`base.py` says what a variant owns).

The built-in variants are imported in their historic order (the order of `VARIANTS`, the config's choices and
`--help`); every other module of this package is imported after them, in name order, so that a new variant is
one new module here (plus its test). `VariantOptions` is every variant's options as one flat dataclass (each
field's doc names the variants that read it): `NTLSettings` and the config's `loss` section are built from it.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from ...core.options import doc_of, merged_dataclass
from .base import REGISTRY, NTLVariant, SpanOptions, TermInputs, any_vocabulary_variants, register

_BUILT_IN = ("was", "lp", "number_level")  # registers was, mse, mae, huber, number_level in this order
for _module in _BUILT_IN + tuple(sorted(info.name for info in pkgutil.iter_modules(__path__)
                                        if info.name not in _BUILT_IN + ("base",))):
    importlib.import_module(f"{__name__}.{_module}")

VARIANTS: tuple[str, ...] = tuple(REGISTRY)  # the variant names, in registration order


def option_owners() -> dict[str, tuple[str, ...]]:
    """Each variant option's name -> the variants that read it, in registration order."""
    owners: dict[str, tuple[str, ...]] = {}
    for variant in REGISTRY.values():
        for name in variant.option_names:
            owners[name] = owners.get(name, ()) + (variant.name,)
    return owners


def _variant_options() -> type:
    """The options of every registered variant as one frozen dataclass, each doc led by the variants reading it."""
    parts = list(dict.fromkeys(variant.Options for variant in REGISTRY.values()))
    docs = {field.name: f"{', '.join(option_owners()[field.name])}: {doc_of(field)}"
            for part in parts for field in dataclasses.fields(part)}
    return merged_dataclass("VariantOptions", parts, module=__name__, frozen=True, docs=docs,
                            doc="Every NTL variant's options (each variant's own: its module's `Options`).")


VariantOptions = _variant_options()


def variant_of(name: str) -> NTLVariant:
    """The registered variant called `name`."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown NTL variant {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


__all__ = ["REGISTRY", "VARIANTS", "NTLVariant", "SpanOptions", "TermInputs", "VariantOptions", "any_vocabulary_variants",
           "option_owners", "register", "variant_of"]
