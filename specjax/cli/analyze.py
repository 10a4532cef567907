"""``specjax analyze``: the theory of speculative decoding as a tool.

Two modes:

* numbers only — ``specjax analyze --alpha 0.8 --c 0.02 [--v V ...] [--gamma-max G]``:
  the theory table (E(N), cost, speedup with v and textbook, Leviathan et al. 2023,
  Eq. 1 / Theorem 3.8), the optimal γ and the oracle bound 1/(1−α).
* models — ``specjax analyze --model M --draft D --prompts FILE``: measured α (overall
  and per category), c(γ) and v(γ) for γ = 1..G, the table with both cost models, the
  recommended γ, and the real speculative run at that γ: measured vs predicted speedup
  and E(N) next to the measured mean accepted tokens (see :mod:`specjax.eval.measure`).

Draft trees — ``--tree-shapes 8x4x2,16x5x3`` (N nodes × depth D × top-k K, as ``--tree-nodes
--tree-depth --tree-topk`` of ``generate``/``bench``) in either mode: the tree E(N) and
speedup E(N)/(c_tree + v(N)) per shape next to the chains (:func:`specjax.eval.theory.tree_table`);
with models, c_tree and v(N) are measured and each shape is decoded for real (measured τ and
speedup), and the recommendation line names the fastest chain or tree.

Markdown tables for people; ``--json`` for machines; ``--plot out.png`` draws predicted
speedup against γ with the measured points.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np

from specjax.eval import theory as analysis
from specjax.eval.report import recommendation_line, render_models  # noqa: F401  (render_models importable from here too)

NUMBERS_GAMMA_MAX = 16
MODEL_GAMMA_MAX = 8


def _usage(msg: str) -> Exception:
    from specjax.cli.common import UsageError

    return UsageError(msg)


def register_cli(subparsers) -> None:
    from specjax.cli.common import add_model_args

    p = subparsers.add_parser(
        "analyze",
        help="theory table from numbers, or measured alpha/c/v(γ) and predicted vs measured speedup",
        description=(
            "Numbers only: specjax analyze --alpha A --c C [--v V ...]. "
            "Models: specjax analyze --model M --draft D --prompts FILE [--limit N] [--categories a,b]. "
            "Either mode: --tree-shapes NxDxK[,...] adds draft trees (docs/analyze.md)."
        ),
    )
    p.add_argument("--alpha", type=float, default=None, help="acceptance rate α in [0, 1] (numbers-only mode)")
    p.add_argument("--c", type=float, default=None, help="draft/target cost ratio c >= 0 (with --alpha)")
    p.add_argument("--v", type=float, nargs="+", default=None,
                   help="target cost of γ+1 tokens over 1 token: one value for every γ, or v(1) v(2) … (with --alpha)")
    p.add_argument("--gamma-max", type=int, default=None,
                   help=f"largest γ in the table (default {NUMBERS_GAMMA_MAX} numbers-only, {MODEL_GAMMA_MAX} with models)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL: 'prompt' or Spec-Bench 'turns' (+ 'category') per line")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (e.g. summarization,qa)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category (file order)")
    p.add_argument("--repeats", type=int, default=1, help="timed decode runs per batch for the measured speedup (median)")
    p.add_argument("--timing-repeats", type=int, default=7, help="timed calls per kind for c and v (median)")
    p.add_argument("--tree-shapes", metavar="NxDxK[,NxDxK...]", default=None,
                   help="draft trees to analyze next to the chains, each N nodes x depth D x top-k K "
                        "(e.g. 8x4x2,16x5x3); with models each is measured and decoded (needs a tree drafter "
                        "for K > 1: ngram, default or an EAGLE drafter)")
    add_model_args(p, mesh=False, trees=False)  # measures on one device; trees via --tree-shapes
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", metavar="PNG", default=None, help="write predicted speedup vs γ (with measured points)")
    p.add_argument("--force", action="store_true", help="allow --plot to overwrite an existing file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (shown only on a terminal)")
    p.set_defaults(func=cmd_analyze)


# --------------------------------------------------------------------------- numbers only
def _check_numbers(args) -> tuple[float, float, Any, int]:
    if args.alpha is None and args.c is None and args.v is None:
        raise _usage("internal: not numbers-only")
    if args.alpha is None:
        raise _usage("--c/--v need --alpha (numbers-only mode: --alpha A --c C [--v V ...])")
    if args.c is None:
        raise _usage("--alpha needs --c (the draft/target cost ratio, e.g. --c 0.05)")
    if not (math.isfinite(args.alpha) and 0.0 <= args.alpha <= 1.0):
        raise _usage(f"--alpha must be in [0, 1], got {args.alpha}")
    if not (math.isfinite(args.c) and args.c >= 0.0):
        raise _usage(f"--c must be finite and >= 0, got {args.c}")
    v = args.v
    if v is not None:
        bad = [x for x in v if not (math.isfinite(x) and x > 0)]
        if bad:
            raise _usage(f"--v values must be finite and > 0, got {bad[0]}")
    gmax = args.gamma_max
    if v is not None and len(v) > 1:
        if gmax is not None and gmax > len(v):
            raise _usage(f"--gamma-max {gmax} needs {gmax} --v values (v(1)..v({gmax})), got {len(v)}")
        gmax = gmax or len(v)
    gmax = NUMBERS_GAMMA_MAX if gmax is None else gmax
    if gmax < 1:
        raise _usage(f"--gamma-max must be >= 1, got {gmax}")
    if v is not None:
        v = float(v[0]) if len(v) == 1 else [float(x) for x in v[:gmax]]
    return float(args.alpha), float(args.c), v, int(gmax)


def parse_tree_shapes(text: str | None) -> list:
    """``"8x4x2,16x5x3"`` → :class:`~specjax.core.drafting.TreeShape` s (N nodes × depth D ×
    top-k K), duplicates dropped, in order; ``None`` → ``[]``.

    Raises:
      UsageError: one line naming the bad shape and the fix (not NxDxK, K > N, D > N,
        N > K + (D−1)·K²).
    """
    from specjax.core.drafting import TreeShape

    if text is None:
        return []
    shapes = []
    for part in text.split(","):
        part = part.strip()
        bits = part.lower().split("x")
        if len(bits) != 3 or not all(b.isdigit() and int(b) >= 1 for b in bits):
            raise _usage(f"--tree-shapes: {part!r} is not NxDxK (nodes x depth x topk, integers >= 1); "
                         "e.g. --tree-shapes 8x4x2,16x5x3")
        n, d, k = (int(b) for b in bits)
        if k > n:
            raise _usage(f"--tree-shapes {part}: topk K={k} > nodes N={n} (a node has at most N children); "
                         f"use K <= {n}, e.g. {n}x{d}x{min(k, n)}")
        if d > n:
            raise _usage(f"--tree-shapes {part}: depth D={d} > nodes N={n} (a path of depth D holds D nodes); "
                         f"raise N to at least {d} or lower D")
        cap = TreeShape.max_nodes(d, k)
        if n > cap:
            raise _usage(f"--tree-shapes {part}: nodes N={n} > K + (D-1)·K² = {cap} (the candidates of a dynamic "
                         "tree); lower N or raise D/K")
        shapes.append(TreeShape(n, d, k))
    return list(dict.fromkeys(shapes))


def _tree_key(t) -> str:
    return f"{t.nodes}x{t.depth}x{t.topk}"


def numbers_report(alpha: float, c: float, v: Any = None, gamma_max: int = NUMBERS_GAMMA_MAX,
                   trees: Any = ()) -> dict:
    """The theory for given α, c (and v): table rows for γ = 1..gamma_max, optimal γ, oracle bound.

    ``v``: ``None`` (textbook), one float for every γ, or a list ``v(1)..v(G)``. With a
    list only γ ≤ len(v) is searched; otherwise the optimum is searched over
    ``1..max(gamma_max, 64)`` so a short table does not hide it.

    ``trees``: :class:`~specjax.core.drafting.TreeShape` s; adds ``trees`` (rows of
    :func:`specjax.eval.theory.tree_table` with a_r = α(1−α)^{r−1}, c_tree = D·c, v(N) from ``v``
    at N draft tokens: a list must cover every N), ``tree_model`` and ``recommended`` (the best of
    the optimal chain — or the table's best when the optimum is unbounded — and the trees).
    """
    gammas = list(range(1, gamma_max + 1))
    vv = np.asarray(v, float) if isinstance(v, list) else v
    rows = analysis.theory_table(alpha, c, gammas, vv)
    search = gamma_max if isinstance(v, list) else max(gamma_max, 64)
    g_opt, s_opt = analysis.optimal_gamma(alpha, c, vv, max_gamma=search)
    tb_search = search if not isinstance(v, list) else max(gamma_max, 64)
    g_tb, s_tb = analysis.optimal_gamma(alpha, c, None, max_gamma=tb_search)
    why = None if isinstance(v, list) else _unbounded_reason(alpha, c, v, g_opt, search)
    why_tb = _unbounded_reason(alpha, c, None, g_tb, tb_search)
    extra = {}
    if trees:
        vt = v if not isinstance(v, list) else {i + 1: x for i, x in enumerate(v)}
        trows = analysis.tree_table(analysis.rank_acceptance(alpha, max(t.topk for t in trees)),
                                    [(t.nodes, t.depth, t.topk) for t in trees], c, vt)
        if why:  # no finite chain optimum: the best chain of the table
            best = max(rows, key=lambda r: (r["speedup"], -r["gamma"]))
            chain = ("chain", int(best["gamma"]), None, float(best["speedup"]))
        else:
            chain = ("chain", int(g_opt), None, float(s_opt))
        cands = [chain] + [("tree", r["depth"], r["shape"], r["speedup"]) for r in trows]
        pick = max(enumerate(cands), key=lambda ic: (ic[1][3], -ic[0]))[1]
        extra = {"trees": trows, "tree_model": TREE_MODEL_NUMBERS,
                 "recommended": {"kind": pick[0], "gamma": pick[1], "shape": pick[2], "speedup": pick[3],
                                 "basis": "predicted"}}
    return {
        "mode": "numbers",
        "alpha": alpha,
        "c": c,
        "v": v,
        "gamma_max": gamma_max,
        "table": rows,
        "optimal_gamma": None if why else int(g_opt),
        "optimal_speedup": None if why else float(s_opt),
        "optimal_gamma_reason": why,
        "optimal_gamma_textbook": None if why_tb else int(g_tb),
        "optimal_speedup_textbook": None if why_tb else float(s_tb),
        "optimal_gamma_textbook_reason": why_tb,
        "oracle_bound": float(analysis.oracle_bound(alpha)),
        **extra,
    }


TREE_MODEL_NUMBERS = ("per-rank acceptance a_r = alpha (1 - alpha)^(r-1) at every node; the tree of shape NxDxK is "
                      "EAGLE-2's dynamic tree on those path probabilities; E(N) = 1 + sum over nodes of the product "
                      "of a_r along the path; speedup = E(N) / (D c + v(N))")


def _unbounded_reason(alpha: float, c: float, v, g_best: int, search: int) -> str | None:
    """Why there is no finite optimal γ (``None`` when there is one): the speedup still grows
    at the search limit — with α = 1 every draft is accepted (speedup → 1/c as γ → ∞), with
    c = 0 drafting is free (speedup → the oracle bound 1/(1−α))."""
    if g_best < search:
        return None
    if alpha >= 1.0 and c == 0.0:
        return "unbounded: α = 1 and c = 0 (every draft accepted, drafting free), the speedup grows without limit in γ"
    if alpha >= 1.0:
        return (f"unbounded: α = 1 accepts every draft, so the speedup keeps growing with γ "
                f"toward 1/c = {1 / c:.3f}× (no finite optimum; take γ as large as the context allows)")
    if c == 0.0:
        return (f"unbounded: c = 0 makes drafting free, so the speedup keeps growing with γ toward the oracle bound "
                f"1/(1−α) = {1 / (1 - alpha):.3f}× (no finite optimum)")
    return f"γ ≥ {search} (the search limit): the speedup still grows there"


def _fmt(x, d=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{d}f}"
    return str(x)


def render_numbers(rep: dict) -> str:
    v = rep["v"]
    vdesc = "1 (textbook)" if v is None else (f"{v:g}" if isinstance(v, float) else "measured list")
    lines = [
        f"## Speculative decoding theory: α = {rep['alpha']:g}, c = {rep['c']:g}, v = {vdesc}",
        "",
        analysis.format_table(rep["table"]),
        "",
        (f"optimal γ: {rep['optimal_gamma_reason']}; " if rep.get("optimal_gamma_reason") else
         f"optimal γ = {rep['optimal_gamma']} (speedup {rep['optimal_speedup']:.3f}×); ")
        + ("textbook (v = 1): the same; " if rep.get("optimal_gamma_textbook_reason")
           and rep.get("optimal_gamma_textbook_reason") == rep.get("optimal_gamma_reason")
           else f"textbook (v = 1): {rep['optimal_gamma_textbook_reason']}; " if rep.get("optimal_gamma_textbook_reason")
           else f"textbook (v = 1): γ = {rep['optimal_gamma_textbook']} ({rep['optimal_speedup_textbook']:.3f}×); ")
        + f"oracle bound 1/(1−α) = {_fmt(rep['oracle_bound'])}",
    ]
    if rep.get("trees"):
        lines += ["", "### Draft trees (a_r = α(1−α)^(r−1) per child rank r, c_tree = D·c, v(N) at N drafts)", "",
                  analysis.format_table(rep["trees"]), "", recommendation_line(rep["recommended"])]
    return "\n".join(lines)


# --------------------------------------------------------------------------- models
def select_prompts(prompts: list[dict], categories: str | None, limit: int | None) -> list[dict]:
    """Keep ``categories`` (comma list) and at most ``limit`` prompts per category, file order
    (the same selection as ``specjax bench``)."""
    from specjax.eval.bench import select_prompts as bench_select

    return bench_select(prompts, categories, limit)


def _plot(rep: dict, path: str) -> str:
    if rep.get("mode") == "numbers":
        a, c = rep["alpha"], rep["c"]
        alphas = sorted({round(x, 3) for x in (0.5, 0.7, 0.9, a)})
        cs = sorted({round(x, 4) for x in (0.02, 0.1, c)})
        v = rep["v"]
        if isinstance(v, list):
            gm = len(v)
            v = np.asarray(v, float)
        else:
            gm = rep["gamma_max"]
        measured = ([{"gamma": rep["optimal_gamma"], "speedup": rep["optimal_speedup"], "c": c, "label": "optimum"}]
                    if rep["optimal_gamma"] is not None else [])
        return analysis.plot_speedup(path, alphas, cs, gm, v, measured)
    a, c = rep["alpha"]["alpha"], rep["c"]
    a = 0.0 if a is None else a  # no position scored (no data): drawn at α 0
    alphas = sorted({round(x, 3) for x in (0.2, 0.5, 0.8, a)})
    cs = sorted({round(x, 4) for x in (0.02, 0.1, c)})
    measured = [{"gamma": m["gamma"], "speedup": m["measured_speedup"], "c": round(c, 4), "label": "measured"}
                for m in rep["measured"]]
    measured += [{"gamma": rep["recommended_gamma"], "speedup": rep["predicted_speedup"], "c": round(c, 4),
                  "label": "predicted (recommended γ)"}]
    return analysis.plot_speedup(path, alphas, cs, len(rep["v"]), np.asarray(rep["v"], float), measured)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def cmd_analyze(args) -> int:
    numbers = args.alpha is not None or args.c is not None or args.v is not None
    if args.plot:  # fail now, not after the measurements; never create directories for it
        import os

        from specjax.eval.bench import check_writable

        check_writable(args.plot, "--plot", create=False)
        if os.path.isdir(args.plot):  # before the --force hint: --force cannot overwrite a directory
            raise _usage(f"--plot {args.plot} is a directory; give a file name (e.g. {os.path.join(args.plot, 'analyze.png')})")
        if os.path.exists(args.plot) and not args.force:
            raise _usage(f"--plot {args.plot} exists; choose a new file name or pass --force to overwrite it")
    if numbers:
        model_flags = [f for f in ("model", "draft", "prompts", "prompt", "config") if getattr(args, f, None)]
        if model_flags:
            raise _usage(f"--alpha/--c/--v (numbers only) cannot be combined with --{model_flags[0]}")
        alpha, c, v, gmax = _check_numbers(args)
        trees = parse_tree_shapes(args.tree_shapes)
        if trees and isinstance(v, list) and max(t.nodes for t in trees) > len(v):
            n = max(t.nodes for t in trees)
            raise _usage(f"--tree-shapes needs v(N) for N = {n} drafted nodes: give {n} --v values (v(1)..v({n})) "
                         "or one value for every size")
        rep = numbers_report(alpha, c, v, gmax, trees)
        text = render_numbers(rep)
    else:
        rep = run_models(args)
        text = render_models(rep)
    if args.plot:
        rep["plot"] = _plot(rep, args.plot)
    if args.json:
        print(json.dumps(_jsonable(rep)))
    else:
        print(text)
        if args.plot:
            print(f"\nplot: {rep['plot']}")
    return 0


def run_models(args) -> dict:
    from specjax.cli.common import chat_default, collect_prompts, load_target_and_drafter, resolve
    from specjax.eval import measure

    s = resolve(args, need_draft="analyze with models needs one drafter: --draft ngram[:N] | PATH_OR_ID "
                                  "(or give numbers only: --alpha A --c C)")
    trees = parse_tree_shapes(args.tree_shapes)
    if s["tree"] is not None and s["tree"] not in trees:  # a pair config's tree is analyzed too
        trees.append(s["tree"])
    if trees:
        from specjax.drafters import registry

        wide = [t for t in trees if t.topk > 1]
        if wide and not registry.proposes_trees(s["draft"]):
            raise _usage(f"--draft {s['draft']} is {registry.kind_words(s['draft'])}, which proposes chains only; "
                         f"tree shape {_tree_key(wide[0])} (topk {wide[0].topk}) needs --draft default, ngram or an "
                         "EAGLE drafter directory (or topk 1)")
    gmax = MODEL_GAMMA_MAX if args.gamma_max is None else args.gamma_max
    from specjax.core.drafting import MAX_GAMMA

    if not 1 <= gmax <= MAX_GAMMA:
        raise _usage(f"--gamma-max must be in [1, {MAX_GAMMA}] (draft tokens per round) when measuring models, got "
                     f"{gmax}; use --gamma-max {MAX_GAMMA} or less")
    if args.repeats < 1 or args.timing_repeats < 1:
        raise _usage("--repeats and --timing-repeats must be >= 1")
    gamma = None
    if s["gamma"] not in (None, "auto"):
        from specjax.cli.common import parse_gamma

        gamma = parse_gamma(s["gamma"])
    prompts = select_prompts(collect_prompts(args), args.categories, args.limit)
    target, drafter = load_target_and_drafter(s)
    log = (lambda m: print(f"specjax analyze: {m}", file=sys.stderr, flush=True))
    settings = s["request"]  # the declared request fields and sampling, with --batch-size
    rep = measure.analyze_pair(
        target, drafter, prompts, settings, gamma_max=gmax, gamma=gamma, chat=chat_default(target, s["chat"]),
        parse_special=s["parse_special"], repeats=args.repeats,
        timing_repeats=args.timing_repeats, log=log, progress=not args.no_progress, trees=trees,
    )
    rep["mode"] = "models"
    rep["command_settings"] = {"model": s["model"] or "default", "draft": s["draft"],
                               "categories": args.categories, "limit": args.limit}
    return rep
