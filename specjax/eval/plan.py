"""Deployment plans (``specjax plan``): per-device memory of the very programs ``generate`` runs, for
a model shape on a mesh, compiled ahead of time on abstract inputs — no weight is loaded or allocated.

The target is a :class:`~specjax.io.loading.Model` whose parameters are ``jax.ShapeDtypeStruct`` s
(the abstract tree of the weight table, :func:`specjax.models.llama.abstract_model`) carrying their
real shardings (:func:`specjax.runtime.sharding.param_shardings`). A :class:`~specjax.runtime.decoder.Decoder`
around it builds the start arguments of a batch (:meth:`~specjax.runtime.decoder.Decoder.prepare`:
the prompt rows are tiny host arrays) and compiles the prefill and the decode loop exactly as
:meth:`~specjax.runtime.decoder.Decoder.start` does (``_get``: ``prefill_jit`` / ``run_rounds_jit``, on a
mesh :func:`specjax.runtime.sharding.decode_jit`); only the compiled programs' memory analysis is read.

Figures are bytes per device (int): ``weights`` (each parameter's shard), ``kv_cache`` (the target
cache's shard in the decode state), ``state`` (the whole decode state), ``temporaries`` (XLA's
``memory_analysis().temp_size_in_bytes`` of each program; from the CPU compiler, so only an estimate
of a TPU's or GPU's), and ``peak`` = weights + the larger of the prefill (its non-weight inputs, its
output state, its temporaries) and the decode loop (state, donated in place, + temporaries). The KV
cache dtype is the accelerator's (:func:`specjax.models.attention.kv_cache_dtype` for ``backend``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from specjax.models import llama
from specjax.models.attention import kv_cache_dtype
from specjax.models.config import ModelConfig
from specjax.runtime import sharding

GiB = 2 ** 30
# the plan never runs what it compiles: lower LLVM optimization (the same buffers, about half the compile time)
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
CPU_NOTE = ("temporaries come from the XLA CPU compiler: an estimate of a TPU's or GPU's (their compilers "
            "fuse and schedule differently)")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan.

    Attributes:
      name: the model's name as given (a shape name or a config path).
      cfg: its :class:`ModelConfig`.
      dtype: the weight format (``float32``, ``bfloat16``, ``int8``).
      data, model: the mesh (rows on ``data``, heads/MLP/vocabulary on ``model``); sizes ≥ 1.
      batch: rows decoded together (≥ 1).
      max_len: tokens per row, prompt + new (≥ 2, at most the model's context).
      prompt_len: prompt tokens per row (``None``: half of ``max_len``); the rest are new tokens.
      device_memory: bytes of memory per device (> 0).
      draft: ``None`` (autoregressive) or ``"ngram"`` / ``"ngram:N"``; ``gamma``: draft tokens per round.
      backend: the platform planned for (``"gpu"``/``"tpu"``: bfloat16 KV caches for bfloat16 weights).
    """

    name: str
    cfg: ModelConfig
    dtype: str = "bfloat16"
    data: int = 1
    model: int = 1
    batch: int = 1
    max_len: int = 4096
    prompt_len: int | None = None
    device_memory: int = 16 * GiB
    draft: str | None = None
    gamma: int = 4
    backend: str = "gpu"

    def __post_init__(self):
        llama.weight_format(self.dtype)  # validates
        for k in ("data", "model", "batch", "device_memory"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        ctx = self.cfg.max_position_embeddings
        if not 2 <= self.max_len <= ctx:
            raise ValueError(f"max_len must be in [2, {ctx}] (the context of {self.name}), got {self.max_len}")
        if not 1 <= self.prompt_tokens < self.max_len:
            raise ValueError(f"prompt_len must be in [1, {self.max_len}) (it leaves room for a new token), "
                             f"got {self.prompt_len}")

    @property
    def prompt_tokens(self) -> int:
        return self.max_len // 2 if self.prompt_len is None else int(self.prompt_len)

    @property
    def devices(self) -> int:
        return self.data * self.model

    @property
    def mesh_text(self) -> str:
        return f"data={self.data},model={self.model}"

    @property
    def cache_dtype(self) -> str:
        return kv_cache_dtype(llama.weight_format(self.dtype), self.backend)

    @property
    def drafting(self) -> bool:
        return self.draft not in (None, "none")

    def spare(self) -> int:
        """Slots a round writes beyond the committed tokens (γ with a drafter, else 0; as the Decoder)."""
        return self.gamma if self.drafting else 0


def model_shape(model: str | None) -> tuple[str, ModelConfig]:
    """``(name, config)`` of a plan's ``--model``: ``None`` or ``"default"`` (the default model,
    SmolLM2-135M-Instruct), a published shape name (:data:`specjax.models.shapes.SHAPES`), a
    ``config.json`` file or a model directory holding one, or a ``.gguf`` file (its metadata, as
    :func:`specjax.io.loading.load_model` reads it). Nothing else is read (no weights, no hub).

    Raises:
      ValueError: an unknown name (names the built-in shapes); CheckpointError: a config.json or
        GGUF file that is not a supported architecture, or a truncated GGUF file; OSError /
        JSONDecodeError: an unreadable or invalid file.
    """
    import json
    import os

    from specjax.io.files import read_utf8
    from specjax.io.loading import DEFAULT_MODEL
    from specjax.models.shapes import DEFAULT_SHAPE, SHAPES, shape_config

    if model in (None, DEFAULT_MODEL):
        return f"{DEFAULT_MODEL} ({DEFAULT_SHAPE})", shape_config(DEFAULT_SHAPE)
    if model.lower() in SHAPES:
        return model.lower(), shape_config(model.lower())
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown --model {model!r}: give a built-in shape ({', '.join(SHAPES)}, or "
                         f"{DEFAULT_MODEL}), a config.json file, a model directory holding one or a .gguf file (a "
                         "plan reads no weights and downloads nothing)")
    if path.endswith(".gguf"):  # the shape from its metadata (the tensors are not read)
        from specjax.io import gguf

        return os.path.basename(path), gguf.config_from_gguf(gguf.open_gguf(path))
    try:
        d = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the syntax") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a config.json object; give a Hugging Face config.json")
    try:
        return model, ModelConfig.from_hf_config(d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a usable config.json ({type(e).__name__}: {e}); give a Hugging Face "
                         "config.json of a supported model") from None


