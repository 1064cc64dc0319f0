"""A run's start-up on this process: the checks that need no communication (`preflight`), the process group,
logging, the pre-emption handler and the run-folder lock (`start`), then the generated corpus and demo tokenizer,
the tokenizer, the data, the engine and a resume (`build`), and the run folder's files and monitor
(`open_run_folder`). Each sets the trainer's parts as it builds them.

Each function takes the run's `Trainer` (typed Any: `trainer.Trainer` imports this module), whose parts and
state it reads and sets."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from typing import Any, Callable, TypeVar

import torch

from ..checkpoint import AgreedCheckpointError, CheckpointError, lr_schedule_description, seed_generators
from ..config import Config, to_dict, to_yaml, write_resolved
from ..core.agreement import agree_on_error, run_agreed
from ..core.fs import write_json_atomic
from ..data import PretrainingData, data_description, document_texts, load_documents, prepare_generated_corpus
from ..loss import vocab_shard_of
from ..loss.objective import check_vocabulary_covers_numbers
from ..loss.sequence_shard import SequenceShard
from ..models.build import load_run_tokenizer
from ..observability.monitor import Monitor, MonitorError, purge_tensorboard_after
from ..observability.throughput import ThroughputWindow, model_flops_per_token, peak_tflops_per_device
from ..parallel import distributed
from ..parallel.layout import ParallelGroups
from ..runtime import lifecycle
from ..tokenizer.coverage import check_training_digits
from ..tokenizer.run import needs_training, tokenizer_source, train_digit_bpe
from . import checkpointing
from .engine import build_engine
from .preemption import PreemptionHandler
from .preflight import (attention_mode, check_data_files, check_eval_inputs, check_output_dir, number_vocab_for,
                        output_problems, preflight, stage_table_text)
from .step_guard import NonfiniteGuard

logger = logging.getLogger("ntl_pretrain")
T = TypeVar("T")


def collective_call(fn: Callable[[], T], first: bool) -> T:
    """Run `fn` on the `first` processes, then on the others (which then find caches and files ready).

    An error on any process is raised on every process (`run_agreed`), so none waits in a
    collective for a dead one.
    """
    result = run_agreed(fn, first)
    later = run_agreed(fn, not first)
    return result if first else later  # type: ignore[return-value]


def setup_logging(is_main: bool) -> None:
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format="[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s", force=True)
    if not is_main:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()


def prepare_assets(cfg: Config) -> None:
    """Generate the demo corpus and train the demo tokenizer if the config asks and they are missing."""
    for index, source in enumerate(cfg.data.sources):
        prepare_generated_corpus(source, f"data.sources.{index}")
    if needs_training(cfg.tokenizer, cfg.model):
        source = cfg.data.sources[0]
        documents = load_documents(source, "data.sources.0", cfg.data.cache_dir)
        texts = document_texts(documents, source)
        out = train_digit_bpe(texts, cfg.tokenizer.train_vocab_size, tokenizer_source(cfg.tokenizer, cfg.model))
        logger.info("trained a digit-level BPE tokenizer (%d tokens) into %s", cfg.tokenizer.train_vocab_size, out)


def start(trainer: Any, cfg: Config) -> None:
    """Checks, the process group, logging, the pre-emption handler and the run-folder lock, then `build`."""
    world_size, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    from deepspeed.accelerator import get_accelerator

    trainer.accelerator = get_accelerator()
    # checks that need no communication, before it starts (the same on every rank); the configuration is
    # resolved here once (tp_size=auto, the user's DeepSpeed JSON) and not changed afterwards
    checked = preflight(cfg, world_size, trainer.accelerator.device_name() == "cpu", lifecycle.local_world_size())
    trainer.cfg = cfg = checked.run.cfg
    trainer.ds_config = checked.run.ds_config
    trainer.objective = checked.objective  # NTL on/off, its weight schedule and the LM head: decided once
    trainer.model_config = checked.model_config
    check_data_files(cfg)
    output_problem = output_problems(cfg)  # every rank writes checkpoint shards: each checks its own view
    lifecycle.use_environment_extensions_dir()
    lifecycle.announce_shm_op_build(local_rank)
    trainer.watchdog = lifecycle.StartupWatchdog(cfg.train.startup_timeout_s)
    with trainer.watchdog.waiting(f"DeepSpeed's communication start-up (its CPU op built on first use, then the "
                                  f"rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR', '?')}:"
                                  f"{os.environ.get('MASTER_PORT', '?')})"):
        distributed.init_distributed(cfg.train.dist_timeout_minutes)
    trainer.layout = distributed.layout(cfg.parallel)  # sizes and ranks; the groups come with the engine
    setup_logging(trainer.layout.is_main)
    if checked.run.tp_note:
        logger.info(checked.run.tp_note)
    for line in checked.warnings:
        logger.warning(line)
    logger.info(trainer.objective.describe())
    logger.info(attention_mode(cfg))
    if cfg.data.stages:
        logger.info("\n".join(stage_table_text(cfg)))
    # installed first: a stop signal during start-up ends the process at once (no step to save), later it saves
    trainer.preemption = PreemptionHandler(cfg.checkpoint.preempt_signals, cfg.checkpoint.preempt_grace_s)
    trainer.preemption.install()
    # the first collective: one run per output folder (global rank 0 holds the lock; all ranks agree)
    trainer.lock = lifecycle.RunLock(cfg.train.output_dir)
    try:
        with trainer.watchdog.waiting("every rank to reach the first collective (the run-folder lock)"):
            agree_on_error(output_problem)  # every rank stops if any cannot write, none waits
            collective_call(trainer.lock.acquire if trainer.layout.is_main else (lambda: None), first=True)
    finally:
        lifecycle.remove_own_shm_buffer()  # every rank reached a collective: every buffer is mapped
    try:
        build(trainer, cfg)
    except BaseException:
        trainer.lock.release(failed=True)
        raise


def build(trainer: Any, cfg: Config) -> None:
    """Data, tokenizer, model, engine, resume and the run folder's files (after the lock is held)."""
    # every rank reads the folder; a refusal (another run's checkpoints, a bad resume) is printed once
    trainer.resume_tag = run_agreed(lambda: check_output_dir(cfg), True, AgreedCheckpointError,
                                    plain=(CheckpointError,))
    seed_generators(cfg.train.seed)  # Python's, NumPy's and torch's: a checkpoint's RNG files then repeat too
    main_first = trainer.layout.is_main
    with trainer.watchdog.waiting("global rank 0 to prepare the generated corpus and the tokenizer"):
        collective_call(lambda: prepare_assets(cfg), first=main_first)
    with trainer.watchdog.waiting("global rank 0 to load the tokenizer"):
        trainer.tokenizer = collective_call(lambda: load_run_tokenizer(cfg.tokenizer, cfg.model), first=main_first)
    collective_call(lambda: check_eval_inputs(cfg, trainer.model_config, read_hub=True), first=main_first)
    number_vocab = number_vocab_for(cfg, trainer.objective, trainer.tokenizer)
    with trainer.watchdog.waiting("local rank 0 of each node to tokenize and pack the data (then the others)"):
        trainer.data = collective_call(
            lambda: PretrainingData.build(cfg.data, trainer.tokenizer, dp_rank=trainer.layout.data_rank,
                                          dp_size=trainer.layout.data_size),
            first=trainer.layout.local_rank == 0)
    collective_call(lambda: check_training_digits(  # a bounded sample, the same on every rank: reported once
        trainer.tokenizer, number_vocab, trainer.data, source=tokenizer_source(cfg.tokenizer, cfg.model),
        ntl_on=trainer.objective.ntl_on and cfg.tokenizer.digit_level,
        allow=cfg.tokenizer.allow_non_digit_level), first=True)
    if cfg.train.validation_on:
        trainer.data.check_validation(cfg.train.val_batches)

    built = build_engine(cfg, trainer.ds_config, trainer.tokenizer, number_vocab, trainer.layout, trainer.resume_tag,
                         data=data_description(cfg.data), lr_schedule=lr_schedule_description(trainer.ds_config),
                         watchdog=trainer.watchdog)
    trainer.engine, trainer.model_report, trainer.number_vocab = built.engine, built.model_report, built.number_vocab
    trainer.checkpoints, trainer.ds_config = built.checkpoints, built.ds_config
    trainer.ulysses = built.ulysses  # None without sequence parallelism
    trainer.sequence = built.ulysses.shard if built.ulysses else SequenceShard()  # this rank's slice of every row
    # the EOS that ends each packed document when attention stays inside documents (data.document_mask)
    trainer.document_eos_id = trainer.tokenizer.eos_token_id if cfg.data.document_mask else None
    derived = (trainer.engine.train_micro_batch_size_per_gpu(), trainer.engine.gradient_accumulation_steps())
    if derived != (cfg.data.micro_batch_size, cfg.train.grad_accum_steps):  # resolved as DeepSpeed does
        raise RuntimeError(f"DeepSpeed derived (micro batch, accumulation) = {derived}, the resolved config "
                           f"{(cfg.data.micro_batch_size, cfg.train.grad_accum_steps)}")
    trainer.groups = ParallelGroups.from_deepspeed(trainer.layout)  # every group a reduction uses (checked here)
    trainer.vocab_shard = vocab_shard_of(trainer.engine)  # this rank's columns of the LM head
    trainer.device = torch.device(trainer.accelerator.current_device_name())
    # The layout checks that need the host run here, once; the step then calls the loss with
    # check_inputs=False (no host sync). Labels come from the tokenizer, whose ids are below the
    # model's vocabulary (NumberVocab.with_vocab_size above).
    vocab_width = trainer.vocab_shard.check_tiling(trainer.device,
                                                   trainer.vocab_shard.width or trainer.model_report.vocab_size)
    check_vocabulary_covers_numbers(vocab_width, trainer.number_vocab)
    trainer.step = 0
    trainer.tokens_seen = 0
    trainer._inputs_checked = False  # the loss's host checks run on the first forward (then check_every_step)
    trainer.nonfinite = NonfiniteGuard(cfg.train.max_nonfinite_steps, cfg.train.output_dir, trainer.layout.is_main)
    if built.load_tag is not None:
        checkpointing.resume(trainer, built.load_tag)  # the scheduler's saved iteration comes with it
    elif trainer.engine.lr_scheduler is not None:
        # optimizer step k runs at the schedule's iteration k (a warmup of W steps peaks at step W, as in
        # Megatron). DeepSpeed's schedulers start at iteration -1, whose lr is 0, and linear warmup's
        # iteration 0 is 0 too: steps 1 and 2 would not train.
        trainer.engine.lr_scheduler.step(1)
    open_run_folder(trainer)


