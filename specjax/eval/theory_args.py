"""Argument checks of the theory formulas (:mod:`specjax.eval.theory`,
:mod:`specjax.eval.tree_theory`): float64 conversion, 0-d results as numpy scalars, range checks
that name the argument, and the lookup of a measured ``v(gamma)`` (:data:`VLike`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# v(gamma): scalar, array aligned with gamma, callable gamma -> v, or mapping.
VLike = float | np.ndarray | Sequence[float] | Callable[[int], float] | Mapping[int, float] | None

def as_array(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def as_output(x: np.ndarray) -> np.ndarray | np.float64:
    """Return 0-d arrays as numpy scalars, others unchanged."""
    return x[()] if isinstance(x, np.ndarray) and x.ndim == 0 else x


def describe_value(x: np.ndarray) -> str:
    return repr(x.item()) if x.size == 1 else f"values in [{np.nanmin(x)}, {np.nanmax(x)}] (nan: {np.isnan(x).any()})"


def check_alpha(alpha: Any) -> np.ndarray:
    a = as_array(alpha)
    if not np.all((a >= 0.0) & (a <= 1.0)):
        raise ValueError(f"alpha must be in [0, 1], got {describe_value(a)}")
    return a


def check_gamma(gamma: Any) -> np.ndarray:
    g = as_array(gamma)
    if not np.all(np.isfinite(g) & (g >= 1.0)):
        raise ValueError(f"gamma must be finite and >= 1, got {describe_value(g)}")
    return g


def check_nonneg(name: str, x: Any) -> np.ndarray:
    a = as_array(x)
    if not np.all(np.isfinite(a) & (a >= 0.0)):
        raise ValueError(f"{name} must be finite and >= 0, got {describe_value(a)}")
    return a


def check_c(c: Any) -> np.ndarray:
    return check_nonneg("c", c)


def check_mu(mu: Any) -> np.ndarray:
    return check_nonneg("mu", mu)


def check_v(v: Any) -> np.ndarray:
    a = as_array(v)
    if not np.all(np.isfinite(a) & (a > 0.0)):
        raise ValueError(f"v must be finite and > 0 (v < 1 is allowed), got {describe_value(a)}")
    return a


def v_at(v: VLike, gamma: np.ndarray) -> np.ndarray:
    """Evaluate v(gamma), returning an array that broadcasts against ``gamma``."""
    if v is None:
        return np.ones_like(gamma)
    if isinstance(v, Mapping) or callable(v):
        lookup = {int(k): val for k, val in v.items()} if isinstance(v, Mapping) else None
        out = np.empty(gamma.shape, dtype=np.float64)
        for idx, g in np.ndenumerate(gamma):
            if lookup is None:
                out[idx] = float(v(int(g)) if float(g).is_integer() else v(float(g)))
            else:
                if not float(g).is_integer() or int(g) not in lookup:
                    raise ValueError(f"v has no entry for gamma={g}; v covers gamma in {sorted(lookup)}")
                out[idx] = float(lookup[int(g)])
        return check_v(out)
    return check_v(v)
