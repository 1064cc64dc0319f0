"""Start-up checks shared by the trainer and `--dry-run`: everything that needs neither data, weights nor
communication runs in `preflight` (the same on every rank, before DeepSpeed's communication start-up),
so a dry run refuses what a real start would refuse."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from ..checkpoint import resolve_resume
from ..config import Config, ConfigError, to_yaml
from ..core.agreement import AgreedError
from ..core.fs import writable_problem
from ..core.lr_schedules import schedule_lengths, wsd_decay_num_steps
from ..core.numbers import DigitsNotKeptError, NumberTokenError, NumberVocab, digit_hiding_added_tokens
from ..data import DataError, resolve_files
from ..eval.config import validate_eval_inputs
from ..models.build import check_sequence_length, load_model_config, max_positions
from ..models.families import check_attention, check_family, check_tp_plan
from ..models.loading import partitioned_load_applies
from ..observability.trackers import check_tracker_libraries
from ..parallel import distributed
from ..parallel.layout import ParallelLayout, check_sequence_parallel
from ..parallel.ulysses import check_deepspeed_config, check_sequence_split
from ..tokenizer.run import tokenizer_source
from .ds_config import ResolvedRun, resolve_run
from .training_objective import Objective

logger = logging.getLogger("ntl_pretrain")


@dataclass(frozen=True)
class Preflight:
    """What the checks resolved: the run's configuration, its objective and the model's config."""

    run: ResolvedRun  # the resolved configuration and the DeepSpeed config
    objective: Objective  # the training objective (NTL on/off, weight schedule, head), decided here once
    model_config: Any | None  # the transformers config (None: a hub id not cached here; checked at load)
    warnings: tuple[str, ...] = ()  # settings that run but likely not as meant (logged once by the main rank)


def preflight(cfg: Config, world_size: int, on_cpu: bool, local_world_size: int | None = None,
              local_files_only: bool = False) -> Preflight:
    """Every check that needs neither data, weights nor communication: the DeepSpeed config and its batch
    sizes, the tensor- and sequence-parallel sizes, the objective's settings, the model config (architecture keys, model
    path, data.seq_len within its positions). Raises ConfigError/ValueError naming the key and the fix."""
    check_tracker_libraries(cfg.monitor)
    run = resolve_run(cfg, on_cpu, world_size, local_world_size)
    distributed.check_tp_divides(world_size, run.cfg.parallel.tp_size)
    sp_size = run.cfg.parallel.sp_size
    check_sequence_parallel(world_size, run.cfg.parallel.tp_size, sp_size)
    check_deepspeed_config(run.ds_config, sp_size)
    check_sequence_split(sp_size, run.cfg.data.seq_len)
    if sp_size > 1 and run.cfg.model.attn_implementation == "eager":
        raise ConfigError(f"parallel.sp_size={sp_size} needs model.attn_implementation sdpa, flash_attention_2 or "
                          f"auto: DeepSpeed's Ulysses attention wraps those (eager materialises the [S, S] mask)")
    check_document_mask(run.cfg)
    check_flash_attention(run.cfg.model.attn_implementation)
    objective = Objective.from_config(run.cfg.loss)
    try:
        model_config = load_model_config(run.cfg.model, local_files_only=local_files_only)
    except FileNotFoundError:
        logger.warning("model.name_or_path=%r is not cached locally: its config (architecture keys, "
                       "max_position_embeddings) is checked when the trainer loads it", cfg.model.name_or_path)
        model_config = None
    else:
        check_sequence_length(model_config, run.cfg.data.seq_len)
        check_model_family(run, model_config)
        check_tensor_parallel_split(run.cfg.parallel.tp_size, model_config)
        check_grouped_experts(model_config, run.cfg.model.dtype, bool(run.cfg.model.architecture))
        if sp_size > 1:
            text = model_config.get_text_config()
            check_sequence_split(sp_size, run.cfg.data.seq_len, text.num_attention_heads,
                                 getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    return Preflight(run=run, objective=objective, model_config=model_config,
                     warnings=tuple(config_warnings(run.cfg)))


# the model sizes AutoTP splits over the tensor-parallel ranks: heads must split evenly (DeepSpeed gives a rank with
# no key-value head an empty (0, hidden) weight and fails inside deepspeed.initialize), the others must give every
# rank a part (DeepSpeed splits them unevenly, in grains)
TP_EVEN_SPLITS = ("num_attention_heads", "num_key_value_heads")
TP_NONEMPTY_SPLITS = ("intermediate_size", "moe_intermediate_size", "vocab_size")


def check_tensor_parallel_split(tp_size: int, model_config: Any) -> None:
    """Refuse a tensor-parallel size that AutoTP cannot split the model's heads or sizes by, naming the size, the
    model's value and the sizes that fit; before anything is built (the same on every rank, and at --dry-run)."""
    if tp_size <= 1:
        return
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    sizes = {key: getattr(text, key, None) for key in (*TP_EVEN_SPLITS, *TP_NONEMPTY_SPLITS)}
    sizes = {key: value for key, value in sizes.items() if isinstance(value, int) and value > 0}
    heads = [sizes[key] for key in TP_EVEN_SPLITS if key in sizes]
    fits = [t for t in range(1, tp_size + 1) if all(h % t == 0 for h in heads)]
    for key, value in sizes.items():
        if (key in TP_EVEN_SPLITS and value % tp_size) or (key in TP_NONEMPTY_SPLITS and value < tp_size):
            rule = "does not divide" if key in TP_EVEN_SPLITS else "is more ranks than"
            raise ConfigError(f"parallel.tp_size={tp_size} {rule} the model's {key}={value} (AutoTP would give a "
                              f"rank an empty or uneven part): set parallel.tp_size to one of {fits} or "
                              f"parallel.tp_size=auto")


