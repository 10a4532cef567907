"""Loading at size (issue 29): peak host memory and wall time of :func:`specjax.io.loading.load_model`
on a random-weight Llama checkpoint of ≥ 1 B parameters.

    python benchmarks/load_size.py [--dir /tmp/specjax-load-size] [--keep] [--cases bf16 int8 bf16-mesh8]
        [--cache]

Writes (unless ``--dir`` already holds it) a Llama-3.2-1B-shaped checkpoint (hidden 2048, 16 layers,
intermediate 8192, 32 heads, 8 KV heads, vocabulary 128256, tied embeddings: 1.236 B parameters) in
bfloat16 safetensors, 5 shards with a ``model.safetensors.index.json`` and a ``config.json``
(2.47 GB; windows of a 64 MB pool of random bits from a seeded numpy generator, exponents fixed so
values are ±[2^-7, 2^-5); norms are ones).
Then loads it in a FRESH subprocess per case: ``bf16`` and ``int8`` on one device, ``bf16-mesh8`` and
``int8-mesh8`` on 8 virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
``mesh="data=1,model=8"``). The converted-weights cache is off (``SPECJAX_NO_CACHE=1``) unless
``--cache``, which adds ``bf16-store`` (a first load that writes the cache entry, to a temporary
cache directory) and ``bf16-cached`` (the load that reads it back).

What is measured, per case (one JSON line each):

* ``ru_maxrss_gb``: ``getrusage(RUSAGE_SELF).ru_maxrss``, the peak resident set. It counts the
  safetensors files' pages the loader touched through its memory map (file-backed, clean, dropped
  by the kernel under pressure without any write), so for a memory-mapped reader it overstates
  what the load costs by up to the checkpoint's size.
* ``peak_anon_gb``: the peak of ``RssAnon`` (``/proc/self/status``; anonymous memory: the heap,
  numpy and XLA buffers — on CPU the devices' memory too), sampled every 2 ms by a thread during
  the load; ``base_anon_gb`` the same before the load (Python, jax, the specjax imports);
  ``load_peak_gb`` = ``peak_anon_gb - base_anon_gb``: what the load itself needed at its peak.
* ``final_anon_gb``: ``RssAnon`` after the load (``load_final_gb`` minus the base; ``trimmed_anon_gb``
  after glibc's ``malloc_trim(0)``, i.e. without freed memory the allocator kept);
  ``model_gb``: the loaded parameters' bytes in their final format (``Model.num_bytes``);
  ``device_gb``: the bytes the devices hold (every addressable shard: replicated tensors count once
  per device); ``seconds``: wall time of ``load_model`` (to every array ready).

The gate (``tests/test_load_size.py``) uses ``load_peak_gb`` ≤ 1.5 × ``model_gb``: anonymous memory
is what a load takes from the machine (it must fit in RAM, or swap), whereas the file pages in
``ru_maxrss`` are page cache that the kernel reclaims at will. The sampler can miss a spike shorter
than 2 ms; every large allocation of the load lives longer than that (it is filled with data).

Prints the host's CPU model and flags first. ``--keep`` keeps the checkpoint (deleted otherwise
when this script wrote it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

LLAMA_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=128000,
                eos_token_id=128001)
CASES = {  # name: (dtype, virtual devices, mesh, cache)
    "bf16": ("bfloat16", 1, None, None), "int8": ("int8", 1, None, None),
    "bf16-mesh8": ("bfloat16", 8, "data=1,model=8", None), "int8-mesh8": ("int8", 8, "data=1,model=8", None),
    "bf16-store": ("bfloat16", 1, None, "store"), "bf16-cached": ("bfloat16", 1, None, "hit"),
}
_BF16_ONE = 0x3F80  # bfloat16 1.0


def hf_tensors(cfg: dict) -> list[tuple[str, tuple, str]]:
    """``[(HF name, shape, "normal" | "ones")]`` of a Llama checkpoint of ``cfg`` (a config.json dict)."""
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], d), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,), "ones"), (p + "self_attn.q_proj.weight", (q, d), "normal"),
                (p + "self_attn.k_proj.weight", (kv, d), "normal"), (p + "self_attn.v_proj.weight", (kv, d), "normal"),
                (p + "self_attn.o_proj.weight", (d, q), "normal"), (p + "post_attention_layernorm.weight", (d,), "ones"),
                (p + "mlp.gate_proj.weight", (f, d), "normal"), (p + "mlp.up_proj.weight", (f, d), "normal"),
                (p + "mlp.down_proj.weight", (d, f), "normal")]
    out.append(("model.norm.weight", (d,), "ones"))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (cfg["vocab_size"], d), "normal"))
    return out


POOL = 1 << 25  # random bfloat16 values drawn once (64 MB); tensors are windows of it, wrapping around


def _random_pool(seed: int) -> np.ndarray:
    """uint16 bfloat16 bits from a seeded generator: random signs and mantissas, exponent 120 or 121."""
    bits = np.frombuffer(np.random.default_rng(seed).bytes(2 * POOL), np.uint16).copy()
    bits &= 0x80FF
    bits |= 0x3C00
    return bits


def _write_tensor(fh, pool: np.ndarray, n: int, kind: str, start: int) -> int:
    """Write ``n`` bfloat16 values (ones, or the pool from ``start`` on, wrapping); returns the next start."""
    if kind == "ones":
        fh.write(np.full(n, _BF16_ONE, np.uint16).view(np.uint8))
        return start
    while n:
        k = min(n, POOL - start)
        fh.write(pool[start:start + k].view(np.uint8))
        n, start = n - k, (start + k) % POOL
    return (start + 7919) % POOL  # the next tensor starts elsewhere in the pool


def write_checkpoint(path: str, cfg: dict = LLAMA_1B, shards: int = 5, seed: int = 0) -> int:
    """Write a random bfloat16 Llama checkpoint of ``cfg`` into the new directory ``path``: ``shards``
    safetensors files of about equal size, their index and ``config.json``. The values are windows
    of one seeded 64 MB pool of random bfloat16 values (:func:`_random_pool`; norms are ones): a
    load test needs the bytes, not independent draws, and the write is then disk speed. Returns
    the number of parameters."""
    tensors = hf_tensors(cfg)
    total = sum(2 * int(np.prod(s)) for _, s, _ in tensors)
    groups, cur, size = [], [], 0
    for t in tensors:
        cur.append(t)
        size += 2 * int(np.prod(t[1]))
        if size >= total / shards and len(groups) < shards - 1:
            groups.append(cur)
            cur, size = [], 0
    groups.append(cur)
    os.makedirs(path)
    pool, start = _random_pool(seed), 0
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, _ in group:
            n = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(path, fname), "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for _, shape, kind in group:
                start = _write_tensor(fh, pool, int(np.prod(shape)), kind, start)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    return total // 2


# ---------------------------------------------------------------- the measured child
def _status() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024  # kB → bytes
    return out


class AnonSampler:
    """Peak ``RssAnon`` of this process, sampled every ``interval`` seconds by a daemon thread."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = _status()["RssAnon"]
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status()["RssAnon"])


