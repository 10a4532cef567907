#!/usr/bin/env python
"""The accelerator benchmark: specjax's decode step, verification cost and speculative round at real
model sizes, on whatever JAX device the host has (one GPU or TPU chip; CPU works too).

One script, no install, no network, no model files: the targets are **random bfloat16 weights**
(``--dtype float32``: a CPU's own format) of
the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes (the published ``config.json`` values,
declared once in :mod:`specjax.models.shapes`, parsed by :meth:`specjax.ModelConfig.from_hf_config`), generated on the device by jitted
``jax.random`` calls, so host memory stays small. Speed does not depend on the weights' values.

    PYTHONPATH=. python benchmarks/device.py --out results.json            # ≈ 5 min budget
    PYTHONPATH=. python benchmarks/device.py --cpu-smoke --out smoke.json  # one tiny shape on CPU (CI)
    PYTHONPATH=. python benchmarks/device.py --shapes llama-3.2-1b --dtype float32 --bandwidth measure \
        --out cpu-1b.json                                                  # a 1B shape against this CPU's floor

Per shape it measures, at batch 1 (times are medians; ms per call unless said):

* ``forward_ms[k]``: one jitted target call over k new tokens as the decode loop makes it
  (``llama.apply`` with the chain verification mask, then ``SamplingParams.process``) on a donated
  KV cache of ``settings.forward_buffer_len`` slots (the Decoder's buffer for the prompt, the new
  tokens and 64 verified ones), for k in {1, 4, 16, 64};
* ``verification_curve[k]`` = forward_ms[k] ÷ forward_ms[1], v(k): the cost of verifying k tokens in one
  call, in one-token steps (the textbook model assumes 1);
* ``ar_step``: the one-token step against the memory-bandwidth bound: bytes one step must read
  (every weight, an untied embedding table only by the row it gathers, plus the whole KV buffer,
  which specjax's blocked attention reads masked) ÷ the device's peak bandwidth
  (:data:`PEAK_BANDWIDTH_TBS` by device kind, or ``--bandwidth``); ``ratio_* = measured ÷ bound``
  (1 = at the bound). On CPU there is no spec-sheet peak: the bound is left out unless ``--bandwidth``
  is given; ``--bandwidth measure`` takes the read rate of a jitted sum over 1 GiB on this host
  (:func:`measured_bandwidth`), the memory floor a decode step could reach here;
* ``decode``: one round of the real decode program (:class:`specjax.Decoder`'s compiled
  ``lax.while_loop``, timed over chunks of rounds): autoregressive (one token per round) and
  speculative with a random-weight drafter of the shipped EAGLE-3 drafter's architecture
  (:data:`DRAFTER`) at each γ;
* ``speculative[γ]``: the predicted speedup τ(γ) · t_AR ÷ t_round(γ), where τ (new tokens per target
  call) is **replayed** from a CPU measurement of the shipped drafter on the real SmolLM2-135M
  (:data:`TAU_REPLAYED`): random weights accept nothing meaningful, so τ cannot be measured here;
* ``compile_s``: seconds to lower and compile each program (the persistent compilation cache,
  ``--compile-cache``, is reported with how many entries it held at the start: a warm cache makes
  these load times).

Weights are made once per shape and pass and released after it, so one shape occupies the device
at a time (a shape that does not fit its memory is skipped with a note). The passes put the
essential figures of every shape first: (1) the one-token call with the bandwidth bound, the AR
round and the γ = 2 round; (2) the calls over 4, 16 and 64 tokens; (3) the other γ. The results
JSON (``--out``) is rewritten atomically after every measurement and one line is printed per
measurement, so a run cut short keeps everything measured so far; after ``--budget-s`` seconds
(default 270) the run stops cleanly before its next measurement and ``status`` says where.
``--cpu-smoke`` runs one tiny shape with few repeats and γ = 2 only, on CPU (≈ 40 s on 2 busy
cores with a cold compilation cache, ≈ 10 s warm; mostly compilation), as CI does
(tests/test_device_benchmark.py).

JSON: ``status``, ``settings`` (dtype, batch, prompt and buffer lengths, k, γ, repeats, budget,
compile cache), ``machine`` (backend, device kind and count, jax/jaxlib versions, CPU model and
vector flags from /proc/cpuinfo, free device memory, ``bandwidth``), ``tau_replayed`` (values,
source), and per shape in ``shapes``: ``config`` (the published values), ``params``,
``weight_bytes``, ``drafter``, ``status``, ``init_s``, ``compile_s``, ``forward_ms``,
``verification_curve``, ``ar_step``, ``decode``, ``speculative``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax.core.sampling import SamplingParams
from specjax.drafters import eagle
from specjax.eval.bench_io import write_json
from specjax.eval.hostcache import host_fingerprint
from specjax.models import llama
from specjax.models.attention import kv_cache_dtype
from specjax.models.shapes import SHAPES as PUBLISHED
from specjax.runtime.decoder import decode_buffer_len
from specjax.runtime.loop import verification_mask

DTYPE = "bfloat16"  # the weight format of every target (GPU/TPU default; --dtype float32 for a CPU's floor); KV cache: kv_cache_dtype(DTYPE)
DTYPES = ("bfloat16", "float32")
BATCH = 1

# The published config.json values of the shapes benchmarked (declared once, in specjax.models.shapes).
SHAPES = {name: {"source": PUBLISHED[name].source, "config": dict(PUBLISHED[name].hf_config)}
          for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b")}
SMOKE_SHAPES = {  # --cpu-smoke: one tiny shape (untied head, so both weight-byte rules are exercised)
    "tiny": {
        "source": "a tiny shape for the CPU smoke run (not a published model)",
        "config": dict(model_type="llama", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                       rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       max_position_embeddings=512, bos_token_id=0, eos_token_id=1),
    },
}

# The shipped drafter (models/smollm2-135m-instruct-eagle3/drafter.json), scaled to each target's width.
DRAFTER = {"sub_vocab": 8192, "intermediate_ratio": 1024 / 1536, "copy_ngram": 3,
           "feature_layers": "eagle3"}

# τ (new tokens per target call) by γ, measured on CPU, replayed here (never measured on the accelerator).
TAU_REPLAYED = {1: 1.53, 2: 1.80, 3: 1.94}
TAU_SOURCE = ("BENCHMARKS.md, 'Issue 19, stage 2' (2026-12-01), row new2_eagle3@γ1/2/3: the shipped EAGLE-3 "
              "drafter (models/smollm2-135m-instruct-eagle3) with the real SmolLM2-135M-Instruct target in int8, "
              "greedy, batch 1, the 33 held-out Spec-Bench prompts x 128 tokens, on a 2-core AVX-512 CPU")

# Peak memory bandwidth by device kind: (substrings that must all appear in the lower-case
# device_kind, label, TB/s); the first match wins, so more specific entries come first.
PEAK_BANDWIDTH_TBS = (
    (("h200",), "NVIDIA H200", 4.8),
    (("h100", "pcie"), "NVIDIA H100 PCIe", 2.0),
    (("h100",), "NVIDIA H100 SXM", 3.35),
    (("a100", "80gb"), "NVIDIA A100-80GB", 2.0),
    (("v5 lite",), "TPU v5e", 0.82), (("v5e",), "TPU v5e", 0.82),
    (("v5p",), "TPU v5p", 2.76), (("tpu v5",), "TPU v5p", 2.76),
    (("v6 lite",), "TPU v6e", 1.64), (("v6e",), "TPU v6e", 1.64),
    (("tpu v4",), "TPU v4", 1.2),
)

FULL = dict(prompt_len=1024, max_new_tokens=1024, repeats=20, warmup=3, chunks=5, rounds=16, budget_s=270.0,
            gammas=[1, 2, 3])
SMOKE = dict(prompt_len=24, max_new_tokens=40, repeats=3, warmup=1, chunks=2, rounds=4, budget_s=120.0, gammas=[2])
KS = (1, 4, 16, 64)


class OutOfBudget(Exception):
    """The time budget ran out before the measurement named in the message."""


class Report:
    """The results document: written atomically to ``path`` (temp file + ``os.replace``) and one line
    printed per measurement; keeps the clock of the ``--budget-s`` time budget."""

    def __init__(self, path: str, budget_s: float, doc: dict):
        self.path, self.budget_s, self.doc = path, float(budget_s), doc
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.t0

    def check_budget(self, what: str) -> None:
        """Raises :class:`OutOfBudget` once ``budget_s`` seconds have passed."""
        if self.elapsed() > self.budget_s:
            raise OutOfBudget(what)

    def record(self, line: str) -> None:
        """Write the document (atomically: :func:`specjax.eval.bench_io.write_json`) and print ``line``
        with the elapsed seconds."""
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
        write_json(self.path, self.doc, force=True)
        print(f"[{self.elapsed():7.1f} s] {line}", flush=True)


# --------------------------------------------------------------------------- the device
def measured_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second the device reads in a jitted sum over a ``gib``-GiB float32 array (best of
    ``repeats``, after one compile call): the streaming read rate a decode step can reach on this host
    (on CPU, with XLA's threads; larger than every cache level, so DRAM). A floor that is achievable
    here, not a spec-sheet peak."""
    x = jnp.ones((int(gib * 2 ** 30) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(repeats))
    nbytes = x.nbytes
    del x
    return nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_bandwidth(kind: str, backend: str, override_tbs: float | str | None) -> dict:
    """``{"bytes_per_s", "source", "note"}``: ``override_tbs`` (``--bandwidth``, TB/s, or ``"measure"``:
    :func:`measured_bandwidth`) if given, else the :data:`PEAK_BANDWIDTH_TBS` entry of the device
    ``kind``; ``bytes_per_s`` is None on the ``"cpu"`` backend and for kinds the table does not know."""
    if override_tbs == "measure":
        bps = measured_bandwidth()
        return {"bytes_per_s": bps, "source": f"measured: a jitted sum over 1 GiB, {bps / 1e9:.1f} GB/s",
                "note": "the read rate reached on this host (best of 5), not a spec-sheet peak"}
    if override_tbs is not None:
        note = "given on the command line" + (" (CPU: indicative only)" if backend == "cpu" else "")
        return {"bytes_per_s": override_tbs * 1e12, "source": "--bandwidth", "note": note}
    if backend == "cpu":
        return {"bytes_per_s": None, "source": None,
                "note": "CPU: the HBM bound is not meaningful (caches, shared DRAM); pass --bandwidth to compute it"}
    k = kind.lower()
    for patterns, label, tbs in PEAK_BANDWIDTH_TBS:
        if all(p in k for p in patterns):
            return {"bytes_per_s": tbs * 1e12, "source": f"table: {label} {tbs} TB/s",
                    "note": "peak, from the spec sheet"}
    return {"bytes_per_s": None, "source": None, "note": f"device kind {kind!r} is not in the table; pass --bandwidth"}


def free_memory_bytes() -> int | None:
    """Bytes free on the first device (``memory_stats``), on CPU the host's MemAvailable; None if unknown."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # backends without memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_section(args) -> dict:
    """Device kind, backend, jax version, device memory, CPU model and vector flags (specjax's host
    fingerprint, from /proc/cpuinfo), Python and platform."""
    fp = host_fingerprint()
    dev = jax.devices()[0]
    return {**fp, "python": platform.python_version(), "platform": platform.platform(),
            "device": str(dev), "free_memory_bytes_at_start": free_memory_bytes(),
            "bandwidth": peak_bandwidth(dev.device_kind, jax.default_backend(), args.bandwidth)}


# --------------------------------------------------------------------------- models
def _random_leaf(seed, index, shape: tuple, dtype, init: str):
    """Parameter number ``index`` of ``shape`` and ``dtype``, per the weight table's ``init``: N(0, 0.02)
    from the run's ``seed`` folded with ``index`` (XLA's RngBitGenerator: "rbg" keys compile faster
    than threefry), or ones, or zeros."""
    if init == "normal":
        key = jax.random.fold_in(jax.random.key(seed, impl="rbg"), index)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jnp.full(shape, 1.0 if init == "ones" else 0.0, dtype)


_random_leaf_jit = jax.jit(_random_leaf, static_argnums=(2, 3, 4))


def random_target(name: str, cfg: specjax.ModelConfig, seed: int) -> specjax.Model:
    """A :class:`specjax.Model` of ``cfg`` in bfloat16 with random weights made on the device: the
    parameter tree of :func:`llama.abstract_model`, each leaf drawn by a jitted ``jax.random`` call
    (one compile per distinct shape) with the weight table's initialisation of its name."""
    graphdef, abstract = llama.abstract_model(cfg, DTYPE)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    arrays = []
    for i, (path, leaf) in enumerate(leaves):
        name_of = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        spec = llama.weight_spec(name_of)
        if spec is None:
            raise RuntimeError(f"parameter {jax.tree_util.keystr(path)} is not in the weight table")
        arrays.append(_random_leaf_jit(np.uint32(seed), np.uint32(i), tuple(leaf.shape), jnp.dtype(leaf.dtype),
                                       spec.init))
    params = jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, arrays))
    return specjax.Model(cfg, graphdef, params, None, name=name, dtype=DTYPE)


