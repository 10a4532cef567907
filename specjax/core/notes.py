"""``specjax: note: …`` lines on stderr, each on a line of its own, also while a progress phase
line is open (:mod:`specjax.runtime.progress` writes ``specjax: <what> … `` and its time when the
phase ends): a note written then ends the open line first, and the phase writes its whole line
again when it ends. Every layer writes its notes with :func:`note` (a bottom-layer module)."""

from __future__ import annotations

import sys
import threading
from typing import IO

_LOCK = threading.RLock()
_OPEN: list = []  # [stream, text, broken] of the line written without its end, or empty


def note(msg: str) -> None:
    """One stderr line ``specjax: note: <msg>`` (something was adjusted, nothing failed)."""
    write_lines(sys.stderr, f"specjax: note: {msg}\n")


def write_lines(stream: IO[str], text: str) -> None:
    """Write ``text`` (whole lines) to ``stream``, after ending a line left open there."""
    with _LOCK:
        _break(stream)
        stream.write(text)
        stream.flush()


def open_line(stream: IO[str], text: str) -> list:
    """Write ``text`` without a line end (a phase's ``specjax: <what> … ``); returns the token
    :func:`close_line` takes."""
    with _LOCK:
        _break(stream)
        token = [stream, text, False]
        _OPEN[:] = [token]
        stream.write(text)
        stream.flush()
        return token


def close_line(token: list, end: str) -> None:
    """End the line :func:`open_line` wrote with ``end`` (e.g. ``"3.1 s\\n"``); when something
    was written after it meanwhile (a note), the whole line is written again."""
    with _LOCK:
        stream, text, broken = token
        current = bool(_OPEN) and _OPEN[0] is token
        stream.write(end if current and not broken else text + end)
        stream.flush()
        if current:
            _OPEN.clear()


def _break(stream: IO[str]) -> None:
    """End the open line (when it is on ``stream``) before other text is written there."""
    if _OPEN and not _OPEN[0][2] and _OPEN[0][0] is stream:
        stream.write("\n")
        _OPEN[0][2] = True
