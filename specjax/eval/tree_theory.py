"""Theory of draft trees: E(N) and the cost model of a chain of ``gamma`` drafts
(:mod:`specjax.eval.theory`) extended to a tree of N nodes, depth D, at most K children per node
(SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024; Sequoia, Chen et al. 2024). With K = 1
they are the chain formulas. Host-side numpy like the chain formulas; re-exported by
:mod:`specjax.eval.theory`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specjax.eval.theory_args import (
    VLike, as_array, check_alpha, check_c, check_nonneg, check_v, describe_value, as_output, v_at,
)

# ----------------------------------------------------------------------------
# draft trees
#
# A tree round drafts N nodes below the root (the last committed token), at most K children
# per node and depth at most D, and verifies them in ONE target call over N + 1 tokens
# (specjax.core.tree). Each node is the child of *rank* r (1 = the drafter's first choice) of
# its parent. Under the deterministic scheme the loop's tree drafters use (EAGLE-2's top-k
# children, the n-gram trie: distinct tokens, tried in rank order), the child of rank r is
# accepted with marginal probability a_r = p(c_r), the target's probability of that token, and
# the events "child r accepted" are disjoint (sum_r a_r <= 1). The i.i.d. acceptance model takes
# a_r the same at every node (every depth, every parent), as E(N) for chains takes alpha the
# same at every position.


def rank_acceptance(alpha: Any, topk: int) -> np.ndarray:
    """Per-rank acceptance ``a_r = alpha (1 - alpha)^(r-1)``, r = 1..K, from one acceptance rate.

    The model of independent tries: the first child is accepted with probability ``alpha``
    (the chain's acceptance rate), and after a rejection each further child is accepted with
    the same conditional probability ``alpha`` (SpecInfer's multi-candidate verification,
    Miao et al. 2024, treated as independent trials). The root thus accepts one of K children
    with probability ``1 - (1 - alpha)^K``. With K = 1 it is ``[alpha]``: the chain.

    Args:
      alpha: scalar acceptance rate in [0, 1].
      topk: K >= 1, children per node.
    Returns:
      float64 ``[K]``, non-increasing, summing to ``1 - (1 - alpha)^K <= 1``.
    """
    if np.ndim(alpha):
        raise ValueError(f"alpha must be a scalar in rank_acceptance, got shape {np.shape(alpha)}")
    a = float(check_alpha(alpha))
    k = _check_int("topk", topk)
    return a * (1.0 - a) ** np.arange(k, dtype=np.float64)


def _check_int(name: str, x: Any, lo: int = 1) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or int(x) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {x!r}")
    return int(x)


def _check_rank_probs(rank_probs: Any) -> np.ndarray:
    a = as_array(rank_probs)
    if a.ndim != 1 or a.size < 1:
        raise ValueError(f"rank_probs must be a 1-D array [K] with K >= 1, got shape {a.shape}")
    if not np.all((a >= 0.0) & (a <= 1.0)):
        raise ValueError(f"rank_probs must be in [0, 1], got {describe_value(a)}")
    if a.sum() > 1.0 + 1e-9:
        raise ValueError(f"rank_probs must sum to <= 1 (disjoint acceptances of distinct children), got {a.sum()}")
    return a


def _check_shape(nodes: Any, depth: Any, topk: Any) -> tuple[int, int, int]:
    n, d, k = _check_int("nodes", nodes), _check_int("depth", depth), _check_int("topk", topk)
    if d > n:
        raise ValueError(f"depth ({d}) must be <= nodes ({n}): a path of depth D holds D nodes")
    from specjax.core.drafting import TreeShape

    cap = TreeShape.max_nodes(d, k)
    if n > cap:
        raise ValueError(f"nodes ({n}) must be <= K + (D-1)·K² = {cap} for depth {d} and topk {k}")
    return n, d, k


def static_tree(nodes: int, depth: int, topk: int, rank_probs: Any) -> tuple[np.ndarray, np.ndarray]:
    """The tree of shape (N, D, K) that EAGLE-2's dynamic tree builds when the drafter's path
    scores are the acceptance model's path probabilities.

    :func:`specjax.core.tree.build_dynamic_tree` (Li et al. 2024) with ``children = expand_width
    = K`` (as the loop's drafters call it), on scores ``Σ log a_rank`` along each path: level 1
    is the root's K children; each further level expands the K best candidates of the level
    above (lower candidate id on ties) into K children each; the N candidates with the largest
    path probability overall (lower id on ties) are the tree, in candidate order (parents
    first). For non-increasing ``rank_probs`` this is Sequoia's greedy tree (Chen et al. 2024):
    the N nodes of largest ``f(v) = Π a_rank`` (restricted to the candidates above).

    Args:
      nodes, depth, topk: N, D, K with ``1 <= D <= N <= K + (D-1)·K²``.
      rank_probs: ``[K']`` per-rank acceptance (:func:`rank_acceptance`), K' >= K.
    Returns:
      ``(parents, ranks)``: int64 ``[N]`` each; ``parents[i]`` in ``[-1, i)`` (-1 = the root) and
      ``ranks[i]`` in ``1..K`` (the node's rank among its parent's drafted children).
    """
    n, d, k = _check_shape(nodes, depth, topk)
    a = _check_rank_probs(rank_probs)
    if a.size < k:
        raise ValueError(f"rank_probs has {a.size} ranks, the tree needs topk = {k}")
    with np.errstate(divide="ignore"):
        log_a = np.log(a[:k])
    par, rank, score = [-1] * k, list(range(1, k + 1)), list(log_a)
    start, size = 0, k
    for _ in range(2, d + 1):
        level = np.asarray(score[start:start + size])
        best = start + np.argsort(-level, kind="stable")[:k]  # the K best, lower id on ties
        new = len(par)
        for f in best:
            par += [int(f)] * k
            rank += list(range(1, k + 1))
            score += list(score[f] + log_a)
        start, size = new, k * k
    chosen = np.sort(np.argsort(-np.asarray(score), kind="stable")[:n])
    node_of = {int(c): i for i, c in enumerate(chosen)}
    parents = np.asarray([-1 if par[c] < 0 else node_of[par[c]] for c in chosen], np.int64)
    return parents, np.asarray([rank[c] for c in chosen], np.int64)


def tree_expected_tokens(parents: Any, rank_probs: Any, ranks: Any = None) -> np.float64:
    """Expected tokens per target call of a draft tree, ``E(N) = 1 + Σ_v Π_{u on root→v} a_rank(u)``.

    Each accepted node adds one token and the round always adds one more (the bonus or
    correction token), so ``E(N) = Σ_v P(path root→v accepted)`` over all vertices, the root
    included with probability 1: Sequoia's ``F(T) = Σ_v f(v)`` (Chen et al. 2024, Section 3),
    the tree form of SpecInfer's token-tree verification (Miao et al. 2024) and EAGLE-2's
    acceptance along the tree (Li et al. 2024). Under the i.i.d. model the path probability is
    the product of the per-rank acceptances ``a_r`` of its nodes. For a chain (every rank 1)
    it is ``Σ_{i=0..γ} alpha^i``, Equation (1).

    Args:
      parents: int ``[N]``, ``parents[i]`` in ``[-1, i)`` (-1 = the root; parents precede children).
      rank_probs: float ``[K]``, ``a_r`` in [0, 1] summing to <= 1.
      ranks: int ``[N]`` in ``1..K``, each node's rank among its parent's children; default: its
        position among its siblings in node order (the order :func:`specjax.core.tree.verify_tree`
        tries them).
    Returns:
      float64 tokens per target call, in ``[1, D + 1]``.
    """
    par = np.asarray(parents)
    if par.ndim != 1 or not np.issubdtype(par.dtype, np.integer):
        raise ValueError(f"parents must be a 1-D integer array [N], got {par.dtype} shape {par.shape}")
    a = _check_rank_probs(rank_probs)
    if ranks is None:
        seen: dict[int, int] = {}
        rk = np.empty(par.shape, np.int64)
        for i, p in enumerate(par.tolist()):
            seen[p] = seen.get(p, 0) + 1
            rk[i] = seen[p]
    else:
        rk = np.asarray(ranks)
        if rk.shape != par.shape or not np.issubdtype(rk.dtype, np.integer):
            raise ValueError(f"ranks must be an integer array shaped like parents {par.shape}, got {rk.shape}")
    reach = np.empty(par.shape, np.float64)
    for i, (p, r) in enumerate(zip(par.tolist(), rk.tolist())):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p} must be -1 (the root) or an earlier node")
        if not 1 <= r <= a.size:
            raise ValueError(f"node {i} has rank {r}; rank_probs covers ranks 1..{a.size}")
        reach[i] = (1.0 if p < 0 else reach[p]) * a[r - 1]
    return np.float64(1.0 + reach.sum())


def tree_speedup(expected: Any, c_tree: Any, v: Any = 1.0) -> np.ndarray | np.float64:
    """Speedup of a tree round, ``E(N) / (c_tree + v(N))``: the chain's ``E(N)/(γc + v(γ))``.

    A round costs the drafter's tree building, ``c_tree`` (target-step units: one drafter call
    per level over the frontier, D calls, ``c_tree ≈ D c`` when a frontier call costs a chain
    call — EAGLE-2, Li et al. 2024), plus one target call over N + 1 tokens with the tree
    mask, ``v(N) = t_target(N+1 tokens) / t_target(1 token)``. Plain decoding emits one token
    per unit, so the ratio is the speedup (Leviathan et al. 2023, Theorem 3.8, with trees as
    in SpecInfer, Miao et al. 2024, and Sequoia, Chen et al. 2024). For a chain
    (``c_tree = γ c``) it is :func:`speedup`.

    Args:
      expected: tokens per round >= 1 (:func:`tree_expected_tokens`, or measured τ).
      c_tree: drafter cost of one tree >= 0, in target-step units.
      v: target-call cost ratio > 0 (1: the textbook assumption).
    Returns:
      float64 speedup (dimensionless), broadcast shape of the inputs.
    """
    e = as_array(expected)
    if not np.all(np.isfinite(e) & (e >= 1.0)):
        raise ValueError(f"expected tokens must be finite and >= 1, got {describe_value(e)}")
    return as_output(np.asarray(e / (check_nonneg("c_tree", c_tree) + check_v(v))))


def tree_table(rank_probs: Any, shapes: Sequence[tuple[int, int, int]], c: float,
               v: VLike = None) -> list[dict]:
    """Per-shape predictions for draft trees: :func:`tree_expected_tokens` of :func:`static_tree`
    and :func:`tree_speedup` with ``c_tree = D c`` (one drafter call per level).

    Args:
      rank_probs: ``[K]`` per-rank acceptance (:func:`rank_acceptance`), K >= every shape's K.
      shapes: ``(N, D, K)`` per row.
      c: scalar drafter/target cost ratio >= 0 of one drafter call.
      v: as in :func:`speedup`, looked up at the number of drafted tokens N (``v(N)``: the
        target call over N + 1 tokens); an array is aligned with ``shapes``.
    Returns:
      One dict per shape, JSON-serialisable: ``shape`` (``"NxDxK"``), ``nodes``, ``depth``,
      ``topk``, ``expected_tokens`` (E(N), tokens per target call), ``c_tree`` (``D c``),
      ``v`` (v(N)), ``cost`` (``c_tree + v``), ``speedup`` and ``speedup_textbook`` (v = 1).
    """
    if np.ndim(c):
        raise ValueError("c must be a scalar in tree_table")
    c_ = float(check_c(c))
    ns = np.asarray([float(s[0]) for s in shapes])
    if v is None or isinstance(v, Mapping) or callable(v):
        vs = np.atleast_1d(v_at(v, ns)) if len(ns) else ns
    else:
        vs = np.broadcast_to(check_v(v), ns.shape)
    rows = []
    for (n, d, k), vi in zip(shapes, vs):
        parents, ranks = static_tree(n, d, k, rank_probs)
        e = float(tree_expected_tokens(parents, rank_probs, ranks))
        ct = d * c_
        rows.append({"shape": f"{n}x{d}x{k}", "nodes": int(n), "depth": int(d), "topk": int(k),
                     "expected_tokens": e, "c_tree": ct, "v": float(vi), "cost": ct + float(vi),
                     "speedup": float(tree_speedup(e, ct, vi)), "speedup_textbook": float(tree_speedup(e, ct, 1.0))})
    return rows
