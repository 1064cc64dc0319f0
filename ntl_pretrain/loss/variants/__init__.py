"""The NTL variants: one module each, registered by name in `REGISTRY` (`base.py` says what a variant owns).

The built-in variants are imported in their historic order (the order of `VARIANTS`, the config's choices and
`--help`); every other module of this package is imported after them, in name order, so that a new variant is
one new module here (plus its test).
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import REGISTRY, NTLVariant, TermInputs, any_vocabulary_variants, register

_BUILT_IN = ("was", "lp", "number_level")  # registers was, mse, mae, huber, number_level in this order
for _module in _BUILT_IN + tuple(sorted(info.name for info in pkgutil.iter_modules(__path__)
                                        if info.name not in _BUILT_IN + ("base",))):
    importlib.import_module(f"{__name__}.{_module}")

VARIANTS: tuple[str, ...] = tuple(REGISTRY)  # the variant names, in registration order


def variant_of(name: str) -> NTLVariant:
    """The registered variant called `name`."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"unknown NTL variant {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


__all__ = ["REGISTRY", "VARIANTS", "NTLVariant", "TermInputs", "any_vocabulary_variants", "register", "variant_of"]
