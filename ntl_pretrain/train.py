"""The training loop: DeepSpeed engine (ZeRO 0-3, AutoTP), CE + vocabulary-parallel NTL with global
normalisation, LR and NTL-weight schedules, validation, checkpoint and evaluation hooks, monitoring.

Started once per rank by DeepSpeed's launcher (`deepspeed launch/pretrain.sh --config X.yaml k=v ...`).
One optimizer step: fetch this rank's `grad_accum_steps` micro-batches -> count the step's tokens and
NTL positions over the data-parallel group (one all-reduce) -> per micro-batch: local logits -> CE/NTL
sums -> loss scaled so the update is CE_mean + lambda * NTL_mean of the GLOBAL batch -> backward ->
`engine.step()` (DeepSpeed clips and steps at the accumulation boundary) -> log.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from . import distributed, lifecycle
from .checkpoint import (CheckpointError, CheckpointManager, data_description, export_hf, fingerprint,
                         lr_schedule_description, resolve_resume, run_on_main, write_hf_assets)
from .config import Config, ConfigError, help_text, load_config, ntl_settings, to_yaml, write_resolved
from .data import DataError, PretrainingData, document_texts, load_documents, prepare_generated_corpus, resolve_files
from .eval.config import save_eval_settings, validate_eval_inputs
from .loss import ce_ntl_sums, chunked_model_ce_ntl_sums, count_step, scaled_micro_batch_loss, vocab_shard_of
from .fs import writable_problem, write_json_atomic
from .loss.objective import SUMS_WIDTH, check_vocabulary_covers_numbers
from .model import (build_model, check_sequence_length, load_model_config, load_tokenizer, needs_training,
                    tokenizer_source, train_digit_bpe)
from .monitor import Monitor, memory_gib, purge_tensorboard_after
from .numbers import NumberVocab
from .preemption import PreemptionHandler
from .tokenizer.coverage import check_training_digits

logger = logging.getLogger("ntl_pretrain")
T = TypeVar("T")


class TrainingDiverged(RuntimeError):
    """The run produced non-finite losses, gradients or weights and stopped without saving them."""


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/pretrain.sh",
        description="Continued pretraining / pretraining of a Hugging Face causal LM with CE + Number Token Loss "
                    "on DeepSpeed (ZeRO 0-3, AutoTP). Overrides: key.sub=value (values are YAML).",
        epilog="Configuration keys:\n" + help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run configuration (e.g. configs/demo.yaml)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the configuration and print it with the DeepSpeed config; load nothing")
    parser.add_argument("--world-size", type=int, default=None,
                        help="--dry-run: number of processes the run will have (default: WORLD_SIZE or tp_size)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="set by DeepSpeed's launcher (LOCAL_RANK is used)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="configuration overrides")
    return parser.parse_intermixed_args(list(argv))


# ---------------------------------------------------------------------------------------------- DeepSpeed config
def generated_deepspeed_config(cfg: Config, on_cpu: bool) -> dict:
    """The DeepSpeed config implied by the YAML (DeepSpeed's own key names and meaning)."""
    zero: dict[str, Any] = {"stage": cfg.parallel.zero_stage}
    if cfg.parallel.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": cfg.parallel.offload_optimizer, "pin_memory": not on_cpu}
    if cfg.parallel.offload_param != "none":
        zero["offload_param"] = {"device": cfg.parallel.offload_param, "pin_memory": not on_cpu}
    if cfg.parallel.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True  # a TP x ZeRO-3 run can export full weights
    adam: dict[str, Any] = {"lr": cfg.optim.lr, "betas": list(cfg.optim.betas), "eps": cfg.optim.eps,
                            "weight_decay": cfg.optim.weight_decay}
    if on_cpu:
        adam["torch_adam"] = True  # DeepSpeed's fused Adam needs a GPU
    warmup = max(1, cfg.optim.warmup_steps)
    if cfg.optim.lr_schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(cfg.train.max_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_ratio": 0.0, "cos_min_ratio": cfg.optim.min_lr_ratio, "warmup_type": "linear"}}
    elif cfg.optim.lr_schedule == "linear":
        scheduler = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": max(cfg.train.max_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_lr": 0.0, "warmup_max_lr": cfg.optim.lr, "warmup_type": "linear"}}
    else:
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_num_steps": warmup, "warmup_min_lr": 0.0, "warmup_max_lr": cfg.optim.lr,
            "warmup_type": "linear"}}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": scheduler,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "fp16": {"enabled": cfg.model.dtype == "fp16"},
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own step prints would duplicate
        "wall_clock_breakdown": False,
    }
    if cfg.parallel.tp_size > 1:
        ds["tensor_parallel"] = {"autotp_size": cfg.parallel.tp_size, "vocab_parallel_lm_head": True}
    return ds


def _merge(base: dict, user: dict, path: str = "") -> dict:
    merged = dict(base)
    for key, value in user.items():
        if value == "auto":  # HF-Trainer convention: keep what the YAML implies
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, f"{path}{key}.")
        else:
            merged[key] = value
    return merged


