"""A feature-level drafter (EAGLE, Li et al. 2024) with a frequent-token sub-vocabulary head.

Architecture (per position t, D = the target's width):

    x_t = fc([h_{t-1} ; e(x_t)])           fc: 2D → D (+ bias); h = target final hidden state, or
                                            (EAGLE-3, ``feature_layers``) fuse · the fused block outputs
    y_t = Block(x_t)                        one Llama decoder block, its own small KV cache
    f_t = RMSNorm(y_t)                      predicted feature ≈ h_t (the target's state at t)
    q(x_{t+1}) ∝ exp(f_t · E[s])  for s in the sub-vocabulary S, 0 elsewhere

With ``copy_ngram = N > 0`` the head also gets a learned copy term (a pointer, as in
See et al. 2017, over the prompt-lookup candidate of Saxena 2023): c_t is the token that
followed the latest earlier occurrence of the trailing n-gram ending at x_t (n ≤ N,
longest first, :func:`specjax.drafters.ngram.lookup_candidate`); its logit becomes

    l(c_t) = f_t · E[c_t] + b_n + w · f_t    (b: one trained bias per match length n; w: [D])

for any token c_t, in S or not (E[c_t]: the target's head row). The drafter thus learns
from the context when copying beats its own prediction; q is still exactly what is
sampled from.

``e`` is the target's (frozen) token embedding and ``E[S]`` the frozen rows of the
target's tied LM head restricted to the |S| (e.g. 8k) most frequent tokens: the head
costs |S|/V of the full one, and the drafter stays exact because q is exactly what is
sampled from (``-inf`` logits outside S → probability 0 after ``sampling.process``).
Only ``fc``, the block, the output norm (and ``fuse``, the copy term) are trained (and shipped); ``embed``,
``head`` and ``sub_ids`` are taken from the target at load time.

Decode-loop protocol (see :mod:`specjax.core.drafting`). Let L = committed length,
n = last_accepted, L0 = L − n − 1 (the committed length before the last round). The
last target call's hidden states ``target_hidden[:, j]`` are h at positions L0−1+j.
Each round:

1. one (γ+1)-token drafter call at positions L0 .. L0+γ with inputs
   ``[target_hidden[:, j] ; e(tokens[L0+j])]``: rewrites the drafter's KV for every
   newly committed position with TRUE target features (positions past L−1 get stale
   values that later calls overwrite before anything reads them); its output at index
   n (position L−1) gives q_1;
2. γ−1 one-token steps that feed the drafter's own predicted feature and the previous
   draft token (``lax.scan``).

In the first round after the prefill there is no target call yet; ``init_state`` keeps
the prompt's h at position P−2 and the first round uses it.

Plain rounds (the serving engine's one-token target calls on a speculative state,
:func:`specjax.runtime.loop._plain_round`) run no drafter call, so step 1 would never see
their features: the drafter's KV would keep holes at those positions (zeros, or a freed
row's stale entries) and its acceptance would drop for the rest of the request
(measured: τ 1.5–1.75 in the first speculative chunk after plain ones vs 2.5–3 when
speculating throughout, int8, one row). :meth:`EagleDrafter.absorb` instead keeps each plain
round's true features (the last call's, as step 1 would feed them) in a ring of the last
:data:`CATCH_UP` positions (a copy, no drafter pass), and the next round's step 1 first
re-encodes the ring's pending positions (one drafter call over the ring, under a
``lax.cond``: only in the first speculative round after plain ones). Positions more than
:data:`CATCH_UP` back stay holes. Exactness never depends on this (q is what is sampled from).

This module holds the drafter (:class:`EagleDrafter`: chains and EAGLE-2 dynamic trees) and
:func:`load_drafter`; the configuration and parameters are in
:mod:`specjax.drafters.eagle_params`, the network (``forward``, ``ttt_forward``, the head) in
:mod:`specjax.drafters.eagle_net` and the files (fingerprint, ``save_drafter``) in
:mod:`specjax.drafters.eagle_files`. Every name of those is re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafting import DraftContext, Drafter, Proposal, TreeProposal, TreeShape
from specjax.core.tree import DraftTree, block_attention_mask, build_dynamic_tree, positions
from specjax.drafters.eagle_files import (  # noqa: F401  (the files, re-exported)
    check_trained_for, fingerprint_mismatch, flat_trainable, save_drafter, target_fingerprint, unflat_trainable,
)
from specjax.drafters.eagle_net import (  # noqa: F401  (the network, re-exported)
    SMALL_ROWS, copy_logit, forward, full_logits, input_features, new_cache, sub_logits, ttt_forward,
)
from specjax.drafters.eagle_params import (  # noqa: F401  (the configuration and parameters, re-exported)
    COPY_KEYS, TRAINABLE, EagleConfig, block_weights, frozen_params, init_copy_params, init_params,
    layer_keys, layer_matmuls, quantize_params, resolve_feature_layers, target_embed,
)
from specjax.drafters.ngram import lookup_candidate
from specjax.models import llama
from specjax.core.sampling import sample


CATCH_UP = 64  # positions of plain rounds' features kept for the next drafter call (module docstring)
_NONE_PENDING = np.iinfo(np.int32).max  # ``pending_from`` when every position is encoded


def catch_up_state(state: dict, batch: int, feature_size: int, max_len: int) -> dict:
    """``state`` with the plain rounds' ring (module docstring): ``ring [B, K, F]`` float32 the
    target's features by position mod K (K = min(:data:`CATCH_UP`, max_len − 1)), ``pending_from
    [B]`` int32 the first position not encoded (:data:`_NONE_PENDING`: none), ``h0_pos [B]`` int32
    the position fed ``h0`` instead of its ring entry (a fresh row's first plain round; −1: none)."""
    k = max(1, min(CATCH_UP, max_len - 1))
    return dict(state, ring=jnp.zeros((batch, k, feature_size), jnp.float32),
                pending_from=jnp.full((batch,), _NONE_PENDING, jnp.int32), h0_pos=jnp.full((batch,), -1, jnp.int32))


@dataclasses.dataclass(frozen=True, eq=False)
class EagleDrafter(Drafter):
    """EAGLE-style feature drafter (static part; ``params`` = ``{"train", "frozen"}``).

    ``min_confidence``: dynamic draft length. Drafts are offered for verification only while
    the drafter's own confidence (its largest probability at temperature 1, copy term
    included) stays ≥ this value; a round whose first draft is below it is a plain target
    step (the γ+1-token verification call is skipped at batch 1). Exactness does not
    depend on it (a stopping rule on the drafter's side, as in SpecDec++, Huang et al.
    2024). Worth it where verification costs more than a plain step: propose iff the
    expected acceptance a satisfies a / (v(γ) − 1) > the current tokens per target-call
    cost, ≈ 0.35 for float32 on the reference CPU (v(1) = 1.34); 0 (always propose) where
    verification is nearly free (GPU/TPU).
    """

    config: EagleConfig
    params: Any = dataclasses.field(repr=False, default=None)
    name: str = "eagle"
    min_confidence: float = 0.0

    # its declarations (specjax.core.drafting.Drafter)
    proposes_trees = True  # EAGLE-2 dynamic trees (propose_tree)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target blocks it reads (EAGLE-3's fused features), ``()``: the final hidden state."""
        return tuple(self.config.feature_layers)

    @property
    def always_proposes(self) -> bool:
        """Drafts every round (γ in a chain, at least one valid node in a tree) unless a confidence
        cut-off is set (``min_confidence > 0``: a round may offer no draft)."""
        return self.min_confidence <= 0.0

    @property
    def context_limit(self) -> int:
        """Its block's context (its KV cache holds the row)."""
        return self.config.max_position_embeddings

    def chain_passes(self, gamma: int) -> int:
        """γ: the (γ+1)-token call over the last round's true features (q_1), then γ − 1 steps."""
        return gamma

    def tree_passes(self, shape: TreeShape) -> int:
        """D: the call over the true features at the root and accepted path, then one forest call
        per level 2..D (:meth:`propose_tree`)."""
        return shape.depth

    def scratch_slots(self, gamma: int, tree: TreeShape | None = None) -> int:
        """A chain: γ (the first call's last position); a tree: also the forest calls' K paths of up
        to D − 1 nodes."""
        return gamma if tree is None else max(tree.depth, tree.topk * (tree.depth - 1))

    def _key(self):
        return (self.config, self.name, float(self.min_confidence))

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, EagleDrafter) and self._key() == other._key()

    # ---- the network seams: a subclass with another network (a published EAGLE-3 head,
    # specjax.drafters.eagle3_head) overrides these three and keeps the propose/tree machinery
    def features_in(self, params, hid) -> jax.Array:
        """The drafter's input feature ``[..., D]`` float32 from the target's ``hid [..., F]``
        (:func:`input_features`)."""
        return input_features(self.config, params, hid)

    def net_forward(self, params, feats, tokens, positions, cache, tree_mask=None):
        """The drafter network over T positions: ``(f [B, T, D], cache)`` (:func:`forward`)."""
        return forward(self.config, params, feats, tokens, positions, cache, tree_mask=tree_mask)

    def cache_slots(self, positions):
        """The cache slots :meth:`net_forward` writes for a causal call at ``positions [B, T]``."""
        return positions

    def head_logits(self, params, feat, tbuf, tlen, vocab_size: int):
        """Logits ``[M, V]`` over the target vocabulary for features ``feat [M, D]`` whose contexts
        are ``tbuf [M, L]``, ``tlen [M]`` (the copy term's candidate is looked up there)."""
        cfg = self.config
        if cfg.copy_ngram:
            cand, cn = lookup_candidate(tbuf, tlen, cfg.copy_ngram)
            return full_logits(params, feat, vocab_size, cand, cn)
        return full_logits(params, feat, vocab_size)

    def init_state(self, params, context: DraftContext, max_len: int):
        b, s = context.tokens.shape
        h = self.features_in(params, context.target_hidden)  # [B, P, D] prompt features
        p = h.shape[1]
        cache = new_cache(self.config, b, max_len)
        feats = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = self.net_forward(params, feats, context.tokens[:, :p], pos, cache)
        idx = jnp.clip(context.lengths - 2, 0, p - 1)
        h0 = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
        h0 = jnp.where((context.lengths >= 2)[:, None], h0, 0.0)
        return catch_up_state({"cache": cache, "h0": h0.astype(jnp.float32), "fresh": jnp.ones((b,), bool)},
                              b, context.target_hidden.shape[-1], max_len)

    def absorb(self, params, state, context: DraftContext):
        """A plain round is about to replace ``context.target_hidden``: its entries at positions
        L0 .. L0 + n (the ones step 1 of the next round would feed) go into the ring, and the
        first of them becomes pending unless earlier ones are (module docstring). A copy of
        ``n + 1 ≤ W`` features per row; no drafter pass."""
        lengths, n, hid = context.lengths, context.last_accepted, context.target_hidden
        ring = state["ring"]
        k = ring.shape[1]
        rows = jnp.arange(lengths.shape[0])
        l0 = lengths - n - 1
        for j in range(hid.shape[1]):
            idx = (l0 + j) % k
            ring = ring.at[rows, idx].set(jnp.where((j <= n)[:, None], hid[:, j].astype(jnp.float32), ring[rows, idx]))
        fresh = state["fresh"]
        return dict(state, ring=ring, pending_from=jnp.minimum(state["pending_from"], l0),
                    h0_pos=jnp.where(fresh, l0, state["h0_pos"]), fresh=jnp.zeros_like(fresh))

    def _catch_up(self, params, state, context: DraftContext):
        """The drafter cache with the ring's pending positions re-encoded (one call over K
        positions ending at L0 − 1, or starting at 1; only the pending slots are kept), and
        nothing pending (module docstring). Runs only when a row has pending positions.

        The call also rewrites the window's positions before ``pending_from`` (their ring entries
        are stale) and the valid positions attend to those; their K/V are still exact because the
        drafter is one block, whose K/V at a position are a function of that position's input
        alone (the rewritten slots are then restored from the old cache). A deeper drafter would
        need a mask here: hence the check."""
        if self.config.layer.num_layers != 1:
            raise NotImplementedError("EagleDrafter catch-up assumes one drafter block "
                                      f"(got {self.config.layer.num_layers})")
        l0 = context.lengths - context.last_accepted - 1
        need = state["pending_from"] < l0

        def encode(state):
            ring, cache = state["ring"], state["cache"]
            b, k = ring.shape[:2]
            buf = context.tokens.shape[1]
            pos = jnp.maximum(l0 - k, 1)[:, None] + jnp.arange(k, dtype=jnp.int32)  # [B, K] contiguous
            valid = need[:, None] & (pos >= state["pending_from"][:, None]) & (pos < l0[:, None])
            feats = self.features_in(params, jnp.take_along_axis(ring, (pos % k)[..., None], axis=1))
            feats = jnp.where((pos == state["h0_pos"][:, None])[..., None], state["h0"][:, None], feats)
            toks = jnp.take_along_axis(context.tokens, jnp.minimum(pos, buf - 1), axis=1)
            _, new = self.net_forward(params, feats, toks, pos, cache)
            slots = self.cache_slots(pos)
            keep = jnp.zeros((b, cache.k[0].shape[2]), bool).at[jnp.arange(b)[:, None], slots].max(valid)
            keep = keep[:, None, :, None]
            cache = llama.KVCache(k=[jnp.where(keep, a, o) for a, o in zip(new.k, cache.k)],
                                  v=[jnp.where(keep, a, o) for a, o in zip(new.v, cache.v)], lengths=cache.lengths)
            return dict(state, cache=cache)

        state = jax.lax.cond(jnp.any(need), encode, lambda st: st, state)
        return dict(state, pending_from=jnp.full_like(state["pending_from"], _NONE_PENDING),
                    h0_pos=jnp.full_like(state["h0_pos"], -1))

    def _reencode(self, params, state, context: DraftContext):
        """Step 1 of a round (module docstring): the plain rounds' pending positions, then the
        drafter call over the last call's true target features at positions L0 .. L0 + W − 1
        (W = ``target_hidden.shape[1]``). Returns ``(f1 [B, D] the feature at position L − 1, the
        drafter state with its new cache and nothing pending, the features fed [B, W, D])``."""
        state = self._catch_up(params, state, context)
        lengths = context.lengths
        n = context.last_accepted
        hid = self.features_in(params, context.target_hidden)  # [B, γ+1, D] (a tree: [B, D+1, D])
        fresh = state["fresh"]
        hid = jnp.where(fresh[:, None, None], hid.at[:, 0].set(state["h0"]), hid)
        l0 = lengths - n - 1
        buf = context.tokens.shape[1]
        pos = l0[:, None] + jnp.arange(hid.shape[1], dtype=jnp.int32)
        toks = jnp.take_along_axis(context.tokens, jnp.minimum(pos, buf - 1), axis=1)
        f, cache = self.net_forward(params, hid, toks, pos, state["cache"])
        f1 = jnp.take_along_axis(f, n[:, None, None], axis=1)[:, 0]  # position L-1
        return f1, dict(state, cache=cache), hid

    def _confidence(self, logits):
        """The drafter's confidence (largest probability at temperature 1) ``[...]``; ones when
        ``min_confidence`` is 0 (static: no extra vocabulary-wide pass when unused)."""
        if self.min_confidence > 0:
            return jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
        return jnp.ones(logits.shape[:-1], jnp.float32)

    def propose(self, params, state, context: DraftContext, keys, gamma: int, vocab_size: int) -> Proposal:
        cfg = self.config
        lengths = context.lengths
        buf = context.tokens.shape[1]
        f1, state, _ = self._reencode(params, state, context)
        cache, fresh = state["cache"], state["fresh"]

        rows = jnp.arange(lengths.shape[0])

        def draw(feat, key_col, tbuf, tlen):
            logits = self.head_logits(params, feat, tbuf, tlen, vocab_size)
            probs = context.sampling.process(logits)
            conf = self._confidence(logits)
            return jax.vmap(sample)(key_col, probs), (probs, conf)

        tbuf = context.tokens
        x1, (q1, c1) = draw(f1, keys[:, 0], tbuf, lengths)

        def step(carry, inp):
            tok, feat, cache, tbuf = carry
            i, key_col = inp
            p_ = (lengths - 1 + i)[:, None]
            fo, cache = self.net_forward(params, feat[:, None], tok[:, None], p_, cache)
            if cfg.copy_ngram:  # the copy candidate sees the drafts so far
                tbuf = tbuf.at[rows, jnp.minimum(lengths - 1 + i, buf - 1)].set(tok)
            nxt, probs = draw(fo[:, 0], key_col, tbuf, jnp.minimum(lengths + i, buf))
            return (nxt, fo[:, 0], cache, tbuf), (nxt, probs)

        if gamma > 1:
            idx = jnp.arange(1, gamma, dtype=jnp.int32)
            (_, _, cache, _), (tk, (pr, cf)) = jax.lax.scan(step, (x1, f1, cache, tbuf),
                                                            (idx, jnp.swapaxes(keys[:, 1:], 0, 1)))
            tokens = jnp.concatenate([x1[:, None], jnp.swapaxes(tk, 0, 1)], axis=1)
            q = jnp.concatenate([q1[:, None], jnp.swapaxes(pr, 0, 1)], axis=1)
            conf = jnp.concatenate([c1[:, None], jnp.swapaxes(cf, 0, 1)], axis=1)
        else:
            tokens, q, conf = x1[:, None], q1[:, None], c1[:, None]
        # leading drafts whose confidence reaches min_confidence (all of them at 0)
        num_valid = jnp.sum(jnp.cumprod(conf >= self.min_confidence, axis=1), axis=1).astype(jnp.int32)
        state = dict(state, cache=cache, fresh=jnp.zeros_like(fresh))
        return Proposal(tokens.astype(jnp.int32), q, num_valid, state)

    def propose_tree(self, params, state, context: DraftContext, keys, shape: TreeShape,
                     vocab_size: int) -> TreeProposal:
        """EAGLE-2's dynamic draft tree (Li et al. 2024): :func:`specjax.core.tree.build_dynamic_tree`
        with ``children = expand_width = K``, ``depth = D``, ``num_nodes = N``.

        Candidates are ranked by the drafter's path probability under its distribution at
        temperature 1 (``softmax`` of the same logits that make q, copy term included), whatever
        the sampling settings: the tree is a deterministic function of the context, verified
        with the ``"deterministic"`` scheme (:data:`specjax.core.tree.SCHEMES`), so no q is
        returned. With ``min_confidence > 0`` the children of a node whose distribution's
        largest probability is below it are invalid (a chain's leading-confidence rule).

        The drafter's attention over the tree: step 1 (the call over the last round's true target
        features at the root and the accepted path) updates the cache, as for a chain. Then each
        level expands its K best candidates in ONE call over a forest ``[root, path of
        candidate 1, .., path of candidate K]`` (each path: the candidate's ancestors and itself,
        fed the drafter's own features of their parents) with ``tree_mask`` — every path node sees
        the committed prefix, the root and its own ancestors, at position ``L − 1 + depth``. Those
        calls' cache writes are dropped (their K/V sit at scratch slots ``L − 1 ..
        L − 1 + K·(D − 1)``, inside the program's spare slots): the cache keeps only committed
        positions, and the next round's step 1 rewrites the accepted path's positions with the
        target's features, so the state follows the accepted path without a compaction. With
        K = 1 the forest is the chain, and the tree is the greedy chain :meth:`propose` drafts at
        temperature 0 (its ranking's top-1 is q's argmax).
        """
        cfg = self.config
        lengths = context.lengths
        b, buf = context.tokens.shape
        n = context.last_accepted
        f1, state, hid = self._reencode(params, state, context)
        cache = state["cache"]
        h_root = jnp.take_along_axis(hid, n[:, None, None], axis=1)[:, 0]  # h at L-2: the root's input
        root_tok = jnp.take_along_axis(context.tokens, (lengths - 1)[:, None], axis=1)  # [B, 1]
        d_max, k = shape.depth, shape.topk
        hidden = cfg.hidden_size

        def ranked(logits):  # [M, V] -> the ranking distribution (0 below min_confidence)
            probs = jax.nn.softmax(logits, axis=-1)
            if self.min_confidence > 0:
                probs = jnp.where((self._confidence(logits) >= self.min_confidence)[..., None], probs, 0.0)
            return probs

        root_probs = ranked(self.head_logits(params, f1, context.tokens, lengths, vocab_size))
        feat_of = {"f": jnp.zeros((b, k + (d_max - 1) * k * k, hidden), jnp.float32)}  # per expanded candidate

        def expand(level, frontier, pool):
            w = frontier.shape[1]
            path = [frontier]  # candidate ids at depths level, level-1, .., 1
            for _ in range(level - 1):
                path.insert(0, jnp.take_along_axis(pool.parents, path[0], axis=1))
            path = jnp.stack(path, axis=2)  # [B, W, level], root → frontier
            flat = path.reshape(b, w * level)
            ptok = jnp.take_along_axis(pool.tokens, flat, axis=1)  # [B, W·level]
            parent_f = jnp.take_along_axis(feat_of["f"], path[:, :, :-1].reshape(b, -1)[..., None], axis=1)
            feats = jnp.concatenate([jnp.broadcast_to(f1[:, None, None], (b, w, 1, hidden)),
                                     parent_f.reshape(b, w, level - 1, hidden)], axis=2)
            j = jnp.arange(w * level, dtype=jnp.int32)
            forest = DraftTree(ptok, jnp.broadcast_to(jnp.where(j % level == 0, -1, j - 1), (b, w * level)),
                               jnp.broadcast_to(j % level + 1, (b, w * level)), jnp.ones((b, w * level), bool),
                               None, level, w)
            fo, _ = self.net_forward(params, jnp.concatenate([h_root[:, None], feats.reshape(b, w * level, hidden)], 1),
                                     jnp.concatenate([root_tok, ptok], axis=1), positions(forest, lengths), cache,
                                     tree_mask=block_attention_mask(forest))
            f_front = fo[:, level::level]  # [B, W]: each lane's last node (block index (w+1)·level)
            feat_of["f"] = jax.vmap(lambda a, i, v: a.at[i].set(v))(feat_of["f"], frontier, f_front)
            tb = tlen = None
            if cfg.copy_ngram:  # each lane's copy candidate sees the committed tokens and its path
                tb, tlen = _lane_tokens(context.tokens, lengths, ptok, level, w)
            logits = self.head_logits(params, f_front.reshape(b * w, hidden), tb, tlen, vocab_size)
            return ranked(logits).reshape(b, w, vocab_size)

        tree, _ = build_dynamic_tree(root_probs, expand, depth=d_max, children=k, expand_width=k,
                                     num_nodes=shape.nodes)
        state = dict(state, fresh=jnp.zeros_like(state["fresh"]))
        return TreeProposal(tree, "deterministic", state)