def drafter_config(cfg: specjax.ModelConfig) -> eagle.EagleConfig:
    """The shipped drafter's architecture for a target of ``cfg``: one decoder block at the target's
    width and heads, MLP width 2/3 of the target's (1024 for SmolLM2-135M, rounded to 64), an
    8192-token sub-vocabulary head, the copy term (n ≤ 3), EAGLE-3 features of blocks (1, L/2−1, L−3)."""
    width = max(64, int(round(cfg.intermediate_size * DRAFTER["intermediate_ratio"] / 64)) * 64)
    return eagle.EagleConfig.for_target(cfg, DRAFTER["sub_vocab"], width, copy_ngram=DRAFTER["copy_ngram"],
                                        feature_layers=DRAFTER["feature_layers"])


def random_drafter(target: specjax.Model, seed: int) -> eagle.EagleDrafter:
    """An EAGLE drafter of :func:`drafter_config` with random trained weights; the frozen parts
    (embedding, head rows of the first ``sub_vocab`` ids) come from the target, as when loading."""
    ecfg = drafter_config(target.config)
    sub_ids = np.arange(ecfg.sub_vocab, dtype=np.int32)
    params = {"train": eagle.init_params(ecfg, seed), "frozen": eagle.frozen_params(target, sub_ids)}
    return eagle.EagleDrafter(ecfg, params, name="eagle3-random")


