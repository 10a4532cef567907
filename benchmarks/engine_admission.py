"""What a long prompt's admission costs the requests already running (issue 31's target: p99
inter-token latency of running streams while a 2,000-token prompt is admitted ≤ 3× its median):
3 greedy streams decode 160 tokens each on the default model (float32, 4 slots, no drafter); after
their 8th update a ≈ 2,000-token prompt is submitted. The whole prompt in one step (turn 13), one
prefill chunk (512 tokens) per engine step (turns 14–19) and one ``ADMIT_TOKENS`` piece (64 tokens) per
step (now), side by side in one run.

    python benchmarks/engine_admission.py [--prompt-tokens 2000] [--dtype float32] [--skip 0]

Prints one JSON line per mode: the running streams' per-token latency between updates (median, p99,
max, ms) over the whole run and the seconds until the long request's first token; and the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from specjax.api import encode_prompts
from specjax.cli.common import enable_compilation_cache
from specjax.eval.hostcache import host_fingerprint
from specjax.io.loading import load_model
from specjax.runtime import engine as engine_mod
from specjax.runtime.decoder import Decoder
from specjax.runtime.engine import Engine, EngineRequest


def _run(engine, short, long_prompt, new):
    ids = {engine.submit(EngineRequest(p, max_new_tokens=new, ignore_eos=True)): i for i, p in enumerate(short)}
    last, gaps, updates, t_long, first_long = {}, [], 0, None, None
    while not engine.idle:
        for u in engine.step():
            now = time.perf_counter()
            if u.request_id in ids and u.tokens:
                i = ids[u.request_id]
                if i in last:
                    gaps.append((now - last[i]) / len(u.tokens))
                last[i] = now
            elif u.tokens and first_long is None:
                first_long = now - t_long
        updates += 1
        if updates == 8 and t_long is None:
            engine.submit(EngineRequest(long_prompt, max_new_tokens=8))
            t_long = time.perf_counter()
    q = sorted(gaps)
    return dict(itl_median_ms=round(1e3 * statistics.median(q), 1), itl_p99_ms=round(1e3 * q[int(.99 * (len(q) - 1))], 1),
                itl_max_ms=round(1e3 * q[-1], 1), p99_over_median=round(q[int(.99 * (len(q) - 1))] / statistics.median(q), 2),
                long_first_token_s=round(first_long, 2) if first_long is not None else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip", type=int, default=0, help="skip the first SKIP modes (the older ones)")
    args = ap.parse_args()
    enable_compilation_cache()
    target = load_model(dtype=args.dtype)
    short = encode_prompts(target, ["Write a haiku about the sea.", "Name three rivers.", "What is 2 + 2?"], chat=True)
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, target.config.vocab_size - 100, size=args.prompt_tokens).tolist()
    print(json.dumps({"host": host_fingerprint()}))
    chunk, piece = engine_mod.PREFILL_CHUNK, engine_mod.ADMIT_TOKENS
    modes = (("whole prompt in one step (turn 13)", 10 ** 9, 10 ** 9),
             ("one 512-token chunk per step (turns 14-19)", chunk, chunk),
             (f"{piece}-token pieces while others run, one per step per waiting request (now)", chunk, piece))
    for mode, limit, admit in modes[args.skip:]:
        engine_mod.PREFILL_CHUNK, engine_mod.ADMIT_TOKENS = limit, admit
        eng = Engine(Decoder(target), slots=4, max_context=2304, max_logprobs=None)
        eng.warmup()
        _run(eng, short, long_prompt, 64)  # compile the long prompt's programs (it arrives after 8 updates)
        res = _run(eng, short, long_prompt, args.new)
        print(json.dumps(dict(mode=mode, prompt_tokens=args.prompt_tokens, dtype=args.dtype, **res)), flush=True)
    engine_mod.PREFILL_CHUNK, engine_mod.ADMIT_TOKENS = chunk, piece


if __name__ == "__main__":
    main()
