"""The files of a published EAGLE-3 head (:mod:`specjax.drafters.eagle3_head`): recognising the
directory (:func:`is_head_dir`), the checks before the target loads (:func:`check_head_dir`), and
:func:`load_head`.

The layout (EAGLE authors' ``cnets.py``, SpecForge ``llama3_eagle.py``, AngelSlim): ``config.json``
with ``architectures: ["LlamaForCausalLMEagle3"]``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``/``rope_scaling``,
``vocab_size`` (the target's), ``draft_vocab_size`` and optionally ``target_hidden_size``; and
``model.safetensors`` holding (PyTorch ``[out, in]`` matrices)

    fc.weight [D, 3·D_t]                       midlayer.input_layernorm.weight [D]
    midlayer.hidden_norm.weight [D]            midlayer.self_attn.{q,k,v}_proj.weight [·, 2D]
    midlayer.self_attn.o_proj.weight [D, H·hd] midlayer.post_attention_layernorm.weight [D]
    midlayer.mlp.{gate,up}_proj.weight [F, D]  midlayer.mlp.down_proj.weight [D, F]
    norm.weight [D]                            lm_head.weight [|S|, D]
    d2t int64 [|S|] (target id = d + d2t[d])   t2d bool [V] (optional, unused)
    embed_tokens.weight [V, D] (optional: else the target's embedding)

A ``pytorch_model.bin`` (pickle) is refused with the one-line conversion to safetensors. vLLM's
``speculators`` layout (``layers.0.*`` names, ``speculators_config``) and other variants (several
layers, ``norm_before_residual``, biases, q/k norms) are refused in one line naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle3_head import ARCHITECTURE, Eagle3HeadConfig, Eagle3HeadDrafter
from specjax.drafters.eagle_params import target_table
from specjax.models import llama
from specjax.models.config import CheckpointError, ModelConfig

WEIGHTS = "model.safetensors"
PICKLE = "pytorch_model.bin"
MIDLAYER = {  # specjax name → (checkpoint name, transposed to [in, out])
    "input_norm": ("midlayer.input_layernorm.weight", False),
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "wq": ("midlayer.self_attn.q_proj.weight", True),
    "wk": ("midlayer.self_attn.k_proj.weight", True),
    "wv": ("midlayer.self_attn.v_proj.weight", True),
    "wo": ("midlayer.self_attn.o_proj.weight", True),
    "post_norm": ("midlayer.post_attention_layernorm.weight", False),
    "w_gate": ("midlayer.mlp.gate_proj.weight", True),
    "w_up": ("midlayer.mlp.up_proj.weight", True),
    "w_down": ("midlayer.mlp.down_proj.weight", True),
}
TOP = {"fc": ("fc.weight", True), "norm": ("norm.weight", False), "head": ("lm_head.weight", False)}
OPTIONAL = ("embed_tokens.weight", "t2d")
MATRICES = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def conversion_command(path: str) -> str:
    """The one line that converts a head's ``pytorch_model.bin`` to ``model.safetensors`` (run by
    the user, who trusts the file; specjax never unpickles)."""
    d = os.path.abspath(path)
    return (f"python -c \"import torch, safetensors.torch as s; s.save_file({{k: v.contiguous() for k, v in "
            f"torch.load('{d}/{PICKLE}', map_location='cpu', weights_only=True).items()}}, '{d}/{WEIGHTS}')\"")


def read_config(path: str) -> dict | None:
    """``config.json`` of a directory as a dict, or ``None`` (no such file, or not a JSON object)."""
    f = os.path.join(os.path.expanduser(path), "config.json")
    try:
        with open(f, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def is_head_dir(spec: str) -> bool:
    """Whether ``spec`` is a directory whose ``config.json`` describes an EAGLE-3 head of any
    variant (an architecture name containing ``Eagle3``, a ``draft_vocab_size`` or a
    ``speculators_config``); cheap: reads only ``config.json``."""
    if not os.path.isdir(os.path.expanduser(spec)):
        return False
    cfg = read_config(spec)
    if cfg is None:
        return False
    archs = cfg.get("architectures") or []
    return (any("eagle3" in str(a).lower() for a in archs) or "draft_vocab_size" in cfg
            or "speculators_config" in cfg)


def check_head_dir(spec: str) -> dict:
    """The checks of a head directory that need no target: a supported variant, a safetensors file
    (a pickle-only head names the conversion). Returns the config dict.

    Raises:
      CheckpointError: one line naming the problem and the fix.
    """
    path = os.path.expanduser(spec)
    cfg = read_config(path) or {}
    archs = cfg.get("architectures") or []
    if "speculators_config" in cfg or ARCHITECTURE not in archs:
        raise CheckpointError(f"{spec}: EAGLE-3 head variant {archs or cfg.get('speculators_model_type')!r} is not "
                              f"supported; specjax loads {ARCHITECTURE} heads (EAGLE/SpecForge/AngelSlim layout; "
                              "vLLM's speculators layout is not supported yet)")
    variant = [f"{k}={cfg[k]!r}" for k, bad in (("num_hidden_layers", lambda v: v not in (None, 1)),
                                               ("norm_before_residual", bool), ("attention_bias", bool),
                                               ("mlp_bias", bool), ("hidden_act", lambda v: v not in (None, "silu")))
               if k in cfg and bad(cfg[k])]
    if variant:
        raise CheckpointError(f"{spec}: EAGLE-3 head variant with {', '.join(variant)} is not supported; specjax "
                              f"loads one-layer {ARCHITECTURE} heads without biases (silu MLP)")
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        if os.path.isfile(os.path.join(path, PICKLE)):
            raise CheckpointError(f"{spec}: only {PICKLE} (a pickle, which specjax never loads); convert it to "
                                  f"safetensors once with: {conversion_command(path)}")
        raise CheckpointError(f"{spec}: no {WEIGHTS}; the EAGLE-3 head directory is incomplete (re-download it)")
    return cfg


def resolve_layers(layers, cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The target blocks (0-based outputs) the head reads, from hidden-state indices (index i = the
    input of layer i: 0 the embedding output, i ≥ 1 block i − 1's output; the reference collects the
    input of layer idx, so i < N): ``layers`` when given, else the config's
    ``eagle_config.eagle_aux_hidden_state_layer_ids``, else the reference's ``(2, N // 2, N − 3)``.

    Raises:
      CheckpointError: an index outside 1 .. N − 1."""
    if layers is None:
        layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        layers = (2, num_layers // 2, num_layers - 3)
    ids = tuple(int(i) for i in layers)
    bad = [i for i in ids if not 1 <= i < num_layers]
    if bad:
        raise CheckpointError(f"EAGLE-3 head layer ids {list(ids)}: {bad} are not layer inputs of a {num_layers}-layer "
                              f"target (use 1..{num_layers - 1}; 0, the embedding output, is not supported)")
    return tuple(i - 1 for i in ids)


def _tensor(tensors: dict, name: str, path: str) -> np.ndarray:
    if name not in tensors:
        raise CheckpointError(f"{path}: {WEIGHTS} has no tensor {name!r}; not a complete {ARCHITECTURE} head "
                              "(re-download it)")
    return np.asarray(tensors[name])


def head_params(tensors: dict, target, path: str) -> dict:
    """The head's float32 parameters (``[in, out]`` matrices) from its checkpoint tensors, with the
    target's embedding when the file has none; ``t_ids`` int32 ``[|S|]`` = ``arange + d2t``.

    Raises:
      CheckpointError: a missing or unknown tensor, a bad ``d2t``."""
    names = {n for n, _ in list(MIDLAYER.values()) + list(TOP.values())} | {"d2t"} | set(OPTIONAL)
    unknown = sorted(set(tensors) - names)
    if unknown:
        raise CheckpointError(f"{path}: EAGLE-3 head variant with tensors {unknown[:4]} is not supported (specjax "
                              f"loads the one-layer {ARCHITECTURE} layout: fc, midlayer.*, norm, lm_head, d2t)")
    p = {}
    for key, (name, transposed) in list(MIDLAYER.items()) + list(TOP.items()):
        a = _tensor(tensors, name, path).astype(np.float32)
        p[key] = jnp.asarray(a.T if transposed else a)
    vocab = target.config.vocab_size
    d2t = _tensor(tensors, "d2t", path).astype(np.int64).reshape(-1)
    t_ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t
    if (d2t.shape[0] != p["head"].shape[0] or t_ids.min(initial=0) < 0 or t_ids.max(initial=0) >= vocab
            or len(np.unique(t_ids)) != len(t_ids)):
        raise CheckpointError(f"{path}: d2t does not map the {p['head'].shape[0]} draft ids to distinct ids of the "
                              f"target's {vocab}-token vocabulary; the head belongs to another target")
    p["t_ids"] = jnp.asarray(t_ids.astype(np.int32))
    if "embed_tokens.weight" in tensors:
        p["embed"] = jnp.asarray(np.asarray(tensors["embed_tokens.weight"], np.float32))
    else:  # the target's table as it is stored (int8: codes and scales; rows read by llama.embed_rows)
        p.update(target_table(target))
    return p


def head_config(cfg: dict, target, layers, path: str) -> Eagle3HeadConfig:
    """The :class:`Eagle3HeadConfig` of a head ``config.json`` for ``target``.

    Raises:
      CheckpointError: a vocabulary or hidden-size mismatch with the target."""
    tc = target.config
    d_t = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    if int(cfg["vocab_size"]) != tc.vocab_size:
        raise CheckpointError(f"{path}: the EAGLE-3 head is for a {cfg['vocab_size']}-token vocabulary, the target "
                              f"has {tc.vocab_size}; use the head trained for this target")
    if d_t != tc.hidden_size:
        raise CheckpointError(f"{path}: the EAGLE-3 head reads a target of hidden size {d_t}, the target has "
                              f"{tc.hidden_size}; use the head trained for this target")
    layer = ModelConfig.from_hf_config({**cfg, "model_type": "llama", "num_hidden_layers": 1})
    layer = dataclasses.replace(layer, vocab_size=tc.vocab_size, max_position_embeddings=tc.max_position_embeddings,
                                tie_word_embeddings=False, eos_token_ids=(), bos_token_id=None)
    feature_layers = resolve_layers(layers, cfg, tc.num_layers)
    return Eagle3HeadConfig(layer, int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), feature_layers, d_t)


