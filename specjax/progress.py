"""Progress lines on stderr: one line per phase with its time (``specjax: loading … 3.1 s``).

The command line passes a :class:`Progress`; library calls pass ``None`` and stay silent.
Standard output is never written, so ``--json`` output stays clean.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import IO, Iterator


class Progress:
    """Writes ``specjax: <what> … <seconds> s`` lines to ``stream`` (default ``sys.stderr``)."""

    def __init__(self, stream: IO[str] | None = None, prefix: str = "specjax: "):
        self.stream = stream
        self.prefix = prefix

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    def begin(self, what: str) -> None:
        self._out().write(f"{self.prefix}{what} … ")
        self._out().flush()

    def end(self, seconds: float, note: str = "") -> None:
        self._out().write(f"{seconds:.1f} s{note}\n")
        self._out().flush()

    def note(self, text: str) -> None:
        """A line of its own (``specjax: note: …``)."""
        self._out().write(f"{self.prefix}{text}\n")
        self._out().flush()


@contextlib.contextmanager
def phase(progress: Progress | None, what: str) -> Iterator[None]:
    """Time the ``with`` body as one phase line (nothing when ``progress`` is ``None``)."""
    if progress is None:
        yield
        return
    progress.begin(what)
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        progress.end(time.perf_counter() - t0, " (failed)")
        raise
    progress.end(time.perf_counter() - t0)
