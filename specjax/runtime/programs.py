"""Exported programs: a warm start that does not trace the decode loop again.

A :class:`~specjax.runtime.decoder.Decoder` compiles two programs per shape bucket (the prefill
and the decode loop). With JAX's persistent compilation cache the XLA compile is read from disk,
but JAX still traces the Python code and lowers it to StableHLO before it can look the
executable up: ≈ 5 of the ≈ 8 seconds "compiling" took in a warm ``specjax generate`` of the
default pair (BENCHMARKS.md, issue 26 "The first minute"). This module keeps each program as a
serialized :mod:`jax.export` module next to the compilation cache; a later process with the
same key deserializes it instead of tracing (milliseconds), and the compile of the deserialized
module hits the compilation cache as before.

The executable is the same: the exported module is the same StableHLO, called with the same
donated buffers, and XLA's optimized HLO equals the traced program's instruction for
instruction (compared for the default pair's prefill and decode loop, int8; only the entry
parameters' names differ), so tokens are unchanged bit for bit.

Key (SHA-256; any change is a new entry): this module's format, the jax and jaxlib versions,
the backend and its devices, every source file of the installed specjax package (content
hash), whether the CPU attention kernel is traced and the int8 CPU kernel loaded, the program kind, the full ``repr`` of the
:class:`~specjax.runtime.loop.Program` (configs, graphdef, drafter settings, γ, buffer, tree,
…) and the arguments' tree structure, shapes, dtypes and shardings. A description that names
an object by address (``0x…``) is not cached. Only programs compiled without a mesh and with
default compiler options are cached.

**Prefetch** (:func:`prefetch`, :func:`remember`): a command tags the programs it used (the tag is
a digest of its settings, prompts left out) in ``recent.json``; the next command with the same tag
starts compiling those entries on background threads before it loads the weights, so reading the
executables back (≈ 1.7 s for the default pair, XLA CPU's deserialization) overlaps the load. Every
entry is compiled from the abstract arguments it stores (shapes, dtypes, weak types; default
device), whether prefetched or not, so a prefetched program is the one the command would have
compiled; :func:`compile_program` takes it only under the exact key, and a guess that does not
match (another prompt bucket) costs idle CPU, not time on the path. ``SPECJAX_NO_PREFETCH=1``
switches the prefetch off (``benchmarks/first_text.py`` compares both).

Used only where it is switched on: the ``specjax`` command line turns it on with the
compilation cache (``SPECJAX_NO_CACHE=1`` turns both off; ``SPECJAX_NO_PROGRAM_CACHE=1`` only
this); from Python, :func:`enable`. Entries live in ``<compilation cache>/specjax-programs/``
(two files each, written atomically; at most :data:`MAX_ENTRIES`, oldest removed first); an
unreadable or stale entry is rebuilt. The output tree is stored with :mod:`pickle` and read with
an unpickler that only accepts jax's PyTreeDef and specjax's own classes (the directory is as
trusted as the compilation cache, whose entries are native code).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import json
import os
import pickle
import re
import threading
from typing import Callable

import jax
from jax.tree_util import tree_flatten, tree_leaves, tree_unflatten

from specjax.core import env

FORMAT = 3  # 3: the kernels an entry calls are named (the attention kernel)
MAX_ENTRIES = 64
MAX_TAGS = 32  # tags kept in recent.json (newest first)
MAX_PREFETCH = 4  # programs remembered per tag
SUBDIR = "specjax-programs"
RECENT = "recent.json"

_dir: str | None = None
_prefetched: dict[str, concurrent.futures.Future] = {}  # key -> (compiled, out_tree, specs, donated) or None
_threads: list[threading.Thread] = []
_used: list[str] = []  # keys this process compiled or took, in order


def enable(directory: str | None = None) -> str | None:
    """Keep exported programs in ``directory`` (default: ``specjax-programs/`` inside JAX's
    compilation cache directory, when one is set). Returns the directory used, or None."""
    global _dir
    if directory is None:
        base = jax.config.jax_compilation_cache_dir
        directory = os.path.join(base, SUBDIR) if base else None
    _dir = directory
    return _dir


def disable() -> None:
    """Stop using exported programs (compiles trace as before); waits for prefetches in flight
    (an XLA compile must not be running on a thread when the interpreter shuts down)."""
    global _dir
    _dir = None
    finish()


def finish() -> None:
    """Wait for the prefetch threads and drop what they compiled and what was recorded."""
    for t in _threads:
        t.join()
    _threads.clear()
    _prefetched.clear()
    _used.clear()


def directory() -> str | None:
    """Where exported programs are kept now, or None (off, or ``SPECJAX_NO_PROGRAM_CACHE=1``)."""
    if env.get("SPECJAX_NO_PROGRAM_CACHE") or env.get("SPECJAX_NO_CACHE"):
        return None
    return _dir


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 of every ``.py``, ``.cc`` and ``.h`` file of the specjax package (paths and contents)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__", "shipped_")))
        for name in sorted(filenames):
            if name.endswith((".py", ".cc", ".h")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _kernel_state(leaves) -> str:
    """Whether programs trace the CPU attention kernel, and int8 programs the x86 matmul kernel
    (only asked when a weight is int8 codes)."""
    from specjax.models import cpu_attention

    attn = f"attention={cpu_attention.enabled()}"
    if not any(getattr(x, "dtype", None) == jax.numpy.uint8 for x in leaves):
        return attn
    from specjax.models import q8

    return f"kernel={q8.available()},{attn}"


# the CPU kernels a program may call: (custom call target prefix, module that registers it)
_KERNELS = (("specjax_q8block", "q8"), ("specjax_cache_attention", "cpu_attention"))


def _kernels_loaded(names) -> bool:
    """Load (build and register) the kernels ``names`` (modules of :data:`_KERNELS`) before a stored
    program that calls them is compiled; False when one cannot be loaded here."""
    import importlib

    return all(importlib.import_module(f"specjax.models.{n}").load() is not None for n in names)


def program_key(which: str, prog, leaves, in_tree) -> str | None:
    """The cache key of a program (module docstring), or None when it cannot be made stably."""
    from importlib import metadata

    try:
        jaxlib_version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        jaxlib_version = "?"
    devices = jax.devices()
    parts = [
        f"specjax-program-{FORMAT}", jax.__version__, jaxlib_version,
        jax.default_backend(), f"{len(devices)}x{devices[0].device_kind}", source_digest(), _kernel_state(leaves),
        f"x64={jax.config.jax_enable_x64}", f"precision={jax.config.jax_default_matmul_precision}",
        which, repr(prog), str(in_tree),
        repr([(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), repr(getattr(x, "sharding", None)))
              for x in leaves]),
    ]
    text = "\n".join(parts)
    if re.search(r"0x[0-9a-fA-F]{6,}", text):  # an object named by its address: not stable across runs
        return None
    return hashlib.sha256(text.encode()).hexdigest()


class ExportedProgram:
    """A compiled program called like :class:`jax.stages.Compiled` (pytrees in and out), built
    from a :mod:`jax.export` module. ``out_info``: the outputs as ``ShapeDtypeStruct`` s with
    shardings; other attributes (``memory_analysis``, ``as_text``, …) are the executable's."""

    def __init__(self, compiled, in_tree, out_tree, loaded: bool, prefetched: bool = False):
        self._compiled = compiled
        self._in_tree = in_tree
        self._out_tree = out_tree
        self.loaded = loaded  # read from disk (True) or exported in this process (False)
        self.prefetched = prefetched  # compiled by a prefetch thread (:func:`prefetch`)

    def __call__(self, *args):
        leaves, tree = tree_flatten(args)
        if tree != self._in_tree:
            raise TypeError(f"arguments of another structure than the program's: {tree} vs {self._in_tree}")
        return tree_unflatten(self._out_tree, self._compiled(*leaves))

    @property
    def out_info(self):
        return tree_unflatten(self._out_tree, tree_leaves(self._compiled.out_info))

    def __getattr__(self, name):
        return getattr(self._compiled, name)


