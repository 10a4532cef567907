"""The block int8 matmul (specjax/models/q8.py) on the SmolLM2-135M shapes, ms per call.

A matmul-only model: 30 x [576->960 qkv, 576->576 o, 576->3072 gate_up, 1536->576 down] (KN) and the
tied-embedding head 49152 x 576 (NK), the layers chained with tanh so that nothing is hoisted.
Variants, interleaved in every round (so they see the same background load; the order rotates from
round to round):

  f32      float32 ``x @ w`` (the head ``x @ E.T``)
  q8_1t    the kernel, one thread (the default)
  q8_2t    the kernel, N split over two threads
  ref      the jnp reference (block_matmul_ref), only at M <= 2 (it is slow)
  q8_1t_ISA  with --isa ISA ...: the kernel, one thread, forced onto that instruction-set path
           (q8.set_isa before each call: e.g. avx2 on an AVX-512 host, a stand-in for an AVX2-only host's
           kernel — the float32 column stays this host's XLA)

Usage: python benchmarks/q8_block.py [--reps 21] [--ms 1,2,4,8,64,512] [--isa avx2 scalar]
Prints the CPU's flags (avx512_vnni / avx2), the load average before and after, and a table of
medians (interquartile range).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import q8

L = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
VOCAB, D = 49152, 576


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "unknown"
    return f"{model}; avx512_vnni={'avx512_vnni' in flags} avx512f={'avx512f' in flags} avx2={'avx2' in flags}"


def make_weights(rng):
    def kn(K, N):
        w = (rng.standard_normal((K, N), dtype=np.float32) / np.sqrt(K)).astype(np.float32)
        codes, scale = q8.quantize_blocks(w, 0)
        return dict(f32=jnp.asarray(w), q8=(jnp.asarray(codes), jnp.asarray(scale)))

    layers = [[kn(K, N) for K, N in SHAPES] for _ in range(L)]
    E = (rng.standard_normal((VOCAB, D), dtype=np.float32) * 0.05).astype(np.float32)
    codes, scale = q8.quantize_blocks(E, 1)
    head = dict(f32=jnp.asarray(E), q8=(jnp.asarray(codes), jnp.asarray(scale)))
    return layers, head


def variants():
    def f32(x, w, head=False):
        return x @ w["f32"].T if head else x @ w["f32"]

    def kernel(threads):
        def mm(x, w, head=False):
            return q8.block_matmul(x, *w["q8"], transposed=head, threads=threads)
        return mm

    def ref(x, w, head=False):
        return q8.block_matmul_ref(x, *w["q8"], transposed=head)

    return {"f32": f32, "q8_1t": kernel(1), "q8_2t": kernel(2), "ref": ref}


def model(mm):
    def run(h, layers, head):
        for lw in layers:
            a = mm(h, lw[0])
            b = mm(jnp.tanh(a[:, :576]), lw[1])
            c = mm(jnp.tanh(b), lw[2])
            d = mm(jnp.tanh(c[:, :1536]) * c[:, 1536:], lw[3])
            h = jnp.tanh(h + d)
        return mm(h, head, True)
    return jax.jit(run)


def head_only(mm):
    return jax.jit(lambda h, head: mm(h, head, True))


def bench(fns, args, reps, warm=2):
    times = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(warm):
            f(*args).block_until_ready()
    keys = list(fns)
    for r in range(reps):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotated: no variant always follows another
            f = fns[k]
            t = time.perf_counter()
            f(*args).block_until_ready()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: (float(np.median(v)), float(np.percentile(v, 25)), float(np.percentile(v, 75)))
            for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--ms", default="1,2,4,8,64,512")
    ap.add_argument("--ref-max-m", type=int, default=2)
    ap.add_argument("--isa", nargs="*", default=[], choices=q8.ISAS,
                    help="also time the one-thread kernel forced onto these instruction-set paths")
    args = ap.parse_args()
    print("cpu:", cpu_flags())
    print(f"kernel: available={q8.available()} isa={q8.isa()} ({q8.unavailable_reason() or 'ok'}); "
          f"jax {jax.__version__}, {os.cpu_count()} cpus")
    print("load average before:", os.getloadavg())
    rng = np.random.default_rng(0)
    t0 = time.time()
    layers, head = make_weights(rng)
    print(f"weights built in {time.time() - t0:.1f}s", flush=True)
    all_v = variants()
    best = q8.isa()
    forced = {f"q8_1t_{i}": i for i in args.isa}
    all_v.update({k: all_v["q8_1t"] for k in forced})

    def wrap(name, f):  # the kernel's path is a process-wide switch: set it before every call
        if name in forced:
            return lambda *a: (q8.set_isa(forced[name]), f(*a))[1]
        return (lambda *a: (q8.set_isa(best), f(*a))[1]) if forced and best else f

    rows = []
    for M in [int(m) for m in args.ms.split(",")]:
        names = [k for k in all_v if k != "ref" or M <= args.ref_max_m]
        h = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
        r = bench({k: wrap(k, model(all_v[k])) for k in names}, (h, layers, head), args.reps)
        rh = bench({k: wrap(k, head_only(all_v[k])) for k in names}, (h, head), args.reps)
        rows.append((M, r, rh))
        for what, d in (("model", r), ("head", rh)):
            print(f"M={M} {what}: " + "  ".join(f"{k} {v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}]" for k, v in d.items()),
                  flush=True)
    print("load average after:", os.getloadavg())
    cols = list(all_v)
    print(f"\nms per call, median (interquartile range) of {args.reps} interleaved repeats")
    print("| M | what | " + " | ".join(cols) + " |")
    print("|---:|---|" + "---:|" * len(cols))
    for M, r, rh in rows:
        for what, d in (("model (30 layers + head)", r), ("head 49152x576 (NK)", rh)):
            cells = [f"{d[k][0]:.2f} ({d[k][1]:.2f}-{d[k][2]:.2f})" if k in d else "—" for k in cols]
            print(f"| {M} | {what} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
