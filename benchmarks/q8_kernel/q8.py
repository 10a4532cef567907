"""Python side of the Q8_0 x Q8_0 FFI matmul prototype.

Build:  see build.sh (g++ -O3 -shared -fPIC -std=c++17 -ffp-contract=off ...)
"""
import ctypes
import os

import numpy as np
import jax
import jax.numpy as jnp

_HERE = os.path.dirname(os.path.abspath(__file__))
_lib = None


def load(path=os.path.join(_HERE, "libq8matmul.so")):
    global _lib
    if _lib is None:
        _lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target("q8_matmul_st", jax.ffi.pycapsule(_lib.Q8MatmulST), platform="cpu")
        jax.ffi.register_ffi_target("q8_matmul_mt", jax.ffi.pycapsule(_lib.Q8MatmulMT), platform="cpu")
    return _lib


def isa():
    return {0: "scalar", 1: "avx2", 2: "avx512vnni"}[load().q8_isa()]


# ------------------------------------------------------------------ format
def quantize_weights(w):
    """w float32 [K, N] -> codes int8 [K, N], scale float32 [K/32, N]."""
    K, N = w.shape
    wb = w.astype(np.float32).reshape(K // 32, 32, N)
    amax = np.abs(wb).max(axis=1)                        # [K/32, N]
    scale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)
    codes = np.clip(np.rint(wb / safe[:, None, :]), -127, 127).astype(np.int8)
    return codes.reshape(K, N), scale


def pack_weights(codes, scale):
    """Standard codes int8 [K, N] + scale [K/32, N] -> kernel layout.

    wp uint8 [N/32, K/4, 32, 4] = codes + 128 (tile of 32 columns contiguous),
    sp float32 [N/32, K/32, 32].
    """
    K, N = codes.shape
    assert K % 32 == 0 and N % 32 == 0
    u = (codes.astype(np.int16) + 128).astype(np.uint8)          # [K, N]
    wp = u.reshape(K // 4, 4, N // 32, 32).transpose(2, 0, 3, 1)  # [N/32, K/4, 32, 4]
    sp = scale.reshape(K // 32, N // 32, 32).transpose(1, 0, 2)   # [N/32, K/32, 32]
    return np.ascontiguousarray(wp), np.ascontiguousarray(sp.astype(np.float32))


def pack_transposed(codes_t, scale_t):
    """Tied embedding: codes_t int8 [N, K] (rows = outputs), scale_t [N, K/32]."""
    return pack_weights(np.ascontiguousarray(codes_t.T), np.ascontiguousarray(scale_t.T))


def embed_lookup_packed(wp, sp, ids):
    """Rows of the tied embedding dequantized straight from the packed layout
    (so the head needs no separate copy). ids int [B] -> float32 [B, K]."""
    T, K4, _, _ = wp.shape
    t, c = ids // 32, ids % 32
    codes = wp[t, :, c, :].reshape(ids.shape[0], K4 * 4).astype(jnp.int32) - 128
    s = sp[t, :, c]                                               # [B, K/32]
    return codes.astype(jnp.float32) * jnp.repeat(s, 32, axis=1)


# ------------------------------------------------------------------ reference
def quantize_acts_ref(x):
    """x float32 [M, K] -> xq int32 [M, K/32, 32], xs float32 [M, K/32]."""
    M, K = x.shape
    xb = x.astype(np.float32).reshape(M, K // 32, 32)
    amax = np.abs(xb).max(axis=2)
    xs = (amax / np.float32(127)).astype(np.float32)
    xs = np.where(amax == 0, np.float32(1), xs).astype(np.float32)
    xq = np.clip(np.rint(xb / xs[:, :, None]), -127, 127).astype(np.int32)
    return xq, xs


def matmul_ref(x, codes, scale):
    """Numpy reference of the formula (float32, sequential over blocks, no FMA)."""
    M, K = x.shape
    N = codes.shape[1]
    xq, xs = quantize_acts_ref(x)
    wq = codes.astype(np.int32).reshape(K // 32, 32, N)
    y = np.zeros((M, N), np.float32)
    for b in range(K // 32):
        isum = (xq[:, b, :] @ wq[b]).astype(np.float32)            # exact
        d = (xs[:, b, None] * scale[None, b, :]).astype(np.float32)
        y = (y + (d * isum).astype(np.float32)).astype(np.float32)
    return y


# ------------------------------------------------------------------ jax op
def q8_matmul(x, wp, sp, threads=True):
    """x f32 [..., K], packed wp/sp -> f32 [..., N]."""
    load()
    N = wp.shape[0] * 32
    name = "q8_matmul_mt" if threads else "q8_matmul_st"
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (N,), jnp.float32)
    return jax.ffi.ffi_call(name, out)(x, wp, sp)
