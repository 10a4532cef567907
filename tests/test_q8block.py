"""The block int8 matmul (specjax/models/q8.py, q8block.cc): the CPU kernel on every instruction set
path this CPU has is bitwise the numpy reference (KN and NK, outliers, all-zero blocks, M = 1..9
and 33, N not a multiple of the kernel's tiles, 1 and 2 threads); each row's result does not depend
on the other rows; it works inside a jitted ``lax.while_loop``; the jnp reference is bitwise the
numpy reference (also for K not a multiple of 32, where block_matmul uses it); quantize_blocks.

On x86-64 Linux with a C++ compiler the kernel must build and load (a failure fails the kernel
tests); they are skipped only where there is no compiler or the machine is not x86-64."""

from __future__ import annotations

import os
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import q8
from specjax.models.weights import dequantize_int8

X86_LINUX = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
HAS_CXX = any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "g++", "c++"))


@pytest.fixture(scope="module")
def kernel():
    if not X86_LINUX:
        pytest.skip(f"the kernel is for x86-64 Linux (this is {platform.system()} {platform.machine()})")
    if not HAS_CXX:
        pytest.skip("no C++ compiler (g++ / c++): block_matmul uses the jnp reference")
    assert q8.load() is not None, f"the kernel did not build or load: {q8.unavailable_reason()}"
    assert jax.default_backend() != "cpu" or q8.available()
    return q8


def isas(kernel):
    """The paths this CPU can run, best first."""
    best = kernel.ISAS.index(kernel.isa())
    return [kernel.ISAS[i] for i in range(best, -1, -1)]


@pytest.fixture
def every_isa(kernel):
    """Iterate over the paths; the best one is restored afterwards."""
    best = kernel.isa()

    def gen():
        for name in isas(kernel):
            assert kernel.set_isa(name) == name
            yield name
    try:
        yield gen
    finally:
        kernel.set_isa(best)


def bits(a):
    return np.asarray(a, np.float32).view(np.int32)


def make(rng, M, K, N, transposed, zero_blocks=True):
    """Activations with per-row magnitudes, an outlier, an all-zero block and an all-zero row;
    random codes with an all-zero code block, d = 0 and m = 0 blocks."""
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 10, (M, 1))).astype(np.float32)
    B = -(-K // 32)
    codes = rng.integers(0, 256, (N, K) if transposed else (K, N), dtype=np.uint8)
    scale = (rng.standard_normal((2, N, B) if transposed else (2, B, N)) * 0.02).astype(np.float32)
    if zero_blocks:
        if M > 1:
            x[1, min(5, K - 1)] = 1e4 if K > 1 else x[1, 0]
        if M > 2:
            x[2] = 0.0
        x[0, :32] = 0.0
        if transposed:
            codes[:3, :32] = 0
            scale[0, 3, 0] = 0.0
            scale[1, 4, -1] = 0.0
        else:
            codes[:32, :3] = 0
            scale[0, 0, 3] = 0.0
            scale[1, -1, 4] = 0.0
    return x, codes, scale


def _kernel_call(x, codes, scale, transposed, threads=1):
    return np.asarray(q8.block_matmul(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale),
                                      transposed, threads=threads))


@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
@pytest.mark.parametrize("K", [32, 576, 1536])
def test_kernel_is_the_numpy_reference_bitwise(kernel, every_isa, transposed, K):
    rng = np.random.default_rng(K + transposed)
    for N in (32, 96, 960, 50):  # 50: a partial tile for every path
        x, codes, scale = make(rng, 33, K, N, transposed)
        ref = q8.block_matmul_np(x, codes, scale, transposed)
        for isa in every_isa():
            for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 33):
                if isa == "scalar" and K * N > 576 * 96 and M not in (1, 5, 33):
                    continue  # the scalar path is slow; a few row counts suffice
                y = _kernel_call(x[:M], codes, scale, transposed)
                assert np.array_equal(bits(y), bits(ref[:M])), (isa, K, N, M)
            if N == 960:  # 2 and 3 threads split N (the pool's helpers: M >= 64 rows): the same bits
                x64 = np.concatenate([x, x])  # 66 rows
                for threads in (2, 3):
                    y2 = _kernel_call(x64, codes, scale, transposed, threads=threads)
                    assert np.array_equal(bits(y2), bits(np.concatenate([ref, ref]))), (isa, K, N, threads)


