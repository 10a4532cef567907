"""Model configuration: a frozen, hashable dataclass built from a Hugging Face
``config.json`` or from GGUF metadata.

Supported: the Llama family as Hugging Face defines it — ``LlamaForCausalLM``
(Llama 2/3, SmolLM2, incl. ``llama3`` and ``linear`` RoPE scaling),
``MistralForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v bias) and ``Qwen3ForCausalLM``
(per-head RMSNorm of q and k before RoPE, ``head_dim`` independent of the width), and the Gemma 2
and Gemma 3 text models (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``: see :data:`GEMMA_TYPES`). Anything that would
change the math in a way this implementation does not follow raises
:class:`UnsupportedModelError` instead of silently building a wrong model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, unsafe or does not match the model."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint uses an architecture or feature specjax does not implement."""


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# What each family changes, named once (the block and the weight table read the config's fields):
# qwen2: q/k/v biases; qwen3: per-head q/k RMSNorm (``qk_norm``), biases only if ``attention_bias``;
# gemma2 / gemma3_text (GEMMA_TYPES): embeddings × √D, norm weights stored as w for a (1 + w) multiplier,
# GeGLU (tanh GELU), norms before AND after attention and MLP, query_pre_attn_scalar, soft-capped
# attention and final logits (Gemma 2), sliding-window layers interleaved with global ones, and for
# Gemma 3 per-head q/k norms and a separate RoPE base for the local (sliding) layers.
QK_NORM_TYPES = ("qwen3", "gemma3_text")
GEMMA_TYPES = ("gemma2", "gemma3_text")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a Llama-family decoder (hashable: usable as a jit static arg).

    Attributes:
      vocab_size: rows of the embedding / columns of the LM head.
      hidden_size: model width D.
      intermediate_size: SwiGLU hidden width F.
      num_layers: decoder blocks.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention, H % KV == 0).
      head_dim: per-head width.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: ``None`` or a sorted tuple of (key, value) pairs from HF ``rope_scaling``.
      max_position_embeddings: longest context the model supports (tokens); for a
        sliding-window model this is capped at the window, where attention is exact.
      tie_word_embeddings: LM head is the embedding matrix.
      attention_bias: q/k/v projections have a bias (Qwen2; Llama ``attention_bias``).
      attention_out_bias: output projection has a bias (Llama ``attention_bias``).
      qk_norm: per-head RMSNorm of the queries and keys (weights ``[head_dim]``) before RoPE (Qwen3, Gemma 3).
      hidden_act: the MLP's gate activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
      sandwich_norms: RMSNorms also after attention and after the MLP, before each residual add (Gemma).
      norm_weight_offset: Hugging Face checkpoints store each RMSNorm weight as multiplier − offset
        (Gemma: 1.0, the ``(1 + w)`` norm); specjax keeps the multiplier (:mod:`specjax.io.hf` adds it).
      scale_embeddings: token embeddings are multiplied by √hidden_size (float32) (Gemma).
      query_pre_attn_scalar: attention scores scale as ``query_pre_attn_scalar ** -0.5`` (``None``:
        ``head_dim ** -0.5``).
      attn_logit_softcapping / final_logit_softcapping: ``cap · tanh(x / cap)`` on the attention
        scores / the output logits (Gemma 2); ``None``: off.
      sliding_window: W of the sliding-window layers (a query at position t sees keys at positions
        > t − W, as transformers); ``sliding_layers``: those layers' indices (empty: none).
      rope_local_theta: RoPE base of the sliding layers (Gemma 3; their RoPE is unscaled); ``None``:
        every layer uses ``rope_theta`` and ``rope_scaling``.
      multimodal: the language model of a multimodal checkpoint (Gemma 3 4b/12b/27b): its tensors
        sit under ``language_model.`` and the vision tower is ignored (:mod:`specjax.io.hf`).
      model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
      bos_token_id / eos_token_ids: special ids from the checkpoint (may be empty).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    norm_weight_offset: float = 0.0
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    multimodal: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; grouped-query attention needs that."
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} is odd; RoPE needs an even head_dim.")

    def identity(self) -> dict:
        """The fields that identify the model's math, as a JSON-ready dict (a drafter's
        trained-for fingerprint hashes it). Fields added after fingerprints were first written
        (:data:`LATER_FIELDS`) are left out while at their default, so every model that existed
        before them keeps its fingerprint (and the drafters trained for it still load)."""
        d = dataclasses.asdict(self)
        for name in LATER_FIELDS:
            if d[name] == _FIELD_DEFAULTS[name]:
                del d[name]
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    def layer_window(self, layer: int) -> int | None:
        """The sliding window W of block ``layer`` (``None``: global attention)."""
        return self.sliding_window if layer in self.sliding_layers else None

    def attention_scale(self) -> float:
        """The factor on q·k: ``1 / √query_pre_attn_scalar``, else ``1 / √head_dim``."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def layer_inv_freq(self, layer: int) -> np.ndarray:
        """RoPE inverse frequencies of block ``layer``: a sliding layer of a model with
        ``rope_local_theta`` uses that base unscaled; every other layer :meth:`rope_inv_freq`."""
        if self.rope_local_theta is not None and layer in self.sliding_layers:
            hd = self.head_dim
            return (1.0 / (self.rope_local_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))).astype(np.float32)
        return self.rope_inv_freq()

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim // 2]`` float32, with ``rope_scaling`` applied
        (``llama3``: Llama 3.1 frequency-dependent scaling; ``linear``: positions / factor)."""
        hd = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            pass
        elif kind == "linear":
            inv = inv / float(scaling["factor"])
        elif kind == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old = float(scaling["original_max_position_embeddings"])
            low_wavelen, high_wavelen = old / low, old / high
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - low) / (high - low)
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            mid = (1 - smooth) * inv / factor + smooth * inv
            is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            inv = np.where(is_mid, mid, scaled)
        else:  # pragma: no cover - guarded in from_hf_config
            raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported")
        return inv.astype(np.float32)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
          UnsupportedModelError: an architecture other than Llama/Mistral/Qwen2/Qwen3 (mixture-of-experts
            named as such), an activation other than SiLU, MLP biases, or an unknown RoPE scaling type.
        """
        if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), Mapping):
            # Gemma 3 4b/12b/27b: the text model of a multimodal checkpoint (the vision tower is ignored)
            top = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg}
            text = {"model_type": "gemma3_text", **top, **cfg["text_config"]}
            return dataclasses.replace(cls.from_hf_config(text), multimodal=True)
        model_type = _supported_type(cfg)
        gemma = _gemma_fields(cfg, model_type) if model_type in GEMMA_TYPES else {}
        act = cfg.get("hidden_act", "silu")
        if not gemma and act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only SwiGLU with silu is.")
        if cfg.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=true is not supported.")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # Sliding-window attention equals full attention while the sequence fits in the
        # window, so cap the context there instead of implementing the window.
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", model_type == "mistral")
        if uses_window and window is not None and not gemma:
            if model_type in ("qwen2", "qwen3") and cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]:
                raise UnsupportedModelError(
                    f"{model_type} sliding-window attention on some layers (use_sliding_window=true) is not "
                    "supported; set use_sliding_window=false in config.json if the window is unused."
                )
            max_pos = min(max_pos, int(window))
        rope_theta, scaling = _rope_settings(cfg) if not gemma else (gemma.pop("rope_theta"), gemma.pop("scaling"))
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise UnsupportedModelError(
                    f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)."
                )
            if kind == "default":
                scaling = None
            else:
                scaling = tuple(sorted((k, _hashable(v)) for k, v in scaling.items()))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling or None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias or model_type == "qwen2",
            attention_out_bias=bias,
            qk_norm=model_type in QK_NORM_TYPES,
            model_type=model_type,
            **gemma,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


# ModelConfig fields added after drafter fingerprints existed (see ModelConfig.identity); append, never remove.
LATER_FIELDS = ("qk_norm", "hidden_act", "sandwich_norms", "norm_weight_offset", "scale_embeddings",
                "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                "sliding_layers", "rope_local_theta", "multimodal")
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _supported_type(cfg: Mapping[str, Any]) -> str:
    """The config's ``model_type`` if specjax implements it.

    Raises:
      UnsupportedModelError: mixture-of-experts, a multimodal checkpoint, or another model type."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    experts = next((f"{k}={cfg[k]}" for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if cfg.get(k)), None)
    if experts or "moe" in str(model_type).lower():
        raise UnsupportedModelError(
            f"mixture-of-experts layers ({experts or model_type}) are not supported; specjax implements "
            f"dense decoders ({', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    if "text_config" in cfg:
        raise UnsupportedModelError(
            f"multimodal checkpoints other than Gemma 3 ({model_type}, architectures={archs}: a vision tower plus "
            "a language model under text_config) are not supported; use the text-only checkpoint."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} (architectures={archs}) is not supported; "
            f"specjax implements {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)."
        )
    return model_type


