"""Draft trees: structure helpers, greedy and exact (T > 0) tree acceptance, the EAGLE-2 dynamic tree.

A *draft tree* holds, per batch row, N candidate tokens hanging below the **root** = the last
committed token. One target call over ``[root, node_0 .. node_{N-1}]`` with a tree attention mask
scores every node at once; this module decides which root-to-node path is accepted and which token
follows it. Everything here is pure and jittable with static shapes (N nodes, maximum depth D,
at most K children per node, vocabulary V); randomness comes only from explicit uniforms and keys.

Index conventions (used by every function):

* node ids ``0 .. N-1``; ``parents[i] = -1`` for a child of the root; parents precede children
  (``parents[i] < i``); ``depth[i] = 1`` for a child of the root, ``depth[parent] + 1`` otherwise.
* arrays "per parent" have N+1 rows: row 0 is the root, row ``i + 1`` is node i. The target's
  distributions ``target_probs [B, N+1, V]`` (row ``u + 1`` = p after the path root→u) and the
  drafter's ``draft_probs [B, N+1, V]`` (row ``u + 1`` = the q that u's children were drawn from)
  use this layout, as does the target call's input block ``[root, nodes...]``.
* the children of a node are tried in node order, which must be the order in which they were
  drawn (for ``"without_replacement"`` this matters, see :data:`SCHEMES`).

Acceptance at T > 0 is recursive rejection sampling over the children of one node, then a descent
into the accepted child: multi-step speculative sampling of SpecInfer (Miao et al., ASPLOS 2024,
Algorithm 2 ``VerifyStochastic``) and the recursive rejection sampling of Recursive Speculative
Decoding (Jeon et al. 2024, arXiv:2402.14160). Which update of ``q`` is exact depends on how the
children were drawn; the three published cases are the ``scheme`` argument (:data:`SCHEMES`). A
chain (K = 1) is Leviathan et al. 2023, Algorithm 1 exactly: :func:`verify_tree` on :func:`chain_tree` gives the same outputs as
:func:`specjax.core.acceptance.verify` for the same uniforms and keys.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from specjax.core.drafting import Proposal
from specjax.core.sampling import sample

__all__ = [
    "SCHEMES",
    "DraftTree",
    "chain_tree",
    "check_tree",
    "limit_depth",
    "ancestor_matrix",
    "attention_mask",
    "block_attention_mask",
    "positions",
    "node_paths",
    "children_table",
    "path_tokens",
    "ChildStep",
    "child_step",
    "acceptance_probability",
    "accepts",
    "residual",
    "sample_children",
    "TreeAcceptance",
    "verify_tree_row",
    "verify_tree",
    "GreedyAcceptance",
    "verify_tree_greedy",
    "build_dynamic_tree",
]

SCHEMES = ("iid", "without_replacement", "deterministic")
"""How the children of one node were drawn from the drafter's ``q`` at that node; selects the update.

Notation at one node: ``p`` = the target's distribution there, ``q`` = the drafter's, children
``c_1 .. c_m`` tried in node order, ``r_i ~ U[0, 1)`` one uniform per child. Every scheme runs

    p_1 = p;  for i = 1..m:  accept c_i iff r_i · q_i(c_i) < p_i(c_i)    [P = min(1, p_i(c_i)/q_i(c_i))]
                              else  p_{i+1} = norm(max(0, p_i − q_i))     (= p_i if that sums to 0)
    all rejected: the next token ~ p_{m+1};  c_i accepted: descend into c_i with p = the target's
    distribution after c_i and q = the drafter's distribution that drew c_i's children

and differs only in ``q_i``, the distribution ``c_i`` is treated as drawn from:

* ``"iid"`` — children drawn i.i.d. WITH replacement from q (SpecInfer, Miao et al. 2024,
  Algorithm 2 ``VerifyStochastic`` / multi-step speculative sampling, one SSM): ``q_i = q``.
