"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX, with a
per-row KV cache.

The module is defined with Flax NNX and split once (:func:`abstract_model`);
everything that runs is a pure function of ``(graphdef, params, ...)``
(:func:`apply`), so parameters and caches are plain pytrees that ``jit``, ``vmap``,
sharding and optax all understand.

The weights are declared once, in :data:`specjax.models.weights.WEIGHTS`.

Layout choices, measured on XLA CPU (see PERFORMANCE-NOTES): one array per layer
(not a stacked ``[layers, ...]`` array) with the layer loop unrolled in Python;
projection weights stored ``[in, out]``, with the query/key/value projections fused into
one ``w_qkv [D, KV, G + 2, hd]`` and gate/up into one ``w_gate_up [D, 2, F]`` (two matmuls
instead of five per block: fewer ops for GPU/TPU, where a decode step is op-count bound;
on XLA CPU fused and split time the same within noise); a tied LM head applied with an
``einsum`` over the untransposed ``[vocab, hidden]`` embedding (``embed.T`` copied 113 MB
per call); KV cache ``[batch, kv_heads, max_len, head_dim]`` per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.models import weights
from specjax.models.config import ModelConfig
from specjax.models.weights import (  # noqa: F401  (the table's functions, re-exported)
    FORMAT_DEFINITION, WEIGHT_FORMATS, Part, WeightSpec, checkpoint_names, fuse, init_weight, layer_weights,
    matmul_weights, num_params, param_logical_axes, part_of, quantize_int8, split, storage_dtype, weight_spec,
)


def _add_weight(module, spec: WeightSpec, cfg: ModelConfig, fmt: str, rngs: nnx.Rngs) -> None:
    """Set ``module.<name>`` (and its int8 ``<name>_scale``) to a new weight in format ``fmt``."""
    w = init_weight(spec, cfg, rngs.params)
    if spec.quant_axis is not None and fmt == "int8":
        q, s = quantize_int8(w, spec.quant_axis)
        setattr(module, spec.name, nnx.Param(q))
        setattr(module, spec.name + "_scale", nnx.Param(s))
        return
    dtype = storage_dtype(fmt) if spec.quant_axis is not None else (jnp.bfloat16 if fmt == "bfloat16" else jnp.float32)
    setattr(module, spec.name, nnx.Param(w.astype(dtype)))


class Block(nnx.Module):
    """One pre-norm decoder block: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP.

    Its parameters are the per-layer entries of :data:`specjax.models.weights.WEIGHTS` that
    ``cfg`` has. Matmul weights are stored ``[in, *out]``; in the int8 format each has a
    float32 per-output-channel ``<name>_scale`` (shape ``out``).
    """

    def __init__(self, cfg: ModelConfig, fmt: str, rngs: nnx.Rngs):
        for spec in layer_weights(cfg):
            _add_weight(self, spec, cfg, fmt, rngs)


class Transformer(nnx.Module):
    """Parameters of a Llama-family decoder (the entries of
    :data:`specjax.models.weights.WEIGHTS` that ``cfg`` has).
    Call it through :func:`apply`.

    ``fmt``: weight format — ``float32``; ``bfloat16`` (bf16 weights, float32
    accumulation); ``int8`` (per-channel int8 weights × per-row int8 activations,
    int32 accumulation; norms, biases and scales float32).
    """

    def __init__(self, cfg: ModelConfig, *, fmt: str = "float32", rngs: nnx.Rngs):
        storage_dtype(fmt)  # validates
        table = weights.WEIGHTS
        first_layer = next((k for k, s in enumerate(table) if s.per_layer), len(table))
        # in table order: the model weights listed before the blocks, the blocks, the rest
        for k, spec in enumerate(table):
            if k == first_layer:
                self.layers = nnx.List([Block(cfg, fmt, rngs) for _ in range(cfg.num_layers)])
            if not spec.per_layer and spec.present(cfg):
                _add_weight(self, spec, cfg, fmt, rngs)
        if first_layer == len(table):  # a table without per-layer weights
            self.layers = nnx.List([])


