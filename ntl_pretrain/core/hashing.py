"""A short stable hash of JSON-like data: what checkpoints record to compare a run's model, tokenizer and data
with the ones they were saved with (changing it would refuse every existing checkpoint)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def short_sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
