"""Attention and the KV cache: :class:`KVCache` (per-row lengths), causal and tree attention over
the cache in batch-invariant blocks (:func:`cache_attention`; trees: :func:`tree_visible` in
float32, the per-query window :func:`_tree_window` in the reduced formats), and the compaction
of an accepted tree path (:func:`compact_tree_cache`).

The decoder block (:func:`specjax.models.llama.decoder_block`, which gives the tree-mask
contract) writes its K/V and calls :func:`cache_attention`; every public name here is re-exported by
:mod:`specjax.models.llama`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from specjax.models import cpu_attention
from specjax.models.config import ModelConfig
from specjax.models.ops import pairwise_max, pairwise_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value cache with per-row lengths (a pytree).

    Attributes:
      k, v: one array per layer, each ``[batch, kv_heads, max_len, head_dim]``.
        Slot ``s`` of row ``b`` holds the key/value of that row's token at position ``s``.
      lengths: ``[batch]`` int32, committed tokens per row. Entries at slots ≥ length
        are stale and never read: a query at position t only sees slots ≤ t, and every
        slot < t was written before. Rolling back is only lowering ``lengths``.
    """

    k: list
    v: list
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(
            k=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            v=[jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)],
            lengths=jnp.zeros((batch,), jnp.int32),
        )


def compact_tree_cache(
    cache: KVCache,
    root_slot: Int[Array, "batch"],
    path: Int[Array, "batch depth"],
    n: Int[Array, "batch"],
) -> KVCache:
    """Move the K/V of an accepted tree path to contiguous slots after a tree call (pure, jittable).

    A tree call (:func:`specjax.models.llama.forward` with ``tree_mask``) over ``[root, node_0 .. node_{N-1}]`` wrote
    node i's K/V at the scratch slot ``root_slot + 1 + i``, but node i's position is
    ``root_slot + depth_i``. After acceptance of the path ``path[b, :n[b]]`` (node ids root →
    leaf, as :func:`specjax.core.tree.verify_tree` returns them), the committed sequence needs
    the K/V of the path's k-th node at slot ``root_slot + 1 + k`` (slot = position again): this
    copies, per row and for every layer's K and V,
    ``slot root_slot + 1 + k  ←  slot root_slot + 1 + path[k]`` for ``k < n`` (the root's K/V
    is already at ``root_slot``). All sources are read before anything is written
    (``path[k] >= k``, so sources and destinations overlap). Slots ``root_slot + 1 + k`` for
    ``k >= n`` keep their values, so a chain (``path = 0, 1, .., n-1``) is an identity copy and
    ``n = 0`` changes nothing. The accepted path's tree-call K/V are those of the causal call
    over the path (see :func:`specjax.models.llama.decoder_block`), so the compacted cache is the causal cache.

    Miao et al. 2024 (SpecInfer) and Li et al. 2024 (EAGLE-2) keep the accepted path's KV the
    same way (a gather of the accepted indices into the contiguous cache).

    Args:
      cache: the cache after the tree call (any dtype; ``lengths`` is returned unchanged: the
        caller commits, e.g. ``lengths + n`` with this module's convention that the cache holds
        positions ``0 .. committed - 2``).
      root_slot: int32 ``[B]``, the slot (= position) of the root, ``positions[:, 0]`` of the
        tree call (``lengths - 1`` in the decode loop's convention).
      path: int32 ``[B, D]`` accepted node ids, -1 padded (entries ``>= n`` are ignored).
      n: int32 ``[B]`` accepted nodes per row (0 .. D).

    Returns:
      The cache with the path's K/V at slots ``root_slot + 1 .. root_slot + n``. The caller
      guarantees ``root_slot + 1 + D <= max_len`` (the tree call's ``N + 1`` slots fit, and
      ``D <= N``), else ``dynamic_update_slice`` would clamp the write.
    """
    path = jnp.asarray(path, jnp.int32)
    root_slot = jnp.asarray(root_slot, jnp.int32)
    depth = path.shape[1]
    k = jnp.arange(depth, dtype=jnp.int32)[None, :]
    node = jnp.where(k < jnp.asarray(n, jnp.int32)[:, None], path, k)  # identity beyond n
    src = root_slot[:, None] + 1 + node  # [B, D]

    def move(arr):  # [B, KV, S, hd]
        src_c = jnp.clip(src, 0, arr.shape[2] - 1)
        rows = jax.vmap(lambda a, s: a[:, s, :])(arr, src_c)  # [B, KV, D, hd]
        return jax.vmap(lambda a, r, s0: jax.lax.dynamic_update_slice(a, r, (0, s0, 0)))(arr, rows, root_slot + 1)

    return KVCache(k=[move(a) for a in cache.k], v=[move(a) for a in cache.v], lengths=cache.lengths)


