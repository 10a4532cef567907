"""Measurements cached on disk per host: the costs behind ``--gamma auto`` (c, v(γ), α) and
the choice behind ``--dtype auto`` are measured once and reused while nothing that changes
them has changed.

A cache entry is one JSON file ``<dir>/measured/<kind>-<hash>.json`` holding its full key
and the measured value. The key is everything the value depends on: the host
(:func:`host_fingerprint`: CPU model and vector flags, cores, devices, XLA flags; the
specjax, jax and jaxlib versions) and what the caller measured (:func:`model_fingerprint`,
:func:`drafter_fingerprint`, shapes, sampling settings, …). Files are written atomically
(a temporary file in the same directory, then ``os.replace``), so concurrent runs never read
half a file; a file that cannot be read or parsed is ignored with one ``specjax: note:``
line on stderr and measured again.

The directory is ``$SPECJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/specjax``, else
``~/.cache/specjax``; ``SPECJAX_NO_CACHE=1`` turns it off (:func:`default_cache` is ``None``),
as it turns off the compilation cache of the command line.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import tempfile
from typing import Any, Callable

import numpy as np

from specjax.core import env, notes
from specjax.core.paths import usable_cache_dir
from specjax.io.convcache import cache_dir  # noqa: F401  (one rule for every specjax cache)

FORMAT_VERSION = 1  # bump when a stored value's meaning changes: older files then never match
_CPU_FLAGS = ("avx", "amx", "fma", "f16c")  # flag prefixes that change kernel speed


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[str, tuple[str, ...]]:
    """``(CPU model, sorted vector-extension flags)`` from the first processor of
    ``/proc/cpuinfo`` (the model: its ``model name``, with family / model / stepping / cache size
    where given: a virtual machine's name can be as vague as "AMD EPYC"); ``platform.processor()``
    (or the machine type) and no flags where it is unreadable."""
    fields, flags = {}, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():  # the end of the first processor's block
                    break
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key in ("flags", "Features"):
                    flags = {x for x in val.split() if x.startswith(_CPU_FLAGS)}
                elif key in ("model name", "cpu family", "model", "stepping", "cache size", "CPU part"):
                    fields[key] = val
    except OSError:
        pass
    name = fields.pop("model name", "")
    detail = ", ".join(f"{k} {v}" for k, v in fields.items())
    if not name:
        name = platform.processor() or platform.machine()
    return name + (f" ({detail})" if detail else ""), tuple(sorted(flags))


def host_fingerprint() -> dict:
    """What makes a timing on this host different from one on another: CPU model and its
    vector flags (``avx*``, ``amx*``, ``fma``, ``f16c``), usable cores, the JAX backend with its
    device kind and count, ``XLA_FLAGS``, the specjax, jax and jaxlib versions, and the attention
    path (the CPU kernel or the blocked jnp computation: :func:`specjax.models.cpu_attention.planned`).

    Returns:
      a JSON-serialisable dict.
    """
    import importlib.metadata as md

    import jax

    from specjax.models import cpu_attention

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:  # e.g. a source tree that is not installed
            return "unknown"
    cpu, flags = _cpu()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 0
    devs = jax.devices()
    return {
        "cpu": cpu,
        "cpu_flags": list(flags),
        "machine": platform.machine(),
        "cores": cores,
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind if devs else "",
        "devices": len(devs),
        "xla_flags": env.get("XLA_FLAGS") or "",
        "specjax": version("specjax"),
        "jax": jax.__version__,
        "jaxlib": version("jaxlib"),
        "attention": "kernel" if cpu_attention.planned() else "blocked",  # speeds differ by path
    }


def params_checksum(params, samples: int = 2048) -> str:
    """A cheap fingerprint of a parameter pytree: SHA-256 over every leaf's path, shape,
    dtype and ≤ ``samples`` evenly strided elements (bytes). Two checkpoints that differ in
    training differ here; reading it touches a few pages of each array, not the weights."""
    import jax

    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        a = np.asarray(leaf)
        flat = a.reshape(-1)
        step = max(1, flat.size // max(1, int(samples)))
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}|".encode())
        h.update(np.ascontiguousarray(flat[::step]).tobytes())
    return h.hexdigest()


def _static_fields(obj) -> dict:
    """``repr`` of a dataclass's fields other than parameters and graph definitions."""
    if not dataclasses.is_dataclass(obj):
        return {}
    return {f.name: repr(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if f.name not in ("params", "graphdef")}


def model_fingerprint(model) -> dict:
    """A loaded :class:`~specjax.io.loading.Model`'s identity: name, weight format, a hash
    of its config and :func:`params_checksum` of its weights."""
    cfg = hashlib.sha256(repr(model.config).encode()).hexdigest()
    return {"name": getattr(model, "name", ""), "dtype": str(getattr(model, "dtype", "")), "config_sha256": cfg,
            "params": params_checksum(model.params)}


def drafter_fingerprint(drafter) -> dict | None:
    """A drafter's identity (``None`` for no drafter): its type, its static fields (config,
    name, n-gram sizes, cache dtype, confidence floor, …) and :func:`params_checksum` of its
    parameters (whose dtypes are its weight format)."""
    if drafter is None:
        return None
    params = drafter.params
    return {"type": f"{type(drafter).__module__}.{type(drafter).__qualname__}",
            "name": drafter.name, "fields": _static_fields(drafter),
            "params": params_checksum(params) if params is not None else None}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


class HostCache:
    """Measured values on disk, one JSON file per key (see the module docstring).

    Args:
      path: the cache directory (default :func:`cache_dir`); entries go to ``path/measured``.
      note: called with a one-line message when a file is unreadable or cannot be written
        (default: a ``specjax: note: …`` line on stderr).
    """

    def __init__(self, path: str | None = None, note: Callable[[str], None] | None = None):
        self.dir = os.path.join(path or cache_dir(), "measured")
        self.note = note or notes.note

    def key(self, kind: str, parts: dict) -> dict:
        """The full key of an entry: ``kind``, the format version, this host and ``parts``."""
        return {"kind": kind, "format": FORMAT_VERSION, "host": host_fingerprint(), **parts}

    def path(self, kind: str, parts: dict) -> str:
        """The file of the entry ``(kind, parts)``."""
        digest = hashlib.sha256(_canonical(self.key(kind, parts)).encode()).hexdigest()[:32]
        return os.path.join(self.dir, f"{kind}-{digest}.json")

    def get(self, kind: str, parts: dict) -> dict | None:
        """The stored entry ``{"value", "created", "seconds", "path"}``, or ``None`` when there is
        none, or when the file is unreadable, not JSON, or holds another key (then one note
        line says so, and the caller measures again)."""
        path = self.path(kind, parts)
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # ValueError: not UTF-8 / not JSON
            self.note(f"ignoring the unreadable measurement cache file {path} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())}); measuring again")
            return None
        key = json.loads(_canonical(self.key(kind, parts)))
        if not isinstance(rec, dict) or rec.get("key") != key or not isinstance(rec.get("value"), dict):
            self.note(f"ignoring the measurement cache file {path} (not a cache entry for this key); measuring again")
            return None
        return {"value": rec["value"], "created": rec.get("created"), "seconds": rec.get("seconds"), "path": path}

    def put(self, kind: str, parts: dict, value: dict, seconds: float | None = None) -> str | None:
        """Store ``value`` (JSON-serialisable) under ``(kind, parts)`` atomically (temporary file
        + ``os.replace``: readers see the old file or the new one, never part of one). Returns
        the path, or ``None`` when it could not be written (one note line; nothing raised)."""
        path = self.path(kind, parts)
        rec = {"key": self.key(kind, parts), "value": value, "seconds": seconds,
               "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        tmp = None
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{kind}-", suffix=".tmp", dir=self.dir)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(json.loads(_canonical(rec)), indent=1, sort_keys=True))
            os.replace(tmp, path)
            return path
        except (OSError, TypeError, ValueError) as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self.note(f"could not write the measurement cache file {path} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())}); the measurement is not cached")
            return None


def default_cache() -> HostCache | None:
    """The command line's cache: a :class:`HostCache` in :func:`cache_dir`, or ``None`` when
    ``SPECJAX_NO_CACHE`` is set or the cache directory is not usable (a file: one note,
    :func:`specjax.core.paths.usable_cache_dir`): every run measures, nothing is written."""
    if env.get("SPECJAX_NO_CACHE") or usable_cache_dir() is None:
        return None
    return HostCache()


def cached_or_measured(cache, kind: str, parts: dict, measure, progress, what: str) -> tuple[dict, dict]:
    """``(value, source)``: the cache entry ``(kind, parts)`` if there is one, else ``measure()``
    (timed as one progress phase ``what``) stored in the cache. ``source``: ``cached`` (bool),
    ``created`` (ISO time of the measurement), ``seconds`` (how long it took), ``path``."""
    import time

    from specjax.runtime.progress import phase

    hit = cache.get(kind, parts) if cache is not None else None
    if hit is not None:
        return hit["value"], {"cached": True, "created": hit["created"], "seconds": hit["seconds"], "path": hit["path"]}
    t0 = time.perf_counter()
    with phase(progress, what):
        value = measure()
    seconds = time.perf_counter() - t0
    path = cache.put(kind, parts, value, seconds) if cache is not None else None
    return value, {"cached": False, "created": None, "seconds": seconds, "path": path}
