"""``specjax bench``: the benchmark of :mod:`specjax.eval.bench` from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax.cli.common import DTYPES, UsageError, add_model_args, parse_gamma, resolve, resolve_auto_dtype
from specjax.eval.bench import (
    json_default, check_out_path, check_writable, filter_split, run_bench, select_prompts, split_categories,
    write_json,
)
from specjax.eval.report import markdown_tables


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="throughput of autoregressive vs speculative decoding per category (Spec-Bench style)",
        description=(
            "Benchmark the autoregressive baseline and every drafter × γ on a prompts file "
            "(JSONL with 'prompt', or Spec-Bench 'turns' + 'category'). Methods run interleaved per "
            "batch; compile and warm-up are excluded from throughput. Markdown table on stdout, "
            "--json for the full results, --out FILE to save them."
        ),
        conflict_handler="resolve",
    )
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help="JSONL: 'prompt' or Spec-Bench 'turns' (first turn used) + optional 'category', 'question_id'")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt text (repeatable; category 'cli'); with or instead of --prompts")
    p.add_argument("--categories", nargs="+", default=None, metavar="C",
                   help="categories to keep (space- or comma-separated; default: all)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per category (file order)")
    p.add_argument("--split", default=None, metavar="FILE[:PART]",
                   help="keep the prompts whose question_id is in PART (default eval) of a split JSON "
                        "{'train': [ids], 'eval': [ids]}, e.g. the drafter's configs/spec_bench_split.json")
    add_model_args(p, multi_draft=True)
    # bench overrides: several weight formats; chat on by default
    p.add_argument("--dtype", nargs="+", default=None, choices=[*DTYPES, "auto"],
                   help="target weight format(s); several run as an outer loop (default float32); auto: the "
                        "fastest decode step on this host (measured once, cached)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (default: on when the model has one; "
                        "--no-chat sends raw text)")
    p.add_argument("--warmup", type=int, default=1, metavar="K",
                   help="untimed warm-up runs of the first batch per method (default 1)")
    p.add_argument("--out", metavar="FILE", default=None, help="write the full results as JSON (refuses to overwrite)")
    p.add_argument("--force", action="store_true", help="allow --out to overwrite an existing file")
    p.add_argument("--json", action="store_true", help="print the full results as JSON on stdout (no table)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from specjax.api import load_pair_config
    from specjax.cli.common import collect_prompts

    if not args.prompts and not args.prompt:
        raise UsageError("no prompts; pass --prompts FILE (JSONL, e.g. Spec-Bench question.jsonl) or --prompt TEXT")
    check_out_path(args.out, args.force)
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    dtypes_flag = args.dtype
    args.dtype = None  # resolve() handles one format; bench loops over several
    chat_flag = args.chat
    args.chat = None
    s = resolve(args, default_draft="ngram", tree_with_gamma=True)
    cfg = load_pair_config(args.config) if args.config else {}
    dtypes = list(dtypes_flag) if dtypes_flag else [cfg.get("dtype", "float32")]
    chat = chat_flag if chat_flag is not None else cfg.get("chat")  # None: the model's template if it has one
    draft_dtype = args.draft_dtype or cfg.get("draft_dtype")
    drafts = s["draft"]
    if drafts is None:
        drafts = ["ngram"]
    elif isinstance(drafts, str):
        drafts = [drafts]
    gammas_raw = s["gamma"]
    if gammas_raw is None:
        gammas_raw = [] if s["tree"] is not None else [4]  # a tree alone, unless --gamma asks for chains too
    elif not isinstance(gammas_raw, (list, tuple)):
        gammas_raw = [gammas_raw]
    gammas = []
    for g in gammas_raw:
        v = parse_gamma(g)
        if v == "auto":
            raise UsageError("--gamma auto is not supported by bench; give the values to compare, e.g. --gamma 3 4 5")
        gammas.append(v)

    from specjax.cli.common import check_max_model_len

    check_max_model_len(s)  # against the model's context, before anything is loaded
    prompts = select_prompts(filter_split(collect_prompts(args), args.split), args.categories, args.limit)
    check_writable(args.out, create=False)  # before the benchmark runs, not after; no directory is made for it
    if "auto" in dtypes:  # the fastest format on this host (a one-token step; measured once, cached)
        from specjax.runtime.progress import Progress

        auto = {"model": s["model"], "dtype": "auto", "draft_dtype": "float32"}
        resolve_auto_dtype(auto, None if args.no_progress else Progress(), predict=False)
        dtypes = list(dict.fromkeys(auto["dtype"] if d == "auto" else d for d in dtypes))
    settings = s["request"]  # the declared request fields and sampling, with --batch-size
    results = run_bench(
        prompts, settings, model=s["model"], drafts=drafts, gammas=gammas, trees=[s["tree"]] if s["tree"] else [],
        dtypes=dtypes, draft_dtype=draft_dtype,
        chat=chat, parse_special=s["parse_special"], warmup=args.warmup, mesh=args.mesh,
        progress=not args.no_progress, max_model_len=s["max_model_len"],
    )
    results["fidelity"] = format_fidelity(s["model"], dtypes, no_progress=args.no_progress)
    results["config"]["prompts_file"] = os.path.abspath(args.prompts) if args.prompts else None
    results["config"]["categories"] = split_categories(args.categories)
    results["config"]["limit"] = args.limit
    if args.out:
        write_json(args.out, results, args.force)
        print(f"specjax bench: wrote {args.out}", file=sys.stderr)
    if args.json:
        print(json.dumps(results, default=json_default))
    else:
        print(markdown_tables(results))
    mm = results["config"].get("greedy_mismatches_vs_ar")
    if mm:
        print(f"specjax bench: warning: {mm} greedy speculative output(s) differ from autoregressive "
              "(expected only in reduced-precision formats)", file=sys.stderr)
    return 0


def format_fidelity(model, dtypes, no_progress: bool = False) -> dict:
    """``{format: fidelity}`` of each benchmarked weight format to float32 (measured once per
    model and host, then cached: :func:`specjax.eval.fidelity.measure`); JSON field ``fidelity``."""
    from specjax.eval import fidelity, hostcache
    from specjax.runtime.progress import Progress

    out = {}
    for d in dtypes:
        fid = fidelity.measure(model, d, cache=hostcache.default_cache(), progress=None if no_progress else Progress())
        out[d] = {k: fid[k] for k in ("mean_kl", "top1_agreement", "faithful") if k in fid}
    return out
