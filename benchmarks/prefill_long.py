"""Long-prompt prefill (issue 29): prefill seconds and peak host memory for prompts of about 1k, 2k, 4k
and 8k tokens on the default model, each in a fresh subprocess (so its VmHWM is that prompt's peak).

    python benchmarks/prefill_long.py [--dtype float32] [--lengths 1000 2000 4000 7900] [--whole-buffer]

The first output line is the host (CPU model, vector flags, cores, versions, load average); then one JSON
line per length: ``prefill_s`` (``Decoder.generate``'s prefill seconds, compile excluded), ``compile_s``,
``peak_rss_gb`` (the child's VmHWM, ``bench_io.peak_rss_bytes``: model, compile and prefill together), the child's wall seconds and
its first 8 greedy tokens (random prompt ids, seed 0; equal across versions means equal numerics).
``--whole-buffer``: every prefill chunk attends over the whole KV buffer (the prefill before issue 29's
masked-block skipping, ``specjax.runtime.prefill.SKIP_MASKED_KEYS = False``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(n: int, dtype: str, whole_buffer: bool) -> dict:
    import numpy as np

    from specjax.eval.bench_io import peak_rss_bytes
    from specjax.io.loading import load_model
    from specjax.runtime import prefill as prefill_mod
    from specjax.runtime.decoder import Decoder

    prefill_mod.SKIP_MASKED_KEYS = not whole_buffer
    target = load_model(dtype=dtype)
    prompt = np.random.default_rng(0).integers(3, target.config.vocab_size, size=n).tolist()
    res = Decoder(target).generate([prompt], max_new_tokens=8, eos_ids=[])
    return dict(prompt_tokens=n, dtype=dtype, whole_buffer=whole_buffer, prefill_s=round(res.prefill_s, 2),
                compile_s=round(res.compile_s, 2),
                peak_rss_gb=round(peak_rss_bytes() / 1e9, 3),
                first_tokens=res.tokens[0][:8])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 7900])
    ap.add_argument("--whole-buffer", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.dtype, args.whole_buffer)), flush=True)
        return
    from specjax.eval.hostcache import host_fingerprint

    print(json.dumps({"host": host_fingerprint(), "loadavg_1m": os.getloadavg()[0]}), flush=True)
    for n in args.lengths:
        cmd = [sys.executable, __file__, "--child", str(n), "--dtype", args.dtype]
        t0 = time.perf_counter()
        out = subprocess.run(cmd + (["--whole-buffer"] if args.whole_buffer else []), capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"length {n} failed:\n{out.stderr[-3000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["child_wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
