"""Device meshes and sharding: the same decode on one chip, eight, or a pod.

Everything runs on JAX's own runtime: a 2-D :class:`jax.sharding.Mesh` with axes
``data`` and ``model``, :class:`~jax.sharding.NamedSharding` for every parameter,
KV cache and per-row array, ``jit`` with output shardings (GSPMD inserts the
collectives; no ``pmap``), and ``jax.distributed`` for several hosts.

Logical axis rules (Megatron-style tensor parallelism + data parallelism):

=============  ==============================  ========
logical axis   where                           mesh axis
=============  ==============================  ========
batch          every per-row array, KV caches  data
heads          wo (rows)                       model
kv_heads       w_qkv/b_qkv (KV groups), caches model
mlp            w_gate_up (columns), w_down     model
vocab          embed ``[V, D]`` rows,          model
               lm_head ``[D, V]`` columns
=============  ==============================  ========

The parameter rows come from the weight table (each :class:`specjax.models.llama.WeightSpec`
names the logical axis of each dimension; :data:`PARAM_LOGICAL_AXES`).
Everything else (norms, ``bo``, the model width D, cache length and head_dim) is
replicated. Head dimensions split whole heads only: the fused ``w_qkv [D, KV, G + 2, hd]``
(per KV group its G query heads, its key and value head) and the caches are sharded on KV
groups iff ``KV % model == 0``, ``wo [H·hd, D]`` iff ``H % model == 0``. A
dimension that does not divide its mesh axis is replicated (see
:func:`replication_notes`; the CLI prints it once). Parameters are replicated over
``data``; a batch that does not divide ``data`` is padded with rows that are done
from the start and dropped from the results.

Row keys are per row (``fold_in(request key, round)``) and JAX's threefry is
partitionable, so the mesh never changes which random numbers a row sees; greedy
outputs can differ from one device only where float32 reductions split across
``model`` flip a near-tie.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import weakref
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.models import llama, weights

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

__all__ = [
    "DATA", "MODEL", "MeshSpec", "AXIS_RULES", "PARAM_LOGICAL_AXES", "param_spec", "param_shardings",
    "param_placer", "Placer", "shard_params", "shard_model", "cache_spec", "cache_sharding",
    "cache_shardings", "batch_sharding", "replication_notes", "warn_replicated", "mesh_of", "initialize",
]

# logical axis -> mesh axis (anything not named here is replicated)
AXIS_RULES: dict[str, str] = {"batch": DATA, "heads": MODEL, "kv_heads": MODEL, "mlp": MODEL, "vocab": MODEL}



class _ParamLogicalAxes(Mapping):
    """``{parameter name (last path element): logical axis of each dimension}``, read from the
    weight table (:data:`specjax.models.weights.WEIGHTS`, :func:`~specjax.models.weights.param_logical_axes`)
    on every lookup: a weight added to the table is sharded by its own axes, and an int8
    ``<name>_scale`` follows its weight's output dimensions (its block axis is replicated)."""

    def __getitem__(self, name):
        return llama.param_logical_axes()[name]

    def __iter__(self):
        return iter(llama.param_logical_axes())

    def __len__(self):
        return len(llama.param_logical_axes())

    def __repr__(self):
        return f"PARAM_LOGICAL_AXES({llama.param_logical_axes()!r})"


PARAM_LOGICAL_AXES: Mapping[str, tuple] = _ParamLogicalAxes()

CACHE_LOGICAL_AXES = ("batch", "kv_heads", None, None)  # [B, KV, S, hd]


