"""Parameters from checkpoint tensors (part of :mod:`specjax.io.loading`, which re-exports it):
:func:`assemble_params` checks every expected tensor's presence and shape, joins the parts of a
fused weight, quantizes int8 formats and places each tensor on its device; the abstract model
it fills is built quickly (:func:`abstract_model_of`)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models import llama
from specjax.models.config import CheckpointError, ModelConfig
from specjax.models.llama import flatten_params as _flat, unflatten_params as _unflat, weight_format as _dtype


def assemble_params(
    cfg: ModelConfig,
    tensors: Iterator[tuple[tuple, Any]],
    dtype="float32",
    place: Callable[[tuple, Any], jax.Array] | None = None,
    source: str = "checkpoint",
):
    """Build ``(graphdef, params)`` from ``(path, array)`` pairs in specjax layout.

    Every expected tensor must appear once with the right shape. A fused weight
    (:attr:`specjax.models.weights.WeightSpec.parts`) may come whole or as its parts, at the
    parts' paths (``("layers", 0, "wq")``, as the checkpoint loaders yield them): the parts are
    kept until the last one arrives, then concatenated (:func:`specjax.models.weights.fuse`).

    Args:
      tensors: iterator of ``(param path tuple, array)``, e.g. ``(("layers", 0, "wq"), w)`` or
        ``(("layers", 0, "w_qkv"), w)``.
      dtype: parameter dtype.
      place: ``(path, array) -> jax.Array`` placing one tensor (device / sharding);
        default ``jax.device_put``. An object with ``for_config(cfg, dtype)`` is first
        bound to the config (see :class:`specjax.runtime.sharding.Placer`).

    Raises:
      CheckpointError: naming every missing tensor, or an unexpected/mis-shaped one.
    """
    dt = _dtype(dtype)
    if place is not None and hasattr(place, "for_config"):  # e.g. specjax.runtime.sharding.Placer:
        place = place.for_config(cfg, dt)  # head-sharding depends on head counts, not only shapes
    graphdef, abstract = abstract_model_of(cfg, str(dt))
    expected = {tuple(p): v for p, v in _flat(nnx.to_pure_dict(abstract))}
    got: dict[tuple, jax.Array] = {}
    pending: dict[tuple, dict] = {}  # fused weight path -> {part name: array} so far
    for path, arr in tensors:
        fused = llama.part_of(path[-1]) if path not in expected else None
        if fused is not None and path[:-1] + (fused[0].name,) in expected:
            spec, part = fused
            want = tuple(part.shape(cfg))
            if tuple(arr.shape) != want:
                raise CheckpointError(f"{source}: tensor {param_path_name(path)} has shape {tuple(arr.shape)}, expected {want}")
            path = path[:-1] + (spec.name,)
            have = pending.setdefault(path, {})
            have[part.name] = arr
            if len(have) < len(spec.parts):
                continue
            parts = [have.pop(q.name) for q in spec.parts]  # the parts go with the fused copy
            if all(isinstance(a, llama.BlockCodes) for a in parts):
                arr = llama.fuse_blocks(spec, cfg, parts)
            else:  # float parts, or exact blocks beside float parts: joined as floats
                arr = llama.fuse(spec, cfg, [_float(a, spec) for a in parts])
            del parts, pending[path]
        if path not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {param_path_name(path)} (shape {tuple(arr.shape)}) "
                                  f"for a {cfg.model_type} model with this config")
        want = tuple(expected[path].shape)
        if tuple(arr.shape) != want:
            raise CheckpointError(f"{source}: tensor {param_path_name(path)} has shape {tuple(arr.shape)}, expected {want}")
        spec = llama.weight_spec(path[-1])
        if isinstance(arr, llama.BlockCodes) and not (dt == "int8" and spec is not None and spec.quant_axis is not None):
            arr = _float(arr, spec)
        items = [(path, arr)]
        if isinstance(arr, llama.BlockCodes):  # a GGUF file's exact blocks (int8 only)
            items = [(path, arr.codes), (path[:-1] + (path[-1] + "_scale",), arr.scale)]
        elif dt == "int8" and spec is not None and spec.quant_axis is not None:  # block codes + float32 scales
            q, scale = llama.quantize_int8_blocks(arr, axis=spec.quant_axis)  # no float32 copy of the whole tensor
            items = [(path, q), (path[:-1] + (path[-1] + "_scale",), scale)]
        del arr  # the source tensor goes as soon as it is converted (the next one is read after)
        while items:
            p, a = items.pop(0)
            a = jnp.asarray(a, dtype=expected[p].dtype)
            got[p] = place(p, a) if place else jax.device_put(a)
            del a
    _check_complete(expected, got, pending, source)
    return graphdef, state_of(abstract, got)


def _check_complete(expected: dict, got: dict, pending: dict, source: str) -> None:
    """Raise :class:`CheckpointError` naming every tensor of ``expected`` (path → abstract array)
    that :func:`assemble_params` did not get: the whole weight, or a fused weight's parts that did
    not arrive (``pending``: fused path → {part name: array})."""
    missing = []
    for p in expected:
        spec = llama.weight_spec(p[-1])
        if p in got or spec is None:  # present, or an int8 scale (named with its weight)
            continue
        have = pending.get(p, {})
        missing += [p[:-1] + (t.name,) for t in spec.tensors() if t.name not in have] if spec.parts else [p]
    if missing:
        names = ", ".join(param_path_name(p) for p in missing[:8]) + (" …" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: {len(missing)} missing tensor(s): {names}")


def _float(arr, tensor):
    """A float32 numpy array of ``arr`` (exact int8 blocks dequantized along their tensor's quant axis)."""
    if not isinstance(arr, llama.BlockCodes):
        return arr
    return np.asarray(llama.dequantize_int8(arr.codes, arr.scale, tensor.quant_axis))


def abstract_model_of(cfg: ModelConfig, fmt: str):
    """:func:`specjax.models.llama.abstract_model` (the same graphdef and abstract state), built
    ~5× faster: under ``eval_shape`` every ``nnx.Rngs`` draw updates its counter variable, and
    flax 0.12's ``Variable.set_value`` then reads ``tracer.sharding``, whose error message walks
    the whole trace so far (quadratic: 1.3 of 1.9 s for SmolLM2-135M). Shapes do not depend on
    the keys, so a fixed key does, and :class:`~specjax.models.params.ShapesOnly` also skips each
    weight's initializer and quantizer. Any failure falls back to ``llama.abstract_model``."""
    try:
        model = nnx.eval_shape(lambda: llama.Transformer(cfg, fmt=fmt, rngs=llama.ShapesOnly()))
        return nnx.split(model)
    except Exception:  # a model whose construction needs more of nnx.Rngs
        return llama.abstract_model(cfg, fmt)


def state_of(abstract, got: dict):
    """The ``nnx.State`` of ``abstract`` holding the arrays ``{param path: array}``."""
    params = nnx.State(abstract)
    nnx.replace_by_pure_dict(params, _unflat(got))
    return params


def param_path_name(path):
    return ".".join(str(p) for p in path)