def kv_cache_dtype(weight_format: str, backend: str | None = None) -> str:
    """KV-cache dtype for a weight format: bfloat16 caches for bfloat16 weights on GPU/TPU;
    float32 otherwise (XLA CPU has no fast batched bf16 attention dot). ``backend``: the
    platform the program is for (``"cpu"``, ``"gpu"``, ``"tpu"``; default JAX's default backend;
    ``specjax plan`` compiles on CPU for an accelerator)."""
    backend = jax.default_backend() if backend is None else backend
    if weight_format == "bfloat16" and backend != "cpu":
        return "bfloat16"
    return "float32"


def write_kv(cache_arr, new, starts):
    """Write ``new [B, KV, T, hd]`` into ``cache_arr [B, KV, S, hd]`` at per-row slot ``starts [B]``."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (0, s, 0)))(
        cache_arr, new, starts
    )


ATTENTION_BLOCK = 64  # cache slots per attention block (a multiple of the Decoder's buffer bucket)


def tree_visible(tree_mask, start, groups: int, nb: int, blk: int):
    """Tree attention's visibility in the physical cache layout (the float32 path of
    :func:`cache_attention`): bool ``[B, 1, NB, G·T, blk]``, query j (row ``g·T + j``) sees slot s iff
    ``s < start`` (the committed prefix) or ``0 <= s - start < T`` and ``tree_mask[:, j, s - start]``.

    For a chain (``tree_mask`` lower triangular) this is exactly the causal ``s <= start + j``, so
    the call is the causal call, bit for bit. For a branching tree the ancestors of a node sit at
    scratch slots that are not contiguous, so its sums add the same terms as the causal call over
    its path but with the exact zeros in other places (float32 rounding, ≈ 1e-7).

    Args: ``tree_mask [B, T, T]`` bool, ``start [B]`` int32 (slot of the first new token),
    ``groups`` G = query heads per KV head, ``nb`` blocks of ``blk`` slots.
    """
    b, t, _ = tree_mask.shape
    rel = jnp.arange(nb * blk, dtype=jnp.int32)[None, :] - start[:, None]  # [B, S]
    inside = (rel >= 0) & (rel < t)
    among = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, nb * blk)),
                                axis=2)  # [B, T, S]: tree_mask[b, j, s - start]
    vis = (rel < 0)[:, None, :] | (inside[:, None, :] & among)
    vis = jnp.broadcast_to(vis[:, None], (b, groups, t, nb * blk)).reshape(b, groups * t, nb, blk)
    return vis.transpose(0, 2, 1, 3)[:, None]


def _tree_slot_positions(positions, nb: int, blk: int):
    """The position of each cache slot during a tree call, ``[B, 1, NB, 1, blk]``: the slot itself,
    except the new tokens' scratch slots ``start + i`` (``start = positions[:, 0]``), which hold
    node i at ``positions[:, i]`` (the root's position + its depth)."""
    b, t = positions.shape
    start = positions[:, 0]
    s = jnp.arange(nb * blk, dtype=jnp.int32)[None, :]
    rel = s - start[:, None]
    node = jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1)
    pos = jnp.where((rel >= 0) & (rel < t), node, s)  # [B, S]
    return pos.reshape(b, 1, nb, 1, blk)


