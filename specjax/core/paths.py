"""Where specjax keeps files of its own: :func:`cache_dir`, the base of every specjax cache but
JAX's compilation cache (``converted/`` for :mod:`specjax.io.convcache`, ``measured/`` for
:mod:`specjax.eval.hostcache`, ``kernels/`` for :mod:`specjax.models.q8`).

A bottom-layer module (imports only :mod:`specjax.core.notes` and :mod:`specjax.core.env`), so that
every layer may use the one rule; :func:`usable_cache_dir` says (once) when that directory cannot be one."""

from __future__ import annotations

import os

from specjax.core import env, notes

_REFUSED: set = set()  # cache directories already said to be unusable (one note per process)


def cache_dir() -> str:
    """``$SPECJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``: the base
    of every specjax cache but the compilation cache (``converted/`` for the conversion cache,
    ``measured/`` for :mod:`specjax.eval.hostcache`, ``kernels/`` for the CPU kernels built on
    first use)."""
    if d := env.get("SPECJAX_CACHE_DIR"):
        return d
    if xdg := env.get("XDG_CACHE_HOME"):
        return os.path.join(xdg, "specjax")
    return os.path.expanduser("~/.cache/specjax")


def forget_refusals() -> None:
    """Forget the directories :func:`usable_cache_dir` has already said it cannot use, so that the
    next call notes again (a note is said once per process otherwise)."""
    _REFUSED.clear()


def usable_cache_dir() -> str | None:
    """:func:`cache_dir` when it is a directory or can be made one, else ``None`` after one
    ``specjax: note:`` per process naming the variable that points there, the file in the way
    and the fix (the run goes on without specjax's caches)."""
    d = cache_dir()
    cur = d
    while cur and not os.path.exists(cur):
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    if not os.path.exists(cur) or os.path.isdir(cur):
        return d
    if d not in _REFUSED:
        _REFUSED.add(d)
        var = next((v for v in ("SPECJAX_CACHE_DIR", "XDG_CACHE_HOME") if env.get(v)), None)
        where = f"{var}={env.raw(var)}" if var else f"the cache directory {d}"
        what = "is a file" if cur == d else f"is under {cur}, a file"
        fix = f"point {var} at a directory (or unset it)" if var else f"move the file {cur} away"
        notes.note(f"{where} {what}, not a directory: running without specjax's caches (converted weights, "
                   f"measurements: nothing is kept for the next run); {fix}")
    return None
