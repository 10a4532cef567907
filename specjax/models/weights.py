"""The weight table: every parameter of a Llama-family model, declared once (:data:`WEIGHTS`).

Initialisation and abstract shapes (:class:`specjax.models.params.Transformer`), the Hugging
Face and GGUF loaders and :func:`specjax.io.loading.save_model` (names, transposes, the GGUF
Q/K row permutation), the sharding rules (:mod:`specjax.runtime.sharding`), the int8 format
(which weights, on which axis) and the EAGLE drafter's block all read this table; adding an
entry adds the weight everywhere (the forward pass still has to use it).

Fused projections: a block stores ONE query/key/value weight ``w_qkv`` and ONE gate/up
weight ``w_gate_up`` (one matmul each instead of three and two; on GPU/TPU a decode step is
bound by its op count). Checkpoints keep the split tensors (``q_proj``, ``k_proj``, …): such a
stored weight declares its checkpoint tensors as :class:`Part` s, concatenated on load
(:func:`fuse`) and split again on save (:func:`split`). ``w_qkv`` is laid out
``[D, KV, G + 2, hd]`` (per KV group: its G = H / KV query heads, then its key and its value
head) and ``w_gate_up`` ``[D, 2, F]``, so that the model axis of a mesh splits whole KV groups
and whole MLP slices; the matmul contracts ``D`` and keeps the other axes (one dot).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig

WEIGHT_FORMATS = ("float32", "bfloat16", "int8")
# What each format computes, for cache keys (measurements, fidelity): change the text when a
# format's arithmetic changes, so nothing measured under the old definition is reused.
FORMAT_DEFINITION = {
    "float32": "float32 weights and activations",
    "bfloat16": "bfloat16 weights, float32 accumulation",
    "int8": ("8-bit weight codes with a float32 scale and offset per block of 32 inputs x two-level int8 "
             "activations per block of 32, int32 block sums"),
}
QUANT_BLOCK = 32  # inputs per block of the int8 format (:func:`quantize_int8`; GGUF's Q4_0/Q4_1/Q8_0 blocks)


class _Tensor:
    """What a checkpoint tensor has (shared by :class:`WeightSpec` and :class:`Part`)."""

    def checkpoint_name(self, fmt: str, layer: int | None = None, cfg: ModelConfig | None = None) -> str | None:
        """The tensor's name in a ``"hf"`` or ``"gguf"`` checkpoint (``None``: it has none). A name
        that differs by family is a function of the config (then ``cfg`` is needed)."""
        template = {"hf": self.hf_name, "gguf": self.gguf_name}[fmt]
        if callable(template):
            template = template(cfg)
        return None if template is None else template.format(i=layer)

    def norm_offset(self, fmt: str, cfg: ModelConfig) -> float:
        """What a ``fmt`` checkpoint's tensor lacks of specjax's value: ``cfg.norm_weight_offset``
        for an RMSNorm weight in a Hugging Face checkpoint (Gemma stores w of a ``(1 + w)``
        multiplier; llama.cpp's GGUF stores the multiplier), else 0."""
        return cfg.norm_weight_offset if fmt == "hf" and getattr(self, "is_norm", False) else 0.0

    def transposed(self, fmt: str) -> bool:
        """Whether the ``"hf"``/``"gguf"`` tensor is the transpose of the specjax one."""
        return {"hf": self.hf_transpose, "gguf": self.gguf_transpose}[fmt]


@dataclasses.dataclass(frozen=True)
class Part(_Tensor):
    """One checkpoint tensor of a fused :class:`WeightSpec` (``wq`` of ``w_qkv``).

    Attributes:
      name: the part's name; a loader yields it at the path ``("layers", i, name)``.
      shape: ``cfg -> shape`` of the tensor in specjax orientation (``[in, out]``).
      view: ``cfg -> shape``: the same elements as they sit in the stored weight (a reshape of
        ``shape``); the parts' views are concatenated on the weight's ``concat_axis``.
      hf_name, hf_transpose, gguf_name, gguf_transpose, gguf_permute: as :class:`WeightSpec`.
    """

    name: str
    shape: Callable[[ModelConfig], tuple]
    view: Callable[[ModelConfig], tuple]
    hf_name: str | None = None
    hf_transpose: bool = False
    gguf_name: str | None = None
    gguf_transpose: bool = False
    gguf_permute: str | None = None


@dataclasses.dataclass(frozen=True)
class WeightSpec(_Tensor):
    """Everything specjax knows about one stored weight, in one place (:data:`WEIGHTS`).

    Attributes:
      name: parameter name, the last element of its path (``("embed",)``,
        ``("layers", i, "w_qkv")``).
      shape: ``cfg -> shape`` in specjax layout (matmul weights ``[in, *out]``).
      logical_axes: one logical axis name (or ``None``) per dimension, for sharding
        (``"heads"``, ``"kv_heads"``, ``"mlp"``, ``"vocab"``; see
        :data:`specjax.runtime.sharding.AXIS_RULES`).
      init: random initialisation: ``"normal"`` (N(0, 0.02), one key per part), ``"ones"`` or
        ``"zeros"``.
      quant_axis: a matmul weight: stored in the weight format's matmul dtype; in int8 as
        8-bit codes with a float32 ``<name>_scale`` (scale and offset per block of
        :data:`QUANT_BLOCK` along this axis, the input dimension; :func:`quantize_int8`).
        ``None``: not a matmul weight (float32, or bf16 in ``bfloat16``).
      hf_name: Hugging Face safetensors name; ``{i}`` is the layer index. ``None``: none. A
        function of the config where families name the tensor differently.
      hf_transpose: the HF tensor is the transpose of the specjax one (``[out, in]``).
      gguf_name: llama.cpp GGUF name (``{i}``: layer); ``None``: the GGUF loader has none.
      gguf_transpose: the (dequantized) GGUF tensor is the transpose of the specjax one.
      gguf_permute: a ``ModelConfig`` head-count attribute (``"num_heads"``,
        ``"num_kv_heads"``): llama.cpp permuted the rows of this tensor per head for the
        ``llama`` architecture (:func:`specjax.io.gguf.unpermute_qk`); ``None``: never.
      per_layer: one per decoder block (path ``("layers", i, name)``), else one per model.
      is_norm: an RMSNorm weight (a Hugging Face checkpoint stores it less ``norm_weight_offset``).
      when: ``cfg -> bool``: the model has this weight only where true (``None``: always).
      tied_to: where ``when`` is false the weight IS this other one (the tied LM head is
        the embedding): a checkpoint's copy of it is skipped, not refused.
      parts: a fused weight: its checkpoint tensors (the ``hf_*``/``gguf_*`` fields are then
        unused), concatenated on ``concat_axis`` in this order (:func:`fuse`).
    """

    name: str
    shape: Callable[[ModelConfig], tuple]
    logical_axes: tuple
    init: str = "normal"
    quant_axis: int | None = None
    hf_name: str | None = None
    hf_transpose: bool = False
    gguf_name: str | None = None
    gguf_transpose: bool = False
    gguf_permute: str | None = None
    per_layer: bool = False
    is_norm: bool = False
    when: Callable[[ModelConfig], bool] | None = None
    tied_to: str | None = None
    parts: tuple[Part, ...] = ()
    concat_axis: int = 0

    def present(self, cfg: ModelConfig) -> bool:
        """Whether a model with config ``cfg`` has this weight."""
        return self.when is None or bool(self.when(cfg))

    def path(self, layer: int | None = None, name: str | None = None) -> tuple:
        """Parameter path: ``("layers", layer, name)`` per layer, else ``(name,)``; ``name``
        defaults to the weight's (a part's name gives the part's path)."""
        name = self.name if name is None else name
        return ("layers", layer, name) if self.per_layer else (name,)

    def tensors(self) -> tuple:
        """The checkpoint tensors: the parts of a fused weight, else the weight itself."""
        return self.parts or (self,)

    @property
    def scale_axes(self) -> tuple:
        """Logical axes of the int8 ``<name>_scale`` (:func:`scale_shape`): ``None`` for the
        (scale, offset) axis, then the weight's, with ``None`` for the blocks of ``quant_axis``
        (a block count need not divide a mesh axis; the scales are small)."""
        return (None,) + tuple(None if k == self.quant_axis else a for k, a in enumerate(self.logical_axes))


def _q_out(c: ModelConfig) -> int:
    return c.num_heads * c.head_dim


def _kv_out(c: ModelConfig) -> int:
    return c.num_kv_heads * c.head_dim


def _group(c: ModelConfig) -> int:
    """G: query heads per KV head."""
    return c.num_heads // c.num_kv_heads


def _qkv(c: ModelConfig, lead: tuple, g: int) -> tuple:
    return (*lead, c.num_kv_heads, g, c.head_dim)


_LAYER = "model.layers.{i}."
_D = lambda c: (c.hidden_size,)  # noqa: E731
_NONE = lambda c: ()  # noqa: E731

# The one table of weights, in model order (embedding, one block, final norm, head): the
# random initialisation draws the "normal" weights in this order (layer by layer, part by part).
WEIGHTS: tuple[WeightSpec, ...] = (
    WeightSpec("embed", lambda c: (c.vocab_size, c.hidden_size), ("vocab", None), quant_axis=1,
               hf_name="model.embed_tokens.weight", gguf_name="token_embd.weight"),
    WeightSpec("attn_norm", lambda c: (c.hidden_size,), (None,), init="ones", per_layer=True, is_norm=True,
               hf_name=_LAYER + "input_layernorm.weight", gguf_name="blk.{i}.attn_norm.weight"),
    WeightSpec("w_qkv", lambda c: _qkv(c, _D(c), _group(c) + 2), (None, "kv_heads", None, None), quant_axis=0,
               per_layer=True, concat_axis=2, parts=(
                   Part("wq", lambda c: (c.hidden_size, _q_out(c)), lambda c: _qkv(c, _D(c), _group(c)),
                        hf_name=_LAYER + "self_attn.q_proj.weight", hf_transpose=True,
                        gguf_name="blk.{i}.attn_q.weight", gguf_transpose=True, gguf_permute="num_heads"),
                   Part("wk", lambda c: (c.hidden_size, _kv_out(c)), lambda c: _qkv(c, _D(c), 1),
                        hf_name=_LAYER + "self_attn.k_proj.weight", hf_transpose=True,
                        gguf_name="blk.{i}.attn_k.weight", gguf_transpose=True, gguf_permute="num_kv_heads"),
                   Part("wv", lambda c: (c.hidden_size, _kv_out(c)), lambda c: _qkv(c, _D(c), 1),
                        hf_name=_LAYER + "self_attn.v_proj.weight", hf_transpose=True,
                        gguf_name="blk.{i}.attn_v.weight", gguf_transpose=True))),
    WeightSpec("b_qkv", lambda c: _qkv(c, (), _group(c) + 2), ("kv_heads", None, None), init="zeros",
               per_layer=True, when=lambda c: c.attention_bias, concat_axis=1, parts=(
                   Part("bq", lambda c: (_q_out(c),), lambda c: _qkv(c, (), _group(c)),
                        hf_name=_LAYER + "self_attn.q_proj.bias", gguf_name="blk.{i}.attn_q.bias",
                        gguf_permute="num_heads"),
                   Part("bk", lambda c: (_kv_out(c),), lambda c: _qkv(c, (), 1),
                        hf_name=_LAYER + "self_attn.k_proj.bias", gguf_name="blk.{i}.attn_k.bias",
                        gguf_permute="num_kv_heads"),
                   Part("bv", lambda c: (_kv_out(c),), lambda c: _qkv(c, (), 1),
                        hf_name=_LAYER + "self_attn.v_proj.bias", gguf_name="blk.{i}.attn_v.bias"))),
    WeightSpec("q_norm", lambda c: (c.head_dim,), (None,), init="ones", per_layer=True, is_norm=True,
               when=lambda c: c.qk_norm, hf_name=_LAYER + "self_attn.q_norm.weight",
               gguf_name="blk.{i}.attn_q_norm.weight"),
    WeightSpec("k_norm", lambda c: (c.head_dim,), (None,), init="ones", per_layer=True, is_norm=True,
               when=lambda c: c.qk_norm, hf_name=_LAYER + "self_attn.k_norm.weight",
               gguf_name="blk.{i}.attn_k_norm.weight"),
    WeightSpec("wo", lambda c: (_q_out(c), c.hidden_size), ("heads", None), quant_axis=0, per_layer=True,
               hf_name=_LAYER + "self_attn.o_proj.weight", hf_transpose=True,
               gguf_name="blk.{i}.attn_output.weight", gguf_transpose=True),
    WeightSpec("bo", lambda c: (c.hidden_size,), (None,), init="zeros", per_layer=True,
               when=lambda c: c.attention_out_bias, hf_name=_LAYER + "self_attn.o_proj.bias"),
    WeightSpec("attn_post_norm", lambda c: (c.hidden_size,), (None,), init="ones", per_layer=True, is_norm=True,
               when=lambda c: c.sandwich_norms, hf_name=_LAYER + "post_attention_layernorm.weight",
               gguf_name="blk.{i}.post_attention_norm.weight"),
    # the norm before the MLP: Llama calls it post_attention_layernorm, Gemma (whose
    # post_attention_layernorm is attn_post_norm above) pre_feedforward_layernorm
    WeightSpec("mlp_norm", lambda c: (c.hidden_size,), (None,), init="ones", per_layer=True, is_norm=True,
               hf_name=lambda c: _LAYER + ("pre_feedforward_layernorm.weight" if c.sandwich_norms
                                           else "post_attention_layernorm.weight"),
               gguf_name="blk.{i}.ffn_norm.weight"),
    WeightSpec("w_gate_up", lambda c: (c.hidden_size, 2, c.intermediate_size), (None, None, "mlp"), quant_axis=0,
               per_layer=True, concat_axis=1, parts=(
                   Part("w_gate", lambda c: (c.hidden_size, c.intermediate_size),
                        lambda c: (c.hidden_size, 1, c.intermediate_size),
                        hf_name=_LAYER + "mlp.gate_proj.weight", hf_transpose=True,
                        gguf_name="blk.{i}.ffn_gate.weight", gguf_transpose=True),
                   Part("w_up", lambda c: (c.hidden_size, c.intermediate_size),
                        lambda c: (c.hidden_size, 1, c.intermediate_size),
                        hf_name=_LAYER + "mlp.up_proj.weight", hf_transpose=True,
                        gguf_name="blk.{i}.ffn_up.weight", gguf_transpose=True))),
    WeightSpec("w_down", lambda c: (c.intermediate_size, c.hidden_size), ("mlp", None), quant_axis=0,
               per_layer=True, hf_name=_LAYER + "mlp.down_proj.weight", hf_transpose=True,
               gguf_name="blk.{i}.ffn_down.weight", gguf_transpose=True),
    WeightSpec("mlp_post_norm", lambda c: (c.hidden_size,), (None,), init="ones", per_layer=True, is_norm=True,
               when=lambda c: c.sandwich_norms, hf_name=_LAYER + "post_feedforward_layernorm.weight",
               gguf_name="blk.{i}.post_ffw_norm.weight"),
    WeightSpec("final_norm", lambda c: (c.hidden_size,), (None,), init="ones", is_norm=True,
               hf_name="model.norm.weight", gguf_name="output_norm.weight"),
    WeightSpec("lm_head", lambda c: (c.hidden_size, c.vocab_size), (None, "vocab"), quant_axis=0,
               when=lambda c: not c.tie_word_embeddings, tied_to="embed",
               hf_name="lm_head.weight", hf_transpose=True, gguf_name="output.weight", gguf_transpose=True),
)


def weight_spec(name: str) -> WeightSpec | None:
    """The :data:`WEIGHTS` entry of parameter ``name`` (``"w_qkv"``), or ``None`` (e.g. for an
    int8 ``<name>_scale``, a part such as ``"wq"``, or a name the table does not have)."""
    for spec in WEIGHTS:
        if spec.name == name:
            return spec
    return None


def part_of(name: str) -> tuple[WeightSpec, Part] | None:
    """``(fused weight, part)`` of a part name (``"wq"`` → ``w_qkv``'s first part), or ``None``."""
    for spec in WEIGHTS:
        for part in spec.parts:
            if part.name == name:
                return spec, part
    return None


def layer_weights(cfg: ModelConfig) -> tuple[WeightSpec, ...]:
    """The per-layer weights a block of a model with config ``cfg`` has, in table order."""
    return tuple(s for s in WEIGHTS if s.per_layer and s.present(cfg))


def num_params(cfg: ModelConfig) -> int:
    """Number of parameters of a model with config ``cfg`` (a tied head counted once), from
    :data:`WEIGHTS`."""
    total = 0
    for spec in WEIGHTS:
        if spec.present(cfg):
            total += int(np.prod(spec.shape(cfg))) * (cfg.num_layers if spec.per_layer else 1)
    return total


def matmul_weights() -> tuple[str, ...]:
    """Names of the matmul weights (int8-quantized in the int8 format), from :data:`WEIGHTS`."""
    return tuple(s.name for s in WEIGHTS if s.quant_axis is not None)


def param_logical_axes() -> dict[str, tuple]:
    """``{parameter name: logical axis of each dimension}`` for every weight of :data:`WEIGHTS`
    and the int8 ``<name>_scale`` of each matmul weight (its output dimensions' axes)."""
    out = {s.name: tuple(s.logical_axes) for s in WEIGHTS}
    out.update({s.name + "_scale": s.scale_axes for s in WEIGHTS if s.quant_axis is not None})
    return out


def checkpoint_names(cfg: ModelConfig, fmt: str) -> dict[str, tuple[tuple, WeightSpec, object]]:
    """``{tensor name: (path, spec, tensor)}`` of every checkpoint tensor with a name in a
    ``fmt`` (``"hf"`` or ``"gguf"``) checkpoint, for every layer of ``cfg``: ``tensor`` is the
    :class:`Part` of a fused weight (``path`` the part's, ``("layers", i, "wq")``) or the spec
    itself. Weights that ``cfg`` does not have (``spec.present(cfg)`` false) are included: a
    loader skips a tied copy (``spec.tied_to``) and refuses the rest.

    Raises:
      KeyError: ``fmt`` is not ``"hf"`` or ``"gguf"``.
    """
    out = {}
    for spec in WEIGHTS:
        for i in (range(cfg.num_layers) if spec.per_layer else (None,)):
            for t in spec.tensors():
                name = t.checkpoint_name(fmt, i, cfg)
                if name is not None:
                    out[name] = (spec.path(i, t.name), spec, t)
    return out


def fuse(spec: WeightSpec, cfg: ModelConfig, arrays):
    """The stored weight ``spec`` from its parts' arrays (in ``spec.parts`` order, each of the
    part's ``shape``): each reshaped to its ``view``, concatenated on ``concat_axis``. numpy
    in, numpy out; jax arrays give a jax array."""
    xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
    views = [xp.reshape(a, p.view(cfg)) for p, a in zip(spec.parts, arrays)]
    return xp.concatenate(views, axis=spec.concat_axis)


def split(spec: WeightSpec, cfg: ModelConfig, arr) -> list:
    """``[(tensor, array)]``: the checkpoint tensors of a stored weight ``arr`` (the inverse of
    :func:`fuse`: each part sliced out of ``concat_axis`` and reshaped to its ``shape``), or
    ``[(spec, arr)]`` for a weight without parts. numpy parts are C-contiguous copies (a strided
    view would be written wrongly by ``safetensors.numpy.save_file``, which copies raw bytes)."""
    if not spec.parts:
        return [(spec, arr)]
    out, start = [], 0
    for p in spec.parts:
        n = p.view(cfg)[spec.concat_axis]
        idx = [slice(None)] * arr.ndim
        idx[spec.concat_axis] = slice(start, start + n)
        part = arr[tuple(idx)].reshape(p.shape(cfg))
        out.append((p, np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part))
        start += n
    return out


def storage_dtype(fmt: str):
    """Array dtype of matmul weights for a weight format; norms/biases/scales stay float32
    except in bfloat16, where every parameter is bf16."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.uint8}[fmt]


def param_dtype(spec: WeightSpec, fmt: str):
    """The dtype weight ``spec`` is stored in, in weight format ``fmt``: a matmul weight in the
    format's :func:`storage_dtype`; any other (norms, biases) bf16 in ``bfloat16``, else float32.
    An int8 matmul weight also has a float32 ``<name>_scale`` (:func:`quantize_int8`)."""
    if spec.quant_axis is not None:
        return storage_dtype(fmt)
    return jnp.bfloat16 if fmt == "bfloat16" else jnp.float32


def scale_shape(shape, axis: int) -> tuple:
    """Shape of the int8 ``<name>_scale`` of a weight of ``shape`` blocked along ``axis``:
    ``(2,) + shape`` with ``shape[axis]`` replaced by its number of blocks of :data:`QUANT_BLOCK`
    (the last one partial when it does not divide); ``[0]`` the scales d, ``[1]`` the offsets m."""
    shape = tuple(shape)
    axis %= len(shape)
    return (2,) + shape[:axis] + (-(-shape[axis] // QUANT_BLOCK),) + shape[axis + 1:]


def quantize_int8(w, axis: int):
    """The int8 format of a float weight: per block of :data:`QUANT_BLOCK` consecutive elements
    along ``axis`` (the input dimension), ``w ≈ d · code + m`` with ``m = min``,
    ``d = (max − min) / 255`` and ``code = round((w − m) / d)`` in 0..255 (round half to even; a
    constant block has ``d = 0``, codes 0 and is exact). Asymmetric 8 bits per block: the error
    is at most d/2 per element (measured on the default model: BENCHMARKS.md "Issue 26"). GGUF
    files' Q4_0 / Q4_1 / Q8_0 blocks are kept exactly instead (:mod:`specjax.io.gguf`).

    Returns:
      ``(codes uint8 of w.shape, scale float32 of`` :func:`scale_shape` ``)``.
    """
    from specjax.models import q8  # the arithmetic's one home (the kernel's module)

    if isinstance(w, jax.core.Tracer):  # inside a jitted program (quantize_int8_blocks)
        return q8.quantize_blocks(jnp.asarray(w, jnp.float32), axis)
    # a concrete array: numpy (the same bits; jnp op by op took 6-8 s for the shipped drafter)
    codes, scale = q8.quantize_blocks(np.asarray(w, np.float32), axis)
    return jnp.asarray(codes), jnp.asarray(scale)


class BlockCodes(NamedTuple):
    """A matmul weight already in the int8 format (a GGUF file's exact Q4_0 / Q4_1 / Q8_0 blocks,
    :func:`specjax.io.gguf.block_codes`): ``codes`` uint8 of the weight's shape, ``scale`` float32
    of :func:`scale_shape` (numpy). ``shape`` is the weight's."""

    codes: np.ndarray
    scale: np.ndarray

    @property
    def shape(self) -> tuple:
        return tuple(self.codes.shape)


def fuse_blocks(spec: "WeightSpec", cfg: ModelConfig, parts: list) -> BlockCodes:
    """:func:`fuse` of :class:`BlockCodes` parts: the codes as :func:`fuse` joins floats, each scale
    reshaped to its part's ``view`` with the blocks in place of ``quant_axis`` and joined on the same axis."""
    codes = fuse(spec, cfg, [p.codes for p in parts])
    scales = []
    for part, p in zip(spec.parts, parts):
        view = list(part.view(cfg))
        view[spec.quant_axis] = -1  # the blocks
        scales.append(p.scale.reshape(2, *view))
    return BlockCodes(codes, np.concatenate(scales, axis=spec.concat_axis + 1))


def dequantize_int8(codes, scale, axis: int):
    """The float32 weight of int8 ``codes`` and ``scale`` (:func:`quantize_int8`): ``d · code + m``,
    rounded after the product and after the sum (a GGUF block's float32 dequantization, bit for bit).
    Concrete arrays go through numpy (a jax array in, a jax array out)."""
    xp = jnp if isinstance(codes, jax.core.Tracer) or isinstance(scale, jax.core.Tracer) else np
    codes = xp.asarray(codes)
    scale = xp.asarray(scale, np.float32)
    axis %= codes.ndim
    k = codes.shape[axis]
    if xp is np and k % QUANT_BLOCK == 0:
        # the same products and sums, with the scales broadcast over each block instead of
        # repeated into two weight-sized arrays (≈ 5× faster: a drafter's copy of the embedding)
        blocks = codes.reshape(*codes.shape[:axis], k // QUANT_BLOCK, QUANT_BLOCK, *codes.shape[axis + 1:])
        d, m = (np.expand_dims(scale[i], axis + 1) for i in (0, 1))
        out = (d * blocks.astype(np.float32)).astype(np.float32) + m
        return jnp.asarray(out.reshape(codes.shape))
    d, m = (xp.repeat(scale[i], QUANT_BLOCK, axis=axis) for i in (0, 1))
    idx = [slice(None)] * codes.ndim
    idx[axis] = slice(0, k)
    out = (d[tuple(idx)] * codes.astype(np.float32)).astype(np.float32) + m[tuple(idx)]
    return out if xp is jnp else jnp.asarray(out)


QUANT_BLOCK_ELEMS = 1 << 24  # elements per block of quantize_int8_blocks (64 MB as float32)
# one fused program per block shape: ~3x faster than quantize_int8's ops one by one, the same values
_quantize_int8_jit = jax.jit(quantize_int8, static_argnums=1)


def quantize_int8_blocks(w, axis: int, block_elems: int = QUANT_BLOCK_ELEMS) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_int8` of a concrete array (numpy or jax, any float dtype) without its float32
    copy of the whole tensor: blocks along ``axis`` are quantized independently, so the tensor is
    cut along its largest other axis into pieces of about ``block_elems`` elements, each quantized
    by :func:`quantize_int8` (jitted) and written into the result (the same values bit for bit).
    Host memory beyond ``w`` and the result: a few float32 pieces (~64 MB each by default).

    Returns:
      ``(codes, scale)`` as numpy arrays: ``codes`` uint8 of ``w.shape``, ``scale`` float32 of
      :func:`scale_shape`.
    """
    shape = tuple(w.shape)
    axis %= len(shape)
    n = int(np.prod(shape))
    if len(shape) < 2 or n <= block_elems:
        q, scale = _quantize_int8_jit(w, axis)
        return np.asarray(q), np.asarray(scale)
    cut = max((a for a in range(len(shape)) if a != axis), key=lambda a: shape[a])
    step = max(1, block_elems * shape[cut] // n)
    q = np.empty(shape, np.uint8)
    scale = np.empty(scale_shape(shape, axis), np.float32)
    for start in range(0, shape[cut], step):
        idx = [slice(None)] * len(shape)
        idx[cut] = slice(start, start + step)
        qb, sb = _quantize_int8_jit(w[tuple(idx)], axis)
        q[tuple(idx)] = np.asarray(qb)
        scale[(slice(None),) + tuple(idx)] = np.asarray(sb)
    return q, scale


def init_weight(spec: WeightSpec, cfg: ModelConfig, next_key: Callable[[], jax.Array] | None = None) -> jax.Array:
    """A float32 weight of ``spec.shape(cfg)`` initialised per ``spec.init``: N(0, 0.02), one
    key from ``next_key()`` per checkpoint tensor (each part drawn in its own shape, then fused
    by :func:`fuse`: the values the split layout had with the same keys); or all ones / zeros.

    Raises:
      ValueError: an unknown ``spec.init``.
    """
    shape = tuple(spec.shape(cfg))
    if spec.init == "normal":
        if not spec.parts:
            return 0.02 * jax.random.normal(next_key(), shape, jnp.float32)
        return fuse(spec, cfg, [0.02 * jax.random.normal(next_key(), tuple(p.shape(cfg)), jnp.float32)
                                for p in spec.parts])
    if spec.init not in ("ones", "zeros"):
        raise ValueError(f"weight {spec.name}: unknown init {spec.init!r} (normal, ones or zeros)")
    return jnp.full(shape, 1.0 if spec.init == "ones" else 0.0, jnp.float32)
