"""Tree attention (issue 18, model level): one target call over ``[root, node_0 .. node_{N-1}]``
with a tree mask scores every node as the causal call over that node's root-to-node path would,
and :func:`specjax.models.llama.compact_tree_cache` turns the accepted path's scratch K/V into
the causal cache. Tiny random models, every weight format, ragged rows (one tree crosses a
64-slot attention block, one ends at the cache's last slot)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config, tiny_model
from specjax.core import tree as T
from specjax.io.loading import assemble_params, float_tensors
from specjax.models import attention, llama

MAXLEN = 128  # two attention blocks
LENGTHS = np.array([61, 20, 121])  # committed tokens per row: roots at slots 60 (tree crosses 64), 19, 120 (ends at 127)
PARENTS = np.array([
    [-1, -1, 0, 0, 1, 2, 5],
    [-1, 0, 0, 1, -1, 4, 2],
    [-1, -1, -1, 0, 0, 3, 5],
])
B, N = PARENTS.shape
NT = N + 1  # tokens per tree call: the root, then the nodes

# (weight format, KV-cache dtype): the CPU Decoder's caches are float32; bf16 weights get a bf16
# cache on GPU/TPU (llama.kv_cache_dtype)
CASES = [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("int8", "float32")]
IDS = [f"{w}-{c}cache" for w, c in CASES]
F32_TOL = 1e-5


def _depths(parents):
    depth = np.zeros_like(parents)
    for b in range(parents.shape[0]):
        for i, par in enumerate(parents[b]):
            depth[b, i] = 1 if par < 0 else depth[b, par] + 1
    return depth


DEPTH = _depths(PARENTS)


class Setup:
    """A tiny model in one format, a prefilled cache (positions 0 .. lengths-2 per row), a draft
    tree per row and the jitted calls."""

    def __init__(self, fmt, cache_dtype):
        base = tiny_model(seed=3, scale=4.0)
        g, p = assemble_params(base.config, float_tensors(base), fmt, source="convert")
        self.cfg, self.params, self.fmt = base.config, p, fmt
        cfg = self.cfg
        self._apply = jax.jit(lambda params, tok, pos, cache, mask: llama.apply(g, params, tok, pos, cache, cfg,
                                                                               tree_mask=mask))
        rng = np.random.default_rng(7)
        v = cfg.vocab_size
        self.seq = rng.integers(0, v, size=(B, MAXLEN))
        width = int(LENGTHS.max()) - 1
        cache = llama.KVCache.create(cfg, B, MAXLEN, jnp.dtype(cache_dtype))
        _, self.prefix = self.call(self.seq[:, :width], np.broadcast_to(np.arange(width), (B, width)), cache)
        self.root = self.seq[np.arange(B), LENGTHS - 1]
        self.tree = T.DraftTree.create(rng.integers(0, v, size=(B, N)), PARENTS, DEPTH)
        self.paths = np.asarray(T.node_paths(self.tree))  # [B, N, D]
        self.garbage = rng.integers(0, v, size=(B, NT))

    def call(self, tokens, positions, cache, mask=None):
        out = self._apply(self.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache,
                          None if mask is None else jnp.asarray(mask))
        return np.asarray(out.logits), out.cache

    def tree_call(self):
        tokens = np.concatenate([self.root[:, None], np.asarray(self.tree.tokens)], axis=1)
        pos = np.asarray(T.positions(self.tree, LENGTHS))
        return self.call(tokens, pos, self.prefix, T.block_attention_mask(self.tree))

    def path_tokens(self, node):
        """``[B, NT]``: per row the root, the path root → ``node``, then garbage."""
        toks = self.garbage.copy()
        toks[:, 0] = self.root
        path_tok = np.asarray(T.path_tokens(self.tree, self.paths[:, node]))
        for b in range(B):
            d = DEPTH[b, node]
            toks[b, 1:d + 1] = path_tok[b, :d]
        return toks

    def causal_call(self, tokens):
        """The causal call over ``tokens [B, NT]`` at positions ``lengths-1 ..`` (today's call)."""
        return self.call(tokens, (LENGTHS - 1)[:, None] + np.arange(NT), self.prefix)

    def autoregressive(self, tokens, steps):
        """Logits ``[B, steps, V]`` of feeding ``tokens[:, :steps]`` one at a time."""
        cache, out = self.prefix, []
        for k in range(steps):
            lg, cache = self.call(tokens[:, k:k + 1], (LENGTHS - 1 + k)[:, None], cache)
            out.append(lg[:, 0])
        return np.stack(out, axis=1), cache


_SETUPS: dict = {}


@pytest.fixture(params=CASES, ids=IDS)
def setup(request):
    if request.param not in _SETUPS:
        _SETUPS[request.param] = Setup(*request.param)
    return _SETUPS[request.param]


def _check(got, want, fmt, what):
    diff = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    if fmt == "float32":
        assert diff <= F32_TOL, f"{what}: max |Δ| = {diff:.2e}"
    else:
        assert diff == 0.0, f"{what}: not bit-identical in {fmt} (max |Δ| = {diff:.2e})"
    return diff


def test_tree_logits_equal_the_causal_path(setup):
    """(a) Every node's logits from ONE tree call == the causal call over its root → node path
    (same T, the path then garbage) and == feeding the path one token at a time: ≤ 1e-5 in
    float32, bit-identical in bfloat16 and int8 (the window of :func:`attention._tree_window` puts each
    query's ancestors where the causal call has them; the kernels are batch-invariant)."""
    tree_logits, _ = setup.tree_call()
    causal_root, _ = setup.causal_call(setup.path_tokens(0))
    _check(tree_logits[:, 0], causal_root[:, 0], setup.fmt, "root")
    ar, _ = setup.autoregressive(setup.path_tokens(int(np.argmax(DEPTH[0]))), 1)
    _check(tree_logits[:, 0], ar[:, 0], setup.fmt, "root vs one-token step")
    worst = 0.0
    for node in range(N):
        toks = setup.path_tokens(node)
        causal, _ = setup.causal_call(toks)
        d = DEPTH[:, node]
        steps = int(d.max()) + 1
        ar, _ = setup.autoregressive(toks, steps)
        for b in range(B):
            got = tree_logits[b, node + 1]
            worst = max(worst, _check(got, causal[b, d[b]], setup.fmt, f"row {b} node {node} vs causal block"))
            _check(got, ar[b, d[b]], setup.fmt, f"row {b} node {node} vs autoregressive")
    # not vacuous: siblings and different depths really differ
    assert np.abs(tree_logits[0, 1] - tree_logits[0, 2]).max() > 1e-2
    print(f"{setup.fmt}: max |tree - causal| = {worst:.2e}")


def test_chain_tree_is_the_causal_call(setup):
    """(c) A chain tree (every node the child of the previous) with the tree mask gives the same
    logits and cache, bit for bit, as today's contiguous causal call."""
    rng = np.random.default_rng(11)
    toks = rng.integers(0, setup.cfg.vocab_size, size=(B, NT))
    chain = T.DraftTree.create(toks[:, 1:], np.broadcast_to(np.arange(N) - 1, (B, N)),
                               np.broadcast_to(np.arange(N) + 1, (B, N)))
    pos = np.asarray(T.positions(chain, LENGTHS))
    assert np.array_equal(pos, (LENGTHS - 1)[:, None] + np.arange(NT))
    want, want_cache = setup.causal_call(toks)
    got, got_cache = setup.call(toks, pos, setup.prefix, T.block_attention_mask(chain))
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_compacted_cache_equals_the_causal_cache(setup):
    """(b) After the tree call, compacting any accepted path (every node's path, and n = 0) gives
    the cache of the causal call over that path at every slot < lengths + n, and the next call
    on it gives the causal logits: ≤ 1e-5 in float32, bit-identical in bfloat16 and int8."""
    _, tcache = setup.tree_call()
    compact = jax.jit(llama.compact_tree_cache)
    root_slot = jnp.asarray(LENGTHS - 1, jnp.int32)
    rng = np.random.default_rng(5)
    for node in list(range(N)) + [None]:
        if node is None:  # nothing accepted
            n = np.zeros(B, np.int32)
            path = np.full((B, setup.paths.shape[2]), -1, np.int32)
            toks = setup.path_tokens(0)
        else:
            n = DEPTH[:, node].astype(np.int32)
            path = setup.paths[:, node]
            toks = setup.path_tokens(node)
        got = compact(tcache, root_slot, jnp.asarray(path), jnp.asarray(n))
        _, want = setup.causal_call(toks)
        for b in range(B):
            live = LENGTHS[b] + n[b]  # slots 0 .. lengths+n-1: prefix, root, accepted path
            for layer, (gk, wk, gv, wv) in enumerate(zip(got.k, want.k, got.v, want.v)):
                for name, x, y in (("K", gk, wk), ("V", gv, wv)):
                    _check(np.asarray(x)[b, :, :live], np.asarray(y)[b, :, :live], setup.fmt,
                           f"node {node} row {b} layer {layer} {name}")
        # the next target call (the bonus token at position lengths + n) sees the same cache
        nxt = rng.integers(0, setup.cfg.vocab_size, size=(B, 1))
        pos = (LENGTHS + n)[:, None]
        a, _ = setup.call(nxt, pos, got)
        c, _ = setup.call(nxt, pos, want)
        _check(a, c, setup.fmt, f"node {node}: next call after compaction")


def test_compaction_of_a_chain_is_a_no_op():
    """A chain's path 0, 1, .., n-1 is already in place: the compaction is an identity copy."""
    cfg = tiny_model().config
    rng = np.random.default_rng(0)
    cache = llama.KVCache.create(cfg, B, MAXLEN)
    cache = llama.KVCache(k=[jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in cache.k],
                          v=[jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in cache.v],
                          lengths=cache.lengths)
    depth = 4
    n = np.array([4, 0, 2], np.int32)
    path = np.where(np.arange(depth)[None, :] < n[:, None], np.arange(depth)[None, :], -1).astype(np.int32)
    got = jax.jit(llama.compact_tree_cache)(cache, jnp.asarray(LENGTHS - 1 - 8), jnp.asarray(path), jnp.asarray(n))
    for a, b in zip(got.k + got.v, cache.k + cache.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a branching path does move slots (and only those of the accepted nodes)
    path2 = np.array([[2, 5, -1, -1], [-1] * 4, [1, 3, -1, -1]], np.int32)
    n2 = np.array([2, 0, 2], np.int32)
    root = LENGTHS - 1 - 8
    moved = jax.jit(llama.compact_tree_cache)(cache, jnp.asarray(root), jnp.asarray(path2), jnp.asarray(n2))
    k0, m0 = np.asarray(cache.k[0]), np.asarray(moved.k[0])
    for b in range(B):
        want = k0[b].copy()
        for k in range(n2[b]):
            want[:, root[b] + 1 + k] = k0[b, :, root[b] + 1 + path2[b, k]]
        np.testing.assert_array_equal(m0[b], want)


def _in_place_reduced_attention(q, k, v, positions, cfg, tree_mask):
    """Negative control: :func:`attention.cache_attention`'s reduced-format sums with the tree mask applied
    in the scratch layout (ancestors where the tree call wrote them, zeros between), i.e. WITHOUT
    the per-query window of :func:`attention._tree_window`."""
    b, t, h, hd = q.shape
    kv, blk = cfg.num_kv_heads, llama.ATTENTION_BLOCK
    nb = k.shape[2] // blk
    dt = jnp.bfloat16
    qg = q.reshape(b, t, kv, h // kv, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, (h // kv) * t, hd)
    kb, vb = k.reshape(b, kv, nb, blk, hd), v.reshape(b, kv, nb, blk, hd)
    sc = jnp.einsum("bkmd,bknsd->bknms", qg.astype(dt), kb.astype(dt), preferred_element_type=jnp.float32)
    sc = sc * (1.0 / math.sqrt(hd))
    vis = attention.tree_visible(tree_mask, positions[:, 0], h // kv, nb, blk)
    sc = jnp.where(vis, sc, -jnp.inf)
    m = jnp.max(sc, axis=(2, 4), keepdims=True)
    e = jnp.where(vis, jnp.exp(sc - m), 0.0).astype(dt)
    den = llama.pairwise_sum(llama.pairwise_sum(e.astype(jnp.float32), axis=-1), axis=2)
    part = jnp.einsum("bknms,bknsd->bknmd", e, vb.astype(dt), preferred_element_type=jnp.float32)
    out = llama.pairwise_sum(part, axis=2) / den[..., None]
    return out.reshape(b, kv, h // kv, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)


@pytest.mark.parametrize("q_dtype,cache_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                 ("float32", "bfloat16")])
def test_tree_attention_kernel_is_the_causal_kernel(q_dtype, cache_dtype):
    """The attention alone (float32 outputs, before any bf16 rounding of the next matmul hides a
    difference): tree attention of every node == causal attention over the cache laid out as the
    node's path. Reduced precision (bf16 dots: a bf16 query or cache) is bit-identical; float32
    ≤ 1e-6. Negative control: the same reduced sums with the mask applied in place (ancestors at
    their scratch slots) are NOT bit-identical — pairwise and per-block sums group the terms
    differently when zeros sit elsewhere — which is why :func:`attention._tree_window` exists."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tree = T.DraftTree.create(np.zeros((B, N), int), PARENTS, DEPTH)
    mask = T.block_attention_mask(tree)
    pos = np.asarray(T.positions(tree, LENGTHS))
    paths = np.asarray(T.node_paths(tree))
    q = jnp.asarray(rng.normal(size=(B, NT, h, hd)) * 3.0, q_dtype)
    k = rng.normal(size=(B, kv, MAXLEN, hd)).astype(cache_dtype)
    v = rng.normal(size=(B, kv, MAXLEN, hd)).astype(cache_dtype)
    reduced = q_dtype != "float32" or cache_dtype != "float32"
    tree_att = np.asarray(jax.jit(lambda *a: attention.cache_attention(*a, cfg, tree_mask=mask))(q, k, v, jnp.asarray(pos)))
    causal = jax.jit(lambda *a: attention.cache_attention(*a, cfg))
    in_place = None
    if reduced:
        in_place = np.asarray(jax.jit(lambda *a: _in_place_reduced_attention(*a, cfg, mask))(q, k, v, jnp.asarray(pos)))
    worst, control = 0.0, 0.0
    for node in range(N):
        kc, vc, qc = k.copy(), v.copy(), np.zeros(q.shape, q_dtype)
        for b in range(B):
            start, d = LENGTHS[b] - 1, DEPTH[b, node]
            slots = start + np.concatenate([[0], paths[b, node, :d] + 1])  # root, then the path's scratch slots
            kc[b, :, start:start + d + 1] = k[b][:, slots]
            vc[b, :, start:start + d + 1] = v[b][:, slots]
            qc[b, d] = np.asarray(q[b, node + 1])
        want = np.asarray(causal(jnp.asarray(qc), kc, vc, jnp.asarray((LENGTHS - 1)[:, None] + np.arange(NT))))
        for b in range(B):
            got = tree_att[b, node + 1]
            ref = want[b, DEPTH[b, node]]
            worst = max(worst, float(np.abs(got - ref).max()))
            if in_place is not None:
                control = max(control, float(np.abs(in_place[b, node + 1] - ref).max()))
    if reduced:
        assert worst == 0.0, f"tree attention not bit-identical to the causal path (max |Δ| = {worst:.2e})"
        assert control > 0.0, "negative control: in-place sums were expected to round differently"
    else:
        assert worst <= 1e-6, f"max |Δ| = {worst:.2e}"


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_greedy_tree_rounds_equal_autoregressive(fmt):
    """The pieces as a decode loop would use them (a host-side loop; runtime/loop.py is not
    changed here): per round ONE tree call over ``[last committed, tree...]`` at
    ``positions(tree, lengths)``, :func:`specjax.core.tree.verify_tree_greedy`, commit the path and
    the target's next token, :func:`llama.compact_tree_cache`, ``lengths += n + 1``. Ragged rows,
    trees that hold the true continuation on a random branch, cut at a random depth (partial and
    full acceptance, and rounds with nothing accepted). The tokens equal the Decoder's
    autoregressive greedy tokens in every format (bit-identical logits in bfloat16 and int8)."""
    from specjax.runtime import decoder as decode

    base = tiny_model(seed=3, scale=4.0)
    g, p = assemble_params(base.config, float_tensors(base), fmt, source="convert")
    target = base.replace(graphdef=g, params=p, dtype=fmt)
    cfg, v = target.config, target.config.vocab_size
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]
    max_new = 24
    ar = decode.Decoder(target).generate(prompts, max_new_tokens=max_new, eos_ids=[]).tokens
    rows = len(prompts)
    parents = np.broadcast_to(PARENTS[0], (rows, N))
    depth = np.broadcast_to(DEPTH[0], (rows, N))
    leaf_paths = np.asarray(T.node_paths(T.DraftTree.create(np.zeros((rows, N), int), parents, depth)))

    step = jax.jit(lambda params, tok, pos, cache, mask: llama.apply(g, params, tok, pos, cache, cfg,
                                                                     tree_mask=mask))
    compact = jax.jit(llama.compact_tree_cache)
    width = max(map(len, prompts))
    seq = np.zeros((rows, MAXLEN), np.int64)
    for b, pr in enumerate(prompts):
        seq[b, :len(pr)] = pr
    lengths = np.array([len(pr) for pr in prompts])
    cache = llama.KVCache.create(cfg, rows, MAXLEN)
    _, cache = llama.forward(g, p, jnp.asarray(seq[:, :width], jnp.int32),
                             jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width)), cache, cfg)
    rng = np.random.default_rng(3)
    accepted = []
    while np.any(lengths - np.array([len(pr) for pr in prompts]) < max_new):
        tokens = rng.integers(0, v, size=(rows, N))
        for b in range(rows):  # the true continuation on one branch, up to a random depth
            new = lengths[b] - len(prompts[b])
            truth = ar[b][new:]
            node = rng.integers(N) if rng.random() < 0.5 else N - 1  # node N-1 is the deepest
            cut = rng.integers(0, DEPTH[0, node] + 1) if rng.random() < 0.5 else DEPTH[0, node]
            for k, nd in enumerate(leaf_paths[b, node, :DEPTH[0, node]]):
                if k < min(cut, len(truth)):
                    tokens[b, nd] = truth[k]
        tree = T.DraftTree.create(tokens, parents, depth)
        root = seq[np.arange(rows), lengths - 1]
        inp = np.concatenate([root[:, None], tokens], axis=1)
        out = step(p, jnp.asarray(inp, jnp.int32), T.positions(tree, lengths), cache, T.block_attention_mask(tree))
        acc = T.verify_tree_greedy(tree, out.logits)
        n = np.asarray(acc.n)
        path_tok = np.asarray(T.path_tokens(tree, acc.path))
        cache = compact(out.cache, jnp.asarray(lengths - 1, jnp.int32), acc.path, acc.n)
        for b in range(rows):
            chunk = list(path_tok[b, :n[b]]) + [int(acc.next_token[b])]
            seq[b, lengths[b]:lengths[b] + len(chunk)] = chunk
        lengths = lengths + n + 1
        accepted.extend(n.tolist())
    for b, pr in enumerate(prompts):
        got = seq[b, len(pr):len(pr) + max_new].tolist()
        assert got == ar[b][:max_new], f"{fmt} row {b}: tree rounds {got} != autoregressive {ar[b][:max_new]}"
    assert max(accepted) >= 3 and min(accepted) == 0, accepted  # deep acceptances and rejections happened