def deepspeed_config(cfg: Config, on_cpu: bool, world_size: int | None = None) -> dict:
    """The generated DeepSpeed config with the user's JSON (deepspeed.config) merged over it; the YAML
    keys that DeepSpeed owns are then set from the merged result, so the resolved config tells the truth.

    With `world_size`, the batch sizes are resolved as DeepSpeed would (train_batch_size = micro batch x
    gradient accumulation x data-parallel size; a user's train_batch_size without one of the other two
    derives it) and a disagreement is a ConfigError now, not DeepSpeed's AssertionError after the build.
    """
    ds = generated_deepspeed_config(cfg, on_cpu)
    user: dict = {}
    if cfg.deepspeed.config:
        path = cfg.deepspeed.config
        try:
            with open(path, encoding="utf-8") as handle:
                user = json.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"deepspeed.config={path!r} does not exist") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"deepspeed.config={path!r} is not valid JSON: {error}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"deepspeed.config={path!r} cannot be read: {error}") from None
        if not isinstance(user, dict):
            raise ConfigError(f"deepspeed.config={path!r} must hold a JSON object")
        ds = _merge(ds, user)
        if on_cpu and ds.get("optimizer", {}).get("type", "").lower() in ("adam", "adamw"):
            ds["optimizer"].setdefault("params", {})["torch_adam"] = True
    # read back what DeepSpeed will actually do
    cfg.parallel.tp_size = int(ds.get("tensor_parallel", {}).get("autotp_size", 0) or 1)
    cfg.parallel.zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    _resolve_batch_sizes(ds, user, cfg, world_size)
    cfg.data.micro_batch_size = int(ds.get("train_micro_batch_size_per_gpu", cfg.data.micro_batch_size))
    cfg.train.grad_accum_steps = int(ds.get("gradient_accumulation_steps", cfg.train.grad_accum_steps))
    cfg.optim.grad_clip = float(ds.get("gradient_clipping", 0.0))
    cfg.model.dtype = ("bf16" if ds.get("bf16", {}).get("enabled") else
                       "fp16" if ds.get("fp16", {}).get("enabled") else "fp32")
    if cfg.parallel.tp_size > 1:
        ds["tensor_parallel"]["vocab_parallel_lm_head"] = True  # the loss needs the vocabulary-sharded head
    return ds


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolve_batch_sizes(ds: dict, user: dict, cfg: Config, world_size: int | None) -> None:
    """Make train_batch_size, the micro batch and the accumulation steps agree (in place), as DeepSpeed
    requires; only a user's JSON can make them disagree."""
    given = {key: user[key] for key in _BATCH_KEYS if key in user and user[key] != "auto"}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"deepspeed.config={cfg.deepspeed.config!r}: {key}={value!r} must be an integer >= 1")
    if "train_batch_size" not in given:
        ds.pop("train_batch_size", None)  # DeepSpeed computes it from the other two
        return
    total = given["train_batch_size"]
    # the YAML's values stand in for the one the user did not give; with neither given, the YAML's micro batch
    if "train_micro_batch_size_per_gpu" not in given and "gradient_accumulation_steps" in given:
        ds.pop("train_micro_batch_size_per_gpu", None)
    elif "gradient_accumulation_steps" not in given:
        ds.pop("gradient_accumulation_steps", None)
    if world_size is None or world_size % cfg.parallel.tp_size:
        return  # DeepSpeed derives the missing one; the trainer reads it back from the engine
    dp = world_size // cfg.parallel.tp_size
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps")
    where = (f"deepspeed.config={cfg.deepspeed.config!r}: train_batch_size={total} must equal "
             f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size "
             f"(world {world_size} / parallel.tp_size {cfg.parallel.tp_size} = {dp})")
    if micro is not None and accum is not None:
        if micro * accum * dp != total:
            raise ConfigError(f"{where}, but {micro} x {accum} x {dp} = {micro * accum * dp}; set train_batch_size "
                              f"to {micro * accum * dp} or \"auto\", or leave out one of the three")
        return
    known, name = (micro, "gradient_accumulation_steps") if micro is not None else (accum, "train_micro_batch_size_per_gpu")
    if total % (known * dp):
        raise ConfigError(f"{where}; {total} is not a multiple of {known} x {dp} = {known * dp}, so {name} cannot be "
                          f"derived; choose train_batch_size as a multiple of {known * dp}")
    ds[name] = total // (known * dp)


def preflight(cfg: Config, world_size: int, on_cpu: bool, local_files_only: bool = False) -> dict:
    """Every check that needs neither data, weights nor communication, shared by the dry run and the
    trainer (before anything is built): the DeepSpeed config and its batch sizes, the tensor-parallel
    size, the model config (architecture keys, model path, data.seq_len within its positions).
    Returns the DeepSpeed config; raises ConfigError/ValueError naming the key and the fix.
    """
    ds = deepspeed_config(cfg, on_cpu, world_size)
    distributed.check_tp_divides(world_size, cfg.parallel.tp_size)
    try:
        model_config = load_model_config(cfg.model, local_files_only=local_files_only)
    except FileNotFoundError:
        logger.warning("model.name_or_path=%r is not cached locally: its config (architecture keys, "
                       "max_position_embeddings) is checked when the trainer loads it", cfg.model.name_or_path)
    else:
        check_sequence_length(model_config, cfg.data.seq_len)
    return ds


def output_problems(cfg: Config) -> str | None:
    """None if every folder the run writes can be written on this process; else one line naming the key."""
    folders = [("train.output_dir", cfg.train.output_dir)]
    if cfg.monitor.tensorboard_dir:
        folders.append(("monitor.tensorboard_dir", cfg.monitor.tensorboard_dir))
    if cfg.checkpoint.export_hf_at_end and cfg.checkpoint.export_dir:
        folders.append(("checkpoint.export_dir", cfg.checkpoint.export_dir))
    for key, folder in folders:
        problem = writable_problem(folder, key)
        if problem is not None:
            return problem
    return None


