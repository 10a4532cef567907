"""Markdown reports of the evaluation results (for people; the JSON is for machines):
:func:`markdown_tables` for ``specjax bench`` results, :func:`render_models` for a
``specjax analyze`` models report. Notebooks and scripts import them from here (no CLI module)."""

from __future__ import annotations

from specjax.eval import theory as analysis


def _f(x, fmt="{:.2f}", dash="–"):
    return dash if x is None else fmt.format(x)


def markdown_tables(results: dict) -> str:
    """Markdown of :func:`specjax.eval.bench.run_bench`'s results (``{"methods": ...}``): an
    overall table (one row per method: tokens/s, speedups, τ, acceptance, new tokens,
    seconds, GB/s) and a per-category table (tokens/s · speedup · τ); ``–`` for a missing value."""
    methods = results["methods"]
    fid = results.get("fidelity") or {}
    lines = [
        "| method | tokens/s | speedup | speedup (decode time) | τ tokens/call | acceptance | new tokens "
        "| decode s | wall s | GB/s | compile s | format: KL vs float32 · top-1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in methods.items():
        o = m["overall"]
        f = fid.get(m.get("dtype"))
        fcell = "–" if not f else (f"{m['dtype']}: {f['mean_kl']:.2g} · {100 * f['top1_agreement']:.1f}%"
                                   + ("" if f["faithful"] else " (not faithful)"))
        lines.append(
            f"| {name} | {_f(o['tokens_per_s'], '{:.1f}')} | {_f(o['speedup'], '{:.2f}×')} "
            f"| {_f(o['speedup_decode_time'], '{:.2f}×')} | {_f(o['mean_accepted_tokens'])} "
            f"| {_f(o['acceptance_rate'], '{:.3f}')} | {o['new_tokens']} | {_f(o['decode_s'], '{:.2f}')} "
            f"| {_f(o['wall_s'], '{:.2f}')} | {_f(o['bandwidth_gb_s'], '{:.1f}')} | {_f(m.get('compile_s'), '{:.1f}')} "
            f"| {fcell} |"
        )
    cats: list[str] = []
    for m in methods.values():
        for c in m["per_category"]:
            if c not in cats:
                cats.append(c)
    if cats:
        names = list(methods)
        lines += ["", "Per category: tokens/s · speedup · τ", "",
                  "| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for c in cats:
            cells = []
            for n in names:
                v = methods[n]["per_category"].get(c)
                cells.append("–" if v is None else
                             f"{_f(v['tokens_per_s'], '{:.1f}')} · {_f(v['speedup'], '{:.2f}×')} · "
                             f"{_f(v['mean_accepted_tokens'])}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_models(rep: dict) -> str:
    """Markdown of a ``specjax analyze`` models report (:func:`specjax.eval.measure.analyze_pair`'s
    dict, or its JSON read back: integer keys may be strings): α per category, the costs
    c(γ)/v(γ), the predicted table, per measured γ predicted vs measured, and with draft trees
    a table of shapes (c_tree, v(N), predicted vs measured τ and speedup, next to the best
    chain) and the recommendation line (docs/analyze.md).

    Raises:
      KeyError: ``rep`` is not such a report (e.g. a numbers-only report).
    """
    st = rep["settings"]
    al = rep["alpha"]
    sampling = "greedy" if st["temperature"] == 0 else f"T={st['temperature']:g}, top-k {st['top_k']}, top-p {st['top_p']:g}"
    out = [
        f"## specjax analyze: target {rep['target']} + drafter {rep['drafter']}",
        "",
        f"{st['prompts']} prompts (median {st['median_prompt_tokens']} tokens), ≤ {st['max_new_tokens']} new tokens, "
        f"{sampling}, batch {st['batch_size']}{', chat template' if st['chat'] else ''}",
        "",
        "### Acceptance rate α = E[Σ min(p, q)] along the target's own output",
        "",
    ]
    cat_rows = [{"category": c, "prompts": v["prompts"], "positions": v["positions"], "alpha": v["alpha"]}
                for c, v in sorted(al["by_category"].items())]
    cat_rows.append({"category": "**all**", "prompts": st["prompts"], "positions": al["positions"], "alpha": al["alpha"]})
    out.append(analysis.format_table(cat_rows))
    if al["coverage"] < 1.0:
        out.append(f"\nα counts positions with a proposal only: {al['coverage']:.1%} of positions had one.")
    co = rep["costs"]
    t1 = co["t_target_ms"][1] if 1 in co["t_target_ms"] else co["t_target_ms"]["1"]
    out += ["", f"### Costs (batch {co['batch']}): t_target(1 token) = {t1:.2f} ms, "
            f"c = {rep['c']:.4f} at the recommended γ = {rep['recommended_gamma']}", ""]
    crow = []
    for i, g in enumerate(range(1, len(rep["v"]) + 1)):
        tt = co["t_target_ms"].get(g + 1, co["t_target_ms"].get(str(g + 1)))
        td = co["t_draft_ms"].get(g, co["t_draft_ms"].get(str(g)))
        crow.append({"gamma": g, "t_draft_ms": td if td is not None else "interp.", "c": rep["c_by_gamma"][i],
                     "t_target_ms": tt if tt is not None else "interp.", "v": rep["v"][i]})
    out.append(analysis.format_table(crow))
    out += ["", f"### Predicted (α = {al['alpha']:.4f}, measured c(γ) and v(γ); textbook: v = 1)", "",
            analysis.format_table(rep["table"]), "",
            f"recommended γ = {rep['recommended_gamma']} (predicted speedup {rep['predicted_speedup']:.3f}×"
            f"{'' if rep['speculation_pays'] else ': speculation does not pay with this drafter'}); "
            f"textbook optimum γ = {rep['optimal_gamma_textbook']}; oracle bound 1/(1−α) = {rep['oracle_bound']:.3f}"]
    for m in rep["measured"]:
        out += _render_measured(m)
    if rep.get("trees"):
        out += _render_trees(rep)
    return "\n".join(out)


def _render_trees(rep: dict) -> list[str]:
    """The draft-tree section of :func:`render_models`: one row per shape (predicted next to
    measured τ and speedup) with the best chain's measured row first, and the recommendation."""
    chain = next((m for m in rep["measured"] if m["gamma"] == rep["recommended_gamma"]), None)
    rows = []
    if chain is not None:
        rows.append({"shape": f"chain γ={chain['gamma']}", "c_tree": rep["c_by_gamma"][chain["gamma"] - 1] * chain["gamma"]
                     if chain["gamma"] <= len(rep["c_by_gamma"]) else None,
                     "v": rep["v"][chain["gamma"] - 1] if chain["gamma"] <= len(rep["v"]) else None,
                     "τ predicted": chain["expected_tokens"], "τ measured": chain["mean_accepted_tokens"],
                     "speedup predicted": chain["predicted_speedup"], "speedup measured": chain["measured_speedup"]})
    for t in rep["trees"]:
        rows.append({"shape": t["shape"], "c_tree": t["c_tree"], "v": t["v"], "τ predicted": t["expected_tokens"],
                     "τ measured": t.get("mean_accepted_tokens"), "speedup predicted": t["predicted_speedup"],
                     "speedup measured": t.get("measured_speedup")})
    out = ["", f"### Draft trees N×D×K (α = {rep['alpha']['alpha']:.4f}: a_r = α(1−α)^(r−1) per child rank r; "
               "measured c_tree = drafter's tree ÷ t_target(1), v(N) = t_target(N+1 tokens, tree mask) ÷ t_target(1))",
           "", analysis.format_table([{k: ("–" if v is None else v) for k, v in r.items()} for r in rows])]
    adj = [t for t in rep["trees"] if "predicted_speedup_coverage_adjusted" in t]
    if adj:
        out.append("\ncoverage-adjusted predictions (plain steps where nothing is proposed, "
                   f"{adj[0]['coverage']:.0%} proposed): "
                   + ", ".join(f"{t['shape']}: τ {t['expected_tokens_coverage_adjusted']:.3f}, "
                               f"{t['predicted_speedup_coverage_adjusted']:.3f}×" for t in adj))
    hists = [t for t in rep["trees"] if t.get("accept_hist")]
    if hists:
        out.append("\nrounds by accepted depth 0..D (the loop's accept_hist): "
                   + "; ".join(f"{t['shape']}: {t['accept_hist']}" for t in hists))
    if rep.get("recommended"):
        out += ["", recommendation_line(rep["recommended"])]
    return out


def recommendation_line(rec: dict) -> str:
    """The recommendation of an analyze report (its ``recommended`` dict), one line:
    ``recommended: draft tree 16x5x3 (N×D×K), measured speedup 1.234×`` or a chain's γ."""
    what = f"draft tree {rec['shape']} (N×D×K)" if rec["kind"] == "tree" else f"chain, γ = {rec['gamma']}"
    sp = rec["speedup"]
    return f"recommended: {what}, {rec['basis']} speedup {'–' if sp is None else f'{sp:.3f}×'}"


def _render_measured(m: dict) -> list[str]:
    """One chain run of :func:`render_models` (``m``: a ``measured`` entry)."""
    out = ["", f"### Measured at γ = {m['gamma']} (real decode loop, interleaved with autoregressive)", ""]
    rows = [
        {"quantity": "tokens per target call", "predicted": m["expected_tokens"],
         "measured": m["mean_accepted_tokens"], "difference": m["tokens_discrepancy"],
         "note": "E(N) from α vs mean_accepted_tokens (acceptances are not independent)"},
        {"quantity": "acceptance rate", "predicted": m["alpha"], "measured": m["acceptance_rate"],
         "difference": None if m["acceptance_rate"] is None else m["acceptance_rate"] - m["alpha"],
         "note": "α (Σmin) vs accepted ÷ checked drafts"},
        {"quantity": "speedup (×)", "predicted": m["predicted_speedup"], "measured": m["measured_speedup"],
         "difference": m["predicted_speedup"] - m["measured_speedup"],
         "note": f"relative error {m['speedup_relative_error']:+.1%}"},
        {"quantity": "speedup, textbook v = 1", "predicted": m["predicted_speedup_textbook"],
         "measured": m["measured_speedup"], "difference": m["predicted_speedup_textbook"] - m["measured_speedup"],
         "note": ""},
        {"quantity": "speedup from measured tokens/call", "predicted": m["predicted_speedup_from_measured_tokens"],
         "measured": m["measured_speedup"],
         "difference": m["predicted_speedup_from_measured_tokens"] - m["measured_speedup"],
         "note": "mean_accepted_tokens ÷ (γc + v): the cost model alone"},
    ]
    if "predicted_speedup_coverage_adjusted" in m:
        rows.append({"quantity": "speedup, coverage-adjusted", "predicted": m["predicted_speedup_coverage_adjusted"],
                     "measured": m["measured_speedup"],
                     "difference": m["predicted_speedup_coverage_adjusted"] - m["measured_speedup"],
                     "note": f"plain steps where nothing is proposed ({m['coverage']:.0%} proposed)"})
    out.append(analysis.format_table(rows))
    out.append(f"\ntokens/s: speculative {m['tokens_per_s_spec']:.2f}, autoregressive {m['tokens_per_s_ar']:.2f}"
               + ("" if m.get("ar_tokens_match") is None else
                  f"; greedy outputs identical: {m['ar_tokens_match']}"))
    out += ["", analysis.format_table([
        {"category": c, "alpha": v["alpha"], "E(N)": v["expected_tokens"],
         "mean_accepted_tokens": v["mean_accepted_tokens"]} for c, v in sorted(m["by_category"].items())])]
    return out
