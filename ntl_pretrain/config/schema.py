"""The configuration schema: one dataclass a section, every field with a default and a one-line doc, and
the allowed values of every choice key (`Literal`s) in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import ConfigError  # noqa: F401 (the config package's API)
from ..core.lr_schedules import LR_SCHEDULES
from ..core.options import merged_dataclass
from ..core.options import option as _doc  # a field with its one-line doc (for `--help`)
from ..eval.config import EvalConfig
from ..loss.heads import LossHeadOptions
from ..loss.variants import VARIANTS, VariantOptions

# The allowed values of every choice key, in one place: loading refuses any other value, naming these.
DType = Literal["bf16", "fp16", "fp32"]
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2"]
NTLScheduleName = Literal["constant", "linear_warmup"]
NTLVariantName = Literal[VARIANTS]  # the registered NTL variants (ntl_pretrain/loss/variants/)
OffloadDevice = Literal["none", "cpu", "nvme"]
ZeroStage = Literal[0, 1, 2, 3]
LRScheduleName = Literal[tuple(LR_SCHEDULES)]  # ntl_pretrain.core.lr_schedules.LR_SCHEDULES
DecayShapeName = Literal["linear", "cosine", "1-sqrt"]
ProgressBar = Literal["auto", "always", "never"]
WandbMode = Literal["online", "offline", "disabled"]
ResumeLRSchedule = Literal["error", "keep", "replan"]
SourceFormat = Literal["text", "prepared", "tokenized"]  # ntl_pretrain.data: how a source's rows are read


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
    format: SourceFormat = _doc(
        "text (documents tokenized by the run) | prepared (a folder written by tools/prepare_data.py: tokenized and "
        "packed once, memory-mapped, checked against the run's tokenizer and settings) | tokenized (the user's own "
        "token ids: an input_ids column of one document each, optionally a loss_mask column, 1 = trained)",
        default="text")
    name: str | None = _doc("hub dataset configuration name", default=None)
    split: str = _doc("dataset split to read", default="train")
    text_field: str = _doc("column that holds the document text (unused when prompt_field and completion_field "
                           "are set)", default="text")
    prompt_field: str | None = _doc(
        "column of the prompt; with completion_field, a document is prompt + completion and only the completion's "
        "tokens (and the EOS after it) are targets: the prompt's labels are ignored (null: every token is trained)",
        default=None)
    completion_field: str | None = _doc("column of the completion (set together with prompt_field)", default=None)
    prompt_template: str | None = _doc(
        "completion-only sources (required there): the text before the completion, a format string over the row's "
        "columns where {prompt} is prompt_field's value (\"Question: {question}\\nAnswer: \"; \"{prompt}\" joins "
        "prompt and completion as they are), or 'chat': the tokenizer's chat template (a user turn, then the "
        "assistant's completion, as TRL does)", default=None)
    weight: float = _doc("sampling weight in the mixture (normalised over sources); with data.stages, the stages' "
                         "weights are used instead", default=1.0)
    label: str | None = _doc(
        "a short name of the source (letters, digits, _ - .; unique): data.stages.N.weights may give weights by it, "
        "and logs and TensorBoard's data/source_share/LABEL name it (null: sources.N)", default=None)
    streaming: bool = _doc("stream instead of downloading/tokenizing everything first (large corpora)",
                           default=False)
    generate_arithmetic: int = _doc(
        "> 0: when path does not exist, write this many generated arithmetic and number-rich documents "
        "there first (the demo's self-made corpus)", default=0)
    generate_options: dict[str, Any] = _doc(
        "settings of the generated corpus (seed, text_share, ops, train_digits, extrapolation_digits); with "
        "generate_arithmetic they are its whole identity (recorded beside it; a file generated otherwise is refused)",
        default_factory=dict)


CHAT_TEMPLATE = "chat"  # prompt_template: the tokenizer's chat template
PREPARED = "prepared"  # format of a corpus written by tools/prepare_data.py
TOKENIZED = "tokenized"  # format of a user's token-id dataset


def check_prompt_template(source: DataSourceConfig, key: str) -> None:
    """A completion-only source names how its prompt and completion are joined (never glued silently), with
    a template that formats: `{prompt}` or column names, no positional or attribute fields."""
    import string

    if source.prompt_field is None or source.completion_field is None:
        if source.prompt_template is not None:
            raise ConfigError(f"{key}.prompt_template is set but prompt_field/completion_field are not: set both "
                              f"fields (loss on the completion only) or drop prompt_template")
        return
    if source.prompt_template is None:
        raise ConfigError(f"{key}.prompt_template is not set: say what goes between the prompt and the completion, "
                          f"e.g. prompt_template: \"Question: {{{source.prompt_field}}}\\nAnswer: \", \"{{prompt}}\\n\", "
                          f"\"{{prompt}}\" (joined as they are, as the arithmetic corpus's \"12+3=\" and \"15\") or chat")
    if source.prompt_template == CHAT_TEMPLATE:
        return
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(source.prompt_template) if field is not None]
    except ValueError as error:
        raise ConfigError(f"{key}.prompt_template={source.prompt_template!r} is not a format string ({error}); "
                          f"write {{column}} for a column's text and {{{{ }}}} for a literal brace") from None
    bad = [field for field in fields if not field.isidentifier()]
    if bad:
        raise ConfigError(f"{key}.prompt_template={source.prompt_template!r} has the field(s) {bad}: use {{prompt}} or "
                          f"{{column_name}} only")


@dataclass
class DataStageConfig:
    """One stage of a staged data mixture: from its first step on (until the next stage's), its source weights."""

    start_step: int = _doc("the first optimizer step of the stage (the first stage's is 1); it lasts until the step "
                           "before the next stage's start_step, the last one to the end of the run", default=1)
    weights: list[float] | dict[str, float] = _doc(
        "the sources' sampling weights in this stage (>= 0, one > 0; normalised): a list, one per data.sources entry "
        "in order, or a mapping {label: weight} by data.sources.N.label (sources left out: 0)", default_factory=list)


@dataclass(frozen=True)
class Stage:
    """A stage as the stream uses it: its first step and one weight per source, in data.sources' order."""

    start_step: int
    weights: tuple[float, ...]


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
    document_mask: bool = _doc(
        "attention stays inside each packed document: position ids restart after every EOS and no token attends "
        "to an earlier document (false: attention spans the whole packed row, as before; docs/training.md)",
        default=True)
    seed: int = _doc("seed of the document split, shuffling and mixture", default=1234)
    num_proc: int = _doc("processes for tokenization (datasets.map num_proc)", default=1)
    max_document_chars: int = _doc(
        "longest text field trained on, in characters; a longer document is skipped (counted and named in the log): "
        "one 50 MB line made the Rust tokenizer abort the process", default=4_000_000)
    cache_dir: str | None = _doc("datasets cache folder; null uses the Hugging Face default", default=None)
    stages: list[DataStageConfig] = _doc(
        "a staged mixture (e.g. a share of the original pretraining data replayed): stages in order, the first from "
        "step 1, each with its own source weights; empty: one mixture by data.sources.N.weight", default_factory=list)

    def source_names(self) -> list[str]:
        """What logs and TensorBoard call each source: its label, or sources.N."""
        return [source.label or f"sources.{i}" for i, source in enumerate(self.sources)]

    def stage_table(self) -> list[Stage]:
        """The mixture's stages with their weights in data.sources' order: data.stages resolved (labels looked up,
        a source a mapping leaves out at 0), or one stage from step 1 by the sources' `weight` (checked by
        `config.validate`)."""
        if not self.stages:
            return [Stage(1, tuple(float(source.weight) for source in self.sources))]
        labels = [source.label for source in self.sources]
        return [Stage(stage.start_step, tuple(float(w) for w in stage.weights) if isinstance(stage.weights, list)
                      else tuple(float(stage.weights.get(label, 0.0)) if label is not None else 0.0
                                 for label in labels))
                for stage in self.stages]


@dataclass
class NTLChoice:
    """The first keys of the loss section: CE plus how much NTL, and which variant (its options follow)."""

    enabled: bool = _doc("add NTL to CE (false: CE only)", default=True)
    ntl_weight: float = _doc("lambda: loss = CE + lambda * NTL", default=0.3)
    ntl_schedule: NTLScheduleName = _doc("constant | linear_warmup (lambda rises from 0 over ntl_warmup_steps)",
                             default="constant")
    ntl_warmup_steps: int = _doc("steps of the linear lambda warm-up", default=0)
    variant: NTLVariantName = _doc("the NTL variant (docs/loss.md); number_level, del and digit_entropy need "
                                   "tokenizer.digit_level=true", default="was")
    reweigh: bool = _doc("scale NTL by the probability mass on number tokens", default=False)


class LossSection:
    """The methods of `LossConfig`."""

    @property
    def ntl_on(self) -> bool:
        """The one switch of NTL (training, validation, the number-vocabulary checks): on unless
        loss.enabled=false or loss.ntl_weight=0."""
        return self.enabled and self.ntl_weight > 0  # type: ignore[attr-defined]


# Cross-entropy plus the Number Token Loss: `NTLChoice`, every NTL variant's options (defined in its module,
# ntl_pretrain/loss/variants/), then the loss heads' keys (each head's own, ntl_pretrain/loss/heads.py).
LossConfig = merged_dataclass("LossConfig", (NTLChoice, VariantOptions, LossHeadOptions), bases=(LossSection,),
                              module=__name__, doc="Cross-entropy plus the Number Token Loss.")


@dataclass
class ParallelConfig:
    """Parallelism (DeepSpeed ZeRO, AutoTP and Ulysses sequence parallelism)."""

    tp_size: int | Literal["auto"] = _doc("tensor-parallel size (DeepSpeed tensor_parallel.autotp_size); divides the world "
                              "size; auto: the largest that divides the world size and the model's heads, "
                              "within one node (the choice is logged)", default=1)
    sp_size: int = _doc("sequence-parallel (Ulysses) size: the consecutive ranks that split one sample's sequence; "
                        "divides world size / tp_size; > 1 needs tp_size=1", default=1)
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
    lr_schedule: LRScheduleName = _doc(" | ".join(f"{name} ({schedule.summary})"
                                                  for name, schedule in LR_SCHEDULES.items()), default="cosine")
    warmup_steps: int = _doc("learning-rate warm-up steps", default=100)
    min_lr_ratio: float = _doc("cosine, wsd: the floor of the decay as a fraction of lr, reached one step after "
                               "train.max_steps (the last step trains above it)", default=0.1)
    decay_fraction: float = _doc("wsd: share of train.max_steps spent decaying, at the end (0 = no decay)",
                                 default=0.1)
    decay_shape: DecayShapeName = _doc("wsd: linear | cosine | 1-sqrt (Hagele et al. 2024: 1 - sqrt(x) of the "
                                       "drop left at x of the decay, so half the drop in its first quarter)",
                                       default="linear")
    warmup_start_lr_ratio: float = _doc("the warm-up starts at this fraction of lr (re-warming a model whose "
                                        "earlier run ended at a lower lr, e.g. its min_lr_ratio); 0 = from 0",
                                        default=0.0)
    grad_clip: float = _doc("clip the global gradient norm to this (DeepSpeed gradient_clipping; 0 = off)",
                            default=1.0)


@dataclass
class TrainConfig:
    """The training loop."""

    output_dir: str = _doc("run folder: resolved config, checkpoints, TensorBoard", default="runs/default")
    max_steps: int = _doc("optimizer steps to train", default=1000)
    grad_accum_steps: int = _doc("micro-batches per optimizer step (DeepSpeed gradient_accumulation_steps)",
                                 default=1)
    seed: int = _doc("seeds Python's random, NumPy's and torch's generators on every rank at start-up (dropout and "
                     "other runtime randomness)", default=1234)
    log_every_n_steps: int = _doc("steps between log lines / TensorBoard points", default=1)
    val_every_n_steps: int = _doc("steps between validation losses, and one after the last step (0 or -1 = no "
                                  "validation; train.max_steps or more = only after the last step)",
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

    def validates_after(self, step: int) -> bool:
        """Whether validation runs after optimizer step `step`: every val_every_n_steps and after the last step;
        never with val_every_n_steps 0 or -1."""
        every = self.val_every_n_steps
        return every > 0 and (step % every == 0 or step == self.max_steps)

    @property
    def validation_on(self) -> bool:
        return self.val_every_n_steps > 0


@dataclass
class CheckpointConfig:
    """Saving checkpoints."""

    every_n_steps: int = _doc("steps between checkpoints (0 = only at the end)", default=1000)
    save_final: bool = _doc("save a checkpoint after the last step", default=True)
    keep_last: int = _doc("keep the newest K complete checkpoints, delete older ones (0 = keep all)", default=3)
    async_save: bool = _doc(
        "write the periodic checkpoints in the background: the step loop pauses only to copy each rank's "
        "checkpoint into host memory (as much memory as its files) and continues while a thread writes and "
        "hashes them; committed at a later step boundary, with the same atomic rename (docs/checkpoints.md)",
        default=False)
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
    export_max_shard_size: str | int = _doc("largest safetensors shard of an export (e.g. 5GB, 500MB, or bytes)",
                                            default="5GB")
    resume_lr_schedule: ResumeLRSchedule = _doc(
        "a resume whose learning-rate schedule differs from the checkpoint's (e.g. another train.max_steps): "
        "error | keep (continue the saved schedule; its final lr past its end) | replan (this run's schedule "
        "at the resumed step; the lr jumps)", default="error")
    allow_data_change: bool = _doc(
        "resume although the data configuration (sources, weights, files, validation_documents, ...) differs "
        "from the checkpoint's: samples may repeat or be skipped (logged)", default=False)


@dataclass
class WandbConfig:
    """Weights & Biases: the TensorBoard figures also logged to a W&B run (global rank 0; `pip install wandb`)."""

    enabled: bool = _doc("log to Weights & Biases too", default=False)
    project: str = _doc("W&B project", default="ntl-pretrain")
    entity: str | None = _doc("W&B team or user; null uses your default entity", default=None)
    name: str | None = _doc("run name; null uses the run folder's name (train.output_dir)", default=None)
    mode: WandbMode = _doc("online | offline (written to dir only; upload later with `wandb sync`) | disabled",
                           default="online")
    dir: str | None = _doc("folder W&B writes its files under (a wandb/ folder in it); null uses train.output_dir",
                           default=None)
    tags: list[str] = _doc("tags of the W&B run", default_factory=list)


@dataclass
class MlflowConfig:
    """MLflow: the TensorBoard figures also logged to an MLflow run (global rank 0; `pip install mlflow-skinny`)."""

    enabled: bool = _doc("log to MLflow too", default=False)
    tracking_uri: str | None = _doc(
        "tracking server (http://host:5000), database (sqlite:///mlflow.db) or local folder (file:///path/mlruns); "
        "null uses MLFLOW_TRACKING_URI or ./mlruns", default=None)
    experiment: str = _doc("MLflow experiment name (created when missing)", default="ntl-pretrain")
    run_name: str | None = _doc("run name; null uses the run folder's name (train.output_dir)", default=None)


@dataclass
class MonitorConfig:
    """TensorBoard, console output and the optional trackers (W&B, MLflow)."""

    tensorboard_dir: str | None = _doc("TensorBoard folder; null uses output_dir/tensorboard", default=None)
    progress_bar: ProgressBar = _doc("auto (tqdm on a terminal, log lines otherwise) | always | never", default="auto")
    wandb: WandbConfig = _doc("Weights & Biases (off by default)", default_factory=WandbConfig)
    mlflow: MlflowConfig = _doc("MLflow (off by default)", default_factory=MlflowConfig)


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