# ---------------------------------------------------------------------------------------------- helpers
def ntl_lambda(cfg: Config, step: int) -> float:
    """The NTL weight at optimizer step `step` (numbering from 1)."""
    if not cfg.loss.enabled:
        return 0.0
    if cfg.loss.ntl_schedule == "linear_warmup":
        return cfg.loss.ntl_weight * min(1.0, step / cfg.loss.ntl_warmup_steps)
    return cfg.loss.ntl_weight


def check_eval_inputs(cfg: Config, read_hub: bool) -> list[str]:
    """Read what the evaluation will read (GSM8K files, exemplars) and check its length budget now, so a bad
    input fails at start-up and not after training (see `eval.config.validate_eval_inputs`)."""
    if not (cfg.eval.at_end or cfg.eval.every_n_steps > 0):
        return []  # no evaluation will run
    corpora = [(f"data.sources.{i}.path", s.path) for i, s in enumerate(cfg.data.sources)
               if s.generate_arithmetic > 0 and os.path.isfile(s.path)]
    return validate_eval_inputs(cfg.eval, max_position_embeddings=cfg.model.architecture.get("max_position_embeddings"),
                                read_hub=read_hub, generated_corpora=corpora)


def check_output_dir(cfg: Config) -> str | None:
    """The checkpoint tag to resume from, or None; refuses a folder holding another run's checkpoints
    (see `checkpoint.resolve_resume`)."""
    return resolve_resume(cfg.train.output_dir, cfg.train.resume)


def collective_call(fn: Callable[[], T], first: bool) -> T:
    """Run `fn` on the `first` processes, then on the others (which then find caches and files ready).

    An error on any process is raised on every process (`distributed.run_agreed`), so none waits in a
    collective for a dead one.
    """
    result = distributed.run_agreed(fn, first)
    later = distributed.run_agreed(fn, not first)
    return result if first else later  # type: ignore[return-value]


def _setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s", force=True)
    if not is_main:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()


def _prepare_assets(cfg: Config) -> None:
    """Generate the demo corpus and train the demo tokenizer if the config asks and they are missing."""
    for index, source in enumerate(cfg.data.sources):
        prepare_generated_corpus(source, f"data.sources.{index}")
    if needs_training(cfg.tokenizer, cfg.model):
        source = cfg.data.sources[0]
        documents = load_documents(source, "data.sources.0", cfg.data.cache_dir)
        texts = document_texts(documents, source)
        out = train_digit_bpe(texts, cfg.tokenizer.train_vocab_size, tokenizer_source(cfg.tokenizer, cfg.model))
        logger.info("trained a digit-level BPE tokenizer (%d tokens) into %s", cfg.tokenizer.train_vocab_size, out)


def _check_before_communication(cfg: Config, world_size: int) -> None:
    """Checks that need no other process (the same on every rank): tp_size against the world size, and
    the local data files that exist already (generated corpora are written later)."""
    distributed.check_tp_divides(world_size, cfg.parallel.tp_size)
    for index, source in enumerate(cfg.data.sources):
        if not source.generate_arithmetic:
            try:
                resolve_files(source, f"data.sources.{index}")
            except DataError as error:
                raise distributed.AgreedError(str(error)) from None


def _number_vocab(cfg: Config, tokenizer: Any) -> NumberVocab:
    """The number tokens NTL acts on (with NTL off they still feed the number-token figures)."""
    try:
        return NumberVocab.from_tokenizer(tokenizer, digit_level=cfg.tokenizer.digit_level)
    except ValueError as error:
        if cfg.loss.enabled and cfg.loss.ntl_weight > 0:
            raise ValueError(f"NTL is on (loss.enabled=true, loss.ntl_weight={cfg.loss.ntl_weight}) but {error}. "
                             f"Or train with CE only: loss.enabled=false") from None
        try:  # CE only: any number-like tokens will do for monitoring
            return NumberVocab.from_tokenizer(tokenizer, digit_level=False)
        except ValueError:
            raise ValueError(f"{error} (tokenizer.name_or_path={tokenizer_source(cfg.tokenizer, cfg.model)!r}); "
                             f"the trainer's number-token figures need at least one number token") from None