class _Unpickler(pickle.Unpickler):
    """Only what a pickled pytree structure of specjax's programs names: jax's PyTreeDef and
    its registry, and specjax's own classes (no functions, no dotted names)."""

    _JAX = {("jaxlib._jax.pytree", "PyTreeDef"), ("jax._src.tree_util", "default_registry")}

    def find_class(self, module, name):
        if (module, name) in self._JAX:
            return super().find_class(module, name)
        if module.split(".")[0] == "specjax" and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a program entry")


def _specs(leaves) -> list[tuple] | None:
    """The abstract arguments an entry is compiled for, ``(shape, dtype name, weak_type)`` per
    leaf; None when a leaf lives elsewhere than the default device (not cached)."""
    from jax.sharding import SingleDeviceSharding

    default = jax.devices()[0]
    out = []
    for x in leaves:
        sh = getattr(x, "sharding", None)
        if sh is not None and not (isinstance(sh, SingleDeviceSharding) and sh.device_set == {default}):
            return None
        a = jax.typeof(x)
        out.append((tuple(a.shape), str(a.dtype), bool(a.weak_type)))
    return out


def _compile_entry(exp, specs, donated):
    """The executable of an exported module for its stored abstract arguments (the same call
    whether prefetched or not)."""
    avals = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dt), weak_type=w) for shape, dt, w in specs]
    return jax.jit(exp.call, donate_argnums=tuple(donated)).trace(*avals).lower().compile()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _evict(d: str) -> None:
    entries = [os.path.join(d, n) for n in os.listdir(d) if n.endswith(".jaxexport")]
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda p: os.stat(p).st_mtime)
    for p in entries[: len(entries) - MAX_ENTRIES]:
        for q in (p, p[: -len(".jaxexport")] + ".tree"):
            try:
                os.remove(q)
            except OSError:
                pass


