"""Published EAGLE-3 draft heads as specjax drafters (Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test", arXiv 2503.01840).

A head trained by the EAGLE authors (``SafeAILab/EAGLE``, ``eagle/model/cnets.py``), SpecForge or
AngelSlim for a target (Llama-3.1-8B-Instruct, Qwen3-8B, …) is a directory with ``config.json``
(``architectures: ["LlamaForCausalLMEagle3"]``) and ``model.safetensors``; the files are read by
:mod:`specjax.drafters.eagle3_head_files`. Its network, per drafter position s (D = the head's
width, D_t = the target's):

    g_s   = fc · [a_s ; b_s ; c_s]            fc [D, 3·D_t], no bias: the RAW residual streams of
                                              three target blocks (not normalized) at position s
    r     = h_s                               h_s = g_s from the target, or the head's own
                                              pre-norm output o_{s−1} from draft 2 on
    z     = [input_layernorm(e(x_{s+1})) ; hidden_norm(h_s)]          2D wide
    o_s   = r + o_proj(attention(q_proj z, k_proj z, v_proj z))       one Llama layer whose
    o_s   = o_s + down(silu(gate(m)) · up(m)),  m = post_attention_layernorm(o_s)   q/k/v read 2D
    q(x_{s+2}) ∝ exp(lm_head · norm(o_s)) over the draft vocabulary (|S| rows),
                 placed at target id d + d2t[d] of each draft id d, probability 0 elsewhere

(``o_s``, before ``norm``, is what the next draft step feeds back as h: ``cnets.py`` feeds
``out_hidden``, and applies ``fc`` only to the wider target features.) ``e`` is the head's own
``embed_tokens`` when the file has one, else the target's embedding.

**Which blocks.** The reference collects ``hidden_states`` BEFORE running layer ``idx`` for
``idx in (2, N // 2, N − 3)`` of an N-layer target (``modeling_llama_kv.py``; vLLM's
``aux_hidden_state_layers`` likewise): Hugging Face ``output_hidden_states`` indices, where index 0
is the embedding output and index i the output of block i − 1. So the default reads specjax
blocks ``(1, N // 2 − 1, N − 4)`` (0-based block outputs), in that order. A head's
``config.json`` may name other indices in ``eagle_config.eagle_aux_hidden_state_layer_ids``
(SpecForge/vLLM's key, same convention), and :func:`specjax.drafters.eagle3_head_files.load_head`
takes ``layers=`` (same convention) over both.

**Layout in specjax's loop.** The drafter reuses :class:`~specjax.drafters.eagle.EagleDrafter`'s
propose and EAGLE-2 tree machinery through its three network seams (``features_in``,
``net_forward``, ``head_logits``). EagleDrafter's position t holds ``(h_{t−1}, x_t)``; the
reference has no entry for x_0, so this network stores position t at cache slot t − 1 with RoPE
position t − 1 (exactly the reference's sequence and positions), for every call whose first
position is > 0. Only a one-token prompt's first round starts at position 0; it stays unshifted
(its entry has no target feature, h = 0; the reference has no such entry) and is overwritten by
later calls.

**Exact at any temperature.** q is ``sampling.process`` of the logits over the TARGET vocabulary
(−inf outside the draft vocabulary's targets), the distribution the drafts are sampled from, so
the acceptance test is the usual one (EagleDrafter's chains; trees are ranked at temperature 1
and verified with the ``"deterministic"`` scheme).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.core.drafting import DraftContext
from specjax.drafters.eagle import EagleDrafter, catch_up_state
from specjax.drafters.eagle_params import LayerDims
from specjax.models import llama
from specjax.models.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclasses.dataclass(frozen=True)
class Eagle3HeadConfig(LayerDims):
    """Static shape of a published EAGLE-3 head (hashable).

    layer: a one-layer :class:`ModelConfig` with the head's width D, heads, head_dim, MLP width,
      RMSNorm epsilon and RoPE (``vocab_size``: the TARGET's vocabulary; ``max_position_embeddings``:
      the target's context).
    draft_vocab: |S|, rows of ``lm_head``.
    feature_layers: the target blocks (0-based, their outputs) whose raw streams ``fc`` reads, in
      order (the reference's hidden-state indices minus one; module docstring).
    target_hidden: D_t, the target's width (``fc`` is ``[D, len(feature_layers)·D_t]``).
    """

    layer: ModelConfig
    draft_vocab: int
    feature_layers: tuple[int, ...]
    target_hidden: int

    copy_ngram = 0  # EagleDrafter's propose reads it: no copy term

    @property
    def feature_size(self) -> int:
        """Width of the target features the loop hands over: ``len(feature_layers)·D_t``."""
        return self.target_hidden * len(self.feature_layers)


def cache_positions(positions):
    """RoPE positions and cache slots of a call at EagleDrafter positions ``positions [B, T]``:
    one less for every row whose call starts after position 0 (module docstring)."""
    return positions - (positions[:, :1] > 0).astype(positions.dtype)


def _lin(p: dict, x, name: str):
    return llama.dense(x, p[name], None, p.get(name + "_scale"))


def head_forward(cfg: Eagle3HeadConfig, p: dict, feats, tokens, positions, cache: llama.KVCache, tree_mask=None):
    """The head's decoder layer over T positions (module docstring).

    Args:
      p: the parameters (:func:`specjax.drafters.eagle3_head_files.head_params`): ``embed [V, D]``,
        ``input_norm``/``hidden_norm``/``post_norm``/``norm [D]``, ``wq [2D, H·hd]``, ``wk``/``wv
        [2D, KV·hd]``, ``wo [H·hd, D]``, ``w_gate``/``w_up [D, F]``, ``w_down [F, D]`` (matrices
        ``[in, out]`` float32, or int8 with ``<name>_scale``), ``fc``, ``head``, ``t_ids``.
      feats: ``[B, T, D]`` float32 h per position (``fc`` of the target's streams, or o fed back).
      tokens: ``[B, T]`` int32; positions: ``[B, T]`` EagleDrafter positions (contiguous; with
        ``tree_mask``: the root's position + depth), stored per :func:`cache_positions`.
      tree_mask: ``None`` (causal) or bool ``[B, T, T]`` (:func:`specjax.models.llama.decoder_block`).
    Returns:
      ``(o [B, T, D] float32 pre-norm outputs, cache with this call's K/V written)``.
    """
    l = cfg.layer
    b, t = tokens.shape
    hd, nh, kv = l.head_dim, l.num_heads, l.num_kv_heads
    pos = cache_positions(positions)
    inv = jnp.asarray(l.rope_inv_freq())
    h = feats.astype(jnp.float32)
    e = llama.embed_rows(p["embed"], p.get("embed_scale"), tokens)
    z = jnp.concatenate([llama.rms_norm(e, p["input_norm"], l.rms_norm_eps),
                         llama.rms_norm(h, p["hidden_norm"], l.rms_norm_eps)], axis=-1)
    q = llama.rope(_lin(p, z, "wq").reshape(b, t, nh, hd), pos, inv)
    k = llama.rope(_lin(p, z, "wk").reshape(b, t, kv, hd), pos, inv)
    v = _lin(p, z, "wv").reshape(b, t, kv, hd)
    kc = llama.write_kv(cache.k[0], k.transpose(0, 2, 1, 3), pos[:, 0])
    vc = llama.write_kv(cache.v[0], v.transpose(0, 2, 1, 3), pos[:, 0])
    a = llama.cache_attention(q, kc, vc, pos, l, tree_mask=tree_mask)
    h = h + _lin(p, a, "wo")
    m = llama.rms_norm(h, p["post_norm"], l.rms_norm_eps)
    h = h + _lin(p, jax.nn.silu(_lin(p, m, "w_gate")) * _lin(p, m, "w_up"), "w_down")
    return h, llama.KVCache(k=[kc], v=[vc], lengths=cache.lengths)


def head_logits(cfg: Eagle3HeadConfig, p: dict, o, vocab_size: int):
    """Logits float32 ``[..., V]`` over the TARGET vocabulary for pre-norm outputs ``o [..., D]``:
    ``lm_head · norm(o)`` at the target ids ``t_ids = d + d2t[d]`` of the draft ids, ``-inf``
    elsewhere (so probability 0 after ``sampling.process``)."""
    f = llama.rms_norm(o, p["norm"], cfg.layer.rms_norm_eps)
    s = llama.matmul(f, p["head"], p.get("head_scale"), transposed=True)  # [..., |S|]
    out = jnp.full(s.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32)
    return out.at[..., p["t_ids"]].set(s)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3HeadDrafter(EagleDrafter):
    """A published EAGLE-3 head (module docstring) in specjax's loop: EagleDrafter's chains,
    EAGLE-2 dynamic trees and ``min_confidence`` rule, with the head's network.

    ``config``: :class:`Eagle3HeadConfig`; ``params``: the flat dict of :func:`head_forward`.
    It reads its target blocks RAW (``raw_features = True``): the loop hands it the concatenated
    residual streams, not the unit-RMS features of specjax's own EAGLE-3 drafters.
    """

    config: Any = None
    name: str = "eagle3-head"

    raw_features = True

    def __hash__(self):
        return hash(("eagle3-head", self.config, self.name, float(self.min_confidence)))

    def __eq__(self, other):
        return (type(other) is type(self) and
                (self.config, self.name, self.min_confidence) == (other.config, other.name, other.min_confidence))

    def features_in(self, params, hid) -> jax.Array:
        """``fc`` of the target's raw streams ``hid [..., len·D_t]`` → ``[..., D]`` float32."""
        return llama.matmul(hid.astype(jnp.float32), params["fc"], params.get("fc_scale"))

    def net_forward(self, params, feats, tokens, positions, cache, tree_mask=None):
        """:func:`head_forward` (returns the pre-norm outputs, which the next step feeds back)."""
        return head_forward(self.config, params, feats, tokens, positions, cache, tree_mask=tree_mask)

    def head_logits(self, params, feat, tbuf, tlen, vocab_size: int):
        """:func:`head_logits` (no copy term: ``tbuf``/``tlen`` unused)."""
        return head_logits(self.config, params, feat, vocab_size)

    def init_state(self, params, context: DraftContext, max_len: int):
        """The prompt's entries ``(g_s, x_{s+1})``, s = 0 .. P − 2, at slots 0 .. P − 2 (positions
        1 .. P − 1 of EagleDrafter's layout), and ``h0 = g_{P−2}`` for the first round (0 for a
        one-token prompt)."""
        b = context.tokens.shape[0]
        g = self.features_in(params, context.target_hidden)  # [B, P, D]
        p = g.shape[1]
        cache = llama.KVCache.create(self.config.layer, b, max_len, jnp.float32)
        if p >= 2:
            pos = jnp.broadcast_to(jnp.arange(1, p, dtype=jnp.int32), (b, p - 1))
            _, cache = self.net_forward(params, g[:, :-1], context.tokens[:, 1:p], pos, cache)
        idx = jnp.clip(context.lengths - 2, 0, p - 1)
        h0 = jnp.take_along_axis(g, idx[:, None, None], axis=1)[:, 0]
        h0 = jnp.where((context.lengths >= 2)[:, None], h0, 0.0)
        return catch_up_state({"cache": cache, "h0": h0.astype(jnp.float32), "fresh": jnp.ones((b,), bool)},
                              b, context.target_hidden.shape[-1], max_len)

    def cache_slots(self, positions):
        """Slot t − 1 for position t (:func:`cache_positions`)."""
        return cache_positions(positions)