# ---------------------------------------------------------------------------------------------- the run
class Trainer:
    """One training run on this process (every rank builds one)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.stopped_by: str | None = None  # the signal that stopped the run early (None: ran to the end)
        self.last_scalars: dict[str, float] = {}
        self.last_validation: dict[str, float] = {}
        self.saved_tag: str | None = None
        self.export_dir: str | None = None
        # checks that need no communication, before DeepSpeed's communication start-up (same on every rank)
        world_size, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
        tp_note = distributed.resolve_tp_size(cfg, world_size, lifecycle.local_world_size())
        from deepspeed.accelerator import get_accelerator

        self.accelerator = get_accelerator()
        on_cpu = self.accelerator.device_name() == "cpu"
        # checks that need no communication, before it starts (the same on every rank); may update cfg from the
        # user's JSON
        self.ds_config = preflight(cfg, world_size, on_cpu)
        _check_before_communication(cfg, world_size)
        output_problem = output_problems(cfg)  # every rank writes checkpoint shards: each checks its own view
        lifecycle.use_environment_extensions_dir()
        lifecycle.announce_shm_op_build(local_rank)
        self.watchdog = lifecycle.StartupWatchdog(cfg.train.startup_timeout_s)
        with self.watchdog.waiting(f"DeepSpeed's communication start-up (its CPU op built on first use, then the "
                                   f"rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR', '?')}:"
                                   f"{os.environ.get('MASTER_PORT', '?')})"):
            distributed.init_distributed(cfg.train.dist_timeout_minutes)
        self.layout = distributed.layout(cfg.parallel.tp_size)
        _setup_logging(self.layout.is_main)
        if tp_note:
            logger.info(tp_note)
        # installed first: a pre-emption signal during start-up is then honoured at the first step boundary
        self.preemption = PreemptionHandler(cfg.checkpoint.preempt_signals, cfg.checkpoint.preempt_grace_s)
        self.preemption.install()
        lifecycle.report_to_supervisor("started")
        # the first collective: one run per output folder (global rank 0 holds the lock; all ranks agree)
        self.lock = lifecycle.RunLock(cfg.train.output_dir)
        try:
            with self.watchdog.waiting("every rank to reach the first collective (the run-folder lock)"):
                distributed.agree_on_error(output_problem)  # every rank stops if any cannot write, none waits
                collective_call(self.lock.acquire if self.layout.is_main else (lambda: None), first=True)
        finally:
            lifecycle.remove_own_shm_buffer()  # every rank reached a collective: every buffer is mapped
        try:
            self._build(cfg)
        except BaseException:
            self.lock.release(failed=True)
            raise

    def _build(self, cfg: Config) -> None:
        """Data, tokenizer, model, engine, resume and the run folder's files (after the lock is held)."""
        import deepspeed

        self.resume_tag = check_output_dir(cfg)
        torch.manual_seed(cfg.train.seed)

        with self.watchdog.waiting("global rank 0 to prepare the generated corpus and the tokenizer"):
            collective_call(lambda: _prepare_assets(cfg), first=self.layout.is_main)
        with self.watchdog.waiting("global rank 0 to load the tokenizer"):
            self.tokenizer = collective_call(lambda: load_tokenizer(cfg.tokenizer, cfg.model),
                                             first=self.layout.is_main)
        collective_call(lambda: check_eval_inputs(cfg, read_hub=True), first=self.layout.is_main)  # not after training
        number_vocab = _number_vocab(cfg, self.tokenizer)
        with self.watchdog.waiting("local rank 0 of each node to tokenize and pack the data (then the others)"):
            self.data = collective_call(
                lambda: PretrainingData.build(cfg.data, self.tokenizer, dp_rank=self.layout.dp_rank,
                                              dp_size=self.layout.dp_size),
                first=self.layout.local_rank == 0)
        collective_call(lambda: check_training_digits(  # a bounded sample, the same on every rank: reported once
            self.tokenizer, number_vocab, self.data, source=tokenizer_source(cfg.tokenizer, cfg.model),
            ntl_on=cfg.loss.enabled and cfg.loss.ntl_weight > 0 and cfg.tokenizer.digit_level,
            allow=cfg.tokenizer.allow_non_digit_level), first=True)
        if cfg.train.val_every_n_steps >= 0:
            self.data.check_validation(cfg.train.val_batches)

        model, self.model_report = build_model(cfg.model, self.tokenizer, cfg.parallel.tp_size, self.ds_config)
        self.number_vocab = number_vocab.with_vocab_size(self.model_report.vocab_size)
        logger.info("model %s: %.1fM parameters, vocabulary %d (tokenizer %d), attention %s, %s",
                    self.model_report.source, self.model_report.parameters / 1e6, self.model_report.vocab_size,
                    self.model_report.tokenizer_size, self.model_report.attn_implementation, self.model_report.dtype)

        self.checkpoints = CheckpointManager(cfg.checkpoint, cfg.train.output_dir, self.layout, cfg.parallel.zero_stage,
                                             fingerprint(model.config, self.tokenizer, self.number_vocab),
                                             seed=cfg.train.seed, data=data_description(cfg.data),
                                             lr_schedule=lr_schedule_description(self.ds_config))
        load_tag = None
        if self.resume_tag is not None:
            kept = self.checkpoints.resume_lr_schedule(self.resume_tag)  # checkpoint.resume_lr_schedule=keep
            if kept is not None:
                if kept["scheduler"] is None:
                    self.ds_config.pop("scheduler", None)
                else:
                    self.ds_config["scheduler"] = kept["scheduler"]
                self.ds_config["optimizer"].setdefault("params", {})["lr"] = kept["lr"]
            load_tag = self.checkpoints.plan_resume(self.resume_tag)  # checks; universal form if the layout changed
            if load_tag != self.resume_tag:
                self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        with self.watchdog.waiting("every rank to set up the DeepSpeed engine (deepspeed.initialize)"):
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        config=self.ds_config)
        del model
        # DeepSpeed derives these when the user's JSON gives train_batch_size instead
        cfg.data.micro_batch_size = self.engine.train_micro_batch_size_per_gpu()
        cfg.train.grad_accum_steps = self.engine.gradient_accumulation_steps()
        distributed.check_layout_matches_deepspeed(self.layout)
        self.tp_group, self.dp_group = distributed.deepspeed_groups(cfg.parallel.tp_size)
        self.vocab_shard = vocab_shard_of(self.engine)  # this rank's columns of the LM head
        self.device = torch.device(self.accelerator.current_device_name())
        # The layout checks that need the host run here, once; the step then calls the loss with
        # check_inputs=False (no host sync). Labels come from the tokenizer, whose ids are below the
        # model's vocabulary (NumberVocab.with_vocab_size above).
        vocab_width = self.vocab_shard.check_tiling(self.device, self.vocab_shard.width or self.model_report.vocab_size)
        check_vocabulary_covers_numbers(vocab_width, self.number_vocab)
        self.settings = ntl_settings(cfg)
        self.step = 0
        self.tokens_seen = 0
        self.nonfinite_in_a_row = 0  # optimizer steps with a non-finite loss or gradient norm, consecutive
        self.nonfinite_steps = 0  # and in all
        if load_tag is not None:
            self._resume(load_tag)

        output_dir = cfg.train.output_dir
        if self.layout.is_main:
            write_resolved(cfg, output_dir)
            _write_json(os.path.join(output_dir, "ds_config.json"), self.ds_config)
            _write_json(os.path.join(output_dir, "model_report.json"), asdict(self.model_report))
            self.number_vocab.save(output_dir)
        tensorboard_dir = cfg.monitor.tensorboard_dir or os.path.join(output_dir, "tensorboard")
        self.tensorboard_dir = tensorboard_dir
        self.start_step = self.step
        if self.layout.is_main and self.resume_tag is not None:
            purge_tensorboard_after(tensorboard_dir, self.step)  # points a killed run wrote after its checkpoint
        self.monitor = Monitor(self.layout.is_main, tensorboard_dir,
                               total_steps=cfg.train.max_steps, progress_bar=cfg.monitor.progress_bar,
                               log_every=cfg.train.log_every_n_steps, start_step=self.step)
        self.monitor.text("config", "```\n" + to_yaml(cfg) + "\n```", self.step)
        self.monitor.text("deepspeed_config", "```\n" + json.dumps(self.ds_config, indent=1) + "\n```", self.step)

    # ------------------------------------------------------------------ one step
    def _forward_sums(self, batch: Any, with_ntl: bool) -> Any:
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        check = self.cfg.loss.check_every_step  # checked once at start-up; per micro-batch only to debug
        if self.cfg.loss.chunk_tokens:
            # the head + loss over chunks of tokens: the full logits never exist (docs/chunked.md)
            return chunked_model_ce_ntl_sums(self.engine, self.engine.module.get_output_embeddings(),
                                             {"input_ids": input_ids}, labels, self.number_vocab, self.settings,
                                             chunk_tokens=self.cfg.loss.chunk_tokens, shard=self.vocab_shard,
                                             with_ntl=with_ntl, check_inputs=check)
        logits = self.engine(input_ids=input_ids).logits
        return ce_ntl_sums(logits, labels, self.number_vocab, self.settings, shard=self.vocab_shard,
                           with_ntl=with_ntl, check_inputs=check)

    def train_step(self, with_ntl: bool | None = None) -> dict[str, float]:
        """One optimizer step; returns the step's global figures (identical on every rank).

        The micro-batch loop reads nothing from the device: counts, losses and figures stay device
        tensors, and the step's one device-to-host transfer reads the logged figures at its end (ZeRO 0:
        just before the update, which it decides). A non-finite loss or gradient norm skips the update
        (`_guard_nonfinite`).
        """
        cfg = self.cfg
        self.accelerator.synchronize()  # the step's clock starts on an idle device
        started = time.perf_counter()
        step = self.step + 1
        lam = ntl_lambda(cfg, step)
        if with_ntl is None:
            with_ntl = lam > 0
        micro_batches = self.data.next_step(cfg.train.grad_accum_steps)
        labels = [mb.labels.to(self.device, non_blocking=True) for mb in micro_batches]
        counts = count_step(labels, self.number_vocab, self.settings, self.dp_group)
        totals = torch.zeros(SUMS_WIDTH, dtype=torch.float64, device=self.device)
        skipped_before = self.engine.skipped_steps
        last = len(micro_batches) - 1
        for index, batch in enumerate(micro_batches):
            sums = self._forward_sums(batch, with_ntl)
            loss = scaled_micro_batch_loss(sums, counts, lam if with_ntl else 0.0, self.layout.dp_size,
                                           cfg.train.grad_accum_steps)
            self.engine.backward(_nan_gradient_if_nonfinite(loss))
            totals += sums.stack().double()  # ObjectiveSums order: the order _step_figures reads back
            if index < last:
                self.engine.step()  # inside the accumulation: DeepSpeed only counts the micro-batch
        if cfg.parallel.zero_stage == 0:
            # no ZeRO: DeepSpeed's engine neither keeps a norm nor skips a non-finite update, so the
            # figures are read before the update and decide it
            figures = self._step_figures(totals, self._unpartitioned_grad_norm())
            if _finite_step(figures):
                self.engine.step()
            else:
                with _update_skipped(self.engine):
                    self.engine.step()
        else:
            # ZeRO 1-3: DeepSpeed skips the update itself when the gradient norm is not finite
            self.engine.step()
            figures = self._step_figures(totals, self.engine.get_global_grad_norm())
        ce_sum, ntl_sum, tokens, ntl_count, number_tokens, abs_error, grad_norm = figures
        elapsed = time.perf_counter() - started
        self.step = step
        self._guard_nonfinite(figures, skipped=self.engine.skipped_steps > skipped_before)
        step_tokens = sum(mb.input_ids.numel() for mb in micro_batches) * self.layout.dp_size
        self.tokens_seen += step_tokens
        ce = ce_sum / max(tokens, 1.0)
        ntl = ntl_sum / ntl_count if ntl_count > 0 else 0.0
        return {
            "train/loss": ce + lam * ntl if with_ntl else ce,
            "train/ce": ce, "train/ntl": ntl, "train/ntl_lambda": lam if with_ntl else 0.0,
            "train/lr": float(self.engine.get_lr()[0]),
            "train/grad_norm": grad_norm if grad_norm is not None else 0.0,
            "train/tokens_per_s": step_tokens / elapsed, "train/step_time_s": elapsed,
            "train/number_token_share": number_tokens / max(tokens, 1.0),
            "train/number_mae": abs_error / number_tokens if number_tokens > 0 else 0.0,
            "train/memory_gib": memory_gib(self.device),
            "train/nonfinite_steps": float(self.nonfinite_steps),
        }

    def _step_figures(self, totals: torch.Tensor, grad_norm: Any) -> list:
        """The step's global sums (summed over data-parallel ranks) and the gradient norm, read to the host
        in ONE transfer: [ce_sum, ntl_sum, tokens, ntl_count, number_tokens, abs_error_sum, grad_norm]."""
        if self.layout.dp_size > 1:
            torch.distributed.all_reduce(totals, group=self.dp_group)
        if torch.is_tensor(grad_norm):
            return torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]).tolist()
        return totals.tolist() + [None if grad_norm is None else float(grad_norm)]

    def _guard_nonfinite(self, figures: list, skipped: bool) -> None:
        """Count a step whose loss or gradient norm is not finite (its update was skipped); stop once
        `train.max_nonfinite_steps` came in a row."""
        ce_sum, ntl_sum, grad_norm = figures[0], figures[1], figures[-1]
        if _finite_step(figures) and not skipped:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        self.nonfinite_steps += 1
        limit = self.cfg.train.max_nonfinite_steps
        what = (f"CE sum {ce_sum:.4g}, NTL sum {ntl_sum:.4g}, gradient norm "
                f"{'n/a' if grad_norm is None else f'{grad_norm:.4g}'}")
        if self.nonfinite_in_a_row >= limit:
            raise TrainingDiverged(
                f"step {self.step}: {self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or "
                f"gradient norm ({what}); stopping without saving (train.max_nonfinite_steps={limit}). The last "
                f"checkpoint in {self.cfg.train.output_dir} holds the weights before. Lower optim.lr, set "
                f"optim.grad_clip, or check the data and the resumed checkpoint.")
        if self.layout.is_main:
            logger.warning("step %d: non-finite loss or gradient norm (%s): update skipped (%d in a row; the run "
                           "stops at train.max_nonfinite_steps=%d)", self.step, what, self.nonfinite_in_a_row, limit)

    def _unpartitioned_grad_norm(self) -> torch.Tensor:
        """Global gradient norm without ZeRO (DeepSpeed's engine keeps none then); TP-sharded parameters
        are summed over the TP group, replicated ones counted once. A device tensor (no host read)."""
        from deepspeed.runtime.utils import clip_grad_norm_

        parameters = [p for p in self.engine.module.parameters() if p.grad is not None]
        return clip_grad_norm_(parameters, max_norm=float("inf"), mpu=self.engine.mpu)

    def _check_weights_finite(self) -> None:
        """Refuse to save non-finite weights: the model's (this rank's ZeRO-3 partitions) and the
        optimizer's fp32 master weights. Every rank calls it (one all-reduce)."""
        tensors = [getattr(p, "ds_tensor", p.data) for p in self.engine.module.parameters()]
        optimizer = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        if optimizer is not None:
            tensors += [p for group in optimizer.param_groups for p in group["params"]]
        bad = torch.zeros((), dtype=torch.float64, device=self.device)
        for tensor in tensors:
            if tensor is not None and tensor.numel():
                bad += (~torch.isfinite(tensor.detach())).sum().to(bad)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad)
        if bad.item() > 0:
            raise TrainingDiverged(
                f"step {self.step}: {int(bad.item())} weights are not finite; refusing to save them as a checkpoint "
                f"(the last checkpoint in {self.cfg.train.output_dir} stays the newest)")

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """CE, NTL and total loss on the held-out samples (global means; every rank runs the same batches count)."""
        self.engine.eval()
        totals = torch.zeros(SUMS_WIDTH, dtype=torch.float64, device=self.device)
        with_ntl = self.cfg.loss.enabled
        for batch in self.data.validation_micro_batches(self.cfg.train.val_batches):
            with torch.no_grad():  # forward only (the chunked head would otherwise prepare gradients)
                sums = self._forward_sums(batch, with_ntl)
            totals += sums.stack().double()
        self.engine.train()
        ce_sum, ntl_sum, tokens, ntl_count, *_ = distributed.all_reduce_sum(totals.tolist(), self.dp_group,
                                                                            self.device)
        ce = ce_sum / max(tokens, 1.0)
        ntl = ntl_sum / ntl_count if ntl_count > 0 else 0.0
        lam = ntl_lambda(self.cfg, max(self.step, 1))
        return {"val/loss": ce + lam * ntl, "val/ce": ce, "val/ntl": ntl}

    # ------------------------------------------------------------------ checkpoints and evaluation
    def save_checkpoint(self) -> str:
        """Save a checkpoint of the current step on every rank (atomic; keeps the last K)."""
        self._check_weights_finite()
        client_state = {"step": self.step, "tokens_seen": self.tokens_seen, "data": self.data.state_dict(),
                        "ntl_lambda": ntl_lambda(self.cfg, max(self.step, 1)), "config": to_yaml(self.cfg)}
        tag = self.checkpoints.save(
            self.engine, self.step, client_state,
            lambda folder: (write_hf_assets(folder, self.engine.module.config, self.tokenizer, self.number_vocab),
                            save_eval_settings(folder, self.cfg.eval)))  # the export evaluates as the run
        timing = self.checkpoints.last_save
        self.monitor.message(f"saved checkpoint {os.path.join(self.cfg.train.output_dir, tag)} "
                             f"({timing.get('save_s', 0.0):.1f} s, of which hashing {timing.get('hash_s', 0.0):.2f} s)")
        self.saved_tag = tag
        return tag

    def _resume(self, load_tag: str) -> None:
        client_state = self.checkpoints.load(self.engine, load_tag)
        self.step = int(client_state["step"])
        self.tokens_seen = int(client_state.get("tokens_seen", 0))
        self.data.load_state_dict(client_state["data"])
        logger.info("resumed from %s at step %d (%.1f s)", os.path.join(self.cfg.train.output_dir, load_tag),
                    self.step, self.checkpoints.last_save.get("load_s", 0.0))

    def export_final(self, tag: str) -> None:
        """Export a checkpoint of this run as a Hugging Face folder (global rank 0 converts; all wait)."""
        cfg = self.cfg.checkpoint
        out = cfg.export_dir or os.path.join(self.cfg.train.output_dir, "hf_export")
        report = run_on_main(self.layout.is_main, lambda: export_hf(
            os.path.join(self.cfg.train.output_dir, tag), out, max_shard_size=cfg.export_max_shard_size))
        if report is not None:
            self.monitor.message(f"exported {tag} to {out} ({report['seconds']:.1f} s)")
        self.export_dir = out

    def evaluate(self, final: bool) -> None:
        """Run the evaluation hooks (ntl_pretrain.eval) when due; every rank calls this."""
        if not self.cfg.eval.is_due(self.step, final=final):
            return
        from .eval.hooks import run_evaluation

        results = run_evaluation(self.engine, self.tokenizer, self.cfg.eval, step=self.step,
                                 output_dir=self.cfg.train.output_dir, writer=self.monitor.writer,
                                 tp_group=self.tp_group, dp_group=self.dp_group, final=final)
        headline = {k: v for k, v in results.items()
                    if isinstance(v, (int, float)) and k.rsplit("/", 1)[-1] in ("accuracy", "mae", "time_s")
                    and k.count("/") <= 3}  # the headline figures; TensorBoard and the predictions file have all
        self.monitor.message(f"step {self.step}: evaluation " + " ".join(f"{k}={v:.4g}" for k, v in headline.items()))

    # ------------------------------------------------------------------ the loop
    def fit(self) -> None:
        cfg = self.cfg
        val_every = cfg.train.val_every_n_steps
        ckpt_every = cfg.checkpoint.every_n_steps
        if self.step >= cfg.train.max_steps:
            self.monitor.message(f"nothing to do: the run is at step {self.step} and train.max_steps={cfg.train.max_steps}")
            self._finish()
            return
        self.monitor.message(f"training steps {self.step + 1}..{cfg.train.max_steps}: dp={self.layout.dp_size} "
                             f"tp={self.layout.tp_size} zero={cfg.parallel.zero_stage} micro_batch="
                             f"{cfg.data.micro_batch_size} grad_accum={cfg.train.grad_accum_steps} seq_len={cfg.data.seq_len}")
        saved_at = None
        while self.step < cfg.train.max_steps:
            scalars = self.train_step()
            self.last_scalars = scalars
            self.monitor.log_step(self.step, scalars)
            signal_name = self.preemption.requested(self.device)  # every rank, every step: one small all-reduce
            if signal_name is not None:
                self._stop_for_preemption(signal_name)
                return
            last = self.step == cfg.train.max_steps
            if val_every > 0 and self.step % val_every == 0 and not last:
                self._validate()
            if ckpt_every > 0 and self.step % ckpt_every == 0:
                saved_at = self.save_checkpoint()
            if not last:
                self.evaluate(final=False)
        if val_every >= 0:
            self._validate()
        if cfg.checkpoint.save_final and saved_at != f"global_step{self.step}":
            saved_at = self.save_checkpoint()
        self.evaluate(final=True)
        if cfg.checkpoint.export_hf_at_end and saved_at is not None:
            self.export_final(saved_at)
        self._finish()

    def _validate(self) -> None:
        self.last_validation = self.validate()
        self.monitor.log_validation(self.step, self.last_validation)

    def _stop_for_preemption(self, signal_name: str) -> None:
        """Save at this step boundary and return (the process then exits 0)."""
        self.monitor.message(f"step {self.step}: {signal_name} received (pre-emption): saving a checkpoint")
        tag = self.save_checkpoint()
        self.monitor.message(f"pre-empted at step {self.step}: {tag} saved; continue with train.resume=auto")
        self.stopped_by = signal_name
        self._finish()

    def _finish(self) -> None:
        """Print the run's summary (as the HF Trainer does), close the monitor, drop the signal handlers."""
        self.monitor.message(self.summary())
        self.monitor.close()
        self.preemption.uninstall()

    def summary(self) -> str:
        """Steps, wall time, tokens, final losses and where the run's outputs are."""
        output_dir = self.cfg.train.output_dir
        seconds = time.monotonic() - self.started
        steps = self.step - self.start_step
        how = f"stopped by {self.stopped_by} at step {self.step}" if self.stopped_by else f"finished at step {self.step}"
        losses = " ".join(f"{k.split('/', 1)[1]}={self.last_scalars[k]:.4g}" for k in ("train/loss", "train/ce", "train/ntl")
                          if k in self.last_scalars)
        val = " ".join(f"{k}={v:.4g}" for k, v in self.last_validation.items())
        lines = [f"run summary: {how}: {steps} steps in {seconds / 60:.1f} min (start-up included), "
                 f"{self.tokens_seen:,} tokens seen in total",
                 f"  final train: {losses or '-'}" + (f"; {val}" if val else ""),
                 f"  checkpoint: {os.path.join(output_dir, self.saved_tag) if self.saved_tag else 'none saved'}"
                 + (" (continue with train.resume=auto)" if self.stopped_by else ""),
                 f"  export: {self.export_dir or 'none (checkpoint.export_hf_at_end=false)'}",
                 f"  TensorBoard: tensorboard --logdir {self.tensorboard_dir}"]
        return "\n".join(lines)


