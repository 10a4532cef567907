"""The block int8 weight format's matmul: a CPU kernel (XLA FFI custom call) and its references.

A weight ``w`` is ``codes`` uint8 of the weight's shape and ``scale`` float32 with ``d, m`` per block of
32 consecutive elements along the input (contracted) axis: ``w[k, n] = d[b, n] * codes[k, n] + m[b, n]``,
``b = k // 32``. Two layouts reach the matmul:

* KN: ``codes [K, ...]`` (the outputs' dims flattened to N), ``scale [2, ceil(K/32), ...]``;
* NK (``transposed=True``, the tied embedding as the LM head): ``codes [N, K]``, ``scale [2, N, ceil(K/32)]``.

The arithmetic (the kernel, :func:`block_matmul_np` and :func:`block_matmul_ref` implement exactly
this): x float32 ``[M, K]``, per row and block of 32 (a partial last block padded with x = 0, code = 0)

1. ``s1 = max|x| / 127`` (1 if 0); ``q1 = clamp(round_half_even(x / s1), ±127)``;
2. ``r = x - s1 * q1``; ``s2 = max|r| / 127`` (1 if 0); ``q2 = clamp(round_half_even(r / s2), ±127)``;
3. ``X`` = the halving-tree sum of x (x[j] + x[j+16], then +8, +4, +2, +1);
4. ``I1 = Σ q1 · codes``, ``I2 = Σ q2 · codes`` (int32, exact);
5. ``c = (d * ((s1 * I1) + (s2 * I2))) + (m * X)``, each op rounded to float32, no FMA;
6. ``y`` = the sum of c over blocks in increasing b (y = c at b = 0).

Two-level activations (x ≈ s1·q1 + s2·q2) times exact 8-bit codes with a per-block scale and offset:
GGUF Q4_0 / Q4_1 / Q8_0 weights are exact, the only error is the activations'. Each row's result is
bitwise independent of M, of the other rows and of the kernel's threads (they split N only).

The kernel (``q8block.cc``, shipped with the package) is compiled on first use with the system C++
compiler into the cache directory (:func:`build`, :mod:`specjax.models.kernels`). Where it cannot be built or run (no compiler, not x86-64, a backend other than CPU,
K not a multiple of 32), :func:`block_matmul` is :func:`block_matmul_ref` (jnp), bitwise the same
as the kernel on CPU.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core import env, notes
from specjax.models import kernels

BLOCK = 32
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "q8block.cc")
LIB_NAME = "libq8block.so"
TARGETS = {False: "specjax_q8block_kn", True: "specjax_q8block_nk"}
ISAS = ("scalar", "avx2", "avx512vnni")


def default_threads() -> int:
    """Threads over N per kernel call: ``SPECJAX_Q8_THREADS`` (an integer >= 1; another value is
    :class:`~specjax.core.env.EnvError`), else the cores this process may run on (at most 8). The
    helpers are a persistent pool in the kernel (q8block.cc), so a call pays microseconds to split,
    not a thread start; calls of fewer than ``SPECJAX_Q8_MIN_PAR_ROWS`` (64) rows — decode's — run
    on one thread. The attention kernel (:mod:`specjax.models.cpu_attention`) uses the same count."""
    given = env.get("SPECJAX_Q8_THREADS")
    if given is not None:
        return given
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


# ------------------------------------------------------------------ build / load
KERNEL = kernels.Kernel(SOURCE, LIB_NAME, {TARGETS[False]: "Q8BlockKN", TARGETS[True]: "Q8BlockNK"},
                        what="the block int8 CPU kernel", fallback="the jnp reference", thread="specjax-q8-build")


def build() -> str:
    """The path of the compiled kernel (:func:`specjax.models.kernels.build`: reused from the cache
    directory, else compiled there). Raises RuntimeError with the reason when it cannot be built."""
    return kernels.build(SOURCE, LIB_NAME)


def load():
    """The kernel's ctypes library (built and registered on first call; thread-safe:
    :class:`specjax.models.kernels.Kernel`), or None."""
    return KERNEL.load()


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used (None when it can)."""
    return KERNEL.unavailable_reason()


