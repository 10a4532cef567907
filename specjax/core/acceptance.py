"""The acceptance step of speculative sampling, for one row and vmapped over a batch.

Implements the verification half of Algorithm 1 ("SpeculativeDecodingStep") of
Leviathan, Kalman & Matias, *Fast Inference from Transformers via Speculative
Decoding* (ICML 2023), equivalently the modified rejection sampling of Chen et
al., *Accelerating Large Language Model Decoding with Speculative Sampling*
(2023, Algorithm 2). Drafting (``x_i ~ q_i``) and scoring (``p_1..p_{γ+1}``) are
the caller's; this module takes their results plus the uniforms and one key.

Output distribution (Leviathan et al. §2.3 and Appendix A.1; Chen et al.
Theorem 1): every emitted token is distributed exactly as the target's ``p`` —
``P(x) = min(p, q)(x) + (1 - β) · norm(max(0, p - q))(x) = p(x)`` with
``β = Σ_x min(p(x), q(x))`` — provided ``q`` is exactly the distribution the
draft token was sampled from and the uniforms are independent of everything
else.

Greedy decoding needs no special case: with one-hot ``p`` and ``q`` a draft is
accepted iff it equals the target's argmax, and the residual is the target's
one-hot argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.core.sampling import sample

__all__ = ["verify_row", "verify"]


def verify_row(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    uniforms: jax.Array,
    key: jax.Array,
    num_allowed: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept/reject γ draft tokens for ONE row; draw the residual or bonus token.

    Args:
      draft_tokens: int32 [γ], ``x_1..x_γ`` sampled by the drafter.
      draft_probs: float32 [γ, V], ``q_i`` = the distribution ``x_i`` was
        sampled from (after the same temperature/top-k/top-p as ``p``).
      target_probs: float32 [γ+1, V], ``p_i = M_p(prefix + x_<i)`` for
        i = 1..γ+1 (the last row is the bonus distribution).
      uniforms: float32 [γ], ``r_i ~ U[0, 1)`` (Algorithm 1: "r_1..r_γ ~ U(0,1)").
      key: PRNG key for the one residual/bonus draw.
      num_allowed: int32 scalar in [0, γ] (clipped): at most this many drafts
        may be accepted. The caller lowers it near ``max_new_tokens`` or the
        cache limit, or sets 0 for a plain one-token step.

    Returns:
      ``(n, next_token, next_probs)``: n int32 — drafts accepted (``x_1..x_n``
      are emitted, then ``next_token``); next_token int32 ~ next_probs;
      next_probs float32 [V], the distribution next_token was drawn from.

    Steps (Leviathan et al. 2023, Algorithm 1):

    1. Accept ``x_i`` iff ``r_i · q_i(x_i) < p_i(x_i)`` — the line
       "n ← min({i − 1 | r_i > p_i(x)/q_i(x)} ∪ {γ})", written without a
       division and with a strict ``<`` so that ``p_i(x_i) = 0`` is never
       accepted, not even with ``r_i = 0`` (which ``jax.random.uniform`` does
       return). ``P(accept) = min(1, p_i(x_i)/q_i(x_i))`` as in the paper. A
       draft id outside ``[0, V)`` is never accepted.
    2. ``n`` = number of accepted drafts before the first rejection, capped at
       ``num_allowed``.
    3. If a rejection happened at position ``n + 1 <= num_allowed``:
       ``next_probs = norm(max(0, p_{n+1} − q_{n+1}))`` (Algorithm 1:
       "p'(x) ← norm(max(0, p_{n+1}(x) − q_{n+1}(x)))"; Chen et al. Algorithm 2's
       resampling step). The residual sums to 0 only when ``p_{n+1} = q_{n+1}``,
       where rejection has probability 0 and can happen only through float
       rounding: then ``p_{n+1}`` is used.
       Otherwise — every allowed draft accepted: the bonus token when
       ``n = γ``, or a forced stop when ``n = num_allowed < γ`` —
       ``next_probs = p_{n+1}`` (Algorithm 1 with the bonus ``p_{γ+1}``).
    4. ``next_token ~ next_probs`` (Algorithm 1: "t ~ p'(x)") with
       :func:`specjax.core.sampling.sample`, so a zero-probability id is never drawn.

    γ and V are static (from the shapes); everything else may be traced.
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    q, p, r = (jnp.asarray(a, jnp.float32) for a in (draft_probs, target_probs, uniforms))
    gamma, vocab = q.shape
    if draft_tokens.shape != (gamma,) or p.shape != (gamma + 1, vocab) or r.shape != (gamma,):
        raise ValueError("verify_row expects draft_tokens [γ], draft_probs [γ, V], target_probs [γ+1, V], "
                         f"uniforms [γ]; got {draft_tokens.shape}, {q.shape}, {p.shape}, {r.shape}")

    # Step 1: accept x_i iff r_i * q_i(x_i) < p_i(x_i).
    in_vocab = (draft_tokens >= 0) & (draft_tokens < vocab)
    idx = jnp.clip(draft_tokens, 0, vocab - 1)[:, None]
    q_x, p_x = (jnp.take_along_axis(a, idx, axis=-1)[:, 0] for a in (q, p[:gamma]))
    accept = in_vocab & (r * q_x < p_x)

    # Step 2: n = accepted prefix length, capped at num_allowed.
    n_free = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)), dtype=jnp.int32)
    allowed = jnp.clip(jnp.asarray(num_allowed, jnp.int32), 0, gamma)
    n = jnp.minimum(n_free, allowed)
    rejected = n_free < allowed  # the first rejection is at position n + 1 <= allowed

    # Step 3: residual norm(max(0, p_{n+1} - q_{n+1})) on rejection, else p_{n+1}.
    p_next, q_next = p[n], q[jnp.minimum(n, gamma - 1)]
    residual = jnp.maximum(p_next - q_next, 0.0)
    mass = jnp.sum(residual)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    next_probs = jnp.where(rejected, residual, p_next)

    # Step 4: t ~ next_probs.
    next_token = sample(key, next_probs)
    return n, next_token, next_probs


_verify_batch = jax.vmap(verify_row)


def verify(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    uniforms: jax.Array,
    keys: jax.Array,
    num_allowed: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`verify_row` vmapped over a batch of B independent rows.

    Args:
      draft_tokens: int32 [B, γ]; draft_probs: float32 [B, γ, V];
      target_probs: float32 [B, γ+1, V]; uniforms: float32 [B, γ] in [0, 1);
      keys: B PRNG keys (typed [B] or raw uint32 [B, 2]), one per row;
      num_allowed: int32 [B] (a scalar is broadcast).

    Returns:
      ``(n int32 [B], next_token int32 [B], next_probs float32 [B, V])``.
    """
    batch = jnp.shape(draft_tokens)[0]
    num_allowed = jnp.broadcast_to(jnp.asarray(num_allowed, jnp.int32), (batch,))
    return _verify_batch(draft_tokens, draft_probs, target_probs, uniforms, keys, num_allowed)
