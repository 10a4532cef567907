#!/usr/bin/env python
"""Foundation targets of specjax on this machine, measured in one run:

1. memory read bandwidth (numpy: sum over a 512 MB float32 array, median of several) and the
   memory-bound floor per decode step = float32 weight bytes ÷ bandwidth; specjax's time per
   token at batch 1 (autoregressive, float32, EOS ignored) and its ratio to the floor
   (goal ≤ 1.25×);
2. tokens/s of specjax vs transformers (float32, plain greedy ``generate``) on the same model,
   prompts and token count at batch 1 and 8 (goal ≥ 2×);
3. peak host memory (max RSS) of ``specjax generate`` on the default model, run as a child
   process, ÷ the float32 weight bytes (goal ≤ 2×).

Prints a markdown table and writes the JSON (``--out``, never overwriting without ``--force``).

    python benchmarks/baseline.py --prompts question.jsonl --out results/baseline.json

Prompts: the first prompt of each category in turn (round-robin, file order) until
``--num-prompts``; the chat template is applied, as in ``specjax bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from specjax.eval.bench import json_default, check_out_path, machine_info, run_bench, write_json  # noqa: E402
from specjax.runtime.settings import DecodeSettings  # noqa: E402

GOAL_FLOOR_RATIO = 1.25
GOAL_VS_TRANSFORMERS = 2.0
GOAL_MEMORY_RATIO = 2.0

# Runs the command given in argv in a child and prints the child's peak RSS (KiB on Linux):
# a separate wrapper so that no other child of this script is counted.
_MAXRSS_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, rc)\n"
)


def measure_bandwidth(mb: int = 512, repeats: int = 7) -> dict:
    """Read bandwidth of ``numpy.sum`` over an ``mb``-MB float32 array (median of ``repeats``)."""
    import numpy as np

    a = np.ones(mb * 2**20 // 4, np.float32)  # touched: every page is resident
    a.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"array_bytes": a.nbytes, "repeats": repeats, "median_s": med, "gb_s": a.nbytes / med / 1e9,
            "all_s": times}


def measure_peak_memory(max_new_tokens: int = 32) -> dict:
    """Peak RSS of ``specjax generate`` (default model, float32) as a child process."""
    cmd = [sys.executable, "-m", "specjax.cli", "generate", "--chat", "--ignore-eos",
           "--max-new-tokens", str(max_new_tokens), "Explain speculative decoding in one paragraph."]
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MAXRSS_WRAPPER, *cmd], capture_output=True, text=True, check=True)
    kib, rc = out.stdout.split()
    if int(rc) != 0:
        raise RuntimeError(f"specjax generate failed (exit {rc}): {' '.join(cmd)}")
    return {"command": "specjax " + " ".join(cmd[3:]), "peak_rss_bytes": int(kib) * 1024,
            "seconds": time.perf_counter() - t0}


def pick_prompts(prompts: list[dict], n: int) -> list[dict]:
    """Round-robin over categories (file order) until ``n`` prompts."""
    by_cat: dict[str, list[dict]] = {}
    for p in prompts:
        by_cat.setdefault(p["category"], []).append(p)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out.extend(v[i] for v in by_cat.values() if i < len(v))
        i += 1
    out = out[:n]
    # one "category" so that bench batches may span the whole selection
    return [dict(p, category="baseline", source_category=p["category"]) for p in out]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, metavar="FILE", help="JSONL prompts (e.g. Spec-Bench question.jsonl)")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts (round-robin over categories; default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bandwidth-mb", type=int, default=512)
    ap.add_argument("--bandwidth-repeats", type=int, default=7)
    ap.add_argument("--memory-tokens", type=int, default=32, help="new tokens of the peak-memory run")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=None, metavar="FILE")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the JSON on stdout (no table)")
    args = ap.parse_args(argv)

    from specjax.io.prompts import read_prompts
    from specjax.cli import UsageError

    try:
        check_out_path(args.out, args.force)
        prompts = pick_prompts(read_prompts(args.prompts), args.num_prompts)
    except (UsageError, ValueError) as e:
        print(f"baseline: error: {e}", file=sys.stderr)
        return 2
    log = lambda m: print(f"baseline: {m}", file=sys.stderr, flush=True)  # noqa: E731
    res: dict = {"config": {"prompts_file": os.path.abspath(args.prompts), "num_prompts": len(prompts),
                            "question_ids": [p["question_id"] for p in prompts],
                            "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
                            "dtype": "float32", "ignore_eos": True, "chat": True, "machine": machine_info()}}

    if not args.skip_memory:
        log("peak memory of `specjax generate` (child process)")
        res["memory"] = measure_peak_memory(args.memory_tokens)
    log(f"memory bandwidth (numpy sum over {args.bandwidth_mb} MB)")
    res["bandwidth"] = measure_bandwidth(args.bandwidth_mb, args.bandwidth_repeats)

    runs: dict = {}
    for b in args.batch_sizes:
        log(f"specjax autoregressive, batch {b}")
        settings = DecodeSettings(batch_size=b, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        runs[f"specjax_b{b}"] = run_bench(prompts, settings, drafts=[], gammas=[], chat=True, log=log)
    if not args.skip_transformers:
        import peers_transformers as peers

        for b in args.batch_sizes:
            log(f"transformers greedy, batch {b}")
            pargs = peers.build_parser().parse_args(
                ["--prompts", args.prompts, "--methods", "ar", "--batch-size", str(b),
                 "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos"])
            runs[f"transformers_b{b}"] = peers.run_peers(prompts, pargs)
    res["runs"] = runs

    # ---- targets
    wbytes = runs[f"specjax_b{args.batch_sizes[0]}"]["config"]["weight_bytes"]["float32"]["target"]
    bw = res["bandwidth"]["gb_s"] * 1e9
    floor_ms = wbytes / bw * 1e3
    rows = [("memory read bandwidth (numpy sum)", f"{bw / 1e9:.1f} GB/s", "", ""),
            ("float32 weight bytes", f"{wbytes / 1e6:.0f} MB", "", ""),
            ("memory-bound floor per decode step (weights ÷ bandwidth)", f"{floor_ms:.1f} ms", "", "")]
    targets: dict = {"weight_bytes": wbytes, "bandwidth_gb_s": bw / 1e9, "floor_ms_per_token": floor_ms}
    if 1 in args.batch_sizes:
        o = runs["specjax_b1"]["methods"]["ar"]["overall"]
        ms = o["decode_s"] / o["new_tokens"] * 1e3
        ratio = ms / floor_ms
        targets["specjax_ms_per_token_b1"] = ms
        targets["floor_ratio"] = ratio
        targets["floor_ratio_met"] = ratio <= GOAL_FLOOR_RATIO
        rows += [("specjax time per token, batch 1", f"{ms:.1f} ms", "", ""),
                 ("… ÷ memory-bound floor", f"{ratio:.2f}×", f"≤ {GOAL_FLOOR_RATIO}×", "yes" if ratio <= GOAL_FLOOR_RATIO else "no")]
    for b in args.batch_sizes:
        sj = runs[f"specjax_b{b}"]["methods"]["ar"]["overall"]["tokens_per_s"]
        targets[f"specjax_tokens_per_s_b{b}"] = sj
        if f"transformers_b{b}" in runs:
            tf = runs[f"transformers_b{b}"]["methods"]["ar"]["overall"]["tokens_per_s"]
            r = sj / tf if tf else None
            targets[f"transformers_tokens_per_s_b{b}"] = tf
            targets[f"vs_transformers_b{b}"] = r
            rows.append((f"specjax ÷ transformers tokens/s, batch {b}", f"{sj:.1f} ÷ {tf:.1f} = {r:.2f}×",
                         f"≥ {GOAL_VS_TRANSFORMERS}×", "yes" if r and r >= GOAL_VS_TRANSFORMERS else "no"))
        else:
            rows.append((f"specjax tokens/s, batch {b}", f"{sj:.1f}", "", ""))
    if "memory" in res:
        peak = res["memory"]["peak_rss_bytes"]
        r = peak / wbytes
        targets.update(peak_rss_bytes=peak, memory_ratio=r, memory_ratio_met=r <= GOAL_MEMORY_RATIO)
        rows.append(("peak RSS of `specjax generate` ÷ float32 weights", f"{peak / 1e6:.0f} MB ÷ {wbytes / 1e6:.0f} MB = {r:.2f}×",
                     f"≤ {GOAL_MEMORY_RATIO}×", "yes" if r <= GOAL_MEMORY_RATIO else "no"))
    res["targets"] = targets
    table = "\n".join(["| quantity | measured | goal | met |", "|---|---:|---:|:---:|"]
                      + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows])
    res["table"] = table
    if args.out:
        write_json(args.out, res, args.force)
        log(f"wrote {args.out}")
    print(json.dumps(res, default=json_default) if args.json else table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