* ``"without_replacement"`` — children drawn sequentially WITHOUT replacement from q, i.e.
  ``c_i ~ q_i = norm(q with c_1 .. c_{i-1} removed)`` (equivalently the Gumbel-top-k order,
  Kool et al. 2019; ``torch.multinomial(q, k, replacement=False)`` as in EAGLE-1's sampled trees):
  recursive rejection sampling of RSD (Jeon et al. 2024), ``q_{i+1} = norm(q_i with c_i
  removed)``. Using ``q_i = q`` here (the "iid" rule) is NOT exact: c_i was drawn from the
  renormalized q_i.
* ``"deterministic"`` — children that are a deterministic function of the context (EAGLE-2's
  top-k children and its dynamic tree, a fixed tree of top-k tokens, n-gram candidates):
  ``q_i = one_hot(c_i)``, i.e. accept c_i with probability ``p_i(c_i)`` and on rejection
  ``p_{i+1} = norm(p_i with c_i set to 0)``; this is EAGLE-2's implementation (``qx = 1.0``,
  ``gtp[xi] = 0; gtp /= gtp.sum()`` in ``evaluate_posterior``). It needs no drafter q at all.
  Treating deterministic top-k children with the drafter's q values — with or without the
  ``"without_replacement"`` removal — is NOT exact: a top-1 child c of q = (0.6, 0.4) under
  p = (0.3, 0.7) would be emitted with probability min(1, 0.3/0.6) = 0.5 ≠ 0.3.

Why it is exact (the proof the tests enumerate): by induction over the children left, the output
of "try c_i, .., c_m, then sample p_{m+1}" is distributed as p_i whenever ``c_i ~ q_i`` given
everything before it: ``P(x) = q_i(x)·min(1, p_i(x)/q_i(x)) + (1 − Σ_y min(p_i, q_i)(y))·p_{i+1}(x)
= p_i(x)`` (Leviathan et al. 2023, Appendix A.1), because the rest of the procedure outputs
``p_{i+1}`` whatever ``c_i`` was (the residual p_{i+1} does not depend on c_i, and a rejected c_i has
``p_{i+1}(c_i) = 0``). After an accepted child the same argument applies one level down with that
child's own p and q, so every emitted token has the target's conditional distribution.

What the tree must satisfy for this (beyond the structure checked by :func:`check_tree`): the
children of a node are tried in draw order, and for ``"iid"`` / ``"without_replacement"`` the
number of valid children of a node must not depend on the values of those children (a fixed k, or a
prefix chosen from earlier draws only). Pruning by value — e.g. EAGLE-2's global top-N by path
probability, or dropping duplicates — breaks ``c_i ~ q_i``; such trees are exact only with
``"deterministic"``.
"""


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


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
    :func:`build_dynamic_tree`; :func:`check_tree` checks the values on the host.
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
    ``"iid"`` scheme, :func:`verify_tree` then computes exactly what
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


def _live(tree: DraftTree) -> jax.Array:
    """Valid nodes within ``max_depth`` (bool, the tree's batch shape + [N])."""
    return tree.valid & (tree.depth >= 1) & (tree.depth <= tree.max_depth)


def _ancestors_row(parents: jax.Array, steps: int) -> jax.Array:
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
    return jax.vmap(lambda par: _ancestors_row(par, tree.max_depth))(tree.parents)


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


def _paths_row(parents, depth, max_depth):
    nodes = parents.shape[0]
    self_or_anc = _ancestors_row(parents, max_depth) | jnp.eye(nodes, dtype=bool)
    level = jnp.arange(1, max_depth + 1, dtype=jnp.int32)
    hit = self_or_anc[:, None, :] & (depth[None, None, :] == level[None, :, None])  # [N, D, N]
    return jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)


def node_paths(tree: DraftTree) -> jax.Array:
    """int32 ``[B, N, D]``: ``[b, i]`` = the node ids on the path root → node i, padded with -1.

    ``[b, i, l]`` is the ancestor-or-self of i at depth ``l + 1``; entries deeper than node i
    are -1. Assumes consistent depths (:func:`check_tree`).
    """
    return jax.vmap(lambda par, dep: _paths_row(par, dep, tree.max_depth))(tree.parents, tree.depth)


def _children_row(parents, live, max_children):
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
    return jax.vmap(lambda par, live: _children_row(par, live, tree.max_children))(tree.parents, _live(tree))


def path_tokens(tree: DraftTree, path) -> jax.Array:
    """int32 ``[B, D]``: the tokens of an accepted path ``[B, D]`` of node ids (-1 stays -1)."""
    path = jnp.asarray(path, jnp.int32)
    return jnp.where(path >= 0, jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1), -1)


# ------------------------------------------------------ the per-child kernels -------------


