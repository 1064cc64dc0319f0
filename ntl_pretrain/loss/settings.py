"""The NTL settings (`NTLSettings`) and the checks of every value a user gives the loss: built by every entry point
(the functions, `HFTrainerLoss`, the ntloss drop-ins, the trainer's config through `config.ntl_settings`), so their
checks run in this one place."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from .variants import REGISTRY, NTLVariant, variant_of
from .variants.del_loss import DEL_RUNS


@dataclass(frozen=True)
class NTLSettings:
    """Settings of the NTL term; which options a variant reads is its own (`variants/`)."""

    variant: str = "was"  # a registered variant (`VARIANTS`): "was" (Wasserstein, the paper's default), "mse", ...
    reweigh: bool = False  # scale by the probability mass on number tokens (over the full vocabulary)
    squash_factor: float | None = None  # "was": farthest wrong number costs this many times the nearest
    smoothing_sigma: float = 0.0  # "was": Gaussian label smoothing of the target over number values
    float_level: bool = False  # "number_level": a "." between digits joins them into one number
    max_number_digits: int = 20  # "number_level", "digit_entropy": digits beyond this many share the highest place
    # "del": c, the factor of the mean over the N x 10 (digit, class) entries: the authors' 0.01 (Qwen, DeepSeek; 0.1
    # for CodeLlama, Mistral), added to CE with ntl_weight=1
    del_scale: float = 0.01
    del_runs: str = "batch"  # "del": runs of number labels over the flattened batch (the authors') or "rows"
    ignore_index: int = -100  # label that marks positions without a target

    def __post_init__(self) -> None:
        variant = variant_of(self.variant)
        for name in ("reweigh", "float_level"):
            check_flag(getattr(self, name), name)
        check_whole_number(self.max_number_digits, "max_number_digits", low=1)
        check_whole_number(self.ignore_index, "ignore_index")
        check_number(self.smoothing_sigma, "smoothing_sigma", "0 turns label smoothing off")
        check_number(self.del_scale, "del_scale", "0 would turn the term off; set ntl_weight=0 for that", low=0.0,
                     low_allowed=False)
        if self.del_runs not in DEL_RUNS:
            raise ValueError(f"del_runs must be one of {', '.join(DEL_RUNS)} (how runs of number labels are read), "
                             f"got {self.del_runs!r}")
        if self.squash_factor is not None:
            check_number(self.squash_factor, "squash_factor", "1 would turn NTL into CE", low=1.0, low_allowed=False)
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        for owner in REGISTRY.values():  # another variant's option, set: refused, naming the variants it applies to
            for option in owner.options:
                if option not in variant.options and getattr(self, option) != defaults[option]:
                    owners = " or ".join(repr(v.name) for v in REGISTRY.values() if option in v.options)
                    raise ValueError(f"{option} {owner.misuse.get(option, f'applies to variant {owners} only')}, "
                                     f"not {self.variant!r}")
        variant.check(self)

    @property
    def ntl_variant(self) -> NTLVariant:
        """The registered variant these settings name."""
        return REGISTRY[self.variant]

    def describe(self) -> str:
        """The effective settings in one line (those of other variants left out), e.g. for a start-up log:
        reweigh is always named, since ntloss's classes default to True and everything here to False."""
        return ", ".join([f"variant={self.variant}", f"reweigh={self.reweigh}", *self.ntl_variant.describe(self)])


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


def check_ntl_weight(value: Any) -> float:
    """The NTL weight lambda of `CE + lambda * NTL` as a float: a finite number >= 0 (the one check of every entry
    point that takes it: `ce_ntl_loss`, `HFTrainerLoss`, the trainer's `loss.ntl_weight`)."""
    return check_number(value, "ntl_weight", "0 turns NTL off")
