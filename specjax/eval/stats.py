"""The one statistics type of decoding runs, :class:`RunStats` (defined in
:mod:`specjax.runtime.stats`, the lowest layer that needs it, so ``specjax.api`` can use it
too; the layer order forbids api → eval imports). Import it from either module."""

from specjax.runtime.stats import COUNTERS, RunStats

__all__ = ["COUNTERS", "RunStats"]
