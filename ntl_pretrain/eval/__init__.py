"""Evaluation: the registered benchmarks (`eval.benchmarks.BENCHMARKS`: arithmetic, GSM8K) with distributed greedy
generation (ZeRO-3 and AutoTP safe)."""

from ntl_pretrain.eval.config import EvalConfig
from ntl_pretrain.eval.hooks import run_evaluation

__all__ = ["EvalConfig", "run_evaluation"]