def _read(base: str):
    """``(exported, out_tree, kernels, specs, donated)`` of an entry (``kernels``: the modules of
    :data:`_KERNELS` it calls), or None (missing or unreadable)."""
    from jax import export

    try:
        with open(base + ".tree", "rb") as f:
            out_tree, kernels, specs, donated = _Unpickler(io.BytesIO(f.read())).load()
        with open(base + ".jaxexport", "rb") as f:
            exp = export.deserialize(bytearray(f.read()))
        os.utime(base + ".jaxexport")  # recently used: evicted last
        return exp, out_tree, tuple(str(k) for k in kernels), [tuple(x) for x in specs], tuple(donated)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001  (a damaged or foreign entry: rebuilt)
        for q in (base + ".tree", base + ".jaxexport"):
            try:
                os.remove(q)
            except OSError:
                pass
        return None


def _disabled_checks():
    from jax import export

    from specjax.models import cpu_attention, q8

    return [export.DisabledSafetyCheck.custom_call(name) for name in (*q8.TARGETS.values(), cpu_attention.TARGET)]


def compile_program(fn: Callable, which: str, prog, args: tuple, donate: tuple[int, ...] = ()):
    """``fn(prog, *args)`` (a jitted function with ``prog`` static) compiled through an exported
    module kept on disk (:func:`directory`), as an :class:`ExportedProgram`; None when exported
    programs are off, the key is not stable, an argument is not on the default device or the
    export fails (the caller compiles as before). ``donate``: positions in ``args`` whose buffers
    the program may reuse (as ``fn``'s own ``donate_argnums``, counted without ``prog``). A
    program :func:`prefetch` compiled under the same key is taken as it is."""
    d = directory()
    if d is None:
        return None
    leaves, in_tree = tree_flatten(args)
    specs = _specs(leaves)
    key = None if specs is None else program_key(which, prog, leaves, in_tree)
    if key is None:
        return None
    starts = [0]
    for a in args:
        starts.append(starts[-1] + len(tree_leaves(a)))
    donated = tuple(i for p in donate for i in range(starts[p], starts[p + 1]))
    _used.append(key)
    fut = _prefetched.pop(key, None)
    got = None if fut is None else fut.result()
    if got is not None and got[2] == specs and got[3] == donated:
        return ExportedProgram(got[0], in_tree, got[1], True, prefetched=True)
    from jax import export

    base = os.path.join(d, key)
    entry = _read(base)
    loaded = entry is not None and entry[3] == specs and entry[4] == donated
    if not loaded:
        out = {}

        def flat(*xs):
            res = fn(prog, *tree_unflatten(in_tree, xs))
            ys, out["tree"] = tree_flatten(res)
            return ys

        try:
            exp = export.export(jax.jit(flat), disabled_checks=_disabled_checks())(*leaves)
        except Exception:  # noqa: BLE001  (e.g. an effect or custom call export refuses: compile as before)
            return None
        targets = _custom_call_targets(exp)
        kernels = tuple(mod for prefix, mod in _KERNELS if any(t.startswith(prefix) for t in targets))
        entry = (exp, out["tree"], kernels, specs, donated)
        try:
            os.makedirs(d, exist_ok=True)
            _write_atomic(base + ".tree", pickle.dumps((out["tree"], kernels, specs, donated)))
            _write_atomic(base + ".jaxexport", bytes(exp.serialize()))
            _evict(d)
        except Exception:  # noqa: BLE001  (a read-only cache, no flatbuffers: this process still uses it)
            pass
    exp, out_tree, kernels = entry[:3]
    if not _kernels_loaded(kernels):
        return None
    return ExportedProgram(_compile_entry(exp, specs, donated), in_tree, out_tree, loaded)


