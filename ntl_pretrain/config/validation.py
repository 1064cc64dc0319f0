"""Checks of a loaded configuration that need several keys or value ranges (types were checked while
loading)."""

from __future__ import annotations

import math
import os
import re
import signal
import sys

from ..checkpoint.export import max_shard_bytes
from ..checkpoint.format import CheckpointError, step_of_tag
from ..eval.arithmetic import check_corpus_options
from ..eval.config import check_corpus_digits
from ..loss.settings import SETTINGS_KEYWORDS, NTLSettings, check_ntl_weight
from ..loss.variants import any_vocabulary_variants, variant_of
from .parsing import get_key
from ..core.lr_schedules import LR_SCHEDULES, schedule_lengths, wsd_decay_num_steps
from .schema import Config, ConfigError, DataConfig, LossConfig, OptimConfig, check_prompt_template


def validate(config: Config) -> None:
    """Checks that need several keys or value ranges (types were checked while loading)."""
    positive = ["data.seq_len", "data.micro_batch_size", "train.max_steps", "train.grad_accum_steps",
                "model.pad_vocab_to_multiple_of", "train.log_every_n_steps",
                "data.num_proc", "train.dist_timeout_minutes", "train.val_batches", "train.max_nonfinite_steps"]
    for key in positive:
        if get_key(config, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {get_key(config, key)}")
    for key in ("data.seed", "train.seed", "model.init_seed"):  # numpy's generators refuse a negative seed mid-start-up
        if not 0 <= get_key(config, key) < 2**63:
            raise ConfigError(f"{key} must be a seed in [0, 2**63), got {get_key(config, key)}")
    tp_size = config.parallel.tp_size
    if isinstance(tp_size, int) and tp_size < 1:
        raise ConfigError(f"parallel.tp_size must be >= 1 or auto, got {tp_size!r}")
    if config.parallel.sp_size < 1:
        raise ConfigError(f"parallel.sp_size must be >= 1, got {config.parallel.sp_size}")
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
        check_prompt_template(source, f"data.sources.{i}")
    check_stages(config.data)
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
    if config.train.validation_on and config.data.validation_documents == 0:
        raise ConfigError(f"validation is on (train.val_every_n_steps={config.train.val_every_n_steps}) but "
                          f"data.validation_documents=0; hold out documents or set train.val_every_n_steps=0 (off)")
    _check_ranges(config)
    if config.train.max_steps > MAX_STEPS_LIMIT:
        raise ConfigError(f"train.max_steps={config.train.max_steps} is more than {MAX_STEPS_LIMIT:.0e} steps (decades "
                          f"at a step a second): give the number of optimizer steps to train, e.g. train.max_steps=1000")
    if config.loss.ntl_weight >= NTL_WEIGHT_LIMIT:
        raise ConfigError(f"loss.ntl_weight={config.loss.ntl_weight:g} must be < {NTL_WEIGHT_LIMIT:g} (the loss would "
                          f"overflow in bf16/fp16 and cross-entropy vanish beside it); the paper uses 0.1-1, e.g. 0.3")
    if config.loss.chunk_tokens < 0:
        raise ConfigError(f"loss.chunk_tokens must be >= 0 (0 = full logits), got {config.loss.chunk_tokens}")
    needs_digits = variant_of(config.loss.variant).single_digits_because
    if config.loss.ntl_on and needs_digits and not config.tokenizer.digit_level:
        raise ConfigError(f"loss.variant={config.loss.variant} {needs_digits} and needs "
                          f"tokenizer.digit_level=true, not tokenizer.digit_level=false (multi-digit tokens); or "
                          f"choose a token-level loss.variant ({', '.join(any_vocabulary_variants())})")
    if config.loss.ntl_schedule == "linear_warmup" and config.loss.ntl_warmup_steps < 1:
        raise ConfigError("loss.ntl_schedule=linear_warmup needs loss.ntl_warmup_steps >= 1")
    if len(config.optim.betas) != 2:
        raise ConfigError(f"optim.betas must be two numbers, got {config.optim.betas}")
    if config.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {config.optim.warmup_steps}")
    _check_lr_schedule(config)
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
    _check_run_folder(config)
    _check_trackers(config)
    if config.tokenizer.name_or_path is None and config.model.name_or_path is None:
        raise ConfigError("set tokenizer.name_or_path (a model built from scratch has no tokenizer of its own)")
    ntl_settings(config.loss)  # the loss's own checks (squash_factor, smoothing with number_level, ...) now, not after the build


LABEL_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")  # a source label: a TensorBoard tag part and a YAML key as written


def check_stages(data: DataConfig) -> None:
    """data.sources.N.label and data.stages: labels unique names; stages from step 1, in order, one weight >= 0 per
    source (a list aligned with data.sources or a mapping by label), one > 0 a stage. One line naming the key."""
    labels: dict[str, int] = {}
    for i, source in enumerate(data.sources):
        if source.label is None:
            continue
        if not LABEL_PATTERN.fullmatch(source.label):
            raise ConfigError(f"data.sources.{i}.label={source.label!r} is not a name: use letters, digits, _ - . "
                              f"only (e.g. label: web), or null")
        if source.label in labels:
            raise ConfigError(f"data.sources.{i}.label={source.label!r} is also data.sources.{labels[source.label]}"
                              f".label: a label names one source; rename one")
        labels[source.label] = i
    if not data.stages:  # the sources' own weights are the mixture
        check_weight_sum("data.sources.N.weight", [source.weight for source in data.sources])
    for k, stage in enumerate(data.stages):
        key = f"data.stages.{k}"
        if k == 0 and stage.start_step != 1:
            raise ConfigError(f"{key}.start_step={stage.start_step}: the first stage must start at step 1 (the "
                              f"stages cover the run from its first step); set {key}.start_step=1")
        if k > 0 and stage.start_step <= data.stages[k - 1].start_step:
            raise ConfigError(f"{key}.start_step={stage.start_step} is not after data.stages.{k - 1}.start_step="
                              f"{data.stages[k - 1].start_step}: list the stages in order, each starting after the "
                              f"one before (a stage lasts until the next one's start_step)")
        weights = stage.weights
        if isinstance(weights, list):
            if len(weights) != len(data.sources):
                raise ConfigError(f"{key}.weights has {len(weights)} weight(s) for {len(data.sources)} data.sources: "
                                  f"give one per source in data.sources' order, or a mapping by data.sources.N.label "
                                  f"({{label: weight}})")
            named = [(f"{key}.weights.{i}", w) for i, w in enumerate(weights)]
        else:
            unknown = [name for name in weights if name not in labels]
            if unknown:
                known = ", ".join(labels) if labels else "none: set data.sources.N.label"
                raise ConfigError(f"{key}.weights names {unknown[0]!r}, which is no data.sources.N.label (labels: "
                                  f"{known}); name a labelled source or give a list, one weight per source")
            named = [(f"{key}.weights.{name}", w) for name, w in weights.items()]
        for where, weight in named:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight < 0:
                raise ConfigError(f"{where}={weight!r} must be a finite number >= 0 (0: the source is not sampled "
                                  f"in this stage)")
        if not any(weight > 0 for _, weight in named):
            raise ConfigError(f"{key}.weights are all 0: give at least one source a weight > 0 in every stage")
        check_weight_sum(f"{key}.weights", [weight for _, weight in named])


def check_weight_sum(key: str, weights: list[float]) -> None:
    """Weights that each pass but whose sum overflows to inf ([1e308, 1e308]) give every source the share 0 (and
    numpy's "Probabilities do not sum to 1" at the first draw): refused, naming them."""
    if not math.isfinite(sum(weights)):
        written = ", ".join(f"{weight:g}" for weight in weights)
        raise ConfigError(f"{key} [{written}] sum to more than the largest number ({sys.float_info.max:.3g}): weights "
                          f"are relative (each is divided by their sum), so write them smaller, e.g. [1, 1] for equal "
                          f"shares")


def _check_run_folder(config: Config) -> None:
    """train.output_dir, train.resume and checkpoint.export_max_shard_size: what the checkpoint code would
    refuse only when it reads or exports a checkpoint (after the build, or after the whole run)."""
    output_dir = config.train.output_dir
    if not output_dir.strip():
        raise ConfigError("train.output_dir is empty; name the run folder, e.g. train.output_dir=runs/my_run")
    if os.path.islink(output_dir) and not os.path.exists(output_dir):
        raise ConfigError(f"train.output_dir={output_dir!r} is a symbolic link to {os.readlink(output_dir)!r}, which "
                          f"does not exist: create that folder, or name a real folder for the run")
    real = os.path.realpath(os.path.expanduser(output_dir))
    if real in ("/", os.path.realpath(os.path.expanduser("~"))):
        what = "the filesystem root" if real == "/" else "your home folder"
        raise ConfigError(f"train.output_dir={output_dir!r} is {what}: the run writes and rotates checkpoint folders "
                          f"in it; name a folder for this run, e.g. train.output_dir=runs/my_run")
    resume = config.train.resume
    if resume not in ("none", "auto") and step_of_tag(resume) is None:
        raise ConfigError(f"train.resume={resume!r} is not none, auto or a checkpoint tag inside train.output_dir "
                          f"(global_stepN, e.g. global_step300); to resume another run, point train.output_dir at it")
    size = config.checkpoint.export_max_shard_size
    try:
        max_shard_bytes(size)  # the export's own reading of it
    except CheckpointError:
        raise ConfigError(f"checkpoint.export_max_shard_size={size!r} is not a size: give a positive number of bytes "
                          f"or a number with one of the units KB, MB, GB, TB (e.g. 5GB, 500MB)") from None
    export_dir = config.checkpoint.export_dir
    if export_dir:
        run, out = os.path.realpath(config.train.output_dir), os.path.realpath(export_dir)
        inside = os.path.relpath(out, run).split(os.sep) if os.path.commonpath([run, out]) == run else None
        if inside == ["."] or (inside and step_of_tag(inside[0]) is not None):
            where = "is the run folder" if inside == ["."] else f"is inside the checkpoint {inside[0]}"
            raise ConfigError(f"checkpoint.export_dir={export_dir!r} {where} (train.output_dir="
                              f"{config.train.output_dir!r}), where the export would be refused after the run; "
                              f"leave it null (train.output_dir/hf_export) or name a folder beside the checkpoints")


def _check_trackers(config: Config) -> None:
    """The names a switched-on tracker needs (W&B's project, MLflow's experiment) are not empty."""
    needed = [("monitor.wandb.project", config.monitor.wandb.enabled, config.monitor.wandb.project),
              ("monitor.mlflow.experiment", config.monitor.mlflow.enabled, config.monitor.mlflow.experiment)]
    for key, enabled, value in needed:
        if enabled and not value.strip():
            raise ConfigError(f"{key} is empty; name it (e.g. {key}=ntl-pretrain) or switch the tracker off "
                              f"({key.rsplit('.', 1)[0]}.enabled=false)")
    uri = config.monitor.mlflow.tracking_uri
    if config.monitor.mlflow.enabled and uri is not None and not uri.strip():
        raise ConfigError("monitor.mlflow.tracking_uri is empty; give a URI (http://host:5000, sqlite:///mlflow.db, "
                          "file:///path/mlruns) or null for MLFLOW_TRACKING_URI / ./mlruns")


MAX_STEPS_LIMIT = 10**9  # a billion optimizer steps: more is a typo (and overflows schedules kept in floats)
NTL_WEIGHT_LIMIT = 1e4  # lambda * NTL beside CE: above this the sum overflows fp16 and CE vanishes in bf16


# (key, low, high or None, low allowed, high allowed, what it means): the range of every float key
_FLOAT_RANGES = [
    ("optim.lr", 0.0, None, False, None, "the peak learning rate, e.g. 3e-4"),
    ("optim.weight_decay", 0.0, None, True, None, "0 turns weight decay off"),
    ("optim.eps", 0.0, None, False, None, "AdamW's epsilon, e.g. 1e-8"),
    ("optim.min_lr_ratio", 0.0, 1.0, True, True, "the final lr as a fraction of optim.lr"),
    ("optim.decay_fraction", 0.0, 1.0, True, True, "wsd: the share of train.max_steps spent decaying"),
    ("optim.warmup_start_lr_ratio", 0.0, 1.0, True, True, "the lr the warm-up starts at, as a fraction of optim.lr"),
    ("optim.grad_clip", 0.0, None, True, None, "0 turns clipping off"),
    ("loss.ntl_weight", 0.0, None, True, None, "0 (or loss.enabled=false) turns NTL off"),
    ("checkpoint.preempt_grace_s", 0.0, None, False, None, "seconds from the signal to the exit"),
]


# the optim keys that only some schedules read: set to anything but the default with another schedule, they would
# change nothing (core/lr_schedules.LR_SCHEDULES: each schedule's `reads`)
_SCHEDULE_KEYS = {f"optim.{key}": tuple(name for name, schedule in LR_SCHEDULES.items() if key in schedule.reads)
                  for key in sorted({key for schedule in LR_SCHEDULES.values() for key in schedule.reads})}


def _check_lr_schedule(config: Config) -> None:
    """The schedule's keys apply to it, and a wsd decay has at least one step unless decay_fraction is 0."""
    optim, defaults = config.optim, OptimConfig()
    for key, schedules in _SCHEDULE_KEYS.items():
        name = key.split(".")[1]
        value = getattr(optim, name)
        if optim.lr_schedule not in schedules and value != getattr(defaults, name):
            raise ConfigError(f"{key}={value} has no effect with optim.lr_schedule={optim.lr_schedule} (it applies to "
                              f"{' and '.join(schedules)} only): remove it or set optim.lr_schedule={schedules[0]}")
    if optim.lr_schedule == "wsd" and optim.decay_fraction > 0:
        warmup, total = schedule_lengths(optim.warmup_steps, config.train.max_steps)
        if wsd_decay_num_steps(optim.decay_fraction, total, warmup) == 0:
            raise ConfigError(f"optim.decay_fraction={optim.decay_fraction:g} of train.max_steps={config.train.max_steps} "
                              f"rounds to 0 decay steps: the lr would never decay; set optim.decay_fraction >= "
                              f"{1 / total:.3g} (one step), or optim.decay_fraction=0 to hold the peak to the end")


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


def ntl_settings(loss: LossConfig) -> NTLSettings:
    """The loss's `NTLSettings` from the loss section (every settings field that is a loss key: the variant, reweigh
    and every variant's options), loss.ntl_weight checked with them: the one place the run builds them (the start-up
    check here and `Objective.from_config`); their own checks as a ConfigError naming the key."""
    try:
        check_ntl_weight(loss.ntl_weight)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"loss.{error}") from None
    try:
        return NTLSettings(**{name: getattr(loss, name) for name in SETTINGS_KEYWORDS if hasattr(loss, name)})
    except (TypeError, ValueError) as error:
        # the settings' messages start with the setting they refuse, which is a loss key of the same name
        named = str(error).split(" ", 1)[0] in SETTINGS_KEYWORDS
        raise ConfigError(f"loss.{error}" if named else f"loss.variant={loss.variant!r}: {error}") from None
