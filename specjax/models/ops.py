"""Batch-invariant numerics of the model: fixed-order pairwise sums and maxima, RMSNorm, the
matmul of each weight format (int8: block codes × two-level block activations,
:mod:`specjax.models.q8`), RoPE.

Each function computes one row the same way whatever the batch or the number of tokens in a
call (docs/design.md, "Batch invariance"); the attention (:mod:`specjax.models.attention`) and
the decoder block (:mod:`specjax.models.llama`, which re-exports every name here) are built from
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models import q8


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
        x = op(_last_index(x, 0), _last_index(x, 1))
    return _last_index(x, 0)


def _last_index(x, i: int):
    """``x[..., i]`` for a static ``i`` as the very ops ``jnp`` indexing emits (``slice`` +
    ``squeeze``: the same program), without its per-call Python cost (≈ 0.3 ms a call; the
    pairwise reductions make thousands of them when a decode loop is traced)."""
    nd = x.ndim
    if x.shape[-1] == 1:  # the whole axis: no slice (as jnp)
        return jax.lax.squeeze(x, (nd - 1,))
    start = (0,) * (nd - 1) + (i,)
    limit = (*x.shape[:-1], i + 1)
    return jax.lax.squeeze(jax.lax.slice(x, start, limit), (nd - 1,))


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
    """Run ``fn`` on ``x2d [M, K]`` with at least 2 rows: XLA CPU's one-row bf16 dot
    converts the whole weight to float32 on every call (~8× slower)."""
    if x2d.shape[0] >= 2:
        return fn(x2d)
    return fn(jnp.pad(x2d, ((0, 2 - x2d.shape[0]), (0, 0))))[: x2d.shape[0]]


def matmul(x, w, scale=None, transposed=False):
    """``x [..., K] @ w`` → float32 ``[..., *out]`` in the weight's format.

    ``w`` is ``[K, *out]`` (or ``[N, K]`` when ``transposed``, the tied embedding); a fused
    weight's output axes (``w_qkv [D, KV, G + 2, hd]``) stay separate axes of one dot, which
    XLA runs as the 2-D ``[K, prod(out)]`` product (contiguous: no copy), and which a mesh can
    split on any output axis without moving data. Every output column is its own dot over K,
    so fusing weights never mixes rows (batch invariance).
    float32 / bfloat16: the activations are cast to ``w.dtype`` and accumulated in
    float32 (bf16×bf16 products are exact in float32). int8: ``w`` holds uint8 codes and
    ``scale [2, blocks, *out]`` (``[2, N, blocks]`` when ``transposed``) the scale and offset of
    each block of 32 inputs; the activations are quantized per row and block in two levels and
    the integer block sums rescaled (:func:`specjax.models.q8.block_matmul`: a CPU kernel, or the
    same arithmetic in jnp) — never a float32 copy of the weight.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    if w.dtype == jnp.uint8:
        out = w.shape[:1] if transposed else w.shape[1:]
        return q8.block_matmul(x2, w, scale, transposed=transposed).reshape(*lead, *out)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    dn = (contract, ((), ()))

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


def rope(x, positions, inv_freq):
    """Rotary embedding, Hugging Face "rotate half" layout.

    x: ``[B, T, heads, head_dim]``; positions: ``[B, T]`` int32; inv_freq ``[head_dim/2]``.
    """
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
