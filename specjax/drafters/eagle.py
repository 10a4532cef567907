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
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.core.drafting import DraftContext, Proposal, TreeProposal, TreeShape
from specjax.core.tree import DraftTree, block_attention_mask, build_dynamic_tree, positions
from specjax.drafters.ngram import lookup_candidate
from specjax.models import llama, weights
from specjax.core.sampling import sample

COPY_KEYS = ("copy_w", "copy_b")  # the copy term's parameters (present iff copy_ngram > 0)
TRAINABLE = ("fc", "fc_b", "layer", "out_norm", "fuse") + COPY_KEYS


def block_weights() -> tuple[llama.WeightSpec, ...]:
    """The drafter block's weights: the per-layer entries of :data:`specjax.models.weights.WEIGHTS`
    every target block has (no ``when`` condition; no biases), in table order."""
    return tuple(s for s in weights.WEIGHTS if s.per_layer and s.when is None)


def layer_keys() -> tuple[str, ...]:
    """Names of the block's weights (``attn_norm``, ``w_qkv``, …, ``w_down``)."""
    return tuple(s.name for s in block_weights())


def layer_matmuls() -> tuple[str, ...]:
    """Names of the block's matrices (quantized in the int8 format)."""
    return tuple(s.name for s in block_weights() if s.quant_axis is not None)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static shape of an EAGLE drafter (hashable).

    layer: a one-layer :class:`ModelConfig` (width, heads, RoPE, eps of the target; its
      ``intermediate_size`` is the drafter's MLP width; ``vocab_size`` is the TARGET vocab).
    sub_vocab: |S|, rows of the head.
    copy_ngram: longest n-gram of the copy term (0 = none).
    feature_layers: the target blocks whose outputs the drafter reads (EAGLE-3's fused low, middle
      and high features, :func:`specjax.models.llama.target_features`), projected to the width by
      the trained ``fuse [len·D, D]``; ``()``: the target's final hidden state (EAGLE-1/2).
    """

    layer: ModelConfig
    sub_vocab: int
    copy_ngram: int = 0
    feature_layers: tuple[int, ...] = ()

    @property
    def feature_size(self) -> int:
        """Width of the target feature the decode loop hands over (``target_hidden``'s last axis)."""
        return self.layer.hidden_size * max(1, len(self.feature_layers))

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.layer.max_position_embeddings

    def to_json(self) -> dict:
        l = self.layer
        return {"kind": "eagle", "hidden_size": l.hidden_size, "intermediate_size": l.intermediate_size,
                "num_heads": l.num_heads, "num_kv_heads": l.num_kv_heads, "head_dim": l.head_dim,
                "sub_vocab": self.sub_vocab, "vocab_size": l.vocab_size, "copy_ngram": self.copy_ngram,
                "feature_layers": list(self.feature_layers)}

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, sub_vocab: int, intermediate_size: int | None = None,
                   num_heads: int | None = None, num_kv_heads: int | None = None,
                   copy_ngram: int = 0, feature_layers=()) -> "EagleConfig":
        """A drafter config matching ``target_cfg``'s width, heads and RoPE. ``copy_ngram``:
        longest n-gram of the copy term (0 = no copy term); ``feature_layers``: the target blocks
        whose fused outputs it reads (:func:`resolve_feature_layers`: indices, ``"1,14,27"`` or
        ``"eagle3"``; ``()``: the final hidden state).

        Raises:
          ValueError: a negative ``copy_ngram`` or a feature layer outside the target."""
        if copy_ngram < 0:
            raise ValueError(f"copy_ngram must be >= 0 (0 = no copy term), got {copy_ngram}")
        layer = dataclasses.replace(
            target_cfg, num_layers=1,
            intermediate_size=int(intermediate_size or target_cfg.intermediate_size),
            num_heads=int(num_heads or target_cfg.num_heads),
            num_kv_heads=int(num_kv_heads or target_cfg.num_kv_heads),
            head_dim=target_cfg.head_dim if num_heads is None else target_cfg.hidden_size // int(num_heads),
        )
        return cls(layer=layer, sub_vocab=int(min(sub_vocab, target_cfg.vocab_size)), copy_ngram=int(copy_ngram),
                   feature_layers=resolve_feature_layers(feature_layers or (), target_cfg))


def resolve_feature_layers(spec, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target blocks a fused-feature drafter reads: ``None``/``()`` → ``()`` (the final hidden
    state); ``"eagle3"`` → a low, a middle and a high block, ``(1, L/2 − 1, L − 3)`` of an L-block
    target (0-based; EAGLE-3, Li et al. 2025, fuses one early, one middle and one late layer);
    ``"1,14,27"`` or a sequence of ints → those blocks.

    Raises:
      ValueError: an index outside the target's blocks, or not integers."""
    if spec is None or spec == () or spec == "":
        return ()
    n = target_cfg.num_layers
    if spec == "eagle3":
        return llama.check_feature_layers(sorted({min(1, n - 1), max(0, n // 2 - 1), max(0, n - 3)}), target_cfg)
    if isinstance(spec, str):
        try:
            spec = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(f"feature layers must be comma-separated block indices or eagle3, got {spec!r}") from None
    return llama.check_feature_layers(spec, target_cfg)


def init_params(cfg: EagleConfig, seed: int = 0, target_final_norm=None) -> dict:
    """Random trainable parameters (N(0, 0.02); norms 1; the output norm copies the
    target's final norm when given, so f lives where the target's h does)."""
    l = cfg.layer
    d = l.hidden_size
    specs = block_weights()
    ks = jax.random.split(jax.random.PRNGKey(seed), 1 + sum(len(s.tensors()) for s in specs if s.init == "normal"))
    n = lambda k, s: 0.02 * jax.random.normal(k, s, jnp.float32)
    rest = iter(ks[1:])  # one key per checkpoint tensor (part), in table order
    layer = {s.name: llama.init_weight(s, l, lambda: next(rest)) for s in specs}
    out_norm = jnp.ones((d,), jnp.float32) if target_final_norm is None else jnp.asarray(target_final_norm, jnp.float32)
    tp = {"fc": n(ks[0], (2 * d, d)), "fc_b": jnp.zeros((d,), jnp.float32), "layer": layer, "out_norm": out_norm}
    if cfg.feature_layers:  # unit-RMS inputs of width len·D: N(0, 1/(len·D)) keeps the output near unit RMS
        fk = jax.random.fold_in(ks[0], 1)
        tp["fuse"] = jax.random.normal(fk, (cfg.feature_size, d), jnp.float32) / np.sqrt(cfg.feature_size)
    tp.update(init_copy_params(cfg))
    return tp


def init_copy_params(cfg: EagleConfig) -> dict:
    """The copy term's parameters (zeros: the candidate starts with its plain head logit);
    empty without a copy term."""
    if not cfg.copy_ngram:
        return {}
    return {"copy_w": jnp.zeros((cfg.hidden_size,), jnp.float32), "copy_b": jnp.zeros((cfg.copy_ngram,), jnp.float32)}


def _value(params, name):
    return params[name][...] if name in params else None


def target_embed(target) -> jax.Array:
    """The target's token embedding ``[V, D]`` float32 (also its tied head); the same
    array for a float32 target, dequantized for bfloat16/int8 targets."""
    e = target.params["embed"][...]
    scale = _value(target.params, "embed_scale")
    if scale is not None:
        return e.astype(jnp.float32) * scale[:, None]
    return e if e.dtype == jnp.float32 else e.astype(jnp.float32)


def frozen_params(target, sub_ids) -> dict:
    """The parts taken from the target: full embedding (input lookups), head rows of the
    sub-vocabulary (``[|S|, D]``, from the tied embedding or the untied head) and ``sub_ids``;
    for an untied head also ``out_embed`` (``[V, D]``, every head row, for the copy term)."""
    sub_ids = jnp.asarray(np.asarray(sub_ids, np.int32))
    emb = target_embed(target)
    if target.config.tie_word_embeddings:
        head = jnp.take(emb, sub_ids, axis=0)
    else:
        w = target.params["lm_head"][...].astype(jnp.float32)
        scale = _value(target.params, "lm_head_scale")
        if scale is not None:
            w = w * scale[None, :]
        head = jnp.take(w, sub_ids, axis=1).T
        return {"embed": emb, "head": jnp.asarray(head, jnp.float32), "sub_ids": sub_ids, "out_embed": w.T}
    return {"embed": emb, "head": jnp.asarray(head, jnp.float32), "sub_ids": sub_ids}


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
    e = jnp.take(fz["embed"], tokens, axis=0).astype(jnp.float32)
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
    e = jnp.take(fz["embed"], tokens, axis=0).astype(jnp.float32)
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

    The head is ``[|S|, D]`` (float32, or int8 with a per-row ``head_scale``, see
    :func:`quantize_params`). For the few rows of a decode step the float32 product is
    taken as ``head · fᵀ``: on XLA CPU that matrix-vector order reads the head about twice
    as fast as ``f · headᵀ`` (0.6 vs 1.1 ms for 8192 × 576).
    """
    fz = params["frozen"]
    head = fz["head"]
    if head.dtype == jnp.int8:
        return llama.matmul(f, head, fz["head_scale"], transposed=True)
    lead = f.shape[:-1]
    f2 = f.reshape(-1, f.shape[-1]).astype(head.dtype)
    if f2.shape[0] <= SMALL_ROWS:
        y = jax.lax.dot_general(head, f2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).T
    else:
        y = jnp.einsum("md,sd->ms", f2, head, preferred_element_type=jnp.float32)
    return y.reshape(*lead, head.shape[0])


SMALL_ROWS = 16  # decode-step row counts (batch × 1) up to which sub_logits uses head · fᵀ


def quantize_params(params: dict) -> dict:
    """The ``int8`` weight format of a drafter's ``{"train", "frozen"}`` parameters.

    ``fc`` (and ``fuse``), the block's four matrices (``w_qkv``, ``wo``, ``w_gate_up``, ``w_down``, stored
    ``[in, *out]``) and the sub-vocabulary head (``[|S|, D]``) become symmetric
    per-output-channel int8 with a float32 ``<name>_scale``
    (:func:`specjax.models.llama.quantize_int8`); activations are quantized per row on the
    fly (:func:`specjax.models.llama.matmul`). Norms, biases, the copy term and the
    embedding used for input lookups stay float32. It lets the drafter run in an int8
    target's format; on the reference CPU a γ = 1 draft call takes about as long as in
    float32 (≈ 2.8 ms: the shipped drafter's weights fit in the L3 cache). The drafter
    stays exact (q is still exactly what is sampled); only its guesses change slightly
    (in-loop acceptance 0.496 on the evaluation split with an int8 target, BENCHMARKS.md).
    """
    tp = dict(params["train"])
    layer = dict(tp["layer"])
    tp["fc"], tp["fc_scale"] = llama.quantize_int8(tp["fc"], 0)
    if "fuse" in tp:
        tp["fuse"], tp["fuse_scale"] = llama.quantize_int8(tp["fuse"], 0)
    for spec in block_weights():
        if spec.quant_axis is not None:
            layer[spec.name], layer[spec.name + "_scale"] = llama.quantize_int8(layer[spec.name], spec.quant_axis)
    tp["layer"] = layer
    fz = dict(params["frozen"])
    fz["head"], fz["head_scale"] = llama.quantize_int8(fz["head"], 1)
    return {"train": tp, "frozen": fz}


def copy_logit(params: dict, f, cand, n) -> jax.Array:
    """Logit of the copy candidate ``[...]``: ``f · E[cand] + b[n-1] + w · f`` (``-inf`` where
    ``n == 0``: no candidate). ``f [..., D]``, ``cand``/``n`` int32 ``[...]``."""
    tp, fz = params["train"], params["frozen"]
    rows = jnp.take(fz.get("out_embed", fz["embed"]), cand, axis=0).astype(jnp.float32)
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


@dataclasses.dataclass(frozen=True, eq=False)
class EagleDrafter:
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

    @property
    def always_proposes(self) -> bool:
        """γ drafts every round unless a confidence cut-off is set (:class:`~specjax.core.drafting.Drafter`)."""
        return self.min_confidence <= 0.0

    def _key(self):
        return (self.config, self.name, float(self.min_confidence))

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, EagleDrafter) and self._key() == other._key()

    def init_state(self, params, context: DraftContext, max_len: int):
        b, s = context.tokens.shape
        h = input_features(self.config, params, context.target_hidden)  # [B, P, D] prompt features
        p = h.shape[1]
        cache = new_cache(self.config, b, max_len)
        feats = jnp.concatenate([jnp.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        _, cache = forward(self.config, params, feats, context.tokens[:, :p], pos, cache)
        idx = jnp.clip(context.lengths - 2, 0, p - 1)
        h0 = jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]
        h0 = jnp.where((context.lengths >= 2)[:, None], h0, 0.0)
        return {"cache": cache, "h0": h0.astype(jnp.float32), "fresh": jnp.ones((b,), bool)}

    def _reencode(self, params, state, context: DraftContext):
        """Step 1 of a round (module docstring): the drafter call over the last call's true target
        features at positions L0 .. L0 + W − 1 (W = ``target_hidden.shape[1]``). Returns
        ``(f1 [B, D] the feature at position L − 1, the drafter cache, the features fed [B, W, D])``."""
        lengths = context.lengths
        n = context.last_accepted
        hid = input_features(self.config, params, context.target_hidden)  # [B, γ+1, D] (a tree: [B, D+1, D])
        fresh = state["fresh"]
        hid = jnp.where(fresh[:, None, None], hid.at[:, 0].set(state["h0"]), hid)
        l0 = lengths - n - 1
        buf = context.tokens.shape[1]
        pos = l0[:, None] + jnp.arange(hid.shape[1], dtype=jnp.int32)
        toks = jnp.take_along_axis(context.tokens, jnp.minimum(pos, buf - 1), axis=1)
        f, cache = forward(self.config, params, hid, toks, pos, state["cache"])
        f1 = jnp.take_along_axis(f, n[:, None, None], axis=1)[:, 0]  # position L-1
        return f1, cache, hid

    def _logits(self, params, feat, tbuf, tlen, vocab_size: int):
        """Logits ``[M, V]`` for features ``feat [M, D]`` whose contexts are ``tbuf [M, L]``,
        ``tlen [M]`` (the copy term's candidate is looked up there)."""
        cfg = self.config
        if cfg.copy_ngram:
            cand, cn = lookup_candidate(tbuf, tlen, cfg.copy_ngram)
            return full_logits(params, feat, vocab_size, cand, cn)
        return full_logits(params, feat, vocab_size)

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
        f1, cache, _ = self._reencode(params, state, context)
        fresh = state["fresh"]

        rows = jnp.arange(lengths.shape[0])

        def draw(feat, key_col, tbuf, tlen):
            logits = self._logits(params, feat, tbuf, tlen, vocab_size)
            probs = context.sampling.process(logits)
            conf = self._confidence(logits)
            return jax.vmap(sample)(key_col, probs), (probs, conf)

        tbuf = context.tokens
        x1, (q1, c1) = draw(f1, keys[:, 0], tbuf, lengths)

        def step(carry, inp):
            tok, feat, cache, tbuf = carry
            i, key_col = inp
            p_ = (lengths - 1 + i)[:, None]
            fo, cache = forward(cfg, params, feat[:, None], tok[:, None], p_, cache)
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
        state = {"cache": cache, "h0": state["h0"], "fresh": jnp.zeros_like(fresh)}
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
        f1, cache, hid = self._reencode(params, state, context)
        h_root = jnp.take_along_axis(hid, n[:, None, None], axis=1)[:, 0]  # h at L-2: the root's input
        root_tok = jnp.take_along_axis(context.tokens, (lengths - 1)[:, None], axis=1)  # [B, 1]
        d_max, k = shape.depth, shape.topk
        hidden = cfg.hidden_size

        def ranked(logits):  # [M, V] -> the ranking distribution (0 below min_confidence)
            probs = jax.nn.softmax(logits, axis=-1)
            if self.min_confidence > 0:
                probs = jnp.where((self._confidence(logits) >= self.min_confidence)[..., None], probs, 0.0)
            return probs

        root_probs = ranked(self._logits(params, f1, context.tokens, lengths, vocab_size))
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
            fo, _ = forward(cfg, params, jnp.concatenate([h_root[:, None], feats.reshape(b, w * level, hidden)], 1),
                            jnp.concatenate([root_tok, ptok], axis=1), positions(forest, lengths), cache,
                            tree_mask=block_attention_mask(forest))
            f_front = fo[:, level::level]  # [B, W]: each lane's last node (block index (w+1)·level)
            feat_of["f"] = jax.vmap(lambda a, i, v: a.at[i].set(v))(feat_of["f"], frontier, f_front)
            tb = tlen = None
            if cfg.copy_ngram:  # each lane's copy candidate sees the committed tokens and its path
                tb = jnp.broadcast_to(context.tokens[:, None, :], (b, w, buf))
                steps = ptok.reshape(b, w, level)
                for i in range(level):
                    slot = jnp.minimum(lengths + i, buf - 1)
                    tb = tb.at[jnp.arange(b)[:, None], jnp.arange(w)[None, :], slot[:, None]].set(steps[:, :, i])
                tb = tb.reshape(b * w, buf)
                tlen = jnp.repeat(jnp.minimum(lengths + level, buf), w)
            logits = self._logits(params, f_front.reshape(b * w, hidden), tb, tlen, vocab_size)
            return ranked(logits).reshape(b, w, vocab_size)

        tree, _ = build_dynamic_tree(root_probs, expand, depth=d_max, children=k, expand_width=k,
                                     num_nodes=shape.nodes)
        state = {"cache": cache, "h0": state["h0"], "fresh": jnp.zeros_like(state["fresh"])}
        return TreeProposal(tree, "deterministic", state)


# ------------------------------------------------------------------ fingerprint / files
def target_fingerprint(target) -> dict:
    """What identifies the target a drafter was trained for: ``config`` (SHA-256 of its
    config), ``tokenizer`` (:meth:`Tokenizer.fingerprint`) — both compared exactly — and
    ``weights``: a few weight statistics (L2 norms of 8 first and 8 last embedding rows,
    the first 16 entries of the final norm and of layer 0's attention norm), compared with
    a 2% tolerance so bfloat16/int8 loads of the same weights still match."""
    import hashlib

    cfg = target.config
    c = json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
                   sort_keys=True, default=str)
    emb = np.asarray(target_embed(target)[np.r_[0:8, cfg.vocab_size - 8:cfg.vocab_size]], np.float64)
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    w = np.concatenate([np.linalg.norm(emb, axis=1), f32(target.params["final_norm"][...])[:16],
                        f32(target.params["layers"][0]["attn_norm"][...])[:16]])
    tok = getattr(target, "tokenizer", None)
    return {"config": hashlib.sha256(c.encode()).hexdigest(),
            "tokenizer": tok.fingerprint() if tok is not None else None,
            "weights": [round(float(x), 6) for x in w]}


def fingerprint_mismatch(saved: dict, fp: dict) -> str | None:
    """Why ``fp`` (the loaded target) is not ``saved`` (the trained-for target), or None."""
    if saved.get("tokenizer") != fp["tokenizer"]:
        return "its tokenizer differs"
    if saved.get("config") != fp["config"]:
        return "its config differs"
    a, b = np.asarray(saved.get("weights", []), float), np.asarray(fp["weights"], float)
    if a.shape != b.shape or not np.allclose(a, b, rtol=2e-2, atol=1e-3):
        return "its weights differ"
    return None


def flat_trainable(tp: dict, cfg: EagleConfig) -> dict[str, np.ndarray]:
    """``{file name: array}`` of the trainable parameters; the block's fused weights are written
    as their parts (``layer.wq``, ``layer.wk``, …: the file layout of every drafter so far)."""
    out = {"fc": tp["fc"], "fc_b": tp["fc_b"], "out_norm": tp["out_norm"]}
    out.update({k: tp[k] for k in COPY_KEYS + ("fuse",) if k in tp})
    for spec in block_weights():
        for t, a in weights.split(spec, cfg.layer, np.asarray(tp["layer"][spec.name])):
            out[f"layer.{t.name}"] = a
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def unflat_trainable(flat: dict, cfg: EagleConfig) -> dict:
    """The inverse of :func:`flat_trainable` (the parts of a fused block weight concatenated)."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    layer = {}
    for spec in block_weights():
        parts = [f32(flat[f"layer.{t.name}"]) for t in spec.tensors()]
        layer[spec.name] = weights.fuse(spec, cfg.layer, parts) if spec.parts else parts[0]
    tp = {"fc": f32(flat["fc"]), "fc_b": f32(flat["fc_b"]), "out_norm": f32(flat["out_norm"]), "layer": layer}
    tp.update({k: jnp.asarray(flat[k], jnp.float32) for k in COPY_KEYS + ("fuse",) if k in flat})
    return tp


def save_drafter(path: str, cfg: EagleConfig, trainable: dict, sub_ids, target, extra: dict | None = None,
                 dtype: str = "float32") -> None:
    """Write ``model.safetensors`` (trainable weights + ``sub_ids``) and ``drafter.json``
    (config, target fingerprint) into the directory ``path`` (created; must not exist or be empty)."""
    import os

    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = flat_trainable(trainable, cfg)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    tensors["sub_ids"] = np.asarray(sub_ids, np.int32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "specjax-eagle"})
    meta = {"config": cfg.to_json(), "target_fingerprint": target_fingerprint(target), "target_name": target.name}
    meta.update(extra or {})
    with open(os.path.join(path, "drafter.json"), "w") as f:
        json.dump(meta, f, indent=2)


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
        why = fingerprint_mismatch(meta.get("target_fingerprint") or {}, target_fingerprint(target))
        if why:
            raise CheckpointError(
                f"the drafter in {path} was trained for target {meta.get('target_name')!r}, not for "
                f"{target.name!r} ({why}); use --draft ngram, or train one for it with `specjax distill`")
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