def child(path: str, dtype: str, mesh: str | None) -> dict:
    """Load ``path`` in ``dtype`` (on ``mesh``) in this process; the measurements as a dict (GB = 1e9 B)."""
    import jax

    from specjax.io.loading import load_model

    jax.devices()  # the backend (and its threads) before the base line
    base = _status()["RssAnon"]
    t0 = time.perf_counter()
    with AnonSampler() as s:
        model = load_model(path, dtype=dtype, mesh=mesh)
        leaves = jax.tree_util.tree_leaves(model.params)
        jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    final = _status()["RssAnon"]
    trimmed = final
    try:  # what the allocator keeps of freed memory, handed back (glibc)
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = _status()["RssAnon"]
    except (OSError, AttributeError):
        pass
    held = sum(sh.data.nbytes for x in leaves for sh in x.addressable_shards)
    gb = lambda b: round(b / 1e9, 3)  # noqa: E731
    return dict(dtype=dtype, mesh=mesh, devices=jax.device_count(), seconds=round(seconds, 2),
                model_gb=gb(model.num_bytes), device_gb=gb(held), base_anon_gb=gb(base), peak_anon_gb=gb(s.peak),
                load_peak_gb=gb(s.peak - base), final_anon_gb=gb(final), load_final_gb=gb(final - base), trimmed_anon_gb=gb(trimmed),
                ru_maxrss_gb=gb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
                vm_hwm_gb=gb(_status()["VmHWM"]))


def run_case(path: str, case: str, cache_dir: str | None = None, timeout: float = 900) -> dict:
    """Run :func:`child` for ``case`` (a :data:`CASES` key) in a fresh Python; its dict plus ``case``.

    Raises:
      RuntimeError: the child failed (its stderr's tail in the message).
    """
    dtype, devices, mesh, cache = CASES[case]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.pop("SPECJAX_NO_CACHE", None)
    if cache is None:
        env["SPECJAX_NO_CACHE"] = "1"
    else:
        env["SPECJAX_CACHE_DIR"] = cache_dir
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--dtype", dtype] + (["--mesh", mesh] if mesh else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"case {case} failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return dict(case=case, **json.loads(r.stdout.strip().splitlines()[-1]))


def cpu_info() -> str:
    """The first CPU's model name and flags (``/proc/cpuinfo``)."""
    try:
        lines = open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
    except OSError:
        return "unknown"
    pick = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in lines if ":" in ln)}
    return f"{pick.get('model name', '?')}; {os.cpu_count()} cores; flags: {pick.get('flags', '?')}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "specjax-load-size"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cases", nargs="+", default=["bf16", "int8", "bf16-mesh8", "int8-mesh8"], choices=list(CASES))
    ap.add_argument("--cache", action="store_true", help="also bf16-store and bf16-cached")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mesh", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dtype, args.mesh)), flush=True)
        return
    print(f"# cpu: {cpu_info()}", flush=True)
    wrote = not os.path.exists(args.dir)
    if wrote:
        t0 = time.perf_counter()
        n = write_checkpoint(args.dir)
        print(json.dumps({"wrote": args.dir, "params": n, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    cache_dir = tempfile.mkdtemp(prefix="specjax-load-size-cache-")
    try:
        cases = list(args.cases) + (["bf16-store", "bf16-cached"] if args.cache else [])
        for case in cases:
            print(json.dumps(run_case(args.dir, case, cache_dir)), flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if wrote and not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
