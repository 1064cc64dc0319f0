"""Comparisons of tensors against a reference."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||actual - expected|| / ||expected|| in float64 (element-wise relative error
    means nothing for entries near 0: two correct float32 evaluations differ there by the larger ones' ulps)."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