def _fmt(dtype) -> str:
    if isinstance(dtype, str) and dtype in WEIGHT_FORMATS:
        return dtype
    return {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8"}[jnp.dtype(dtype).name]


def abstract_model(cfg: ModelConfig, dtype="float32"):
    """``(graphdef, abstract_params)`` without allocating weights (``nnx.eval_shape``).
    ``dtype``: a weight format name (float32, bfloat16, int8) or the matching dtype."""
    model = nnx.eval_shape(lambda: Transformer(cfg, fmt=_fmt(dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_model(cfg: ModelConfig, seed: int = 0, dtype="float32"):
    """``(graphdef, params)`` with random weights (N(0, 0.02), norms 1, biases 0)."""
    return nnx.split(Transformer(cfg, fmt=_fmt(dtype), rngs=nnx.Rngs(seed)))


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

    A tree call (:func:`forward` with ``tree_mask``) over ``[root, node_0 .. node_{N-1}]`` wrote
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
    over the path (see :func:`decoder_block`), so the compacted cache is the causal cache.

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


def _pairwise(x, axis: int, op, fill):
    """Reduce ``axis`` with ``op`` in a fixed order: adjacent pairs, level by level (the axis
    padded with ``fill`` to a power of two), as elementwise ops XLA cannot reorder or hand to a
    library kernel (:func:`pairwise_sum`, :func:`pairwise_max`)."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)], constant_values=fill)
    while x.shape[-1] > 1:
        x = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        x = op(x[..., 0], x[..., 1])
    return x[..., 0]


def pairwise_sum(x, axis: int = -1):
    """Sum over ``axis`` in a fixed order: adjacent pairs, level by level (the axis zero-padded
    to a power of two), written as elementwise adds so XLA cannot reorder it.

    The result for one row never depends on the other dimensions' sizes (the batch, the
    number of tokens in a call), which XLA's own reductions do not promise (their
    vectorization follows the shapes, ≈ 1e-7 apart); and appending zeros to the axis does not
    change it (``x + 0 = x``), so a sum over a longer, zero-masked cache equals the sum over
    the live part. Batch invariance (docs/design.md) rests on this.
    """
    return _pairwise(x, axis, jnp.add, 0.0)


def pairwise_max(x, axis: int = -1):
    """Maximum over ``axis`` as elementwise ``maximum`` ops (exact, like ``jnp.max``). Why not
    ``jnp.max``: XLA CPU hands a reduce and the elementwise ops that consume it (the softmax's
    ``exp(s - max)``) to a YNNPACK fusion in some programs and not in others, and YNNPACK's
    ``exp`` rounds differently from XLA's: measured, a one-token int8 call's attention output
    1.7e-4 (relative) away from the same row verified in a two-token tree call, enough to flip an
    activation's int8 rounding and a greedy token (question 287 of Spec-Bench). With no reduce
    op there is no such fusion, and every program computes the same ``exp``."""
    return _pairwise(x, axis, jnp.maximum, -jnp.inf)


def rms_norm(x, w, eps):
    """RMSNorm in float32 over the last axis, with a batch-invariant sum (:func:`pairwise_sum`)."""
    x32 = x.astype(jnp.float32)
    ms = pairwise_sum(x32 * x32) / x32.shape[-1]
    y = x32 * jax.lax.rsqrt(ms[..., None] + eps)
    return y * w.astype(jnp.float32)


def _rows_padded(x2d, fn):
    """Run ``fn`` on ``x2d [M, K]`` with at least 2 rows: XLA CPU's one-row bf16/int8 dot
    converts the whole weight to float32 on every call (~8× slower)."""
    if x2d.shape[0] >= 2:
        return fn(x2d)
    return fn(jnp.pad(x2d, ((0, 2 - x2d.shape[0]), (0, 0))))[: x2d.shape[0]]


def quantize_rows(x):
    """Dynamic symmetric int8 per row: ``x [M, K] ≈ q * scale[:, None]``."""
    # the barrier keeps the division below out of a library reduce fusion (see pairwise_max);
    # a pairwise maximum over K here costs ~1 ms per step
    amax = jax.lax.optimization_barrier(jnp.max(jnp.abs(x), axis=-1))
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(x / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def matmul(x, w, scale=None, transposed=False):
    """``x [..., K] @ w`` → float32 ``[..., *out]`` in the weight's format.

    ``w`` is ``[K, *out]`` (or ``[N, K]`` when ``transposed``, the tied embedding); a fused
    weight's output axes (``w_qkv [D, KV, G + 2, hd]``) stay separate axes of one dot, which
    XLA runs as the 2-D ``[K, prod(out)]`` product (contiguous: no copy), and which a mesh can
    split on any output axis without moving data. Every output column is its own dot over K,
    so fusing weights never mixes rows (batch invariance).
    float32 / bfloat16: the activations are cast to ``w.dtype`` and accumulated in
    float32 (bf16×bf16 products are exact in float32). int8: activations are quantized
    per row on the fly, ``int8 × int8 → int32`` (``preferred_element_type``), then
    rescaled by the row and channel scales — never a float32 copy of the weight.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    dn = (contract, ((), ()))
    if w.dtype == jnp.int8:
        def fn(a):
            q, s = quantize_rows(a)
            y = jax.lax.dot_general(q, w, dn, preferred_element_type=jnp.int32)
            return y.astype(jnp.float32) * s.reshape((-1,) + (1,) * (y.ndim - 1)) * scale[None]
    else:
        def fn(a):
            return jax.lax.dot_general(a.astype(w.dtype), w, dn, preferred_element_type=jnp.float32)
    y = _rows_padded(x2, fn) if w.dtype != jnp.float32 else fn(x2)
    return y.reshape(*lead, *y.shape[1:])


def dense(x, w, b=None, scale=None):
    """``x @ w`` (+ b, of shape ``out``) with float32 output; ``w`` stored ``[in, *out]`` (see
    :func:`matmul`)."""
    y = matmul(x, w, scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y


def _p(module, name):
    """A parameter's value, or None if the module does not have it."""
    return module.__dict__[name][...] if name in module.__dict__ else None


def _arrays(module) -> dict:
    """``{name: array}`` of a module's own parameters (a block's weights and int8 scales)."""
    return {k: v[...] for k, v in vars(module).items() if isinstance(v, nnx.Param)}


def rope(x, positions, inv_freq):
    """Rotary embedding, Hugging Face "rotate half" layout.

    x: ``[B, T, heads, head_dim]``; positions: ``[B, T]`` int32; inv_freq ``[head_dim/2]``.
    """
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _write(cache_arr, new, starts):
    """Write ``new [B, KV, T, hd]`` into ``cache_arr [B, KV, S, hd]`` at per-row slot ``starts [B]``."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (0, s, 0)))(
        cache_arr, new, starts
    )


ATTENTION_BLOCK = 64  # cache slots per attention block (a multiple of the Decoder's buffer bucket)


def _tree_visible(tree_mask, start, groups: int, nb: int, blk: int):
    """Tree attention's visibility in the physical cache layout (the float32 path of
    :func:`_attention`): bool ``[B, 1, NB, G·T, blk]``, query j (row ``g·T + j``) sees slot s iff
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


class _TreeWindow:
    """The blocks of :func:`_attention` that hold new tokens, per query, in the causal layout of
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


def _tree_window(scores, v_cache, positions, tree_mask, blk: int, dt) -> _TreeWindow:
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


def _attention(q, k_cache, v_cache, positions, cfg: ModelConfig, tree_mask=None):
    """Causal GQA attention of ``q [B, T, H, hd]`` over this row's cache ``[B, KV, S, hd]``:
    the query at position t sees slots ≤ t. Returns float32 ``[B, T, H·hd]``.

    With ``tree_mask`` (bool ``[B, T, T]``, see :func:`decoder_block`): tree attention — query j
    sees the committed prefix (slots < ``positions[:, 0]``) and the new tokens i with
    ``tree_mask[:, j, i]`` (its ancestors and itself), whose K/V sit at slots
    ``positions[:, 0] + i``; see :func:`_tree_visible` (float32) and :func:`_tree_window`
    (reduced formats) for how that is computed without breaking batch invariance.

    Batch-invariant by construction (docs/design.md, "Batch invariance"): the cache is read in
    blocks of :data:`ATTENTION_BLOCK` slots, so each dot contracts a fixed length (``hd`` for
    the scores, 64 slots for the values) whatever ``S``, ``T`` or ``B`` is; the softmax max is
    exact, its normalizer and the per-block value sums are combined with :func:`pairwise_sum`
    (masked slots contribute exact zeros, so a longer buffer changes nothing). In the reduced
    weight formats the dots take bfloat16 inputs with float32 accumulation (the products are
    exact in float32, and XLA CPU's kernel sums them in an order that does not depend on the
    number of rows: measured, and checked by tests/test_batch_invariance.py); in float32 they are
    float32 dots, whose kernels do round differently for different row counts (≈ 1e-6).
    """
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
    kb = k_cache.reshape(b, kv, nb, blk, hd)
    vb = v_cache.reshape(b, kv, nb, blk, hd)
    scores = jnp.einsum("bkmd,bknsd->bknms", qg.astype(dt), kb.astype(dt),
                        preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hd))
    slots = jnp.arange(nb * blk, dtype=jnp.int32).reshape(nb, 1, blk)
    window = None
    if tree_mask is None:
        qpos = jnp.broadcast_to(positions[:, None, :], (b, h // kv, t)).reshape(b, 1, 1, (h // kv) * t, 1)
        visible = slots[None, None] <= qpos  # [B, 1, NB, G·T, blk]
    elif dt == jnp.float32:
        visible = _tree_visible(tree_mask, positions[:, 0], h // kv, nb, blk)
    else:  # the prefix outside the window here; the window's blocks per query (_tree_window)
        window = _tree_window(scores, v_cache, positions, tree_mask, blk, dt)
        visible = window.outside[:, None, :, None, :]  # [B, 1, NB, 1, blk]
    scores = jnp.where(visible, scores, -jnp.inf)
    # exact; slot 0 is always visible. Not jnp.max: see pairwise_max (the exp below must not
    # land in a library fusion in one program and not in another)
    m = pairwise_max(pairwise_max(scores, axis=-1), axis=2)[:, :, None, :, None]  # [B, KV, 1, G·T, 1]
    if window is not None:
        m = jnp.maximum(m, window.max())
    e = jnp.where(visible, jnp.exp(scores - m), 0.0).astype(dt)
    if window is None:
        denom = pairwise_sum(pairwise_sum(e.astype(jnp.float32), axis=-1), axis=2)  # [B, KV, G·T]
        part = jnp.einsum("bknms,bknsd->bknmd", e, vb.astype(dt), preferred_element_type=jnp.float32)
    else:  # per block: the blocks outside the window, plus the window's (exact zeros elsewhere)
        block_sums, part = window.add_to(
            pairwise_sum(e.astype(jnp.float32), axis=-1),
            jnp.einsum("bknms,bknsd->bknmd", e, vb.astype(dt), preferred_element_type=jnp.float32), m)
        denom = pairwise_sum(block_sums, axis=2)
    out = pairwise_sum(part, axis=2) / denom[..., None]  # [B, KV, G·T, hd]
    return out.reshape(b, kv, h // kv, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)


def decoder_block(
    p: Mapping[str, jax.Array],
    h: Float[Array, "batch seq hidden"],
    positions: Int[Array, "batch seq"],
    k_cache: jax.Array,
    v_cache: jax.Array,
    cfg: ModelConfig,
    inv_freq=None,
    tree_mask: Bool[Array, "batch seq seq"] | None = None,
) -> tuple[Float[Array, "batch seq hidden"], jax.Array, jax.Array]:
    """One decoder block (pre-norm GQA attention with RoPE, then SwiGLU MLP) on the residual
    stream ``h``, writing its K/V into this block's cache arrays.

    Args:
      p: the block's weights by :data:`specjax.models.weights.WEIGHTS` name (``attn_norm``,
        ``w_qkv [D, KV, G + 2, hd]``, ``wo``, ``mlp_norm``, ``w_gate_up [D, 2, F]``, ``w_down
        [F, D]``; matmul weights ``[in, *out]`` in float32, bfloat16 or int8 with a float32
        ``<name>_scale``). Optional weights (the biases ``b_qkv``/``bo``) may be absent.
      h: ``[B, T, D]`` float32 input of the block.
      positions: ``[B, T]`` int32 RoPE positions. K/V are always written at the contiguous
        slots ``positions[:, 0] + arange(T)``. Without ``tree_mask`` they must be contiguous
        (``positions[:, 0] + arange(T)``) and the query at position t sees slots ≤ t. With
        ``tree_mask``: ``positions[:, j] = positions[:, 0] + depth_j`` (token 0 = the root,
        depth 0), so slot ≠ position for a tree.
      k_cache, v_cache: ``[B, KV, S, hd]`` this block's cache arrays (any float dtype).
      cfg: heads, head_dim, RoPE and RMSNorm epsilon.
      inv_freq: ``cfg.rope_inv_freq()`` if already computed (``[hd/2]``).
      tree_mask: ``None`` (causal attention, as above), or bool ``[B, T, T]`` for tree attention
        (SpecInfer, Miao et al. 2024, "tree-based parallel decoding"; EAGLE-2, Li et al. 2024):
        token j sees the committed prefix (slots < ``positions[:, 0]``) and the new tokens i with
        ``tree_mask[:, j, i]``, which must be exactly j's ancestors and j itself, one per depth
        ``0 .. depth_j`` (:func:`specjax.core.tree.block_attention_mask`). Each token's output is
        that of one-token causal calls along its root-to-token path (bit-identical in the reduced
        formats, ≈ 1e-7 in float32). A multi-token *causal* call does not promise that in the
        reduced formats (measured: 2.4 apart in int8 at one position of a real prompt), so the
        decode loop verifies chains as chain trees (:func:`specjax.runtime.loop._target_step`).

    Returns:
      ``(h [B, T, D] float32 output of the block, k_cache, v_cache)`` with the new K/V written.
    """
    b, t = h.shape[:2]
    hd = cfg.head_dim
    if inv_freq is None:
        inv_freq = cfg.rope_inv_freq()
    inv_freq = jnp.asarray(inv_freq)
    starts = positions[:, 0]

    def lin(x, name, bias=None):
        return dense(x, p[name], p.get(bias) if bias else None, p.get(name + "_scale"))

    x = rms_norm(h, p["attn_norm"], cfg.rms_norm_eps)
    qkv = lin(x, "w_qkv", "b_qkv")  # [B, T, KV, G + 2, hd]: per KV group its G queries, key, value
    g = cfg.num_heads // cfg.num_kv_heads
    q = qkv[:, :, :, :g].reshape(b, t, cfg.num_heads, hd)  # head kv·G + j, the checkpoints' order
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, T, KV, hd]
    q = rope(q, positions, inv_freq)
    k = rope(k, positions, inv_freq)
    kc = _write(k_cache, k.transpose(0, 2, 1, 3), starts)
    vc = _write(v_cache, v.transpose(0, 2, 1, 3), starts)
    a = _attention(q if p["w_qkv"].dtype == jnp.float32 else q.astype(jnp.bfloat16), kc, vc, positions, cfg,
                   tree_mask=tree_mask)
    h = h + lin(a, "wo", "bo")
    x = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
    gate_up = lin(x, "w_gate_up")  # [B, T, 2, F]
    h = h + lin(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], "w_down")
    return h, kc, vc


class Output(NamedTuple):
    logits: Float[Array, "batch seq vocab"] | None
    cache: KVCache
    hidden: Float[Array, "batch seq hidden"] | None


def forward(
    graphdef,
    params,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"],
    cache: KVCache,
    cfg: ModelConfig,
    tree_mask: Bool[Array, "batch seq seq"] | None = None,
    feature_layers: tuple[int, ...] = (),
) -> tuple[Float[Array, "batch seq hidden"], KVCache]:
    """Run the decoder blocks and final norm; write K/V of ``tokens`` into ``cache``.

    Args:
      tokens: ``[B, T]`` int32 ids.
      positions: ``[B, T]`` int32; must be contiguous per row (``p0 + arange(T)``):
        K/V are written at slots ``positions[:, 0] + arange(T)``. With ``tree_mask``:
        ``positions[:, 0] + depth`` (see :func:`decoder_block`); the slots are the same.
      cache: the KV cache; its ``lengths`` are NOT changed (the caller commits).
      tree_mask: ``None`` (causal) or bool ``[B, T, T]``: one call verifies a draft tree
        ``[root, node_0 .. node_{N-1}]`` (T = N + 1); see :func:`decoder_block`, and
        :func:`compact_tree_cache` for the accepted path's K/V afterwards.

      feature_layers: with block indices, return :func:`target_features` of those blocks
        instead of the final hidden state (EAGLE-3's fused low/mid/high features).

    Returns:
      ``(hidden [B, T, D] float32 after the final RMSNorm, updated cache)``; with
      ``feature_layers``: ``(features [B, T, len(feature_layers)·D], updated cache)``.
    """
    h, cache, feats = run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask, feature_layers)
    return (feats if feature_layers else h), cache


def target_features(block_outputs: list[jax.Array], eps: float) -> jax.Array:
    """The feature a fused-feature drafter reads (EAGLE-3, Li et al. 2025, Sec. 3.2): the residual
    streams after the chosen blocks, each scaled to unit RMS (no weight: the streams of different
    depths differ in scale by orders of magnitude), concatenated: ``[..., len(block_outputs)·D]``
    float32."""
    return jnp.concatenate([x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
                            for x in block_outputs], axis=-1)


def check_feature_layers(feature_layers, cfg: ModelConfig) -> tuple[int, ...]:
    """``feature_layers`` as a tuple of block indices, each in ``[0, num_layers)``.

    Raises:
      ValueError: an index outside the model's blocks."""
    out = tuple(int(i) for i in feature_layers)
    bad = [i for i in out if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"feature layers {bad} are not blocks of a {cfg.num_layers}-block model "
                         f"(use indices 0..{cfg.num_layers - 1})")
    return out


def run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask=None, feature_layers=()):
    """The blocks and final norm: ``(final hidden [B, T, D], cache, fused features or None)`` (:func:`forward`)."""
    model = nnx.merge(graphdef, params)
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    h = embed_tokens(model, tokens)
    new_k, new_v, picked = [], [], {}
    for i, layer in enumerate(model.layers):
        h, kc, vc = decoder_block(_arrays(layer), h, positions, cache.k[i], cache.v[i], cfg, inv_freq=inv_freq,
                                  tree_mask=tree_mask)
        new_k.append(kc)
        new_v.append(vc)
        if i in feature_layers:
            picked[i] = h
    feats = target_features([picked[i] for i in feature_layers], cfg.rms_norm_eps) if feature_layers else None
    h = rms_norm(h, model.final_norm[...], cfg.rms_norm_eps)
    return h, KVCache(k=new_k, v=new_v, lengths=cache.lengths), feats


def lm_head(graphdef, params, hidden: Float[Array, "... hidden"], cfg: ModelConfig) -> Float[Array, "... vocab"]:
    """Logits float32 ``[..., vocab]`` from final hidden states ``[..., hidden]``."""
    model = nnx.merge(graphdef, params)
    if cfg.tie_word_embeddings:
        # contracting the untransposed [V, D] embedding: `embed.T` would copy it every call
        return matmul(hidden, model.embed[...], _p(model, "embed_scale"), transposed=True)
    return matmul(hidden, model.lm_head[...], _p(model, "lm_head_scale"))


def embed_tokens(model, tokens):
    """Embedding rows of ``tokens [B, T]`` → float32 ``[B, T, D]`` (dequantized in int8)."""
    e = jnp.take(model.embed[...], tokens, axis=0)
    if e.dtype != jnp.float32:
        # Without the barrier XLA hoists the convert above the gather and converts the
        # whole [V, D] table to float32 on every call.
        e = jax.lax.optimization_barrier(e)
    e = e.astype(jnp.float32)
    scale = _p(model, "embed_scale")
    if scale is not None:
        e = e * jnp.take(scale, tokens, axis=0)[..., None]
    return e


def apply(
    graphdef,
    params,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"],
    cache: KVCache,
    cfg: ModelConfig,
    return_hidden: bool = False,
    tree_mask: Bool[Array, "batch seq seq"] | None = None,
    feature_layers: tuple[int, ...] = (),
) -> Output:
    """Full model: ``Output(logits [B, T, V] float32, cache, hidden [B, T, D] or None)``; with
    ``return_hidden`` and ``feature_layers``, ``hidden`` is the fused feature
    ``[B, T, len(feature_layers)·D]`` (:func:`target_features`).

    See :func:`forward` for the argument contract (``tree_mask``: tree attention).
    """
    h, cache, feats = run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask,
                           feature_layers if return_hidden else ())
    logits = lm_head(graphdef, params, h, cfg)
    return Output(logits, cache, (feats if feature_layers else h) if return_hidden else None)


def param_bytes(params) -> int:
    """Total bytes of all parameter arrays."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def kv_cache_dtype(weight_format: str) -> str:
    """KV-cache dtype for a weight format: bfloat16 caches for bfloat16 weights on GPU/TPU;
    float32 otherwise (XLA CPU has no fast batched bf16 attention dot)."""
    if weight_format == "bfloat16" and jax.default_backend() != "cpu":
        return "bfloat16"
    return "float32"


def weight_format(dtype) -> str:
    """Weight format name (``float32``, ``bfloat16``, ``int8``) from a name or dtype.

    Raises:
      ValueError: not one of :data:`WEIGHT_FORMATS`.
    """
    name = dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return name


def flatten_params(d, prefix=()):
    """``(path, leaf)`` pairs of a nested parameter dict (``("layers", 0, "w_qkv")``)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flatten_params(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def unflatten_params(flat: dict) -> dict:
    """The nested dict of ``{path: leaf}`` (inverse of :func:`flatten_params`)."""
    out: dict = {}
    for path, v in flat.items():
        cur = out
        for k in path[:-1]:
            cur = cur.setdefault(k, {})
        cur[path[-1]] = v
    return out
