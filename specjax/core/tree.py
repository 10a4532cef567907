"""Draft trees: structure helpers, greedy and exact (T > 0) tree acceptance, the EAGLE-2 dynamic tree.

This module holds the acceptance (the per-child kernels, :func:`verify_tree`,
:func:`verify_tree_greedy`); the :class:`DraftTree` pytree and its structure helpers live in
:mod:`specjax.core.tree_structure` and the dynamic tree in :mod:`specjax.core.dynamic_tree`. Both
are re-exported here: import every tree name from ``specjax.core.tree``.

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

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specjax.core.dynamic_tree import build_dynamic_tree
from specjax.core.sampling import sample
from specjax.core.tree_structure import (  # noqa: F401  (the structure helpers, re-exported)
    DraftTree, ancestors_row, children_row, live_nodes, paths_row, ancestor_matrix, attention_mask, block_attention_mask,
    chain_tree, check_tree, children_table, limit_depth, node_paths, path_tokens, positions,
)

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


def _walk_step(tokens, children, uniforms, p_all, q_at, scheme: str, depth_max: int, k_max: int):
    """The ``lax.fori_loop`` body of :func:`verify_tree_row`: one try of the walk.

    ``state = (u, j, p, q, n, path, done)``: the current node ``u`` (-1: the root), the index ``j``
    of its next child in ``children [N+1, K]``, the node state ``(p, q)``, the accepted count ``n``,
    the accepted ``path [D]`` and whether the walk has ended. ``q_at(row)`` is the drafter's q of
    that row of ``draft_probs`` (zeros for ``"deterministic"``).
    """

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

    return body


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
    children = children_row(tree.parents, live_nodes(tree), k_max)  # [N+1, K]
    p_all = target_probs
    q_all = None if scheme == "deterministic" else jnp.asarray(tree.draft_probs, jnp.float32)
    vocab = p_all.shape[-1]

    def q_at(row):
        return jnp.zeros((vocab,), jnp.float32) if q_all is None else q_all[row]

    body = _walk_step(tokens, children, uniforms, p_all, q_at, scheme, depth_max, k_max)
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
        anc = ancestors_row(parents, depth_max)
        ok = match & ~jnp.any(anc & ~match[None, :], axis=1)
        reach = jnp.where(ok, depth, 0)
        best = jnp.argmax(reach).astype(jnp.int32)  # deepest, lowest id on ties
        n = reach[best]
        path = jnp.where(n > 0, paths_row(parents, depth, depth_max)[best], -1)
        next_token = best_token[jnp.where(n > 0, best + 1, 0)]
        return GreedyAcceptance(n.astype(jnp.int32), path, next_token)

    return jax.vmap(row)(tree.tokens, tree.parents, tree.depth, live_nodes(tree), target_scores)
