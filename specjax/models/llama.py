"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) in Flax NNX, with a
per-row KV cache.

The module is defined with Flax NNX and split once (:func:`abstract_model`);
everything that runs is a pure function of ``(graphdef, params, ...)``
(:func:`apply`), so parameters and caches are plain pytrees that ``jit``, ``vmap``,
sharding and optax all understand.

The weights are declared once, in :data:`specjax.models.weights.WEIGHTS`. The family is split by
concern, and every name of these modules is re-exported here (import from ``specjax.models.llama``):

* :mod:`specjax.models.params`: the parameters as NNX modules (``Transformer``, ``Block``),
  ``abstract_model`` / ``init_model``, weight-format names, parameter utilities;
* :mod:`specjax.models.ops`: the batch-invariant numerics (pairwise sums, RMSNorm, the matmul
  of each weight format, RoPE);
* :mod:`specjax.models.attention`: the KV cache, causal and tree attention over it, the
  compaction of an accepted tree path;
* this module: the decoder block, ``forward`` / ``apply`` (the blocks, the final norm, the LM
  head) and the fused target features of EAGLE-3.

A new family declares its weights in the table, its attention variants (e.g. soft-capped scores,
sliding windows) in ``attention``, and its block and head here.

Layout choices, measured on XLA CPU (stacked weights sliced inside jit: 33–45 ms per step vs 29 ms unrolled): one array per layer
(not a stacked ``[layers, ...]`` array) with the layer loop unrolled in Python;
projection weights stored ``[in, out]``, with the query/key/value projections fused into
one ``w_qkv [D, KV, G + 2, hd]`` and gate/up into one ``w_gate_up [D, 2, F]`` (two matmuls
instead of five per block: fewer ops for GPU/TPU, where a decode step is op-count bound;
on XLA CPU fused and split time the same within noise); a tied LM head applied with an
``einsum`` over the untransposed ``[vocab, hidden]`` embedding (``embed.T`` copied 113 MB
per call); KV cache ``[batch, kv_heads, max_len, head_dim]`` per layer.
"""

from __future__ import annotations

from functools import partial
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from specjax.models.attention import (  # noqa: F401  (the cache and attention, re-exported)
    ATTENTION_BLOCK, KVCache, cache_attention, write_kv, compact_tree_cache, kv_cache_dtype,
)
from specjax.models.config import ModelConfig
from specjax.models.ops import (  # noqa: F401  (the numerics, re-exported)
    dense, matmul, pairwise_max, pairwise_sum, rms_norm, rope,
)
from specjax.models.params import (  # noqa: F401  (the parameters, re-exported)
    Block, ShapesOnly, Transformer, module_arrays, param_or_none, abstract_model, flatten_params, init_model, param_bytes, param_shapes,
    unflatten_params, weight_format,
)
from specjax.models.weights import (  # noqa: F401  (the table's functions, re-exported)
    BlockCodes, FORMAT_DEFINITION, WEIGHT_FORMATS, Part, WeightSpec, checkpoint_names, fuse, init_weight, layer_weights,
    matmul_weights, num_params, param_logical_axes, part_of, quantize_int8, quantize_int8_blocks, dequantize_int8, fuse_blocks, split, storage_dtype, weight_spec,
)


def decoder_block(
    p: Mapping[str, jax.Array],
    h: Float[Array, "batch seq hidden"],
    positions: Int[Array, "batch seq"],
    k_cache: jax.Array,
    v_cache: jax.Array,
    cfg: ModelConfig,
    inv_freq=None,
    tree_mask: Bool[Array, "batch seq seq"] | None = None,
    window: int | None = None,
    kv_view: int | None = None,
    key_span: int | None = None,
) -> tuple[Float[Array, "batch seq hidden"], jax.Array, jax.Array]:
    """One decoder block (pre-norm GQA attention with RoPE, then SwiGLU MLP; Gemma: GeGLU and the
    sandwich norms ``attn_post_norm`` / ``mlp_post_norm`` after each sub-layer) on the residual
    stream ``h``, writing its K/V into this block's cache arrays.

    Args:
      p: the block's weights by :data:`specjax.models.weights.WEIGHTS` name (``attn_norm``,
        ``w_qkv [D, KV, G + 2, hd]``, ``wo``, ``mlp_norm``, ``w_gate_up [D, 2, F]``, ``w_down
        [F, D]``; matmul weights ``[in, *out]`` in float32, bfloat16 or int8 with a float32
        ``<name>_scale``). Optional weights (the biases ``b_qkv``/``bo``, Qwen3's per-head
        ``q_norm``/``k_norm [hd]``) may be absent.
      h: ``[B, T, D]`` float32 input of the block.
      positions: ``[B, T]`` int32 RoPE positions. K/V are always written at the contiguous
        slots ``positions[:, 0] + arange(T)``. Without ``tree_mask`` they must be contiguous
        (``positions[:, 0] + arange(T)``) and the query at position t sees slots ≤ t. With
        ``tree_mask``: ``positions[:, j] = positions[:, 0] + depth_j`` (token 0 = the root,
        depth 0), so slot ≠ position for a tree.
      k_cache, v_cache: ``[B, KV, S, hd]`` this block's cache arrays (any float dtype); cfg: the config.
      inv_freq, window: this block's RoPE frequencies ``[hd/2]`` (default ``cfg.rope_inv_freq()``;
        ``cfg.layer_inv_freq(i)``) and sliding window W (``cfg.layer_window(i)``; ``None``: global).
      kv_view: attend over the first ``kv_view`` cache slots only (static; ``None``: all ``S``); every
        query's visible slots must lie inside it. ``key_span`` (static, causal calls): read the cache
        in spans of that many slots and skip those no query sees (:func:`cache_attention`; a long
        prompt's prefill chunks). Either way the result is the full cache's, bit for bit (the skipped
        slots were exact zeros in the fixed-order sums), at a cost that follows what is read.
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
    inv_freq = jnp.asarray(cfg.rope_inv_freq() if inv_freq is None else inv_freq)
    starts = positions[:, 0]

    def lin(x, name, bias=None):
        return dense(x, p[name], p.get(bias) if bias else None, p.get(name + "_scale"))

    x = rms_norm(h, p["attn_norm"], cfg.rms_norm_eps)
    qkv = lin(x, "w_qkv", "b_qkv")  # [B, T, KV, G + 2, hd]: per KV group its G queries, key, value
    g = cfg.num_heads // cfg.num_kv_heads
    q = qkv[:, :, :, :g].reshape(b, t, cfg.num_heads, hd)  # head kv·G + j, the checkpoints' order
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, T, KV, hd]
    if "q_norm" in p:  # Qwen3: RMSNorm of each head's query and key before RoPE
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, inv_freq)
    k = rope(k, positions, inv_freq)
    kc = write_kv(k_cache, k.transpose(0, 2, 1, 3), starts)
    vc = write_kv(v_cache, v.transpose(0, 2, 1, 3), starts)
    a = cache_attention(q if p["w_qkv"].dtype == jnp.float32 else q.astype(jnp.bfloat16), kc, vc, positions, cfg,
                        tree_mask=tree_mask, window=window, key_span=key_span, kv_view=kv_view)
    h = h + _post_norm(lin(a, "wo", "bo"), p, "attn_post_norm", cfg)
    x = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
    gate_up = lin(x, "w_gate_up")  # [B, T, 2, F]
    act = jax.nn.silu if cfg.hidden_act == "silu" else partial(jax.nn.gelu, approximate=True)
    h = h + _post_norm(lin(act(gate_up[:, :, 0]) * gate_up[:, :, 1], "w_down"), p, "mlp_post_norm", cfg)
    return h, kc, vc


