"""The draft-tree pytree and its structure: :class:`DraftTree`, chains as trees, host checks,
depth limits, ancestor/attention masks, positions of a tree call, root-to-node paths, children
tables.

The index conventions (node ids, parents, depths, the N+1 rows "per parent") are those of
:mod:`specjax.core.tree`, which re-exports every name here. Pure and jittable with static shapes
(except :func:`check_tree`, which runs on the host).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specjax.core.drafting import Proposal


# ------------------------------------------------------------------ the tree pytree --------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A draft tree per batch row (a pytree; ``max_depth`` and ``max_children`` are static).

    Attributes:
      tokens: int32 ``[B, N]`` draft token of each node (ids outside ``[0, V)`` are never accepted).
      parents: int32 ``[B, N]`` parent node id, ``-1`` for a child of the root; ``parents[i] < i``.
      depth: int32 ``[B, N]`` 1-based depth (``1`` below the root, ``depth[parent] + 1`` below).
      valid: bool ``[B, N]``; invalid nodes are never tried, accepted or on a path (padding,
        nodes past a length limit). A valid node's parent must be valid.
      draft_probs: float32 ``[B, N+1, V]`` or ``None``: row 0 = the q the root's children were
        drawn from, row ``i + 1`` = the q node i's children were drawn from (rows of nodes without
        children are unused). Needed by the ``"iid"`` and ``"without_replacement"`` schemes; the
        ``"deterministic"`` scheme and greedy acceptance ignore it.
      max_depth: D (static int >= 1): no valid node is deeper; accepted paths are ``[D]``.
      max_children: K (static int >= 1): no node has more valid children; children beyond K in
        node order are ignored by the acceptance functions (:func:`check_tree` reports them).

    Build with :meth:`create` (checks shapes and casts dtypes), :func:`chain_tree` or
    :func:`specjax.core.dynamic_tree.build_dynamic_tree`; :func:`check_tree` checks the values on the host.
    """

    tokens: Int[Array, "batch nodes"]
    parents: Int[Array, "batch nodes"]
    depth: Int[Array, "batch nodes"]
    valid: Bool[Array, "batch nodes"]
    draft_probs: Float[Array, "batch nodes_plus_1 vocab"] | None
    max_depth: int = dataclasses.field(metadata=dict(static=True), default=1)
    max_children: int = dataclasses.field(metadata=dict(static=True), default=1)

    @classmethod
    def create(cls, tokens, parents, depth, valid=None, draft_probs=None, *, max_depth=None,
               max_children=None) -> "DraftTree":
        """A tree from arrays ``[B, N]`` (and ``draft_probs [B, N+1, V]``), dtypes cast.

        ``valid`` defaults to all True. ``max_depth`` / ``max_children`` default to the largest
        depth / child count found in the (concrete) arrays; pass them explicitly under ``jit``.

        Raises ValueError for mismatched shapes, ``draft_probs`` not ``[B, N+1, V]``, or
        ``max_depth`` / ``max_children`` not positive integers.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        parents = jnp.asarray(parents, jnp.int32)
        depth = jnp.asarray(depth, jnp.int32)
        valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
        if tokens.ndim != 2 or any(a.shape != tokens.shape for a in (parents, depth, valid)):
            raise ValueError(
                "DraftTree expects tokens, parents, depth, valid all [B, N]; got "
                f"{tokens.shape}, {parents.shape}, {depth.shape}, {valid.shape}"
            )
        batch, nodes = tokens.shape
        if draft_probs is not None:
            draft_probs = jnp.asarray(draft_probs, jnp.float32)
            if draft_probs.ndim != 3 or draft_probs.shape[:2] != (batch, nodes + 1):
                raise ValueError(
                    f"draft_probs must be [B, N+1, V] = [{batch}, {nodes + 1}, V] (row 0 = the root), "
                    f"got {draft_probs.shape}"
                )
        if max_depth is None:
            max_depth = max(1, int(np.max(np.where(np.asarray(valid), np.asarray(depth), 1), initial=1)))
        if max_children is None:
            max_children = max(1, _max_children_np(np.asarray(parents), np.asarray(valid)))
        for name, value in (("max_depth", max_depth), ("max_children", max_children)):
            if isinstance(value, bool) or int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        return cls(tokens, parents, depth, valid, draft_probs, int(max_depth), int(max_children))

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]


def _max_children_np(parents: np.ndarray, valid: np.ndarray) -> int:
    best = 0
    for par, ok in zip(parents.reshape(-1, parents.shape[-1]), valid.reshape(-1, valid.shape[-1])):
        counts = np.bincount(np.clip(par[ok] + 1, 0, None), minlength=1) if ok.any() else np.zeros(1, int)
        best = max(best, int(counts.max(initial=0)))
    return best


def chain_tree(proposal: Proposal) -> DraftTree:
    """The chain of a :class:`~specjax.core.drafting.Proposal` as a tree (K = 1, D = γ).

    Node i is draft x_{i+1}: ``parents = [-1, 0, .., γ-2]``, ``depth = [1 .. γ]``,
    ``valid[b, i] = i < num_valid[b]``, and ``draft_probs[:, i] = q_{i+1}`` (the q that node
    i-1's only child x_{i+1} was drawn from; row 0 = the root's), the last row zeros. With the
    ``"iid"`` scheme, :func:`specjax.core.tree.verify_tree` then computes exactly what
    :func:`specjax.core.acceptance.verify` computes with ``num_allowed = num_valid``.

    Args:
      proposal: ``tokens [B, γ]`` int32, ``probs [B, γ, V]`` float32, ``num_valid [B]`` int32.

    Returns:
      a :class:`DraftTree` with N = γ, ``max_depth = γ``, ``max_children = 1``.

    Raises ValueError if γ = 0 or the shapes disagree.
    """
    tokens = jnp.asarray(proposal.tokens, jnp.int32)
    probs = jnp.asarray(proposal.probs, jnp.float32)
    if tokens.ndim != 2 or probs.ndim != 3 or probs.shape[:2] != tokens.shape or tokens.shape[1] < 1:
        raise ValueError(
            f"chain_tree expects tokens [B, γ] and probs [B, γ, V] with γ >= 1, got {tokens.shape}, {probs.shape}"
        )
    batch, gamma = tokens.shape
    idx = jnp.arange(gamma, dtype=jnp.int32)
    num_valid = jnp.broadcast_to(jnp.asarray(proposal.num_valid, jnp.int32), (batch,))
    draft_probs = jnp.concatenate([probs, jnp.zeros_like(probs[:, :1])], axis=1)
    return DraftTree(
        tokens=tokens,
        parents=jnp.broadcast_to(idx - 1, (batch, gamma)),
        depth=jnp.broadcast_to(idx + 1, (batch, gamma)),
        valid=idx[None, :] < num_valid[:, None],
        draft_probs=draft_probs,
        max_depth=gamma,
        max_children=1,
    )


def check_tree(tree: DraftTree, vocab_size: int | None = None) -> None:
    """Check a tree's values on the host (not traceable); returns None or raises ValueError.

    Checks, for every row b and valid node i: ``-1 <= parents[b, i] < i``; the parent is valid;
    ``depth[b, i] = 1`` below the root and ``depth[parent] + 1`` otherwise; ``depth <= max_depth``;
    at most ``max_children`` valid children per node (the root included); with ``vocab_size``,
    ``0 <= tokens < vocab_size``. The message names the row and node.
    """
    tokens, parents, depth, valid = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.depth, tree.valid))
    if tokens.ndim != 2:
        raise ValueError(f"check_tree expects a batched tree [B, N], got tokens {tokens.shape}")
    for b in range(tokens.shape[0]):
        for i in np.flatnonzero(valid[b]):
            par = int(parents[b, i])
            where = f"row {b}, node {i}"
            if not -1 <= par < i:
                raise ValueError(f"{where}: parent {par} must be -1 (the root) or an earlier node")
            if par >= 0 and not valid[b, par]:
                raise ValueError(f"{where}: its parent {par} is invalid")
            want = 1 if par < 0 else int(depth[b, par]) + 1
            if depth[b, i] != want:
                raise ValueError(f"{where}: depth {int(depth[b, i])}, expected {want} (parent {par})")
            if depth[b, i] > tree.max_depth:
                raise ValueError(f"{where}: depth {int(depth[b, i])} > max_depth {tree.max_depth}")
            if vocab_size is not None and not 0 <= tokens[b, i] < vocab_size:
                raise ValueError(f"{where}: token {int(tokens[b, i])} outside [0, {vocab_size})")
        counts = np.bincount(parents[b][valid[b]] + 1, minlength=tokens.shape[1] + 1)
        if counts.size and counts.max() > tree.max_children:
            u = int(np.argmax(counts)) - 1
            raise ValueError(
                f"row {b}: node {u} ({'the root' if u < 0 else 'a node'}) has {int(counts.max())} valid "
                f"children > max_children {tree.max_children}"
            )


def limit_depth(tree: DraftTree, num_allowed) -> DraftTree:
    """``tree`` with nodes deeper than ``num_allowed`` invalid (at most that many tokens accepted).

    num_allowed: int32 ``[B]`` or scalar (e.g. lowered near ``max_new_tokens``; 0 = a plain step).
    A row whose walk stops at the limit draws its next token from p there, not from a residual,
    as :func:`specjax.core.acceptance.verify_row` does with ``num_allowed``.
    """
    limit = jnp.broadcast_to(jnp.asarray(num_allowed, jnp.int32), tree.tokens.shape[:1])
    return dataclasses.replace(tree, valid=tree.valid & (tree.depth <= limit[:, None]))


# ------------------------------------------------------------- structure helpers ---------


def live_nodes(tree: DraftTree) -> jax.Array:
    """Valid nodes within ``max_depth`` (bool, the tree's batch shape + [N])."""
    return tree.valid & (tree.depth >= 1) & (tree.depth <= tree.max_depth)


def ancestors_row(parents: jax.Array, steps: int) -> jax.Array:
    """bool [N, N]: [i, j] = j is a strict ancestor of i (pointer chasing, ``steps`` levels)."""
    nodes = parents.shape[0]
    anc = jnp.zeros((nodes, nodes), bool)
    cur = parents
    for _ in range(steps):
        anc = anc | jax.nn.one_hot(cur, nodes, dtype=bool)  # cur = -1 gives an all-False row
        cur = jnp.where(cur >= 0, parents[jnp.maximum(cur, 0)], -1)
    return anc


def ancestor_matrix(tree: DraftTree) -> jax.Array:
    """bool ``[B, N, N]``: ``[b, i, j]`` = node j is a strict ancestor of node i (root excluded).

    Follows ``parents`` for ``max_depth`` levels (enough for every node within ``max_depth``);
    validity is not applied (rows of invalid nodes follow their parents all the same).
    """
    return jax.vmap(lambda par: ancestors_row(par, tree.max_depth))(tree.parents)


def attention_mask(tree: DraftTree) -> jax.Array:
    """bool ``[B, N, N]``: node i attends to node j iff j is i or an ancestor of i.

    Within the tree block only; every node also sees the root and the committed prefix (the KV
    cache), see :func:`block_attention_mask` for the mask of the whole target call.
    """
    return ancestor_matrix(tree) | jnp.eye(tree.num_nodes, dtype=bool)


def block_attention_mask(tree: DraftTree) -> jax.Array:
    """bool ``[B, N+1, N+1]`` over the target call's block ``[root, node_0 .. node_{N-1}]``.

    The root (the last committed token, block index 0) sees itself; block index ``i + 1`` sees the
    root, itself and its ancestors. (Cache slots of the committed prefix are visible to all.)
    """
    inner = attention_mask(tree)
    batch, nodes = tree.tokens.shape
    top = jnp.zeros((batch, 1, nodes + 1), bool).at[:, 0, 0].set(True)
    rest = jnp.concatenate([jnp.ones((batch, nodes, 1), bool), inner], axis=2)
    return jnp.concatenate([top, rest], axis=1)


def positions(tree: DraftTree, lengths) -> jax.Array:
    """int32 ``[B, N+1]`` positions of the target call's block ``[root, nodes...]``.

    ``lengths [B]`` int32 committed tokens per row. The root (the last committed token) is at
    ``lengths - 1`` — the convention of ``runtime/loop.py``, where the last committed token is the
    first input of a target call — and node i at ``lengths - 1 + depth[i]``. Invalid nodes get the
    same formula from whatever depth they hold; their outputs must be ignored.
    """
    lengths = jnp.asarray(lengths, jnp.int32)
    root = lengths[:, None] - 1
    return jnp.concatenate([root, root + tree.depth], axis=1)


def paths_row(parents, depth, max_depth):
    nodes = parents.shape[0]
    self_or_anc = ancestors_row(parents, max_depth) | jnp.eye(nodes, dtype=bool)
    level = jnp.arange(1, max_depth + 1, dtype=jnp.int32)
    hit = self_or_anc[:, None, :] & (depth[None, None, :] == level[None, :, None])  # [N, D, N]
    return jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)


