"""Typed run configuration: dataclasses loaded from YAML, `key.sub=value` overrides, strict validation.

A run is described by one YAML file whose sections mirror the dataclasses below (`model`, `tokenizer`,
`data`, `loss`, `parallel`, `optim`, `train`, `checkpoint`, `monitor`, `deepspeed`, `eval`). Any key can
be overridden on the command line as `section.key=value` (values are parsed as YAML, so `true`, `3`,
`[0.9, 0.95]` and `null` work; list items are addressed by index: `data.sources.0.weight=2`).
Unknown keys are rejected with the nearest valid key named; values are type-checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import signal
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import yaml

from .eval.arithmetic import check_corpus_options
from .eval.config import EvalConfig, check_corpus_digits


# The allowed values of every choice key, in one place: loading refuses any other value, naming these.
DType = Literal["bf16", "fp16", "fp32"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2"]
NTLScheduleName = Literal["constant", "linear_warmup"]
NTLVariantName = Literal["was", "mse", "mae", "huber", "number_level"]  # ntl_pretrain.loss.VARIANTS
OffloadDevice = Literal["none", "cpu", "nvme"]
ZeroStage = Literal[0, 1, 2, 3]
LRScheduleName = Literal["cosine", "linear", "constant"]
ProgressBar = Literal["auto", "always", "never"]
ResumeLRSchedule = Literal["error", "keep", "replan"]


def _doc(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose one-line doc is kept in its metadata (for `--help`)."""
    return field(metadata={"doc": text}, **kwargs)


@dataclass
class ModelConfig:
    """Which causal LM to train and how to build it."""

    name_or_path: str | None = _doc(
        "Hub id or local folder for from_pretrained (continued pretraining); null builds a new model "
        "from model.architecture", default=None)
    architecture: dict[str, Any] = _doc(
        "transformers config keys for a model built from scratch (needs model_type, e.g. llama); with "
        "name_or_path set, these keys override the loaded config", default_factory=dict)
    dtype: DType = _doc("training precision: bf16 | fp16 | fp32 (DeepSpeed's bf16/fp16 sections)", default="bf16")
    attn_implementation: AttnImplementation = _doc(
        "auto (flash_attention_2 when flash-attn imports and CUDA is present, else sdpa) | sdpa | eager | "
        "flash_attention_2", default="auto")
    gradient_checkpointing: bool = _doc("recompute activations in backward to save memory", default=False)
    trust_remote_code: bool = _doc("allow model code from the hub (off unless you trust the repository)",
                                   default=False)
    resize_embeddings: bool = _doc(
        "resize the embeddings when the tokenizer has more tokens than the model (new rows: mean init)",
        default=False)
    pad_vocab_to_multiple_of: int = _doc(
        "pad a resized or newly built vocabulary to a multiple of this (times parallel.tp_size if that "
        "does not divide it)", default=64)
    init_seed: int = _doc("seed of the weight initialisation of a model built from scratch", default=1234)
    partitioned_load: bool = _doc(
        "under ZeRO-3, build the model partitioned: with model.name_or_path each rank reads only its share of the "
        "safetensors weights (T=1: its ZeRO partition, T>1: its AutoTP slices); from scratch (T=1) the same "
        "weights as the whole build; false: every rank builds or loads the full model first",
        default=True)


@dataclass
class TokenizerConfig:
    """The tokenizer and its number vocabulary."""

    name_or_path: str | None = _doc("Hub id or local folder; null uses model.name_or_path", default=None)
    train_vocab_size: int = _doc(
        "> 0: when name_or_path does not exist yet, train a digit-level byte-level BPE of this size on the "
        "training data and save it there (the demo's self-made tokenizer)", default=0)
    digit_level: bool = _doc("NTL acts on the ten bare digits 0-9 (else on every token that parses as a number)",
                             default=True)
    allow_non_digit_level: bool = _doc(
        "train digit-level NTL although fewer than 99% of the training data's digits are single-digit tokens "
        "(measured at start-up and logged; the fix is tools/tokenizer.py split-digits)", default=False)