# ----------------------------------------------------------------------------- mesh
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A ``data × model`` device mesh (sizes ≥ 1).

    ``data``: rows of the batch split across devices (data parallelism).
    ``model``: heads, MLP hidden units and vocabulary split across devices (tensor parallelism).
    """

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for name in AXES:
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"mesh size {name}={v!r} must be an integer >= 1")

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"

    @classmethod
    def parse(cls, text: str, device_count: int | None = None) -> "MeshSpec":
        """Parse ``"data=2,model=4"`` (either axis may be omitted: it takes the remaining
        devices). The product must equal the number of devices (all hosts together).

        Raises:
          ValueError: a malformed string, an unknown or repeated axis, a size < 1, or sizes
            whose product exceeds / does not use all of the devices.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"--mesh must look like data=D,model=M (e.g. data=2,model=4), got {text!r}")
        sizes: dict[str, int] = {}
        for part in text.split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]+)\s*=\s*([0-9]+)\s*", part)
            if not m:
                raise ValueError(f"--mesh {text!r}: cannot read {part.strip()!r}; use data=D,model=M, e.g. data=2,model=4")
            name, val = m.group(1).lower(), int(m.group(2))
            if name not in AXES:
                raise ValueError(f"--mesh {text!r}: unknown axis {name!r}; the axes are 'data' and 'model'")
            if name in sizes:
                raise ValueError(f"--mesh {text!r}: axis {name!r} given twice")
            if val < 1:
                raise ValueError(f"--mesh {text!r}: {name} must be >= 1, got {val}")
            sizes[name] = val
        n = jax.device_count() if device_count is None else int(device_count)
        if len(sizes) == 1:
            (name, val), = sizes.items()
            other = MODEL if name == DATA else DATA
            if n % val:
                raise ValueError(f"--mesh {text!r}: {name}={val} does not divide the {n} available device(s)")
            sizes[other] = n // val
        prod = sizes[DATA] * sizes[MODEL]
        if prod > n:
            raise ValueError(f"--mesh {text!r} needs {prod} devices but only {n} are available "
                             f"(jax.device_count() = {n}); choose sizes whose product is {n}")
        if prod != n:
            raise ValueError(f"--mesh {text!r} uses {prod} of the {n} devices; choose sizes whose product is {n} "
                             f"(e.g. data={n // sizes[MODEL] if n % sizes[MODEL] == 0 else n},model="
                             f"{sizes[MODEL] if n % sizes[MODEL] == 0 else 1})")
        return cls(data=sizes[DATA], model=sizes[MODEL])

    def make(self, devices=None) -> Mesh:
        """``jax.make_mesh((data, model), ("data", "model"))`` with automatic (GSPMD) axes,
        so the model code needs no sharding annotations. ``devices``: optional subset."""
        auto = (jax.sharding.AxisType.Auto,) * 2
        kw = {} if devices is None else {"devices": list(devices)}
        return jax.make_mesh((self.data, self.model), AXES, axis_types=auto, **kw)


def _axis_size(mesh: Mesh, axis: str) -> int:
    return int(dict(mesh.shape).get(axis, 1))


def mesh_of(tree) -> Mesh | None:
    """The ``data × model`` mesh the arrays of ``tree`` are sharded on, or ``None``."""
    for leaf in jax.tree_util.tree_leaves(tree):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and set(AXES) <= set(s.mesh.axis_names):
            return s.mesh
        return None
    return None


def as_mesh(mesh) -> Mesh:
    """A :class:`Mesh` from a ``Mesh``, a :class:`MeshSpec` or a ``"data=D,model=M"`` string."""
    if isinstance(mesh, Mesh):
        missing = set(AXES) - set(mesh.axis_names)
        if missing:
            raise ValueError(f"the mesh needs axes 'data' and 'model'; it has {mesh.axis_names}")
        return mesh
    if isinstance(mesh, str):
        mesh = MeshSpec.parse(mesh)
    if isinstance(mesh, MeshSpec):
        return mesh.make()
    raise TypeError(f"mesh must be a jax.sharding.Mesh, a MeshSpec or 'data=D,model=M', got {type(mesh).__name__}")


