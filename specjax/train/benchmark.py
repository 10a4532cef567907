"""``specjax distill --bench DRAFTER``: the real decode loop on the evaluation split —
autoregressive vs a distilled drafter at each γ, ``ngram`` and the untrained truncated
target — with the statistics of :class:`specjax.runtime.stats.RunStats`."""

from __future__ import annotations

import json
import os
from collections import Counter

from specjax.runtime.stats import RunStats, ratio
from specjax.train.common import DistillError, log
from specjax.train.options import check_args, check_out_dir, parse_gammas
from specjax.train.records import encode_record, read_records, read_split

# the smallest prompt bucket of the benchmark's decoders: few prompt-shape buckets, since
# each new bucket compiles every decoder again
BENCH_PROMPT_BUCKET = 512


def bench(args) -> dict:
    """Real decode loop on the evaluation split: autoregressive vs the distilled drafter at
    each γ, ``ngram`` and the untrained truncated target (first 2 layers), greedy, batch 1,
    interleaved prompt by prompt (all kinds see the same machine load); compile time excluded.
    Also checks that every speculative output equals the autoregressive one.

    ``args``: the ``specjax distill`` options (``--bench DIR|default``, ``--prompts``,
    ``--split``, ``--out``, ``--bench-gammas``, ``--bench-per-category``, ``--bench-limit``,
    ``--max-new-tokens``, ``--model``). Writes ``OUT/bench.json`` and prints one table line
    per kind. Returns the result: ``prompts``, ``max_new_tokens``, ``dtype``, ``batch``,
    ``greedy``, ``mismatches`` (``(kind, question id)`` pairs) and ``table`` (per kind:
    ``tokens_per_s``, ``speedup`` vs autoregressive, ``alpha`` (``None`` for autoregressive),
    ``tokens_per_call``, ``new_tokens`` and ``by_category`` ``{speedup, alpha}``).

    Raises:
      DistillError: ``--out`` a file or not empty or not writable, a bad option or
        ``--bench-gammas``, or no drafter directory at ``--bench``.
    """
    from specjax.io.loading import load_model

    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise DistillError(f"--out {out} is a file; give a directory for the benchmark results")
    if os.path.exists(out) and os.listdir(out):
        raise DistillError(f"{out} exists and is not empty; choose a new --out for the benchmark results")
    check_args(args, export_only=True)
    gammas = parse_gammas(args.bench_gammas)
    if args.bench != "default" and not os.path.isdir(os.path.expanduser(args.bench)):
        raise DistillError(f"--bench {args.bench}: no such drafter directory (a run's DIR/drafter, or 'default')")
    check_out_dir(out)
    os.makedirs(out, exist_ok=True)
    target = load_model(args.model, dtype="float32")
    recs = _bench_records(args)
    prompts = [encode_record(target, r, True) for r in recs]
    return _bench_run(args, out, target, recs, prompts, gammas)


def _bench_records(args) -> list[dict]:
    """The evaluation records of ``--split`` in file order, at most ``--bench-per-category``
    per category and ``--bench-limit`` in all (0: no limit)."""
    records = read_records(args.prompts)
    ev = set(x for x in read_split(args.split)["eval"] if isinstance(x, (int, str)))
    recs = [r for r in records if r["question_id"] in ev]
    if args.bench_per_category:
        seen = Counter()
        keep = []
        for r in recs:
            if seen[r["category"]] < args.bench_per_category:
                keep.append(r)
                seen[r["category"]] += 1
        recs = keep
    if args.bench_limit:
        recs = recs[: args.bench_limit]
    return recs


