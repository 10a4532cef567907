"""EAGLE-2's context-aware dynamic draft tree (Li et al. 2024): expansion by path probability,
then reranking (:func:`build_dynamic_tree`). Pure and jittable with static sizes; the tree's
conventions are those of :mod:`specjax.core.tree` (which re-exports it).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from specjax.core.tree_structure import DraftTree


def build_dynamic_tree(
    root_probs: jax.Array,
    expand: Callable[[int, jax.Array, DraftTree], jax.Array],
    *,
    depth: int,
    children: int,
    expand_width: int,
    num_nodes: int,
) -> tuple[DraftTree, jax.Array]:
    """EAGLE-2's context-aware dynamic draft tree (Li et al. 2024, "EAGLE-2": expansion, then reranking).

    Candidates are scored by their path probability ``Π q`` along the path (kept as
    ``Σ log q``). Expansion phase: the root's top-``children`` tokens form level 1; for levels
    2..``depth``, the ``expand_width`` best candidates of the previous level (by score, lower
    candidate id on ties) are expanded, each into the top-``children`` tokens of the drafter's
    distribution at it (``expand_width · children`` new candidates per level). Reranking phase: the
    ``num_nodes`` candidates with the highest score overall (ties to the lower candidate id) become
    the tree, in candidate order (level-major), so parents precede children. A parent's score is
    >= its children's and its candidate id is lower, so the parent of every kept node is kept.

    Args:
      root_probs: float32 ``[B, V]``, the drafter's distribution at the root.
      expand: ``expand(level, frontier, pool) -> q`` (traced; may call the drafter): ``level`` the
        depth of the frontier nodes (static int, 1 .. depth-1), ``frontier`` int32 ``[B, W]`` the
        candidate ids to expand, ``pool`` a :class:`DraftTree` of all C candidates so far (later
        ones invalid, ``depth`` 0). Returns float32 ``[B, W, V]``, the drafter's distribution after
        each frontier node's path.
      depth: D >= 1, children: K in [1, V], expand_width: W in [1, K], num_nodes: N in [1, C]
        with C = K + (D − 1)·W·K candidates (static ints).

    Returns:
      ``(tree, scores)``: a :class:`DraftTree` with N nodes, ``max_depth = D``,
      ``max_children = K`` and ``draft_probs = None`` — its children are a deterministic function of
      the drafter, so verify it with ``scheme="deterministic"`` (or greedily); nodes with path
      probability 0 are invalid. ``scores`` float32 ``[B, N]`` are the nodes' ``Σ log q``.

    Raises ValueError for sizes outside the ranges above or ``root_probs`` not ``[B, V]``.
    """
    root_probs = jnp.asarray(root_probs, jnp.float32)
    if root_probs.ndim != 2:
        raise ValueError(f"root_probs must be [B, V], got {root_probs.shape}")
    batch, vocab = root_probs.shape
    k, w, d, n = children, expand_width, depth, num_nodes
    pool_size = _check_sizes(d, k, w, n, vocab)

    def log(x):  # <= 0 even if rounding left a probability above 1: a child never outscores its parent
        return jnp.where(x > 0, jnp.minimum(jnp.log(jnp.where(x > 0, x, 1.0)), 0.0), -jnp.inf)

    values, top = lax.top_k(root_probs, k)
    tokens = jnp.zeros((batch, pool_size), jnp.int32).at[:, :k].set(top)
    parents = jnp.full((batch, pool_size), -1, jnp.int32)
    depths = jnp.zeros((batch, pool_size), jnp.int32).at[:, :k].set(1)
    scores = jnp.full((batch, pool_size), -jnp.inf, jnp.float32).at[:, :k].set(log(values))
    start, size = 0, k  # the previous level's slice of the pool
    for level in range(2, d + 1):
        pool = DraftTree(tokens, parents, depths, depths > 0, None, d, k)
        _, best = lax.top_k(scores[:, start:start + size], w)
        frontier = (start + best).astype(jnp.int32)  # [B, W]
        q = jnp.asarray(expand(level - 1, frontier, pool), jnp.float32)
        if q.shape != (batch, w, vocab):
            raise ValueError(f"expand must return [B, W, V] = {(batch, w, vocab)}, got {q.shape}")
        values, top = lax.top_k(q, k)  # [B, W, K]
        new = start + size
        base = jnp.take_along_axis(scores, frontier, axis=1)
        tokens = tokens.at[:, new:new + w * k].set(top.reshape(batch, w * k))
        parents = parents.at[:, new:new + w * k].set(jnp.repeat(frontier, k, axis=1))
        depths = depths.at[:, new:new + w * k].set(level)
        scores = scores.at[:, new:new + w * k].set((base[:, :, None] + log(values)).reshape(batch, w * k))
        start, size = new, w * k

    return _rerank(tokens, parents, depths, scores, n, d, k)


def _check_sizes(d: int, k: int, w: int, n: int, vocab: int) -> int:
    """The pool size C = K + (D − 1)·W·K of :func:`build_dynamic_tree` after checking its sizes.

    Raises ValueError for a size that is not a positive integer, K > V, W > K or N > C."""
    for name, value in (("depth", d), ("children", k), ("expand_width", w), ("num_nodes", n)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if k > vocab:
        raise ValueError(f"children ({k}) must be <= the vocabulary size {vocab}")
    if w > k:
        raise ValueError(f"expand_width ({w}) must be <= children ({k}): level 1 has only {k} candidates")
    pool_size = k + (d - 1) * w * k
    if n > pool_size:
        raise ValueError(f"num_nodes ({n}) must be <= the {pool_size} candidates K + (D-1)·W·K")
    return pool_size


def _rerank(tokens, parents, depths, scores, n: int, d: int, k: int) -> tuple[DraftTree, jax.Array]:
    """The reranking phase of :func:`build_dynamic_tree`: the ``n`` candidates of the pool
    (``[B, C]`` each; ``parents`` as candidate ids) with the highest ``scores`` (ties to the lower
    id) as a :class:`DraftTree` in candidate order (parents first), and their scores ``[B, n]``."""
    pool_size = scores.shape[1]
    _, chosen = lax.top_k(scores, n)
    chosen = jnp.sort(chosen, axis=1)  # candidate order: parents first
    node_of = jax.vmap(lambda c: jnp.full((pool_size,), -1, jnp.int32).at[c].set(jnp.arange(n, dtype=jnp.int32)))(chosen)
    take = lambda a: jnp.take_along_axis(a, chosen, axis=1)
    parent_cand = take(parents)
    node_parents = jnp.where(
        parent_cand >= 0, jnp.take_along_axis(node_of, jnp.maximum(parent_cand, 0), axis=1), -1
    )
    node_scores = take(scores)
    tree = DraftTree(take(tokens), node_parents, take(depths), node_scores > -jnp.inf, None, d, k)
    return tree, node_scores
