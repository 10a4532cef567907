"""The CPU attention kernel (specjax/models/cpu_attention.py, attention.cc): it computes the
attention of :func:`specjax.models.attention.cache_attention` (causal, GQA, tree, sliding window,
soft-capping; within float32 rounding of the blocked jnp path), and its result for one query depends
on that query and its visible keys only — bitwise the same alone or in a batch, in a one-token step
or a (γ+1)-token call, in a longer buffer, as a tree node or as the causal query over the node's
path, on one thread or two, and on the AVX-512 path or the generic one (the batch-invariance
property of docs/design.md, by construction). ``cache_attention`` uses it on CPU, and
``SPECJAX_ATTENTION=xla`` restores the blocked jnp path.

On x86-64 Linux with a C++ compiler the kernel must build and load (a failure fails these tests);
they are skipped only where there is no compiler or the machine is not x86-64."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import attention, cpu_attention, kernels

@pytest.fixture(scope="module")
def kernel():
    if not kernels.buildable(cpu_attention.SOURCE):  # not x86-64 Linux, or no C++ compiler
        pytest.skip(f"the kernel cannot be built on this host ({platform.system()} {platform.machine()}, "
                    f"compiler {kernels.compiler()}): cache_attention uses the blocked jnp path")
    assert cpu_attention.load() is not None, f"the kernel did not build: {cpu_attention.unavailable_reason()}"
    assert cpu_attention.enabled() == (jax.default_backend() == "cpu" and jax.device_count() == 1)
    return cpu_attention


@dataclasses.dataclass(frozen=True)
class Cfg:  # the three fields cache_attention reads
    num_kv_heads: int = 3
    attn_logit_softcapping: float | None = None
    head_dim: int = 64

    def attention_scale(self):
        return self.head_dim ** -0.5


def _inputs(b=2, t=3, h=9, kv=3, hd=64, s=256, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, s, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, s, hd)), jnp.float32)
    return q, k, v


def _blocked(q, k, v, pos, cfg, monkeypatch, **kw):
    monkeypatch.setenv(cpu_attention.ENV, "xla")
    try:
        return np.asarray(attention.cache_attention(q, k, v, pos, cfg, **kw))
    finally:
        monkeypatch.delenv(cpu_attention.ENV)


TREE = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)  # root; two children; a grandchild


@pytest.mark.parametrize("hd,h,kv", [(64, 9, 3), (128, 8, 2), (80, 4, 4), (24, 6, 1)])
@pytest.mark.parametrize("mode", ["causal", "window", "softcap", "tree"])
def test_kernel_is_the_attention_of_cache_attention(kernel, monkeypatch, hd, h, kv, mode):
    """Against the blocked jnp path (float32): 1e-5 relative. hd 64, 128 and 80 (a partial group of
    16-lane accumulators) take the AVX-512 path where the CPU has it; 24 (not a multiple of 16) the
    generic path with its partial lanes."""
    cfg = Cfg(num_kv_heads=kv, head_dim=hd, attn_logit_softcapping=4.0 if mode == "softcap" else None)
    q, k, v = _inputs(t=4, h=h, kv=kv, hd=hd)
    kw = {}
    if mode == "tree":
        pos = jnp.asarray([[100, 101, 101, 102], [7, 8, 8, 9]], jnp.int32)
        kw["tree_mask"] = jnp.asarray(np.stack([TREE, TREE]))
    else:
        pos = jnp.asarray([[100, 101, 102, 103], [37, 38, 39, 40]], jnp.int32)
    if mode == "window":
        kw["window"] = 20
    got = np.asarray(attention.cache_attention(q, k, v, pos, cfg, **kw))
    ref = _blocked(q, k, v, pos, cfg, monkeypatch, **kw)
    assert got.shape == ref.shape == (2, 4, h * hd)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)


def test_a_query_alone_equals_the_query_in_any_call(kernel):
    """Bitwise: each (row, position) computed alone in a one-token call over a buffer of another size
    equals the same query in the batched 3-token call."""
    q, k, v = _inputs(b=3, t=3, s=320)
    pos = jnp.asarray([[200, 201, 202], [5, 6, 7], [63, 64, 65]], jnp.int32)
    full = np.asarray(kernel.attend(q, k, v, pos, 0.125))
    for b in range(3):
        for t in range(3):
            p = int(pos[b, t])
            s = 256 if p < 256 else 320
            one = kernel.attend(q[b:b + 1, t:t + 1], k[b:b + 1, :, :s], v[b:b + 1, :, :s], pos[b:b + 1, t:t + 1], 0.125)
            assert np.array_equal(np.asarray(one)[0, 0], full[b, t]), (b, t)


def test_a_tree_node_is_the_causal_query_over_its_path(kernel):
    """Bitwise: node 3 (root → child 2 → grandchild 3, at scratch slots r, r+2, r+3) equals the causal
    query at position r + 2 over a cache holding that path contiguously."""
    q, k, v = _inputs(b=1, t=4)
    r = 50
    pos = jnp.asarray([[r, r + 1, r + 1, r + 2]], jnp.int32)
    tree = np.asarray(kernel.attend(q, k, v, pos, 0.125, tree_mask=jnp.asarray(TREE[None])))
    path = [r, r + 2, r + 3]
    kc = k.at[:, :, r:r + 3].set(k[:, :, path])
    vc = v.at[:, :, r:r + 3].set(v[:, :, path])
    causal = np.asarray(kernel.attend(q[:, 3:4], kc, vc, jnp.asarray([[r + 2]], jnp.int32), 0.125))
    assert np.array_equal(causal[0, 0], tree[0, 3])
    # and the windowed node equals the windowed causal query
    tw = np.asarray(kernel.attend(q, k, v, pos, 0.125, tree_mask=jnp.asarray(TREE[None]), window=16))
    cw = np.asarray(kernel.attend(q[:, 3:4], kc, vc, jnp.asarray([[r + 2]], jnp.int32), 0.125, window=16))
    assert np.array_equal(cw[0, 0], tw[0, 3])


def test_a_row_with_no_visible_key_is_zero_and_the_rest_unchanged(kernel):
    q, k, v = _inputs(b=2, t=1)
    pos = jnp.asarray([[-1], [40]], jnp.int32)  # a padded row (position -1: nothing visible)
    out = np.asarray(kernel.attend(q, k, v, pos, 0.125))
    assert np.all(out[0] == 0) and np.all(np.isfinite(out))
    alone = np.asarray(kernel.attend(q[1:], k[1:], v[1:], pos[1:], 0.125))
    assert np.array_equal(alone[0], out[1])


def test_inside_jit_while_loop_and_vmap(kernel):
    q, k, v = _inputs(b=1, t=1)

    def body(i, acc):
        return acc + kernel.attend(q, k, v, jnp.full((1, 1), 10, jnp.int32) + i, 0.125)

    looped = jax.jit(lambda: jax.lax.fori_loop(0, 3, body, jnp.zeros((1, 1, 9 * 64), jnp.float32)))()
    direct = sum(np.asarray(kernel.attend(q, k, v, jnp.full((1, 1), 10 + i, jnp.int32), 0.125)) for i in range(3))
    np.testing.assert_allclose(np.asarray(looped), direct, rtol=1e-6)
    vm = jax.vmap(lambda qq: kernel.attend(qq, k, v, jnp.full((1, 1), 10, jnp.int32), 0.125))(jnp.stack([q, 2 * q]))
    assert np.array_equal(np.asarray(vm[0]), np.asarray(kernel.attend(q, k, v, jnp.full((1, 1), 10, jnp.int32), 0.125)))


_CHILD = r"""
import json, sys
import jax.numpy as jnp, numpy as np
from specjax.models import cpu_attention
rng = np.random.default_rng(1)
q = jnp.asarray(rng.standard_normal((2, 64, 9, 64)), jnp.float32)
k = jnp.asarray(rng.standard_normal((2, 3, 2048, 64)), jnp.float32)
v = jnp.asarray(rng.standard_normal((2, 3, 2048, 64)), jnp.float32)
pos = jnp.asarray(np.stack([np.arange(1900, 1964), np.arange(100, 164)]), jnp.int32)
o1 = np.asarray(cpu_attention.attend(q, k, v, pos, 0.125))
o2 = np.asarray(cpu_attention.attend(q, k, v, pos, 0.125, softcap=3.0, window=700))
np.save(sys.argv[1], np.stack([o1, o2]))
print(json.dumps({"kernel": cpu_attention.enabled()}))
"""


def _child(tmp_path, name, **env):
    out = tmp_path / f"{name}.npy"
    e = {**os.environ, **env}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(out)], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"kernel": True}
    return np.load(out)


def test_the_same_bits_on_every_path_and_thread_count(kernel, tmp_path):
    """A prefill-sized call (2 rows × 64 positions over 2,048 slots): the default (AVX-512 where the
    CPU has it, two threads: the call is above the split threshold), the generic path
    (``SPECJAX_ATTN_GENERIC=1``) and one thread (``SPECJAX_ATTN_MIN_PAR_WORK`` huge) give the same
    bits. On a CPU without AVX-512 the first two runs are both the generic path."""
    default = _child(tmp_path, "default")
    generic = _child(tmp_path, "generic", SPECJAX_ATTN_GENERIC="1")
    one = _child(tmp_path, "one", SPECJAX_ATTN_MIN_PAR_WORK="2000000000")  # an int (atoi): 1e12 wrapped negative
    forced = _child(tmp_path, "forced", SPECJAX_ATTN_MIN_PAR_WORK="1")
    assert np.array_equal(default, generic)
    assert np.array_equal(default, one)
    assert np.array_equal(default, forced)


def test_xla_env_keeps_the_blocked_path(kernel, monkeypatch):
    q, k, v = _inputs(b=1, t=1)
    pos = jnp.asarray([[77]], jnp.int32)
    monkeypatch.setenv(cpu_attention.ENV, "xla")
    assert not cpu_attention.enabled()
    monkeypatch.delenv(cpu_attention.ENV)
    assert cpu_attention.enabled() == (jax.default_backend() == "cpu" and jax.device_count() == 1)
    a = np.asarray(attention.cache_attention(q, k, v, pos, Cfg()))
    assert np.array_equal(a, np.asarray(kernel.attend(q, k, v, pos, Cfg().attention_scale())))


def test_a_view_is_not_cut_for_the_kernel(kernel, monkeypatch):
    """``cache_attention(kv_view=...)`` (the decode loop's attention views): the kernel gets the whole
    cache (it reads each query's visible keys only; a cut operand would be a copy per layer and step:
    measured 22 vs 42 tokens/s at a 4,224-slot buffer) and gives the same bits as without the view; the
    blocked path reads only the view, with the whole cache's result."""
    q, k, v = _inputs(b=2, t=3, s=512)
    pos = jnp.asarray([[100, 101, 102], [37, 38, 39]], jnp.int32)
    cfg = Cfg()
    fn = jax.jit(lambda q, k, v, p: attention.cache_attention(q, k, v, p, cfg, kv_view=128))
    hlo = fn.lower(q, k, v, pos).as_text()
    assert "specjax_cache_attention" in hlo
    assert "tensor<2x3x128x64xf32>" not in hlo and "slice" not in hlo, "the view was cut for the kernel"
    assert np.array_equal(np.asarray(fn(q, k, v, pos)), np.asarray(attention.cache_attention(q, k, v, pos, cfg)))
    viewed = _blocked(q, k, v, pos, cfg, monkeypatch, kv_view=128)
    whole = _blocked(q, k, v, pos, cfg, monkeypatch)
    np.testing.assert_array_equal(viewed, whole)