# ------------------------------------------------------------------ prefetch
def _recent(d: str) -> dict:
    try:
        with open(os.path.join(d, RECENT)) as f:
            got = json.load(f)
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def remember(tag: str) -> None:
    """Record the programs this process used (at most :data:`MAX_PREFETCH`, in order) under
    ``tag`` for :func:`prefetch`; nothing when off or when none was used."""
    d = directory()
    keys = list(dict.fromkeys(_used))[:MAX_PREFETCH]
    if d is None or not keys:
        return
    recent = _recent(d)
    recent.pop(tag, None)
    recent = {tag: keys, **dict(list(recent.items())[: MAX_TAGS - 1])}
    try:
        os.makedirs(d, exist_ok=True)
        _write_atomic(os.path.join(d, RECENT), json.dumps(recent).encode())
    except OSError:
        pass


def prefetch(tag: str) -> int:
    """Start compiling, one background thread each, the programs that the last process with this
    ``tag`` used (:func:`remember`); :func:`compile_program` takes them by key. Returns how many
    were started (0 when off or nothing is recorded)."""
    d = directory()
    if d is None or env.get("SPECJAX_NO_PREFETCH"):
        return 0
    keys = [k for k in _recent(d).get(tag, []) if isinstance(k, str) and re.fullmatch(r"[0-9a-f]{64}", k)]
    started = 0
    for key in keys:
        if key in _prefetched:
            continue
        fut = concurrent.futures.Future()
        _prefetched[key] = fut
        t = threading.Thread(target=_prefetch_one, args=(os.path.join(d, key), fut), daemon=True,
                             name=f"specjax-prefetch-{key[:8]}")
        _threads.append(t)
        t.start()
        started += 1
    return started


def prefetches_pending() -> int:
    """How many programs :func:`prefetch` started that :func:`compile_program` has not taken yet
    (compiled or still compiling; :func:`finish` drops them)."""
    return len(_prefetched)


def _prefetch_one(base: str, fut: concurrent.futures.Future) -> None:
    try:
        entry = _read(base)
        if entry is not None and not _kernels_loaded(entry[2]):
            entry = None
        if entry is None:
            fut.set_result(None)
            return
        exp, out_tree, _, specs, donated = entry
        fut.set_result((_compile_entry(exp, specs, donated), out_tree, specs, donated))
    except Exception:  # noqa: BLE001  (a prefetch is a guess: the command compiles as before)
        fut.set_result(None)


def _custom_call_targets(exp) -> list[str]:
    return re.findall(r"custom_call @(\w+)", exp.mlir_module())
