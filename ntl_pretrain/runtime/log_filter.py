"""Known-harmless output of the libraries, filtered from a run's log (`launch/pretrain.sh --verbose` shows it all).

Each entry names where the output comes from and matches its text exactly, so a new or real warning of the same
library still shows. What is filtered (docs/training.md, "Launching", lists the same):

- torch's FutureWarnings that `all_gather_into_tensor` / `reduce_scatter_tensor` are deprecated (DeepSpeed 0.19's
  ZeRO-3 calls them every step; nothing a user can change);
- DeepSpeed's "Attempting to get learning rate from scheduler before it has started" (its schedulers start at
  iteration -1; the trainer steps them to 1 before the first step);
- DeepSpeed's "DeepSpeed ...deepspeed_shm_comm_op built successfully", printed on every start although the op is
  compiled once (the trainer announces the compile itself: ntl_pretrain/runtime/lifecycle.py);
- huggingface_hub's "Model weights successfully saved to ...partial!" (the export's staging folder; the trainer
  says where the export landed);
- the untitled progress bars of DeepSpeed's universal-checkpoint conversion (the trainer logs the conversion);
- the INFO blocks of DeepSpeed's launcher (`bash launch/pretrain.sh` runs it with `--log_level warning`), and its
  runner's "Unable to find hostfile" on one node (the supervisor runs the runner with this filter:
  `RUNNER_WITH_FILTER`);
- datasets' progress bars when stderr is not a terminal (a log file: they glue into one line);
- AutoTP's "vocab_parallel_lm_head supersedes the configured 'column' partitioning" (the trainer always asks for
  the vocabulary-sharded head; DeepSpeed's presets name a column split for it).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Callable, NoReturn, TextIO

import tqdm

from ..core.process_exit import exit_status, leave

VERBOSE_FLAG = "--verbose"


@dataclass(frozen=True)
class KnownWarning:
    """A Python warning filtered by its category, the module that raises it and its message."""

    category: type[Warning]
    module: str  # regular expression on the warning's module, as `warnings.filterwarnings` takes it
    message: str  # regular expression on the start of the message


@dataclass(frozen=True)
class KnownRecord:
    """A logging record filtered by its logger and message."""

    logger: str
    message: str  # regular expression, matched against the whole formatted message


KNOWN_WARNINGS = (
    KnownWarning(FutureWarning, r"torch\.distributed\.c10d_logger",
                 r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
)
KNOWN_RECORDS = (
    KnownRecord("DeepSpeed", r"Attempting to get learning rate from scheduler before it has started"),
    # the trainer always asks AutoTP for the vocabulary-sharded head (the loss reads its shards), which replaces the
    # 'column' split DeepSpeed's own presets name for lm_head (and its tied embedding): nothing to change
    KnownRecord("DeepSpeed", r"(\[Rank 0\] )?AutoTP: vocab_parallel_lm_head supersedes the configured '\w+' "
                             r"partitioning for (tied embedding )?'[^']+'.*"),
    # DeepSpeed's runner on one node without /job/hostfile: what `bash launch/pretrain.sh` means to run
    KnownRecord("DeepSpeed", r"Unable to find hostfile, will proceed with training with local resources only\."),
    # the export's staging folder ends in checkpoint.format.STAGING_SUFFIX (not imported: the supervisor loads no torch)
    KnownRecord("huggingface_hub.serialization._torch", r"Model weights successfully saved to .*\.partial!"),
)
# lines written with print() (no logger to filter): matched as whole lines of the process's stdout
KNOWN_PRINTED_LINES = (
    re.compile(r"DeepSpeed deepspeed\.ops\.comm\.deepspeed_shm_comm_op built successfully"),
)
UNIVERSAL_CONVERSION_MODULE = "deepspeed.checkpoint.ds_to_universal"  # its progress bars have no title


class _DropKnownRecords(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.fullmatch(message) for pattern in self.patterns)


class _DropKnownLines:
    """A text stream that passes everything on except whole lines matching KNOWN_PRINTED_LINES. print() writes a
    line's text and its newline in two calls: a dropped text drops the newline that follows it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._dropped_text = False

    def write(self, text: str) -> int:
        if self._dropped_text and text == "\n":
            self._dropped_text = False
            return len(text)
        self._dropped_text = False
        if any(pattern.fullmatch(text.rstrip("\n")) for pattern in KNOWN_PRINTED_LINES):
            self._dropped_text = not text.endswith("\n")
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def wants_verbose(argv: list[str]) -> bool:
    """Whether the command line asks for every line (`--verbose`)."""
    return VERBOSE_FLAG in argv