def node_paths(tree: DraftTree) -> jax.Array:
    """int32 ``[B, N, D]``: ``[b, i]`` = the node ids on the path root → node i, padded with -1.

    ``[b, i, l]`` is the ancestor-or-self of i at depth ``l + 1``; entries deeper than node i
    are -1. Assumes consistent depths (:func:`check_tree`).
    """
    return jax.vmap(lambda par, dep: paths_row(par, dep, tree.max_depth))(tree.parents, tree.depth)


def children_row(parents, live, max_children):
    """int32 [N+1, K]: row u+1 = the live children of u (root: row 0) in node order, -1 padded."""
    nodes = parents.shape[0]
    same = (parents[:, None] == parents[None, :]) & live[None, :]
    earlier = jnp.arange(nodes)[None, :] < jnp.arange(nodes)[:, None]
    rank = jnp.sum(same & earlier, axis=1)  # live earlier siblings
    keep = live & (rank < max_children)
    row = jnp.where(keep, parents + 1, nodes + 1)  # out of range rows are dropped
    table = jnp.full((nodes + 1, max_children), -1, jnp.int32)
    return table.at[row, jnp.minimum(rank, max_children - 1)].set(
        jnp.arange(nodes, dtype=jnp.int32), mode="drop"
    )


def children_table(tree: DraftTree) -> jax.Array:
    """int32 ``[B, N+1, K]``: row ``u + 1`` lists the valid children of node u (row 0: the root's)
    in node order, padded with -1; valid children beyond ``max_children`` are left out."""
    return jax.vmap(lambda par, live: children_row(par, live, tree.max_children))(tree.parents, live_nodes(tree))


def path_tokens(tree: DraftTree, path) -> jax.Array:
    """int32 ``[B, D]``: the tokens of an accepted path ``[B, D]`` of node ids (-1 stays -1)."""
    path = jnp.asarray(path, jnp.int32)
    return jnp.where(path >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1), -1)
