"""The block drafter's network (DFlash-style parallel drafting: Chen et al. 2026, "DFlash: Block
Diffusion for Flash Speculative Decoding", arXiv 2602.06036) as pure functions of
``(config, params, ...)``: its configuration (:class:`BlockConfig`), parameters, the context K/V
made from the target's fused features (:func:`context_kv`), the one-pass block call of the decode
loop (:func:`block_forward`), the packed training call over many anchors (:func:`train_forward`) and
the int8 format. The drafter (its decode-loop protocol) is :mod:`specjax.drafters.block`.

Architecture (D = the target's width, γ = the block size of a round):

    c_p   = RMSNorm(fuse · ĥ_p)                       the target's fused features at a committed
                                                      position p (low/middle/high blocks, as EAGLE-3)
    K/V_p = per drafter layer ℓ: the K/V part of w_qkv^ℓ · c_p, RoPE at p   (the context, cached)
    h^0   = [e(x_a) ; m ; … ; m]                      the anchor (the last committed token, at
                                                      position a) and γ mask slots (``mask_embed``)
                                                      at positions a .. a + γ; with ``anchor_feature``
                                                      the anchor's input is e(x_a) + A · c_{a−1}
    h^ℓ   = Llama block over h^{ℓ−1} whose attention sees the context K/V at positions < a and
            the whole block (bidirectional: no causal mask inside the block)
    f_i   = RMSNorm(h^L_i);  q_i(x) ∝ exp(f_i · E[x]) for x in the sub-vocabulary S (0 elsewhere)

Block slot i (1..γ) predicts the token AT position a + i (the i-th draft), so one call gives
q_1..q_γ. The layout follows the published DFlash heads (``fc`` over concatenated target layers and
a ``hidden_norm``, per-layer K/V of the context from the projected features, the target's
embedding and head frozen), except that the mask slot is a trained vector, not a token's
embedding, and there is no per-head q/k norm (a Llama target has none).

``anchor_feature`` (an option, off in the published layout): the anchor's input also carries the
context vector of the position before it, through a trained ``anchor_proj`` A [D, D] (zero at
initialization, so a drafter trained without it starts as it was). An EAGLE-3 drafter's first draft
reads that feature directly (``fc`` over [e(x_a) ; features_{a−1}]); the block's slot 1 otherwise
has to fetch it through attention over the whole context. It does not touch exactness: q_i is
still one function of the committed context, sampled from and put in the ratio as it is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle_params import LayerDims, block_weights, embed_rows, resolve_feature_layers
from specjax.models import llama
from specjax.models.config import ModelConfig

TRAINABLE = ("fuse", "hidden_norm", "mask_embed", "layers", "out_norm", "anchor_proj")  # the last: anchor_feature only


@dataclasses.dataclass(frozen=True)
class BlockConfig(LayerDims):
    """Static shape of a block drafter (hashable).

    layer: a :class:`ModelConfig` of the drafter's stack: ``num_layers`` blocks with the target's
      width, RoPE and eps (``intermediate_size``/heads its own); ``vocab_size`` is the TARGET vocab.
    block_size: the largest γ it was trained for (a round may draft fewer: the first γ slots).
    sub_vocab: |S|, rows of the head.
    feature_layers: the target blocks whose fused outputs it reads
      (:func:`specjax.models.llama.target_features`), projected by ``fuse [len·D, D]``.
    anchor_feature: the anchor's input adds ``anchor_proj · c_{a−1}`` (module docstring).
    """

    layer: ModelConfig
    block_size: int
    sub_vocab: int
    feature_layers: tuple[int, ...]
    anchor_feature: bool = False

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def feature_size(self) -> int:
        return self.layer.hidden_size * len(self.feature_layers)

    def to_json(self) -> dict:
        l = self.layer
        return {"kind": "block", "num_layers": l.num_layers, "hidden_size": l.hidden_size,
                "intermediate_size": l.intermediate_size, "num_heads": l.num_heads, "num_kv_heads": l.num_kv_heads,
                "head_dim": l.head_dim, "vocab_size": l.vocab_size, "block_size": self.block_size,
                "sub_vocab": self.sub_vocab, "feature_layers": list(self.feature_layers),
                "anchor_feature": self.anchor_feature}

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, num_layers: int = 2, block_size: int = 8, sub_vocab: int = 8192,
                   intermediate_size: int | None = None, num_heads: int | None = None,
                   num_kv_heads: int | None = None, feature_layers="eagle3",
                   head_dim: int | None = None, anchor_feature: bool = False) -> "BlockConfig":
        """A block drafter config matching ``target_cfg``'s width, heads and RoPE.

        Raises:
          ValueError: ``num_layers`` or ``block_size`` below 1, no feature layers, or a feature
            layer outside the target."""
        if int(num_layers) < 1:
            raise ValueError(f"a block drafter needs >= 1 layer, got {num_layers}")
        if int(block_size) < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        fl = resolve_feature_layers(feature_layers, target_cfg)
        if not fl:
            raise ValueError("a block drafter reads the target's fused features: give feature layers "
                             "(e.g. eagle3 or 1,14,27)")
        layer = dataclasses.replace(
            target_cfg, num_layers=int(num_layers),
            intermediate_size=int(intermediate_size or target_cfg.intermediate_size),
            num_heads=int(num_heads or target_cfg.num_heads),
            num_kv_heads=int(num_kv_heads or target_cfg.num_kv_heads),
            head_dim=int(head_dim) if head_dim else (target_cfg.head_dim if num_heads is None
                                                     else target_cfg.hidden_size // int(num_heads)))
        return cls(layer=layer, block_size=int(block_size), sub_vocab=int(min(sub_vocab, target_cfg.vocab_size)),
                   feature_layers=fl, anchor_feature=bool(anchor_feature))

    @classmethod
    def from_json(cls, c: dict, target_cfg: ModelConfig) -> "BlockConfig":
        """The config a ``block_drafter.json`` describes, for ``target_cfg``. Raises ValueError."""
        if c.get("hidden_size", target_cfg.hidden_size) != target_cfg.hidden_size or \
                c.get("vocab_size", target_cfg.vocab_size) != target_cfg.vocab_size:
            raise ValueError(f"the block drafter's width/vocabulary ({c.get('hidden_size')}/{c.get('vocab_size')}) "
                             f"are not the target's ({target_cfg.hidden_size}/{target_cfg.vocab_size})")
        return cls.for_target(target_cfg, c["num_layers"], c["block_size"], c["sub_vocab"], c["intermediate_size"],
                              c["num_heads"], c["num_kv_heads"], tuple(c["feature_layers"]), c.get("head_dim"),
                              bool(c.get("anchor_feature", False)))


def init_params(cfg: BlockConfig, seed: int = 0, target_final_norm=None) -> dict:
    """Random trainable parameters: the layers from the weight table (N(0, 0.02), norms 1),
    ``fuse`` N(0, 1/(len·D)) (unit-RMS inputs), ``mask_embed`` N(0, 0.02), the output norm the
    target's final norm when given (so f lives where the target's h does); with
    ``anchor_feature``, ``anchor_proj`` zeros [D, D]."""
    l = cfg.layer
    d = l.hidden_size
    specs = block_weights()
    key = jax.random.PRNGKey(seed)
    layers = []
    for i in range(cfg.num_layers):
        ks = iter(jax.random.split(jax.random.fold_in(key, 100 + i), 64))
        layers.append({s.name: llama.init_weight(s, l, lambda: next(ks)) for s in specs})
    fk, mk = jax.random.split(key)
    out_norm = jnp.ones((d,), jnp.float32) if target_final_norm is None else jnp.asarray(target_final_norm, jnp.float32)
    tp = {"fuse": jax.random.normal(fk, (cfg.feature_size, d), jnp.float32) / np.sqrt(cfg.feature_size),
          "hidden_norm": jnp.ones((d,), jnp.float32),
          "mask_embed": 0.02 * jax.random.normal(mk, (d,), jnp.float32),
          "layers": layers, "out_norm": out_norm}
    return with_anchor_proj(cfg, tp)


def with_anchor_proj(cfg: BlockConfig, tp: dict) -> dict:
    """``tp`` with a zero ``anchor_proj [D, D]`` added when ``cfg.anchor_feature`` asks for one and
    ``tp`` has none (a warm start from a drafter trained without it: the same function at first)."""
    if not cfg.anchor_feature or "anchor_proj" in tp:
        return tp
    d = cfg.layer.hidden_size
    return dict(tp, anchor_proj=jnp.zeros((d, d), jnp.float32))


def new_cache(cfg: BlockConfig, batch: int, max_len: int, dtype=jnp.float32) -> llama.KVCache:
    """The context K/V of every drafter layer, ``[B, KV, max_len, hd]`` each."""
    return llama.KVCache.create(cfg.layer, batch, max_len, dtype)


def _lin(p, x, name, bias=None):
    return llama.dense(x, p[name], p.get(bias) if bias else None, p.get(name + "_scale"))


def context(cfg: BlockConfig, tp: dict, feats) -> jax.Array:
    """``c = RMSNorm(fuse · ĥ)`` ``[..., D]`` float32 from the target's fused features ``[..., len·D]``."""
    c = llama.matmul(feats.astype(jnp.float32), tp["fuse"], tp.get("fuse_scale"))
    return llama.rms_norm(c, tp["hidden_norm"], cfg.layer.rms_norm_eps)