# ----------------------------------------------------------------------------- rules
def _units(cfg) -> dict[str, int]:
    """Size of each logical axis in whole units (heads, not head_dim columns)."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size,
            "vocab": cfg.vocab_size}


def _spec(logical, units: dict, mesh: Mesh) -> P:
    out = []
    for name in logical:
        axis = AXIS_RULES.get(name) if name else None
        if axis is None or name not in units or units[name] % _axis_size(mesh, axis):
            out.append(None)
        else:
            out.append(axis)
    return P(*out)


def param_spec(path: tuple, shape: tuple, cfg, mesh: Mesh) -> P:
    """PartitionSpec of parameter ``path`` (e.g. ``("layers", 0, "w_qkv")``) with ``shape``.
    Unknown names (and shapes of another rank) are replicated."""
    name = str(path[-1])
    spec = weights.weight_spec(name[:-len("_scale")]) if name.endswith("_scale") else None
    if spec is not None and spec.quant_axis is not None and len(shape) == len(spec.logical_axes) + 1:
        # an int8 scale [2, ..., blocks, ...]: its weight's spec; the blocks follow the weight's input
        # axis when each device's slice of it is whole blocks, else they are replicated
        w = tuple(_spec(spec.logical_axes, _units(cfg), mesh))
        w += (None,) * (len(spec.logical_axes) - len(w))
        q = spec.quant_axis
        if w[q] is not None and (shape[1 + q] % _axis_size(mesh, w[q]) or spec.shape(cfg)[q] % weights.QUANT_BLOCK):
            w = w[:q] + (None,) + w[q + 1:]
        return P(None, *w)
    logical = PARAM_LOGICAL_AXES.get(name)
    if logical is None or len(logical) != len(shape):
        return P(*([None] * len(shape)))
    return _spec(logical, _units(cfg), mesh)


def param_shardings(cfg, mesh: Mesh, dtype="float32") -> dict[tuple, NamedSharding]:
    """``{param path: NamedSharding}`` for every parameter of a model with config ``cfg``."""
    from flax import nnx

    _, abstract = llama.abstract_model(cfg, llama.weight_format(dtype))
    return {p: NamedSharding(mesh, param_spec(p, v.shape, cfg, mesh))
            for p, v in llama.flatten_params(nnx.to_pure_dict(abstract))}


def cache_spec(cfg, mesh: Mesh, batch: int | None = None) -> P:
    """PartitionSpec of one KV-cache array ``[B, KV, S, hd]``: batch on ``data`` (when it
    divides), KV heads on ``model`` when ``KV % model == 0``."""
    units = {"kv_heads": cfg.num_kv_heads, "batch": batch if batch is not None else _axis_size(mesh, DATA)}
    return _spec(CACHE_LOGICAL_AXES, units, mesh)


def cache_sharding(cfg, mesh: Mesh, batch: int | None = None) -> NamedSharding:
    return NamedSharding(mesh, cache_spec(cfg, mesh, batch))


def batch_sharding(mesh: Mesh, ndim: int = 1, batch: int | None = None) -> NamedSharding:
    """Sharding of a per-row array ``[B, ...]``: rows on ``data`` (replicated if ``batch``
    is given and does not divide it)."""
    if ndim == 0:
        return NamedSharding(mesh, P())
    lead = DATA if batch is None or batch % _axis_size(mesh, DATA) == 0 else None
    return NamedSharding(mesh, P(lead, *([None] * (ndim - 1))))


def cache_shardings(cfg, mesh: Mesh, cache):
    """A :class:`~specjax.models.llama.KVCache` of shardings matching ``cache`` (arrays or shapes)."""
    b = cache.lengths.shape[0]
    s = cache_sharding(cfg, mesh, b)
    return llama.KVCache(k=[s] * len(cache.k), v=[s] * len(cache.v), lengths=batch_sharding(mesh, 1, b))


def replication_notes(cfg, mesh_or_model_size) -> list[str]:
    """Human-readable list of the dimensions that do not divide the ``model`` axis (replicated)."""
    m = mesh_or_model_size if isinstance(mesh_or_model_size, int) else _axis_size(mesh_or_model_size, MODEL)
    if m <= 1:
        return []

    def on(axis):  # the weights (from the table) with a dimension on this logical axis
        return ", ".join(w.name for w in weights.WEIGHTS if axis in w.logical_axes and w.quant_axis is not None
                         and w.present(cfg))

    notes = []
    if cfg.num_heads % m:
        notes.append(f"attention heads ({cfg.num_heads}: {on('heads')})")
    if cfg.num_kv_heads % m:
        notes.append(f"KV heads ({cfg.num_kv_heads}: {on('kv_heads')}, KV cache)")
    if cfg.intermediate_size % m:
        notes.append(f"MLP hidden ({cfg.intermediate_size}: {on('mlp')})")
    if cfg.vocab_size % m:
        notes.append(f"vocabulary ({cfg.vocab_size}: {on('vocab')})")
    return notes


_WARNED: set = set()


def warn_replicated(cfg, mesh, name: str = "model", file=None) -> str | None:
    """Print once per (config, model size) a warning line on stderr naming the replicated
    dimensions; returns the line (or ``None`` when everything divides / already warned)."""
    m = _axis_size(mesh, MODEL) if isinstance(mesh, Mesh) else int(mesh)
    notes = replication_notes(cfg, m)
    key = (cfg, m)
    if not notes or key in _WARNED:
        return None
    _WARNED.add(key)
    line = (f"specjax: warning: {name}: {', '.join(notes)} not divisible by model={m}; "
            f"replicated on the model axis (the rest is sharded)")
    if jax.process_index() == 0:
        print(line, file=file or sys.stderr, flush=True)
    return line


# ----------------------------------------------------------------------------- placement
def put(x, sharding: NamedSharding, dtype=None) -> jax.Array:
    """Place ``x`` (numpy or jax) into ``sharding``. Host data goes straight to each
    device's slice (``make_array_from_callback``), which also works across hosts when every
    process holds the same value. A jax array on one CPU device takes the same path (a
    zero-copy numpy view of it): ``jax.device_put`` of it into a multi-device sharding kept
    35–80% of the tensor beyond the shards (jax 0.10, XLA CPU; benchmarks/load_size.py)."""
    if isinstance(x, jax.Array):
        if dtype is not None and x.dtype != dtype:
            x = x.astype(dtype)
        if x.sharding == sharding:
            return x
        if not x.is_fully_addressable or sharding.is_fully_addressable and not _cpu_to_many(x, sharding):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
    x = np.asarray(x, dtype=dtype)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _cpu_to_many(x: jax.Array, sharding) -> bool:
    """Whether ``x`` lives on one CPU device and ``sharding`` spans several devices."""
    devices = x.devices()
    return len(devices) == 1 and next(iter(devices)).platform == "cpu" and len(sharding.device_set) > 1


class Placer:
    """A ``place(path, array)`` callback for :func:`specjax.io.loading.load_model` that puts each
    tensor straight into its sharding. Bound to a config by the loader (``for_config``),
    since head-sharding depends on head counts, not only on shapes. The loader has already
    converted the tensor to its weight format; the placer only places it."""

    def __init__(self, mesh: Mesh, cfg=None, dtype=None):
        self.mesh, self.cfg, self.dtype = mesh, cfg, dtype

    def for_config(self, cfg, dtype) -> "Placer":
        return Placer(self.mesh, cfg, dtype)

    def __call__(self, path, arr) -> jax.Array:
        if self.cfg is None:
            raise ValueError("Placer used before for_config(cfg, dtype); pass it as load_model(place=...)")
        spec = param_spec(tuple(path), tuple(arr.shape), self.cfg, self.mesh)
        return put(arr, NamedSharding(self.mesh, spec))


def param_placer(mesh: Mesh, cfg=None, dtype=None) -> Placer:
    """The ``place`` callback for ``load_model(path, dtype, place=param_placer(mesh))``."""
    return Placer(mesh, cfg, dtype)


def mesh_str(mesh: Mesh) -> str:
    """``data=D,model=M`` of a mesh."""
    return f"data={_axis_size(mesh, DATA)},model={_axis_size(mesh, MODEL)}"


def shard_params(params, cfg, mesh: Mesh):
    """A copy of the ``nnx.State`` ``params`` with every leaf in its sharding on ``mesh``."""
    from flax import nnx

    from specjax.models.llama import flatten_params, unflatten_params

    pure = nnx.to_pure_dict(params)
    placed = {p: put(v, NamedSharding(mesh, param_spec(p, v.shape, cfg, mesh))) for p, v in flatten_params(pure)}
    out = jax.tree_util.tree_map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, unflatten_params(placed))
    return out


def _replicate(tree, mesh: Mesh):
    return jax.tree_util.tree_map(lambda x: put(x, NamedSharding(mesh, P(*([None] * np.ndim(x))))), tree)


def shard_model(model, mesh: Mesh, warn: bool = True):
    """``model`` (a :class:`~specjax.io.loading.Model`) with its parameters sharded on ``mesh``."""
    if warn:
        warn_replicated(model.config, mesh, name=f"{model.name or 'model'} on mesh {mesh_str(mesh)}")
    return model.replace(params=shard_params(model.params, model.config, mesh))


def shard_drafter(drafter, mesh: Mesh):
    """The drafter with its parameters on ``mesh``: a draft model (a drafter that declares its
    :attr:`~specjax.core.drafting.Drafter.causal_model`) by its OWN config's rules, any other
    parameter pytree replicated."""
    if drafter is None or drafter.params is None:
        return drafter
    model = drafter.causal_model
    if model is not None and dataclasses.is_dataclass(drafter):
        cfg = model.config
        warn_replicated(cfg, mesh, name=f"drafter {drafter.name} on mesh {mesh_str(mesh)}")
        try:
            params = shard_params(drafter.params, cfg, mesh)
        except Exception:  # not a llama nnx.State: keep it whole on every device
            params = _replicate(drafter.params, mesh)
    else:
        params = _replicate(drafter.params, mesh)
    if dataclasses.is_dataclass(drafter):
        return dataclasses.replace(drafter, params=params)
    drafter = copy.copy(drafter)  # never change the caller's object
    drafter.params = params
    return drafter


# ----------------------------------------------------------------------------- decode support
def prepare_decoder(target, drafter, mesh):
    """``(mesh, target, drafter)`` for :class:`specjax.runtime.decoder.Decoder`: ``mesh`` may be
    ``None`` (then the target's own mesh is used, if its parameters are sharded on one)."""
    if mesh is None:
        mesh = mesh_of(target.params)
        if mesh is None:
            return None, target, drafter
    mesh = as_mesh(mesh)
    if mesh_of(target.params) != mesh:
        try:  # several Decoders of one target (e.g. bench) share one sharded copy
            per_mesh = _SHARDED_TARGETS.setdefault(target, {})
        except TypeError:
            per_mesh = {}
        if mesh not in per_mesh:
            per_mesh[mesh] = shard_model(target, mesh)
        target = per_mesh[mesh]
    return mesh, target, shard_drafter(drafter, mesh)


_SHARDED_TARGETS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pad_rows(x, pad: int):
    if pad == 0:
        return x
    x = jax.numpy.asarray(x) if not isinstance(x, (np.ndarray, jax.Array)) else x
    rep = np.repeat(np.asarray(x[:1]), pad, axis=0) if isinstance(x, np.ndarray) else jax.numpy.repeat(x[:1], pad, axis=0)
    return (np.concatenate if isinstance(x, np.ndarray) else jax.numpy.concatenate)([x, rep], axis=0)


def shard_start_args(args, mesh: Mesh):
    """Pad the per-row start arguments of :func:`specjax.runtime.prefill.prefill` to a multiple of the
    ``data`` axis (extra rows copy row 0 with ``max_new = 0``: done from the start) and
    place them with rows on ``data``. Parameters are left as they are."""
    tparams, dparams, prompt, plens, max_new, eos, keys, sampling = args
    b = prompt.shape[0]
    d = _axis_size(mesh, DATA)
    pad = -b % d
    rows = [_pad_rows(x, pad) for x in (prompt, plens, max_new, eos, keys)]
    if pad:
        rows[2] = jax.numpy.asarray(rows[2]).at[b:].set(0)
    sampling = jax.tree_util.tree_map(lambda x: _pad_rows(x, pad), sampling)
    place = lambda x: put(x, batch_sharding(mesh, np.ndim(x)))  # noqa: E731
    rows = [place(x) for x in rows]
    sampling = jax.tree_util.tree_map(place, sampling)
    return (tparams, dparams, *rows, sampling)


def state_shardings(prog, state, mesh: Mesh):
    """Shardings for a :class:`specjax.runtime.decoder.DecodeState` (arrays or shapes): per-row arrays on
    ``data``, the target cache by the target config, a draft model's cache by its own config,
    scalars replicated."""
    b = state.lengths.shape[0]

    def by_row(x):
        nd = len(x.shape)
        return batch_sharding(mesh, nd) if nd >= 1 and x.shape[0] == b else NamedSharding(mesh, P(*([None] * nd)))

    out = jax.tree_util.tree_map(by_row, state)
    out = dataclasses.replace(out, target_cache=cache_shardings(prog.cfg, mesh, state.target_cache))
    model = prog.drafter.causal_model if prog.drafter is not None else None
    if isinstance(state.drafter_state, llama.KVCache) and model is not None:
        out = dataclasses.replace(out, drafter_state=cache_shardings(model.config, mesh, state.drafter_state))
    return out


def decode_jit(which: str, prog, args, mesh: Mesh):
    """``jit`` of :func:`specjax.runtime.prefill.prefill` / :func:`specjax.runtime.loop.run_rounds` with
    output shardings on ``mesh`` (inputs are already placed; GSPMD partitions the rest)."""
    from specjax.runtime import loop as decode
    from specjax.runtime.prefill import prefill

    if which == "start":
        shape = jax.eval_shape(lambda *a: prefill(prog, *a), *args)
        return jax.jit(prefill, static_argnums=0, out_shardings=state_shardings(prog, shape, mesh))
    return jax.jit(decode.run_rounds, static_argnums=0, donate_argnums=decode.RUN_ROUNDS_DONATE,
                   out_shardings=state_shardings(prog, args[2], mesh))


def host_view(state):
    """``state`` with the fields the host reads (tokens, lengths, done, stats, …) as arrays
    every process can read; caches dropped. A no-op view on one host."""
    if all(x.is_fully_addressable for x in jax.tree_util.tree_leaves((state.tokens, state.lengths))):
        return state
    from jax.experimental import multihost_utils

    small = dataclasses.replace(state, target_cache=None, drafter_state=None, target_hidden=None)
    return multihost_utils.process_allgather(small, tiled=True)


def put_replicated(x, mesh: Mesh):
    return put(x, NamedSharding(mesh, P(*([None] * np.ndim(x)))))


# ----------------------------------------------------------------------------- multi-host
def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kw) -> None:
    """``jax.distributed.initialize`` (arguments auto-detected on TPU pods, SLURM, …); on CPU
    it first selects the gloo collectives so that a mesh may span processes."""
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # pragma: no cover - option missing in other jax versions
        pass
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kw)