@functools.lru_cache(maxsize=None)
def _backend_note(backend: str) -> None:
    notes.note(f"the block int8 CPU kernel is not used on the {backend} backend; using the jnp reference")


def start_build() -> bool:
    """Build (when not yet in the cache) and load the kernel on a background thread, so a cold
    start overlaps the compiler's ≈ 4–7 s with other work; :func:`load` waits for it. Only on a
    host where :func:`buildable`; returns whether a thread was started (or one is running)."""
    return KERNEL.start_build(lambda: jax.default_backend() == "cpu")


def join_build() -> None:
    """Wait for a :func:`start_build` thread (before the interpreter shuts down)."""
    KERNEL.join_build()


def buildable() -> bool:
    """Whether :func:`build` would compile here (x86-64 Linux, a C++ compiler, the source), without
    building."""
    return KERNEL.buildable()


def expected() -> bool:
    """:func:`available`, except while a :func:`start_build` thread is still building: then whether
    this host can build it (the build's outcome is not awaited; a failed build leaves int8 on the
    jnp reference with one note, as :func:`available` says)."""
    if KERNEL.builder.is_alive():
        return jax.default_backend() == "cpu" and buildable()
    return available()


def available() -> bool:
    """Whether :func:`block_matmul` runs the kernel (built and loaded, default backend CPU). When
    not, one ``specjax: note:`` line on stderr says why (once per process)."""
    backend = jax.default_backend()
    if backend != "cpu":
        _backend_note(backend)
        return False
    return load() is not None


def isa() -> str | None:
    """The kernel's instruction set path: "avx512vnni", "avx2" or "scalar" (None: no kernel)."""
    lib = load()
    return None if lib is None else ISAS[lib.q8block_isa()]


def set_isa(name: str) -> str:
    """Use the path ``name`` (or the best below it that this CPU has) from now on; returns the one
    set. For tests and benchmarks: every path gives the same bits."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"no kernel: {unavailable_reason()}")
    return ISAS[lib.q8block_set_isa(ISAS.index(name))]


# ------------------------------------------------------------------ the matmul
def _as_2d(codes, scale, transposed: bool):
    if transposed:
        return codes, scale
    K = codes.shape[0]
    return codes.reshape(K, -1), scale.reshape(2, scale.shape[1], -1)


def block_matmul(x2d, codes, scale, transposed: bool = False, threads: int | None = None):
    """float32 ``x2d [M, K]`` times the block int8 weight → float32 ``[M, N]``.

    ``codes`` uint8 ``[K, ...]`` with ``scale [2, ceil(K/32), ...]`` (KN), or with
    ``transposed=True`` ``codes [N, K]``, ``scale [2, N, ceil(K/32)]`` (NK). The kernel when it is
    available and K is a multiple of 32, else :func:`block_matmul_ref` (the same bits on CPU).
    ``threads``: threads over N for the kernel (default :func:`default_threads`)."""
    codes2, scale2 = _as_2d(codes, scale, transposed)
    K = x2d.shape[-1]
    N = codes2.shape[0] if transposed else codes2.shape[1]
    if K % BLOCK or not available():
        return block_matmul_ref(x2d, codes2, scale2, transposed)
    out = jax.ShapeDtypeStruct((x2d.shape[0], N), jnp.float32)
    call = jax.ffi.ffi_call(TARGETS[bool(transposed)], out)
    return call(x2d.astype(jnp.float32), codes2.astype(jnp.uint8), scale2.astype(jnp.float32),
                threads=np.int64(default_threads() if threads is None else threads))


# ------------------------------------------------------------------ references
def _div(xp, a, b):
    """``a / b`` (float32, true division). XLA's simplifier turns a division by a broadcast (or a
    constant) into a multiplication by its rounded reciprocal, which rounds differently: jnp gets
    the divisor materialized at ``a``'s shape behind an optimization barrier."""
    if xp is np:
        return (a / b).astype(np.float32)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape))
    return a / b


