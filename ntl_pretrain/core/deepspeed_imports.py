"""DeepSpeed's import of mlflow, which this project never uses, skipped.

DeepSpeed 0.19's `deepspeed.autotuning.autotuner` runs `import mlflow` whenever `deepspeed` is imported, only to log
autotuning experiments (`deepspeed --autotuning`, which this project does not drive). With mlflow installed (the
`tracking` extra, the dev install) that import costs about 1.5 s of CPU in every process that imports DeepSpeed:
the runner and each rank, before anything trains (`python tools/bench_launch.py` measures it). The finder below
makes that one import fail as if mlflow were absent (the autotuner catches it and records `has_mlflow = False`);
every other `import mlflow`, the trainer's MLflow tracker's included, is untouched.
"""

from __future__ import annotations

import importlib.abc
import sys

SKIPPED_MODULE = "mlflow"
IMPORTER = "deepspeed.autotuning.autotuner"  # checked against the pinned DeepSpeed (constraints.txt)


class _SkipMlflowForDeepSpeedsAutotuner(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name != SKIPPED_MODULE:
            return None
        frame = sys._getframe(1)
        while frame is not None:  # the frames of the import machinery, then the module that imports
            if frame.f_globals.get("__name__") == IMPORTER:
                raise ModuleNotFoundError(f"{name} is not imported for {IMPORTER} (ntl_pretrain.core.deepspeed_imports)",
                                          name=name)
            frame = frame.f_back
        return None


def skip_autotuner_mlflow() -> None:
    """Install the finder first on sys.meta_path (once); it must come before DeepSpeed is first imported."""
    if not any(isinstance(finder, _SkipMlflowForDeepSpeedsAutotuner) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SkipMlflowForDeepSpeedsAutotuner())
