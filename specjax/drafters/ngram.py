"""n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"), on device.

The trailing n-gram of each row is compared with every earlier window of the row's
committed token buffer (a vectorized equality over the fixed-size buffer, masked by
length, the trailing n-gram itself excluded); the latest match wins and the γ
tokens after it are proposed. Sizes n = N, N−1, …, 1 are tried, longest first.
q is one-hot: the proposal is deterministic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.drafting import DraftContext, Proposal


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafter. ``max_ngram``: longest n-gram tried (≥ 1); ``min_ngram``: shortest."""

    max_ngram: int = 3
    min_ngram: int = 1
    params: None = None
    always_proposes = False  # no match, no drafts (see specjax.core.drafting.Drafter)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )

    @property
    def name(self) -> str:
        return f"ngram:{self.max_ngram}"

    def init_state(self, params, context: DraftContext, max_len: int):
        return ()

    def propose(self, params, state, context: DraftContext, keys, gamma: int, vocab_size: int) -> Proposal:
        tokens, num_valid, _ = jax.vmap(lambda b, n: _lookup_row(b, n, gamma, self.min_ngram, self.max_ngram))(
            context.tokens, context.lengths
        )
        probs = jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32)
        return Proposal(tokens, probs, num_valid, state)


def lookup_candidate(tokens, lengths, max_n: int):
    """The prompt-lookup candidate for the next token of each row, and its match length.

    Args:
      tokens: ``[B, L]`` int32 committed token buffer; lengths: ``[B]`` int32 (slots at or
        beyond a row's length are ignored).
      max_n: longest n-gram tried (then n−1, …, 1).
    Returns:
      ``(candidate [B] int32, n [B] int32)``: the token that followed the latest earlier
      occurrence of the row's trailing n-gram, n the longest matching size (0 and token 0
      when nothing matches). :func:`specjax.train.batches.lookup_candidates` is the same rule
      over whole training sequences, in NumPy.
    """
    toks, _, n = jax.vmap(lambda b, m: _lookup_row(b, m, 1, 1, max_n))(tokens, lengths)
    return toks[:, 0], n


def _lookup_row(buf, length, gamma, min_n, max_n):
    """One row: ``(tokens [γ], num_valid, n)`` from the latest earlier match of the trailing
    n-gram (n: the size that matched, 0 if none)."""
    size = buf.shape[0]
    starts = jnp.arange(size, dtype=jnp.int32)
    best_start = jnp.int32(-1)
    best_n = jnp.int32(0)
    # Longest n first: keep the first n that has a match.
    for n in range(max_n, min_n - 1, -1):
        trail_pos = length - n + jnp.arange(n)
        trail = jnp.take(buf, jnp.clip(trail_pos, 0, size - 1))
        eq = jnp.ones((size,), bool)
        for j in range(n):
            shifted = jnp.roll(buf, -j)  # shifted[s] = buf[s + j]
            eq = eq & (shifted == trail[j])
        # the window [s, s+n) must end before the last committed token (so at least
        # one token follows it, and it is not the trailing n-gram itself)
        ok = eq & (starts + n <= length - 1) & (length >= n + 1)
        latest = jnp.max(jnp.where(ok, starts, -1))
        cont = latest + n  # first proposed token's slot
        take = (best_start < 0) & (latest >= 0)
        best_n = jnp.where(take, n, best_n)
        best_start = jnp.where(take, cont, best_start)
    found = best_start >= 0
    idx = jnp.clip(best_start + jnp.arange(gamma), 0, size - 1)
    toks = jnp.take(buf, idx)
    num_valid = jnp.where(found, jnp.minimum(gamma, length - best_start), 0).astype(jnp.int32)
    toks = jnp.where(jnp.arange(gamma) < num_valid, toks, 0).astype(jnp.int32)
    return toks, num_valid, best_n.astype(jnp.int32)