class ChildStep(NamedTuple):
    """One child tried at one node (see :func:`child_step`); all float32.

    q_child: ``[V]`` the distribution the child is treated as drawn from (``q_i`` of :data:`SCHEMES`).
    accept_prob: scalar, ``P(r · q_child(c) < p(c))`` for ``r ~ U[0, 1)``.
    p_rejected: ``[V]`` the target's distribution for the next sibling / the final draw if rejected.
    q_rejected: ``[V]`` the drafter state for the next sibling if rejected.
    """

    q_child: jax.Array
    accept_prob: jax.Array
    p_rejected: jax.Array
    q_rejected: jax.Array


def residual(p: jax.Array, q_child: jax.Array) -> jax.Array:
    """``norm(max(0, p − q_child))`` over the last axis, or ``p`` where that sums to 0.

    Leviathan et al. 2023, Algorithm 1, "p'(x) ← norm(max(0, p(x) − q(x)))"; the same float32
    operations as :func:`specjax.core.acceptance.verify_row`. The sum is 0 only when
    ``q_child >= p`` everywhere (for normalized inputs: p = q, where rejection has probability 0).
    """
    res = jnp.maximum(p - q_child, 0.0)
    mass = jnp.sum(res, axis=-1, keepdims=True)
    return jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p)


def _gather(probs: jax.Array, token: jax.Array) -> jax.Array:
    vocab = probs.shape[-1]
    return jnp.take_along_axis(probs, jnp.clip(token, 0, vocab - 1)[..., None], axis=-1)[..., 0]


def _in_vocab(token: jax.Array, vocab: int) -> jax.Array:
    return (token >= 0) & (token < vocab)


def accepts(uniform: jax.Array, p: jax.Array, q_child: jax.Array, token: jax.Array) -> jax.Array:
    """The sampling decision: accept iff ``uniform · q_child(token) < p(token)`` (bool).

    Leviathan et al. 2023, Algorithm 1 ("if r > p(x)/q(x) reject"), written without a division and
    with a strict ``<`` so that ``p(token) = 0`` is never accepted, not even with ``uniform = 0``.
    A token outside ``[0, V)`` is never accepted. For ``uniform ~ U[0, 1)`` the probability is
    :func:`acceptance_probability`.
    """
    vocab = p.shape[-1]
    return _in_vocab(token, vocab) & (uniform * _gather(q_child, token) < _gather(p, token))


def acceptance_probability(p: jax.Array, q_child: jax.Array, token: jax.Array) -> jax.Array:
    """``P_{r ~ U[0,1)}(r · q_child(c) < p(c))`` = ``min(1, p(c) / q_child(c))`` (float32).

    1 when ``q_child(c) = 0 < p(c)``, 0 when ``p(c) = 0`` or c is outside ``[0, V)``.
    """
    vocab = p.shape[-1]
    p_c, q_c = _gather(p, token), _gather(q_child, token)
    ratio = jnp.where(q_c > 0, jnp.minimum(1.0, p_c / jnp.where(q_c > 0, q_c, 1.0)), 1.0)
    return jnp.where(_in_vocab(token, vocab) & (p_c > 0), ratio, 0.0)


def _remove(q: jax.Array, token: jax.Array) -> jax.Array:
    """``norm(q with token set to 0)``; all zeros if nothing is left (no sibling can follow)."""
    kept = jnp.where(jnp.arange(q.shape[-1]) == token[..., None], 0.0, q)
    mass = jnp.sum(kept, axis=-1, keepdims=True)
    return jnp.where(mass > 0, kept / jnp.where(mass > 0, mass, 1.0), 0.0)


