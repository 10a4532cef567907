"""n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"), on device.

The trailing n-gram of each row is compared with every earlier window of the row's
committed token buffer (a vectorized equality over the fixed-size buffer, masked by
length, the trailing n-gram itself excluded); the latest match wins and the γ
tokens after it are proposed. Sizes n = N, N−1, …, 1 are tried, longest first.
q is one-hot: the proposal is deterministic.

Trees (:meth:`NgramDrafter.propose_tree`): the continuations after *every* earlier match
(longest n first, then the latest), deduplicated into a trie; verified with the
``"deterministic"`` scheme (the candidates are a function of the context).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.drafting import MAX_NGRAM, DraftContext, Drafter, Proposal, TreeProposal, TreeShape
from specjax.core.tree import DraftTree


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    """Prompt-lookup drafter. ``max_ngram``: longest n-gram tried (1 ≤ N ≤ ``MAX_NGRAM``, 16);
    ``min_ngram``: shortest."""

    max_ngram: int = 3
    min_ngram: int = 1
    params: None = None
    # its declarations (specjax.core.drafting.Drafter)
    feature_layers = ()  # reads only the committed tokens
    proposes_trees = True  # a trie of every earlier match (propose_tree)
    always_proposes = False  # no match, no drafts
    context_limit = None  # no state of its own

    def chain_passes(self, gamma: int) -> int:
        """No model pass: a lookup in the committed tokens."""
        return 0

    def tree_passes(self, shape: TreeShape) -> int:
        """No model pass: a trie of lookups."""
        return 0

    def scratch_slots(self, gamma: int, tree: TreeShape | None = None) -> int:
        """None: it keeps no state."""
        return 0

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        if self.max_ngram > MAX_NGRAM:
            raise ValueError(f"max_ngram must be <= {MAX_NGRAM}, got {self.max_ngram}; use ngram:{MAX_NGRAM} or less")

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

    def propose_tree(self, params, state, context: DraftContext, keys, shape: TreeShape,
                     vocab_size: int) -> TreeProposal:
        """A trie of the continuations after every earlier occurrence of the trailing n-gram.

        Candidates: each slot c of the row's buffer that follows a match of the trailing n-gram
        (the longest n for that slot), ranked by (n, c) — longest match first, then the latest —
        and the best ``2N`` of them; each proposes the ≤ D committed tokens from c on. They are
        inserted in rank order into a trie: a candidate follows the existing nodes of its prefix
        and adds a node where its token is new, while that node's parent has fewer than K
        children and fewer than N nodes exist (a rejected insertion ends the candidate); a
        candidate with fewer than D tokens (the buffer ends) holds one child slot of its last
        node for its unknown next token. With K = 1 the tree is the chain :meth:`propose`
        returns (the best candidate's ≤ D tokens).
        Deterministic: verified with ``"deterministic"`` (no q). Unused slots are invalid
        (token 0, parent -1, depth 1).
        """
        tokens, parents, depth, valid = jax.vmap(
            lambda b, n: _trie_row(b, n, shape, self.min_ngram, self.max_ngram))(context.tokens, context.lengths)
        tree = DraftTree(tokens, parents, depth, valid, None, shape.depth, shape.topk)
        return TreeProposal(tree, "deterministic", state)


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


def _match_slots(buf, length, min_n, max_n):
    """``[L]`` int32 per slot c: the longest n in [min_n, max_n] such that the n tokens before c
    equal the row's trailing n-gram, with at least one committed token at or after c and the
    trailing n-gram itself excluded (as :func:`_lookup_row`); 0 where none."""
    size = buf.shape[0]
    starts = jnp.arange(size, dtype=jnp.int32)
    best = jnp.zeros((size,), jnp.int32)
    for n in range(min_n, max_n + 1):  # longer n overwrite shorter ones
        trail = jnp.take(buf, jnp.clip(length - n + jnp.arange(n), 0, size - 1))
        eq = jnp.ones((size,), bool)
        for j in range(n):
            eq = eq & (jnp.roll(buf, -j) == trail[j])
        ok = eq & (starts + n <= length - 1) & (length >= n + 1)  # window start s, continuation at s + n
        at_cont = jnp.roll(ok, n)  # [c] = ok[c - n]; wrapped entries are False (s + n <= length - 1 < L)
        best = jnp.where(at_cont, n, best)
    return best


def _trie_row(buf, length, shape: TreeShape, min_n: int, max_n: int):
    """One row's trie ``(tokens, parents, depth, valid)``, each ``[N]`` (see
    :meth:`NgramDrafter.propose_tree`)."""
    size = buf.shape[0]
    nodes, d_max, k_max = shape.nodes, shape.depth, shape.topk
    m = min(size, 2 * nodes)
    match_n = _match_slots(buf, length, min_n, max_n)
    slots = jnp.arange(size, dtype=jnp.int32)
    rank = jnp.where(match_n > 0, match_n * size + slots, -1)
    top, cont = jax.lax.top_k(rank, m)  # [M]: best first
    cont = cont.astype(jnp.int32)
    cand_len = jnp.where(top >= 0, jnp.clip(length - cont, 0, d_max), 0)
    cand = jnp.take(buf, jnp.clip(cont[:, None] + jnp.arange(d_max), 0, size - 1))  # [M, D]

    def insert(c, carry):
        tokens, parents, depth, valid, kids, count = carry
        cur = jnp.int32(-1)
        placed = jnp.bool_(True)  # every token of the candidate so far is in the trie
        for d in range(d_max):
            t = cand[c, d]
            want = placed & (d < cand_len[c])
            same = valid & (parents == cur) & (tokens == t)
            found = jnp.any(same)
            new = want & ~found & (kids[cur + 1] < k_max) & (count < nodes)
            slot = jnp.minimum(count, nodes - 1)
            tokens = jnp.where(new, tokens.at[slot].set(t), tokens)
            parents = jnp.where(new, parents.at[slot].set(cur), parents)
            depth = jnp.where(new, depth.at[slot].set(d + 1), depth)
            valid = jnp.where(new, valid.at[slot].set(True), valid)
            kids = jnp.where(new, kids.at[cur + 1].add(1), kids)
            nxt = jnp.where(found, jnp.argmax(same).astype(jnp.int32), slot)
            placed = placed & ((d >= cand_len[c]) | found | new)
            cur = jnp.where(want & (found | new), nxt, cur)
            count = count + new.astype(jnp.int32)
        # A candidate cut short by the end of the buffer (fewer than D tokens) holds one child
        # slot of its last node for its unknown next token: with K = 1 no other candidate extends
        # it (the chain's proposal), with K > 1 the next ones may.
        short = placed & (cand_len[c] > 0) & (cand_len[c] < d_max)
        kids = jnp.where(short, kids.at[cur + 1].add(1), kids)
        return tokens, parents, depth, valid, kids, count

    init = (jnp.zeros((nodes,), jnp.int32), jnp.full((nodes,), -1, jnp.int32), jnp.ones((nodes,), jnp.int32),
            jnp.zeros((nodes,), bool), jnp.zeros((nodes + 1,), jnp.int32), jnp.int32(0))
    tokens, parents, depth, valid, _, _ = jax.lax.fori_loop(0, m, insert, init)
    return tokens, parents, depth, valid
