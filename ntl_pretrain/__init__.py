"""ntl-pretrain: DeepSpeed ZeRO-3 + AutoTP pretraining with the vocabulary-parallel Number Token Loss."""

__version__ = "0.1.0"