def _gemma_fields(cfg: Mapping[str, Any], model_type: str) -> dict:
    """The Gemma 2 / Gemma 3 text fields of a HF config (the GEMMA_TYPES differences), with its RoPE
    as ``rope_theta`` / ``scaling`` (the global layers') for :meth:`ModelConfig.from_hf_config`.

    Raises:
      UnsupportedModelError: another activation than tanh GELU, bidirectional attention, layer types
        other than sliding/full, or a scaled RoPE on Gemma 3's local layers."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{model_type} hidden_activation={act!r} is not supported; only the tanh "
                                    "GELU (gelu_pytorch_tanh) is.")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{model_type} use_bidirectional_attention=true (an encoder) is not supported.")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # configs before transformers 4.53: the fixed pattern
        every = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise UnsupportedModelError(f"{model_type} layer_types {unknown or types} are not supported (sliding_attention "
                                    f"and full_attention, one per layer).")
    window = cfg.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    local = None
    params = cfg.get("rope_parameters")
    if model_type == "gemma3_text" and isinstance(params, Mapping) and all(isinstance(v, Mapping)
                                                                           for v in params.values()):
        slide = dict(params.get("sliding_attention") or {})
        if slide.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"gemma3 local-layer RoPE type {slide.get('rope_type')!r} is not supported "
                                        "(default only).")
        local = float(slide.get("rope_theta", 10000.0))
        theta, scaling = _rope_settings({"rope_parameters": dict(params.get("full_attention") or {})})
    else:
        theta, scaling = _rope_settings(cfg)
        if model_type == "gemma3_text":
            local = float(cfg.get("rope_local_base_freq", 10000.0))
    softcap = lambda k: None if cfg.get(k) is None else float(cfg[k])  # noqa: E731
    return dict(hidden_act="gelu_tanh", sandwich_norms=True, norm_weight_offset=1.0, scale_embeddings=True,
                query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
                attn_logit_softcapping=softcap("attn_logit_softcapping"),
                final_logit_softcapping=softcap("final_logit_softcapping"),
                sliding_window=int(window) if window else None, sliding_layers=sliding, rope_local_theta=local,
                rope_theta=theta, scaling=scaling)


def _rope_settings(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope scaling dict or None)`` from a HF config of either format:
    transformers < 5 (``rope_theta`` + ``rope_scaling``) or transformers >= 5
    (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling keys).

    Raises:
      UnsupportedModelError: per-layer-type RoPE parameters (a dict of dicts).
    """
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        if all(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedModelError(
                f"per-layer-type rope_parameters ({sorted(params)}) are not supported; "
                "Llama-family models use one RoPE setting for every layer."
            )
        theta = params.get("rope_theta", theta)
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if rest:
            scaling = rest
    if isinstance(scaling, Mapping):
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"} or None
    elif scaling is not None:
        raise UnsupportedModelError(f"rope_scaling={scaling!r} is not a mapping; expected a dict with rope_type")
    return float(10000.0 if theta is None else theta), (dict(scaling) if scaling else None)


def _hashable(v):
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, dict):
        return tuple(sorted(v.items()))
    return v
