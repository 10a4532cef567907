"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in Flax NNX, with a
per-row KV cache.

The module is defined with Flax NNX and split once (:func:`abstract_model`);
everything that runs is a pure function of ``(graphdef, params, ...)``
(:func:`apply`), so parameters and caches are plain pytrees that ``jit``, ``vmap``,
sharding and optax all understand.

Layout choices, measured on XLA CPU (see PERFORMANCE-NOTES): one array per layer
(not a stacked ``[layers, ...]`` array) with the layer loop unrolled in Python;
projection weights stored ``[in, out]``; a tied LM head applied with an ``einsum``
over the untransposed ``[vocab, hidden]`` embedding (``embed.T`` copied 113 MB per
call); KV cache ``[batch, kv_heads, max_len, head_dim]`` per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from specjax.config import ModelConfig


def _init(rngs: nnx.Rngs, shape, dtype, scale=0.02):
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


class Block(nnx.Module):
    """One pre-norm decoder block: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.attn_norm = nnx.Param(jnp.ones((d,), dtype))
        self.wq = _init(rngs, (d, cfg.num_heads * hd), dtype)
        self.wk = _init(rngs, (d, cfg.num_kv_heads * hd), dtype)
        self.wv = _init(rngs, (d, cfg.num_kv_heads * hd), dtype)
        if cfg.attention_bias:
            self.bq = nnx.Param(jnp.zeros((cfg.num_heads * hd,), dtype))
            self.bk = nnx.Param(jnp.zeros((cfg.num_kv_heads * hd,), dtype))
            self.bv = nnx.Param(jnp.zeros((cfg.num_kv_heads * hd,), dtype))
        self.wo = _init(rngs, (cfg.num_heads * hd, d), dtype)
        if cfg.attention_out_bias:
            self.bo = nnx.Param(jnp.zeros((d,), dtype))
        self.mlp_norm = nnx.Param(jnp.ones((d,), dtype))
        self.w_gate = _init(rngs, (d, cfg.intermediate_size), dtype)
        self.w_up = _init(rngs, (d, cfg.intermediate_size), dtype)
        self.w_down = _init(rngs, (cfg.intermediate_size, d), dtype)


class Transformer(nnx.Module):
    """Parameters of a Llama-family decoder. Call it through :func:`apply`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embed = _init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = _init(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)


def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """``(graphdef, abstract_params)`` without allocating weights (``nnx.eval_shape``)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """``(graphdef, params)`` with random weights (N(0, 0.02), norms 1, biases 0)."""
    return nnx.split(Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))


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


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y * w.astype(jnp.float32)


def dense(x, w, b=None):
    """``x @ w`` (+ b) with float32 accumulation; ``w`` stored ``[in, out]``."""
    y = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
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


def _write(cache_arr, new, starts):
    """Write ``new [B, KV, T, hd]`` into ``cache_arr [B, KV, S, hd]`` at per-row slot ``starts [B]``."""
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (0, s, 0)))(
        cache_arr, new, starts
    )


def _attention(q, k_cache, v_cache, positions, cfg: ModelConfig):
    """q ``[B, T, H, hd]``; caches ``[B, KV, S, hd]``; query at position t sees slots ≤ t of its row."""
    b, t, h, hd = q.shape
    kv = cfg.num_kv_heads
    q = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(hd)
    slots = jnp.arange(k_cache.shape[2], dtype=jnp.int32)
    visible = slots[None, None, None, None, :] <= positions[:, None, None, :, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    w = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->btkgd", w.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h * hd)


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
) -> tuple[Float[Array, "batch seq hidden"], KVCache]:
    """Run the decoder blocks and final norm; write K/V of ``tokens`` into ``cache``.

    Args:
      tokens: ``[B, T]`` int32 ids.
      positions: ``[B, T]`` int32; must be contiguous per row (``p0 + arange(T)``):
        K/V are written at slots ``positions[:, 0] + arange(T)``.
      cache: the KV cache; its ``lengths`` are NOT changed (the caller commits).

    Returns:
      ``(hidden [B, T, D] float32 after the final RMSNorm, updated cache)``.
    """
    model = nnx.merge(graphdef, params)
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    h = jnp.take(model.embed[...], tokens, axis=0).astype(jnp.float32)
    b, t = tokens.shape
    hd = cfg.head_dim
    starts = positions[:, 0]
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):
        x = rms_norm(h, layer.attn_norm[...], cfg.rms_norm_eps)
        bias = cfg.attention_bias
        q = dense(x, layer.wq[...], layer.bq[...] if bias else None).reshape(b, t, cfg.num_heads, hd)
        k = dense(x, layer.wk[...], layer.bk[...] if bias else None).reshape(b, t, cfg.num_kv_heads, hd)
        v = dense(x, layer.wv[...], layer.bv[...] if bias else None).reshape(b, t, cfg.num_kv_heads, hd)
        q = rope(q, positions, inv_freq)
        k = rope(k, positions, inv_freq)
        kc = _write(cache.k[i], k.transpose(0, 2, 1, 3), starts)
        vc = _write(cache.v[i], v.transpose(0, 2, 1, 3), starts)
        new_k.append(kc)
        new_v.append(vc)
        a = _attention(q.astype(kc.dtype), kc, vc, positions, cfg)
        h = h + dense(a, layer.wo[...], layer.bo[...] if cfg.attention_out_bias else None)
        x = rms_norm(h, layer.mlp_norm[...], cfg.rms_norm_eps)
        g = dense(x, layer.w_gate[...])
        u = dense(x, layer.w_up[...])
        h = h + dense(jax.nn.silu(g) * u, layer.w_down[...])
    h = rms_norm(h, model.final_norm[...], cfg.rms_norm_eps)
    return h, KVCache(k=new_k, v=new_v, lengths=cache.lengths)


def lm_head(graphdef, params, hidden: Float[Array, "... hidden"], cfg: ModelConfig) -> Float[Array, "... vocab"]:
    """Logits float32 ``[..., vocab]`` from final hidden states ``[..., hidden]``."""
    model = nnx.merge(graphdef, params)
    if cfg.tie_word_embeddings:
        e = model.embed[...]
        return jnp.einsum("...d,vd->...v", hidden.astype(e.dtype), e, preferred_element_type=jnp.float32)
    return dense(hidden, model.lm_head[...])


def apply(
    graphdef,
    params,
    tokens: Int[Array, "batch seq"],
    positions: Int[Array, "batch seq"],
    cache: KVCache,
    cfg: ModelConfig,
    return_hidden: bool = False,
) -> Output:
    """Full model: ``Output(logits [B, T, V] float32, cache, hidden [B, T, D] or None)``.

    See :func:`forward` for the argument contract.
    """
    h, cache = forward(graphdef, params, tokens, positions, cache, cfg)
    logits = lm_head(graphdef, params, h, cfg)
    return Output(logits, cache, h if return_hidden else None)


def param_bytes(params) -> int:
    """Total bytes of all parameter arrays."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))
