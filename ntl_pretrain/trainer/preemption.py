"""Pre-emption: a stop signal (checkpoint.preempt_signals: SIGTERM, SIGINT, SIGUSR1 by default) or the end of
the DeepSpeed launcher above a rank makes every rank save at the next step boundary and exit 0, within a bounded grace time.
Before step 1 (start-up: loading, resuming) there is nothing to save: a stop signal ends the process at once."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import numpy
import torch
import torch.distributed as dist

from ..checkpoint.format import CheckpointError
from ..core.agreement import host_group
from ..runtime.lifecycle import ended_launcher, launcher_processes

logger = logging.getLogger("ntl_pretrain")


class PreemptionHandler:
    """SIGTERM / SIGINT / SIGUSR1 (configurable) on any rank -> every rank saves at the next step boundary and exits 0.

    The handler only records the signal; `requested()` (called by every rank at every step boundary)
    agrees on it over the whole world with one all-reduce of one integer in host memory, over a gloo group
    made once here (the default group when it is gloo already): no device sync, so the step's queued device
    work keeps running while the hosts agree. Every rank gets the same answer at the same boundary and
    stops there together. Build it on every rank after `init_distributed` (making the group is
    collective). A watchdog started at the first signal ends the process if it has not finished within
    the grace time, so a pre-empted job never outlives what the cluster allows (the previous checkpoint
    then stays the resume point).

    Args:
        signals: signal names, e.g. ["SIGTERM", "SIGUSR1"].
        grace_s: seconds from the signal to the exit.
    """

    def __init__(self, signals: list[str], grace_s: float) -> None:
        self.signals = []
        for name in signals:
            number = getattr(signal, name, None)
            if not isinstance(number, signal.Signals):
                raise CheckpointError(f"checkpoint.preempt_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
            self.signals.append(number)
        self.grace_s = grace_s
        self.received: int = 0  # the signal number this process got (0: none)
        self.training = False  # before step 1 there is nothing to save: a stop signal ends the process at once
        self._watchdog: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        self._launchers: list[tuple[Any, str]] = []  # (psutil.Process, its command) of the launchers above
        # the agreed flag lives in host memory: written and read through numpy, all-reduced through torch
        self._flag = numpy.zeros(1, dtype=numpy.int64)
        self._group = host_group()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._on_signal)
        self.watch_launchers()

    def watch_launchers(self) -> None:
        """Remember the DeepSpeed launcher processes above this one (parent and grandparent)."""
        self._launchers = launcher_processes()

    def _launcher_ended(self) -> bool:
        ended = ended_launcher(self._launchers)
        if ended is not None:
            logger.warning("pre-emption: the DeepSpeed launcher above this rank (pid %d: %s) has ended; "
                           "saving and stopping as for SIGTERM", ended[0].pid, ended[1])
        return ended is not None

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog.join(timeout=5)

    def training_starts(self) -> None:
        """From here on a stop signal saves at the next step boundary (before: the process ends at once)."""
        self.training = True

    def _on_signal(self, number: int, frame: Any) -> None:
        if not self.training:
            # start-up (loading the model, resuming): no step has run, so nothing to save and nothing to wait for
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
            print(f"error: [rank {rank}] {signal.Signals(number).name} received before step 1 (during start-up): "
                  f"stopped at once, nothing is saved (no step has run)", file=sys.stderr, flush=True)
            os._exit(128 + int(number))
        if not self.received:
            self.received = int(number)
            self._watchdog = threading.Timer(self.grace_s, self._grace_exceeded)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _grace_exceeded(self) -> None:
        logger.error("pre-emption: no checkpoint within checkpoint.preempt_grace_s=%s s of %s; exiting without it "
                     "(the previous complete checkpoint stays the resume point)", self.grace_s,
                     signal.Signals(self.received).name)
        os._exit(1)

    def requested(self) -> str | None:
        """The name of the signal any rank received, or None; every rank calls this at the same point."""
        if not self.received and self._launchers and self._launcher_ended():
            self._on_signal(signal.SIGTERM, None)
        self._flag[0] = self.received
        if dist.is_initialized():
            dist.all_reduce(torch.from_numpy(self._flag), op=dist.ReduceOp.MAX, group=self._group)
        number = int(self._flag[0])
        return signal.Signals(number).name if number else None