def context_kv(cfg: BlockConfig, tp: dict, feats, positions, c=None) -> list[tuple[jax.Array, jax.Array]]:
    """Per drafter layer the context ``(K, V)`` ``[B, KV, T, hd]`` (RoPE at ``positions [B, T]``) of the
    target's fused features ``feats [B, T, len·D]`` (``c``: their :func:`context` if already made)."""
    l = cfg.layer
    g = l.num_heads // l.num_kv_heads
    c = context(cfg, tp, feats) if c is None else c
    inv = jnp.asarray(l.rope_inv_freq())
    out = []
    for p in tp["layers"]:
        qkv = _lin(p, c, "w_qkv", "b_qkv")  # [B, T, KV, G + 2, hd]
        k = llama.rope(qkv[:, :, :, g], positions, inv)
        out.append((k.transpose(0, 2, 1, 3), qkv[:, :, :, g + 1].transpose(0, 2, 1, 3)))
    return out


def write_context(cfg: BlockConfig, tp: dict, cache: llama.KVCache, feats, start) -> llama.KVCache:
    """``cache`` with the context K/V of ``feats [B, W, len·D]`` written at slots ``start [B] + arange(W)``
    (= their positions)."""
    w = feats.shape[1]
    pos = start[:, None] + jnp.arange(w, dtype=jnp.int32)
    kvs = context_kv(cfg, tp, feats, pos)
    ks = [jax.vmap(_put)(kc, k, start) for kc, (k, _) in zip(cache.k, kvs)]
    vs = [jax.vmap(_put)(vc, v, start) for vc, (_, v) in zip(cache.v, kvs)]
    return llama.KVCache(k=ks, v=vs, lengths=cache.lengths)


