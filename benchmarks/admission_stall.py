"""Running streams while a long prompt is admitted (issue 31's target: p99 inter-token latency of the
running streams while a 2,000-token prompt is admitted ≤ 3× their median).

The engine without HTTP (``specjax serve``'s decode side): ``--streams`` greedy requests decode
(``--new`` tokens each, EOS ignored); after ``--after`` engine steps one request with a
``--long``-token prompt (Spec-Bench questions joined, raw text, cut to that many tokens) is submitted.
The engine admits it one prefill chunk (``ADMIT_TOKENS``) per step between chunks of rounds. For the
running streams, every update's seconds per token (as ``engine_load.py``'s ITL) is recorded, and those
that fall between the long prompt's submission and its first token are reported apart. A first,
unreported pass compiles every program the timed one meets.

    python benchmarks/admission_stall.py [--streams 2] [--long 2000] [--new 160] [--method off|spec]
        [--dtype float32] [--slots 4] [--max-context 4096]

Prints one JSON line per pass with the host's CPU flags first.
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
from specjax.runtime.engine import ADMIT_TOKENS, Engine, EngineRequest

QUESTIONS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench", "question.jsonl")


def _texts():
    return [json.loads(line)["turns"][0] for line in open(QUESTIONS, encoding="utf-8")]


def _long_prompt(target, n):
    ids = []
    for t in _texts():
        ids += encode_prompts(target, [t], chat=False)[0]
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the questions hold only {len(ids)} tokens; ask for --long {len(ids)} or less")


def _pass(eng, streams, long_prompt, new, after):
    ids = {eng.submit(EngineRequest(p, max_new_tokens=new, ignore_eos=True)): i for i, p in enumerate(streams)}
    last, normal, during = {}, [], []
    long_id, t_submit, t_first, steps = None, None, None, 0
    while not eng.idle:
        if steps == after:
            long_id = eng.submit(EngineRequest(long_prompt, max_new_tokens=16, ignore_eos=True))
            t_submit = time.perf_counter()
        for u in eng.step():
            now = time.perf_counter()
            if u.request_id == long_id:
                if u.tokens and t_first is None:
                    t_first = now
                continue
            if u.tokens:
                if u.request_id in last:
                    per_token = (now - last[u.request_id]) / len(u.tokens)
                    (during if t_submit is not None and t_first is None else normal).append(per_token)
                last[u.request_id] = now
        steps += 1
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    both = normal + during
    med = statistics.median(both)
    return dict(itl_p50_ms=round(1e3 * med, 1), itl_p99_ms=round(1e3 * q(both, .99), 1),
                p99_over_median=round(q(both, .99) / med, 2), itl_max_ms=round(1e3 * max(both), 1),
                admission_s=round(t_first - t_submit, 2) if t_first else None,
                during_admission_p50_ms=round(1e3 * statistics.median(during), 1) if during else None,
                during_admission_max_ms=round(1e3 * max(during), 1) if during else None,
                updates=len(both), updates_during_admission=len(during))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--after", type=int, default=4, help="engine steps before the long prompt arrives")
    ap.add_argument("--method", default="off", choices=["off", "spec"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--rounds-per-chunk", type=int, default=4)
    args = ap.parse_args()
    enable_compilation_cache()
    target = load_model(dtype=args.dtype)
    dec = Decoder(target) if args.method == "off" else Decoder(target, load_drafter("default", target, args.dtype), 2)
    print(json.dumps({"host": host_fingerprint()}), flush=True)
    streams = encode_prompts(target, _texts()[: args.streams], chat=True)
    long_prompt = _long_prompt(target, args.long)
    eng = Engine(dec, slots=args.slots, max_context=args.max_context, rounds_per_chunk=args.rounds_per_chunk,
                 max_logprobs=None)
    warm = eng.warmup()
    for timed in (False, True):
        res = _pass(eng, streams, long_prompt, args.new, args.after)
        if timed:
            print(json.dumps(dict(streams=args.streams, long=args.long, new=args.new, method=args.method,
                                  dtype=args.dtype, slots=args.slots, admit_tokens_per_step=ADMIT_TOKENS,
                                  warmup_s=round(warm, 1), **res)), flush=True)


if __name__ == "__main__":
    main()
