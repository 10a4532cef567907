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

from specjax.models.config import ModelConfig


WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
# Matmul weights (quantized in int8) and the axis their per-channel scale runs along.
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "embed")


def storage_dtype(fmt: str):
    """Array dtype of matmul weights for a weight format; norms/biases/scales stay float32
    except in bfloat16, where every parameter is bf16."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8}[fmt]


def quantize_int8(w, axis: int):
    """Symmetric per-channel int8: ``w ≈ q * scale`` with ``scale = max|w| / 127`` reduced over
    ``axis`` (the input dim). Returns ``(q int8, scale float32 with axis removed)``."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axis)), -127, 127).astype(jnp.int8)
    return q, scale.astype(jnp.float32)


def _weight(rngs, shape, fmt, reduce_axis):
    """A matmul weight (and its int8 scale param, or None)."""
    w = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    if fmt == "int8":
        q, s = quantize_int8(w, reduce_axis)
        return nnx.Param(q), nnx.Param(s)
    return nnx.Param(w.astype(storage_dtype(fmt))), None


def _vec(value, shape, fmt):
    return nnx.Param(jnp.full(shape, value, jnp.bfloat16 if fmt == "bfloat16" else jnp.float32))


class Block(nnx.Module):
    """One pre-norm decoder block: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP.

    Matmul weights are stored ``[in, out]``; in the int8 format each has a float32
    per-output-channel ``<name>_scale``.
    """

    def __init__(self, cfg: ModelConfig, fmt: str, rngs: nnx.Rngs):
        d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.attn_norm = _vec(1.0, (d,), fmt)
        shapes = {"wq": (d, cfg.num_heads * hd), "wk": (d, cfg.num_kv_heads * hd),
                  "wv": (d, cfg.num_kv_heads * hd), "wo": (cfg.num_heads * hd, d),
                  "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
        for name, shape in shapes.items():
            w, s = _weight(rngs, shape, fmt, 0)
            setattr(self, name, w)
            if s is not None:
                setattr(self, name + "_scale", s)
        if cfg.attention_bias:
            self.bq = _vec(0.0, (cfg.num_heads * hd,), fmt)
            self.bk = _vec(0.0, (cfg.num_kv_heads * hd,), fmt)
            self.bv = _vec(0.0, (cfg.num_kv_heads * hd,), fmt)
        if cfg.attention_out_bias:
            self.bo = _vec(0.0, (d,), fmt)
        self.mlp_norm = _vec(1.0, (d,), fmt)


class Transformer(nnx.Module):
    """Parameters of a Llama-family decoder. Call it through :func:`apply`.

    ``fmt``: weight format — ``float32``; ``bfloat16`` (bf16 weights, float32
    accumulation); ``int8`` (per-channel int8 weights × per-row int8 activations,
    int32 accumulation; norms, biases and scales float32).
    """

    def __init__(self, cfg: ModelConfig, *, fmt: str = "float32", rngs: nnx.Rngs):
        storage_dtype(fmt)  # validates
        self.embed, s = _weight(rngs, (cfg.vocab_size, cfg.hidden_size), fmt, 1)
        if s is not None:
            self.embed_scale = s
        self.layers = nnx.List([Block(cfg, fmt, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _vec(1.0, (cfg.hidden_size,), fmt)
        if not cfg.tie_word_embeddings:
            self.lm_head, s = _weight(rngs, (cfg.hidden_size, cfg.vocab_size), fmt, 0)
            if s is not None:
                self.lm_head_scale = s


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


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y * w.astype(jnp.float32)


def _rows_padded(x2d, fn):
    """Run ``fn`` on ``x2d [M, K]`` with at least 2 rows: XLA CPU's one-row bf16/int8 dot
    converts the whole weight to float32 on every call (~8× slower)."""
    if x2d.shape[0] >= 2:
        return fn(x2d)
    return fn(jnp.pad(x2d, ((0, 2 - x2d.shape[0]), (0, 0))))[: x2d.shape[0]]


def quantize_rows(x):
    """Dynamic symmetric int8 per row: ``x [M, K] ≈ q * scale[:, None]``."""
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(x / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def matmul(x, w, scale=None, transposed=False):
    """``x [..., K] @ w`` → float32 ``[..., N]`` in the weight's format.

    ``w`` is ``[K, N]`` (or ``[N, K]`` when ``transposed``, the tied embedding).
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
            return y.astype(jnp.float32) * s[:, None] * scale[None, :]
    else:
        def fn(a):
            return jax.lax.dot_general(a.astype(w.dtype), w, dn, preferred_element_type=jnp.float32)
    y = _rows_padded(x2, fn) if w.dtype != jnp.float32 else fn(x2)
    return y.reshape(*lead, y.shape[-1])


def dense(x, w, b=None, scale=None):
    """``x @ w`` (+ b) with float32 output; ``w`` stored ``[in, out]`` (see :func:`matmul`)."""
    y = matmul(x, w, scale)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y


def _p(module, name):
    """A parameter's value, or None if the module does not have it."""
    return module.__dict__[name][...] if name in module.__dict__ else None


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


# Blocks of up to this many queries (verification calls, γ + 1 ≤ 16) attend one query at a
# time in reduced weight formats; longer blocks (prefill) attend all queries at once.
PER_QUERY_MAX = 16


def _attention(q, k_cache, v_cache, positions, cfg: ModelConfig, per_query: bool = False):
    """q ``[B, T, H, hd]``; caches ``[B, KV, S, hd]``; query at position t sees slots ≤ t of its row.

    ``per_query``: compute each of the T queries with the shapes of a one-token call. XLA
    CPU's batched attention dots round differently for different T (≈ 1e-7), and bf16/int8
    activation rounding amplifies that into different tokens; per query, a token's attention
    output is bit-identical whether it is verified in a block or decoded alone, which keeps
    greedy speculative == greedy autoregressive within a reduced format.
    """
    if per_query and 1 < q.shape[1] <= PER_QUERY_MAX:
        return jnp.concatenate(
            [_attention(q[:, i:i + 1], k_cache, v_cache, positions[:, i:i + 1], cfg) for i in range(q.shape[1])],
            axis=1)
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
    h = embed_tokens(model, tokens)
    b, t = tokens.shape
    hd = cfg.head_dim
    starts = positions[:, 0]
    reduced = model.layers[0].wq[...].dtype != jnp.float32  # bf16 / int8 weights
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):

        def lin(x, name, bias=None):
            return dense(x, layer.__dict__[name][...], _p(layer, bias) if bias else None, _p(layer, name + "_scale"))

        x = rms_norm(h, layer.attn_norm[...], cfg.rms_norm_eps)
        q = lin(x, "wq", "bq").reshape(b, t, cfg.num_heads, hd)
        k = lin(x, "wk", "bk").reshape(b, t, cfg.num_kv_heads, hd)
        v = lin(x, "wv", "bv").reshape(b, t, cfg.num_kv_heads, hd)
        q = rope(q, positions, inv_freq)
        k = rope(k, positions, inv_freq)
        kc = _write(cache.k[i], k.transpose(0, 2, 1, 3), starts)
        vc = _write(cache.v[i], v.transpose(0, 2, 1, 3), starts)
        new_k.append(kc)
        new_v.append(vc)
        a = _attention(q.astype(kc.dtype), kc, vc, positions, cfg, per_query=reduced)
        h = h + lin(a, "wo", "bo")
        x = rms_norm(h, layer.mlp_norm[...], cfg.rms_norm_eps)
        h = h + lin(jax.nn.silu(lin(x, "w_gate")) * lin(x, "w_up"), "w_down")
    h = rms_norm(h, model.final_norm[...], cfg.rms_norm_eps)
    return h, KVCache(k=new_k, v=new_v, lengths=cache.lengths)


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
    """``(path, leaf)`` pairs of a nested parameter dict (``("layers", 0, "wq")``)."""
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
