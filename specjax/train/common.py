"""What every module of :mod:`specjax.train` shares: the error type and the log line."""

from __future__ import annotations

import sys
import time


class DistillError(ValueError):
    """A distillation option, file or run directory that cannot be used; the message names
    the option or path and the fix (the command line prints it as one line)."""


def log(msg: str) -> None:
    """One progress line on stderr: ``[distill HH:MM:SS] msg`` (flushed)."""
    print(f"[distill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
