#!/usr/bin/env python
"""Where an accelerator's one-token target call loses to the bandwidth bound: ablations of the
attention and of XLA's command buffers, on the random-weight shapes of ``benchmarks/device.py``.

The first H200 run of ``device.py`` (BENCHMARKS.md) found the one-token decode round ≈ 60 µs per
layer above the bytes' bound at every size (135M, 1B, 8B): a fixed cost per layer, not bandwidth.
This script splits that cost. For each shape it compiles the one-token target call as the decode
loop makes it (``device.py``'s ``_forward``: ``llama.apply`` + ``SamplingParams.process``, batch 1,
bfloat16 weights and KV cache, the same buffer and position) with the model's attention replaced by

* ``blocked``: specjax's own (:func:`specjax.models.attention.cache_attention`; the default, batch-invariant);
* ``dense``: one plain masked softmax over the whole buffer (``jnp.max``/``jnp.sum``, no key blocks, no
  pairwise sums) — NOT batch-invariant, an ablation only;
* ``fused``: ``jax.nn.dot_product_attention`` (cuDNN where it applies, else XLA; the JSON says which) —
  an ablation only (not bitwise equal between a verify call and a one-token step);
* ``none``: zeros (the K/V are still written): the cost of everything but attention,
* ``no_row_pad``: specjax's attention, but the matmuls' one-row activations are not padded to two
  rows (``ops._rows_padded``, a workaround for XLA CPU's one-row bf16 dot, applied on every backend),

and times each (median of ``--repeats`` calls); the sampling step alone (``SamplingParams.process``
over the vocabulary) is timed too, and the optimized HLO of the ``blocked`` call is written to
``--out`` (gzip) with a count of its top-level instructions by opcode (each fusion, custom call or
copy there is at least one kernel launch). XLA flag variants (``--variants``) run as child
processes, since XLA reads its flags once per process: ``default`` (no flags) and
``no_command_buffer`` (``--xla_gpu_enable_command_buffer=``: every kernel launched on its own) and
``no_triton_gemm`` (``--xla_gpu_enable_triton_gemm=false``: the dots go to cuBLAS instead of XLA's Triton
GEMM fusions, which the first run's HLO showed splitting each one-token dot over K); the
non-default variants time ``blocked`` and ``no_row_pad`` only.

    PYTHONPATH=. python benchmarks/device_overhead.py --out DIR                 # ≈ 3 min on one GPU
    PYTHONPATH=. python benchmarks/device_overhead.py --out DIR --shapes tiny --dtype float32   # CPU check

``DIR/overhead.json`` is rewritten after every measurement; one line is printed per measurement; a
child past ``--budget-s`` stops before its next measurement.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"default": None, "no_command_buffer": "--xla_gpu_enable_command_buffer=",
            "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false"}
ABLATIONS = ("blocked", "dense", "fused", "none", "no_row_pad")


def _device_module():
    spec = importlib.util.spec_from_file_location("device_benchmark", os.path.join(HERE, "device.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _attention(kind: str, original):
    """A replacement for ``llama.cache_attention`` (same signature, float32 ``[B, T, H·hd]``)."""
    import jax
    import jax.numpy as jnp

    def dense(q, k_cache, v_cache, positions, cfg, tree_mask=None, window=None, key_span=None, kv_view=None):
        b, t, h, hd = q.shape
        kv, s = k_cache.shape[1], k_cache.shape[2]
        qg = q.reshape(b, t, kv, h // kv, hd).astype(k_cache.dtype)
        sc = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) * cfg.attention_scale()
        visible = jnp.arange(s)[None, None, None, None, :] <= positions[:, None, None, :, None]
        p = jax.nn.softmax(jnp.where(visible, sc, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgts,bksd->btkgd", p.astype(v_cache.dtype), v_cache, preferred_element_type=jnp.float32)
        return o.reshape(b, t, h * hd)

    used = {}

    def fused(q, k_cache, v_cache, positions, cfg, tree_mask=None, window=None, key_span=None, kv_view=None):
        b, t, h, hd = q.shape
        s = k_cache.shape[2]
        k, v = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)  # [B, S, KV, hd]
        mask = (jnp.arange(s)[None, None, None, :] <= positions[:, None, :, None])  # [B, 1, T, S]
        qq = q.astype(k.dtype)
        for impl in ("cudnn", "xla"):
            try:
                o = jax.nn.dot_product_attention(qq, k, v, mask=mask, scale=cfg.attention_scale(), implementation=impl)
                used["implementation"] = impl
                break
            except Exception as exc:  # cuDNN does not take this mask/shape: fall back to XLA's
                used.setdefault("refused", []).append(f"{impl}: {type(exc).__name__}: {str(exc)[:200]}")
        return o.astype(jnp.float32).reshape(b, t, h * hd)

    def none(q, k_cache, v_cache, positions, cfg, tree_mask=None, window=None, key_span=None, kv_view=None):
        b, t, h, hd = q.shape
        return jnp.zeros((b, t, h * hd), jnp.float32)

    return {"blocked": original, "dense": dense, "fused": fused, "none": none, "no_row_pad": original}[kind], used


def _opcodes(hlo: str) -> dict:
    """Top-level instructions of the ENTRY computation by opcode."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    counts = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?\s+([a-z][a-z0-9-]*)\(", line)
        if m is None:
            m = re.search(r"\s([a-z][a-z0-9-]*)\(", line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts.most_common())