def _put(c, u, s):
    return jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (0, s, 0))


def _block_layer(cfg: BlockConfig, p: dict, h, positions, ctx_scores, ctx_values):
    """One drafter layer on the block ``h [B, T, D]``: attention over the context (the callables
    give its scores ``[B, KV, G, T, S]`` already masked, and its weighted values) and over the whole
    block (no mask), then the SwiGLU MLP."""
    l = cfg.layer
    b, t = h.shape[:2]
    kv, hd = l.num_kv_heads, l.head_dim
    g = l.num_heads // kv
    inv = jnp.asarray(l.rope_inv_freq())
    x = llama.rms_norm(h, p["attn_norm"], l.rms_norm_eps)
    qkv = _lin(p, x, "w_qkv", "b_qkv")
    q = llama.rope(qkv[:, :, :, :g].reshape(b, t, kv * g, hd), positions, inv).reshape(b, t, kv, g, hd)
    kb = llama.rope(qkv[:, :, :, g], positions, inv)  # [B, T, KV, hd]
    vb = qkv[:, :, :, g + 1]
    scale = 1.0 / np.sqrt(hd)
    sc = ctx_scores(q) * scale  # [B, KV, G, T, S]
    sb = jnp.einsum("btkgd,bskd->bkgts", q, kb) * scale  # [B, KV, G, T, T]
    m = jnp.maximum(jnp.max(sc, axis=-1), jnp.max(sb, axis=-1))[..., None]
    ec, eb = jnp.exp(sc - m), jnp.exp(sb - m)
    den = jnp.sum(ec, axis=-1) + jnp.sum(eb, axis=-1)  # [B, KV, G, T]
    att = ctx_values(ec) + jnp.einsum("bkgts,bskd->btkgd", eb, vb)
    att = att / jnp.moveaxis(den, 3, 1)[..., None]
    h = h + _lin(p, att.reshape(b, t, kv * g * hd), "wo", "bo")
    gate_up = _lin(p, llama.rms_norm(h, p["mlp_norm"], l.rms_norm_eps), "w_gate_up")
    return h + _lin(p, jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], "w_down")