class _TreeWindow:
    """The blocks of :func:`cache_attention` that hold new tokens, per query, in the causal layout of
    that query's path (built by :func:`_tree_window`; the reduced-format tree path).

    ``outside [B, NB, blk]``: prefix slots NOT in the window (the shared computation's mask);
    ``scores [B·T, KV, NW, G, blk]`` float32 (masked: -inf) and ``v [B·T, KV, NW, blk, hd]`` (dt)
    per query; ``w0 [B]`` the first window block; ``dims = (B, T, G)``.
    """

    def __init__(self, outside, scores, v, w0, dims):
        self.outside, self.scores, self.v, self.w0, self.dims = outside, scores, v, w0, dims

    def max(self):
        """The window's score maximum per query, ``[B, KV, 1, G·T, 1]`` (-inf if none visible)."""
        b, t, g = self.dims
        mw = pairwise_max(pairwise_max(self.scores, axis=-1), axis=2)  # [B·T, KV, G] (exact)
        return mw.reshape(b, t, -1, g).transpose(0, 2, 3, 1).reshape(b, -1, 1, g * t, 1)

    def add_to(self, block_sums, part, m):
        """Add the window's per-block softmax sums and value sums (``exp(score - m)``, ``m [B, KV,
        1, G·T, 1]`` the global maximum) into the shared ``block_sums [B, KV, NB, G·T]`` and
        ``part [B, KV, NB, G·T, hd]`` at the window's blocks, where the shared ones are exact zeros
        (so the sums are the window's, bit for bit)."""
        b, t, g = self.dims
        kv = block_sums.shape[1]
        dt = self.v.dtype
        mq = m.reshape(b, kv, g, t).transpose(0, 3, 1, 2).reshape(b * t, kv, 1, g, 1)
        e = jnp.where(self.scores > -jnp.inf, jnp.exp(self.scores - mq), 0.0).astype(dt)
        sums = pairwise_sum(e.astype(jnp.float32), axis=-1)  # [B·T, KV, NW, G]
        vals = jnp.einsum("bknms,bknsd->bknmd", e, self.v, preferred_element_type=jnp.float32)
        nw = sums.shape[2]
        sums = sums.reshape(b, t, kv, nw, g).transpose(0, 2, 3, 4, 1).reshape(b, kv, nw, g * t)
        vals = vals.reshape(b, t, kv, nw, g, -1).transpose(0, 2, 3, 4, 1, 5).reshape(b, kv, nw, g * t, -1)

        def place(shared, win):
            at = lambda z, w, s: jax.lax.dynamic_update_slice(z, w, (0, s) + (0,) * (z.ndim - 2))
            return shared + jax.vmap(at)(jnp.zeros_like(shared), win, self.w0)

        return place(block_sums, sums), place(part, vals)


