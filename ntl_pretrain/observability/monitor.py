"""Monitoring on global rank 0: TensorBoard scalars and text (and the same to W&B / MLflow when switched on,
`trackers`), a tqdm progress bar or plain log lines.

Other ranks get a `Monitor` that does nothing, so the training loop calls it unconditionally.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from typing import Any, Mapping

import torch

from ..config import MonitorConfig
from .trackers import TensorBoardWriter, TrackerStartError, open_trackers

logger = logging.getLogger(__name__)

# The scalars a training step writes (TensorBoard tag -> short name on the progress bar / log line).
STEP_TAGS = {
    "train/loss": "loss", "train/ce": "ce", "train/ntl": "ntl", "train/ntl_lambda": "lambda",
    "train/lr": "lr", "train/grad_norm": "gnorm", "train/tokens_per_s": "tok/s",
    "train/tokens_per_s_per_device": "tok/s/dev", "train/tflops_per_device": "tflops/dev", "train/mfu": "mfu",
    "train/step_time_s": "step_s", "train/number_token_share": "num_share", "train/number_mae": "num_mae",
    "train/memory_gib": "mem_gib",
}
VAL_TAGS = ("val/loss", "val/ce", "val/ntl")


class MonitorError(ValueError):
    """A writer failed: TensorBoard's event file could not be written (the run folder removed, its disk full), or a
    tracker (W&B, MLflow) could not start or log: one line, exit 2."""


def _silence_writer_thread_errors() -> None:
    """TensorBoard writes from a thread of its own; when the folder goes away that thread dies printing a raw
    traceback, and the next write of the training thread raises the same error, which `Monitor` reports in one
    line. Keep only the latter: the hook is silent for exactly that thread class and OSError, else unchanged."""
    previous = threading.excepthook
    if getattr(previous, "_ntl_tensorboard_quiet", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook._ntl_tensorboard_quiet = True
    threading.excepthook = hook


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: accelerator memory on GPUs, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def purge_tensorboard_after(tensorboard_dir: str, step: int) -> None:
    """Hide TensorBoard points after `step` that a run killed after its last checkpoint had written.

    A resumed run writes those steps again; TensorBoard's "purge_step" session marker (written here,
    before the new run's event file) makes readers drop the older points with step > `step`.
    """
    from torch.utils.tensorboard import SummaryWriter

    if not os.path.isdir(tensorboard_dir):
        return
    writer = SummaryWriter(log_dir=tensorboard_dir, purge_step=step + 1)
    writer.close()


class Monitor:
    """TensorBoard (+ the switched-on trackers) and console output of one run (active on global rank 0 only).

    Args:
        active: whether this process writes (global rank 0).
        tensorboard_dir: folder of the event files.
        total_steps: for the progress bar.
        progress_bar: "auto" (tqdm on a terminal, log lines otherwise), "always" or "never".
        start_step: the step a resumed run continues from.
        settings: the run config's `monitor` section (which trackers log beside TensorBoard); None: TensorBoard only.
        output_dir: the run folder (the trackers' default folder and run name).
    """

    def __init__(self, active: bool, tensorboard_dir: str, total_steps: int, progress_bar: str = "auto",
                 start_step: int = 0, settings: MonitorConfig | None = None, output_dir: str | None = None) -> None:
        self.active = active
        self.writers: list[Any] = []  # TensorBoard first, then the trackers: every figure goes to each
        self.writer = None  # the writers as one SummaryWriter-like object (the evaluation hooks write through it)
        self.bar = None
        if not active:
            return
        _silence_writer_thread_errors()
        self.tensorboard_dir = tensorboard_dir
        self.writers = [TensorBoardWriter(tensorboard_dir)]
        if settings is not None:
            try:
                self.writers += open_trackers(settings, output_dir or os.path.dirname(tensorboard_dir))
            except TrackerStartError as error:
                self.writers.pop().close("failed")
                raise MonitorError(str(error)) from error.__cause__
        self.writer = _AllWriters(self)
        use_bar = progress_bar == "always" or (progress_bar == "auto" and sys.stdout.isatty())
        if use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self._last_line = time.monotonic()

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Write text (e.g. the resolved config) to TensorBoard and the trackers."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)

    def config(self, config: Mapping[str, Any]) -> None:
        """The resolved run config (nested) as the trackers' run configuration / parameters (TensorBoard has it as
        text)."""
        for writer in self.writers:
            self._write(writer, writer.add_config, config)

    def _write(self, writer: Any, write: Any, *args: Any) -> None:
        """One call of one writer; its failure (raised here, or by TensorBoard's thread and re-raised at the next
        call) becomes one line naming the writer and where it writes."""
        try:
            write(*args)
        except Exception as error:  # the writer re-raises its thread's error as it was (OSError, mostly)
            if writer in self.writers:  # broken: no later call (nor the close after the error) tries it again
                self.writers.remove(writer)
            if not isinstance(writer, TensorBoardWriter):
                raise MonitorError(f"{writer.name} could not log ({writer.where}): {_reason(error)}; check the "
                                   f"tracker (its server, its folder's disk), then rerun with train.resume=auto") \
                    from error
            gone = "" if os.path.isdir(self.tensorboard_dir) else " (the folder no longer exists: was the run folder " \
                                                                  "removed?)"
            raise MonitorError(f"TensorBoard could not write to {self.tensorboard_dir!r}: {_reason(error)}{gone}; keep "
                               f"train.output_dir in place and on a disk with free space while a run trains, then "
                               f"rerun with train.resume=auto") from error

    def log_step(self, step: int, scalars: Mapping[str, float] | None) -> None:
        """Record one optimizer step (numbering from 1); `scalars` on a logging step (the trainer decides which
        steps read their figures), None on the others."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(1)
        if scalars is None:
            return
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        summary = {STEP_TAGS.get(tag, tag): value for tag, value in scalars.items()
                   if tag in ("train/loss", "train/ce", "train/ntl", "train/tokens_per_s",
                              "train/tokens_per_s_per_device", "train/tflops_per_device", "train/mfu", "train/lr",
                              "train/grad_norm")}
        if self.bar is not None:
            self.bar.set_postfix({k: _short(v) for k, v in summary.items()}, refresh=False)
        else:
            line = " ".join(f"{k}={_short(v)}" for k, v in summary.items())
            print(f"step {step}: {line}", flush=True)

    def log_validation(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.active:
            return
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        line = " ".join(f"{tag}={_short(v)}" for tag, v in scalars.items())
        self.message(f"step {step}: {line}")

    def log_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Other numbers (evaluation metrics): written as they are."""
        if not self.active:
            return
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), step)

    def message(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self, outcome: str = "finished") -> None:
        """Flush and close every writer once (later calls do nothing); `outcome` (finished, stopped by a signal,
        failed) is how the trackers record the run's end. Every writer is closed even when one fails."""
        if self.bar is not None:
            self.bar, bar = None, self.bar
            bar.close()
        writers, self.writers, self.writer = self.writers, [], None  # closed once, even when closing fails
        failure = None
        for writer in writers:
            try:
                self._write(writer, writer.close, outcome)
            except MonitorError as error:
                failure = failure or error
        if failure is not None:
            raise failure


class _AllWriters:
    """The monitor's writers behind TensorBoard's `SummaryWriter` calls: each call goes to every writer."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor

    def _each(self, call: str, *args: Any) -> None:
        for writer in self._monitor.writers:
            self._monitor._write(writer, getattr(writer, call), *args)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._each("add_scalar", tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._each("add_text", tag, text, step)

    def flush(self) -> None:
        self._each("flush")


def _reason(error: BaseException) -> str:
    return getattr(error, "strerror", None) or " ".join(str(error).split()) or type(error).__name__


def _short(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"