def block_input(tp: dict, fz: dict, anchor, gamma: int, prev=None) -> jax.Array:
    """``[e(anchor) ; m × γ]`` ``[B, γ + 1, D]`` float32: the anchor token's embedding (the target's
    table in ``fz``, :func:`~specjax.drafters.eagle_params.embed_rows`), then γ mask slots.
    ``prev [B, D]``: the context vector c_{a−1} of the position before the anchor, added to the
    anchor's input through ``anchor_proj`` (``anchor_feature`` drafters; None otherwise)."""
    e = embed_rows(fz, anchor)
    if prev is not None:
        e = e + llama.matmul(prev.astype(jnp.float32), tp["anchor_proj"], tp.get("anchor_proj_scale"))
    e = e[:, None]
    m = jnp.broadcast_to(tp["mask_embed"].astype(jnp.float32), (anchor.shape[0], gamma, e.shape[-1]))
    return jnp.concatenate([e, m], axis=1)


def block_forward(cfg: BlockConfig, params: dict, cache: llama.KVCache, anchor, anchor_pos, gamma: int,
                  prev=None) -> jax.Array:
    """The decode loop's one drafter call: the block ``[anchor, mask × γ]`` at positions
    ``anchor_pos [B] + 0..γ`` over the context slots ``< anchor_pos`` of ``cache``; ``prev [B, D]``
    the context vector at ``anchor_pos − 1`` (read only with ``cfg.anchor_feature``).

    Returns ``f [B, γ, D]`` float32, the features of block slots 1..γ (slot i predicts the token
    at ``anchor_pos + i``)."""
    tp, fz = params["train"], params["frozen"]
    h = block_input(tp, fz, anchor, gamma, prev if cfg.anchor_feature else None)
    b, t = h.shape[:2]
    pos = anchor_pos[:, None] + jnp.arange(t, dtype=jnp.int32)
    s = cache.max_len
    visible = (jnp.arange(s)[None, :] < anchor_pos[:, None])[:, None, None, None, :]  # [B, 1, 1, 1, S]
    for i, p in enumerate(tp["layers"]):
        kc, vc = cache.k[i].astype(jnp.float32), cache.v[i].astype(jnp.float32)
        h = _block_layer(cfg, p, h, pos,
                         lambda q, kc=kc: jnp.where(visible, jnp.einsum("btkgd,bksd->bkgts", q, kc), -jnp.inf),
                         lambda e, vc=vc: jnp.einsum("bkgts,bksd->btkgd", e, vc))
    return llama.rms_norm(h[:, 1:], tp["out_norm"], cfg.layer.rms_norm_eps)