def _tree_window(scores, v_cache, positions, tree_mask, blk: int, dt, window: int | None = None) -> _TreeWindow:
    """Tree attention in the reduced formats, bit-identical to the causal call over each node's
    path (the property the batch-invariant kernels give the chain; docs/design.md).

    The new tokens' K/V sit at scratch slots ``start + i`` (``start = positions[:, 0]``, the
    root), so the ancestors of a deep node are not contiguous; summing in place would add the
    same terms with the zeros elsewhere, which rounds differently. Instead the NW blocks that
    hold ``start .. start + T - 1`` (the *window*) are rebuilt per query j in the layout of the
    causal call over j's path: slot ``start + k`` holds j's ancestor at depth ``k`` (``k <=
    depth_j = positions[:, j] - start``), prefix slots stay, later slots are masked. The scores
    are gathered from the shared ``scores`` (each one dot over ``hd``), the values per query;
    the value sums use the einsum of a one-token decode step (batch B·T, M = G rows), and the
    per-block sums replace the shared computation's window blocks before the cross-block
    :func:`pairwise_sum`. Cost: ``T · NW · blk`` gathered V slots per KV head and layer
    (NW ≤ 2 for T ≤ 65).

    Args:
      scores: ``[B, KV, NB, G·T, blk]`` float32 unmasked scores of every query (row ``g·T + j``)
        against every slot.
      v_cache: ``[B, KV, S, hd]`` with the new V written, ``S = NB · blk``.
      positions: ``[B, T]`` int32; ``positions[:, 0]`` is the root's slot and position.
      tree_mask: ``[B, T, T]`` bool, ancestors-or-self (one ancestor per depth < depth_j).
      dt: the dtype of the value einsum's inputs (bfloat16).
      window: a sliding window W: query j also needs position > ``positions[:, j]`` − W (in the
        rebuilt layout a slot's position is the slot).
    """
    b, kv, nb, gt, _ = scores.shape
    hd = v_cache.shape[-1]
    t = tree_mask.shape[1]
    g = gt // t
    nw = min(nb, (blk + t - 2) // blk + 1)  # blocks touched by T slots from any offset
    start = positions[:, 0]
    depth = positions - start[:, None]  # [B, T]
    w0 = jnp.clip(start // blk, 0, nb - nw)  # the caller leaves start + T <= S
    slot = w0[:, None] * blk + jnp.arange(nw * blk, dtype=jnp.int32)[None, :]  # [B, W] window slots
    rel = slot - start[:, None]
    # anc[b, j, k]: the new token that is j's ancestor at depth k (argmax of one True; 0 if none)
    at_depth = depth[:, None, :, None] == jnp.arange(t, dtype=jnp.int32)[None, None, None, :]
    anc = jnp.argmax(tree_mask[:, :, :, None] & at_depth, axis=2).astype(jnp.int32)  # [B, T, T]
    on_path = (rel[:, None, :] >= 0) & (rel[:, None, :] <= depth[:, :, None])  # [B, T, W]
    src_rel = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, nw * blk)), axis=2)
    src = jnp.where(on_path, start[:, None, None] + src_rel, slot[:, None, :])  # [B, T, W] physical slots
    src = jnp.clip(src, w0[:, None, None] * blk, (w0[:, None, None] + nw) * blk - 1)
    visible = (rel[:, None, :] < 0) | on_path  # [B, T, W]
    if window is not None:
        visible = visible & (slot[:, None, :] > positions[:, :, None] - window)

    by_query = scores.transpose(0, 1, 3, 2, 4).reshape(b, kv, g, t, nb * blk)
    sw = jnp.take_along_axis(by_query, jnp.broadcast_to(src[:, None, None], (b, kv, g, t, nw * blk)), axis=4)
    sw = sw.transpose(0, 3, 1, 2, 4).reshape(b * t, kv, g, nw, blk).transpose(0, 1, 3, 2, 4)  # [B·T, KV, NW, G, blk]
    sw = jnp.where(visible.reshape(b * t, 1, nw, 1, blk), sw, -jnp.inf)

    win = jax.vmap(lambda c, s: jax.lax.dynamic_slice(c, (0, s, 0), (kv, nw * blk, hd)))(v_cache, w0 * blk)
    local = src - (w0 * blk)[:, None, None]
    vw = jax.vmap(lambda c, i: c[:, i, :])(win.astype(dt), local)  # [B, KV, T, W, hd]
    vw = vw.transpose(0, 2, 1, 3, 4).reshape(b * t, kv, nw, blk, hd)
    block = jnp.arange(nb, dtype=jnp.int32)[None, :]
    in_window = (block >= w0[:, None]) & (block < (w0 + nw)[:, None])  # [B, NB]
    prefix = jnp.arange(nb * blk, dtype=jnp.int32).reshape(1, nb, blk) < start[:, None, None]
    outside = prefix & ~in_window[:, :, None]
    return _TreeWindow(outside, sw, vw, w0, (b, t, g))


def _block_scores(qg, kb, dt, cfg: ModelConfig, out: str = "bknms"):
    """Scores of the queries ``qg [B, KV, M, hd]`` against the key blocks ``kb [B, KV, N, blk, hd]``:
    float32 ``[B, KV, N, M, blk]`` (``out="bkmns"``: ``[B, KV, M, N, blk]``, the dot's own order, no
    transpose; the same values), scaled and soft-capped (one dot over ``hd`` each, inputs in ``dt``)."""
    scores = jnp.einsum("bkmd,bknsd->" + out, qg.astype(dt), kb.astype(dt),
                        preferred_element_type=jnp.float32) * cfg.attention_scale()
    if cfg.attn_logit_softcapping is not None:
        cap = cfg.attn_logit_softcapping
        scores = jnp.tanh(scores / cap) * cap
    return scores