@dataclass
class DataSourceConfig:
    """One dataset of the training mixture."""

    path: str = _doc("local .jsonl/.json/.parquet/.txt file or glob, a folder of them, or a hub dataset id",
                     default="")
    name: str | None = _doc("hub dataset configuration name", default=None)
    split: str = _doc("dataset split to read", default="train")
    text_field: str = _doc("column that holds the document text (unused when prompt_field and completion_field "
                           "are set)", default="text")
    prompt_field: str | None = _doc(
        "column of the prompt; with completion_field, a document is prompt + completion and only the completion's "
        "tokens (and the EOS after it) are targets: the prompt's labels are ignored (null: every token is trained)",
        default=None)
    completion_field: str | None = _doc("column of the completion (set together with prompt_field)", default=None)
    weight: float = _doc("sampling weight in the mixture (normalised over sources)", default=1.0)
    streaming: bool = _doc("stream instead of downloading/tokenizing everything first (large corpora)",
                           default=False)
    generate_arithmetic: int = _doc(
        "> 0: when path does not exist, write this many generated arithmetic and number-rich documents "
        "there first (the demo's self-made corpus)", default=0)
    generate_options: dict[str, Any] = _doc(
        "settings of the generated corpus (seed, text_share, ops, train_digits, extrapolation_digits); with "
        "generate_arithmetic they are its whole identity (recorded beside it; a file generated otherwise is refused)",
        default_factory=dict)


@dataclass
class DataConfig:
    """Datasets, tokenization and packing."""

    sources: list[DataSourceConfig] = _doc("datasets mixed by weight", default_factory=list)
    seq_len: int = _doc("tokens per packed training sequence", default=2048)
    micro_batch_size: int = _doc("sequences per data-parallel rank and micro-batch "
                                 "(DeepSpeed train_micro_batch_size_per_gpu)", default=1)
    validation_documents: int = _doc("documents of each source held out for validation", default=200)
    mask_document_start: bool = _doc(
        "no loss on the first token of a document (predicted from the previous document's EOS)", default=True)
    seed: int = _doc("seed of the document split, shuffling and mixture", default=1234)
    num_proc: int = _doc("processes for tokenization (datasets.map num_proc)", default=1)
    cache_dir: str | None = _doc("datasets cache folder; null uses the Hugging Face default", default=None)


@dataclass
class LossConfig:
    """Cross-entropy plus the Number Token Loss."""

    enabled: bool = _doc("add NTL to CE (false: CE only)", default=True)
    ntl_weight: float = _doc("lambda: loss = CE + lambda * NTL", default=0.3)
    ntl_schedule: NTLScheduleName = _doc("constant | linear_warmup (lambda rises from 0 over ntl_warmup_steps)",
                             default="constant")
    ntl_warmup_steps: int = _doc("steps of the linear lambda warm-up", default=0)
    variant: NTLVariantName = _doc("was | mse | mae | huber | number_level (needs tokenizer.digit_level=true)", default="was")
    reweigh: bool = _doc("scale NTL by the probability mass on number tokens", default=False)
    squash_factor: float | None = _doc("was: farthest wrong digit costs this many times the nearest", default=None)
    smoothing_sigma: float = _doc("was: Gaussian label smoothing of the target over number values", default=0.0)
    float_level: bool = _doc("number_level: a '.' between digits joins them into one number", default=False)
    chunk_tokens: int = _doc("compute LM head + loss over chunks of this many tokens, never the full logits "
                             "(docs/chunked.md; 0 = off)", default=0)
    check_every_step: bool = _doc("debug: re-check labels and the vocabulary-shard layout on every micro-batch "
                                  "(host syncs; normally checked once at start-up)", default=False)

    @property
    def ntl_on(self) -> bool:
        """The one switch of NTL (training, validation, the number-vocabulary checks): on unless
        loss.enabled=false or loss.ntl_weight=0."""
        return self.enabled and self.ntl_weight > 0


