"""Ending a process that has done its work: the exit status the interpreter would give, without its teardown."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_status(code: object) -> int:
    """The status of `SystemExit(code)` as the interpreter gives it: None 0, an int itself, anything else printed
    on stderr and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def leave(code: int) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process with `code` without the interpreter's teardown (slow
    with torch and DeepSpeed loaded; atexit handlers and running threads are not waited for)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