def _lane_tokens(tokens, lengths, ptok, level: int, width: int):
    """The token buffers the copy candidate of each of ``width`` forest lanes reads at tree depth
    ``level`` (:meth:`EagleDrafter.propose_tree`): ``tokens [B, L]`` with the lane's path
    ``ptok [B, width·level]`` written at slots ``lengths .. lengths + level - 1`` (clamped to the
    buffer). Returns ``(buffers [B·width, L], lengths [B·width])``."""
    b, buf = tokens.shape
    tb = jnp.broadcast_to(tokens[:, None, :], (b, width, buf))
    steps = ptok.reshape(b, width, level)
    for i in range(level):
        slot = jnp.minimum(lengths + i, buf - 1)
        tb = tb.at[jnp.arange(b)[:, None], jnp.arange(width)[None, :], slot[:, None]].set(steps[:, :, i])
    return tb.reshape(b * width, buf), jnp.repeat(jnp.minimum(lengths + level, buf), width)


def load_drafter(path, target, dtype: str = "float32", name: str = "eagle", check: bool = True,
                 min_confidence: float | None = None) -> EagleDrafter:
    """Load an EAGLE drafter saved by :func:`save_drafter` for ``target``.

    ``path`` may be a directory path or an ``importlib.resources`` Traversable.
    ``dtype``: weight format: ``float32``; ``bfloat16`` (weights rounded to bfloat16,
    computed in float32); ``int8`` (:func:`quantize_params`).
    ``min_confidence``: see :class:`EagleDrafter`; ``None`` takes ``drafter.json``'s
    ``min_confidence`` (0 when absent).

    Raises:
      CheckpointError: missing files, or the drafter was trained for another target
        (fingerprint mismatch: config, weights or tokenizer differ).
      ValueError: an unknown ``dtype`` or a ``min_confidence`` outside [0, 1).
    """
    from safetensors.numpy import load as st_load

    from specjax.models.config import CheckpointError

    if dtype not in ("float32", "bfloat16", "int8"):
        raise ValueError(f"drafter dtype must be float32, bfloat16 or int8, got {dtype!r}")

    import pathlib

    p = pathlib.Path(path) if isinstance(path, str) else path
    try:
        meta = json.loads((p / "drafter.json").read_text())
        raw = (p / "model.safetensors").read_bytes()
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(f"{path}: not an EAGLE drafter directory ({e})") from None
    if check:
        check_trained_for(meta, target, path)
    tensors = st_load(raw)
    c = meta["config"]
    try:
        cfg = EagleConfig.for_target(target.config, c["sub_vocab"], c["intermediate_size"], c["num_heads"],
                                     c["num_kv_heads"], c.get("copy_ngram", 0), tuple(c.get("feature_layers", ())))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if cfg.feature_layers and "fuse" not in tensors:
        raise CheckpointError(f"{path}: drafter.json sets feature_layers {list(cfg.feature_layers)} but the weights "
                              "have no 'fuse'; the directory is incomplete or mixed")
    tp = unflat_trainable({k: np.asarray(v, np.float32) for k, v in tensors.items() if k != "sub_ids"},
                          cfg)
    if cfg.copy_ngram and not set(COPY_KEYS) <= set(tp):
        raise CheckpointError(f"{path}: drafter.json sets copy_ngram = {cfg.copy_ngram} but the weights have no "
                              "copy_w/copy_b; the directory is incomplete or mixed")
    if dtype == "bfloat16":  # weights rounded to bf16, computed in float32 (rows are few: bf16 matmuls are slow here)
        tp = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), tp)
    fz = frozen_params(target, tensors["sub_ids"])
    params = {"train": tp, "frozen": fz}
    if dtype == "int8":
        params = quantize_params(params)
    if min_confidence is None:
        min_confidence = float(meta.get("min_confidence", 0.0))
    if not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
    return EagleDrafter(cfg, params, name=name, min_confidence=float(min_confidence))