def _span_attention(qg, k_cache, v_cache, qpos, positions, cfg: ModelConfig, span: int, dt, window=None):
    """Causal attention that reads only the key spans a query can see (``key_span`` of
    :func:`cache_attention`): float32 ``[B, KV, M, hd]`` for ``qg [B, KV, M, hd]`` (M = G·T, row
    ``g·T + j``) at positions ``qpos [B, 1, 1, M, 1]``, over ``k_cache``/``v_cache [B, KV, S, hd]``.

    The cache is cut into spans of ``span`` slots (``span / ATTENTION_BLOCK`` blocks, a power of two);
    two loops over the spans ``lo .. n - 1`` that hold a visible slot (``n`` from the largest position,
    ``lo`` from a sliding ``window``) compute, per span, the same block scores, mask and ``exp`` as the
    whole-cache computation: the first the exact maximum, the second each span's softmax and value sums
    over its blocks (the first levels of the blocks' :func:`pairwise_sum`, whose pairs never cross an
    aligned power-of-two group). The span sums go into a zero ``[.., S // span, ..]`` array whose
    :func:`pairwise_sum` is then the whole cache's (the skipped spans are exact zeros there), so the
    output equals the whole cache's bit for bit, at a cost that follows the visible keys (a prefill
    chunk of a long prompt: its own and the earlier chunks). The scores are computed twice (once per
    loop) rather than stored: no ``[S, M]`` array at all; they stay in the dot's ``[.., M, blocks,
    blk]`` order (the sums and maxima per query are the same, the transpose is gone: 35 % faster).
    """
    b, kv, m, hd = qg.shape
    blk = ATTENTION_BLOCK
    per, nsp = span // blk, k_cache.shape[2] // span
    assert span % blk == 0 and per & (per - 1) == 0 and nsp >= 1, (span, k_cache.shape)
    n = jnp.minimum(jnp.max(positions) // span + 1, nsp)
    lo = 0 if window is None else jnp.clip((jnp.min(positions) - window + 1) // span, 0, n)
    qpos = qpos.reshape(b, 1, m, 1, 1)

    def span_scores(j):
        ks = jax.lax.dynamic_slice_in_dim(k_cache, j * span, span, axis=2).reshape(b, kv, per, blk, hd)
        slots = (j * span + jnp.arange(span, dtype=jnp.int32)).reshape(1, 1, 1, per, blk)
        visible = slots <= qpos  # [B, 1, M, per, blk]
        if window is not None:
            visible = visible & (slots > qpos - window)
        return jnp.where(visible, _block_scores(qg, ks, dt, cfg, "bkmns"), -jnp.inf), visible

    def span_max(j, mx):
        return jnp.maximum(mx, pairwise_max(pairwise_max(span_scores(j)[0], axis=-1), axis=-1)[..., None, None])

    mx = jax.lax.fori_loop(lo, n, span_max, jnp.full((b, kv, m, 1, 1), -jnp.inf, jnp.float32))

    def span_sums(j, acc):
        sums, part = acc
        scores, visible = span_scores(j)
        e = jnp.where(visible, jnp.exp(scores - mx), 0.0).astype(dt)
        vs = jax.lax.dynamic_slice_in_dim(v_cache, j * span, span, axis=2).reshape(b, kv, per, blk, hd)
        s_j = pairwise_sum(pairwise_sum(e.astype(jnp.float32), axis=-1), axis=-1)  # [B, KV, M]
        p_j = pairwise_sum(jnp.einsum("bkmns,bknsd->bknmd", e, vs.astype(dt), preferred_element_type=jnp.float32),
                           axis=2)  # [B, KV, M, hd]
        return (jax.lax.dynamic_update_index_in_dim(sums, s_j, j, axis=2),
                jax.lax.dynamic_update_index_in_dim(part, p_j, j, axis=2))

    sums, part = jax.lax.fori_loop(lo, n, span_sums, (jnp.zeros((b, kv, nsp, m), jnp.float32),
                                                       jnp.zeros((b, kv, nsp, m, hd), jnp.float32)))
    return pairwise_sum(part, axis=2) / pairwise_sum(sums, axis=2)[..., None]


def reads_visible_keys_only(cache_dtype, head_dim: int) -> bool:
    """Whether :func:`cache_attention` over a cache of ``cache_dtype`` with heads of ``head_dim``, traced
    now, runs the CPU kernel (:mod:`specjax.models.cpu_attention`: a float32 cache, ``head_dim`` ≤
    :data:`~specjax.models.cpu_attention.MAX_HEAD_DIM`, the kernel enabled here), whose cost follows
    each query's visible keys whatever the buffer — so the decode loop needs no attention views
    (:func:`specjax.runtime.decoder.attention_views`) — rather than the blocked path, which reads the
    whole cache (or ``kv_view``) it is given."""
    return (jnp.dtype(cache_dtype) == jnp.float32 and int(head_dim) <= cpu_attention.MAX_HEAD_DIM
            and cpu_attention.enabled())


def cache_attention(q, k_cache, v_cache, positions, cfg: ModelConfig, tree_mask=None, window: int | None = None,
                    key_span: int | None = None, kv_view: int | None = None):
    """Causal GQA attention of ``q [B, T, H, hd]`` over this row's cache ``[B, KV, S, hd]``:
    the query at position t sees slots ≤ t (and with a sliding ``window`` W only slots > t − W,
    transformers' rule; a tree node's window counts from its own position). Scores are scaled by
    :meth:`~specjax.models.config.ModelConfig.attention_scale` and soft-capped with
    ``cfg.attn_logit_softcapping`` (Gemma 2) before the mask. Returns float32 ``[B, T, H·hd]``.

    With ``tree_mask`` (bool ``[B, T, T]``, see :func:`specjax.models.llama.decoder_block`): tree attention — query j
    sees the committed prefix (slots < ``positions[:, 0]``) and the new tokens i with
    ``tree_mask[:, j, i]`` (its ancestors and itself), whose K/V sit at slots
    ``positions[:, 0] + i``; see :func:`tree_visible` (float32) and :func:`_tree_window`
    (reduced formats) for how that is computed without breaking batch invariance.

    On one CPU device this is one kernel (:mod:`specjax.models.cpu_attention`: per-query arithmetic,
    float32 in every format, cost following each query's visible keys); elsewhere the blocked jnp
    computation below (``SPECJAX_ATTENTION=xla`` forces it on CPU).

    Batch-invariant by construction (docs/design.md, "Batch invariance"): the cache is read in
    blocks of :data:`ATTENTION_BLOCK` slots, so each dot contracts a fixed length (``hd`` for
    the scores, 64 slots for the values) whatever ``S``, ``T`` or ``B`` is; the softmax max is
    exact, its normalizer and the per-block value sums are combined with :func:`pairwise_sum`
    (masked slots contribute exact zeros, so a longer buffer changes nothing). In the reduced
    weight formats the dots take bfloat16 inputs with float32 accumulation (the products are
    exact in float32, and XLA CPU's kernel sums them in an order that does not depend on the
    number of rows: measured, and checked by tests/test_batch_invariance.py); in float32 they are
    float32 dots, whose kernels do round differently for different row counts (≈ 1e-6).

    ``kv_view`` (static): every query's visible slots lie in the first ``kv_view`` slots; the blocked
    computation reads only those (the decode loop's attention views,
    :meth:`specjax.runtime.decoder.Decoder.run`), the kernel reads each query's own keys whatever the
    view (slicing the cache for it would copy the slices: measured 22 instead of 42 tokens/s at a
    4,224-slot buffer). The result is the same either way.

    ``key_span`` (causal calls only; a static multiple of :data:`ATTENTION_BLOCK` by a power of two,
    the prefill's chunk): read only the spans of ``key_span`` slots that hold a visible slot, and skip
    the rest, which a causal chunk of a long prompt cannot see (:func:`_span_attention`; the result is
    the whole cache's, bit for bit). Every visible slot must lie in the cache's first
    ``(S // key_span) · key_span`` slots.
    """
    if k_cache.dtype == v_cache.dtype and reads_visible_keys_only(k_cache.dtype, q.shape[-1]):
        return _kernel_attention(q, k_cache, v_cache, positions, tree_mask, cfg, window)  # no view to cut: a copy
    if kv_view is not None:
        k_cache, v_cache = k_cache[:, :, :kv_view], v_cache[:, :, :kv_view]
    return _blocked_attention(q, k_cache, v_cache, positions, cfg, tree_mask, window, key_span)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _kernel_attention(q, k_cache, v_cache, positions, tree_mask, cfg: ModelConfig, window):
    """The CPU kernel (:func:`specjax.models.cpu_attention.attend`); its gradient (a drafter's
    training through the cache) is the blocked computation's, the same function up to rounding."""
    return cpu_attention.attend(q, k_cache, v_cache, positions, cfg.attention_scale(), cfg.attn_logit_softcapping,
                                tree_mask, window)


def _kernel_attention_fwd(q, k_cache, v_cache, positions, tree_mask, cfg, window):
    return _kernel_attention(q, k_cache, v_cache, positions, tree_mask, cfg, window), (
        q, k_cache, v_cache, positions, tree_mask)


def _kernel_attention_bwd(cfg, window, res, g):
    q, k_cache, v_cache, positions, tree_mask = res
    _, vjp = jax.vjp(lambda a, b, c: _blocked_attention(a, b, c, positions, cfg, tree_mask, window), q, k_cache, v_cache)
    return (*vjp(g), None, None)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def _blocked_attention(q, k_cache, v_cache, positions, cfg: ModelConfig, tree_mask=None, window: int | None = None,
                       key_span: int | None = None):
    """:func:`cache_attention` as blocked jnp computations (its docstring: every backend without the
    CPU kernel)."""
    b, t, h, hd = q.shape
    kv, s = cfg.num_kv_heads, k_cache.shape[2]
    blk = ATTENTION_BLOCK
    pad = (-s) % blk
    if pad:  # only for caches not built by the Decoder (its buffers are multiples of the block)
        k_cache = jnp.pad(k_cache, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v_cache = jnp.pad(v_cache, ((0, 0), (0, 0), (0, pad), (0, 0)))
    nb = (s + pad) // blk
    dt = jnp.float32 if k_cache.dtype == jnp.float32 and q.dtype == jnp.float32 else jnp.bfloat16
    qg = q.reshape(b, t, kv, h // kv, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv, (h // kv) * t, hd)
    qpos = jnp.broadcast_to(positions[:, None, :], (b, h // kv, t)).reshape(b, 1, 1, (h // kv) * t, 1)
    if key_span is not None and tree_mask is None:
        return _span_attention(qg, k_cache, v_cache, qpos, positions, cfg, key_span, dt, window).reshape(
            b, kv, h // kv, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)
    kb = k_cache.reshape(b, kv, nb, blk, hd)
    vb = v_cache.reshape(b, kv, nb, blk, hd)
    scores = _block_scores(qg, kb, dt, cfg)
    slots = jnp.arange(nb * blk, dtype=jnp.int32).reshape(nb, 1, blk)
    tw = None
    if tree_mask is None:
        visible = slots[None, None] <= qpos  # [B, 1, NB, G·T, blk]
    elif dt == jnp.float32:
        visible = tree_visible(tree_mask, positions[:, 0], h // kv, nb, blk)
    else:  # the prefix outside the tree window here; the tree window's blocks per query (_tree_window)
        tw = _tree_window(scores, v_cache, positions, tree_mask, blk, dt, window)
        visible = tw.outside[:, None, :, None, :]  # [B, 1, NB, 1, blk]
    if window is not None:  # a slot's position is the slot, except a tree's new tokens (float32 path)
        slot_pos = slots[None, None]
        if tree_mask is not None and tw is None:
            slot_pos = _tree_slot_positions(positions, nb, blk)
        visible = visible & (slot_pos > qpos - window)
    scores = jnp.where(visible, scores, -jnp.inf)
    # exact; the query's own slot is always visible. Not jnp.max: see pairwise_max (the exp below
    # must not land in a library fusion in one program and not in another)
    m = pairwise_max(pairwise_max(scores, axis=-1), axis=2)[:, :, None, :, None]  # [B, KV, 1, G·T, 1]
    if tw is not None:
        m = jnp.maximum(m, tw.max())
    e = jnp.where(visible, jnp.exp(scores - m), 0.0).astype(dt)
    if tw is None:
        denom = pairwise_sum(pairwise_sum(e.astype(jnp.float32), axis=-1), axis=2)  # [B, KV, G·T]
        part = jnp.einsum("bknms,bknsd->bknmd", e, vb.astype(dt), preferred_element_type=jnp.float32)
    else:  # per block: the blocks outside the window, plus the window's (exact zeros elsewhere)
        block_sums, part = tw.add_to(
            pairwise_sum(e.astype(jnp.float32), axis=-1),
            jnp.einsum("bknms,bknsd->bknmd", e, vb.astype(dt), preferred_element_type=jnp.float32), m)
        denom = pairwise_sum(block_sums, axis=2)
    out = pairwise_sum(part, axis=2) / denom[..., None]  # [B, KV, G·T, hd]
    return out.reshape(b, kv, h // kv, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)