# ----------------------------------------------------------------------------- analytic figures
@functools.lru_cache(maxsize=16)
def abstract_params(cfg: ModelConfig, fmt: str) -> dict:
    """``{path: ShapeDtypeStruct}`` of a model's parameters in format ``fmt``, from the weight table
    (:func:`specjax.models.llama.param_shapes`; nothing allocated, nothing traced)."""
    return llama.param_shapes(cfg, fmt)


def _shard_bytes(shape, dtype, spec, sizes: dict) -> int:
    """Bytes of one device's shard of an array of ``shape`` sharded by PartitionSpec ``spec``."""
    n = 1
    for k, dim in enumerate(shape):
        axis = spec[k] if k < len(spec) else None
        n *= -(-int(dim) // sizes[axis]) if axis is not None else int(dim)
    return n * np.dtype(dtype).itemsize


def weight_bytes(cfg: ModelConfig, fmt: str, data: int = 1, model: int = 1) -> int:
    """Weight bytes per device on a ``data × model`` mesh, from the weight table and the sharding
    rules alone (:func:`specjax.runtime.sharding.param_spec` on an abstract mesh): a sharded weight
    counts its shard, a replicated one (norms, a dimension that does not divide ``model``) in full."""
    mesh = jax.sharding.AbstractMesh((data, model), sharding.AXES)
    sizes = {sharding.DATA: data, sharding.MODEL: model}
    flat = abstract_params(cfg, fmt)
    return sum(_shard_bytes(v.shape, v.dtype, sharding.param_spec(p, v.shape, cfg, mesh), sizes)
               for p, v in flat.items())


def kv_bytes(cfg: ModelConfig, batch: int, slots: int, cache_dtype: str, data: int = 1, model: int = 1) -> int:
    """Target KV-cache bytes per device: keys and values of every layer, ``[B, KV, slots, hd]``, rows
    padded to a multiple of ``data`` and split on it, KV heads split on ``model`` when they divide it."""
    rows = -(-batch // data)
    kv = cfg.num_kv_heads // model if cfg.num_kv_heads % model == 0 else cfg.num_kv_heads
    return 2 * cfg.num_layers * rows * kv * slots * cfg.head_dim * np.dtype(cache_dtype).itemsize


def buffer_slots(req: PlanRequest) -> int:
    """Token/KV slots of the plan's decode buffer (:func:`specjax.runtime.decoder.decode_buffer_len`)."""
    from specjax.runtime.decoder import decode_buffer_len

    return decode_buffer_len(req.prompt_tokens, req.max_len - req.prompt_tokens, req.spare())


def step_weight_reads(cfg: ModelConfig, fmt: str, data: int, model: int, rows: int) -> int:
    """Weight bytes one target decode step reads per device, in the weight format: every parameter
    shard, except that an untied embedding table is read only by the rows it gathers (at most
    ``rows`` = the device's batch rows × tokens per call; with int8 each row's scale too). A tied
    embedding is also the LM head: read whole."""
    total = weight_bytes(cfg, fmt, data, model)
    if cfg.tie_word_embeddings:
        return total
    flat = abstract_params(cfg, fmt)
    mesh = jax.sharding.AbstractMesh((data, model), sharding.AXES)
    sizes = {sharding.DATA: data, sharding.MODEL: model}
    table = 0
    row = 0
    for name in ("embed", "embed_scale"):
        v = flat.get((name,))
        if v is None:
            continue
        table += _shard_bytes(v.shape, v.dtype, sharding.param_spec((name,), v.shape, cfg, mesh), sizes)
        row += int(np.prod(v.shape)) // cfg.vocab_size * np.dtype(v.dtype).itemsize  # one vocabulary row's share
    local_rows = -(-cfg.vocab_size // model) if cfg.vocab_size % model == 0 else cfg.vocab_size
    return total - table + min(rows, local_rows) * row


def analytic(req: PlanRequest, data: int | None = None, model: int | None = None, fmt: str | None = None,
             batch: int | None = None, slots: int | None = None) -> dict:
    """``{"weights", "kv_cache"}`` bytes per device of ``req`` (or of it with another mesh, format,
    batch or buffer), from the tables alone (no compile, no devices)."""
    data, model = data or req.data, model or req.model
    fmt = fmt or req.dtype
    cache = kv_cache_dtype(fmt, req.backend)
    return {"weights": weight_bytes(req.cfg, fmt, data, model),
            "kv_cache": kv_bytes(req.cfg, batch or req.batch, slots or buffer_slots(req), cache, data, model)}


# ----------------------------------------------------------------------------- compiling
def _leaf_bytes(tree) -> int:
    """Per-device bytes of the arrays / shapes in ``tree`` (each leaf's shard on its sharding)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = tuple(x.shape)
        s = getattr(x, "sharding", None)
        if s is not None and hasattr(s, "shard_shape"):
            shape = s.shard_shape(shape)
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def abstract_target(req: PlanRequest, mesh):
    """A :class:`~specjax.io.loading.Model` of ``req``'s shape whose parameters are
    ``ShapeDtypeStruct`` s with their shardings on ``mesh`` (``None``: one device, no sharding)."""
    from flax import nnx

    from specjax.io.loading import Model

    fmt = llama.weight_format(req.dtype)
    graphdef, abstract = llama.abstract_model(req.cfg, fmt)
    if mesh is not None:
        flat = {p: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
            mesh, sharding.param_spec(p, v.shape, req.cfg, mesh))) for p, v in abstract_params(req.cfg, fmt).items()}
        abstract = jax.tree_util.tree_map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(abstract, llama.unflatten_params(flat))
    return Model(req.cfg, graphdef, abstract, None, name=req.name, dtype=fmt)


def check_draft(spec: str | None) -> None:
    """A plan's ``--draft``: none or ``ngram[:N]`` (a drafter without weights).

    Raises:
      ValueError: any other drafter (one with weights), or a bad n-gram size."""
    from specjax.drafters import registry

    if spec in (None, "none"):
        return
    kind = registry.find_kind(spec) if isinstance(spec, str) else None
    if kind is None or kind.name != "ngram":
        raise ValueError(f"--draft {spec!r}: a plan covers --draft none or ngram[:N] (drafters without weights); "
                         "plan the target alone for a drafter with weights")
    kind.check(spec)


def _drafter(req: PlanRequest):
    from specjax.drafters import registry

    check_draft(req.draft)
    return None if req.draft in (None, "none") else registry.KINDS["ngram"].load(req.draft, None, req.dtype)


def compile_programs(req: PlanRequest, devices=None) -> dict:
    """Compile ``req``'s prefill and decode loop (the full-buffer view) ahead of time on ``devices``
    (the first ``req.devices`` of them form the mesh; ``None`` with one device: no mesh).

    Returns ``{"prefill", "decode"}``: each ``{"memory": memory_analysis(), "compile_s"}``, plus
    ``"state"`` (the decode state as shapes with shardings), ``"inputs"`` (non-weight bytes per
    device of the prefill's inputs) and ``"buffer_len"``."""
    from specjax.runtime.decoder import Decoder
    from specjax.runtime.prefill import prefill_program

    mesh = None
    if devices is not None:
        mesh = sharding.MeshSpec(req.data, req.model).make(list(devices)[: req.devices])
    cache = req.cache_dtype

    class PlanDecoder(Decoder):  # the programs an accelerator's Decoder builds (its KV-cache dtype)
        compiler_options = FAST_COMPILE

        @property
        def cache_dtype(self) -> str:
            return cache

    target = abstract_target(req, mesh)
    dec = PlanDecoder(target, _drafter(req), req.gamma, mesh=mesh)
    p = req.prompt_tokens
    # distinct prompts (identical ones would share one prefill row: a smaller program than distinct ones)
    prompts = [[2 + i % (req.cfg.vocab_size - 2)] + [2] * (p - 1) for i in range(req.batch)]
    prog, args = dec.prepare(prompts, max_new_tokens=req.max_len - p, eos_ids=[])
    sprog = prog if dec.mesh is not None else prefill_program(prog)
    start, c1 = dec.compiled_program("start", sprog, args)
    state = dec.run_shapes(start, sprog, prog)
    run, c2 = dec.compiled_program("run", prog, dec.run_args(state, 0))
    return {"prefill": {"memory": start.memory_analysis(), "compile_s": c1},
            "decode": {"memory": run.memory_analysis(), "compile_s": c2},
            "state": state, "inputs": _leaf_bytes(args[2:]), "buffer_len": prog.buffer_len}


def plan(req: PlanRequest, devices=None) -> dict:
    """Compile ``req``'s programs (:func:`compile_programs`) and return its figures (bytes per device
    as ints): ``weights``, ``kv_cache``, ``state``, ``temporaries`` (``prefill``, ``decode``), ``peak``
    and the program it is reached in, ``analytic`` (:func:`analytic`), ``decode_step_weight_bytes``
    (:func:`step_weight_reads`), ``fits`` (``peak`` ≤ ``device_memory``) and ``largest`` (the
    largest batch at ``max_len`` and the longest context at ``batch`` that fit:
    :func:`largest_fit`)."""
    t0 = time.perf_counter()
    c = compile_programs(req, devices)
    st = c["state"]
    weights = weight_bytes(req.cfg, req.dtype, req.data, req.model)
    kv = _leaf_bytes((st.target_cache.k, st.target_cache.v))
    state = _leaf_bytes(st)
    mp, md = c["prefill"]["memory"], c["decode"]["memory"]
    temps = {"prefill": int(mp.temp_size_in_bytes), "decode": int(md.temp_size_in_bytes)}
    peaks = {"prefill": weights + c["inputs"] + int(mp.output_size_in_bytes) + temps["prefill"],
             "decode": weights + state + temps["decode"]}
    which = max(peaks, key=peaks.get)
    tokens = req.gamma + 1 if req.drafting else 1
    fig = {
        "model": req.name, "dtype": llama.weight_format(req.dtype), "kv_cache_dtype": req.cache_dtype,
        "mesh": req.mesh_text, "devices": req.devices, "batch": req.batch, "max_len": req.max_len,
        "prompt_len": req.prompt_tokens, "buffer_len": int(c["buffer_len"]),
        "draft": req.draft if req.drafting else "none",
        "gamma": req.gamma if req.drafting else None, "device_memory": int(req.device_memory),
        "weights": int(weights), "kv_cache": int(kv), "state": int(state), "temporaries": temps,
        "peak": int(peaks[which]), "peak_program": which, "program_peaks": {k: int(v) for k, v in peaks.items()},
        "analytic": {k: int(v) for k, v in analytic(req, slots=int(c["buffer_len"])).items()},
        "decode_step_weight_bytes": int(step_weight_reads(req.cfg, req.dtype, req.data, req.model,
                                                          -(-req.batch // req.data) * tokens)),
        "compile_s": {k: round(c[k]["compile_s"], 2) for k in ("prefill", "decode")},
        "note": CPU_NOTE,
    }
    fig["fits"] = fig["peak"] <= req.device_memory
    fig["largest"] = largest_fit(req, fig)
    fig["seconds"] = round(time.perf_counter() - t0, 2)
    return fig


def largest_fit(req: PlanRequest, fig: dict) -> dict:
    """``{"batch", "max_len"}``: the largest batch at ``req.max_len`` and the longest row at
    ``req.batch`` whose peak fits ``req.device_memory`` (``0`` when none does), estimated from the
    compiled point: the weights are fixed and everything else (KV cache, state, temporaries) is
    taken as proportional to rows per device × buffer slots. The context is capped at the model's."""
    free = req.device_memory - fig["weights"]
    rows = -(-req.batch // req.data)
    per_slot_row = (fig["peak"] - fig["weights"]) / (rows * fig["buffer_len"])
    if free <= 0 or per_slot_row <= 0:
        return {"batch": 0, "max_len": 0}
    batch = int(free // (per_slot_row * fig["buffer_len"])) * req.data
    slots = int(free // (per_slot_row * rows))
    ctx = min(req.cfg.max_position_embeddings, slots - req.spare() - 1)
    return {"batch": batch, "max_len": max(0, (ctx // 64) * 64 if ctx >= 64 else ctx)}


# ----------------------------------------------------------------------------- refusing
def fmt_bytes(n: float) -> str:
    """``n`` bytes as GiB (or MiB below one GiB), e.g. ``"14.96 GiB"``."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


def model_axis_sizes(cfg: ModelConfig, above: int = 1, limit: int = 64) -> list[int]:
    """``model`` axis sizes to suggest, in the order to try them: first those in ``(above, limit]`` that
    divide the attention heads, KV heads and MLP width of ``cfg`` (nothing replicated but what is meant
    to be), smallest first; when ``above`` itself does not divide them, then the dividing sizes below it
    (fewer devices, each holding a shard instead of whole copies); last the powers of two above
    ``above`` that do not divide (their replicated dimensions are counted in full)."""
    def divides(m):
        return not (cfg.num_heads % m or cfg.num_kv_heads % m or cfg.intermediate_size % m)

    ok = [m for m in range(2, limit + 1) if m != above and divides(m)]
    out = [m for m in ok if m > above] + ([] if divides(above) else [m for m in reversed(ok) if m < above])
    return out + [2 ** k for k in range(1, limit.bit_length()) if above < 2 ** k <= limit and 2 ** k not in out]


def alternatives(req: PlanRequest, need_extra: float = 0.0) -> list[str]:
    """What would fit ``req.device_memory`` (analytic: weights + KV cache + ``need_extra`` bytes per
    device): a larger ``model`` axis that divides the heads, KV heads and MLP (:func:`model_axis_sizes`), int8 weights on this mesh, a shorter
    context, a smaller batch. Each as the flag to change and why."""
    mem, out = req.device_memory, []
    fits = lambda a: a["weights"] + a["kv_cache"] + need_extra <= mem  # noqa: E731
    for m in model_axis_sizes(req.cfg, above=req.model):
        a = analytic(req, model=m)
        if fits(a):
            out.append(f"--mesh data={req.data},model={m} ({fmt_bytes(a['weights'])} of weights per device)")
            break
    if llama.weight_format(req.dtype) != "int8":
        a = analytic(req, fmt="int8")
        if fits(a):
            out.append(f"--dtype int8 ({fmt_bytes(a['weights'])} of weights per device)")
    a = analytic(req)
    free = mem - a["weights"] - need_extra
    if free > 0:
        per_slot = a["kv_cache"] / buffer_slots(req)
        ctx = min(int(free // per_slot) - req.spare() - 1, req.max_len - 1) // 64 * 64
        if ctx >= 64:
            out.append(f"a shorter context, --max-len {ctx}")
        per_row = a["kv_cache"] / -(-req.batch // req.data)
        b = min(int(free // per_row), -(-req.batch // req.data) - 1) * req.data
        if b >= 1:
            out.append(f"a smaller batch, --batch {b}")
    return out


def refusal(req: PlanRequest, fig: dict | None = None) -> str | None:
    """The one-line refusal when ``req`` does not fit its device memory, else ``None``. Without
    ``fig`` (before compiling) it decides from the analytic weight and KV bytes
    (:func:`analytic`): when those alone exceed the memory nothing is compiled; with ``fig``
    (compiled) from its ``peak``. The line names the figures and :func:`alternatives`."""
    mem = req.device_memory
    where = f"{req.devices} × {fmt_bytes(mem)} ({req.mesh_text})"
    if fig is None:
        a = analytic(req)
        if a["weights"] + a["kv_cache"] <= mem:
            return None
        what = (f"its weights alone take {fmt_bytes(a['weights'])} per device" if a["weights"] > mem else
                f"weights {fmt_bytes(a['weights'])} + KV cache {fmt_bytes(a['kv_cache'])} per device exceed "
                f"{fmt_bytes(mem)}")
        how, extra = "decided from the weight table before compiling", 0.0
    else:
        if fig["fits"]:
            return None
        what = (f"its peak is {fmt_bytes(fig['peak'])} per device (weights {fmt_bytes(fig['weights'])}, KV cache "
                f"{fmt_bytes(fig['kv_cache'])}, {fig['peak_program']} temporaries "
                f"{fmt_bytes(fig['temporaries'][fig['peak_program']])})")
        how, extra = "compiled on CPU; temporaries estimated", fig["peak"] - fig["weights"] - fig["kv_cache"]
    alts = alternatives(req, extra)
    fix = "; what would fit: " + ", or ".join(alts) if alts else "; nothing nearby fits: use devices with more memory"
    return (f"{req.name} in {llama.weight_format(req.dtype)} at batch {req.batch} × {req.max_len} tokens does not "
            f"fit {where}: {what} ({how}){fix}")
