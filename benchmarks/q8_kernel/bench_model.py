"""Matmul-only model of SmolLM2-135M shapes: 30 x [576->960, 576->576, 576->3072,
1536->576] + head 576->49152. Variants (same run, interleaved rounds):
  f32   : jnp x @ w
  i8dot : per-row int8 activations x per-channel int8 weights, lax.dot_general
          int32 accumulation, rows padded to >= 2
  q8_st : FFI kernel, single thread
  q8_mt : FFI kernel, XLA intra-op thread pool
Usage: python bench_model.py [reps] [Ms...]
"""
import sys
import time
import numpy as np
import jax
import jax.numpy as jnp
import q8

q8.load()
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 25
MS = [int(a) for a in sys.argv[2:]] or [1, 2, 5, 8]
L = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
HEAD = (576, 49152)
rng = np.random.default_rng(0)


def make(K, N):
    w = (rng.standard_normal((K, N), dtype=np.float32) * (1.0 / np.sqrt(K))).astype(np.float32)
    codes, scale = q8.quantize_weights(w)
    wp, sp = q8.pack_weights(codes, scale)
    # per-output-channel int8 for variant (b)
    cs = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    ci = np.clip(np.rint(w / cs), -127, 127).astype(np.int8)
    return dict(f32=jnp.asarray(w), i8=(jnp.asarray(ci), jnp.asarray(cs)),
                q8=(jnp.asarray(wp), jnp.asarray(sp)))


t0 = time.time()
layers = [[make(K, N) for (K, N) in SHAPES] for _ in range(L)]
head = make(*HEAD)
print(f"weights built in {time.time() - t0:.1f}s; isa={q8.isa()}", flush=True)


def mm_f32(x, w):
    return x @ w["f32"]


def mm_i8(x, w):
    wq, ws = w["i8"]
    M = x.shape[0]
    if M < 2:
        x = jnp.pad(x, ((0, 2 - M), (0, 0)))
    s = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    s = jnp.where(s == 0, 1.0, s)
    xq = jnp.clip(jnp.round(x / s), -127, 127).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * s * ws[None, :]
    return y[:M]


def mm_q8(threads):
    def f(x, w):
        wp, sp = w["q8"]
        return q8.q8_matmul(x, wp, sp, threads=threads)
    return f


def model(mm):
    def run(h, layers, head):
        for lw in layers:
            a = mm(h, lw[0])                                   # 576 -> 960
            b = mm(jnp.tanh(a[:, :576]), lw[1])                 # 576 -> 576
            c = mm(jnp.tanh(b), lw[2])                          # 576 -> 3072
            d = mm(jnp.tanh(c[:, :1536]) * c[:, 1536:], lw[3])  # 1536 -> 576
            h = jnp.tanh(h + d)
        return mm(h, head)
    return jax.jit(run)


def head_only(mm):
    return jax.jit(lambda h, head: mm(h, head))


VARIANTS = {"f32": mm_f32, "i8dot": mm_i8, "q8_st": mm_q8(False), "q8_mt": mm_q8(True)}


def bench(fns, args_for, reps, warm=3):
    times = {k: [] for k in fns}
    for k, f in fns.items():
        for _ in range(warm):
            f(*args_for(k)).block_until_ready()
    for _ in range(reps):
        for k, f in fns.items():            # interleaved: same background load
            a = args_for(k)
            t = time.perf_counter()
            f(*a).block_until_ready()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: (float(np.median(v)), float(np.percentile(v, 25)), float(np.percentile(v, 75))) for k, v in times.items()}


rows = []
for M in MS:
    h = jnp.asarray(rng.standard_normal((M, 576), dtype=np.float32))
    fns = {k: model(mm) for k, mm in VARIANTS.items()}
    r = bench(fns, lambda k: (h, layers, head), REPS)
    fh = {k: head_only(mm) for k, mm in VARIANTS.items()}
    rh = bench(fh, lambda k: (h, head), REPS * 2)
    rows.append((M, r, rh))
    print(f"M={M}: model " + "  ".join(f"{k} {v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}]" for k, v in r.items()), flush=True)
    print(f"M={M}: head  " + "  ".join(f"{k} {v[0]:.3f} [{v[1]:.3f}-{v[2]:.3f}]" for k, v in rh.items()), flush=True)

print("\nms per call, median (IQR) of", REPS, "reps (head: ", 2 * REPS, ")")
print("| M | what | f32 x@w | int8 dot_general | q8 kernel 1 thread | q8 kernel XLA pool |")
print("|---|---|---|---|---|---|")
for M, r, rh in rows:
    for name, d in (("model", r), ("head 576->49152", rh)):
        print(f"| {M} | {name} | " + " | ".join(f"{d[k][0]:.2f} ({d[k][1]:.2f}-{d[k][2]:.2f})" for k in VARIANTS) + " |")
