"""``specjax analyze``'s measurements of one target/drafter pair (part of
:mod:`specjax.eval.measure`, which re-exports them): :func:`analyze_pair` — the target's own
output, α (:mod:`specjax.eval.alpha`), the costs (:mod:`specjax.eval.costs`), the theory table
and recommended γ, the real speculative runs (:mod:`specjax.eval.speedup`) — and the predictions
and measurements of draft trees (:func:`tree_entry`, :func:`recommend_shape`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from specjax.eval import theory as analysis
from specjax.eval.alpha import measure_alpha
from specjax.eval.common import sampling_key, prompt_records
from specjax.eval.costs import measure_costs, tree_key
from specjax.eval.speedup import autoregressive_run, best_row, compare, measure_speedup, theory_rows
from specjax.runtime.settings import DecodeSettings
from specjax.runtime.stats import difference, ratio


def analyze_pair(
    target,
    drafter,
    prompts: Sequence[Any],
    settings: DecodeSettings | None = None,
    *,
    gamma_max: int = 8,
    gamma: int | None = None,
    parse_special: bool = True,
    chat: bool = False,
    repeats: int = 1,
    timing_repeats: int = 7,
    quick_costs: bool = False,
    measure_run: bool = True,
    log=None,
    progress: bool = False,
    trees: Sequence[Any] = (),
) -> dict:
    """Everything ``specjax analyze`` reports for one target/drafter pair.

    Steps: (1) the target alone decodes every prompt (its own output, and the AR
    baseline decoder warmed up); (2) α by teacher forcing along that output
    (:func:`measure_alpha`); (3) c(γ), v(γ) for γ = 1..``gamma_max``
    (:func:`measure_costs`, batch = ``settings.batch_size``, buffer for the median prompt);
    (4) the theory table and the recommended γ (largest predicted speedup with the
    measured c(γ), v(γ)); (5) the real speculative run at the recommended γ (and at
    ``gamma`` if given), interleaved with AR (:func:`measure_speedup`). ``progress``: tqdm
    bars on stderr over the prompts / batches of steps 1, 2 and 5 (only when stderr is a terminal).

    With ``trees`` (:class:`~specjax.core.drafting.TreeShape` s): step 3 also times each
    shape's c_tree and v(N) (:func:`measure_costs`), step 4 predicts its τ and speedup
    (:func:`tree_entry`), step 5 also decodes with each shape (a real tree decode, interleaved
    with AR) for the measured τ and speedup, and ``recommended`` names the fastest of the
    recommended chain and the trees (measured speedup; predicted with ``measure_run=False``).

    Args:
      prompts: texts, id lists or records (:func:`prompt_records`).
      settings: sampling, length, seed, batch size, EOS (default ``DecodeSettings(batch_size=1)``;
        ``batch_size=None`` decodes and times all prompts as one batch).
    Returns a JSON-serialisable dict (see ``specjax analyze --json``).
    """
    settings = DecodeSettings(batch_size=1) if settings is None else settings
    say = log or (lambda *_: None)
    recs = prompt_records(prompts, target, chat, parse_special)
    sp_kw = sampling_key(settings)
    decoders: dict = {}
    say(f"[1/5] target's own output: {len(recs)} prompts × ≤{settings.max_new_tokens} tokens")
    base = autoregressive_run(target, recs, settings, decoders=decoders, progress=progress)
    one_pass = drafter.causal_model is None and drafter.chain_passes(2) == 1 and int(gamma_max) > 1
    say("[2/5] alpha by teacher forcing" + (f" (block slots 1..{gamma_max} of each one-pass proposal)" if one_pass else ""))
    alpha = measure_alpha(target, drafter, recs, base["tokens"], seed=settings.seed, batch_size=4, progress=progress,
                          slots=int(gamma_max) if one_pass else 1, **sp_kw)
    by_pos = alpha.get("alpha_by_position")
    gammas = list(range(1, int(gamma_max) + 1))
    plen = int(np.median([len(r["ids"]) for r in recs]))
    batch = settings.batch_size or len(recs)
    say(f"[3/5] costs c(γ), v(γ) for γ = 1..{gamma_max} (batch {batch}, prompt {plen} tokens)")
    mg = sorted({g for g in (1, 2, 4, 8, int(gamma_max)) if g <= gamma_max}) if quick_costs else None
    trees = list(dict.fromkeys(trees))
    if trees:
        say(f"[3/5] … and for the trees {', '.join(tree_key(t) for t in trees)}: c_tree and v(N)")
    costs = measure_costs(target, drafter, gammas, batch=batch, prompt_len=plen,
                          max_new_tokens=settings.max_new_tokens, repeats=timing_repeats, measure_gammas=mg,
                          trees=trees, **sp_kw)
    a = 0.0 if alpha["alpha"] is None else alpha["alpha"]  # no position scored: the theory's α 0
    rows = theory_rows(a, gammas, costs["c"], costs["v"], by_pos)
    best = best_row(rows)
    say(f"[4/5] α = {a:.4f}, c(γ) = {costs['c'][best['gamma'] - 1]:.4f}: recommended γ = {best['gamma']} "
        f"(predicted {best['speedup']:.3f}×)")
    report = _pair_report(target, drafter, settings, chat, recs, plen, alpha, costs, rows, a)
    run_kw = dict(repeats=repeats, decoders=decoders, progress=progress)
    if measure_run:
        gs = [best["gamma"]] + ([int(gamma)] if gamma is not None and int(gamma) != best["gamma"] else [])
        report["measured"] += _chain_runs(target, drafter, recs, settings, gs, a, rows, costs, alpha, run_kw, say)
    report["trees"] += _tree_entries(target, drafter, recs, settings, trees, a, costs, alpha, measure_run, run_kw,
                                     say)
    if trees:
        report["tree_model"] = TREE_MODEL
    report["recommended"] = recommend_shape(report)
    return report


def _chain_runs(target, drafter, recs, settings, gs, a, rows, costs, alpha, run_kw, say) -> list[dict]:
    """:func:`analyze_pair`'s step 5 for chains: a speculative run at each γ of ``gs`` (interleaved
    with autoregressive, :func:`measure_speedup` with ``run_kw``), each a ``measured`` entry."""
    out = []
    for g in gs:
        say(f"[5/5] speculative run at γ = {g} (interleaved with autoregressive)")
        run = measure_speedup(target, drafter, recs, g, settings, **run_kw)
        row = rows[g - 1] if g <= len(rows) else theory_rows(a, [g], costs["c_scalar"], costs["v"][-1])[0]  # Eq. (1)
        out.append(_measured_entry(a, g, run, row, alpha, settings))
    return out


def _tree_entries(target, drafter, recs, settings, trees, a, costs, alpha, measure_run, run_kw, say) -> list[dict]:
    """:func:`analyze_pair`'s ``trees``: each shape's predictions (:func:`tree_entry`) and, with
    ``measure_run``, its real tree decode (interleaved with autoregressive, :func:`_tree_measured`)."""
    out = []
    for t in trees:
        entry = tree_entry(a, costs["trees"][tree_key(t)], alpha["coverage"])
        if measure_run:
            say(f"[5/5] speculative run with draft trees {tree_key(t)} (interleaved with autoregressive)")
            run = measure_speedup(target, drafter, recs, t.depth, settings, tree=t, **run_kw)
            entry.update(_tree_measured(run, entry, settings))
        out.append(entry)
    return out


TREE_MODEL = (
    "per-rank acceptance a_r = alpha (1 - alpha)^(r-1) at every node (independent tries); the tree of shape "
    "NxDxK is EAGLE-2's dynamic tree on those path probabilities (theory.static_tree); E(N) = 1 + sum over nodes "
    "of the product of a_r along the path (Sequoia's F(T)); speedup = E(N) / (c_tree + v(N)) with c_tree and v(N) "
    "measured (measure_costs)"
)


def tree_entry(alpha: float, cost: dict, coverage: float = 1.0) -> dict:
    """The predictions for one tree shape at acceptance rate ``alpha`` with its measured costs.

    Args:
      cost: one entry of :func:`measure_costs`' ``trees`` (``nodes``, ``depth``, ``topk``, ``v``,
        ``c_tree``, ``t_target_ms``, ``t_draft_ms``, ``buffer_len``).
      coverage: the fraction f of positions where the drafter proposes (an n-gram drafter: f < 1).
    Returns:
      dict: ``shape`` ("NxDxK"), ``label``, ``nodes``, ``depth``, ``topk``, ``alpha``, the costs,
      ``expected_tokens`` (predicted τ, :func:`specjax.eval.theory.tree_expected_tokens` of
      :func:`specjax.eval.theory.static_tree` with :func:`~specjax.eval.theory.rank_acceptance`),
      ``cost`` (``c_tree + v``), ``predicted_speedup``, ``predicted_speedup_textbook`` (v = 1); with
      f < 1 also ``coverage``, ``expected_tokens_coverage_adjusted`` (``f E + 1 − f``) and
      ``predicted_speedup_coverage_adjusted`` (``(f E + 1 − f) / (c_tree + f v + 1 − f)``: plain
      steps where nothing is proposed, as for chains in :func:`compare`).
    """
    n, d, k = int(cost["nodes"]), int(cost["depth"]), int(cost["topk"])
    a = analysis.rank_acceptance(alpha, k)
    parents, ranks = analysis.static_tree(n, d, k, a)
    e = float(analysis.tree_expected_tokens(parents, a, ranks))
    ct, v = float(cost["c_tree"]), float(cost["v"])
    out = {"shape": f"{n}x{d}x{k}", "label": cost.get("label", f"tree(N{n},D{d},K{k})"), "nodes": n, "depth": d,
           "topk": k, "alpha": float(alpha), "c_tree": ct, "v": v, "t_target_ms": cost["t_target_ms"],
           "t_draft_ms": cost["t_draft_ms"], "buffer_len": cost["buffer_len"], "expected_tokens": e,
           "cost": ct + v, "predicted_speedup": float(analysis.tree_speedup(e, ct, v)),
           "predicted_speedup_textbook": float(analysis.tree_speedup(e, ct, 1.0))}
    if coverage < 1.0:
        f = float(coverage)
        out["coverage"] = f
        out["expected_tokens_coverage_adjusted"] = f * e + 1 - f
        out["predicted_speedup_coverage_adjusted"] = (f * e + 1 - f) / (ct + f * v + 1 - f)
    return out


def _tree_measured(run: dict, entry: dict, settings: DecodeSettings) -> dict:
    """The measured half of a tree entry from :func:`measure_speedup`'s run with that tree: τ
    (``mean_accepted_tokens`` = the loop's new tokens ÷ target calls, pooled), its counters,
    ``accept_hist`` (rounds by accepted depth 0..D), speedup and tokens/s."""
    spec = run["spec"]
    tau = spec["mean_accepted_tokens"]
    ms = run.get("speedup")
    return {
        "mean_accepted_tokens": tau,
        "tokens_discrepancy": difference(tau, entry["expected_tokens"]),
        "new_tokens": spec["new_tokens"],
        "target_calls": spec["target_calls"],
        "drafted_tokens": spec["drafted_tokens"],
        "accepted_tokens": spec["accepted_tokens"],
        "acceptance_rate": spec["acceptance_rate"],
        "accept_hist": spec["accept_hist"],
        "measured_speedup": ms,
        "predicted_speedup_from_measured_tokens": ratio(tau, entry["cost"]),
        "speedup_relative_error": ratio(difference(entry["predicted_speedup"], ms), ms),
        "tokens_per_s_spec": spec["tokens_per_s"],
        "tokens_per_s_ar": run["ar"]["tokens_per_s"] if "ar" in run else None,
        "ar_tokens_match": run["tokens"] == run["ar_tokens"] if settings.temperature == 0 and "ar_tokens" in run
        else None,
    }


def recommend_shape(report: dict) -> dict:
    """The fastest way to speculate in an :func:`analyze_pair` report: the recommended chain
    (its measured run at the recommended γ) or one of the ``trees``, by measured speedup where
    every candidate was run, else by predicted speedup (ties: the chain, then the smaller tree).

    Returns:
      ``{"kind": "chain" | "tree", "gamma": D or γ, "shape": "NxDxK" or None, "speedup",
      "basis": "measured" | "predicted"}``.
    """
    chain_run = next((m for m in report["measured"] if m["gamma"] == report["recommended_gamma"]), None)
    measured = chain_run is not None and all("measured_speedup" in t for t in report["trees"])
    key = "measured_speedup" if measured else "predicted_speedup"
    cands = [("chain", report["recommended_gamma"], None,
              chain_run["measured_speedup"] if measured else report["predicted_speedup"])]
    cands += [("tree", t["depth"], t["shape"], t[key]) for t in report["trees"]]

    def score(c):
        return c[3] if c[3] is not None and np.isfinite(c[3]) else -np.inf
    best = max(enumerate(cands), key=lambda ic: (score(ic[1]), -ic[0]))[1]
    return {"kind": best[0], "gamma": int(best[1]), "shape": best[2], "speedup": best[3],
            "basis": "measured" if measured else "predicted"}


def _pair_report(target, drafter, settings, chat, recs, plen, alpha, costs, rows, a) -> dict:
    """:func:`analyze_pair`'s report before the speculative runs (``measured`` empty)."""
    best, best_tb = best_row(rows), best_row(rows, "speedup_textbook")
    return {
        "target": getattr(target, "name", ""),
        "drafter": drafter.name,
        "settings": {"max_new_tokens": settings.max_new_tokens, "batch_size": settings.batch_size, "chat": chat,
                     "seed": settings.seed, "ignore_eos": settings.ignore_eos, "prompts": len(recs),
                     "median_prompt_tokens": plen, **sampling_key(settings)},
        "alpha": {k: alpha[k] for k in ("alpha", "positions", "coverage", "by_category", "per_prompt", "method",
                                        "alpha_by_position") if k in alpha},
        # one number for the plot and summaries: c(γ) at the recommended γ (the table uses c(γ) per γ)
        "c": costs["c"][best["gamma"] - 1],
        "c_by_gamma": costs["c"],
        "v": costs["v"],
        "costs": {k: costs[k] for k in ("t_target_ms", "t_draft_ms", "batch", "buffer_len", "interpolated",
                                        "repeats", "method")},
        "table": rows,
        "recommended_gamma": best["gamma"],
        "predicted_speedup": best["speedup"],
        "optimal_gamma_textbook": best_tb["gamma"],
        "oracle_bound": float(analysis.oracle_bound(a)),
        "speculation_pays": bool(best["speedup"] > 1.0),
        "measured": [],
        "trees": [],
    }


def _measured_entry(a: float, g: int, run: dict, row: dict, alpha: dict, settings: DecodeSettings) -> dict:
    """One ``measured`` entry of the report: :func:`compare` plus per-category α, E(N) and τ."""
    cmp = compare(a, g, run, row, coverage=alpha["coverage"])
    by_cat = {}
    for cat, ca in alpha["by_category"].items():
        ac = 0.0 if ca["alpha"] is None else ca["alpha"]
        by_cat[cat] = {"alpha": ca["alpha"], "expected_tokens": float(analysis.expected_tokens(ac, g)),
                       "mean_accepted_tokens": run["spec"]["by_category"].get(cat, {}).get("mean_accepted_tokens")}
    cmp["by_category"] = by_cat
    cmp["accept_hist"] = run["spec"]["accept_hist"]
    cmp["ar_tokens_match"] = run["tokens"] == run["ar_tokens"] if settings.temperature == 0 else None
    return cmp