def kv_bytes(cfg: specjax.ModelConfig, buffer_len: int, cache_dtype: str) -> int:
    """Bytes of a whole KV cache (keys and values, every layer) of ``buffer_len`` slots at batch 1."""
    return 2 * cfg.num_layers * BATCH * cfg.num_kv_heads * buffer_len * cfg.head_dim * jnp.dtype(cache_dtype).itemsize


def weight_bytes_read(cfg: specjax.ModelConfig) -> int:
    """Weight bytes one decode step reads: every parameter, except that an untied embedding table is
    read only by the row it gathers (a tied one is the LM head, read whole)."""
    total = llama.num_params(cfg) * jnp.dtype(DTYPE).itemsize
    if not cfg.tie_word_embeddings:
        total -= (cfg.vocab_size - BATCH) * cfg.hidden_size * jnp.dtype(DTYPE).itemsize
    return total


def memory_need(cfg: specjax.ModelConfig, buffer_len: int) -> int:
    """Bytes a shape's run needs on the device (estimate, 15% + 1 GiB headroom): the bf16 weights,
    the drafter (its float32 weights, the target embedding it copies to float32, and for an untied
    head the float32 head and its transpose), the KV caches and the largest probabilities."""
    weights = llama.num_params(cfg) * jnp.dtype(DTYPE).itemsize
    train = llama.param_bytes(jax.eval_shape(lambda: eagle.init_params(drafter_config(cfg), 0)))
    frozen = cfg.vocab_size * cfg.hidden_size * 4 * (1 if cfg.tie_word_embeddings else 3)
    caches = kv_bytes(cfg, buffer_len, kv_cache_dtype(DTYPE)) * (len(KS) + 2)
    probs = 2 * max(KS) * cfg.vocab_size * 4
    return int(1.15 * (weights + train + frozen + caches + probs)) + 2 ** 30


