"""Settings made of parts: a component (an NTL variant, a config section's piece) owns a small dataclass of its
options, each field with a default and a one-line doc (`option`); a settings class or a config section is one flat
dataclass merged from the parts' fields (`merged_dataclass`), so an option is defined once, where its component is.
Also the checks of single values that the parts run (each error one line naming the option and what it takes)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Any, Mapping, Sequence


def option(doc: str, **default: Any) -> Any:
    """A dataclass field whose one-line doc is kept in its metadata (`--help`, docstrings read it)."""
    return dataclasses.field(metadata={"doc": doc}, **default)


def doc_of(field: dataclasses.Field) -> str:
    """The one-line doc `option` gave `field` ("" for a field without one)."""
    return field.metadata.get("doc", "")


def _default_of(field: dataclasses.Field) -> dict[str, Any]:
    if field.default is not dataclasses.MISSING:
        return {"default": field.default}
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return {"default_factory": field.default_factory}  # type: ignore[misc]
    raise ValueError(f"option {field.name!r} has no default: give every option a default")


def merged_fields(parts: Sequence[type], docs: Mapping[str, str] = {}) -> list[tuple[str, Any, dataclasses.Field]]:
    """`(name, type, field)` of every field of the dataclasses `parts`, in order, for `dataclasses.make_dataclass`.

    A name in several parts is one field when they define it alike (a shared options class their parts inherit);
    defined otherwise, it is refused, naming both parts. `docs` replaces the doc of the fields it names.
    """
    merged: dict[str, tuple[Any, dataclasses.Field, type]] = {}
    for part in parts:
        hints = typing.get_type_hints(part)  # resolved types: the config's reader checks values against them
        for field in dataclasses.fields(part):
            if field.name in merged:
                hint, first, owner = merged[field.name]
                if (hint, _default_of(first), doc_of(first)) != (hints[field.name], _default_of(field), doc_of(field)):
                    raise ValueError(f"option {field.name!r} of {part.__qualname__} is also {owner.__qualname__}'s, "
                                     f"defined otherwise: give one of them another name, or share one options class")
                continue
            merged[field.name] = (hints[field.name], field, part)
    return [(name, hint, dataclasses.field(metadata={**field.metadata, "doc": docs.get(name, doc_of(field))},
                                           **_default_of(field)))
            for name, (hint, field, _) in merged.items()]


def merged_dataclass(name: str, parts: Sequence[type], *, module: str, doc: str, bases: tuple[type, ...] = (),
                     frozen: bool = False, docs: Mapping[str, str] = {}) -> type:
    """One flat dataclass called `name` of the fields of `parts` (`merged_fields`), with `bases` (methods, such as
    a `__post_init__` that checks the parts) and the docstring `doc`; `module`: where pickle and repr find it."""
    cls = dataclasses.make_dataclass(name, merged_fields(parts, docs), bases=bases, frozen=frozen,
                                     namespace={"__doc__": doc})
    cls.__module__ = module
    return cls


def check_flag(value: Any, name: str) -> None:
    """`value` is True or False (a string such as 'False' would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def check_whole_number(value: Any, name: str, low: int | None = None) -> None:
    """`value` is an int (not a bool, not 2.5), at least `low` when given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_number(value: Any, name: str, meaning: str, low: float = 0.0, low_allowed: bool = True) -> float:
    """`value` is a real number (not a bool or a string), finite, and >= `low` (> `low` unless `low_allowed`);
    returns it as a float. `meaning` says what the bound means, for the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    bound = f"{'>=' if low_allowed else '>'} {low:g}"
    if not math.isfinite(value) or (value < low if low_allowed else value <= low):
        raise ValueError(f"{name} must be {bound} and finite ({meaning}), got {value}")
    return float(value)


def check_choice(value: Any, name: str, choices: Sequence[Any], meaning: str) -> None:
    """`value` is one of `choices`; `meaning` says what the option chooses, for the message."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))} ({meaning}), got {value!r}")