@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
def test_rows_do_not_depend_on_the_other_rows(kernel, transposed):
    rng = np.random.default_rng(7)
    K, N = 576, 192
    x, codes, scale = make(rng, 9, K, N, transposed)
    singles = np.concatenate([_kernel_call(x[i:i + 1], codes, scale, transposed) for i in range(9)])
    for M in range(1, 10):
        junk = (rng.standard_normal((M, K)) * 100).astype(np.float32)
        idx = rng.permutation(9)[:M]
        xm = np.where(np.arange(M)[:, None] == 0, x[idx], junk)  # row 0 real, the others junk
        y = _kernel_call(xm, codes, scale, transposed)
        assert np.array_equal(bits(y[0]), bits(singles[idx[0]])), M
        y = _kernel_call(x[idx], codes, scale, transposed)
        assert np.array_equal(bits(y), bits(singles[idx])), M


def test_inside_a_jitted_while_loop(kernel):
    rng = np.random.default_rng(3)
    K = 64
    _, codes, scale = make(rng, 1, K, 96, False)
    _, codes_t, scale_t = make(rng, 1, K, 96, True)
    cj, sj, ctj, stj = map(jnp.asarray, (codes, scale, codes_t, scale_t))

    def body(c):
        i, h = c
        y = q8.block_matmul(h, cj, sj) + q8.block_matmul(h, ctj, stj, transposed=True)
        return i + 1, jnp.tanh(y[:, :K])

    loop = jax.jit(lambda h: jax.lax.while_loop(lambda c: c[0] < 4, body, (0, h))[1])
    h0 = rng.standard_normal((3, K)).astype(np.float32)
    out = np.asarray(loop(h0))
    h = h0
    step = jax.jit(body)
    for _ in range(4):
        h = np.asarray(step((0, h))[1])
    assert np.array_equal(bits(out), bits(h))
    # the same chain with the numpy reference (tanh is jnp's in both)
    h = h0
    for _ in range(4):
        y = q8.block_matmul_np(h, codes, scale) + q8.block_matmul_np(h, codes_t, scale_t, True)
        h = np.asarray(jnp.tanh(jnp.asarray(y[:, :K])))
    assert np.array_equal(bits(out), bits(h))


def test_higher_rank_codes_are_flattened(kernel):
    rng = np.random.default_rng(5)
    K = 64
    x, codes, scale = make(rng, 4, K, 2 * 3 * 16, False)
    c4 = codes.reshape(K, 2, 3, 16)
    s4 = scale.reshape(2, 2, 2, 3, 16)
    y = np.asarray(jax.jit(q8.block_matmul)(x, c4, s4))
    assert np.array_equal(bits(y), bits(q8.block_matmul_np(x, codes, scale)))


@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
def test_jnp_reference_is_the_numpy_reference_bitwise(transposed):
    rng = np.random.default_rng(11)
    ref_fn = jax.jit(q8.block_matmul_ref, static_argnums=3)
    for M, K, N in ((1, 576, 96), (3, 1536, 50), (9, 32, 32), (2, 8, 24), (3, 16, 40), (4, 112, 33), (2, 40, 64)):
        x, codes, scale = make(rng, M, K, N, transposed)
        y = np.asarray(ref_fn(x, codes, scale, transposed))
        assert np.array_equal(bits(y), bits(q8.block_matmul_np(x, codes, scale, transposed))), (M, K, N)


