"""ntl-pretrain: DeepSpeed ZeRO-3 + AutoTP pretraining with the vocabulary-parallel Number Token Loss."""

__version__ = "0.1.0"

from .core.deepspeed_imports import skip_autotuner_mlflow

# First, before anything imports DeepSpeed: its autotuner imports mlflow (1.5 s a process; core/deepspeed_imports.py)
skip_autotuner_mlflow()