def _finite_step(figures: list) -> bool:
    """Whether the step's CE and NTL sums and its gradient norm (when there is one) are finite."""
    ce_sum, ntl_sum, grad_norm = figures[0], figures[1], figures[-1]
    return math.isfinite(ce_sum) and math.isfinite(ntl_sum) and (grad_norm is None or math.isfinite(grad_norm))


def _nan_gradient_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, or, where it is not finite, a loss whose gradient is NaN everywhere: DeepSpeed's overflow
    check then skips the update (a non-finite loss can have a finite gradient). Decided on the device."""
    return loss * torch.where(torch.isfinite(loss), 1.0, float("nan")).to(loss.dtype)


@contextmanager
def _update_skipped(engine: Any) -> Iterator[None]:
    """Let `engine.step()` close the accumulation (DeepSpeed's counters, zeroed gradients) without
    updating the weights or advancing the LR schedule, as DeepSpeed does for an overflow."""
    targets = [engine.optimizer] + ([engine.lr_scheduler] if engine.lr_scheduler is not None else [])
    for target in targets:
        target.step = lambda *args, **kwargs: None  # instance attribute: shadows the method for this call
    try:
        yield
    finally:
        for target in targets:
            del target.step


def _write_json(path: str, data: Any) -> None:
    write_json_atomic(path, data, indent=1, default=str)


def dry_run(cfg: Config, world_size: int | None) -> None:
    """Validate a configuration without loading data or weights (the model's config.json is read when it
    is local or cached); print it and its DeepSpeed config. Runs the trainer's own pre-build checks."""
    from deepspeed.accelerator import get_accelerator

    tp = cfg.parallel.tp_size
    world = world_size or int(os.environ.get("WORLD_SIZE", "0")) or (tp if isinstance(tp, int) else 1)
    tp_note = distributed.resolve_tp_size(cfg, world)
    # the user's JSON may set the TP size, which the default world size follows
    if not world_size and not int(os.environ.get("WORLD_SIZE", "0")):
        deepspeed_config(cfg, on_cpu=get_accelerator().device_name() == "cpu")
        world = cfg.parallel.tp_size
    ds = preflight(cfg, world, on_cpu=get_accelerator().device_name() == "cpu", local_files_only=True)
    # a dry run may run on another machine than the job (a laptop, a login node): a warning, not a refusal
    problem = output_problems(cfg)
    eval_inputs = check_eval_inputs(cfg, read_hub=False)
    dp = world // cfg.parallel.tp_size
    global_batch = cfg.data.micro_batch_size * cfg.train.grad_accum_steps * dp
    print(to_yaml(cfg))
    print("# DeepSpeed config")
    print(json.dumps(ds, indent=1))
    for line in eval_inputs:
        print(f"# evaluation input OK: {line}")
    if tp_note:
        print(f"# {tp_note}")
    print(f"# dry run OK: world {world} = dp {dp} x tp {cfg.parallel.tp_size}; global batch {global_batch} "
          f"sequences = {global_batch * cfg.data.seq_len} tokens per step")
    if problem is not None:
        print(f"warning: {problem} (here; the trainer refuses to start where this holds)", file=sys.stderr)


def _report_error(error: BaseException) -> None:
    """Print a start-up or run error once: errors every rank raises together (configuration, agreed by a
    collective) are printed by global rank 0 only; anything else by the rank that hit it."""
    shared = isinstance(error, (ConfigError, distributed.AgreedError))
    if lifecycle.global_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    elif not shared:
        print(f"error: [rank {lifecycle.global_rank()}] {error}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    trainer = None
    try:
        try:
            cfg = load_config(args.config, args.overrides)
            if args.dry_run:
                dry_run(cfg, args.world_size)
                return 0
            trainer = Trainer(cfg)
        except ValueError as error:  # ConfigError, DataError, CheckpointError, RunLockError, ...: exit 2
            _report_error(error)
            return 2
        try:
            trainer.fit()
        except (CheckpointError, TrainingDiverged) as error:
            _report_error(error)
            return 2
        lifecycle.report_to_supervisor("done", how="stopped" if trainer.stopped_by else "finished", step=trainer.step)
        return 0
    finally:
        if trainer is not None:
            trainer.lock.release()
        distributed.shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
