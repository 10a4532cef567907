"""The EAGLE drafter's network as pure functions of ``(config, params, ...)``: the input feature
(:func:`input_features`), the drafter block over T positions with its own KV cache
(:func:`forward`), the training-time-test unroll of EAGLE-3 (:func:`ttt_forward`) and the head:
sub-vocabulary logits, the copy term, logits over the target's vocabulary. The architecture is
in :mod:`specjax.drafters.eagle`, which re-exports every name here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle_params import EagleConfig, embed_rows
from specjax.models import llama


def input_features(cfg: EagleConfig, params: dict, hid) -> jax.Array:
    """The drafter's input feature ``[..., D]`` float32 from the target's ``hid [..., feature_size]``:
    the fused features projected by ``fuse`` (EAGLE-3), or the final hidden state as it is."""
    if not cfg.feature_layers:
        return hid.astype(jnp.float32)
    tp = params["train"]
    return llama.matmul(hid.astype(jnp.float32), tp["fuse"], tp.get("fuse_scale"))


def new_cache(cfg: EagleConfig, batch: int, max_len: int, dtype=jnp.float32) -> llama.KVCache:
    return llama.KVCache.create(cfg.layer, batch, max_len, dtype)


def forward(cfg: EagleConfig, params: dict, feats, tokens, positions, cache: llama.KVCache, tree_mask=None):
    """Drafter block over T positions.

    Args:
      params: ``{"train": trainable, "frozen": frozen}``.
      feats: ``[B, T, D]`` h_{t-1} per position (target's or the drafter's own).
      tokens: ``[B, T]`` x_t; positions ``[B, T]`` contiguous per row (with ``tree_mask``: the
        root's position + depth, see :func:`specjax.models.llama.decoder_block`).
      tree_mask: ``None`` (causal) or bool ``[B, T, T]`` (tree attention over ``[root, nodes]``).
    Returns:
      ``(f [B, T, D] float32 predicted features, cache with K/V written at the positions)``.
    """
    l = cfg.layer
    tp, fz = params["train"], params["frozen"]
    e = embed_rows(fz, tokens)
    x = llama.dense(jnp.concatenate([feats.astype(jnp.float32), e], axis=-1), tp["fc"], tp["fc_b"],
                    tp.get("fc_scale"))
    x, kc, vc = llama.decoder_block(tp["layer"], x, positions, cache.k[0], cache.v[0], l, tree_mask=tree_mask)
    f = llama.rms_norm(x, tp["out_norm"], l.rms_norm_eps)
    return f, llama.KVCache(k=[kc], v=[vc], lengths=cache.lengths)


def _shift(x, k: int):
    """``x [B, W, ...]`` moved ``k`` positions later along axis 1 (zeros in front): ``y[:, s] = x[:, s-k]``."""
    if k == 0:
        return x
    return jnp.concatenate([jnp.zeros_like(x[:, :k]), x[:, :-k]], axis=1)


def ttt_forward(cfg: EagleConfig, params: dict, feats, tokens, steps: int) -> list[jax.Array]:
    """Training-time test (EAGLE-3, Li et al. 2025, Sec. 3.3): the drafter unrolled ``steps`` times on
    its own predicted features over a teacher-forced window, every position at once.

    Step 0 is the teacher-forced pass (:func:`forward`, causal): the input at position s is the
    target's feature ``feats[:, s]`` (h at s − 1, already through :func:`input_features`) with
    token x_s. Step k ≥ 1 feeds each position s the drafter's own step-(k − 1) output at s − 1,
    and its attention sees what the decode loop's drafter cache holds at that draft: step-0 keys
    at positions ≤ s − k (written by the round's call over true features) and, for each
    j = 1..k, the step-j key at position s − k + j (the drafts made before it in the same round,
    and itself). So step k at s is the (k + 1)-th draft of a round whose last committed token is
    x_{s−k}, with the drafts equal to the true tokens.

    Args:
      feats: ``[B, W, D]`` float32 input features of step 0 (zeros where there is no previous
        position); tokens: ``[B, W]`` int32 x_s (positions 0 .. W − 1).
    Returns:
      ``steps`` arrays ``[B, W, D]`` float32: f of each step (row s of step k is meaningful for
      s ≥ k; earlier rows start from the window's zero feature).
    """
    l = cfg.layer
    tp, fz = params["train"], params["frozen"]
    p = tp["layer"]
    b, w = tokens.shape
    kv, hd = l.num_kv_heads, l.head_dim
    g = l.num_heads // kv
    inv = jnp.asarray(l.rope_inv_freq())
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
    e = embed_rows(fz, tokens)
    lin = lambda x, name, bias=None: llama.dense(x, p[name], p.get(bias) if bias else None,  # noqa: E731
                                                 p.get(name + "_scale"))
    s_idx = jnp.arange(w)[:, None]
    t_idx = jnp.arange(w)[None, :]
    keys, vals, outs = [], [], []
    x_in = feats.astype(jnp.float32)
    for k in range(steps):
        x = llama.dense(jnp.concatenate([x_in, e], axis=-1), tp["fc"], tp["fc_b"], tp.get("fc_scale"))
        qkv = lin(llama.rms_norm(x, p["attn_norm"], l.rms_norm_eps), "w_qkv", "b_qkv")  # [B, W, KV, G + 2, hd]
        q = llama.rope(qkv[:, :, :, :g].reshape(b, w, kv * g, hd), pos, inv).reshape(b, w, kv, g, hd)
        keys.append(llama.rope(qkv[:, :, :, g], pos, inv))  # [B, W, KV, hd]
        vals.append(qkv[:, :, :, g + 1])
        scale = 1.0 / np.sqrt(hd)
        s0 = jnp.einsum("bskgd,btkd->bkgst", q, keys[0]) * scale
        s0 = jnp.where(t_idx <= s_idx - k, s0, -jnp.inf)  # step-0 keys up to s - k
        diag = [jnp.where(jnp.arange(w) >= k - j,
                          jnp.einsum("bskgd,bskd->bkgs", q, _shift(keys[j], k - j)) * scale, -jnp.inf)
                for j in range(1, k + 1)]  # step-j key at s - k + j
        sc = jnp.concatenate([s0] + [d[..., None] for d in diag], axis=-1)  # [B, KV, G, W, W + k]
        pr = jax.nn.softmax(sc, axis=-1)
        att = jnp.einsum("bkgst,btkd->bskgd", pr[..., :w], vals[0])
        for j in range(1, k + 1):
            att = att + jnp.moveaxis(pr[..., w + j - 1], 3, 1)[..., None] * _shift(vals[j], k - j)[:, :, :, None, :]
        h = x + lin(att.reshape(b, w, kv * g * hd), "wo", "bo")
        gate_up = lin(llama.rms_norm(h, p["mlp_norm"], l.rms_norm_eps), "w_gate_up")
        h = h + lin(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], "w_down")
        f = llama.rms_norm(h, tp["out_norm"], l.rms_norm_eps)
        outs.append(f)
        x_in = _shift(f, 1)
    return outs


def sub_logits(params: dict, f) -> jax.Array:
    """Logits float32 ``[..., |S|]`` over the sub-vocabulary for features ``f [..., D]``.

    The head is ``[|S|, D]`` (float32, or int8 codes with ``head_scale``, see
    :func:`specjax.drafters.eagle_params.quantize_params`). For the few rows of a decode step
    the float32 product is taken as ``head · fᵀ``: on XLA CPU that matrix-vector order reads the
    head about twice as fast as ``f · headᵀ`` (0.6 vs 1.1 ms for 8192 × 576).
    """
    fz = params["frozen"]
    head = fz["head"]
    if head.dtype == jnp.uint8:
        return llama.matmul(f, head, fz["head_scale"], transposed=True)
    lead = f.shape[:-1]
    f2 = f.reshape(-1, f.shape[-1]).astype(head.dtype)
    if f2.shape[0] <= SMALL_ROWS:
        y = jax.lax.dot_general(head, f2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).T
    else:
        y = jnp.einsum("md,sd->ms", f2, head, preferred_element_type=jnp.float32)
    return y.reshape(*lead, head.shape[0])


SMALL_ROWS = 16  # decode-step row counts (batch × 1) up to which sub_logits uses head · fᵀ


def copy_logit(params: dict, f, cand, n) -> jax.Array:
    """Logit of the copy candidate ``[...]``: ``f · E[cand] + b[n-1] + w · f`` (``-inf`` where
    ``n == 0``: no candidate). ``f [..., D]``, ``cand``/``n`` int32 ``[...]``."""
    tp, fz = params["train"], params["frozen"]
    rows = (jnp.take(fz["out_embed"], cand, axis=0).astype(jnp.float32) if "out_embed" in fz
            else embed_rows(fz, cand))
    f = f.astype(jnp.float32)
    b = jnp.take(tp["copy_b"], jnp.maximum(n - 1, 0))
    lc = jnp.sum(f * rows, axis=-1) + b + f @ tp["copy_w"]
    return jnp.where(n > 0, lc, -jnp.inf)


def full_logits(params: dict, f, vocab_size: int, cand=None, n=None) -> jax.Array:
    """Logits over the target vocab ``[B, V]`` for features ``f [B, D]``: ``-inf`` outside the
    sub-vocabulary, and (with ``cand``/``n`` ``[B]``, a copy term) the candidate's logit
    replaced by :func:`copy_logit` where a candidate exists."""
    s = sub_logits(params, f)
    out = jnp.full(s.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    out = out.at[..., params["frozen"]["sub_ids"]].set(s)
    if cand is None:
        return out
    lc = copy_logit(params, f, cand, n)
    rows = jnp.arange(out.shape[0])
    return out.at[rows, cand].set(jnp.where(n > 0, lc, out[rows, cand]))
