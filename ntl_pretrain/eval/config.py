"""Evaluation settings, built from the benchmark registry. The trainer's config embeds them as `eval`, so users write
`eval.every_n_steps=100`; each benchmark's keys are its `Settings` (`ntl_pretrain.eval.benchmarks`)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ntl_pretrain.core.fs import write_json_atomic
from ntl_pretrain.core.typed_yaml import build_dataclass
from ntl_pretrain.eval.benchmarks import BENCHMARKS, Benchmark, InputChecks
from ntl_pretrain.eval.benchmarks.arithmetic import ARITHMETIC_PROMPT_FORMATS, ArithmeticPromptFormat  # noqa: F401
from ntl_pretrain.eval.benchmarks.base import check_at_least, setting
from ntl_pretrain.eval.benchmarks.gsm8k import GSM8K_VARIANTS  # noqa: F401  (both: the names this module had)

# The run's evaluation settings, written into every checkpoint's hf/ folder (and so into its export), so that
# tools/evaluate.py --model EXPORT evaluates as the run did.
EVAL_SETTINGS_FILE = "ntl_eval.json"


@dataclass
class ScheduleSettings:
    """When the training loop evaluates (the first keys of eval)."""

    every_n_steps: int = setting("evaluate every this many optimizer steps during training (0: never periodically)",
                                 default=0)
    at_end: bool = setting("evaluate once more after the last training step", default=True)

    def __post_init__(self) -> None:
        check_at_least(self, 0, "every_n_steps")


@dataclass
class SharedSettings:
    """How every benchmark generates and logs (the last keys of eval)."""

    batch_size: int = setting("prompts decoded together on each data-parallel rank", default=16)
    max_length: int = setting(
        "prompt plus answer limit in tokens; longer prompts keep their end (0: the model's max_position_embeddings)",
        default=0)
    add_special_tokens: bool | None = setting(
        "add the tokenizer's special tokens (e.g. BOS) to prompts; null: the tokenizer's default, as "
        "lm-evaluation-harness does (BOS for Llama-style tokenizers)", default=None)
    samples_to_log: int = setting("sample generations per benchmark logged as text to TensorBoard", default=4)

    def __post_init__(self) -> None:
        check_at_least(self, 0, "max_length", "samples_to_log")
        check_at_least(self, 1, "batch_size")


class EvalConfigBase:
    """The methods of an `eval_config_class`: validation by parts, the schedule, each benchmark's settings."""

    # Set by eval_config_class (not annotated: the run config's type hints stay those of the keys).
    parts = ()  # ScheduleSettings, each benchmark's Settings, SharedSettings
    benchmarks = ()  # the Benchmark objects, in the order they run

    def __post_init__(self) -> None:
        # each part validates its keys and normalises them (a tuple of ops becomes a list); keep the normalised values
        for part in self.parts:
            checked = self._part(part)
            for f in dataclasses.fields(part):
                setattr(self, f.name, getattr(checked, f.name))

    def _part(self, part: type) -> Any:
        return part(**{f.name: getattr(self, f.name) for f in dataclasses.fields(part)})

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and how to fix it (each part checks its own keys, in the
        order of the keys)."""
        for part in self.parts:
            self._part(part)

    def settings_of(self, benchmark: Benchmark) -> Any:
        """`benchmark`'s settings (its `Settings` dataclass) from these flat keys."""
        return self._part(benchmark.Settings)

    def enabled_benchmarks(self) -> list[tuple[Benchmark, Any]]:
        """(benchmark, its settings) of every benchmark these settings run, in registry order."""
        chosen = [(benchmark, self.settings_of(benchmark)) for benchmark in self.benchmarks]
        return [(benchmark, settings) for benchmark, settings in chosen if benchmark.enabled(settings)]

    def is_due(self, step: int, *, final: bool = False) -> bool:
        """Whether the training loop should evaluate after `step` (`final`: after the last step)."""
        if final:
            return self.at_end  # type: ignore[attr-defined]
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0  # type: ignore[attr-defined]


def eval_config_class(benchmarks: Sequence[Benchmark]) -> type:
    """The `eval` section for `benchmarks`: one flat dataclass of the schedule keys, each benchmark's settings in
    order, then the shared keys (so the run config and ntl_eval.json keep flat keys such as `eval.arithmetic_n`)."""
    names = [benchmark.name for benchmark in benchmarks]
    if len(set(names)) != len(names):
        raise ValueError(f"benchmark names {names} repeat; each benchmark needs its own name (its TensorBoard tags)")
    parts = (ScheduleSettings, *(benchmark.Settings for benchmark in benchmarks), SharedSettings)
    owner: dict[str, str] = {}
    fields = []
    for part in parts:
        hints = typing.get_type_hints(part)  # resolved types: the config's reader coerces against them
        for f in dataclasses.fields(part):
            if f.name in owner:
                raise ValueError(f"eval setting {f.name!r} is both {owner[f.name]}'s and {part.__name__}'s; "
                                 f"name a benchmark's settings after it (e.g. arithmetic_n)")
            owner[f.name] = part.__name__
            default = ({"default": f.default} if f.default is not dataclasses.MISSING
                       else {"default_factory": f.default_factory})
            fields.append((f.name, hints[f.name], dataclasses.field(metadata=f.metadata, **default)))
    cls = dataclasses.make_dataclass(
        "EvalConfig", fields, bases=(EvalConfigBase,),
        namespace={"__doc__": "Which benchmarks run when, and how generation is done.", "parts": parts,
                   "benchmarks": tuple(benchmarks)})
    cls.__module__ = __name__  # where pickle and repr find it
    return cls