# --------------------------------------------------------------------------- timed programs
def _forward(graphdef, cfg, params, tokens, positions, cache, sampling, tree_mask):
    """One target call as the decode loop verifies (``loop._target_step`` without penalties):
    ``llama.apply`` over ``tokens [B, k]`` (chain mask ``[B, k, k]``, None for k = 1), then
    ``SamplingParams.process``: ``(p [B, k, V] float32, cache)``."""
    out = llama.apply(graphdef, params, tokens, positions, cache, cfg, tree_mask=tree_mask)
    return sampling.process(out.logits), out.cache


_forward_jit = jax.jit(_forward, static_argnums=(0, 1), donate_argnums=(5,))


def median_ms(run, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``run()`` (which blocks until its result is ready) after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def compile_forward(target: specjax.Model, k: int, buffer_len: int, pos0: int):
    """``(compile seconds, run)``: the target call over ``k`` new tokens at positions ``pos0 ..``,
    compiled ahead of time; ``run()`` calls it once on its own donated KV cache of ``buffer_len``
    slots and waits for the result."""
    cfg = target.config
    rng = np.random.default_rng(k)
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (BATCH, k)), jnp.int32)
    positions = jnp.asarray(np.broadcast_to(pos0 + np.arange(k), (BATCH, k)), jnp.int32)
    mask = verification_mask(BATCH, k)
    sampling = SamplingParams.create(BATCH)
    box = [llama.KVCache.create(cfg, BATCH, buffer_len, jnp.dtype(kv_cache_dtype(DTYPE)))]
    t0 = time.perf_counter()
    fn = _forward_jit.lower(target.graphdef, cfg, target.params, tokens, positions, box[0], sampling, mask).compile()
    seconds = time.perf_counter() - t0

    def run():
        p, box[0] = fn(target.params, tokens, positions, box[0], sampling, mask)
        jax.block_until_ready(p)
    return seconds, run