def check_shapes(hc: Eagle3HeadConfig, p: dict, path: str) -> None:
    """Every parameter has the shape the config says. Raises CheckpointError (names the tensor)."""
    l = hc.layer
    d, f, q, kv = l.hidden_size, l.intermediate_size, l.num_heads * l.head_dim, l.num_kv_heads * l.head_dim
    want = {"fc": (hc.feature_size, d), "input_norm": (d,), "hidden_norm": (d,), "wq": (2 * d, q), "wk": (2 * d, kv),
            "wv": (2 * d, kv), "wo": (q, d), "post_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
            "norm": (d,), "head": (hc.draft_vocab, d), "embed": (l.vocab_size, d)}
    for k, shape in want.items():
        if tuple(p[k].shape) != shape:
            if k == "fc":
                raise CheckpointError(f"{path}: fc.weight reads {p[k].shape[0]} target features, expected "
                                      f"{len(hc.feature_layers)} layers × hidden size {hc.target_hidden} = "
                                      f"{shape[0]}; the head belongs to another target (hidden size mismatch)")
            raise CheckpointError(f"{path}: {k} has shape {tuple(p[k].shape)}, config.json says {shape}; the "
                                  "directory is inconsistent (re-download it)")


def load_head(path: str, target, dtype: str = "float32", name: str | None = None, layers=None,
              min_confidence: float = 0.0) -> Eagle3HeadDrafter:
    """Load a published EAGLE-3 head directory as a drafter for ``target``.

    Args:
      path: the head directory (``config.json`` + ``model.safetensors``).
      target: the loaded target model (its config, embedding).
      dtype: ``float32``; ``bfloat16`` (weights rounded to bfloat16, computed in float32); ``int8``
        (per-output-channel int8 matrices and head, :func:`specjax.models.llama.quantize_int8`).
      layers: hidden-state indices of the three target layers (index 0 = the embedding output;
        default: the config's ``eagle_config.eagle_aux_hidden_state_layer_ids``, else
        ``(2, N // 2, N − 3)``, the reference's).
      min_confidence: see :class:`~specjax.drafters.eagle.EagleDrafter`.

    Raises:
      CheckpointError: an unsupported variant, a pickle-only head, a missing tensor, a vocabulary or
        hidden-size mismatch with the target, a bad ``d2t`` (each one line).
      ValueError: an unknown ``dtype``.
    """
    from safetensors.numpy import load_file

    if dtype not in ("float32", "bfloat16", "int8"):
        raise ValueError(f"drafter dtype must be float32, bfloat16 or int8, got {dtype!r}")
    cfg = check_head_dir(path)
    hc = head_config(cfg, target, layers, path)
    p = head_params(load_file(os.path.join(os.path.expanduser(path), WEIGHTS)), target, path)
    check_shapes(hc, p, path)
    if dtype == "bfloat16":
        p.update({k: p[k].astype(jnp.bfloat16).astype(jnp.float32) for k in MATRICES + ("head",)})
    elif dtype == "int8":
        for k in MATRICES:
            p[k], p[k + "_scale"] = llama.quantize_int8(p[k], 0)
        p["head"], p["head_scale"] = llama.quantize_int8(p["head"], 1)
    name = name or os.path.basename(os.path.normpath(path))
    return Eagle3HeadDrafter(hc, p, name=name, min_confidence=float(min_confidence))