def _bench_decoders(args, target, gammas) -> list[tuple]:
    """``(kind name, Decoder)`` for every kind compared, autoregressive (``"ar"``) first."""
    from specjax.api import load_drafter
    from specjax.drafters.model import ModelDrafter
    from specjax.io.loading import truncate_model
    from specjax.runtime.decoder import Decoder

    def dec(drafter=None, gamma=4):
        return Decoder(target, drafter, gamma, prompt_bucket=BENCH_PROMPT_BUCKET)

    dr = load_drafter(args.bench, target)  # 'default' or a run's DIR/drafter of any kind (EAGLE, block)
    first2 = ModelDrafter.from_model(truncate_model(target, 2), name="first2")
    return ([("ar", dec())] + [(f"distilled γ={g}", dec(dr, g)) for g in gammas]
            + [("ngram γ=4", dec(load_drafter("ngram", target), 4)), ("first2 γ=2", dec(first2, 2))])


def _bench_run(args, out, target, recs, prompts, gammas) -> dict:
    """Decode every prompt with every kind (interleaved), compare with autoregressive, and
    write/print the table (see :func:`bench`)."""
    kinds = _bench_decoders(args, target, gammas)
    totals = {name: RunStats() for name, _ in kinds}
    by_category = {name: {} for name, _ in kinds}
    mismatches = []
    for i, (r, ids) in enumerate(zip(recs, prompts)):
        ar_tokens = None
        for name, dec in kinds:
            g = dec.generate([ids], max_new_tokens=args.max_new_tokens)
            if name == "ar":
                ar_tokens = g.tokens[0]
            elif g.tokens[0] != ar_tokens:
                mismatches.append((name, r["question_id"]))
            st = RunStats.from_batch(g.stats, g.decode_s)
            totals[name] += st
            cats = by_category[name]
            cats[r["category"]] = cats.get(r["category"], RunStats()) + st
        log(f"bench {i + 1}/{len(recs)} ({r['category']}): " + ", ".join(
            f"{k} {v.tokens_per_s or 0.0:.1f} tok/s" for k, v in totals.items()))
    result = {"prompts": len(recs), "max_new_tokens": args.max_new_tokens, "dtype": "float32", "batch": 1,
              "greedy": True, "mismatches": mismatches, "table": bench_table(totals, by_category)}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    for k, v in result["table"].items():
        print(f"{k:16s} {_num(v['tokens_per_s'], 6, 2)} tok/s  speedup {_num(v['speedup'], 0, 2)}x  "
              f"alpha {_num(v['alpha'], 0, 3)}  tokens/call {_num(v['tokens_per_call'], 0, 2)}")
    if mismatches:
        print(f"MISMATCH vs autoregressive: {mismatches}")
    return result


def _num(x: float | None, width: int, digits: int) -> str:
    """A table figure; "–" for no data (``None``)."""
    return f"{'–':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def bench_table(totals: dict, by_category: dict) -> dict:
    """The benchmark table from per-kind :class:`RunStats` (``totals[kind]``) and per-kind,
    per-category ones (``by_category[kind][category]``); kind ``"ar"`` is the baseline.
    Per kind: ``tokens_per_s`` (new tokens ÷ decode seconds), ``speedup`` (÷ the
    autoregressive tokens/s), ``alpha`` (acceptance rate, ``None`` without a drafter),
    ``tokens_per_call`` (new tokens ÷ target calls, ``None`` without calls), ``new_tokens`` and
    ``by_category`` (sorted) ``{speedup, alpha}``.
    A kind without decode time has ``None`` tokens/s and speedup (no data).
    """
    ar_tps = totals["ar"].tokens_per_s
    ar_cat = {c: v.tokens_per_s for c, v in by_category["ar"].items()}
    table = {}
    for k, v in totals.items():
        tps = v.tokens_per_s
        table[k] = {"tokens_per_s": tps, "speedup": ratio(tps, ar_tps), "alpha": v.acceptance_rate,
                    "tokens_per_call": v.mean_accepted_tokens, "new_tokens": v.new_tokens,
                    "by_category": {c: {"speedup": ratio(x.tokens_per_s, ar_cat[c]), "alpha": x.acceptance_rate}
                                    for c, x in sorted(by_category[k].items())}}
    return table