def child_step(p: jax.Array, q: jax.Array, token: jax.Array, scheme: str) -> ChildStep:
    """The kernel of one child: what trying ``token`` does to the node's state ``(p, q)``.

    Args:
      p: float32 ``[..., V]``, the target's current distribution at the node (``p_i``).
      q: float32 ``[..., V]``, the drafter's current state at the node (``q_i`` for
        ``"iid"`` / ``"without_replacement"``; ignored by ``"deterministic"``).
      token: int32 ``[...]``, the child's token ``c_i``.
      scheme: one of :data:`SCHEMES` (static).

    Returns:
      :class:`ChildStep` with ``q_child`` = q (iid, without_replacement) or ``one_hot(c_i)``
      (deterministic); ``accept_prob = min(1, p(c_i)/q_child(c_i))``;
      ``p_rejected = residual(p, q_child)``; ``q_rejected`` = q (iid), ``norm(q with c_i removed)``
      (without_replacement; RSD, Jeon et al. 2024), q unchanged (deterministic, unused).

    :func:`verify_tree_row` is a loop over these steps with :func:`accepts` as the decision; the
    tests integrate exactly these kernels to prove exactness. Raises ValueError for an unknown scheme.
    """
    _check_scheme(scheme)
    p = jnp.asarray(p, jnp.float32)
    q = jnp.asarray(q, jnp.float32)
    token = jnp.asarray(token, jnp.int32)
    if scheme == "deterministic":
        q_child = jax.nn.one_hot(token, p.shape[-1], dtype=jnp.float32)  # out of vocab: zeros
        q_next = q
    else:
        q_child = q
        q_next = _remove(q, token) if scheme == "without_replacement" else q
    return ChildStep(q_child, acceptance_probability(p, q_child, token), residual(p, q_child), q_next)


def sample_children(key: jax.Array, q: jax.Array, k: int, scheme: str) -> tuple[jax.Array, jax.Array]:
    """Draw k children from one node's ``q [V]`` as ``scheme`` assumes (for drafters and tests).

    * ``"iid"``: k independent draws ``sample(key_i, q)`` (``key`` split in k).
    * ``"without_replacement"``: the Gumbel-top-k trick (Kool et al. 2019): the k largest of
      ``log q + Gumbel(key)``, in decreasing order — an ordered sample without replacement, the
      same law as drawing ``c_i ~ norm(q with c_<i removed)`` one at a time. Children beyond the
      support of q are invalid.
    * ``"deterministic"``: the top-k of q (``lax.top_k``: ties to the lower id); all valid.

    Returns ``(tokens int32 [k], valid bool [k])`` in draw order. Raises ValueError for an unknown
    scheme or ``k`` outside ``[1, V]``.
    """
    _check_scheme(scheme)
    q = jnp.asarray(q, jnp.float32)
    vocab = q.shape[-1]
    if q.ndim != 1 or not 1 <= k <= vocab:
        raise ValueError(f"sample_children expects q [V] and 1 <= k <= V, got q {q.shape}, k={k}")
    if scheme == "iid":
        keys = jax.random.split(key, k)
        tokens = jax.vmap(lambda kk: sample(kk, q))(keys)
        return tokens.astype(jnp.int32), jnp.ones((k,), bool)
    if scheme == "without_replacement":
        scores = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)) + jax.random.gumbel(key, (vocab,)), -jnp.inf)
        values, tokens = lax.top_k(scores, k)
        return tokens.astype(jnp.int32), values > -jnp.inf
    _, tokens = lax.top_k(q, k)
    return tokens.astype(jnp.int32), jnp.ones((k,), bool)


# ------------------------------------------------------------- exact acceptance ----------


class TreeAcceptance(NamedTuple):
    """The result of :func:`verify_tree` (one row from :func:`verify_tree_row`, B rows batched).

    n: int32 ``[B]`` accepted nodes (0 .. D); the round emits ``n + 1`` tokens.
    path: int32 ``[B, D]`` the accepted node ids root → leaf, padded with -1
      (``path_tokens(tree, path)`` gives their tokens).
    next_token: int32 ``[B]`` the token after the path (bonus or residual/correction).
    next_probs: float32 ``[B, V]`` the distribution next_token was drawn from.
    """

    n: jax.Array
    path: jax.Array
    next_token: jax.Array
    next_probs: jax.Array


def _check_inputs(tree: DraftTree, target_probs, uniforms, scheme: str, batched: bool) -> None:
    _check_scheme(scheme)
    lead = tree.tokens.shape[:1] if batched else ()
    nodes = tree.tokens.shape[-1]
    if tree.tokens.ndim != len(lead) + 1:
        raise ValueError(f"tree.tokens must be {'[B, N]' if batched else '[N]'}, got {tree.tokens.shape}")
    if target_probs.ndim != len(lead) + 2 or target_probs.shape[:-1] != lead + (nodes + 1,):
        raise ValueError(
            f"target_probs must be {'[B, N+1, V]' if batched else '[N+1, V]'} (row 0 = the root) "
            f"with N = {nodes}, got {target_probs.shape}"
        )
    if uniforms is not None and uniforms.shape != lead + (nodes,):
        raise ValueError(f"uniforms must be {'[B, N]' if batched else '[N]'} (one per node), got {uniforms.shape}")
    if scheme != "deterministic":
        if tree.draft_probs is None:
            raise ValueError(
                f"scheme {scheme!r} needs tree.draft_probs (the q each node's children were drawn from); "
                "only 'deterministic' works without it"
            )
        if tree.draft_probs.shape != target_probs.shape:
            raise ValueError(
                f"tree.draft_probs {tree.draft_probs.shape} and target_probs {target_probs.shape} "
                "must both be [.., N+1, V]"
            )


