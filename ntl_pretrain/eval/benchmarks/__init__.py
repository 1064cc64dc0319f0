"""The benchmark registry: every benchmark the evaluation runs, in the order it runs them.

The run config's `eval` section is built from it (`eval.config.EvalConfig`: the schedule keys, each benchmark's
settings in this order, then the shared generation keys), and the hooks, the start-up checks and
tools/evaluate.py iterate it. Adding a benchmark: its module here (a `base.Benchmark` subclass with its settings)
and one line below (docs/evaluation.md, "Adding a benchmark").
"""

from ntl_pretrain.eval.benchmarks.arithmetic import ARITHMETIC
from ntl_pretrain.eval.benchmarks.base import Benchmark, BenchmarkResult, EvalContext, InputChecks
from ntl_pretrain.eval.benchmarks.gsm8k import GSM8K
from ntl_pretrain.eval.benchmarks.lm_eval import LM_EVAL

BENCHMARKS: tuple[Benchmark, ...] = (
    ARITHMETIC,
    GSM8K,
    LM_EVAL,
)

__all__ = ["BENCHMARKS", "Benchmark", "BenchmarkResult", "EvalContext", "InputChecks"]
