"""A run's start-up on this process: the checks that need no communication (`preflight`), the process group,
logging, the pre-emption handler and the run-folder lock (`start`), then the generated corpus and demo tokenizer,
the tokenizer, the data, the engine and a resume (`build`), and the run folder's files and monitor
(`open_run_folder`). `start` returns what they built: the run's parts (`TrainerParts`, frozen) and its state
(`TrainingState`: step 0, or a resume's)."""

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
from ..parallel.layout import ParallelGroups, ParallelLayout
from ..runtime import lifecycle
from ..tokenizer.coverage import check_training_digits
from ..tokenizer.run import needs_training, tokenizer_source, train_digit_bpe
from . import checkpointing
from .engine import BuiltEngine, build_engine
from .parts import TrainerParts, TrainingState
from .preemption import PreemptionHandler
from .preflight import (Preflight, attention_mode, check_data_files, check_eval_inputs, check_output_dir,
                        number_vocab_for, output_problems, preflight, stage_table_text)
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


def start(cfg: Config) -> tuple[TrainerParts, TrainingState]:
    """Checks, the process group, logging, the pre-emption handler and the run-folder lock, then `build`: the
    run's parts and its state (a resume's, else step 0)."""
    world_size, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    # checks that need no communication, before it starts (the same on every rank); the configuration is
    # resolved here once (tp_size=auto, the user's DeepSpeed JSON) and not changed afterwards. The objective
    # (NTL on/off, its weight schedule and the LM head) is decided here once too.
    checked = preflight(cfg, world_size, accelerator.device_name() == "cpu", lifecycle.local_world_size())
    cfg = checked.run.cfg
    check_data_files(cfg)
    output_problem = output_problems(cfg)  # every rank writes checkpoint shards: each checks its own view
    lifecycle.use_environment_extensions_dir()
    lifecycle.announce_shm_op_build(local_rank)
    watchdog = lifecycle.StartupWatchdog(cfg.train.startup_timeout_s)
    with watchdog.waiting(f"DeepSpeed's communication start-up (its CPU op built on first use, then the "
                          f"rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR', '?')}:"
                          f"{os.environ.get('MASTER_PORT', '?')})"):
        distributed.init_distributed(cfg.train.dist_timeout_minutes)
    layout = distributed.layout(cfg.parallel)  # sizes and ranks; the groups come with the engine
    setup_logging(layout.is_main)
    if checked.run.tp_note:
        logger.info(checked.run.tp_note)
    for line in checked.warnings:
        logger.warning(line)
    logger.info(checked.objective.describe())
    logger.info(attention_mode(cfg))
    if cfg.data.stages:
        logger.info("\n".join(stage_table_text(cfg)))
    # installed first: a stop signal during start-up ends the process at once (no step to save), later it saves
    preemption = PreemptionHandler(cfg.checkpoint.preempt_signals, cfg.checkpoint.preempt_grace_s)
    preemption.install()
    # the first collective: one run per output folder (global rank 0 holds the lock; all ranks agree)
    lock = lifecycle.RunLock(cfg.train.output_dir)
    try:
        with watchdog.waiting("every rank to reach the first collective (the run-folder lock)"):
            agree_on_error(output_problem)  # every rank stops if any cannot write, none waits
            collective_call(lock.acquire if layout.is_main else (lambda: None), first=True)
    finally:
        lifecycle.remove_own_shm_buffer()  # every rank reached a collective: every buffer is mapped
    try:
        return build(checked, layout, watchdog, accelerator, preemption, lock)
    except BaseException:
        lock.release(failed=True)
        raise


