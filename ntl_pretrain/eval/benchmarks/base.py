"""What every benchmark shares: the `Benchmark` interface, the context a run gets, and its result.

A benchmark owns its settings (a dataclass whose fields are its `eval.*` keys), its checks and its run; the
hooks (`eval.hooks.run_evaluation`), the start-up checks (`eval.config.validate_eval_inputs`) and
tools/evaluate.py only iterate the registry (`ntl_pretrain.eval.benchmarks.BENCHMARKS`).
"""

from __future__ import annotations

import abc

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.distributed as dist

from ntl_pretrain.core.errors import ConfigError
from ntl_pretrain.eval.generate import GenerationOutput, data_parallel_group, greedy_generate
from ntl_pretrain.eval.progress import GenerationProgress


def setting(doc: str, **kwargs: Any) -> Any:
    """A settings field whose one-line doc is kept in its metadata (the run config's `--help` shows it)."""
    return field(metadata={"doc": doc}, **kwargs)


def check_at_least(settings: Any, minimum: int, *names: str) -> None:
    """Raise ConfigError (a ValueError: one line, no trace) for the first of the `names` settings below `minimum`
    (None, meaning "default", passes)."""
    for name in names:
        value = getattr(settings, name)
        if value is not None and value < minimum:
            raise ConfigError(f"eval.{name}={value} must be >= {minimum}")


def is_writer_rank() -> bool:
    """Whether this process writes files and prints (rank 0 of the world, or the only process)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@dataclass(frozen=True)
class EvalContext:
    """What every benchmark's run gets besides its own settings: the shared generation settings (eval.batch_size,
    eval.max_length, eval.add_special_tokens), whether this is the final evaluation, and where it runs."""

    batch_size: int
    max_length: int
    add_special_tokens: bool | None
    final: bool = False  # the evaluation after the last step (tools/evaluate.py too), else a periodic one
    dp_group: Any = None  # the group prompts are split over (None: found on the engine)
    tp_group: Any = None  # the group of a vocabulary-parallel head (None: the head's own)
    show_progress: bool = False  # rank 0 prints what is evaluated and the generation's progress (tools/evaluate.py)
    # the model was trained with attention inside each packed document (data.document_mask): a document starts
    # alone at position 0, not after the previous document's EOS
    document_mask: bool = False

    def generate(self, model: Any, tokenizer: Any, prompts: Sequence[str], *, label: str, what: str,
                 max_new_tokens: int, stop: Sequence[str], add_special_tokens: bool | None,
                 prefix_ids: Sequence[int] = ()) -> GenerationOutput:
        """`greedy_generate` with the shared settings; every rank calls it (collectives). `label` and `what`
        name the benchmark and say what it evaluates on the progress lines (`show_progress`)."""
        return greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, stop=stop,
                               batch_size=self.batch_size, max_length=self.max_length,
                               add_special_tokens=add_special_tokens, prefix_ids=prefix_ids, dp_group=self.dp_group,
                               tp_group=self.tp_group, progress=self._progress(label, what, model))

    def _progress(self, label: str, what: str, model: Any) -> GenerationProgress | None:
        """A progress reporter on the writer rank when `show_progress` (after a line saying what is evaluated)."""
        if not (self.show_progress and is_writer_rank()):
            return None
        if dist.is_available() and dist.is_initialized():
            split = dist.get_world_size(data_parallel_group(model, self.dp_group))
            what += (f"; {dist.get_world_size()} processes, the prompts split over {split} data-parallel rank(s), "
                     f"rank 0's progress shown")
        print(f"eval {label}: {what}", flush=True)
        return GenerationProgress(label)


@dataclass
class BenchmarkResult:
    """One benchmark's run, the same on every rank."""

    metrics: dict[str, float]  # TensorBoard tag (eval/<name>/...) -> value
    records: list[dict[str, Any]]  # one per prediction: benchmark (its name), prompt, output, extracted, gold, correct
    generation: GenerationOutput | None = None  # what generating cost (eval/generation/*); None: nothing generated


@dataclass(frozen=True)
class InputChecks:
    """What a benchmark's start-up check may read (`Benchmark.check_inputs`)."""

    read_hub: bool = False  # also load data given as a datasets hub id (else only local files are read)
    generated_corpora: tuple[tuple[str, str], ...] = ()  # (config key, path) of existing corpora the config generates


class Benchmark(abc.ABC):
    """One benchmark. To add one: subclass this in its own module under ntl_pretrain/eval/benchmarks/, and add
    its instance to `BENCHMARKS` there (docs/evaluation.md, "Adding a benchmark").

    `name`: its TensorBoard tags `eval/<name>/...`, the "benchmark" of its prediction records, its sample table
    `eval/samples/<name>` and its progress lines. `Settings`: a dataclass of its keys in the run config's `eval`
    section, which is flat (`eval.arithmetic_n`), so each key names its benchmark; every field has a default and
    a one-line doc (`setting(doc, default=...)`, shown by `--help`), and `__post_init__` validates (ValueError
    naming `eval.KEY` and the fix). `max_new_tokens_key`: the setting that bounds its answers, checked at start-up
    to leave room for a prompt within the length limit.
    """

    name: str
    Settings: type
    max_new_tokens_key: str

    @abc.abstractmethod
    def enabled(self, settings: Any) -> bool:
        """Whether these settings run the benchmark (e.g. arithmetic_n > 0)."""

    def check_tokenizer(self, settings: Any, tokenizer: Any) -> None:
        """Refuse settings the tokenizer cannot serve (before the weights load in tools/evaluate.py)."""
        return None  # default: every tokenizer serves it

    def check_inputs(self, settings: Any, inputs: InputChecks) -> list[str]:
        """Read what the run will read (files, exemplars) before training; ValueError naming the file/line or key and
        the fix; returns one line per input checked."""
        return []

    @abc.abstractmethod
    def run(self, model: Any, tokenizer: Any, settings: Any, context: EvalContext) -> BenchmarkResult:
        """Evaluate `model` (a module or a DeepSpeed engine); every rank calls this with the same arguments."""