def child(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = _device_module()
    from specjax.core.sampling import SamplingParams
    from specjax.models import llama, ops

    if args.dtype:
        dev.DTYPE = args.dtype
    t_start = time.perf_counter()
    path = os.path.join(args.out, f"overhead-{args.child}.json")
    doc = {"variant": args.child, "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__,
           "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend(), "dtype": dev.DTYPE,
           "shapes": {}, "status": "running"}

    def save(line=None):
        if line:
            print(f"[{time.perf_counter() - t_start:7.1f} s] {args.child}: {line}", flush=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)

    shapes = dict(dev.SHAPES, **dev.SMOKE_SHAPES)
    original, padded = llama.cache_attention, ops._rows_padded
    attentions = ABLATIONS if args.child == "default" else ("blocked", "no_row_pad")
    buf = dev.decode_buffer_len(args.prompt_len, args.max_new_tokens, max(dev.KS) - 1)
    pos0 = args.prompt_len + args.max_new_tokens // 2
    try:
        for name in args.shapes:
            cfg = __import__("specjax").ModelConfig.from_hf_config(shapes[name]["config"])
            target = dev.random_target(name, cfg, 0)
            bw = dev.peak_bandwidth(jax.devices()[0].device_kind, jax.default_backend(), None)["bytes_per_s"]
            bound = dev.bound_ms(cfg, buf, bw)
            sec = doc["shapes"][name] = {"layers": cfg.num_layers, "buffer_len": buf, "bound": bound, "forward_ms": {},
                                         "compile_s": {}}
            for kind in attentions:
                if time.perf_counter() - t_start > args.budget_s:
                    doc["status"] = f"stopped: budget before {name} {kind}"
                    save(doc["status"])
                    return 0
                fn, used = _attention(kind, original)
                llama.cache_attention = fn
                if kind == "no_row_pad":
                    ops._rows_padded = lambda x2d, f: f(x2d)
                jax.clear_caches()
                try:
                    if kind == "blocked" and args.child == "default":
                        tokens = jnp.asarray(np.full((1, 1), 7), jnp.int32)
                        positions = jnp.asarray([[pos0]], jnp.int32)
                        cache = llama.KVCache.create(cfg, 1, buf, jnp.dtype(dev.kv_cache_dtype(dev.DTYPE)))
                        comp = dev._forward_jit.lower(target.graphdef, cfg, target.params, tokens, positions, cache,
                                                      SamplingParams.create(1), None).compile()
                        text = comp.as_text()
                        sec["entry_opcodes"] = _opcodes(text)
                        with gzip.open(os.path.join(args.out, f"hlo-{name}.txt.gz"), "wt") as f:
                            f.write(text)
                        del comp, cache
                    sec["compile_s"][kind], run = dev.compile_forward(target, 1, buf, pos0)
                    ms = sec["forward_ms"][kind] = dev.median_ms(run, 3, args.repeats)
                    if used:
                        sec.setdefault("fused", {}).update(used)
                    per_layer = (ms - (bound["bound_ms"] or 0.0)) / cfg.num_layers * 1e3
                    save(f"{name} {kind}: {ms:.3f} ms ({per_layer:.1f} µs/layer above the bound"
                         f" of {bound['bound_ms'] or 0:.3f} ms) {used or ''}")
                except Exception as exc:
                    sec["forward_ms"][kind] = None
                    sec.setdefault("errors", {})[kind] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    save(f"{name} {kind}: failed: {sec['errors'][kind]}")
                finally:
                    llama.cache_attention, ops._rows_padded = original, padded
            if args.child == "default":  # the sampling step alone, over the vocabulary
                sp = SamplingParams.create(1)
                logits = jnp.zeros((1, 1, cfg.vocab_size), jnp.float32)
                proc = jax.jit(lambda lg: sp.process(lg))
                jax.block_until_ready(proc(logits))
                sec["sampling_ms"] = dev.median_ms(lambda: jax.block_until_ready(proc(logits)), 3, args.repeats)
                save(f"{name} sampling alone: {sec['sampling_ms']:.3f} ms")
            del target
            jax.clear_caches()
        doc["status"] = "complete"
        save("complete")
    except Exception as exc:
        doc["status"] = f"failed: {type(exc).__name__}: {str(exc)[:400]}"
        save(doc["status"])
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dtype", default=None, help="weights' dtype (device.py's DTYPES; default bfloat16)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=200.0, help="seconds for all children together")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.child:
        return child(args)
    t0, rc = time.perf_counter(), 0
    for i, name in enumerate(args.variants):
        left = args.budget_s - (time.perf_counter() - t0)
        share = left - 15 if i == len(args.variants) - 1 else 0.7 * left  # the first child ablates the most
        if left < 20:
            print(f"budget spent before variant {name}", flush=True)
            break
        env = dict(os.environ)
        if VARIANTS[name]:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", args.out, "--shapes", *args.shapes,
               "--prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.max_new_tokens),
               "--repeats", str(args.repeats), "--budget-s", str(share)]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        try:
            rc |= subprocess.run(cmd, env=env, timeout=left + 30).returncode
        except subprocess.TimeoutExpired:
            print(f"variant {name} ran past the budget", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