def verify_tree_row(
    tree: DraftTree,
    target_probs: jax.Array,
    uniforms: jax.Array,
    key: jax.Array,
    scheme: str,
) -> TreeAcceptance:
    """Exact acceptance (T > 0, also greedy) of ONE row's draft tree; the next token.

    Args:
      tree: one row (``tokens, parents, depth, valid [N]``; ``draft_probs [N+1, V]`` or None).
      target_probs: float32 ``[N+1, V]``, row 0 = p at the root, row ``i + 1`` = p after the path
        root → node i (processed with the same ``SamplingParams.process`` as q).
      uniforms: float32 ``[N]`` in [0, 1), ``r_i`` for node i (used when i is tried; each node is
        tried at most once).
      key: a PRNG key for the one final draw.
      scheme: one of :data:`SCHEMES` (static) — how each node's children were drawn.

    Returns:
      :class:`TreeAcceptance` for the row (``n`` scalar, ``path [D]``, ``next_token`` scalar,
      ``next_probs [V]``).

    The walk (recursive rejection sampling; equations in :data:`SCHEMES`): start at the root with
    ``p = target_probs[0]``, ``q = draft_probs[0]``; try the valid children of the current node in
    node order with :func:`child_step` and :func:`accepts` (uniform ``r_c``): on acceptance of c,
    append c to the path and continue at c with ``p = target_probs[c+1]``, ``q = draft_probs[c+1]``;
    on rejection move to the next sibling with ``(p_rejected, q_rejected)``. When no child is left
    (all rejected, or a leaf), ``next_token ~ next_probs = p`` — the residual after the rejections,
    or the target's distribution at an accepted leaf (the bonus token) — drawn with
    :func:`specjax.core.sampling.sample` (never a zero-probability id). A static ``lax.fori_loop``
    of D·K tries, so shapes and cost are fixed.

    Raises ValueError for an unknown scheme, mismatched shapes, or a missing ``draft_probs`` with
    ``"iid"`` / ``"without_replacement"``.
    """
    target_probs = jnp.asarray(target_probs, jnp.float32)
    uniforms = jnp.asarray(uniforms, jnp.float32)
    _check_inputs(tree, target_probs, uniforms, scheme, batched=False)
    depth_max, k_max = tree.max_depth, tree.max_children
    tokens = tree.tokens
    children = _children_row(tree.parents, _live(tree), k_max)  # [N+1, K]
    p_all = target_probs
    q_all = None if scheme == "deterministic" else jnp.asarray(tree.draft_probs, jnp.float32)
    vocab = p_all.shape[-1]

    def q_at(row):
        return jnp.zeros((vocab,), jnp.float32) if q_all is None else q_all[row]

    def body(_, state):
        u, j, p, q, n, path, done = state
        c = jnp.where(j < k_max, children[u + 1, jnp.minimum(j, k_max - 1)], -1)
        active = ~done & (c >= 0)
        c_safe = jnp.maximum(c, 0)
        token = tokens[c_safe]
        step = child_step(p, q, token, scheme)
        take = active & accepts(uniforms[c_safe], p, step.q_child, token)
        reject = active & ~take
        p = jnp.where(take, p_all[c_safe + 1], jnp.where(reject, step.p_rejected, p))
        q = jnp.where(take, q_at(c_safe + 1), jnp.where(reject, step.q_rejected, q))
        path = jnp.where(take, path.at[jnp.minimum(n, depth_max - 1)].set(c), path)
        return (
            jnp.where(take, c, u),
            jnp.where(take, 0, jnp.where(reject, j + 1, j)),
            p,
            q,
            n + take.astype(jnp.int32),
            path,
            done | ~active,
        )

    init = (
        jnp.int32(-1),
        jnp.int32(0),
        p_all[0],
        q_at(0),
        jnp.int32(0),
        jnp.full((depth_max,), -1, jnp.int32),
        jnp.bool_(False),
    )
    _, _, next_probs, _, n, path, _ = lax.fori_loop(0, depth_max * k_max, body, init)
    return TreeAcceptance(n, path, sample(key, next_probs), next_probs)


