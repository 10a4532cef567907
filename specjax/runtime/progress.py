"""Progress lines on stderr: one line per phase with its time (``specjax: loading … 3.1 s``).

The command line passes a :class:`Progress`; library calls pass ``None`` and stay silent.
Standard output is never written, so ``--json`` output stays clean. A phase that fails
within ``Progress.delay_s`` prints nothing, so a bad input still gives exactly one
``specjax: error: …`` line. A note written while a phase line waits for its time
(:func:`specjax.core.notes.note`) goes on a line of its own, and the phase's line is written
whole when it ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Iterator

from specjax.core import notes


class Progress:
    """Writes ``specjax: <what> … <seconds> s`` lines to ``stream`` (default ``sys.stderr``).

    The ``<what> …`` part appears ``delay_s`` seconds into a phase (so the user sees what is
    running while it runs), the time when it ends; a phase that ends sooner prints its whole
    line at the end, and one that fails sooner prints nothing."""

    def __init__(self, stream: IO[str] | None = None, prefix: str = "specjax: ", delay_s: float = 0.3):
        self.stream = stream
        self.prefix = prefix
        self.delay_s = delay_s

    @property
    def out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    def write(self, text: str) -> None:
        """Whole lines (after ending a phase line left open: :func:`specjax.core.notes.write_lines`)."""
        notes.write_lines(self.out, text)

    def note(self, text: str) -> None:
        """A line of its own (``specjax: <text>``)."""
        self.write(f"{self.prefix}{text}\n")


class Phase:
    """What ``with phase(...) as ph`` gives: set ``ph.detail`` (e.g. ``" (converted again)"``)
    to have it written after the seconds when the phase ends."""

    detail: str = ""


@contextlib.contextmanager
def phase(progress: Progress | None, what: str) -> Iterator[Phase]:
    """Time the ``with`` body as one phase line (nothing when ``progress`` is ``None``)."""
    ph = Phase()
    if progress is None:
        yield ph
        return
    shown: list = []  # the open line's token (specjax.core.notes.open_line)
    done = threading.Event()

    def show():
        if not done.wait(progress.delay_s):
            shown.append(notes.open_line(progress.out, f"{progress.prefix}{what} … "))

    timer = threading.Thread(target=show, daemon=True)
    t0 = time.perf_counter()
    timer.start()
    failed = True
    try:
        yield ph
        failed = False
    finally:
        done.set()
        timer.join()
        seconds = time.perf_counter() - t0
        if shown:
            notes.close_line(shown[0], f"{seconds:.1f} s{' (failed)' if failed else ph.detail}\n")
        elif not failed:
            progress.write(f"{progress.prefix}{what} … {seconds:.1f} s{ph.detail}\n")
