"""Where specjax keeps files of its own: :func:`cache_dir`, the base of every specjax cache but
JAX's compilation cache (``converted/`` for :mod:`specjax.io.convcache`, ``measured/`` for
:mod:`specjax.eval.hostcache`, ``kernels/`` for :mod:`specjax.models.q8`).

A bottom-layer module (imports nothing of specjax), so that every layer may use the one rule."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """``$SPECJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``: the base
    of every specjax cache but the compilation cache (``converted/`` for the conversion cache,
    ``measured/`` for :mod:`specjax.eval.hostcache`, ``kernels/`` for the CPU kernels built on
    first use)."""
    if os.environ.get("SPECJAX_CACHE_DIR"):
        return os.path.expanduser(os.environ["SPECJAX_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.path.expanduser(os.environ["XDG_CACHE_HOME"]), "specjax")
    return os.path.expanduser("~/.cache/specjax")
