"""PLACEHOLDER (replaced by the kernel branch): the int8 block matmul in jnp."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _acts(x):
    M, K = x.shape
    nb = -(-K // 32)
    if nb * 32 != K:
        x = jnp.pad(x, ((0, 0), (0, nb * 32 - K)))
    xb = x.reshape(M, nb, 32)
    a1 = jnp.max(jnp.abs(xb), axis=-1)
    s1 = jnp.where(a1 > 0, a1 / 127.0, 1.0)
    q1 = jnp.clip(jnp.round(xb / s1[..., None]), -127, 127)
    r = xb - s1[..., None] * q1
    a2 = jnp.max(jnp.abs(r), axis=-1)
    s2 = jnp.where(a2 > 0, a2 / 127.0, 1.0)
    q2 = jnp.clip(jnp.round(r / s2[..., None]), -127, 127)
    t = xb
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return q1.astype(jnp.int8), s1, q2.astype(jnp.int8), s2, t[..., 0], nb


def block_matmul_ref(x, codes, scale, transposed=False):
    x = x.astype(jnp.float32)
    q1, s1, q2, s2, X, nb = _acts(x)
    K = x.shape[1]
    if transposed:
        codes = codes.T
        scale = jnp.swapaxes(scale, 1, 2)
    if nb * 32 != K:
        codes = jnp.pad(codes, ((0, nb * 32 - K), (0, 0)))
    cb = codes.reshape(nb, 32, -1)
    dn = (((2,), (1,)), ((1,), (0,)))
    i1 = jax.lax.dot_general(q1, cb, dn, preferred_element_type=jnp.int32)  # [nb, M, N]
    i2 = jax.lax.dot_general(q2, cb, dn, preferred_element_type=jnp.int32)
    d, m = scale[0], scale[1]  # [nb, N]
    c = d[:, None, :] * (s1.T[:, :, None] * i1.astype(jnp.float32) + s2.T[:, :, None] * i2.astype(jnp.float32)) \
        + m[:, None, :] * X.T[:, :, None]
    y = c[0]
    for b in range(1, nb):
        y = y + c[b]
    return y


block_matmul = block_matmul_ref