@dataclass
class ParallelConfig:
    """Parallelism (DeepSpeed ZeRO and AutoTP)."""

    tp_size: int | Literal["auto"] = _doc("tensor-parallel size (DeepSpeed tensor_parallel.autotp_size); divides the world "
                              "size; auto: the largest that divides the world size and the model's heads, "
                              "within one node (the choice is logged)", default=1)
    zero_stage: ZeroStage = _doc("ZeRO stage 0-3 (DeepSpeed zero_optimization.stage)", default=3)
    offload_optimizer: OffloadDevice = _doc("none | cpu | nvme (zero_optimization.offload_optimizer.device)", default="none")
    offload_param: OffloadDevice = _doc("none | cpu | nvme (zero_optimization.offload_param.device, stage 3)", default="none")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = _doc("peak learning rate", default=3e-4)
    weight_decay: float = _doc("AdamW weight decay", default=0.1)
    betas: list[float] = _doc("AdamW betas", default_factory=lambda: [0.9, 0.95])
    eps: float = _doc("AdamW epsilon", default=1e-8)
    lr_schedule: LRScheduleName = _doc("cosine (WarmupCosineLR) | linear (WarmupDecayLR) | constant (WarmupLR)",
                            default="cosine")
    warmup_steps: int = _doc("learning-rate warm-up steps", default=100)
    min_lr_ratio: float = _doc("cosine: final lr as a fraction of lr", default=0.1)
    grad_clip: float = _doc("clip the global gradient norm to this (DeepSpeed gradient_clipping; 0 = off)",
                            default=1.0)


@dataclass
class TrainConfig:
    """The training loop."""

    output_dir: str = _doc("run folder: resolved config, checkpoints, TensorBoard", default="runs/default")
    max_steps: int = _doc("optimizer steps to train", default=1000)
    grad_accum_steps: int = _doc("micro-batches per optimizer step (DeepSpeed gradient_accumulation_steps)",
                                 default=1)
    seed: int = _doc("seed of dropout and other runtime randomness", default=1234)
    log_every_n_steps: int = _doc("steps between log lines / TensorBoard points", default=1)
    val_every_n_steps: int = _doc("steps between validation losses (0 = only at the end, -1 = never)",
                                  default=200)
    val_batches: int = _doc("micro-batches per data-parallel rank in one validation", default=8)
    resume: str = _doc("none | auto (newest complete checkpoint in output_dir, or a fresh start) | a checkpoint "
                       "tag in output_dir (global_step300)", default="none")
    dist_timeout_minutes: int = _doc("collectives that wait longer than this fail the job instead of hanging",
                                     default=30)
    max_nonfinite_steps: int = _doc("stop with an error (saving nothing) once this many optimizer steps in a row "
                                    "had a non-finite loss or gradient norm; each such step's update is skipped",
                                    default=3)
    startup_timeout_s: float = _doc(
        "each start-up wait (rendezvous, first collective, rank 0 preparing data or the tokenizer while the "
        "others wait, the engine's set-up) fails after this many seconds with a message naming it",
        default=1800.0)