def _post_norm(x, p, name: str, cfg: ModelConfig):
    """``x`` through the sandwich norm ``name`` when the block has it (Gemma), else unchanged."""
    return rms_norm(x, p[name], cfg.rms_norm_eps) if name in p else x


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
    raw_features: bool = False,
    kv_view: int | None = None,
    key_span: int | None = None,
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
        instead of the final hidden state (EAGLE-3's fused low/mid/high features); ``raw_features``:
        those block outputs unnormalized (:func:`target_features` with ``raw``).
      kv_view, key_span: read part of the cache only (:func:`decoder_block`); the result is unchanged.

    Returns:
      ``(hidden [B, T, D] float32 after the final RMSNorm, updated cache)``; with
      ``feature_layers``: ``(features [B, T, len(feature_layers)·D], updated cache)``.
    """
    h, cache, feats = run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask, feature_layers,
                                 raw_features, kv_view, key_span)
    return (feats if feature_layers else h), cache


def target_features(block_outputs: list[jax.Array], eps: float, raw: bool = False) -> jax.Array:
    """The feature a fused-feature drafter reads (EAGLE-3, Li et al. 2025, Sec. 3.2): the residual
    streams after the chosen blocks, each scaled to unit RMS (no weight: the streams of different
    depths differ in scale by orders of magnitude), concatenated: ``[..., len(block_outputs)·D]``
    float32. ``raw``: the streams as they are, concatenated (what published EAGLE-3 heads read)."""
    if raw:
        return jnp.concatenate(block_outputs, axis=-1)
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


def run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask=None, feature_layers=(), raw_features=False,
               kv_view=None, key_span=None):
    """The blocks and final norm: ``(final hidden [B, T, D], cache, fused features or None)`` (:func:`forward`;
    ``raw_features``: the features unnormalized, :func:`target_features`; ``kv_view``, ``key_span``:
    :func:`decoder_block`)."""
    model = nnx.merge(graphdef, params)
    inv_freq = {}  # per distinct RoPE (one, or a global and a local one)
    h = embed_tokens(model, tokens, cfg)
    new_k, new_v, picked = [], [], {}
    for i, layer in enumerate(model.layers):
        freq = cfg.layer_inv_freq(i)
        inv = inv_freq.setdefault(freq.tobytes(), jnp.asarray(freq))
        h, kc, vc = decoder_block(module_arrays(layer), h, positions, cache.k[i], cache.v[i], cfg, inv_freq=inv,
                                  tree_mask=tree_mask, window=cfg.layer_window(i), kv_view=kv_view,
                                  key_span=key_span)
        new_k.append(kc)
        new_v.append(vc)
        if i in feature_layers:
            picked[i] = h
    feats = (target_features([picked[i] for i in feature_layers], cfg.rms_norm_eps, raw_features)
             if feature_layers else None)
    h = rms_norm(h, model.final_norm[...], cfg.rms_norm_eps)
    return h, KVCache(k=new_k, v=new_v, lengths=cache.lengths), feats


def lm_head(graphdef, params, hidden: Float[Array, "... hidden"], cfg: ModelConfig) -> Float[Array, "... vocab"]:
    """Logits float32 ``[..., vocab]`` from final hidden states ``[..., hidden]`` (soft-capped as
    ``cap · tanh(logits / cap)`` with ``cfg.final_logit_softcapping``, Gemma 2)."""
    model = nnx.merge(graphdef, params)
    if cfg.tie_word_embeddings:
        # contracting the untransposed [V, D] embedding: `embed.T` would copy it every call
        logits = matmul(hidden, model.embed[...], param_or_none(model, "embed_scale"), transposed=True)
    else:
        logits = matmul(hidden, model.lm_head[...], param_or_none(model, "lm_head_scale"))
    cap = cfg.final_logit_softcapping
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def embed_rows(table, scale, tokens) -> jax.Array:
    """Rows ``tokens [...]`` of an embedding ``table [V, D]`` as float32 ``[..., D]``, reading only
    those rows: a float table's rows converted, an int8 table's codes dequantized with their rows
    of ``scale [2, V, D/32]`` (scales and offsets per block; None for a float table). The target's
    lookups and a drafter's lookups into the target's table (no float32 copy of the table)."""
    e = jnp.take(table, tokens, axis=0)
    if e.dtype != jnp.float32:
        # Without the barrier XLA hoists the convert above the gather and converts the
        # whole [V, D] table to float32 on every call.
        e = jax.lax.optimization_barrier(e)
    e = e.astype(jnp.float32)
    if scale is not None:
        e = dequantize_int8(e, jnp.take(scale, tokens, axis=1), -1)
    return e


def embed_tokens(model, tokens, cfg: ModelConfig | None = None):
    """Embedding rows of ``tokens [B, T]`` → float32 ``[B, T, D]`` (dequantized in int8; × √D in
    float32 when ``cfg.scale_embeddings``, Gemma)."""
    e = embed_rows(model.embed[...], param_or_none(model, "embed_scale"), tokens)
    if cfg is not None and cfg.scale_embeddings:
        e = e * jnp.float32(cfg.hidden_size ** 0.5)
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
    raw_features: bool = False,
    kv_view: int | None = None,
) -> Output:
    """Full model: ``Output(logits [B, T, V] float32, cache, hidden [B, T, D] or None)``; with
    ``return_hidden`` and ``feature_layers``, ``hidden`` is the fused feature
    ``[B, T, len(feature_layers)·D]`` (:func:`target_features`; unnormalized with ``raw_features``).

    See :func:`forward` for the argument contract (``tree_mask``: tree attention).
    """
    h, cache, feats = run_blocks(graphdef, params, tokens, positions, cache, cfg, tree_mask,
                           feature_layers if return_hidden else (), raw_features, kv_view)
    logits = lm_head(graphdef, params, h, cfg)
    return Output(logits, cache, (feats if feature_layers else h) if return_hidden else None)