def time_decode(target: specjax.Model, drafter, gamma: int, args) -> tuple[float, dict]:
    """``(compile seconds of prefill + decode loop, timings)`` of the real decode program: a
    :class:`specjax.Decoder` (``drafter`` None: autoregressive) on one random prompt of
    ``args.prompt_len`` tokens, EOS ignored; after one warm-up round, ``args.chunks`` calls of
    ``args.rounds`` rounds each. ``round_ms``: median seconds per round over the chunks.

    Raises:
      RuntimeError: the row finished before the timed rounds (``--max-new-tokens`` too small).
    """
    dec = specjax.Decoder(target, drafter, max(1, gamma))
    prompt = np.random.default_rng(gamma).integers(2, target.config.vocab_size, args.prompt_len).tolist()
    prog, st, compile_s, prefill_s = dec.start([prompt], max_new_tokens=args.max_new_tokens, eos_ids=[])
    st, _, _ = dec.run(prog, st, int(st.round) + 1)
    per_round = []
    for _ in range(args.chunks):
        r0 = int(st.round)
        st, _, seconds = dec.run(prog, st, r0 + args.rounds)
        if int(st.round) - r0 != args.rounds:
            raise RuntimeError(f"the row finished after {int(st.round)} rounds; raise --max-new-tokens")
        per_round.append(seconds / args.rounds)
    return compile_s, {"round_ms": statistics.median(per_round) * 1e3, "prefill_s": prefill_s,
                       "buffer_len": prog.buffer_len, "cache_dtype": prog.cache_dtype,
                       "rounds_timed": args.chunks * args.rounds}


# --------------------------------------------------------------------------- one shape
def bound_ms(cfg: specjax.ModelConfig, buffer_len: int, bandwidth: float | None) -> dict:
    """Bytes one decode step reads (weights, the whole KV buffer) and the time they take at the peak
    bandwidth (``bound_ms`` None without one)."""
    w, kv = weight_bytes_read(cfg), kv_bytes(cfg, buffer_len, kv_cache_dtype(DTYPE))
    return {"weight_bytes": w, "kv_bytes": kv, "buffer_len": buffer_len,
            "bound_ms": None if bandwidth is None else (w + kv) / bandwidth * 1e3}


