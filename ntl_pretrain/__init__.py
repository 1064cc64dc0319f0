"""ntl-pretrain: DeepSpeed ZeRO-3 + AutoTP pretraining with the vocabulary-parallel Number Token Loss.

Importing the package (or `ntl_pretrain.loss` from a user's own training script) changes nothing outside it: the
start-up speed-up that acts on DeepSpeed's imports (core/deepspeed_imports.py) is installed by the entry points
only (launch/pretrain.sh, the supervisor's runner, the tools that start DeepSpeed)."""

__version__ = "0.1.0"