def build(checked: Preflight, layout: ParallelLayout, watchdog: lifecycle.StartupWatchdog, accelerator: Any,
          preemption: PreemptionHandler, lock: lifecycle.RunLock) -> tuple[TrainerParts, TrainingState]:
    """Data, tokenizer, model, engine, resume and the run folder's files (after the lock is held)."""
    cfg, objective = checked.run.cfg, checked.objective
    # every rank reads the folder; a refusal (another run's checkpoints, a bad resume) is printed once
    resume_tag = run_agreed(lambda: check_output_dir(cfg), True, AgreedCheckpointError, plain=(CheckpointError,))
    seed_generators(cfg.train.seed)  # Python's, NumPy's and torch's: a checkpoint's RNG files then repeat too
    with watchdog.waiting("global rank 0 to prepare the generated corpus and the tokenizer"):
        collective_call(lambda: prepare_assets(cfg), first=layout.is_main)
    with watchdog.waiting("global rank 0 to load the tokenizer"):
        tokenizer = collective_call(lambda: load_run_tokenizer(cfg.tokenizer, cfg.model), first=layout.is_main)
    collective_call(lambda: check_eval_inputs(cfg, checked.model_config, read_hub=True), first=layout.is_main)
    number_vocab = number_vocab_for(cfg, objective, tokenizer)
    with watchdog.waiting("local rank 0 of each node to tokenize and pack the data (then the others)"):
        data = collective_call(lambda: PretrainingData.build(cfg.data, tokenizer, dp_rank=layout.data_rank,
                                                             dp_size=layout.data_size),
                               first=layout.local_rank == 0)
    collective_call(lambda: check_training_digits(  # a bounded sample, the same on every rank: reported once
        tokenizer, number_vocab, data, source=tokenizer_source(cfg.tokenizer, cfg.model),
        ntl_on=objective.ntl_on and cfg.tokenizer.digit_level, allow=cfg.tokenizer.allow_non_digit_level), first=True)
    if cfg.train.validation_on:
        data.check_validation(cfg.train.val_batches)

    built = build_engine(cfg, checked.run.ds_config, tokenizer, number_vocab, layout, resume_tag,
                         data=data_description(cfg.data), lr_schedule=lr_schedule_description(checked.run.ds_config),
                         watchdog=watchdog)
    engine = built.engine
    derived = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps())
    if derived != (cfg.data.micro_batch_size, cfg.train.grad_accum_steps):  # resolved as DeepSpeed does
        raise RuntimeError(f"DeepSpeed derived (micro batch, accumulation) = {derived}, the resolved config "
                           f"{(cfg.data.micro_batch_size, cfg.train.grad_accum_steps)}")
    groups = ParallelGroups.from_deepspeed(layout)  # every group a reduction uses (checked here)
    vocab_shard = vocab_shard_of(engine)  # this rank's columns of the LM head
    device = torch.device(accelerator.current_device_name())
    # The layout checks that need the host run here, once; the step then calls the loss with
    # check_inputs=False (no host sync). Labels come from the tokenizer, whose ids are below the
    # model's vocabulary (NumberVocab.with_vocab_size above).
    vocab_width = vocab_shard.check_tiling(device, vocab_shard.width or built.model_report.vocab_size)
    check_vocabulary_covers_numbers(vocab_width, built.number_vocab)
    state = TrainingState()  # the loss's host checks run on its first forward (then loss.check_every_step)
    nonfinite = NonfiniteGuard(cfg.train.max_nonfinite_steps, cfg.train.output_dir, layout.is_main)
    if built.load_tag is not None:
        checkpointing.resume(built, data, state, cfg.train.output_dir)  # the scheduler's saved iteration comes with it
    elif engine.lr_scheduler is not None:
        # optimizer step k runs at the schedule's iteration k (a warmup of W steps peaks at step W, as in
        # Megatron). DeepSpeed's schedulers start at iteration -1, whose lr is 0, and linear warmup's
        # iteration 0 is 0 too: steps 1 and 2 would not train.
        engine.lr_scheduler.step(1)
    tensorboard_dir, monitor, window = open_run_folder(cfg, built, layout, device, resumed=resume_tag is not None,
                                                       step=state.step)
    parts = TrainerParts(
        cfg=cfg, ds_config=built.ds_config, objective=objective, layout=layout, groups=groups, device=device,
        tokenizer=tokenizer, data=data, engine=engine, model_report=built.model_report,
        number_vocab=built.number_vocab, vocab_shard=vocab_shard, ulysses=built.ulysses,
        sequence=built.ulysses.shard if built.ulysses else SequenceShard(),  # this rank's slice of every row
        # the EOS that ends each packed document when attention stays inside documents (data.document_mask)
        document_eos_id=tokenizer.eos_token_id if cfg.data.document_mask else None,
        checkpoints=built.checkpoints, nonfinite=nonfinite, preemption=preemption, lock=lock, monitor=monitor,
        window=window, tensorboard_dir=tensorboard_dir)
    return parts, state


def open_run_folder(cfg: Config, built: BuiltEngine, layout: ParallelLayout, device: torch.device, resumed: bool,
                    step: int) -> tuple[str, Monitor, ThroughputWindow]:
    """The run folder's files (resolved config, DeepSpeed config, model report, number vocabulary), then
    (the TensorBoard folder, the monitor, the throughput window) of a run at `step`."""
    output_dir = cfg.train.output_dir
    if layout.is_main:
        write_resolved(cfg, output_dir)
        _write_json(os.path.join(output_dir, "ds_config.json"), built.ds_config)
        _write_json(os.path.join(output_dir, "model_report.json"), asdict(built.model_report))
        built.number_vocab.save(output_dir)
    tensorboard_dir = cfg.monitor.tensorboard_dir or os.path.join(output_dir, "tensorboard")
    if layout.is_main and resumed:
        purge_tensorboard_after(tensorboard_dir, step)  # points a killed run wrote after its checkpoint
    # a tracker that cannot start (W&B not logged in, an MLflow server away) stops every rank, none waits
    monitor = run_agreed(lambda: Monitor(layout.is_main, tensorboard_dir, total_steps=cfg.train.max_steps,
                                         progress_bar=cfg.monitor.progress_bar, start_step=step, settings=cfg.monitor,
                                         output_dir=output_dir),
                         True, plain=(MonitorError,))
    flops_per_token = model_flops_per_token(built.engine.module.config, built.model_report.parameters,
                                            built.model_report.vocab_size, cfg.data.seq_len)
    window = ThroughputWindow(layout.world_size, flops_per_token, peak_tflops_per_device(device))
    monitor.text("config", "```\n" + to_yaml(cfg) + "\n```", step)
    monitor.text("deepspeed_config", "```\n" + json.dumps(built.ds_config, indent=1) + "\n```", step)
    monitor.config(to_dict(cfg))
    return tensorboard_dir, monitor, window


def _write_json(path: str, data: Any) -> None:
    write_json_atomic(path, data, indent=1, default=str)
