"""Head (576->49152) and one layer's matmuls: ST vs MT, interleaved, many reps."""
import time, sys, numpy as np, jax, jax.numpy as jnp, q8
q8.load()
rng = np.random.default_rng(1)
res = {}
for K, N in [(576, 49152), (576, 3072), (576, 576)]:
    c, s = q8.quantize_weights(rng.standard_normal((K, N), dtype=np.float32))
    wp, sp = map(jnp.asarray, q8.pack_weights(c, s))
    for M in (1, 2, 8):
        x = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32))
        f = {t: jax.jit(lambda x, wp, sp, t=t: q8.q8_matmul(x, wp, sp, threads=t)) for t in (False, True)}
        for t in f: f[t](x, wp, sp).block_until_ready()
        tm = {False: [], True: []}
        reps = 40 if N > 10000 else 400
        for _ in range(reps):
            for t in (False, True):
                a = time.perf_counter(); f[t](x, wp, sp).block_until_ready(); tm[t].append(time.perf_counter() - a)
        print(f"K={K} N={N} M={M}: ST {np.median(tm[False])*1e3:.3f} ms  MT {np.median(tm[True])*1e3:.3f} ms", flush=True)
