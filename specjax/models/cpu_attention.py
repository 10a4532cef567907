"""Attention over the KV cache on CPU as one fused kernel (``attention.cc``, an XLA FFI custom call).

:func:`specjax.models.attention.cache_attention` calls :func:`attend` instead of its blocked jnp
computation when :func:`enabled`: the default backend is CPU with one device, the kernel is built
(:mod:`specjax.models.kernels`), the cache is float32 and ``SPECJAX_ATTENTION`` is not ``xla``.

Why: on XLA CPU the blocked computation runs as many small batched dots, a pairwise-sum tree and, in
the reduced formats, a float32→bfloat16 copy of the cache per layer and step; measured on the
default model it is ≈ 70 % of an 8-row decode step at a 1,088-slot view and makes a one-row step at
context 4,000 cost 2.96× the step at 100 where the bytes grow 1.33× (BENCHMARKS.md, issue 29).
The kernel reads each visible key and value once per group of queries and nothing past a query's
own length.

The arithmetic (``attention.cc``'s header) is a function of one query and its own visible keys in
their logical order, so it is batch-invariant and gives a (γ+1)-token verify call, a decode step,
a tree node (its path's keys in the causal order) and a prefill chunk the same bits by
construction — the property docs/design.md ("Batch invariance") asks of every attention path. It
computes in float32 in every weight format (the blocked path rounds q and K/V to bfloat16 in the
reduced formats): a process uses one of the two paths for every call, and the two differ by float
rounding (≈ 1e-6 relative), not by rule.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import env
from specjax.models import kernels, q8  # q8: the kernels' thread count

SOURCE = os.path.join(kernels.HERE, "attention.cc")
LIB_NAME = "libspecjax_attention.so"
TARGET = "specjax_cache_attention"
MAX_HEAD_DIM = 256  # the kernel's largest head_dim
ENV = "SPECJAX_ATTENTION"  # "xla": the blocked jnp computation on CPU too (benchmarks, A/B runs); "auto"

KERNEL = kernels.Kernel(SOURCE, LIB_NAME, {TARGET: "Attention"}, what="the CPU attention kernel",
                        fallback="the blocked jnp attention", thread="specjax-attention-build")


def load():
    """The kernel's ctypes library (built and registered on first call; thread-safe:
    :class:`specjax.models.kernels.Kernel`), or None."""
    return KERNEL.load()


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used (None when it can)."""
    return KERNEL.unavailable_reason()


def start_build() -> bool:
    """Build (when not yet in the cache) and load the kernel on a background thread, so a cold start
    overlaps the compiler's ≈ 5 s with loading the weights; :func:`load` (and so :func:`enabled`)
    waits for it. Returns whether a thread was started (or one is running)."""
    return KERNEL.start_build(lambda: env.get(ENV) != "xla" and jax.default_backend() == "cpu")


def join_build() -> None:
    """Wait for a :func:`start_build` thread (before the interpreter shuts down)."""
    KERNEL.join_build()


def _wanted() -> bool:
    """``SPECJAX_ATTENTION`` is not ``xla`` (unset, or ``auto``; another value is
    :class:`~specjax.core.env.EnvError`) and the default backend is CPU with one device (a mesh
    keeps the blocked computation, which XLA can partition)."""
    return env.get(ENV) != "xla" and jax.default_backend() == "cpu" and jax.device_count() == 1


def planned() -> bool:
    """:func:`enabled` without building: whether this process will use the kernel if it builds
    (what measurements of speed are keyed by, :func:`specjax.eval.hostcache.host_fingerprint`)."""
    if not _wanted():
        return False
    return load() is not None if KERNEL.tried() else KERNEL.buildable()


def enabled() -> bool:
    """Whether :func:`~specjax.models.attention.cache_attention` runs the kernel in programs traced now:
    :func:`_wanted`, and the kernel builds and loads here."""
    return _wanted() and load() is not None


def attend(q, k_cache, v_cache, positions, scale: float, softcap: float | None = None, tree_mask=None,
           window: int | None = None):
    """The kernel's attention: float32 ``[B, T, H·hd]`` for ``q [B, T, H, hd]`` over ``k_cache``/
    ``v_cache [B, KV, S, hd]`` (float32; this call's K/V written) at ``positions [B, T]`` int32,
    the semantics of :func:`~specjax.models.attention.cache_attention` (causal, or ``tree_mask``
    ``[B, T, T]`` bool ancestors-or-self with the new tokens at slots ``positions[:, 0] + i``;
    a sliding ``window``; scores times ``scale``, then soft-capped at ``softcap``).

    Raises:
      RuntimeError: the kernel cannot be built or loaded here (:func:`enabled` says whether it can)."""
    if load() is None:
        raise RuntimeError(f"the CPU attention kernel is not available: {unavailable_reason()}")
    b, t, h, hd = q.shape
    pos = positions.astype(jnp.int32)
    if tree_mask is None:
        prefix = pos + 1
        n_extra = jnp.zeros((b, t), jnp.int32)
        extra = jnp.zeros((b, t, 1), jnp.int32)
    else:  # node j: the committed prefix, then its ancestors root first (depth k at slot start + anc[j, k])
        start = pos[:, 0]
        depth = pos - start[:, None]  # [B, T]
        at_depth = depth[:, None, :, None] == jnp.arange(t, dtype=jnp.int32)[None, None, None, :]
        anc = jnp.argmax(tree_mask[:, :, :, None] & at_depth, axis=2).astype(jnp.int32)  # [B, T, T]
        extra = start[:, None, None] + anc
        prefix = jnp.broadcast_to(start[:, None], (b, t))
        n_extra = depth + 1
    lo = jnp.zeros((b, t), jnp.int32) if window is None else jnp.maximum(pos - window + 1, 0)
    out = jax.ShapeDtypeStruct((b, t, h, hd), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    o = call(q.astype(jnp.float32), k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), lo, prefix,
             extra.astype(jnp.int32), n_extra.astype(jnp.int32), scale=np.float32(scale),
             softcap=np.float32(softcap or 0.0), threads=np.int64(q8.default_threads()))
    return o.reshape(b, t, h * hd)