def open_run_folder(trainer: Any) -> None:
    """The run folder's files (resolved config, DeepSpeed config, model report, number vocabulary) and the monitor."""
    cfg, output_dir = trainer.cfg, trainer.cfg.train.output_dir
    if trainer.layout.is_main:
        write_resolved(cfg, output_dir)
        _write_json(os.path.join(output_dir, "ds_config.json"), trainer.ds_config)
        _write_json(os.path.join(output_dir, "model_report.json"), asdict(trainer.model_report))
        trainer.number_vocab.save(output_dir)
    trainer.tensorboard_dir = cfg.monitor.tensorboard_dir or os.path.join(output_dir, "tensorboard")
    trainer.start_step = trainer.step
    if trainer.layout.is_main and trainer.resume_tag is not None:
        purge_tensorboard_after(trainer.tensorboard_dir, trainer.step)  # points a killed run wrote after its checkpoint
    # a tracker that cannot start (W&B not logged in, an MLflow server away) stops every rank, none waits
    trainer.monitor = run_agreed(lambda: Monitor(trainer.layout.is_main, trainer.tensorboard_dir,
                                                 total_steps=cfg.train.max_steps, progress_bar=cfg.monitor.progress_bar,
                                                 start_step=trainer.step, settings=cfg.monitor, output_dir=output_dir),
                                 True, plain=(MonitorError,))
    flops_per_token = model_flops_per_token(trainer.engine.module.config, trainer.model_report.parameters,
                                            trainer.model_report.vocab_size, cfg.data.seq_len)
    trainer.window = ThroughputWindow(trainer.layout.world_size, flops_per_token, peak_tflops_per_device(trainer.device))
    trainer.monitor.text("config", "```\n" + to_yaml(cfg) + "\n```", trainer.step)
    trainer.monitor.text("deepspeed_config", "```\n" + json.dumps(trainer.ds_config, indent=1) + "\n```", trainer.step)
    trainer.monitor.config(to_dict(cfg))


def _write_json(path: str, data: Any) -> None:
    write_json_atomic(path, data, indent=1, default=str)