def _mul(xp, a, b):
    """``a * b`` rounded to float32 on its own. XLA:CPU lets LLVM contract a multiplication and an
    addition that uses it into an FMA (one rounding): in jnp the product's bits pass through an
    integer OR with a flag that is 0 unless the product is NaN (a NaN stays NaN), which LLVM
    cannot see through."""
    if xp is np:
        return (a * b).astype(np.float32)
    p = a * b
    i = jax.lax.bitcast_convert_type(p, jnp.int32) | (p != p).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(i, jnp.float32)


def _quantize_acts(xp, xb):
    """xb float32 [M, B, 32] → (q1, q2 int32 [M, B, 32], s1, s2, X float32 [M, B]) (``xp``: np or jnp)."""
    f32 = xp.float32
    a1 = xp.max(xp.abs(xb), axis=-1)
    s1 = xp.where(a1 == 0, f32(1), _div(xp, a1, f32(127))).astype(f32)
    q1f = xp.round(xp.clip(_div(xp, xb, s1[..., None]), f32(-127), f32(127)))
    r = (xb - _mul(xp, s1[..., None], q1f)).astype(f32)
    a2 = xp.max(xp.abs(r), axis=-1)
    s2 = xp.where(a2 == 0, f32(1), _div(xp, a2, f32(127))).astype(f32)
    q2f = xp.round(xp.clip(_div(xp, r, s2[..., None]), f32(-127), f32(127)))
    t = xb
    for h in (16, 8, 4, 2, 1):
        t = (t[..., :h] + t[..., h:2 * h]).astype(f32)
    return q1f.astype(xp.int32), q2f.astype(xp.int32), s1, s2, t[..., 0]


