"""Continuous batching under load (issue 31's targets, the engine without HTTP): total tokens/s,
time to first token and inter-update latency at 1, 8 (and more) concurrent requests, speculation
on (the default pair: SmolLM2-135M-Instruct + its shipped drafter, γ 2), off (the target alone) and
auto (speculation while at most ``--spec-max-running`` requests run), side by side in one run.

    python benchmarks/engine_load.py [--concurrency 1 8] [--requests-per-slot 2] [--new 64] [--dtype float32]
        [--max-context 1024] [--spec-max-running 1]

Requests are Spec-Bench questions (../shared/data/spec_bench/question.jsonl, chat template), greedy,
all submitted at once (so every slot stays busy while requests remain); the engine runs
``--slots`` = the concurrency. Every program is compiled (and every prompt bucket prefilled once)
before the timed run. Prints one JSON line per (concurrency, method) and the host's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from specjax.api import encode_prompts, load_drafter
from specjax.cli.common import enable_compilation_cache
from specjax.eval.hostcache import host_fingerprint
from specjax.io.loading import load_model
from specjax.runtime.decoder import Decoder
from specjax.runtime.engine import Engine, EngineRequest

QUESTIONS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench", "question.jsonl")


def _prompts(target, n):
    rows = [json.loads(line) for line in open(QUESTIONS, encoding="utf-8")]
    texts = [r["turns"][0] for r in rows[::max(1, len(rows) // n)]][:n]
    return encode_prompts(target, texts, chat=True)


def _run(engine, prompts, new):
    t0 = time.perf_counter()
    first, last, gaps, total = {}, {}, [], 0
    ids = {engine.submit(EngineRequest(p, max_new_tokens=new, seed=0)): i for i, p in enumerate(prompts)}
    start = {i: t0 for i in ids.values()}
    while not engine.idle:
        for u in engine.step():
            now = time.perf_counter()
            i = ids[u.request_id]
            if u.tokens:
                total += len(u.tokens)
                if i not in first:
                    first[i] = now - start[i]
                else:
                    gaps.append((now - last[i]) / len(u.tokens))
                last[i] = now
    wall = time.perf_counter() - t0
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
    return dict(tokens=total, seconds=round(wall, 2), tokens_per_s=round(total / wall, 1),
                ttft_p50_s=round(statistics.median(first.values()), 3), ttft_p99_s=round(q(list(first.values()), .99), 3),
                itl_p50_ms=round(1e3 * statistics.median(gaps), 1) if gaps else None,
                itl_p99_ms=round(1e3 * q(gaps, .99), 1) if gaps else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--rounds-per-chunk", type=int, default=4)
    ap.add_argument("--spec-max-running", type=int, default=1)
    args = ap.parse_args()
    enable_compilation_cache()
    target = load_model(dtype=args.dtype)
    drafter = load_drafter("default", target, args.dtype)
    print(json.dumps({"host": host_fingerprint()}))
    for c in args.concurrency:
        prompts = _prompts(target, c * args.requests_per_slot)
        methods = (("off", Decoder(target), None), ("spec γ2", Decoder(target, drafter, gamma=2), None),
                   (f"auto γ2 (spec while ≤ {args.spec_max_running} running)", Decoder(target, drafter, gamma=2),
                    args.spec_max_running))
        for method, dec, limit in methods:
            eng = Engine(dec, slots=c, max_context=args.max_context, rounds_per_chunk=args.rounds_per_chunk,
                         max_logprobs=None, spec_max_running=limit)
            warm = eng.warmup()
            _run(eng, prompts[: max(c, 2)], 4)  # compile every prompt bucket the run meets
            _run(eng, prompts, 4)
            res = _run(eng, prompts, args.new)
            print(json.dumps(dict(concurrency=c, method=method, requests=len(prompts), new=args.new,
                                  dtype=args.dtype, warmup_s=round(warm, 1), **res)), flush=True)


if __name__ == "__main__":
    main()
