"""The model, checkpoint manager and DeepSpeed engine of a run, built one way for the trainer and
tools/evaluate.py (`build_engine`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from ..core.lr_schedules import register_with_deepspeed
from ..checkpoint import CheckpointManager, fingerprint
from ..config import Config
from ..core.numbers import NumberVocab
from ..models.build import ModelReport, build_model
from ..models.loading import check_tp_load_filled
from ..parallel.ulysses import UlyssesAttention, register_ulysses_attention, release_ulysses_attention
from .ds_config import resumed_deepspeed_config

logger = logging.getLogger("ntl_pretrain")


@dataclass
class BuiltEngine:
    """The DeepSpeed engine of a run and what was built with it (`build_engine`)."""

    engine: Any
    model_report: ModelReport
    number_vocab: NumberVocab  # sized to the model's vocabulary
    checkpoints: CheckpointManager
    ds_config: dict  # as handed to deepspeed.initialize (a resume's schedule and universal load included)
    load_tag: str | None  # the checkpoint to load into `engine` (`checkpoints.load`), None: a fresh start
    ulysses: UlyssesAttention | None = None  # DeepSpeed's Ulysses attention (parallel.sp_size > 1), else None


def build_engine(cfg: Config, ds_config: dict, tokenizer: Any, number_vocab: NumberVocab, layout: Any,
                 resume_tag: str | None, data: dict | None = None, lr_schedule: dict | None = None,
                 watchdog: Any = None) -> BuiltEngine:
    """Model, checkpoint manager and DeepSpeed engine of the resolved `cfg` on every rank (the trainer's and
    tools/evaluate.py's). With `resume_tag` (a checkpoint in train.output_dir) the manager checks it first
    (manifest, fingerprint of model, tokenizer and number vocabulary; `data` and `lr_schedule`: the
    descriptions a resume must match, None: not checked) and plans its load (its universal form when the
    layout changed)."""
    model, report = build_model(cfg.model, tokenizer, cfg.parallel.tp_size, ds_config,
                                document_rows=cfg.data.micro_batch_size if cfg.data.document_mask else 0)
    number_vocab = number_vocab.with_vocab_size(report.vocab_size)
    logger.info("model %s: %.1fM parameters, vocabulary %d (tokenizer %d), attention %s, %s", report.source,
                report.parameters / 1e6, report.vocab_size, report.tokenizer_size, report.attn_implementation,
                report.dtype)
    checkpoints = CheckpointManager(cfg.checkpoint, cfg.train.output_dir, layout, cfg.parallel.zero_stage,
                                    fingerprint(model.config, tokenizer, number_vocab), seed=cfg.train.seed,
                                    data=data, lr_schedule=lr_schedule)
    load_tag = None
    if resume_tag is not None:
        kept = checkpoints.resume_lr_schedule(resume_tag)  # checkpoint.resume_lr_schedule=keep
        load_tag = checkpoints.plan_resume(resume_tag)  # checks; universal form if the layout changed
        ds_config = resumed_deepspeed_config(ds_config, kept, load_universal=load_tag != resume_tag)
    import deepspeed

    register_with_deepspeed()  # this project's lr schedules (optim.lr_schedule=wsd), found by their type names

    ulysses = None
    if cfg.parallel.sp_size > 1:  # Ulysses attention and DeepSpeed's sequence-parallel groups, before the engine
        ulysses = register_ulysses_attention(model, cfg.parallel.sp_size, cfg.data.micro_batch_size,
                                             document_mask=cfg.data.document_mask)
    else:
        release_ulysses_attention()  # an earlier engine's, in this process (tests build several)
    with (watchdog.waiting("every rank to set up the DeepSpeed engine (deepspeed.initialize)") if watchdog
          else contextlib.nullcontext()):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                               mpu=ulysses.mpu if ulysses else None)
    check_tp_load_filled(engine.module)  # a sliced AutoTP load filled inside deepspeed.initialize
    return BuiltEngine(engine=engine, model_report=report, number_vocab=number_vocab, checkpoints=checkpoints,
                       ds_config=ds_config, load_tag=load_tag, ulysses=ulysses)