def install(verbose: bool = False) -> None:
    """Filter the known-harmless output in this process (nothing when `verbose`); called once, by the entry point
    (launch/pretrain.sh) before it imports the trainer, never by library code (it replaces sys.stdout)."""
    if verbose:
        return
    if not sys.stderr.isatty():
        # datasets' bars redraw with carriage returns: in a log file they glue into one line ("Generating train
        # split: 0 examples [00:00, ?...]100 examples..."); the trainer logs the packing with counts instead
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    for name in {known.logger for known in KNOWN_RECORDS}:
        logging.getLogger(name).addFilter(_DropKnownRecords(
            [re.compile(known.message) for known in KNOWN_RECORDS if known.logger == name]))
    if not isinstance(sys.stdout, _DropKnownLines):
        sys.stdout = _DropKnownLines(sys.stdout)
    _untitled_conversion_bars_off()


def _untitled_conversion_bars_off() -> None:
    """DeepSpeed's universal conversion shows two progress bars without a title (ours are titled): its module's
    `tqdm` is replaced by one whose bars are off, now or when it is first imported (--help imports no DeepSpeed)."""
    module = sys.modules.get(UNIVERSAL_CONVERSION_MODULE)
    if module is not None:
        _bars_off(module)
    elif not any(isinstance(finder, _BarsOffAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BarsOffAfterImport())


def _bars_off(module: types.ModuleType) -> None:
    if getattr(module, "tqdm", None) is tqdm:
        module.tqdm = types.SimpleNamespace(tqdm=functools.partial(tqdm.tqdm, disable=True))


class _BarsOffAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the conversion module it wraps the real loader so `_bars_off` runs after it."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != UNIVERSAL_CONVERSION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_then_bars_off(module: types.ModuleType) -> None:
            run_module(module)
            _bars_off(module)

        spec.loader.exec_module = exec_then_bars_off  # type: ignore[method-assign]
        return spec


# DeepSpeed's runner (`python -m deepspeed.launcher.runner`) in a process that first skips DeepSpeed's autotuner mlflow
# import (core/deepspeed_imports.py) and installs this filter: what the
# supervisor starts (`python -u -c RUNNER_WITH_FILTER ARGS...`; the runner reads sys.argv[1:] as it would). Its exit
# status is the runner's; the process then leaves without the interpreter's teardown (0.4 s with DeepSpeed loaded;
# the runner holds nothing to release), as the ranks do (parallel/distributed.run_process).
RUNNER_WITH_FILTER = ("import sys; from ntl_pretrain.core.deepspeed_imports import skip_autotuner_mlflow; "
                      "skip_autotuner_mlflow(); from ntl_pretrain.runtime import log_filter; "
                      "log_filter.install(verbose=log_filter.wants_verbose(sys.argv)); "
                      "import runpy; from ntl_pretrain.runtime.log_filter import run_and_leave; "
                      "run_and_leave(lambda: runpy.run_module('deepspeed.launcher.runner', run_name='__main__', "
                      "alter_sys=True))")


def run_and_leave(run: Callable[[], object]) -> NoReturn:
    """Call `run`, flush stdout and stderr, and end the process with its exit status (0, or the code of the
    SystemExit it raised, as the interpreter would give it) without the interpreter's teardown. Any other exception
    (KeyboardInterrupt included: the process then dies by SIGINT, as before) propagates as it would without this."""
    try:
        run()
        code = 0
    except SystemExit as stop:
        code = exit_status(stop.code)
    leave(code)