def check_flash_attention(attn_implementation: str) -> None:
    """flash_attention_2 asked for where the flash-attn package does not import: transformers would first try a Hub
    kernel (a download), then fail with an ImportError after the model loaded; refused here in one line."""
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                          "installed in this environment; install it (pip install flash-attn --no-build-isolation, on "
                          "CUDA) or set model.attn_implementation=auto (flash-attn when it imports, else sdpa)")


GROUPED_MM_ALIGNMENT = 16  # bytes: torch's grouped_mm needs each matrix's strides a multiple of this
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def grouped_experts_problem(model_config: Any, dtype: str) -> tuple[str, int, int] | None:
    """(key, value, the multiple it needs) of fused MoE experts that torch's grouped_mm cannot multiply, or None.

    transformers' default experts implementation (grouped_mm) needs the hidden size and each expert's width
    (intermediate_size, or moe_intermediate_size) times the bytes of the dtype a multiple of 16, else the first
    forward fails with "strides should be multiple of 16 bytes" (Mixtral with intermediate_size=97). AutoTP does not
    split the fused experts (models/families.py), so the rule is on the whole sizes at every tp_size."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    implementation = getattr(text, "_experts_implementation", None)
    if not isinstance(experts, int) or experts <= 0 or implementation not in (None, "grouped_mm"):
        return None
    multiple = GROUPED_MM_ALIGNMENT // DTYPE_BYTES.get(dtype, 2)
    width_key = "moe_intermediate_size" if getattr(text, "moe_intermediate_size", None) else "intermediate_size"
    for key in ("hidden_size", width_key):
        value = getattr(text, key, None)
        if isinstance(value, int) and value % multiple:
            return key, value, multiple
    return None


def check_grouped_experts(model_config: Any, dtype: str, from_architecture: bool) -> None:
    """Refuse (ConfigError, one line naming the sizes that fit and the other fix) what `grouped_experts_problem`
    finds, before the model is built (the trainer's start-up and --dry-run)."""
    problem = grouped_experts_problem(model_config, dtype)
    if problem is None:
        return
    key, value, multiple = problem
    lower, upper = value // multiple * multiple, (value // multiple + 1) * multiple
    choices = f"{lower} or {upper}" if lower else f"{upper}"
    where = "model.architecture." if from_architecture else "the model's "
    raise ConfigError(f"{where}{key}={value} is {value * DTYPE_BYTES.get(dtype, 2)} bytes in model.dtype={dtype}, not "
                      f"a multiple of {GROUPED_MM_ALIGNMENT}: the fused MoE experts multiply with torch's grouped_mm, "
                      f"which needs that (step 1 fails with 'strides should be multiple of 16 bytes'); choose {key} a "
                      f"multiple of {multiple} (e.g. {choices}), or set model.architecture.experts_implementation=eager "
                      f"(slower)")


NTL_WEIGHT_WARN = 10.0  # the paper uses 0.1-1; far above, NTL outweighs CE


def config_warnings(cfg: Config) -> list[str]:
    """Settings that run but likely not as meant, each a line naming the key and what to change."""
    found = []
    if cfg.optim.warmup_steps >= cfg.train.max_steps > 0:
        found.append(f"optim.warmup_steps={cfg.optim.warmup_steps} >= train.max_steps={cfg.train.max_steps}: the "
                     f"learning rate never reaches optim.lr={cfg.optim.lr:g} (it peaks at "
                     f"{cfg.train.max_steps / max(cfg.optim.warmup_steps, 1):.1%} of it); set optim.warmup_steps "
                     f"below train.max_steps")
    optim = cfg.optim
    if optim.lr_schedule == "wsd":
        warmup, total = schedule_lengths(optim.warmup_steps, cfg.train.max_steps)
        asked, decay = round(optim.decay_fraction * total), wsd_decay_num_steps(optim.decay_fraction, total, warmup)
        if decay < asked:
            found.append(f"optim.decay_fraction={optim.decay_fraction:g} asks for {asked} decay steps but only {decay} "
                         f"follow optim.warmup_steps={optim.warmup_steps} in train.max_steps={cfg.train.max_steps}: the "
                         f"decay is {decay} steps; lower optim.warmup_steps or optim.decay_fraction")
    if cfg.loss.ntl_on and cfg.loss.ntl_weight > NTL_WEIGHT_WARN:
        found.append(f"loss.ntl_weight={cfg.loss.ntl_weight:g} is far above the paper's 0.1-1: the number-token "
                     f"loss outweighs cross-entropy; set loss.ntl_weight to about 0.3")
    found.extend(stage_warnings(cfg))
    return found


def stage_warnings(cfg: Config) -> list[str]:
    """data.stages that run but likely not as meant: a stage that starts after the last step, a source no stage
    samples, a source weight the stages replace."""
    if not cfg.data.stages:
        return []
    found = [f"data.stages.{k}.start_step={stage.start_step} is after train.max_steps={cfg.train.max_steps}: the stage "
             f"never trains; lower its start_step or raise train.max_steps"
             for k, stage in enumerate(cfg.data.stages) if stage.start_step > cfg.train.max_steps]
    table = cfg.data.stage_table()
    for i, source in enumerate(cfg.data.sources):
        if all(stage.weights[i] == 0 for stage in table):
            found.append(f"data.sources.{i} ({source.label or source.path}) has weight 0 in every data.stages entry: "
                         f"it is loaded but never sampled; give it a weight in a stage or remove it")
        if source.weight != 1.0:
            found.append(f"data.sources.{i}.weight={source.weight:g} is not used: data.stages gives every source's "
                         f"weight; remove it or move it into the stages")
    return found


def stage_table_text(cfg: Config) -> list[str]:
    """The staged mixture as lines (the dry run prints them): each stage's steps and its sources' shares."""
    table, last = cfg.data.stage_table(), cfg.train.max_steps
    names = cfg.data.source_names()
    lines = ["data stages (share of the samples from each source):"]
    for k, stage in enumerate(table):
        end = table[k + 1].start_step - 1 if k + 1 < len(table) else last
        steps = f"steps {stage.start_step}-{min(end, last)}" if stage.start_step <= last else \
            f"from step {stage.start_step} (after train.max_steps={last}: never trained)"
        total = sum(stage.weights)
        shares = ", ".join(f"{name} {weight / total:.3f}" for name, weight in zip(names, stage.weights))
        lines.append(f"  stage {k}: {steps}: {shares}")
    return lines


def check_model_family(run: ResolvedRun, model_config: Any) -> None:
    """The model's family can run at the run's tensor-parallel size with the load the run will use (the partitioned
    load of model.name_or_path under ZeRO-3, `model.partitioned_load`); else a ConfigError naming the reason and
    the fix (`models.families.FAMILIES`), before anything is built."""
    model = run.cfg.model
    tp_size = run.cfg.parallel.tp_size
    partitioned = (model.name_or_path is not None and model.partitioned_load
                   and partitioned_load_applies(run.ds_config, tp_size))
    check_family(model_config, tp_size, partitioned)
    check_tp_plan(model_config, tp_size, run.ds_config)
    check_attention(model_config, model.attn_implementation)


def output_problems(cfg: Config) -> str | None:
    """None if every folder the run writes can be written on this process; else one line naming the key."""
    folders = [("train.output_dir", cfg.train.output_dir)]
    if cfg.monitor.tensorboard_dir:
        folders.append(("monitor.tensorboard_dir", cfg.monitor.tensorboard_dir))
    if cfg.checkpoint.export_hf_at_end and cfg.checkpoint.export_dir:
        folders.append(("checkpoint.export_dir", cfg.checkpoint.export_dir))
    if cfg.monitor.wandb.enabled and cfg.monitor.wandb.dir:  # W&B's own error named neither the key nor the fix
        folders.append(("monitor.wandb.dir", cfg.monitor.wandb.dir))
    for key, folder in folders:
        problem = writable_problem(folder, key)
        if problem is not None:
            return problem
    return None


def check_eval_inputs(cfg: Config, model_config: Any | None, read_hub: bool) -> list[str]:
    """Read what the evaluation will read (GSM8K files, exemplars) and check its length budget against the
    model's positions (`model_config`, a pretrained model's included) now, so a bad input fails at start-up
    and not after training (see `eval.config.validate_eval_inputs`)."""
    if not (cfg.eval.at_end or cfg.eval.every_n_steps > 0):
        return []  # no evaluation will run
    corpora = [(f"data.sources.{i}.path", s.path) for i, s in enumerate(cfg.data.sources)
               if s.generate_arithmetic > 0 and os.path.isfile(s.path)]
    positions = (max_positions(model_config) if model_config is not None
                 else cfg.model.architecture.get("max_position_embeddings"))
    return validate_eval_inputs(cfg.eval, max_position_embeddings=positions, read_hub=read_hub,
                                generated_corpora=corpora)


def check_output_dir(cfg: Config) -> str | None:
    """The checkpoint tag to resume from, or None; refuses a folder holding another run's checkpoints
    (see `checkpoint.resolve_resume`)."""
    return resolve_resume(cfg.train.output_dir, cfg.train.resume)


def check_data_files(cfg: Config) -> None:
    """The local data files that exist already (generated corpora are written later) are there, the same
    on every rank: an AgreedError (reported once)."""
    for index, source in enumerate(cfg.data.sources):
        if not source.generate_arithmetic:
            try:
                resolve_files(source, f"data.sources.{index}")
            except DataError as error:
                raise AgreedError(str(error)) from None


def number_vocab_for(cfg: Config, objective: Objective, tokenizer: Any) -> NumberVocab:
    """The number tokens NTL acts on (with NTL off they still feed the number-token figures). Digit-level
    NTL refuses added tokens that hide digits (`numbers.digit_hiding_added_tokens`) unless
    tokenizer.allow_non_digit_level=true, which logs them."""
    hiding = digit_hiding_added_tokens(tokenizer) if cfg.tokenizer.digit_level and objective.ntl_on else []
    if hiding:
        problem = (f"tokenizer {tokenizer_source(cfg.tokenizer, cfg.model)!r} has {len(hiding)} added token(s) that begin "
                   f"or end with a digit ({', '.join(repr(t) for t in hiding[:5])}{', ...' if len(hiding) > 5 else ''}): "
                   f"added tokens are matched before digits are split, so they hide digits from digit-level NTL")
        if not cfg.tokenizer.allow_non_digit_level:
            raise ValueError(f"{problem}; remove them from tokenizer.json's added_tokens, or set "
                             f"tokenizer.digit_level=false, or tokenizer.allow_non_digit_level=true to train anyway")
        logger.warning("%s (tokenizer.allow_non_digit_level=true: training anyway)", problem)
    try:
        return NumberVocab.from_tokenizer(tokenizer, digit_level=cfg.tokenizer.digit_level)
    except NumberTokenError:  # a broken tokenizer, with NTL on or off: its message names the fix
        raise
    except DigitsNotKeptError as error:
        if objective.ntl_on:
            raise ValueError(f"NTL is on (loss.enabled=true, loss.ntl_weight={cfg.loss.ntl_weight}) but {error}. "
                             f"Or train with CE only: loss.enabled=false") from None
        logger.warning("%s; the number-token figures will stay empty (CE only: training anyway)", error)
        return NumberVocab.from_tokenizer(tokenizer, digit_level=cfg.tokenizer.digit_level, require_digits_kept=False)
    except ValueError as error:
        if objective.ntl_on:
            raise ValueError(f"NTL is on (loss.enabled=true, loss.ntl_weight={cfg.loss.ntl_weight}) but {error}. "
                             f"Or train with CE only: loss.enabled=false") from None
        try:  # CE only: any number-like tokens will do for monitoring
            return NumberVocab.from_tokenizer(tokenizer, digit_level=False)
        except ValueError:
            raise ValueError(f"{error} (tokenizer.name_or_path={tokenizer_source(cfg.tokenizer, cfg.model)!r}); "
                             f"the trainer's number-token figures need at least one number token") from None


def check_document_mask(cfg: Config) -> None:
    """Raise (ConfigError) when attention cannot stay inside documents in this layout: transformers runs flash
    attention on packed documents (variable-length sequences from the position ids) for one row at a time only;
    with several it would attend across documents (model.attn_implementation=auto then picks sdpa)."""
    attention = cfg.model.attn_implementation
    if cfg.data.document_mask and attention.startswith("flash_attention") and cfg.data.micro_batch_size > 1:
        raise ConfigError(f"data.document_mask=true with model.attn_implementation={attention} needs "
                          f"data.micro_batch_size=1 (transformers separates packed documents for flash attention in a "
                          f"batch of one row only), got {cfg.data.micro_batch_size}: set data.micro_batch_size=1 and "
                          f"raise train.grad_accum_steps, or set model.attn_implementation=auto or sdpa")


def attention_mode(cfg: Config) -> str:
    """One line for the log and the dry run: how far attention reaches in a packed row."""
    if cfg.data.document_mask:
        return ("attention: within each packed document (data.document_mask=true: position ids restart after each "
                "EOS)")
    return "attention: the whole packed row, across documents (data.document_mask=false)"


def dry_run(cfg: Config, world_size: int | None) -> None:
    """Validate a configuration without loading data or weights (the model's config.json is read when it
    is local or cached); print it and its DeepSpeed config. Runs the trainer's own pre-build checks."""
    from deepspeed.accelerator import get_accelerator

    on_cpu = get_accelerator().device_name() == "cpu"
    world = world_size or int(os.environ.get("WORLD_SIZE", "0"))
    if not world:  # one process per TP rank; the user's JSON may set the TP size, which this then follows
        tp_size = cfg.parallel.tp_size
        world = resolve_run(cfg, on_cpu, tp_size if isinstance(tp_size, int) else 1).cfg.parallel.tp_size
    checked = preflight(cfg, world, on_cpu, local_files_only=True)
    resolved = checked.run.cfg
    # a dry run may run on another machine than the job (a laptop, a login node): a warning, not a refusal
    problem = output_problems(resolved)
    eval_inputs = check_eval_inputs(resolved, checked.model_config, read_hub=False)
    layout = ParallelLayout.of(world, 0, 0, resolved.parallel.tp_size, resolved.parallel.sp_size)
    global_batch = resolved.data.micro_batch_size * resolved.train.grad_accum_steps * layout.data_size
    print(to_yaml(resolved))
    print("# DeepSpeed config")
    print(json.dumps(checked.run.ds_config, indent=1))
    for line in eval_inputs:
        print(f"# evaluation input OK: {line}")
    if checked.run.tp_note:
        print(f"# {checked.run.tp_note}")
    for line in checked.warnings:
        print(f"warning: {line}", file=sys.stderr)
    print(f"# {checked.objective.describe()}")
    print(f"# {attention_mode(resolved)}")
    print(f"# layout: {layout.describe()}")
    if resolved.data.stages:
        for line in stage_table_text(resolved):
            print(f"# {line}")
    print(f"# dry run OK: global batch {global_batch} sequences = {global_batch * resolved.data.seq_len} tokens "
          f"per step")
    if problem is not None:
        print(f"warning: {problem} (here; the trainer refuses to start where this holds)", file=sys.stderr)
