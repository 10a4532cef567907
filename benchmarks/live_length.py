"""Decode cost against the buffer size (issue 29: "decode slows with --max-new-tokens"): the first
``--rounds`` autoregressive rounds of one chat prompt, with the buffer sized for
``--max-new-tokens`` of 128 .. 4,096, attention views on (``Decoder.run``'s ladder, the default)
and off (the whole buffer every round, as before), side by side in one run.

    python benchmarks/live_length.py [--dtype float32] [--rounds 128] [--max-new 128 1024 4096]

Prints one JSON line per (max_new_tokens, views) with decode tokens/s (median of ``--repeats``
warm runs, compile excluded) and the host's CPU flags. Where the attention is the CPU kernel (one CPU
device; ``host.attention`` in the first line), the loop runs no views (``decoder.attention_views``): both
rows are then the same program; ``SPECJAX_ATTENTION=xla`` compares the blocked attention's views.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from specjax.api import encode_prompts
from specjax.cli.common import enable_compilation_cache
from specjax.eval.hostcache import host_fingerprint
from specjax.io.loading import load_model
from specjax.runtime import decoder as decoder_mod
from specjax.runtime.decoder import Decoder


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=128)
    ap.add_argument("--max-new", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    enable_compilation_cache()
    target = load_model(dtype=args.dtype)
    prompt = encode_prompts(target, ["Write a haiku about the sea."], chat=True)
    print(json.dumps({"host": host_fingerprint()}))
    default_min = decoder_mod.KV_VIEW_MIN
    for n in args.max_new:
        for views in (False, True):
            decoder_mod.KV_VIEW_MIN = default_min if views else 10 ** 9
            dec = Decoder(target)
            times = []
            for _ in range(args.repeats + 1):  # the first run compiles
                prog, st, _, _ = dec.start(prompt, max_new_tokens=n, eos_ids=[])
                t0 = time.perf_counter()
                st, c, _ = dec.run(prog, st, args.rounds)
                jax.block_until_ready(st)
                times.append(time.perf_counter() - t0 - c)
            s = statistics.median(times[1:])
            print(json.dumps(dict(max_new_tokens=n, buffer=prog.buffer_len, views=views, rounds=args.rounds,
                                  decode_tokens_per_s=round(args.rounds / s, 1), dtype=args.dtype)), flush=True)
    decoder_mod.KV_VIEW_MIN = default_min


if __name__ == "__main__":
    main()