def train_forward(cfg: BlockConfig, params: dict, feats, tokens, anchors, gamma: int) -> jax.Array:
    """Teacher-forced training call over a window: every anchor's block at once, each seeing the
    window's context before it (what the decode loop's drafter sees at that anchor).

    Args:
      feats: ``[B, W, len·D]`` the target's fused features at positions 0 .. W − 1.
      tokens: ``[B, W]`` int32 the window's tokens.
      anchors: ``[B, A]`` int32 anchor positions a (1 <= a; a + γ − 1 <= W − 1, the last label position).
    Returns:
      ``f [B, A, γ, D]`` float32: slot i of anchor a predicts the token at a + i.
    """
    tp, fz = params["train"], params["frozen"]
    b, w = tokens.shape
    a_n = anchors.shape[1]
    t = gamma + 1
    c = context(cfg, tp, feats)  # [B, W, D]
    kvs = context_kv(cfg, tp, feats, jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w)), c)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    prev = None
    if cfg.anchor_feature:  # c_{a−1} [B·A, D]
        prev = jnp.take_along_axis(c, (anchors - 1)[:, :, None], axis=1).reshape(b * a_n, -1)
    h = block_input(tp, fz, anchor_tok.reshape(-1), gamma, prev).reshape(b, a_n, t, -1)
    h = h.reshape(b * a_n, t, -1)
    pos = (anchors.reshape(-1)[:, None] + jnp.arange(t, dtype=jnp.int32))  # [B·A, T]
    visible = (jnp.arange(w)[None, :] < anchors.reshape(-1)[:, None])[:, None, None, None, :]  # [B·A, 1, 1, 1, W]
    def scores(q, k):  # q [B·A, T, KV, G, hd], k [B, KV, W, hd] -> [B·A, KV, G, T, W], context < anchor
        s = jnp.einsum("batkgd,bkwd->bakgtw", q.reshape(b, a_n, *q.shape[1:]), k)
        return jnp.where(visible, s.reshape(b * a_n, *s.shape[2:]), -jnp.inf)

    def values(e, v):  # e [B·A, KV, G, T, W], v [B, KV, W, hd] -> [B·A, T, KV, G, hd]
        o = jnp.einsum("bakgtw,bkwd->batkgd", e.reshape(b, a_n, *e.shape[1:]), v)
        return o.reshape(b * a_n, *o.shape[2:])

    for p, (k, v) in zip(tp["layers"], kvs):
        h = _block_layer(cfg, p, h, pos, lambda q, k=k: scores(q, k), lambda e, v=v: values(e, v))
    f = llama.rms_norm(h[:, 1:], tp["out_norm"], cfg.layer.rms_norm_eps)
    return f.reshape(b, a_n, gamma, -1)


def quantize_params(params: dict) -> dict:
    """The ``int8`` format of a block drafter's ``{"train", "frozen"}`` parameters: ``fuse``, the
    layers' matrices and the sub-vocabulary head become 8-bit block codes with a float32
    ``<name>_scale`` (:func:`specjax.models.llama.quantize_int8`), ``anchor_proj`` too when there is
    one; norms, ``mask_embed`` and the embedding stay float32. q stays exactly what is sampled
    (exactness does not depend on it)."""
    tp = dict(params["train"])
    tp["fuse"], tp["fuse_scale"] = llama.quantize_int8(tp["fuse"], 0)
    if "anchor_proj" in tp:
        tp["anchor_proj"], tp["anchor_proj_scale"] = llama.quantize_int8(tp["anchor_proj"], 0)
    layers = []
    for layer in tp["layers"]:
        layer = dict(layer)
        for spec in block_weights():
            if spec.quant_axis is not None:
                layer[spec.name], layer[spec.name + "_scale"] = llama.quantize_int8(layer[spec.name], spec.quant_axis)
        layers.append(layer)
    tp["layers"] = layers
    fz = dict(params["frozen"])
    fz["head"], fz["head_scale"] = llama.quantize_int8(fz["head"], 1)
    return {"train": tp, "frozen": fz}
