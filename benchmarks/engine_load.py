"""Continuous batching under load (issue 31's targets, the engine without HTTP): total tokens/s,
time to first token and inter-update latency at 1, 8 and 32 concurrent clients, with the default
pair's three ways of serving side by side in one run: off (the target alone), always (speculate every
round: the default pair, SmolLM2-135M-Instruct + its shipped drafter, γ 2) and auto (the engine's
measured choice between speculative and plain chunks, ``specjax serve``'s default).

    python benchmarks/engine_load.py [--concurrency 1 8 32] [--slots 8] [--requests-per-client 2] [--new 64]
        [--requests N] [--dtype float32] [--max-context 1024] [--ladder on off]

Clients are closed loops: each keeps one request in flight and submits its next when the last one
finishes, so at most ``concurrency`` requests are in the engine (the rest of a client's requests wait
on the client, not in the queue). Requests are Spec-Bench questions
(../shared/data/spec_bench/question.jsonl, chat template), greedy. ``--slots``: the engine's slots
(``serve --max-batch``; default: the concurrency). Every program is compiled (and every prompt bucket
prefilled once) before the timed run. Prints one JSON line per (concurrency, method) and the host's
CPU flags.
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


def _run(engine, prompts, new, clients=None):
    """Serve ``prompts`` through ``clients`` closed-loop clients (default: all at once)."""
    clients = len(prompts) if clients is None else clients
    t0 = time.perf_counter()
    first, last, gaps, total = {}, {}, [], 0
    ids, start, pending = {}, {}, list(enumerate(prompts))

    def submit():
        i, p = pending.pop(0)
        ids[engine.submit(EngineRequest(p, max_new_tokens=new, seed=0))] = i
        start[i] = time.perf_counter()

    for _ in range(min(clients, len(pending))):
        submit()
    while not engine.idle or pending:
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
            if u.finish_reason and pending:
                submit()
    wall = time.perf_counter() - t0
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
    return dict(tokens=total, seconds=round(wall, 2), tokens_per_s=round(total / wall, 1),
                ttft_p50_s=round(statistics.median(first.values()), 3), ttft_p99_s=round(q(list(first.values()), .99), 3),
                itl_p50_ms=round(1e3 * statistics.median(gaps), 1) if gaps else None,
                itl_p99_ms=round(1e3 * q(gaps, .99), 1) if gaps else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--slots", type=int, default=None, help="engine slots (default: the concurrency)")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None,
                    help="the same N requests at every concurrency (default: concurrency x --requests-per-client); "
                         "throughput ratios between concurrencies compare like with like only with this")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--rounds-per-chunk", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["off", "always", "auto"])
    ap.add_argument("--ladder", nargs="+", default=["on"], choices=["on", "off"],
                    help="chunks on the fewest rows holding the running requests (on: the engine's default) or on "
                         "every slot (off); both: side by side")
    args = ap.parse_args()
    enable_compilation_cache()
    target = load_model(dtype=args.dtype)
    drafter = load_drafter("default", target, args.dtype)
    print(json.dumps({"host": host_fingerprint()}))
    for c in args.concurrency:
        slots = args.slots or c
        prompts = _prompts(target, args.requests or c * args.requests_per_client)
        for method, ladder in [(m, x) for m in args.methods for x in args.ladder]:
            dec = Decoder(target) if method == "off" else Decoder(target, drafter, gamma=2)
            eng = Engine(dec, slots=slots, max_context=args.max_context, rounds_per_chunk=args.rounds_per_chunk,
                         max_logprobs=None, speculation="auto" if method == "auto" else "always", ladder=ladder == "on")
            warm = eng.warmup(all_rows=True)
            _run(eng, prompts[: max(slots, 2)], 4)  # compile every prompt bucket the run meets
            _run(eng, prompts, 4)
            eng.chunks_by_rows.clear()
            res = _run(eng, prompts, args.new, clients=c)
            extra = {} if eng.auto is None else {"auto_rates": {str(k): v for k, v in eng.auto.summary().items()}}
            extra["chunks_by_rows"] = dict(eng.chunks_by_rows)
            print(json.dumps(dict(concurrency=c, slots=slots, method=method, ladder=ladder, requests=len(prompts), new=args.new,
                                  dtype=args.dtype, warmup_s=round(warm, 1), **res, **extra), default=str), flush=True)


if __name__ == "__main__":
    main()
