"""Theory of speculative decoding (Leviathan, Kalman & Matias, ICML 2023).

Closed-form quantities from "Fast Inference from Transformers via Speculative
Decoding" (arXiv:2211.17192), used to predict and explain the speedups the
decoder measures:

* ``beta`` / ``d_lk`` / ``acceptance_rate``: Definition 3.1, Definition 3.2,
  Theorem 3.5 (per-position acceptance probability and its mean, alpha).
* ``expected_tokens``: Equation (1), expected tokens produced per round.
* ``walltime_improvement``: Theorem 3.8, and ``speedup``, its hardware-aware
  generalisation with a measured target cost ratio ``v(gamma)``.
* ``operations_factor``: Theorem 3.11, increase in arithmetic operations.
* ``oracle_bound``: Corollary 3.9, the ``1/(1 - alpha)`` limit.
* ``optimal_gamma``, ``theory_table``, ``format_table``, ``plot_speedup``:
  helpers built on the above.
* Draft trees: ``rank_acceptance``, ``static_tree``, ``tree_expected_tokens``,
  ``tree_speedup`` and ``tree_table`` extend E(N) and the cost model from a chain of
  ``gamma`` drafts to a tree of N nodes, depth D, at most K children per node (SpecInfer,
  Miao et al. 2024; EAGLE-2, Li et al. 2024; Sequoia, Chen et al. 2024). With K = 1 they
  are the chain formulas above. They live in :mod:`specjax.eval.tree_theory` (the argument
  checks both use in :mod:`specjax.eval.theory_args`) and are re-exported here.

Notation follows the paper: ``alpha`` is the expected acceptance rate,
``gamma`` the number of tokens the draft model proposes per round, ``c`` the
cost ratio (time of one draft-model call / time of one target-model call),
``mu`` the ratio of arithmetic operations per token (draft / target).  Every
cost below is dimensionless, in units of one target-model call on one token.

Everything is host-side plain numpy: inputs may be Python scalars, numpy
arrays or jax arrays (converted with ``np.asarray``) and broadcast against
each other; array results are float64 numpy arrays and 0-d results are numpy
scalars.  Invalid arguments raise ``ValueError`` naming the argument and its
valid range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specjax.eval.theory_args import (
    VLike, as_array, check_alpha, check_c, check_gamma, check_mu, describe_value, as_output, v_at,
)
from specjax.eval.tree_theory import (  # noqa: F401  (the draft-tree formulas, re-exported)
    rank_acceptance, static_tree, tree_expected_tokens, tree_speedup, tree_table,
)

__all__ = [
    "beta",
    "d_lk",
    "acceptance_rate",
    "expected_tokens",
    "walltime_improvement",
    "speedup",
    "operations_factor",
    "optimal_gamma",
    "oracle_bound",
    "theory_table",
    "format_table",
    "plot_speedup",
    "rank_acceptance",
    "static_tree",
    "tree_expected_tokens",
    "tree_speedup",
    "tree_table",
]


# ----------------------------------------------------------------------------
# acceptance


def beta(p: Any, q: Any) -> np.ndarray | np.float64:
    """Acceptance probability of one drafted token, Definition 3.1 / Theorem 3.5.

    ``beta = sum_x min(p(x), q(x))`` where ``p`` is the target (``M_p``) and
    ``q`` the draft (``M_q``) next-token distribution.  By Lemma 3.3 /
    Theorem 3.5, ``beta = 1 - D_LK(p, q)``.

    Args:
      p, q: probabilities, shape ``[..., vocab]`` (broadcastable), any float
        dtype; numpy or jax arrays.
    Returns:
      float64, shape ``[...]`` (the vocab axis reduced), in [0, 1] for
      normalised inputs; a numpy scalar for 1-D inputs.
    """
    return as_output(np.minimum(as_array(p), as_array(q)).sum(axis=-1))


def d_lk(p: Any, q: Any) -> np.ndarray | np.float64:
    """Divergence ``D_LK(p, q) = sum_x |p(x) - q(x)| / 2``, Definition 3.2.

    Equal to ``1 - beta(p, q)`` for normalised distributions (Lemma 3.3), i.e.
    the total-variation distance: symmetric, 0 iff ``p == q`` and 1 iff the
    supports are disjoint.

    Args:
      p, q: probabilities, shape ``[..., vocab]`` (broadcastable).
    Returns:
      float64, shape ``[...]``, in [0, 1].
    """
    return as_output(0.5 * np.abs(as_array(p) - as_array(q)).sum(axis=-1))


def acceptance_rate(betas: Any, weights: Any = None, axis: int | tuple[int, ...] | None = None) -> np.ndarray | np.float64:
    """Expected acceptance rate ``alpha = E[beta]``, Definition 3.1 / Theorem 3.5.

    Args:
      betas: per-position acceptance probabilities (e.g. from :func:`beta`),
        any shape, values in [0, 1].
      weights: optional non-negative weights broadcastable to ``betas`` (e.g.
        a mask of valid positions); ``None`` means uniform.
      axis: axis or axes to average over; ``None`` averages everything.
    Returns:
      float64 alpha in [0, 1]; shape of ``betas`` with ``axis`` removed.
    """
    b = as_array(betas)
    if not np.all((b >= 0.0) & (b <= 1.0)):
        raise ValueError(f"betas must be in [0, 1], got {describe_value(b)}")
    if weights is None:
        return as_output(np.asarray(np.mean(b, axis=axis)))
    w = np.broadcast_to(as_array(weights), b.shape)
    if not np.all(np.isfinite(w) & (w >= 0.0)):
        raise ValueError(f"weights must be finite and >= 0, got {describe_value(w)}")
    return as_output(np.asarray(np.average(b, axis=axis, weights=w)))


# ----------------------------------------------------------------------------
# expected tokens, speedups, costs


def expected_tokens(alpha: Any, gamma: Any) -> np.ndarray | np.float64:
    """Expected tokens per round ``E(N) = (1 - alpha^(gamma+1)) / (1 - alpha)``, Equation (1).

    The number of tokens one round of speculative decoding produces (accepted
    drafts plus the one token sampled from the target) is capped-geometric;
    Equation (1) gives its mean.  At ``alpha = 1`` the limit ``gamma + 1`` is
    returned exactly (no 0/0), and the evaluation
    ``expm1((gamma+1) log alpha) / expm1(log alpha)`` stays accurate as
    ``alpha -> 1``.

    Args:
      alpha: acceptance rate(s) in [0, 1].
      gamma: draft length(s) >= 1 (tokens; real values allowed for curves).
    Returns:
      float64 tokens per round, broadcast shape of the inputs, in
      [1, gamma + 1].
    """
    a = check_alpha(alpha)
    g = check_gamma(gamma)
    a, g = np.broadcast_arrays(a, g)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_a = np.log(a)  # -inf at alpha = 0, giving expm1(-inf) = -1 -> E = 1
        ratio = np.expm1((g + 1.0) * log_a) / np.expm1(log_a)
    return as_output(np.where(a == 1.0, g + 1.0, ratio))


def expected_tokens_by_position(alphas: Sequence[float], gamma: int) -> float:
    """Expected tokens per round when the draft at position i is accepted with its own rate
    ``alphas[i-1]`` given that the drafts before it were: ``E(N) = 1 + Σ_{k=1}^{γ} Π_{i=1}^{k} α_i``
    (Equation (1) generalised; equal to it when every α_i is α). For drafters whose acceptance
    falls with the position, such as a block drafter (one pass drafts all γ slots, slot i not
    seeing the drafts before it: DFlash, Chen et al. 2026).

    Args:
      alphas: per-position acceptance rates in [0, 1], at least ``gamma`` of them.
      gamma: draft length >= 1.
    Returns:
      float tokens per round in [1, gamma + 1].
    Raises:
      ValueError: fewer than ``gamma`` rates, or a rate outside [0, 1].
    """
    a = np.asarray(alphas, np.float64)
    g = int(gamma)
    if a.ndim != 1 or a.size < g or g < 1:
        raise ValueError(f"need >= gamma = {g} per-position rates, got {a.size}")
    check_alpha(a)
    return float(1.0 + np.cumprod(a[:g]).sum())


def walltime_improvement(alpha: Any, gamma: Any, c: Any) -> np.ndarray | np.float64:
    """Expected wall-time improvement factor, Theorem 3.8.

    ``(1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))``: ``E(N)`` tokens
    per round at a round cost of ``gamma`` draft calls plus one target call
    (which costs the same over ``gamma + 1`` tokens as over one).

    Args:
      alpha: acceptance rate(s) in [0, 1].
      gamma: draft length(s) >= 1.
      c: draft/target cost ratio(s) >= 0 (dimensionless).
    Returns:
      float64 speedup factor over plain target decoding (dimensionless),
      broadcast shape of the inputs.
    """
    c_ = check_c(c)
    return as_output(np.asarray(expected_tokens(alpha, gamma) / (check_gamma(gamma) * c_ + 1.0)))


def speedup(alpha: Any, gamma: Any, c: Any, v: VLike = None) -> np.ndarray | np.float64:
    """Hardware-aware speedup ``E(N) / (gamma c + v(gamma))``, generalising Theorem 3.8.

    Theorem 3.8 assumes one target call over ``gamma + 1`` tokens costs the
    same as over one token.  Here ``v(gamma) = t_target(gamma+1 tokens) /
    t_target(1 token)`` is the measured ratio, so a round costs
    ``gamma c + v(gamma)`` target-call units.  ``v=None`` (``v = 1``) is
    exactly :func:`walltime_improvement`.

    Args:
      alpha: acceptance rate(s) in [0, 1].
      gamma: draft length(s) >= 1.
      c: draft/target cost ratio(s) >= 0.
      v: ``None``, a scalar, an array broadcastable against ``gamma``, a
        callable ``gamma -> v`` or a mapping ``{gamma: v}``; values > 0 (values
        below 1 are allowed).
    Returns:
      float64 speedup factor (dimensionless), broadcast shape of the inputs.
    """
    g = check_gamma(gamma)
    c_ = check_c(c)
    e = expected_tokens(alpha, g)
    return as_output(np.asarray(e / (g * c_ + v_at(v, g))))


def operations_factor(alpha: Any, gamma: Any, mu: Any) -> np.ndarray | np.float64:
    """Factor of increase in arithmetic operations, Theorem 3.11.

    ``(1 - alpha) (gamma mu + gamma + 1) / (1 - alpha^(gamma+1))``, i.e.
    ``(gamma mu + gamma + 1) / E(N)``: each round runs the draft ``gamma``
    times and the target on ``gamma + 1`` tokens.

    Args:
      alpha: acceptance rate(s) in [0, 1].
      gamma: draft length(s) >= 1.
      mu: draft/target arithmetic-operations-per-token ratio(s) >= 0.
    Returns:
      float64 ratio of total operations to plain target decoding
      (dimensionless, >= 1 when mu >= 0), broadcast shape of the inputs.
    """
    g = check_gamma(gamma)
    m = check_mu(mu)
    return as_output(np.asarray((g * m + g + 1.0) / expected_tokens(alpha, g)))


def oracle_bound(alpha: Any) -> np.ndarray | np.float64:
    """Speedup limit ``1 / (1 - alpha)``, Corollary 3.9 / Equation (1).

    The supremum of ``E(N)`` as ``gamma -> inf``, hence of the speedup with a
    free (``c = 0``) draft model; ``inf`` at ``alpha = 1``.

    Args:
      alpha: acceptance rate(s) in [0, 1].
    Returns:
      float64 upper bound on tokens per target call (dimensionless).
    """
    a = check_alpha(alpha)
    with np.errstate(divide="ignore"):
        return as_output(np.asarray(1.0 / (1.0 - a)))


def _candidate_gammas(v: VLike, max_gamma: int) -> np.ndarray:
    if isinstance(v, Mapping):
        gs = sorted(int(k) for k in v)
    elif v is not None and not callable(v) and np.ndim(v) == 1:
        gs = list(range(1, len(v) + 1))
    else:
        gs = list(range(1, max_gamma + 1))
    gs = [g for g in gs if 1 <= g <= max_gamma]
    if not gs:
        raise ValueError(f"v covers no gamma in [1, max_gamma={max_gamma}]")
    return np.asarray(gs, dtype=np.float64)


def optimal_gamma(alpha: Any, c: Any, v: VLike = None, max_gamma: int = 64) -> tuple[Any, Any]:
    """Best integer draft length and its speedup (Theorem 3.8 / Figure 3 of the paper).

    Maximises :func:`speedup` over integer ``gamma`` in ``[1, max_gamma]``.  If
    ``v`` is a mapping only its keys are searched; if ``v`` is a 1-D array,
    ``v[i]`` is taken as ``v(gamma = i + 1)`` and only ``gamma = 1..len(v)``
    is searched.  Ties go to the smaller ``gamma``.

    Args:
      alpha: acceptance rate(s) in [0, 1].
      c: draft/target cost ratio(s) >= 0, broadcast against ``alpha``.
      v: as in :func:`speedup`; ``None`` is the textbook ``v = 1``.
      max_gamma: largest draft length considered (>= 1).
    Returns:
      ``(gamma, speedup)``: a Python ``int`` and ``float`` for scalar
      ``alpha``/``c``, else an int64 and a float64 array of their broadcast
      shape.
    """
    if int(max_gamma) < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    a, c_ = np.broadcast_arrays(check_alpha(alpha), check_c(c))
    gs = _candidate_gammas(v, int(max_gamma))
    if v is not None and not callable(v) and not isinstance(v, Mapping) and np.ndim(v) == 1:
        v = np.asarray(v, dtype=np.float64)[: len(gs)]
    s = np.asarray(speedup(a[..., None], gs, c_[..., None], v))
    best = np.argmax(s, axis=-1)
    g_best = gs.astype(np.int64)[best]
    s_best = np.take_along_axis(s, best[..., None], axis=-1)[..., 0]
    if g_best.ndim == 0:
        return int(g_best), float(s_best)
    return g_best, s_best


# ----------------------------------------------------------------------------
# reporting


def theory_table(alpha: float, c: float, gammas: Sequence[int] | Any, v: VLike = None) -> list[dict]:
    """Per-gamma predictions: Equation (1) and Theorem 3.8 (plus measured ``v``).

    Args:
      alpha: scalar acceptance rate in [0, 1].
      c: scalar draft/target cost ratio >= 0.
      gammas: draft lengths >= 1, one row each.
      v: as in :func:`speedup`; an array is aligned with ``gammas``.
    Returns:
      One dict per gamma, JSON-serialisable plain Python numbers, keys
      ``gamma`` (int), ``expected_tokens`` (tokens per round, Eq. (1)),
      ``cost`` (``gamma c + v(gamma)``, one round in target-call units),
      ``speedup`` (``expected_tokens / cost``) and ``speedup_textbook``
      (Theorem 3.8, ``v = 1``).
    """
    if np.ndim(alpha) or np.ndim(c):
        raise ValueError("alpha and c must be scalars in theory_table")
    g = check_gamma(np.atleast_1d(np.asarray(gammas)))
    if g.ndim != 1:
        raise ValueError(f"gammas must be 1-D, got shape {g.shape}")
    e = np.atleast_1d(expected_tokens(alpha, g))
    cost = g * float(check_c(c)) + np.broadcast_to(v_at(v, g), g.shape)
    textbook = np.atleast_1d(walltime_improvement(alpha, g, c))
    return [
        {
            "gamma": int(gi) if float(gi).is_integer() else float(gi),
            "expected_tokens": float(ei),
            "cost": float(ci),
            "speedup": float(ei / ci),
            "speedup_textbook": float(ti),
        }
        for gi, ei, ci, ti in zip(g, e, cost, textbook)
    ]


def format_table(rows: Sequence[Mapping[str, Any]], digits: int = 3) -> str:
    """Render rows (e.g. from :func:`theory_table`) as a GitHub-markdown table.

    Columns follow the first row's keys; floats use ``digits`` decimals.
    Returns an empty string for no rows.
    """
    if not rows:
        return ""
    keys = list(rows[0].keys())

    def cell(x: Any) -> str:
        if isinstance(x, (float, np.floating)):
            return f"{x:.{digits}f}"
        return str(x)

    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join("---:" for _ in keys) + "|"]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot_speedup(
    path: str,
    alphas: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.9),
    cs: Sequence[float] = (0.02, 0.1, 0.3),
    max_gamma: int = 16,
    v: VLike = None,
    measured: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Plot predicted speedup against gamma (Theorem 3.8, cf. the paper's Figure 3).

    One subplot per ``c``, one line per ``alpha`` over ``gamma = 1..max_gamma``
    (a 1-D array ``v`` is read as ``v(gamma = i + 1)``).  ``measured`` points,
    dicts with ``gamma``, ``speedup`` and ``label`` (and optionally ``c`` to
    restrict them to that subplot), are overlaid as markers.  The 1x line
    marks no speedup.

    Returns:
      ``path``, where the PNG was written.
    """
    # Agg canvas on a bare Figure: no pyplot state, no change to the user's backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if int(max_gamma) < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    gs = np.arange(1, int(max_gamma) + 1, dtype=np.float64)
    if v is not None and not callable(v) and not isinstance(v, Mapping) and np.ndim(v) == 1:
        if len(v) < len(gs):
            raise ValueError(f"v array must cover gamma = 1..max_gamma={max_gamma}, got length {len(v)}")
        v = np.asarray(v, dtype=np.float64)[: len(gs)]
    fig = Figure(figsize=(4.5 * len(cs), 3.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(cs), squeeze=False, sharey=True)
    for ax, c in zip(axes[0], cs):
        for a in alphas:
            ax.plot(gs, speedup(a, gs, c, v), marker=".", label=f"α={a:g}")
        markers = {}
        for m in measured or ():
            if "c" in m and not np.isclose(m["c"], c):
                continue
            label = m.get("label", "measured")
            marker = markers.setdefault(label, "xP*^sDv<>"[len(markers) % 9])
            seen = label in ax.get_legend_handles_labels()[1]
            ax.scatter([m["gamma"]], [m["speedup"]], marker=marker, color="k", s=60, zorder=3,
                       label=None if seen else label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(f"c = {c:g}" + ("" if v is None else ", measured v(γ)"))
        ax.set_xlabel("γ (draft tokens per round)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("predicted speedup (×)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return str(path)
