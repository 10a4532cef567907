#!/usr/bin/env python
"""Plain greedy decoding with llama.cpp (``llama-cpp-python``) on the same GGUF file and the same
prompt token ids as ``specjax bench``, and the same prompts through specjax, interleaved per
prompt so a drift in machine speed hits both alike (issue 26's "÷ llama.cpp" target).

Per prompt: the prompt ids are made by specjax (its tokenizer and chat template, as ``specjax
bench``), then

* ``llama.cpp``: ``Llama.generate(ids, temp=0)`` (greedy), ``--max-new-tokens`` tokens, EOS
  ignored; ``tokens_per_s`` = (new tokens − 1) ÷ the seconds from the first new token to the last
  (the first token comes out of the prefill, so this is decoding alone, as specjax's figure);
* ``specjax <method>/<dtype>``: one :class:`specjax.Decoder` per method (``ar`` or
  ``<drafter>@γ<g>``), compiled before timing; ``tokens_per_s`` = new tokens ÷ decode seconds
  (``GenerationResult.decode_s``: the jitted decode loop after prefill).

Also reported: greedy agreement of each specjax method with llama.cpp (tokens identical up to
the first difference), since both multiply 4-bit weight blocks with 8-bit activation blocks.

    pip install --no-deps llama-cpp-python   # CMAKE_ARGS="-DGGML_NATIVE=ON": built for this CPU
    python benchmarks/peers_llamacpp.py --prompts ../shared/data/spec_bench/question.jsonl \\
        --split configs/spec_bench_split.json:eval --limit 1 --max-new-tokens 96 --threads 2 \\
        --specjax ar/int8 default@2/int8 ar/float32

llama-cpp-python is not a dependency of specjax (a peer to compare with).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True, metavar="FILE", help="JSONL prompts (as specjax bench)")
    p.add_argument("--split", default=None, metavar="FILE[:PART]", help="as specjax bench --split")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    p.add_argument("--specjax", nargs="*", default=["ar/int8"], metavar="METHOD/DTYPE",
                   help="specjax methods run on the same prompts: ar/<dtype> or <drafter>@<γ>/<dtype>")
    p.add_argument("--out", default=None, metavar="FILE", help="write the results as JSON")
    return p


def _llama_worker(conn, path: str, threads: int, n: int) -> None:
    """Child process: greedy llama.cpp decoding of each prompt received on ``conn``; sends back
    ``(tokens, decode tokens/s, seconds to the first token)``."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                verbose=False, seed=0)
    while True:
        prompt_ids = conn.recv()
        if prompt_ids is None:
            return
        out, t_first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(prompt_ids, temp=0.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(int(tok))
            if len(out) == n:
                break
        t1 = time.perf_counter()
        conn.send((out, (n - 1) / (t1 - t_first), t_first - t0))


def gguf_path() -> str:
    from specjax.io.loading import default_model_path

    return default_model_path()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("peers_llamacpp.py needs llama-cpp-python: "
                         "CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-deps llama-cpp-python") from None

    import specjax
    from specjax.api import encode_prompts
    from specjax.eval.bench_io import filter_split, machine_info, select_prompts
    from specjax.io.prompts import read_prompts

    prompts = select_prompts(filter_split(read_prompts(args.prompts), args.split), None, args.limit)
    path = gguf_path()
    n = args.max_new_tokens

    # specjax methods: one Decoder each, compiled on the first prompt before any timing
    decoders = {}
    targets = {}
    for spec in args.specjax:
        method, dtype = spec.split("/")
        if dtype not in targets:
            targets[dtype] = specjax.load_model(path, dtype=dtype)
        target = targets[dtype]
        if method == "ar":
            decoders[spec] = specjax.Decoder(target, None)
        else:
            name, gamma = method.split("@")
            drafter = specjax.load_drafter(name, target, dtype)
            decoders[spec] = specjax.Decoder(target, drafter, gamma=int(gamma))
    tok_model = next(iter(targets.values())) if targets else specjax.load_model(path, dtype="float32")
    ids = encode_prompts(tok_model, [p["prompt"] for p in prompts], True)

    # llama.cpp runs in a child process: in one process with XLA, its spinning worker threads
    # and XLA's share the two cores and some of its runs were 5-30x slower (measured)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_llama_worker, args=(child, path, args.threads, n), daemon=True)
    worker.start()

    def run_llama(prompt_ids):
        parent.send(list(map(int, prompt_ids)))
        return parent.recv()

    def run_specjax(dec, prompt_ids):
        res = dec.generate([prompt_ids], max_new_tokens=n, eos_ids=[])
        toks = [int(t) for t in res.tokens[0]]
        return toks, len(toks) / res.decode_s, res.prefill_s

    # warm-up: one untimed run of every method on the first prompt (compiles specjax's programs)
    run_llama(ids[0])
    for dec in decoders.values():
        run_specjax(dec, ids[0])

    rows = []
    for p, pid in zip(prompts, ids):
        row = {"question_id": p.get("question_id"), "category": p.get("category"), "prompt_tokens": len(pid)}
        # a pause before each timed run: the other runtime's worker threads (which spin for a while
        # after their work) must not share the two cores with the one being timed
        time.sleep(0.5)
        ref, tps, pre = run_llama(pid)
        row["llama.cpp"] = {"tokens_per_s": tps, "prefill_s": pre}
        for spec, dec in decoders.items():
            time.sleep(0.5)
            toks, tps, pre = run_specjax(dec, pid)
            same = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
            row[spec] = {"tokens_per_s": tps, "prefill_s": pre, "same_prefix": same}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)

    parent.send(None)
    worker.join()
    methods = ["llama.cpp", *decoders]
    summary = {}
    for m in methods:
        t = [r[m]["tokens_per_s"] for r in rows]
        # aggregate: total tokens ÷ total decode seconds (every prompt makes n tokens)
        summary[m] = {"tokens_per_s": len(t) / sum(1.0 / x for x in t), "median_tokens_per_s": statistics.median(t)}
        if m != "llama.cpp":
            summary[m]["vs_llama_cpp"] = summary[m]["tokens_per_s"] / summary["llama.cpp"]["tokens_per_s"]
            summary[m]["identical_to_llama_cpp"] = sum(r[m]["same_prefix"] == n for r in rows)
            summary[m]["median_same_prefix"] = statistics.median(r[m]["same_prefix"] for r in rows)
    result = {"config": {"command": " ".join(sys.argv), "prompts": len(rows), "max_new_tokens": n,
                         "threads": args.threads, "llama_cpp_python": llama_cpp.__version__, "gguf": os.path.basename(path),
                         "machine": machine_info()},
              "summary": summary, "rows": rows}
    print(f"{'method':<22} {'tokens/s':>9} {'median':>7} {'÷ llama.cpp':>12} {'identical':>10}")
    for m in methods:
        s = summary[m]
        print(f"{m:<22} {s['tokens_per_s']:9.1f} {s['median_tokens_per_s']:7.1f} {s.get('vs_llama_cpp', 1.0):11.2f}× "
              f"{str(s.get('identical_to_llama_cpp', '-')) + '/' + str(len(rows)):>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
