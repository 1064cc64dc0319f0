"""The data layer's error (the bottom of ntl_pretrain.data: every data module may raise it)."""

from __future__ import annotations


class DataError(ValueError):
    """A data source cannot be used; the message names the source key and the fix."""