# The run config's `eval` section, from the registry.
EvalConfig = eval_config_class(BENCHMARKS)


def eval_config_from_dict(values: dict[str, Any], where: str = "eval") -> EvalConfig:
    """An EvalConfig from a mapping; an unknown key is an error naming the nearest valid one, and every value is
    type-checked as the trainer's config checks `eval.*` (`arithmetic_n=1.5` or `true` is refused, not used)."""
    names = [f.name for f in dataclasses.fields(EvalConfig)]
    for key in values:
        if key not in names:
            nearest = difflib.get_close_matches(str(key), names, n=1, cutoff=0.0)
            raise ValueError(f"unknown evaluation setting {key!r} in {where}; did you mean {nearest[0]!r}? "
                             f"Valid keys: {', '.join(names)}")
    return build_dataclass(EvalConfig, dict(values), "eval.")


# ntl_eval.json's one key that is no setting: whether the run trained with attention inside each packed document
# (data.document_mask), which decides how a "document" prompt is encoded (EvalContext.document_mask)
TRAINED_DOCUMENT_MASK = "trained_with_document_mask"


def save_eval_settings(folder: str, cfg: EvalConfig, document_mask: bool = False) -> str:
    """Write `cfg` and the run's data.document_mask as FOLDER/ntl_eval.json (atomically); returns the path."""
    return write_json_atomic(os.path.join(folder, EVAL_SETTINGS_FILE),
                             {**dataclasses.asdict(cfg), TRAINED_DOCUMENT_MASK: document_mask}, indent=1)


def trained_document_mask(folder: str) -> bool:
    """Whether the run whose FOLDER/ntl_eval.json this is trained with data.document_mask; false without the file
    or the key (written before it: attention then spanned the packed row)."""
    try:
        with open(os.path.join(folder, EVAL_SETTINGS_FILE), encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(values, dict) and values.get(TRAINED_DOCUMENT_MASK) is True


def load_eval_settings(folder: str) -> EvalConfig | None:
    """The settings FOLDER/ntl_eval.json holds (a run's, saved with its checkpoints), or None without one."""
    path = os.path.join(folder, EVAL_SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); delete it to evaluate with default settings") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a mapping of evaluation settings")
    values.pop(TRAINED_DOCUMENT_MASK, None)  # not a setting (trained_document_mask)
    try:
        return eval_config_from_dict(values, where=path)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if path in message else f"{path}: {message}") from None


def check_corpus_digits(cfg: EvalConfig, corpora: Iterable[tuple[str, dict[str, Any]]]) -> None:
    """Refuse arithmetic benchmark digits that disagree with a corpus the same config generates.

    `corpora`: (config key of the options, e.g. "data.sources.0.generate_options", the options). The
    interpolation split must use the corpus's operand lengths and the extrapolation split longer ones,
    else "extrapolation" problems are trained on (or "interpolation" is not the training distribution).
    """
    if cfg.arithmetic_n == 0:
        return
    for where, options in corpora:
        corpus_digits = [int(d) for d in options.get("train_digits", (1, 4))]
        if corpus_digits != cfg.arithmetic_train_digits:
            raise ValueError(
                f"eval.arithmetic_train_digits={cfg.arithmetic_train_digits} but {where}.train_digits="
                f"{corpus_digits} (the corpus this run generates): the interpolation split must use the training "
                f"operand lengths and the extrapolation split longer ones; set eval.arithmetic_train_digits="
                f"{corpus_digits} and eval.arithmetic_extrapolation_digits to start above {corpus_digits[1]}")


def validate_eval_inputs(cfg: EvalConfig, *, max_position_embeddings: int | None = None, read_hub: bool = False,
                         generated_corpora: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Check, before any training, what the evaluation will read: that every benchmark's answers leave room for
    a prompt under the length limit, then each benchmark's inputs (`Benchmark.check_inputs`: GSM8K files, every
    line, the chain-of-thought exemplars; existing generated corpora hold no interpolation problem).

    `max_position_embeddings`: the model's, when known (used when eval.max_length is 0). `read_hub`:
    also load data given as a datasets hub id (else only local files are read). `generated_corpora`:
    (config key, path) of corpora the config generates, when they exist. Raises ValueError naming the
    file/line or key and the fix; returns one line per input checked.
    """
    enabled = cfg.enabled_benchmarks()
    limit = cfg.max_length or max_position_embeddings or 0
    for benchmark, settings in enabled:
        key = benchmark.max_new_tokens_key
        max_new = getattr(settings, key)
        if limit and max_new >= limit:
            source = "eval.max_length" if cfg.max_length else "the model's max_position_embeddings"
            raise ValueError(f"eval.{key}={max_new} leaves no room for the prompt within {limit} tokens ({source}); "
                             f"lower eval.{key} or raise eval.max_length (lm-evaluation-harness refuses the same)")
    inputs = InputChecks(read_hub=read_hub, generated_corpora=tuple(generated_corpora))
    return [line for benchmark, settings in enabled for line in benchmark.check_inputs(settings, inputs)]
