"""Progress of a benchmark's generation, for `tools/evaluate.py` (long GSM8K runs printed nothing for half an hour).

`greedy_generate` calls the reporter after every decoding step with this rank's batches done, its batch count
and the tokens generated so far; the reporter runs on the writer rank only and shows a tqdm bar on a terminal,
otherwise a line every `every` batches (and on the last), plus a heartbeat line while a single batch runs
longer than `heartbeat_s`. It reads nothing from the device and runs no collective.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

LINES_PER_BENCHMARK = 10  # plain-line mode: about this many batch lines per benchmark
HEARTBEAT_S = 60.0  # plain-line mode: a line at least this often while a batch is being generated


class GenerationProgress:
    """Callable as `progress(done_batches, total_batches, new_tokens)`; `label` names the benchmark."""

    def __init__(self, label: str, *, bar: bool | None = None, every: int = 0, heartbeat_s: float = HEARTBEAT_S,
                 stream: IO[str] | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stdout
        self.use_bar = self.stream.isatty() if bar is None else bar
        self.every = every  # 0: about LINES_PER_BENCHMARK lines
        self.heartbeat_s = heartbeat_s
        self.bar: Any = None
        self.started = self.last_line = time.monotonic()
        self.done = -1

    def __call__(self, done: int, total: int, new_tokens: int) -> None:
        now = time.monotonic()
        if self.use_bar:
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=f"eval {self.label}", unit="batch", dynamic_ncols=True)
            if done > self.done >= 0:
                self.bar.update(done - self.done)
            self.bar.set_postfix({"tokens": new_tokens}, refresh=False)
            self.done = done
            if done == total:
                self.bar.close()
            return
        every = self.every or max(1, math.ceil(total / LINES_PER_BENCHMARK))
        elapsed = now - self.started
        if done != self.done and done > 0 and (done % every == 0 or done == total):
            left = elapsed / done * (total - done)
            self._line(f"eval {self.label}: {done}/{total} batches, {new_tokens} tokens generated, {elapsed:.0f} s"
                       + (f", about {left:.0f} s left" if done < total else ""), now)
        elif done < total and now - self.last_line >= self.heartbeat_s:
            self._line(f"eval {self.label}: batch {done + 1}/{total} still generating, {new_tokens} tokens so far, "
                       f"{elapsed:.0f} s", now)
        self.done = done

    def _line(self, text: str, now: float) -> None:
        print(text, file=self.stream, flush=True)
        self.last_line = now
