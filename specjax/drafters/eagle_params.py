"""The EAGLE drafter's configuration and parameters: :class:`EagleConfig`, the target blocks a
fused-feature drafter reads (:func:`resolve_feature_layers`), the trainable parameters (one
decoder block from the weight table, ``fc``, the output norm, EAGLE-3's ``fuse``, the copy
term), the frozen parts taken from the target, and the int8 format (:func:`quantize_params`).
The architecture is in :mod:`specjax.drafters.eagle`, which re-exports every name here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models import llama, weights

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


class LayerDims:
    """The sizes a drafter config reads from its ``layer`` (a :class:`ModelConfig`): width, the
    target vocabulary, the context. Shared by every drafter config with a ``layer`` field."""

    layer: ModelConfig

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.layer.max_position_embeddings


@dataclasses.dataclass(frozen=True)
class EagleConfig(LayerDims):
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


def target_embed(target, rows=None) -> jax.Array:
    """The target's token embedding ``[V, D]`` float32 (also its tied head), or only its ``rows``
    (an index array); the same array for a float32 target, dequantized for bfloat16/int8 targets."""
    e = target.params["embed"][...]
    scale = _value(target.params, "embed_scale")
    if rows is not None:
        e = e[rows]
        scale = None if scale is None else scale[:, rows]
    if scale is not None:
        return llama.dequantize_int8(e, scale, 1)
    return e if e.dtype == jnp.float32 else e.astype(jnp.float32)


def embed_rows(frozen: dict, tokens) -> jax.Array:
    """The drafter's input embedding of ``tokens [...]``: float32 ``[..., D]`` rows of the target's
    table in the target's own format (:func:`specjax.models.llama.embed_rows`)."""
    return llama.embed_rows(frozen["embed"], frozen.get("embed_scale"), tokens)


def target_table(target) -> dict:
    """The target's embedding table as it is stored, for :func:`embed_rows`: ``{"embed": [V, D]}``
    (plus ``"embed_scale"`` for int8); the target's own arrays, no copy."""
    table = {"embed": target.params["embed"][...]}
    scale = _value(target.params, "embed_scale")
    if scale is not None:
        table["embed_scale"] = scale
    return table


def frozen_params(target, sub_ids) -> dict:
    """The parts taken from the target: its embedding table as it is stored (``embed`` ``[V, D]``,
    with ``embed_scale`` for int8: the same arrays, no copy; rows are read through
    :func:`embed_rows`), head rows of the sub-vocabulary (``[|S|, D]`` float32, from the tied
    embedding or the untied head) and ``sub_ids``; for an untied head also ``out_embed``
    (``[V, D]``, every head row, for the copy term)."""
    sub_ids = jnp.asarray(np.asarray(sub_ids, np.int32))
    emb = target_table(target)
    if target.config.tie_word_embeddings:
        head = target_embed(target, sub_ids)
    else:
        w = target.params["lm_head"][...].astype(jnp.float32)
        scale = _value(target.params, "lm_head_scale")
        if scale is not None:
            w = llama.dequantize_int8(target.params["lm_head"][...], scale, 0)
        head = jnp.take(w, sub_ids, axis=1).T
        return {**emb, "head": jnp.asarray(head, jnp.float32), "sub_ids": sub_ids, "out_embed": w.T}
    return {**emb, "head": jnp.asarray(head, jnp.float32), "sub_ids": sub_ids}


def quantize_params(params: dict) -> dict:
    """The ``int8`` weight format of a drafter's ``{"train", "frozen"}`` parameters.

    ``fc`` (and ``fuse``), the block's four matrices (``w_qkv``, ``wo``, ``w_gate_up``, ``w_down``, stored
    ``[in, *out]``) and the sub-vocabulary head (``[|S|, D]``) become 8-bit codes with a
    float32 ``<name>_scale`` per block of 32 inputs (:func:`specjax.models.llama.quantize_int8`);
    activations are quantized per row and block on the fly (:func:`specjax.models.llama.matmul`). Norms, biases and the copy
    term stay float32; input lookups read the target's table in its own format (:func:`embed_rows`). It lets the drafter run in an int8
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
