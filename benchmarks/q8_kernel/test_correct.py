"""Correctness: bitwise vs numpy reference, M-invariance, ST==MT, while_loop.
Run with Q8_FORCE_ISA=1 (avx2) / 0 (scalar) to test the fallback paths."""
import sys
import numpy as np
import jax
import jax.numpy as jnp
import q8

q8.load()
print("isa:", q8.isa(), " jax threads? devices:", jax.devices())
rng = np.random.default_rng(0)
results = []


def ulps(a, b):
    ai = a.view(np.int32).astype(np.int64)
    bi = b.view(np.int32).astype(np.int64)
    ai = np.where(ai < 0, -(ai & 0x7fffffff), ai)
    bi = np.where(bi < 0, -(bi & 0x7fffffff), bi)
    return int(np.abs(ai - bi).max())


shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (64, 32), (576, 49152)]
for K, N in shapes:
    w = rng.standard_normal((K, N)).astype(np.float32) * 0.05
    w[:32, :5] = 0.0                         # an all-zero weight block
    codes, scale = q8.quantize_weights(w)
    wp, sp = q8.pack_weights(codes, scale)
    wpj, spj = jnp.asarray(wp), jnp.asarray(sp)
    f_st = jax.jit(lambda x: q8.q8_matmul(x, wpj, spj, threads=False))
    f_mt = jax.jit(lambda x: q8.q8_matmul(x, wpj, spj, threads=True))
    X = rng.standard_normal((16, K)).astype(np.float32) * rng.uniform(0.01, 10, (16, 1)).astype(np.float32)
    X[0, :32] = 0.0                          # an all-zero activation block
    X[1, 5] = 1e4                            # outlier
    ref = q8.matmul_ref(X, codes, scale)
    y_st = np.asarray(f_st(X))
    y_mt = np.asarray(f_mt(X))
    n_neq = int((y_st.view(np.int32) != ref.view(np.int32)).sum())
    ok_ref = n_neq == 0
    ok_stmt = np.array_equal(y_st.view(np.int32), y_mt.view(np.int32))
    # M-invariance: each M=1..9 with random other rows, and M single calls
    single = np.stack([np.asarray(f_mt(X[i:i + 1]))[0] for i in range(9)])
    single_st = np.stack([np.asarray(f_st(X[i:i + 1]))[0] for i in range(9)])
    ok_inv = np.array_equal(single.view(np.int32), single_st.view(np.int32))
    for M in range(1, 10):
        for trial in range(3):
            idx = rng.permutation(16)[:M]
            Xm = X[idx].copy()
            if trial == 2:                   # other rows completely random junk
                Xm[1:] = rng.standard_normal((M - 1, K)).astype(np.float32) * 100
            for f in (f_st, f_mt):
                ym = np.asarray(f(Xm))
                if not np.array_equal(ym[0].view(np.int32), y_st[idx[0]].view(np.int32)):
                    ok_inv = False
                if trial < 2 and not np.array_equal(ym.view(np.int32), single[idx].view(np.int32) if idx.max() < 9 else y_st[idx].view(np.int32)):
                    ok_inv = False
    rel = float(np.abs(y_st - ref).max() / np.abs(ref).max())
    xf = X @ w
    relf = float(np.linalg.norm(y_st - xf) / np.linalg.norm(xf))
    print(f"K={K:5d} N={N:6d}: bitwise==ref {ok_ref} (neq={n_neq}, max ulp {ulps(y_st, ref)}), "
          f"ST==MT {ok_stmt}, M-invariant(1..9, singles) {ok_inv}, rel.err vs float matmul {relf:.4f}")
    results.append(ok_ref and ok_stmt and ok_inv)

# batch dims [B, T, K]
K, N = 576, 960
w = rng.standard_normal((K, N)).astype(np.float32)
codes, scale = q8.quantize_weights(w)
wp, sp = map(jnp.asarray, q8.pack_weights(codes, scale))
X3 = rng.standard_normal((2, 3, K)).astype(np.float32)
y3 = np.asarray(jax.jit(lambda x: q8.q8_matmul(x, wp, sp))(X3))
ok3 = np.array_equal(y3.reshape(6, N), q8.matmul_ref(X3.reshape(6, K), codes, scale))
print("batch dims [2,3,K]:", ok3)
results.append(ok3)


# inside lax.while_loop (and fori_loop / scan) with a data-dependent chain
def body(c):
    i, h = c
    y = q8.q8_matmul(h, wp, sp)
    return i + 1, jnp.tanh(y[:, :K])


@jax.jit
def loop(h):
    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, h))[1]


h0 = rng.standard_normal((3, K)).astype(np.float32)
yl = np.asarray(loop(h0))
h = h0
for _ in range(5):
    h = np.tanh(q8.matmul_ref(h, codes, scale)[:, :K]).astype(np.float32)
d = float(np.abs(yl - h).max())
hj = h0
for _ in range(5):
    hj = np.asarray(jax.jit(body)((0, hj))[1])
okw = np.array_equal(yl, hj)
print(f"while_loop: matches eager-jit chain bitwise {okw}; max|diff| vs numpy chain {d:.2e} (tanh impl differs)")
results.append(okw)


# embedding lookup from the packed head layout
E = rng.standard_normal((4096, 576)).astype(np.float32)
codes_t, scale_t = q8.quantize_weights(E.T)          # head: K=576 inputs, N=4096 outputs
wpE, spE = q8.pack_weights(codes_t, scale_t)
ids = np.array([0, 31, 32, 4095, 1234])
emb = np.asarray(jax.jit(q8.embed_lookup_packed)(jnp.asarray(wpE), jnp.asarray(spE), jnp.asarray(ids)))
deq = (codes_t.astype(np.float32).reshape(18, 32, 4096) * scale_t[:, None, :]).reshape(576, 4096).T
oke = np.array_equal(emb, deq[ids])
print("embedding lookup from packed head:", oke)
results.append(oke)
print("ALL OK" if all(results) else "FAILURES")
sys.exit(0 if all(results) else 1)