@pytest.mark.parametrize("transposed", [False, True], ids=["KN", "NK"])
def test_k_not_a_multiple_of_32_uses_the_reference(transposed):
    rng = np.random.default_rng(13)
    for K in (8, 16, 112):
        x, codes, scale = make(rng, 3, K, 48, transposed)
        y = np.asarray(jax.jit(q8.block_matmul, static_argnums=3)(x, codes, scale, transposed))
        assert np.array_equal(bits(y), bits(q8.block_matmul_np(x, codes, scale, transposed))), K
        # the padded reference is the full-block arithmetic on zero-padded x and codes
        B = -(-K // 32)
        xp = np.pad(x, ((0, 0), (0, 32 * B - K)))
        cp = np.pad(codes, ((0, 0), (0, 32 * B - K)) if transposed else ((0, 32 * B - K), (0, 0)))
        assert np.array_equal(bits(y), bits(q8.block_matmul_np(xp, cp, scale, transposed)))


def test_quantize_blocks_round_trip():
    rng = np.random.default_rng(17)
    for shape, axis in (((576, 96), 0), ((40, 112), 1), ((70, 2, 3), 0)):
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        w[:, 0] = 0.25 if axis == 1 else w[:, 0]  # a constant block (d = 0) along axis 1
        codes, scale = q8.quantize_blocks(w, axis)
        B = -(-shape[axis] // 32)
        assert codes.dtype == np.uint8 and codes.shape == w.shape
        assert scale.dtype == np.float32 and scale.shape == (2,) + shape[:axis] + (B,) + shape[axis + 1:]
        back = dequantize_int8(codes, scale, axis)
        d = np.repeat(scale[0], 32, axis=axis).take(np.arange(shape[axis]), axis=axis)
        assert np.all(np.abs(w - back) <= d / 2 * (1 + 1e-3) + 1e-7)
        cj, sj = jax.jit(q8.quantize_blocks, static_argnums=1)(jnp.asarray(w), axis)
        assert np.array_equal(np.asarray(cj), codes) and np.array_equal(bits(sj), bits(scale))


def test_quantize_blocks_is_exact_on_q4_1_weights():
    """w = d * q + m with q in 0..15 per block (GGUF Q4_1): the block's min and max are hit, so
    codes = q * 17 and d / 17 reproduce each element to a rounding of the float formula."""
    rng = np.random.default_rng(19)
    K, N = 128, 40
    dq = rng.uniform(0.001, 0.01, (K // 32, 1, N)).astype(np.float32)
    mq = rng.uniform(-0.1, 0.0, (K // 32, 1, N)).astype(np.float32)
    q = rng.integers(0, 16, (K // 32, 32, N))
    q[:, 0], q[:, 1] = 0, 15
    w = (dq * q + mq).astype(np.float32).reshape(K, N)
    codes, scale = q8.quantize_blocks(w, 0)
    assert np.array_equal(codes.reshape(K // 32, 32, N), (q * 17).astype(np.uint8))
    assert np.allclose(dequantize_int8(codes, scale, 0), w, rtol=0, atol=1e-6)
    # codes of GGUF blocks are used exactly: the matmul of the codes is the float matmul of w up
    # to the activations' two-level rounding
    x = rng.standard_normal((2, K)).astype(np.float32)
    y = q8.block_matmul_np(x, codes, scale)
    assert np.allclose(y, x @ w, rtol=1e-3, atol=1e-4)


def test_kernel_builds_once_into_the_cache(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECJAX_NO_CACHE", "1")  # does not turn the kernel's build off
    path = q8.build()
    assert path.startswith(str(tmp_path / "kernels")) and os.path.isfile(path)
    mtime = os.stat(path).st_mtime_ns
    assert q8.build() == path and os.stat(path).st_mtime_ns == mtime
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]


def test_without_a_compiler_the_reference_is_used_with_one_note(tmp_path):
    """No C++ compiler on PATH (and an empty cache): available() is False, one note line names the
    reason, and block_matmul is the reference (the same bits)."""
    import subprocess
    import sys

    code = (
        "import numpy as np, jax\n"
        "from specjax.models import q8\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((2, 64)).astype(np.float32)\n"
        "c = rng.integers(0, 256, (64, 48), dtype=np.uint8)\n"
        "s = (rng.standard_normal((2, 2, 48)) * 0.01).astype(np.float32)\n"
        "assert not q8.available() and not q8.available()\n"
        "y = np.asarray(jax.jit(q8.block_matmul)(x, c, s))\n"
        "assert np.array_equal(y.view(np.int32), q8.block_matmul_np(x, c, s).view(np.int32))\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(q8.__file__))))
    env = dict(os.environ, PATH=str(tmp_path), SPECJAX_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("CXX", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    notes = [line for line in r.stderr.splitlines() if line.startswith("specjax: note:")]
    assert len(notes) == 1 and "compiler" in notes[0], r.stderr[-2000:]


def test_a_background_build_is_awaited_by_load(kernel, tmp_path):
    """start_build() compiles on a thread in an empty cache; expected() says yes without waiting,
    load() waits for the same build (one library, registered once), and the kernel is then the
    numpy reference bitwise; without a compiler no thread starts."""
    import subprocess
    import sys

    code = (
        "import numpy as np, jax, os, sys\n"
        "from specjax.models import q8\n"
        "assert q8.start_build() and q8.expected()\n"
        "assert q8.KERNEL.builder.is_alive()  # building: expected() did not wait\n"
        "lib = q8.load()\n"
        "assert lib is not None and q8.load() is lib and q8.available()\n"
        "q8.join_build(); assert not q8.start_build()\n"
        "assert len(os.listdir(os.path.join(os.environ['SPECJAX_CACHE_DIR'], 'kernels'))) == 1\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.standard_normal((2, 64)).astype(np.float32)\n"
        "c = rng.integers(0, 256, (64, 48), dtype=np.uint8)\n"
        "s = (rng.standard_normal((2, 2, 48)) * 0.01).astype(np.float32)\n"
        "y = np.asarray(jax.jit(q8.block_matmul)(x, c, s))\n"
        "assert np.array_equal(y.view(np.int32), q8.block_matmul_np(x, c, s).view(np.int32))\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(q8.__file__))))
    env = dict(os.environ, SPECJAX_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    env.update(PATH=str(tmp_path), SPECJAX_CACHE_DIR=str(tmp_path / "cache2"))
    env.pop("CXX", None)
    r = subprocess.run([sys.executable, "-c", "from specjax.models import q8\nprint(q8.start_build())"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "False", r.stderr[-2000:]
