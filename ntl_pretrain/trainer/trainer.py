"""The training loop: DeepSpeed engine (ZeRO 0-3, AutoTP), CE + vocabulary-parallel NTL with global
normalisation, LR and NTL-weight schedules, validation, checkpoint and evaluation hooks, monitoring.

Started once per rank by DeepSpeed's launcher (`deepspeed launch/pretrain.sh --config X.yaml k=v ...`).
One optimizer step: fetch this rank's `grad_accum_steps` micro-batches -> count the step's tokens and
NTL positions over the loss group (`ParallelGroups.loss_group`, one all-reduce) -> per micro-batch: local logits -> CE/NTL
sums -> loss scaled so the update is CE_mean + lambda * NTL_mean of the GLOBAL batch -> backward ->
`engine.step()` (DeepSpeed clips and steps at the accumulation boundary) -> on a logging step
(`train.log_every_n_steps`), read the figures and log; no other step reads the device.

The pieces: `preflight` (start-up checks, `--dry-run`), `ds_config` (the configuration resolved once,
with the DeepSpeed config), `engine` (model, checkpoint manager and engine), `training_objective` (what a
step optimises), `nonfinite` (the step's guard); `cli` is the command line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict
from typing import Any, Callable, TypeVar

import psutil
import torch

from ..checkpoint import AgreedCheckpointError, CheckpointError, export_hf, lr_schedule_description, run_on_main, write_hf_assets
from ..config import Config, to_dict, to_yaml, write_resolved
from ..core.agreement import agree_on_error, run_agreed
from ..core.fs import write_json_atomic
from ..data import PretrainingData, data_description, document_texts, load_documents, prepare_generated_corpus
from ..eval.config import save_eval_settings
from ..loss import ce_ntl_sums, chunked_model_ce_ntl_sums, vocab_shard_of
from ..loss.objective import SUMS_WIDTH, check_vocabulary_covers_numbers
from ..loss.sequence_shard import SequenceShard, shard_number_spans
from ..models.build import load_run_tokenizer
from ..observability.monitor import Monitor, MonitorError, memory_gib, purge_tensorboard_after
from ..observability.throughput import ThroughputWindow, model_flops_per_token, peak_tflops_per_device
from ..parallel import distributed
from ..parallel.layout import ParallelGroups
from ..parallel.ulysses import shard_inputs
from ..runtime import lifecycle
from ..runtime.supervisor import COMMAND_START_ENV
from ..tokenizer.coverage import check_training_digits
from ..tokenizer.run import needs_training, tokenizer_source, train_digit_bpe
from .engine import build_engine
from .preemption import PreemptionHandler
from .preflight import check_data_files, check_eval_inputs, check_output_dir, number_vocab_for, output_problems, preflight
from .step_guard import (
    NonfiniteGuard,
    TrainingDiverged,
    check_weights_finite,
    describe_figures,
    finite_step,
    nan_gradient_if_nonfinite,
    unpartitioned_grad_norm,
    update_skipped,
)
from .training_objective import StepFigures

logger = logging.getLogger("ntl_pretrain")
T = TypeVar("T")
__all__ = ["Trainer", "TrainingDiverged", "collective_call"]


# ---------------------------------------------------------------------------------------------- start-up
def collective_call(fn: Callable[[], T], first: bool) -> T:
    """Run `fn` on the `first` processes, then on the others (which then find caches and files ready).

    An error on any process is raised on every process (`run_agreed`), so none waits in a
    collective for a dead one.
    """
    result = run_agreed(fn, first)
    later = run_agreed(fn, not first)
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


# ---------------------------------------------------------------------------------------------- the run
class Trainer:
    """One training run on this process (every rank builds one)."""

    def __init__(self, cfg: Config) -> None:
        # the run's wall time counts from the command (launch/pretrain.sh's supervisor passes its start;
        # under another launcher, from this process's start)
        self.started = float(os.environ.get(COMMAND_START_ENV) or psutil.Process().create_time())
        self.stopped_by: str | None = None  # the signal that stopped the run early (None: ran to the end)
        self.last_scalars: dict[str, float] = {}  # the figures of the last logging step
        self.last_logged_step = 0
        self.last_validation: dict[str, float] = {}
        self.saved_tag: str | None = None
        self.export_dir: str | None = None
        world_size, local_rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
        from deepspeed.accelerator import get_accelerator

        self.accelerator = get_accelerator()
        # checks that need no communication, before it starts (the same on every rank); the configuration is
        # resolved here once (tp_size=auto, the user's DeepSpeed JSON) and not changed afterwards
        checked = preflight(cfg, world_size, self.accelerator.device_name() == "cpu", lifecycle.local_world_size())
        self.cfg = cfg = checked.run.cfg
        self.ds_config = checked.run.ds_config
        self.objective = checked.objective  # NTL on/off, its weight schedule and the LM head: decided once
        self.model_config = checked.model_config
        check_data_files(cfg)
        output_problem = output_problems(cfg)  # every rank writes checkpoint shards: each checks its own view
        lifecycle.use_environment_extensions_dir()
        lifecycle.announce_shm_op_build(local_rank)
        self.watchdog = lifecycle.StartupWatchdog(cfg.train.startup_timeout_s)
        with self.watchdog.waiting(f"DeepSpeed's communication start-up (its CPU op built on first use, then the "
                                   f"rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR', '?')}:"
                                   f"{os.environ.get('MASTER_PORT', '?')})"):
            distributed.init_distributed(cfg.train.dist_timeout_minutes)
        self.layout = distributed.layout(cfg.parallel)  # sizes and ranks; the groups come with the engine
        _setup_logging(self.layout.is_main)
        if checked.run.tp_note:
            logger.info(checked.run.tp_note)
        for line in checked.warnings:
            logger.warning(line)
        logger.info(self.objective.describe())
        # installed first: a stop signal during start-up ends the process at once (no step to save), later it saves
        self.preemption = PreemptionHandler(cfg.checkpoint.preempt_signals, cfg.checkpoint.preempt_grace_s)
        self.preemption.install()
        # the first collective: one run per output folder (global rank 0 holds the lock; all ranks agree)
        self.lock = lifecycle.RunLock(cfg.train.output_dir)
        try:
            with self.watchdog.waiting("every rank to reach the first collective (the run-folder lock)"):
                agree_on_error(output_problem)  # every rank stops if any cannot write, none waits
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
        # every rank reads the folder; a refusal (another run's checkpoints, a bad resume) is printed once
        self.resume_tag = run_agreed(lambda: check_output_dir(cfg), True, AgreedCheckpointError,
                                                 plain=(CheckpointError,))
        torch.manual_seed(cfg.train.seed)
        main_first = self.layout.is_main
        with self.watchdog.waiting("global rank 0 to prepare the generated corpus and the tokenizer"):
            collective_call(lambda: _prepare_assets(cfg), first=main_first)
        with self.watchdog.waiting("global rank 0 to load the tokenizer"):
            self.tokenizer = collective_call(lambda: load_run_tokenizer(cfg.tokenizer, cfg.model), first=main_first)
        collective_call(lambda: check_eval_inputs(cfg, self.model_config, read_hub=True), first=main_first)
        number_vocab = number_vocab_for(cfg, self.objective, self.tokenizer)
        with self.watchdog.waiting("local rank 0 of each node to tokenize and pack the data (then the others)"):
            self.data = collective_call(
                lambda: PretrainingData.build(cfg.data, self.tokenizer, dp_rank=self.layout.data_rank,
                                              dp_size=self.layout.data_size),
                first=self.layout.local_rank == 0)
        collective_call(lambda: check_training_digits(  # a bounded sample, the same on every rank: reported once
            self.tokenizer, number_vocab, self.data, source=tokenizer_source(cfg.tokenizer, cfg.model),
            ntl_on=self.objective.ntl_on and cfg.tokenizer.digit_level,
            allow=cfg.tokenizer.allow_non_digit_level), first=True)
        if cfg.train.val_every_n_steps >= 0:
            self.data.check_validation(cfg.train.val_batches)

        built = build_engine(cfg, self.ds_config, self.tokenizer, number_vocab, self.layout, self.resume_tag,
                             data=data_description(cfg.data), lr_schedule=lr_schedule_description(self.ds_config),
                             watchdog=self.watchdog)
        self.engine, self.model_report, self.number_vocab = built.engine, built.model_report, built.number_vocab
        self.checkpoints, self.ds_config = built.checkpoints, built.ds_config
        self.ulysses = built.ulysses  # None without sequence parallelism
        self.sequence = built.ulysses.shard if built.ulysses else SequenceShard()  # this rank's slice of every row
        derived = (self.engine.train_micro_batch_size_per_gpu(), self.engine.gradient_accumulation_steps())
        if derived != (cfg.data.micro_batch_size, cfg.train.grad_accum_steps):  # resolved as DeepSpeed does
            raise RuntimeError(f"DeepSpeed derived (micro batch, accumulation) = {derived}, the resolved config "
                               f"{(cfg.data.micro_batch_size, cfg.train.grad_accum_steps)}")
        self.groups = ParallelGroups.from_deepspeed(self.layout)  # every group a reduction uses (checked here)
        self.vocab_shard = vocab_shard_of(self.engine)  # this rank's columns of the LM head
        self.device = torch.device(self.accelerator.current_device_name())
        # The layout checks that need the host run here, once; the step then calls the loss with
        # check_inputs=False (no host sync). Labels come from the tokenizer, whose ids are below the
        # model's vocabulary (NumberVocab.with_vocab_size above).
        vocab_width = self.vocab_shard.check_tiling(self.device, self.vocab_shard.width or self.model_report.vocab_size)
        check_vocabulary_covers_numbers(vocab_width, self.number_vocab)
        self.step = 0
        self.tokens_seen = 0
        self._inputs_checked = False  # the loss's host checks run on the first forward (then check_every_step)
        self.nonfinite = NonfiniteGuard(cfg.train.max_nonfinite_steps, cfg.train.output_dir, self.layout.is_main)
        if built.load_tag is not None:
            self._resume(built.load_tag)  # the scheduler's saved iteration comes with it
        elif self.engine.lr_scheduler is not None:
            # optimizer step k runs at the schedule's iteration k (a warmup of W steps peaks at step W, as in
            # Megatron). DeepSpeed's schedulers start at iteration -1, whose lr is 0, and linear warmup's
            # iteration 0 is 0 too: steps 1 and 2 would not train.
            self.engine.lr_scheduler.step(1)
        self._open_run_folder()

    def _open_run_folder(self) -> None:
        """The run folder's files (resolved config, DeepSpeed config, model report, number vocabulary) and the monitor."""
        cfg, output_dir = self.cfg, self.cfg.train.output_dir
        if self.layout.is_main:
            write_resolved(cfg, output_dir)
            _write_json(os.path.join(output_dir, "ds_config.json"), self.ds_config)
            _write_json(os.path.join(output_dir, "model_report.json"), asdict(self.model_report))
            self.number_vocab.save(output_dir)
        self.tensorboard_dir = cfg.monitor.tensorboard_dir or os.path.join(output_dir, "tensorboard")
        self.start_step = self.step
        if self.layout.is_main and self.resume_tag is not None:
            purge_tensorboard_after(self.tensorboard_dir, self.step)  # points a killed run wrote after its checkpoint
        # a tracker that cannot start (W&B not logged in, an MLflow server away) stops every rank, none waits
        self.monitor = run_agreed(lambda: Monitor(self.layout.is_main, self.tensorboard_dir,
                                                  total_steps=cfg.train.max_steps, progress_bar=cfg.monitor.progress_bar,
                                                  start_step=self.step, settings=cfg.monitor, output_dir=output_dir),
                                  True, plain=(MonitorError,))
        flops_per_token = model_flops_per_token(self.engine.module.config, self.model_report.parameters,
                                                self.model_report.vocab_size, cfg.data.seq_len)
        self.window = ThroughputWindow(self.layout.world_size, flops_per_token, peak_tflops_per_device(self.device))
        self.monitor.text("config", "```\n" + to_yaml(cfg) + "\n```", self.step)
        self.monitor.text("deepspeed_config", "```\n" + json.dumps(self.ds_config, indent=1) + "\n```", self.step)
        self.monitor.config(to_dict(cfg))

    # ------------------------------------------------------------------ one step
    def _forward_sums(self, batch: Any, with_ntl: bool) -> Any:
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)
        # the host checks (labels, the shard layout, the chunked head's returned logits) run on the first
        # micro-batch; on every one only to debug (loss.check_every_step)
        check = self.cfg.loss.check_every_step or not self._inputs_checked
        self._inputs_checked = True
        inputs, spans = {"input_ids": input_ids}, None
        if self.sequence.size > 1:
            # sequence parallelism: this rank's slice with its global positions; the labels' slice, and the
            # whole rows' number spans for number-level NTL (parallel/ulysses.py, loss/sequence_shard.py)
            inputs = shard_inputs(input_ids, self.sequence).as_kwargs()
            if with_ntl and self.objective.settings.variant == "number_level":
                spans = shard_number_spans(labels, self.sequence, self.number_vocab, self.objective.settings)
            labels = self.sequence.split(labels)
        if self.objective.chunk_tokens:
            # the head + loss over chunks of tokens: the full logits never exist (docs/chunked.md)
            return chunked_model_ce_ntl_sums(self.engine, self.engine.module.get_output_embeddings(),
                                             inputs, labels, self.number_vocab, self.objective.settings,
                                             chunk_tokens=self.objective.chunk_tokens, shard=self.vocab_shard,
                                             with_ntl=with_ntl, check_inputs=check,
                                             backward=self.objective.chunk_backward, spans=spans)
        logits = self.engine(**inputs).logits
        return ce_ntl_sums(logits, labels, self.number_vocab, self.objective.settings, shard=self.vocab_shard,
                           with_ntl=with_ntl, check_inputs=check, spans=spans)

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` reads its figures to the host and logs them: the first, every
        `train.log_every_n_steps`-th and the last."""
        return step == 1 or step % self.cfg.train.log_every_n_steps == 0 or step == self.cfg.train.max_steps

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step; on a logging step (`logs_at`) returns its global figures (identical on every
        rank), else None.

        Between logging steps nothing is read from the device: counts, losses and figures stay device
        tensors, and the step time comes from the logging window (`ThroughputWindow`). A logging step makes
        one device-to-host transfer, the logged figures at its end. Without ZeRO every step reads its figures
        just before the update, which they decide. A non-finite loss or gradient norm skips the update
        (`nonfinite`).
        """
        step, objective, accumulation = self.step + 1, self.objective, self.cfg.train.grad_accum_steps
        micro_batches = self.data.next_step(accumulation)
        counts = objective.count([mb.labels.to(self.device, non_blocking=True) for mb in micro_batches],
                                 self.number_vocab, self.groups, self.sequence)
        totals = torch.zeros(SUMS_WIDTH, dtype=torch.float64, device=self.device)
        for index, batch in enumerate(micro_batches):
            sums = self._forward_sums(batch, objective.ntl_on)
            loss = objective.micro_batch_loss(sums, counts, step, self.layout, accumulation)
            self.engine.backward(nan_gradient_if_nonfinite(loss))
            totals += sums.stack().double()  # ObjectiveSums order: the order StepFigures reads back
            if index < len(micro_batches) - 1:
                self.engine.step()  # inside the accumulation: DeepSpeed only counts the micro-batch
        lr = float(self.engine.get_lr()[0])  # what this step's update uses (the schedule moves with the step)
        figures, grad_norm = self._optimizer_step(totals, step)
        self.step = step
        step_tokens = sum(mb.input_ids.numel() for mb in micro_batches) * self.layout.data_size
        self.tokens_seen += step_tokens
        self.window.add(step_tokens)
        if not self.logs_at(step):
            return None
        if figures is None:
            figures = self._step_figures(totals, grad_norm)  # the logging step's one read
        loss, ce, ntl = objective.losses(figures, step)
        return {
            "train/loss": loss, "train/ce": ce, "train/ntl": ntl, "train/ntl_lambda": objective.ntl_lambda(step),
            "train/lr": lr,
            "train/grad_norm": figures.grad_norm if figures.grad_norm is not None else 0.0,
            **self.window.read(),
            "train/number_token_share": figures.number_tokens / max(figures.tokens, 1.0),
            "train/number_mae": figures.abs_error_sum / figures.number_tokens if figures.number_tokens > 0 else 0.0,
            "train/memory_gib": memory_gib(self.device),
            "train/nonfinite_steps": float(self.nonfinite.total),
        }

    def _optimizer_step(self, totals: torch.Tensor, step: int) -> tuple[StepFigures | None, Any]:
        """Close the accumulation with `engine.step()` (DeepSpeed clips and updates), count a skipped update
        (`NonfiniteGuard`), and return (the figures when this step had to read them, the gradient norm)."""
        if self.cfg.parallel.zero_stage == 0:
            # no ZeRO: DeepSpeed's engine neither keeps a norm nor skips a non-finite update, so the
            # figures are read before the update and decide it (one read every step)
            figures = self._step_figures(totals, unpartitioned_grad_norm(self.engine))
            finite = finite_step(figures.ce_sum, figures.ntl_sum, figures.grad_norm)
            if finite:
                self.engine.step()
            else:
                with update_skipped(self.engine):
                    self.engine.step()
            self.nonfinite.check(step, not finite, describe_figures(figures.ce_sum, figures.ntl_sum, figures.grad_norm))
            return figures, figures.grad_norm
        # ZeRO 1-3: DeepSpeed skips the update itself when the gradient norm is not finite; its own check
        # read the norm, so whether it skipped is known on the host without a read of ours
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        self.nonfinite.check(step, self.engine.skipped_steps > skipped_before,
                             "DeepSpeed's overflow check found the global gradient norm not finite")
        return None, self.engine.get_global_grad_norm()

    def _step_figures(self, totals: torch.Tensor, grad_norm: Any) -> StepFigures:
        """The step's global sums (summed over the loss group; every rank calls this at the same step)
        and the gradient norm, read to the host in ONE transfer."""
        if self.layout.loss_size > 1:
            torch.distributed.all_reduce(totals, group=self.groups.loss_group)
        if torch.is_tensor(grad_norm):
            return StepFigures(*torch.cat([totals, grad_norm.detach().reshape(1).to(totals)]).tolist())
        return StepFigures(*totals.tolist(), None if grad_norm is None else float(grad_norm))

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """CE, NTL and total loss on the held-out samples (global means; every rank runs the same batches count)."""
        self.engine.eval()
        totals = torch.zeros(SUMS_WIDTH, dtype=torch.float64, device=self.device)
        for batch in self.data.validation_micro_batches(self.cfg.train.val_batches):
            with torch.no_grad():  # forward only (the chunked head would otherwise prepare gradients)
                totals += self._forward_sums(batch, self.objective.ntl_on).stack().double()
        self.engine.train()
        figures = StepFigures(*distributed.all_reduce_sum(totals.tolist(), self.groups.loss_group, self.device))
        loss, ce, ntl = self.objective.losses(figures, max(self.step, 1))
        return {"val/loss": loss, "val/ce": ce, "val/ntl": ntl}

    # ------------------------------------------------------------------ checkpoints and evaluation
    def save_checkpoint(self) -> str:
        """Save a checkpoint of the current step on every rank (atomic; keeps the last K)."""
        check_weights_finite(self.engine, self.device, self.step, self.cfg.train.output_dir)
        client_state = {"step": self.step, "tokens_seen": self.tokens_seen, "data": self.data.state_dict(),
                        "ntl_lambda": self.objective.ntl_lambda(max(self.step, 1)), "config": to_yaml(self.cfg)}
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
        from ..eval.hooks import run_evaluation

        # generation: whole prompts with the plain attention on every rank, prompts split over all dp x sp ranks
        # under sequence parallelism (UlyssesAttention.unsharded); the dp group otherwise
        unsharded = self.ulysses.unsharded() if self.ulysses else contextlib.nullcontext()
        prompts_group = self.groups.loss_group if self.ulysses else self.groups.dp_group
        with unsharded:
            results = run_evaluation(self.engine, self.tokenizer, self.cfg.eval, step=self.step,
                                     output_dir=self.cfg.train.output_dir, writer=self.monitor.writer,
                                     tp_group=self.groups.tp_group, dp_group=prompts_group, final=final)
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
        sp = f"sp={self.layout.sp_size} " if self.layout.sp_size > 1 else ""  # the dp x tp line as before without sp
        self.monitor.message(f"training steps {self.step + 1}..{cfg.train.max_steps}: dp={self.layout.dp_size} "
                             f"{sp}tp={self.layout.tp_size} zero={cfg.parallel.zero_stage} micro_batch="
                             f"{cfg.data.micro_batch_size} grad_accum={cfg.train.grad_accum_steps} seq_len={cfg.data.seq_len}")
        saved_at = None
        # from here a stop signal saves at the next step boundary (the supervisor forwards it to the started
        # ranks); before, during start-up, it ends the job at once: nothing has been trained to save
        self.preemption.training_starts()
        lifecycle.report_to_supervisor("started")
        self.window.restart()
        while self.step < cfg.train.max_steps:
            scalars = self.train_step()
            if scalars is not None:
                self.last_scalars, self.last_logged_step = scalars, self.step
            self.monitor.log_step(self.step, scalars)
            # every rank, every step: one integer all-reduced on the host (gloo), no device sync
            signal_name = self.preemption.requested()
            if signal_name is not None:
                self._stop_for_preemption(signal_name)
                return
            last = self.step == cfg.train.max_steps
            with self.window.paused():  # not training steps: kept out of the logged step time and tokens/s
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
        self.monitor.close("stopped" if self.stopped_by else "finished")
        self.preemption.uninstall()

    def close_after_failure(self) -> None:
        """Close the monitor of a run that ended by an error (the trackers mark it failed); nothing if it is
        closed already. Another failure while closing is logged: the run's own error is the one reported."""
        try:
            self.monitor.close("failed")
        except Exception as error:  # the run's own error is reported; this one only logged
            logger.warning("closing the monitor after the run's error failed too: %s", error)

    def summary(self) -> str:
        """Steps, wall time, tokens, final losses and where the run's outputs are."""
        output_dir = self.cfg.train.output_dir
        seconds = max(time.time() - self.started, 0.0)
        steps = self.step - self.start_step
        how = f"stopped by {self.stopped_by} at step {self.step}" if self.stopped_by else f"finished at step {self.step}"
        losses = " ".join(f"{k.split('/', 1)[1]}={self.last_scalars[k]:.4g}" for k in ("train/loss", "train/ce", "train/ntl")
                          if k in self.last_scalars)
        val = " ".join(f"{k}={v:.4g}" for k, v in self.last_validation.items())
        lines = [f"run summary: {how}: {steps} steps in {seconds / 60:.1f} min (from the command's start), "
                 f"{self.tokens_seen:,} tokens seen in total",
                 f"  train (last logged, step {self.last_logged_step}): {losses or '-'}" + (f"; {val}" if val else ""),
                 f"  checkpoint: {os.path.join(output_dir, self.saved_tag) if self.saved_tag else 'none saved'}"
                 + (" (continue with train.resume=auto)" if self.stopped_by else ""),
                 f"  export: {self.export_dir or 'none (checkpoint.export_hf_at_end=false)'}",
                 f"  TensorBoard: tensorboard --logdir {self.tensorboard_dir}"]
        return "\n".join(lines)


def _write_json(path: str, data: Any) -> None:
    write_json_atomic(path, data, indent=1, default=str)
