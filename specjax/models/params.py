"""The parameters of a Llama-family model as Flax NNX modules, and what handles them whole.

:class:`Transformer` and its :class:`Block` s hold the entries of
:data:`specjax.models.weights.WEIGHTS` that a config has, in a weight format (float32, bfloat16,
int8 block codes with scales and offsets); :func:`abstract_model` / :func:`init_model` split them once into
``(graphdef, params)``, the pytrees everything else runs on (:func:`specjax.models.llama.apply`).
Also: the format of a dtype, parameter bytes, and nested-dict (de)flattening for the loaders.
Re-exported by :mod:`specjax.models.llama`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import weights
from specjax.models.config import ModelConfig
from specjax.models.weights import (
    WEIGHT_FORMATS, WeightSpec, init_weight, layer_weights, param_dtype, quantize_int8, storage_dtype,
)


class ShapesOnly:
    """A stand-in for ``nnx.Rngs`` when only shapes are built (:func:`specjax.io.assemble.abstract_model_of`):
    ``params()`` is a fixed key, and the modules skip their initializers (:func:`_add_weight`)."""

    @staticmethod
    def params():
        return jax.random.key(0)


def _add_weight(module, spec: WeightSpec, cfg: ModelConfig, fmt: str, rngs: nnx.Rngs) -> None:
    """Set ``module.<name>`` (and its int8 ``<name>_scale``) to a new weight in format ``fmt``.
    ``rngs`` a :class:`ShapesOnly` (under ``nnx.eval_shape``): zeros of the weight's shape and
    dtype, without tracing its initializer and quantizer (the same abstract model; ≈ 1 s less
    per load of the default model)."""
    if isinstance(rngs, ShapesOnly):
        shape = tuple(spec.shape(cfg))
        setattr(module, spec.name, nnx.Param(jnp.zeros(shape, param_dtype(spec, fmt))))
        if spec.quant_axis is not None and fmt == "int8":
            scale = weights.scale_shape(shape, spec.quant_axis)
            setattr(module, spec.name + "_scale", nnx.Param(jnp.zeros(scale, jnp.float32)))
        return
    w = init_weight(spec, cfg, rngs.params)
    if spec.quant_axis is not None and fmt == "int8":
        q, s = quantize_int8(w, spec.quant_axis)
        setattr(module, spec.name, nnx.Param(q))
        setattr(module, spec.name + "_scale", nnx.Param(s))
        return
    setattr(module, spec.name, nnx.Param(w.astype(param_dtype(spec, fmt))))


class Block(nnx.Module):
    """One pre-norm decoder block: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP.

    Its parameters are the per-layer entries of :data:`specjax.models.weights.WEIGHTS` that
    ``cfg`` has. Matmul weights are stored ``[in, *out]``; in the int8 format as uint8 codes
    with a float32 ``<name>_scale`` (scale and offset per block of 32 inputs,
    :func:`specjax.models.weights.quantize_int8`).
    """

    def __init__(self, cfg: ModelConfig, fmt: str, rngs: nnx.Rngs):
        for spec in layer_weights(cfg):
            _add_weight(self, spec, cfg, fmt, rngs)


class Transformer(nnx.Module):
    """Parameters of a Llama-family decoder (the entries of
    :data:`specjax.models.weights.WEIGHTS` that ``cfg`` has).
    Call it through :func:`specjax.models.llama.apply`.

    ``fmt``: weight format — ``float32``; ``bfloat16`` (bf16 weights, float32
    accumulation); ``int8`` (8-bit weight codes with a scale and offset per block of 32 inputs ×
    two-level int8 activations per block, int32 block sums; norms, biases and scales float32).
    """

    def __init__(self, cfg: ModelConfig, *, fmt: str = "float32", rngs: nnx.Rngs):
        storage_dtype(fmt)  # validates
        table = weights.WEIGHTS
        first_layer = next((k for k, s in enumerate(table) if s.per_layer), len(table))
        # in table order: the model weights listed before the blocks, the blocks, the rest
        for k, spec in enumerate(table):
            if k == first_layer:
                self.layers = nnx.List([Block(cfg, fmt, rngs) for _ in range(cfg.num_layers)])
            if not spec.per_layer and spec.present(cfg):
                _add_weight(self, spec, cfg, fmt, rngs)
        if first_layer == len(table):  # a table without per-layer weights
            self.layers = nnx.List([])


def _fmt(dtype) -> str:
    if isinstance(dtype, str) and dtype in WEIGHT_FORMATS:
        return dtype
    return {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8", "uint8": "int8"}[jnp.dtype(dtype).name]


def abstract_model(cfg: ModelConfig, dtype="float32"):
    """``(graphdef, abstract_params)`` without allocating weights (``nnx.eval_shape``).
    ``dtype``: a weight format name (float32, bfloat16, int8) or the matching dtype."""
    model = nnx.eval_shape(lambda: Transformer(cfg, fmt=_fmt(dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


def param_shapes(cfg: ModelConfig, dtype="float32") -> dict[tuple, jax.ShapeDtypeStruct]:
    """``{path: ShapeDtypeStruct}`` of every parameter (:func:`flatten_params` paths: ``("embed",)``,
    ``("layers", i, "w_qkv")``, int8 ``<name>_scale``), read from the weight table alone: what
    :func:`abstract_model` gives, in milliseconds instead of tracing the modules (seconds for a 70B)."""
    fmt = _fmt(dtype)
    out = {}
    for spec in weights.WEIGHTS:
        if not spec.present(cfg):
            continue
        shape = tuple(spec.shape(cfg))
        arrays = [(spec.name, shape, param_dtype(spec, fmt))]
        if spec.quant_axis is not None and fmt == "int8":
            arrays.append((spec.name + "_scale", weights.scale_shape(shape, spec.quant_axis), jnp.float32))
        for layer in range(cfg.num_layers) if spec.per_layer else [None]:
            for name, shp, dt in arrays:
                out[spec.path(layer, name)] = jax.ShapeDtypeStruct(shp, dt)
    return out


def init_model(cfg: ModelConfig, seed: int = 0, dtype="float32"):
    """``(graphdef, params)`` with random weights (N(0, 0.02), norms 1, biases 0)."""
    return nnx.split(Transformer(cfg, fmt=_fmt(dtype), rngs=nnx.Rngs(seed)))


def param_or_none(module, name):
    """A parameter's value, or None if the module does not have it."""
    return module.__dict__[name][...] if name in module.__dict__ else None


def module_arrays(module) -> dict:
    """``{name: array}`` of a module's own parameters (a block's weights and int8 scales)."""
    return {k: v[...] for k, v in vars(module).items() if isinstance(v, nnx.Param)}


def param_bytes(params) -> int:
    """Total bytes of all parameter arrays."""
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


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
    """``(path, leaf)`` pairs of a nested parameter dict (``("layers", 0, "w_qkv")``)."""
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