def _blocks_np(x2d, codes, scale, transposed):
    """Pad K to whole blocks; x → [M, B, 32], codes → [B, 32, N] int32, d, m → [B, N]."""
    x = np.asarray(x2d, np.float32)
    codes = np.asarray(codes)
    scale = np.asarray(scale, np.float32)
    M, K = x.shape
    B = -(-K // BLOCK)
    pad = B * BLOCK - K
    x = np.pad(x, ((0, 0), (0, pad)))
    if transposed:
        codes = codes.T
        scale = np.swapaxes(scale, 1, 2)
    codes = np.pad(codes.reshape(K, -1), ((0, pad), (0, 0)))
    N = codes.shape[1]
    return (x.reshape(M, B, BLOCK), codes.astype(np.int32).reshape(B, BLOCK, N),
            scale[0].reshape(B, N), scale[1].reshape(B, N))


def block_matmul_np(x2d, codes, scale, transposed: bool = False) -> np.ndarray:
    """The numpy reference of the arithmetic (the tests' oracle): float32 ``[M, N]``."""
    xb, cb, d, mn = _blocks_np(x2d, codes, scale, transposed)
    q1, q2, s1, s2, X = _quantize_acts(np, xb)
    f32 = np.float32
    y = None
    for b in range(cb.shape[0]):
        I1 = (q1[:, b, :] @ cb[b]).astype(f32)  # exact in int32 (|Σ| < 2^20)
        I2 = (q2[:, b, :] @ cb[b]).astype(f32)
        t1 = (s1[:, b, None] * I1).astype(f32)
        t2 = (s2[:, b, None] * I2).astype(f32)
        v = (d[None, b] * (t1 + t2).astype(f32)).astype(f32)
        w = (mn[None, b] * X[:, b, None]).astype(f32)
        c = (v + w).astype(f32)
        y = c if y is None else (y + c).astype(f32)
    if y is None:
        return np.zeros((xb.shape[0], cb.shape[-1] if cb.ndim == 3 else 0), np.float32)
    return y


def block_matmul_ref(x2d, codes, scale, transposed: bool = False):
    """The arithmetic in jnp (any backend, any K): batched int32 ``dot_general`` over blocks for
    I1 / I2, then a sequential sum over blocks (``lax.scan``). Takes KN codes ``[K, N]`` /
    scale ``[2, B, N]`` (or higher-rank outputs, flattened) or NK ``[N, K]`` / ``[2, N, B]``."""
    f32 = jnp.float32
    x = jnp.asarray(x2d, f32)
    M, K = x.shape
    B = -(-K // BLOCK)
    pad = B * BLOCK - K
    codes = jnp.asarray(codes)
    scale = jnp.asarray(scale, f32)
    xb = jnp.pad(x, ((0, 0), (0, pad))).reshape(M, B, BLOCK)
    q1, q2, s1, s2, X = _quantize_acts(jnp, xb)
    if transposed:
        N = codes.shape[0]
        cb = jnp.pad(codes, ((0, 0), (0, pad))).reshape(N, B, BLOCK).astype(jnp.int32)
        d, mn = scale[0].T, scale[1].T  # [B, N]
        dims = (((2,), (2,)), ((1,), (1,)))  # q [M,B,32] · c [N,B,32] → [B, M, N]
    else:
        codes = codes.reshape(K, -1)
        N = codes.shape[1]
        cb = jnp.pad(codes, ((0, pad), (0, 0))).reshape(B, BLOCK, N).astype(jnp.int32)
        d, mn = scale[0].reshape(B, N), scale[1].reshape(B, N)
        dims = (((2,), (1,)), ((1,), (0,)))  # q [M,B,32] · c [B,32,N] → [B, M, N]
    I1 = jax.lax.dot_general(q1, cb, dims, preferred_element_type=jnp.int32).astype(f32)
    I2 = jax.lax.dot_general(q2, cb, dims, preferred_element_type=jnp.int32).astype(f32)
    t1 = _mul(jnp, s1.T[:, :, None], I1)  # [B, M, N]
    t2 = _mul(jnp, s2.T[:, :, None], I2)
    v = _mul(jnp, d[:, None, :], t1 + t2)
    w = _mul(jnp, mn[:, None, :], X.T[:, :, None])
    c = v + w

    def step(y, cb_):
        return y + cb_, None

    # -0.0 + c == c bitwise: the same as starting from c at b = 0
    y, _ = jax.lax.scan(step, jnp.full((M, N), -0.0, f32), c)
    return y


# ------------------------------------------------------------------ quantizing float weights
def quantize_blocks(w, axis: int = 0):
    """Float weights → the block int8 format along ``axis`` (the input axis): per block of 32
    (the last may be partial) ``lo = min``, ``hi = max``, ``d = (hi - lo) / 255``,
    ``codes = clamp(round_half_even((w - lo) / d), 0, 255)`` (``d == 0``: codes 0), ``m = lo``.
    Returns ``(codes uint8 of w.shape, scale float32 of shape (2,) + w.shape with axis → ceil(K/32))``.
    numpy in, numpy out; a jax array in, jax arrays out (jittable with a static ``axis``)."""
    xp = jnp if isinstance(w, jax.Array) else np  # tracers are jax.Arrays
    f32 = np.float32
    w = xp.asarray(w).astype(f32)
    axis = axis % w.ndim
    wm = xp.moveaxis(w, axis, 0)
    K = wm.shape[0]
    B = -(-K // BLOCK)
    pad = B * BLOCK - K
    rest = wm.shape[1:]
    if pad:  # edge padding: the block's min and max are unchanged
        wm = xp.concatenate([wm, xp.broadcast_to(wm[-1:], (pad,) + rest)], axis=0)
    wb = wm.reshape((B, BLOCK) + rest)
    lo = xp.min(wb, axis=1)
    hi = xp.max(wb, axis=1)
    d = _div(xp, hi - lo, f32(255)).astype(f32)
    safe = xp.where(d == 0, f32(1), d)
    q = xp.round(xp.clip(_div(xp, wb - lo[:, None], safe[:, None]), f32(0), f32(255)))
    q = xp.where((d == 0)[:, None], f32(0), q)
    codes = q.astype(xp.uint8).reshape((B * BLOCK,) + rest)[:K]
    codes = xp.moveaxis(codes, 0, axis)
    scale = xp.stack([xp.moveaxis(d, 0, axis), xp.moveaxis(lo.astype(f32), 0, axis)])
    return codes, scale