class ShapeRun:
    """One shape's JSON section (``report.doc["shapes"][name]``), its random target and drafter (built
    on first use, released after each pass so only one shape occupies the device at a time; the
    same seed rebuilds the same weights) and its measurement steps."""

    def __init__(self, report: Report, name: str, shape: dict, args):
        self.report, self.name, self.args = report, name, args
        self.cfg = specjax.ModelConfig.from_hf_config(shape["config"])
        self.model, self.eagle = None, None
        n = llama.num_params(self.cfg)
        self.sec = report.doc["shapes"][name] = {
            "source": shape["source"], "config": shape["config"], "params": n,
            "weight_bytes": n * jnp.dtype(DTYPE).itemsize, "status": "running",
            "drafter": drafter_config(self.cfg).to_json(),
            "compile_s": {}, "forward_ms": {}, "verification_curve": {}, "decode": {}, "speculative": {}}
        need = memory_need(self.cfg, decode_buffer_len(args.prompt_len, args.max_new_tokens, max(KS) - 1))
        free = free_memory_bytes()
        if free is not None and need > free:
            self.sec["status"] = f"skipped: needs about {need / 1e9:.1f} GB, the device has {free / 1e9:.1f} GB free"
            report.record(f"{name}: {self.sec['status']}")

    @property
    def active(self) -> bool:
        """Still measuring: not skipped, failed or complete."""
        return self.sec["status"] == "running"

    def target(self) -> specjax.Model:
        """The random target (built now if released; ``init_s`` is the first build's seconds)."""
        if self.model is None:
            t0 = time.perf_counter()
            self.model = random_target(self.name, self.cfg, self.args.seed)
            if "init_s" not in self.sec:
                self.sec["init_s"] = time.perf_counter() - t0
                self.report.record(f"{self.name}: random {DTYPE} weights on {jax.devices()[0].device_kind}, "
                                   f"{self.sec['weight_bytes'] / 1e9:.3f} GB in {self.sec['init_s']:.1f} s")
        return self.model

    def drafter(self) -> eagle.EagleDrafter:
        """The random drafter of :func:`random_drafter` (built now if released)."""
        if self.eagle is None:
            self.eagle = random_drafter(self.target(), self.args.seed + 1)
        return self.eagle

    def release(self) -> None:
        """Drop the target and drafter, and JAX's caches of traced programs (whose static arguments,
        the decode Programs, hold the drafter and its weights)."""
        self.model, self.eagle = None, None
        jax.clear_caches()
        gc.collect()

    def forward(self, k: int) -> None:
        """forward[k] and v(k); for k = 1 also the step against the bandwidth bound (``ar_step``)."""
        sec, a = self.sec, self.args
        buf = decode_buffer_len(a.prompt_len, a.max_new_tokens, max(KS) - 1)
        sec["compile_s"][f"forward_k{k}"], run = compile_forward(self.target(), k, buf,
                                                                 a.prompt_len + a.max_new_tokens // 2)
        ms = sec["forward_ms"][str(k)] = median_ms(run, a.warmup, a.repeats)
        v = sec["verification_curve"][str(k)] = ms / sec["forward_ms"]["1"]
        self.report.record(f"{self.name} forward k={k}: {ms:.3f} ms = {v:.2f} one-token calls "
                           f"(compile {sec['compile_s'][f'forward_k{k}']:.1f} s)")
        if k == 1:
            step = bound_ms(self.cfg, buf, self.report.doc["machine"]["bandwidth"]["bytes_per_s"])
            ratio = None if step["bound_ms"] is None else ms / step["bound_ms"]
            sec["ar_step"] = {"forward_ms": ms, "forward_bound": step, "ratio_forward": ratio}
            self.report.record(f"{self.name} AR step (forward) vs the bandwidth bound: "
                               + ("no bound (see machine.bandwidth)" if ratio is None
                                  else f"{ratio:.2f}x the bound of {step['bound_ms']:.3f} ms"))

    def autoregressive(self) -> None:
        """The decode loop's autoregressive round (``decode.ar``) and its bandwidth ratio."""
        sec = self.sec
        sec["compile_s"]["decode_ar"], ar = time_decode(self.target(), None, 0, self.args)
        sec["decode"]["ar"] = ar
        step = bound_ms(self.cfg, ar["buffer_len"], self.report.doc["machine"]["bandwidth"]["bytes_per_s"])
        sec["ar_step"].update(loop_ms=ar["round_ms"], loop_bound=step, tokens_per_s=1e3 / ar["round_ms"],
                              ratio_loop=None if step["bound_ms"] is None else ar["round_ms"] / step["bound_ms"])
        self.report.record(f"{self.name} decode loop AR: {ar['round_ms']:.3f} ms/round "
                           f"(compile {sec['compile_s']['decode_ar']:.1f} s, prefill {ar['prefill_s']:.2f} s)")

    def speculative(self, g: int) -> None:
        """The speculative round at γ = ``g`` (``decode[g]``) and its predicted speedup (``speculative[g]``)."""
        sec = self.sec
        sec["compile_s"][f"decode_gamma{g}"], sec["decode"][str(g)] = time_decode(self.target(), self.drafter(),
                                                                                  g, self.args)
        t_ar, t_round, tau = sec["decode"]["ar"]["round_ms"], sec["decode"][str(g)]["round_ms"], TAU_REPLAYED[g]
        sec["speculative"][str(g)] = {"round_ms": t_round, "round_in_ar_rounds": t_round / t_ar,
                                      "tau_replayed": tau, "predicted_speedup": tau * t_ar / t_round,
                                      "predicted_tokens_per_s": tau * 1e3 / t_round}
        self.report.record(f"{self.name} decode loop γ={g}: {t_round:.3f} ms/round = {t_round / t_ar:.2f} AR "
                           f"rounds; predicted speedup with replayed τ {tau}: {tau * t_ar / t_round:.2f}x "
                           f"(compile {sec['compile_s'][f'decode_gamma{g}']:.1f} s)")


def plan(gammas: list[int]) -> list[list[tuple[str, str, tuple]]]:
    """The measurement passes, each a list of ``(label, ShapeRun method, args)`` run for every shape
    before the next pass, so a run cut by the budget has the essential figures of every shape: first
    the one-token call, the AR round and one speculative round (γ 2 when asked, the default pair's),
    then the rest of the verification curve, then the other γ."""
    first = 2 if 2 in gammas else gammas[0]
    return [
        [("forward k=1", "forward", (1,)), ("decode loop AR", "autoregressive", ()),
         (f"decode loop γ={first}", "speculative", (first,))],
        [(f"forward k={k}", "forward", (k,)) for k in KS[1:]],
        [(f"decode loop γ={g}", "speculative", (g,)) for g in gammas if g != first],
    ]


def run_passes(report: Report, runs: list[ShapeRun], gammas: list[int]) -> int:
    """Every pass of :func:`plan` over the active shapes; returns how many shapes failed (a failure,
    e.g. the device running out of memory, is recorded as the shape's status and ends that shape).

    Raises:
      OutOfBudget: before a step, once the time budget has run out.
    """
    failed = 0
    for steps in plan(gammas):
        for run in runs:
            try:
                for label, method, step_args in steps:
                    if run.active:
                        report.check_budget(f"{run.name} {label}")
                        getattr(run, method)(*step_args)
            except OutOfBudget:
                raise
            except Exception as e:  # recorded; the next shape may still fit and run
                failed += 1
                run.sec["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:500]}"
                report.record(f"{run.name}: {run.sec['status']}")
            finally:
                run.release()
    for run in runs:
        if run.active:
            run.sec["status"] = "complete"
    return failed


# --------------------------------------------------------------------------- main
def _bandwidth_arg(text: str) -> float | str:
    if text == "measure":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of TB/s; give e.g. 4.8, or 'measure'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the bandwidth must be > 0 TB/s")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, with the full or smoke presets (:data:`FULL`, :data:`SMOKE`) for those not given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results JSON (rewritten after every measurement)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="one tiny shape on CPU, few repeats, γ 2 (CI: keeps the script from rotting)")
    p.add_argument("--shapes", nargs="+", help=f"shapes to run (default: all of {', '.join(SHAPES)})")
    p.add_argument("--gammas", nargs="+", type=int, choices=sorted(TAU_REPLAYED),
                   help=f"speculative γ values, those with a replayed τ (default {FULL['gammas']}; "
                   f"smoke {SMOKE['gammas']})")
    p.add_argument("--bandwidth", type=_bandwidth_arg,
                   help="peak memory bandwidth in TB/s, or 'measure' (a jitted sum over 1 GiB on the device: "
                   "a CPU's achievable floor); default: by device kind")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="the targets' weight format (default %(default)s; float32: a CPU's memory floor)")
    p.add_argument("--budget-s", type=float, help="stop before the next measurement after this many seconds "
                   f"(default {FULL['budget_s']:.0f}; smoke {SMOKE['budget_s']:.0f})")
    p.add_argument("--compile-cache", default=os.path.join(tempfile.gettempdir(), "specjax-device-benchmark-cache"),
                   help="persistent JAX compilation cache directory, or 'none' (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {FULL['prompt_len']})")
    p.add_argument("--max-new-tokens", type=int, help=f"new tokens a row may take; sizes the KV buffer "
                   f"(default {FULL['max_new_tokens']})")
    p.add_argument("--repeats", type=int, help=f"timed calls per forward (default {FULL['repeats']})")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.cpu_smoke else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    names = SMOKE_SHAPES if a.cpu_smoke else SHAPES
    a.shapes = a.shapes or list(names)
    unknown = [s for s in a.shapes if s not in names]
    if unknown:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(names)}")
    if a.max_new_tokens < (1 + a.chunks * a.rounds) * (max(a.gammas) + 1):
        p.error(f"--max-new-tokens must be >= {(1 + a.chunks * a.rounds) * (max(a.gammas) + 1)} "
                f"({1 + a.chunks * a.rounds} rounds of up to γ + 1 tokens)")
    return a