@dataclass
class CheckpointConfig:
    """Saving checkpoints."""

    every_n_steps: int = _doc("steps between checkpoints (0 = only at the end)", default=1000)
    save_final: bool = _doc("save a checkpoint after the last step", default=True)
    keep_last: int = _doc("keep the newest K complete checkpoints, delete older ones (0 = keep all)", default=3)
    keep_every_n_steps: int = _doc(
        "checkpoints at multiples of this step are permanent: never deleted by keep_last (0 = none; a KEEP "
        "file in a checkpoint folder also makes it permanent)", default=0)
    preempt_signals: list[str] = _doc(
        "signals that make every rank save at the next step boundary and exit 0 (cluster pre-emption)",
        default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    preempt_grace_s: float = _doc(
        "seconds from a pre-emption signal to the exit; past it the process exits without the checkpoint "
        "(set it below what the cluster allows, e.g. Slurm's --signal lead time)", default=300.0)
    reshard_on_resume: bool = _doc(
        "resume a checkpoint saved with another dp/tp size or ZeRO stage through a DeepSpeed universal "
        "checkpoint (converted once, beside it)", default=True)
    export_hf_at_end: bool = _doc("after the final checkpoint, export it as a Hugging Face folder", default=False)
    export_dir: str | None = _doc("folder of that export; null uses train.output_dir/hf_export", default=None)
    export_max_shard_size: str = _doc("largest safetensors shard of an export (e.g. 5GB, 500MB)", default="5GB")
    resume_lr_schedule: ResumeLRSchedule = _doc(
        "a resume whose learning-rate schedule differs from the checkpoint's (e.g. another train.max_steps): "
        "error | keep (continue the saved schedule; its final lr past its end) | replan (this run's schedule "
        "at the resumed step; the lr jumps)", default="error")
    allow_data_change: bool = _doc(
        "resume although the data configuration (sources, weights, files, validation_documents, ...) differs "
        "from the checkpoint's: samples may repeat or be skipped (logged)", default=False)


@dataclass
class MonitorConfig:
    """TensorBoard and console output."""

    tensorboard_dir: str | None = _doc("TensorBoard folder; null uses output_dir/tensorboard", default=None)
    progress_bar: ProgressBar = _doc("auto (tqdm on a terminal, log lines otherwise) | always | never", default="auto")


@dataclass
class DeepSpeedSection:
    """A user's own DeepSpeed JSON, merged over the configuration generated from this file."""

    config: str | None = _doc(
        "path of a DeepSpeed JSON; its keys override the generated ones (\"auto\" keeps the generated value)",
        default=None)


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = _doc("the model", default_factory=ModelConfig)
    tokenizer: TokenizerConfig = _doc("the tokenizer", default_factory=TokenizerConfig)
    data: DataConfig = _doc("the data", default_factory=DataConfig)
    loss: LossConfig = _doc("the objective", default_factory=LossConfig)
    parallel: ParallelConfig = _doc("parallelism", default_factory=ParallelConfig)
    optim: OptimConfig = _doc("the optimizer", default_factory=OptimConfig)
    train: TrainConfig = _doc("the loop", default_factory=TrainConfig)
    checkpoint: CheckpointConfig = _doc("checkpoints", default_factory=CheckpointConfig)
    monitor: MonitorConfig = _doc("monitoring", default_factory=MonitorConfig)
    deepspeed: DeepSpeedSection = _doc("DeepSpeed JSON merge", default_factory=DeepSpeedSection)
    eval: EvalConfig = _doc("evaluation hooks (ntl_pretrain.eval)", default_factory=EvalConfig)


class ConfigError(ValueError):
    """A configuration a user wrote is invalid; the message names the key and the fix."""


# ---------------------------------------------------------------------------------------------- keys
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_keys(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, doc) of every leaf key, sections first-to-last."""
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from iter_keys(hint, key + ".")
            continue
        item = _list_item_dataclass(hint)
        if item is not None:
            yield key, hint, _default_of(f), f.metadata.get("doc", "")
            yield from iter_keys(item, key + ".N.")
            continue
        yield key, hint, _default_of(f), f.metadata.get("doc", "")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _list_item_dataclass(hint: Any) -> type | None:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return item
    return None


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    if typing.get_origin(hint) is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join("None" if option is type(None) else _type_name(option) for option in typing.get_args(hint))
    return str(hint).replace("typing.", "")


def help_text() -> str:
    """Every configuration key with its type, default and meaning (for `--help`)."""
    lines = []
    section = None
    for key, hint, default, doc in iter_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            lines.append(f"\n[{top}]")
        lines.append(f"  {key} ({_type_name(hint)}, default {default!r})\n      {doc}")
    return "\n".join(lines)


# Names other tools (HF Trainer, DeepSpeed, Megatron, torchtitan) use for a key of ours: a misspelt key
# that is one of these is pointed at our name, not at the closest spelling (learning_rate -> lr).
SYNONYMS = {
    "learning_rate": "optim.lr", "max_lr": "optim.lr", "peak_lr": "optim.lr",
    "adam_epsilon": "optim.eps", "adam_eps": "optim.eps", "adam_beta1": "optim.betas", "adam_beta2": "optim.betas",
    "max_grad_norm": "optim.grad_clip", "gradient_clipping": "optim.grad_clip", "clip_grad": "optim.grad_clip",
    "num_warmup_steps": "optim.warmup_steps", "warmup": "optim.warmup_steps", "lr_warmup_steps": "optim.warmup_steps",
    "lr_scheduler_type": "optim.lr_schedule", "lr_scheduler": "optim.lr_schedule", "min_lr": "optim.min_lr_ratio",
    "decay": "optim.weight_decay",
    "max_seq_len": "data.seq_len", "seq_length": "data.seq_len", "max_length": "data.seq_len",
    "sequence_length": "data.seq_len", "block_size": "data.seq_len", "max_seq_length": "data.seq_len",
    "batch_size": "data.micro_batch_size", "per_device_train_batch_size": "data.micro_batch_size",
    "train_micro_batch_size_per_gpu": "data.micro_batch_size", "micro_batch": "data.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps", "grad_accum": "train.grad_accum_steps",
    "train_steps": "train.max_steps", "total_steps": "train.max_steps", "steps": "train.max_steps",
    "train_iters": "train.max_steps", "logging_steps": "train.log_every_n_steps",
    "log_interval": "train.log_every_n_steps", "eval_steps": "train.val_every_n_steps",
    "eval_interval": "train.val_every_n_steps", "save_steps": "checkpoint.every_n_steps",
    "save_interval": "checkpoint.every_n_steps", "save_total_limit": "checkpoint.keep_last",
    "model_name_or_path": "model.name_or_path", "tokenizer_name": "tokenizer.name_or_path",
    "tensor_parallel_size": "parallel.tp_size", "tensor_model_parallel_size": "parallel.tp_size",
    "autotp_size": "parallel.tp_size", "tp": "parallel.tp_size", "stage": "parallel.zero_stage",
    "zero": "parallel.zero_stage", "ntl_lambda": "loss.ntl_weight", "lambda": "loss.ntl_weight",
    "lam": "loss.ntl_weight", "torch_dtype": "model.dtype", "precision": "model.dtype",
    "mixed_precision": "model.dtype", "output_path": "train.output_dir", "save_dir": "train.output_dir",
}


def _tokens(name: str) -> set[str]:
    return {t for t in name.lower().replace("-", "_").split("_") if t}


def _leaf_score(name: str, candidate: str) -> float:
    """Spelling similarity plus the share of words (split at '_') the two names have in common."""
    spelling = difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio()
    shared = len(_tokens(name) & _tokens(candidate)) / max(len(_tokens(name) | _tokens(candidate)), 1)
    return spelling + shared


def _nearest(key: str, candidates: list[str]) -> str:
    """The valid dotted key a user most likely meant: a known synonym first (in the same section when the
    section is right), then the same leaf name in another section, then the best-scoring leaf within the
    same section, then the best-scoring key overall."""
    parts = key.split(".")
    leaf, section = parts[-1], ".".join(parts[:-1])
    normalised = leaf.lower().replace("-", "_")
    synonym = SYNONYMS.get(normalised)
    if synonym is not None:
        same = [c for c in candidates if c.rsplit(".", 1)[0] == section and c.rsplit(".", 1)[-1] == synonym.rsplit(".", 1)[-1]]
        return same[0] if same else synonym
    same_leaf = [c for c in candidates if c.rsplit(".", 1)[-1] == normalised]
    if same_leaf:
        return same_leaf[0]
    siblings = [c for c in candidates if c.rsplit(".", 1)[0] == section]
    pool = siblings or candidates
    target = leaf if siblings else key
    best = max(pool, key=lambda c: _leaf_score(target, c.rsplit(".", 1)[-1] if siblings else c), default="")
    return best


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    full_valid = [k for k, *_ in iter_keys()]
    index = re.search(r"\.(\d+)\.", key)  # data.sources.3.text_feild: match as .N., answer with .3.
    pattern = re.sub(r"\.\d+\.", ".N.", key)
    nearest = _nearest(pattern, full_valid)
    if index is not None:
        nearest = nearest.replace(".N.", f".{index.group(1)}.", 1)
    nearest = nearest.replace(".N.", ".0.")
    return ConfigError(f"unknown config key {key!r} ({where}); did you mean {nearest!r}? "
                       f"See `launch/pretrain.sh --help` for every key.")


# ---------------------------------------------------------------------------------------------- typing
def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check (and where lossless, convert) a YAML value against a field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        if len(errors) > 1:  # int | Literal["auto"]: name every kind of value the key takes
            expected = " or ".join(_expected(option) for option in options if option is not type(None))
            raise ConfigError(f"{key} must be {expected}, got {type(value).__name__} {value!r}")
        raise ConfigError(errors[0] if errors else f"{key}: cannot be null")
    if hint is Any:
        return value
    if origin is Literal:
        for choice in typing.get_args(hint):
            if value == choice and type(value) is type(choice):  # true is not 1, "3" is not 3
                return choice
        raise ConfigError(f"{key}={value!r} is not one of {_choices(hint)}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {hint.__name__} keys, got {value!r}")
        return _build(hint, value, key + ".")
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {type(value).__name__} {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {type(value).__name__} {value!r}")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:  # YAML 1.1 reads "1e-4" (no dot) as a string
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(number):  # .nan slips through every `< 0` check; .inf means nothing here
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {type(value).__name__} {value!r}; quote it in YAML")
    raise ConfigError(f"{key}: unsupported type {hint}")


def _choices(hint: Any) -> str:
    """The allowed values of a Literal type, as a user writes them."""
    return ", ".join(str(choice) for choice in typing.get_args(hint))


def _expected(hint: Any) -> str:
    """What a value of type `hint` is, in words (for an error naming every kind a key takes)."""
    if typing.get_origin(hint) is Literal:
        return f"one of {_choices(hint)}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, _type_name(hint))


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise _unknown_key_error(f"{prefix}{key}", names, f"not a key of [{prefix.rstrip('.') or 'top level'}]")
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- overrides
def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set `a.b.0.c` in a nested dict/list tree, creating mappings on the way (checked later)."""
    parts = key.split(".")
    node: Any = tree
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is a list of {len(node)} items; "
                                  f"use an index 0..{len(node)}")
            index = int(part)
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
            else:
                if node[index] is None:
                    node[index] = {}
                node = node[index]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[:depth])} is not a section")
        if last:
            node[part] = value
        else:
            child = node.get(part)
            if child is None:
                child = [] if parts[depth + 1].isdigit() else {}
                node[part] = child
            node = child


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` -> (key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"command-line argument {text!r} is not an override of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has no key before '='")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _validate_override_key(key: str) -> None:
    """Reject an override of a key that does not exist, naming the nearest one."""
    parts = key.split(".")
    cls: Any = Config
    walked = []
    for part in parts:
        if part.isdigit() and walked and isinstance(cls, tuple):
            cls = cls[1]
            walked.append(part)
            continue
        if not dataclasses.is_dataclass(cls):
            if walked and cls is not None and typing.get_origin(cls) is dict:
                return  # free-form mapping (model.architecture.hidden_size)
            raise _unknown_key_error(key, [], f"{'.'.join(walked)} has no sub-keys")
        hints = _type_hints(cls)
        if part not in hints:
            raise _unknown_key_error(key, list(hints), "not a known key")
        hint = hints[part]
        item = _list_item_dataclass(hint)
        cls = ("list", item) if item is not None else hint
        walked.append(part)


# ---------------------------------------------------------------------------------------------- load/save
def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start from defaults), apply `key=value` overrides, validate."""
    tree: dict = {}
    if path is not None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist (pass --config configs/NAME.yaml)")
        with open(path, encoding="utf-8") as handle:
            try:
                tree = yaml.safe_load(handle) or {}
            except yaml.YAMLError as error:
                raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(tree).__name__}")
    for text in overrides:
        key, value = parse_override(text)
        _validate_override_key(key)
        _set_dotted(tree, key, value)
    config = _build(Config, tree)
    validate(config)
    return config


def get_key(config: Config, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def validate(config: Config) -> None:
    """Checks that need several keys or value ranges (types were checked while loading)."""
    positive = ["data.seq_len", "data.micro_batch_size", "train.max_steps", "train.grad_accum_steps",
                "model.pad_vocab_to_multiple_of", "train.log_every_n_steps",
                "data.num_proc", "train.dist_timeout_minutes", "train.val_batches", "train.max_nonfinite_steps"]
    for key in positive:
        if get_key(config, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {get_key(config, key)}")
    tp_size = config.parallel.tp_size
    if isinstance(tp_size, int) and tp_size < 1:
        raise ConfigError(f"parallel.tp_size must be >= 1 or auto, got {tp_size!r}")
    if not config.train.startup_timeout_s > 0:
        raise ConfigError(f"train.startup_timeout_s must be > 0, got {config.train.startup_timeout_s}")
    if config.parallel.offload_param != "none" and config.parallel.zero_stage != 3:
        raise ConfigError("parallel.offload_param needs parallel.zero_stage=3")
    if config.model.name_or_path is None and not config.model.architecture:
        raise ConfigError("set model.name_or_path (continued pretraining) or model.architecture "
                          "(a new model, e.g. {model_type: llama, hidden_size: 256, ...})")
    if config.model.name_or_path is None and "model_type" not in config.model.architecture:
        raise ConfigError("model.architecture needs model_type (e.g. llama, qwen2, mistral) to build a new model")
    if not config.data.sources:
        raise ConfigError("data.sources is empty; add at least one source, e.g. "
                          "data.sources=[{path: corpus.jsonl, text_field: text}]")
    for i, source in enumerate(config.data.sources):
        if not source.path:
            raise ConfigError(f"data.sources.{i}.path is empty; give a file, folder or hub dataset id")
        if not source.weight > 0:
            raise ConfigError(f"data.sources.{i}.weight must be > 0, got {source.weight}")
        if source.generate_arithmetic < 0:
            raise ConfigError(f"data.sources.{i}.generate_arithmetic must be >= 0")
        if (source.prompt_field is None) != (source.completion_field is None):
            given, missing = ("prompt_field", "completion_field") if source.completion_field is None else \
                ("completion_field", "prompt_field")
            raise ConfigError(f"data.sources.{i}.{given} is set but data.sources.{i}.{missing} is not: set both (loss "
                              f"on the completion only) or neither (loss on every token of text_field)")
        if source.prompt_field is not None and source.prompt_field == source.completion_field:
            raise ConfigError(f"data.sources.{i}.prompt_field and completion_field are both {source.prompt_field!r}; "
                              f"name two different columns")
    try:  # the generated corpus's options, and the arithmetic benchmark's digits against them
        corpora = [(f"data.sources.{i}.generate_options", source.generate_options)
                   for i, source in enumerate(config.data.sources) if source.generate_arithmetic > 0]
        for where, options in corpora:
            check_corpus_options(options, where)
        check_corpus_digits(config.eval, corpora)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.data.validation_documents < 0:
        raise ConfigError("data.validation_documents must be >= 0")
    if config.train.val_every_n_steps >= 0 and config.data.validation_documents == 0:
        raise ConfigError("validation is on (train.val_every_n_steps >= 0) but data.validation_documents=0; "
                          "hold out documents or set train.val_every_n_steps=-1")
    _check_ranges(config)
    if config.loss.chunk_tokens < 0:
        raise ConfigError(f"loss.chunk_tokens must be >= 0 (0 = full logits), got {config.loss.chunk_tokens}")
    if config.loss.ntl_on and config.loss.variant == "number_level" and not config.tokenizer.digit_level:
        raise ConfigError("loss.variant=number_level composes numbers from single-digit tokens and needs "
                          "tokenizer.digit_level=true, not tokenizer.digit_level=false (multi-digit tokens); or "
                          "choose a token-level loss.variant (was, mse, mae, huber)")
    if config.loss.ntl_schedule == "linear_warmup" and config.loss.ntl_warmup_steps < 1:
        raise ConfigError("loss.ntl_schedule=linear_warmup needs loss.ntl_warmup_steps >= 1")
    if len(config.optim.betas) != 2:
        raise ConfigError(f"optim.betas must be two numbers, got {config.optim.betas}")
    if config.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {config.optim.warmup_steps}")
    if config.checkpoint.every_n_steps < 0:
        raise ConfigError("checkpoint.every_n_steps must be >= 0")
    if config.checkpoint.keep_last < 0 or config.checkpoint.keep_every_n_steps < 0:
        raise ConfigError("checkpoint.keep_last and checkpoint.keep_every_n_steps must be >= 0 (0 = keep all / none)")
    if not config.checkpoint.preempt_grace_s > 0:
        raise ConfigError(f"checkpoint.preempt_grace_s must be > 0, got {config.checkpoint.preempt_grace_s}")
    for name in config.checkpoint.preempt_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"checkpoint.preempt_signals: {name!r} is not a catchable signal name "
                              f"(e.g. SIGTERM, SIGUSR1, SIGUSR2)")
    if config.tokenizer.name_or_path is None and config.model.name_or_path is None:
        raise ConfigError("set tokenizer.name_or_path (a model built from scratch has no tokenizer of its own)")
    ntl_settings(config.loss)  # the loss's own checks (squash_factor, smoothing with number_level, ...) now, not after the build


# (key, low, high or None, low allowed, high allowed, what it means): the range of every float key
_FLOAT_RANGES = [
    ("optim.lr", 0.0, None, False, None, "the peak learning rate, e.g. 3e-4"),
    ("optim.weight_decay", 0.0, None, True, None, "0 turns weight decay off"),
    ("optim.eps", 0.0, None, False, None, "AdamW's epsilon, e.g. 1e-8"),
    ("optim.min_lr_ratio", 0.0, 1.0, True, True, "the final lr as a fraction of optim.lr"),
    ("optim.grad_clip", 0.0, None, True, None, "0 turns clipping off"),
    ("loss.ntl_weight", 0.0, None, True, None, "0 (or loss.enabled=false) turns NTL off"),
    ("loss.smoothing_sigma", 0.0, None, True, None, "0 turns label smoothing off"),
    ("checkpoint.preempt_grace_s", 0.0, None, False, None, "seconds from the signal to the exit"),
]


def _check_ranges(config: Config) -> None:
    """Every float key within its range (non-finite values were refused while loading)."""
    for key, low, high, low_ok, high_ok, meaning in _FLOAT_RANGES:
        value = get_key(config, key)
        below = value < low if low_ok else value <= low
        above = high is not None and (value > high if high_ok else value >= high)
        if below or above:
            lower = f"{'>=' if low_ok else '>'} {low:g}"
            bound = lower if high is None else f"{lower} and {'<=' if high_ok else '<'} {high:g}"
            raise ConfigError(f"{key} must be {bound}, got {value:g} ({meaning})")
    for i, beta in enumerate(config.optim.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optim.betas.{i}={beta:g} must be in [0, 1) (AdamW's moment decay, e.g. [0.9, 0.95])")
    if config.loss.squash_factor is not None and not math.isfinite(config.loss.squash_factor):
        raise ConfigError(f"loss.squash_factor must be a finite number > 1 or null, got {config.loss.squash_factor}")


def ntl_settings(loss: LossConfig) -> Any:
    """The loss's `NTLSettings` from the loss section; its own checks as a ConfigError naming the keys."""
    from .loss import NTLSettings

    try:
        return NTLSettings(variant=loss.variant, reweigh=loss.reweigh, squash_factor=loss.squash_factor,
                           smoothing_sigma=loss.smoothing_sigma, float_level=loss.float_level)
    except ValueError as error:
        raise ConfigError(f"loss settings (loss.variant={loss.variant!r}, loss.squash_factor={loss.squash_factor}, "
                          f"loss.smoothing_sigma={loss.smoothing_sigma}, loss.float_level={loss.float_level}) do not "
                          f"fit together: {error}") from None


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


def write_resolved(config: Config, directory: str, filename: str = "config.yaml") -> str:
    """Write the resolved configuration into the run folder (atomically)."""
    from .fs import write_text_atomic

    return write_text_atomic(os.path.join(directory, filename), to_yaml(config))
