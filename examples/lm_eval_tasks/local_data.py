"""The local data of the demo lm-eval tasks beside this file: lm-eval calls `load` (the tasks' `custom_dataset`)
with the task's dataset_kwargs, so the tasks run from any working directory and never reach a hub."""

from __future__ import annotations

import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent


def load(data_file: str, **_metadata):
    """{"test": the rows of DATA_FILE (JSON lines beside this file)} as a datasets.Dataset."""
    import datasets

    with open(HERE / data_file, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