def start_document(args, argv: list[str]) -> dict:
    """The document's header: the command line ``argv``, settings, machine, the replayed τ and the drafter."""
    cache = None if args.compile_cache == "none" else {
        "dir": args.compile_cache,
        "entries_at_start": len(os.listdir(args.compile_cache)) if os.path.isdir(args.compile_cache) else 0}
    return {
        "benchmark": "benchmarks/device.py", "status": "running",
        "command": " ".join(["benchmarks/device.py", *argv]),
        "settings": {"mode": "cpu-smoke" if args.cpu_smoke else "full", "dtype": DTYPE, "batch": BATCH,
                     "kv_cache_dtype": kv_cache_dtype(DTYPE), "prompt_len": args.prompt_len,
                     "max_new_tokens": args.max_new_tokens,
                     "forward_buffer_len": decode_buffer_len(args.prompt_len, args.max_new_tokens, max(KS) - 1),
                     "ks": list(KS), "gammas": list(args.gammas),
                     "repeats": args.repeats, "warmup": args.warmup, "chunks": args.chunks,
                     "rounds_per_chunk": args.rounds, "budget_s": args.budget_s, "seed": args.seed,
                     "weights": "random (jax.random on the device), N(0, 0.02); norms 1",
                     "compile_cache": cache},
        "machine": machine_section(args),
        "tau_replayed": {"note": "tau is REPLAYED from a CPU measurement, not measured on this device: random "
                                 "weights accept nothing meaningful. predicted_speedup = tau * t_AR / t_round.",
                         "source": TAU_SOURCE, "by_gamma": {str(g): TAU_REPLAYED[g] for g in args.gammas}},
        "drafter_note": ("random weights with the shipped EAGLE-3 drafter's architecture, scaled to each target "
                         "(shapes[*].drafter); the replayed tau is the 135M pair's, a trained drafter for a larger "
                         "target would have its own"),
        "shapes": {},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 0 when complete or stopped by the budget, 1 when a shape failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    global DTYPE
    DTYPE = args.dtype  # read by every function below when it runs
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    if args.compile_cache != "none":
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    report = Report(args.out, args.budget_s, start_document(args, argv))
    m = report.doc["machine"]
    report.record(f"{m['backend']} {m['device_kind']}, jax {m['jax']}; bandwidth: "
                  f"{m['bandwidth']['source'] or m['bandwidth']['note']}")
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    failed = 0
    try:
        runs = [ShapeRun(report, name, shapes[name], args) for name in args.shapes]
        failed = run_passes(report, runs, args.gammas)
        report.doc["status"] = "complete" if not failed else f"complete, {failed} shape(s) failed"
    except OutOfBudget as e:
        report.doc["status"] = f"stopped: the time budget of {args.budget_s:.0f} s ran out before {e}"
        for sec in report.doc["shapes"].values():
            if sec["status"] == "running":
                sec["status"] = "incomplete (time budget)"
    report.record(f"status: {report.doc['status']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