def verify_tree(
    tree: DraftTree,
    target_probs: jax.Array,
    uniforms: jax.Array,
    keys: jax.Array,
    scheme: str,
) -> TreeAcceptance:
    """:func:`verify_tree_row` vmapped over B independent rows.

    Args:
      tree: a batched :class:`DraftTree` (``[B, N]``; ``draft_probs [B, N+1, V]`` or None).
      target_probs: float32 ``[B, N+1, V]`` (row 0 = the root).
      uniforms: float32 ``[B, N]`` in [0, 1), one per node.
      keys: B PRNG keys (typed ``[B]`` or raw uint32 ``[B, 2]``), one per row.
      scheme: one of :data:`SCHEMES` (static).

    Returns:
      :class:`TreeAcceptance`: ``n [B]``, ``path [B, D]``, ``next_token [B]`` int32,
      ``next_probs [B, V]`` float32. Raises ValueError as :func:`verify_tree_row`.
    """
    target_probs = jnp.asarray(target_probs, jnp.float32)
    uniforms = jnp.asarray(uniforms, jnp.float32)
    _check_inputs(tree, target_probs, uniforms, scheme, batched=True)
    return jax.vmap(lambda t, p, r, k: verify_tree_row(t, p, r, k, scheme))(tree, target_probs, uniforms, keys)


# ---------------------------------------------------------------- greedy ---------------


class GreedyAcceptance(NamedTuple):
    """The result of :func:`verify_tree_greedy`: ``n [B]``, ``path [B, D]`` (-1 padded) and
    ``next_token [B]``, all int32."""

    n: jax.Array
    path: jax.Array
    next_token: jax.Array


def verify_tree_greedy(tree: DraftTree, target_scores: jax.Array) -> GreedyAcceptance:
    """Greedy acceptance: the longest root-to-node path that the target's argmax reproduces.

    Args:
      tree: a batched :class:`DraftTree` (``draft_probs`` is not used).
      target_scores: float ``[B, N+1, V]``, the target's logits or processed probabilities at the
        root (row 0) and after every node (row ``i + 1``); only the argmax matters, lowest id on
        ties (as :func:`specjax.core.sampling.process_logits` at temperature 0).

    Returns:
      :class:`GreedyAcceptance`. A valid node i *matches* when ``tokens[i] = argmax(target_scores
      [parents[i] + 1])``; the accepted node is the deepest one whose whole path root → i matches
      (lowest node id among equally deep ones: duplicate siblings), ``n`` its depth (0 if none),
      ``path`` its path, and ``next_token = argmax(target_scores[i + 1])`` (root: row 0) — the
      target's token after the path (SpecInfer, Miao et al. 2024, Algorithm 2 ``VerifyGreedy``).
      The same tokens as autoregressive greedy decoding of the target.

    Raises ValueError if ``target_scores`` is not ``[B, N+1, V]``.
    """
    target_scores = jnp.asarray(target_scores)
    batch, nodes = tree.tokens.shape
    if target_scores.ndim != 3 or target_scores.shape[:2] != (batch, nodes + 1):
        raise ValueError(
            f"target_scores must be [B, N+1, V] = [{batch}, {nodes + 1}, V] (row 0 = the root), "
            f"got {target_scores.shape}"
        )
    depth_max = tree.max_depth

    def row(tokens, parents, depth, live, scores):
        best_token = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # [N+1], lowest id on ties
        match = live & (tokens == best_token[parents + 1])
        anc = _ancestors_row(parents, depth_max)
        ok = match & ~jnp.any(anc & ~match[None, :], axis=1)
        reach = jnp.where(ok, depth, 0)
        best = jnp.argmax(reach).astype(jnp.int32)  # deepest, lowest id on ties
        n = reach[best]
        path = jnp.where(n > 0, _paths_row(parents, depth, depth_max)[best], -1)
        next_token = best_token[jnp.where(n > 0, best + 1, 0)]
        return GreedyAcceptance(n.astype(jnp.int32), path, next_token)

    return jax.vmap(row)(tree.tokens, tree.parents, tree.depth, _live(tree), target_scores)


# ------------------------------------------------------- EAGLE-2 dynamic tree ------------


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
