"""The speculative run itself, next to the theory: :func:`measure_speedup` runs the real
decode loop, autoregressive and speculative interleaved batch by batch, and pools the counters
with :class:`~specjax.runtime.stats.RunStats`; :func:`compare` puts the theory's predictions at
the measured α next to it. Part of :mod:`specjax.eval.measure` (which re-exports these).
"""

from __future__ import annotations

import statistics
import sys
from typing import Sequence

import numpy as np

from specjax.eval import theory as analysis
from specjax.runtime.stats import RunStats, difference, ratio
from specjax.runtime.decoder import Decoder
from specjax.runtime.settings import DecodeSettings


def progress_bar(iterable, desc: str, total: int | None = None, enabled: bool = False):
    """``iterable`` with a tqdm bar on stderr when ``enabled`` and stderr is a terminal
    (``disable=None``: no carriage-return lines in logs; stdout is never written)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, disable=None if enabled else True, leave=False,
                dynamic_ncols=True)


# --------------------------------------------------------------------------- (c) speedup
def _decode_batches(dec: Decoder, prompts, settings: DecodeSettings):
    """Yield ``(rows, run)`` per batch of ``settings.batch_size`` prompts, where ``run()``
    decodes the batch (request keys by prompt index) and returns a GenerationResult."""
    ids = [p["ids"] for p in prompts]
    for rows in settings.batches(len(ids)):
        chunk = [ids[i] for i in rows]

        def run(chunk=chunk, lo=rows.start):
            return dec.generate(chunk, max_new_tokens=settings.max_new_tokens, sampling=settings.params(len(chunk)),
                                seed=settings.seed, seed_offset=lo, eos_ids=settings.eos_ids())
        yield list(rows), run


def _summarise(prompts, results, times, label):
    """Pool per-prompt stats of one decoder over all batches (:class:`RunStats`); returns
    ``(summary, new tokens per prompt)``. ``times``: decode seconds per batch."""
    per, toks = [], []
    for rows, r in results:
        for i, t, st in zip(rows, r.tokens, r.stats):
            per.append(dict(st, question_id=prompts[i].get("question_id"), category=prompts[i].get("category", "all")))
            toks.append(t)
    total = RunStats.from_batch(per, decode_s=float(sum(times)))
    by_cat: dict[str, RunStats] = {}
    for s in per:
        by_cat[s["category"]] = by_cat.get(s["category"], RunStats()) + RunStats.from_row(s)
    out = {
        "label": label,
        "new_tokens": total.new_tokens,
        "target_calls": total.target_calls,
        "decode_s": total.decode_s,
        "tokens_per_s": total.tokens_per_s,
        "mean_accepted_tokens": total.mean_accepted_tokens,
        "acceptance_rate": total.acceptance_rate,
        "accepted_tokens": total.accepted_tokens,
        "checked_tokens": total.checked_tokens,
        "drafted_tokens": total.drafted_tokens,
        "per_prompt": per,
        "by_category": {c: {"mean_accepted_tokens": v.mean_accepted_tokens, "new_tokens": v.new_tokens}
                        for c, v in by_cat.items()},
        "accept_hist": list(total.accept_hist),
    }
    return out, toks


def measure_speedup(
    target,
    drafter,
    prompts: Sequence[dict],
    gamma: int,
    settings: DecodeSettings | None = None,
    *,
    repeats: int = 1,
    autoregressive: bool = True,
    decoders: dict | None = None,
    progress: bool = False,
    tree=None,
) -> dict:
    """The real decode loop: autoregressive and speculative (γ) on the same prompts,
    interleaved batch by batch (AR, spec, AR, spec, …) so both see the same machine load.
    With ``tree`` (a :class:`~specjax.core.drafting.TreeShape`) the speculative decoder drafts
    trees of that shape instead of chains (``gamma`` is then the tree's depth D).

    Each batch is run ``repeats`` times per decoder after a compile (compile time is
    never counted: :class:`Decoder` compiles ahead of time); per batch the median decode
    time is kept. tokens/s = all new tokens ÷ the sum of those times.

    Args:
      prompts: records from :func:`prompt_records`.
      settings: sampling, length, seed, batch size, EOS (default ``DecodeSettings(batch_size=1)``).
      decoders: optional cache ``{key: Decoder}`` reused across calls (no recompiles).
    Returns:
      dict: ``gamma``, ``spec`` and ``ar`` summaries (``new_tokens``, ``target_calls``,
      ``decode_s`` (seconds), ``tokens_per_s``, ``mean_accepted_tokens`` = new tokens ÷ target
      calls, pooled; ``acceptance_rate`` = accepted ÷ checked, pooled (``None`` for AR or nothing checked);
      ``accept_hist``; ``by_category``; ``per_prompt``), ``speedup`` (spec ÷ AR tokens/s, ``None``
      without AR: no data), ``tokens`` (speculative new tokens per prompt), ``ar_tokens``.
    """
    settings = DecodeSettings(batch_size=1) if settings is None else settings
    decoders = {} if decoders is None else decoders
    if tree is not None:
        gamma = tree.depth
    what = f"γ={gamma}" if tree is None else tree.label
    kinds = [("spec", _decoder(decoders, target, drafter, int(gamma), tree))]
    if autoregressive:
        kinds.insert(0, ("ar", _decoder(decoders, target, None, 0)))
    results, times = _interleaved_runs(kinds, prompts, settings, repeats, f"speedup {what}", progress)
    spec, spec_tokens = _summarise(prompts, results["spec"], times["spec"], f"speculative {what}")
    out = {"gamma": int(gamma), "spec": spec, "tokens": spec_tokens, "repeats": int(repeats)}
    if tree is not None:
        out["tree"] = tree.label
    if autoregressive:
        ar, ar_tokens = _summarise(prompts, results["ar"], times["ar"], "autoregressive")
        out["ar"] = ar
        out["ar_tokens"] = ar_tokens
        out["speedup"] = ratio(spec["tokens_per_s"], ar["tokens_per_s"])
    else:
        out["speedup"] = None
    return out


def _decoder(decoders: dict, target, drafter, gamma: int, tree=None) -> Decoder:
    """The cached Decoder of (target, drafter, γ, tree shape or ``None``) in ``decoders`` (made on first use)."""
    k = (id(target), id(drafter), gamma, tree)
    if k not in decoders:
        kw = {} if tree is None else dict(tree_nodes=tree.nodes, tree_depth=tree.depth, tree_topk=tree.topk)
        decoders[k] = Decoder(target, drafter, gamma, **kw)
    return decoders[k]


def _interleaved_runs(kinds, prompts, settings, repeats, desc, progress):
    """Per decoder kind: the last ``(rows, GenerationResult)`` and the median decode seconds
    of ``repeats`` runs of each batch, kinds interleaved per batch."""
    results = {k: [] for k, _ in kinds}
    times = {k: [] for k, _ in kinds}
    gens = {k: list(_decode_batches(dec, prompts, settings)) for k, dec in kinds}
    for bi in progress_bar(range(len(gens[kinds[0][0]])), desc, enabled=progress):
        per = {k: [] for k, _ in kinds}
        last = {}
        for _ in range(max(1, int(repeats))):
            for k, _dec in kinds:
                rows, run = gens[k][bi]
                r = run()
                per[k].append(r.decode_s)
                last[k] = (rows, r)
        for k, _ in kinds:
            results[k].append(last[k])
            times[k].append(statistics.median(per[k]))
    return results, times


def autoregressive_run(target, prompts, settings: DecodeSettings | None = None, *, decoders: dict | None = None,
                       progress: bool = False) -> dict:
    """The target alone (its own output for :func:`measure_alpha`, and a warm AR decoder).
    Returns ``{"ar": summary (as in :func:`measure_speedup`), "tokens": new tokens per prompt}``."""
    settings = DecodeSettings(batch_size=1) if settings is None else settings
    dec = _decoder({} if decoders is None else decoders, target, None, 0)
    res, times = [], []
    batches = _decode_batches(dec, prompts, settings)
    for rows, run in progress_bar(batches, "target", total=len(settings.batches(len(prompts))), enabled=progress):
        r = run()
        res.append((rows, r))
        times.append(r.decode_s)
    summary, toks = _summarise(prompts, res, times, "autoregressive")
    return {"ar": summary, "tokens": toks}


# --------------------------------------------------------------------------- theory ↔ measurement
def theory_rows(alpha: float, gammas: Sequence[int], c: Sequence[float] | float, v: Sequence[float] | None,
                alphas_by_position: Sequence[float] | None = None) -> list[dict]:
    """:func:`analysis.theory_table` rows with a per-γ measured c(γ) and v(γ): ``cost`` =
    γ c(γ) + v(γ), ``speedup`` = E(N)/cost, ``speedup_textbook`` = E(N)/(γ c(γ) + 1). With
    ``alphas_by_position`` (α_1.. α_γmax, e.g. a block drafter's per-slot rates), E(N) is
    :func:`analysis.expected_tokens_by_position` instead of Equation (1) at ``alpha``."""
    gammas = [int(g) for g in gammas]
    cs = np.broadcast_to(np.asarray(c, float), (len(gammas),))
    vs = np.ones(len(gammas)) if v is None else np.broadcast_to(np.asarray(v, float), (len(gammas),))
    rows = [analysis.theory_table(alpha, float(ci), [g], float(vi))[0] for g, ci, vi in zip(gammas, cs, vs)]
    if alphas_by_position is not None:
        for r, ci in zip(rows, cs):
            e = analysis.expected_tokens_by_position(alphas_by_position, r["gamma"])
            r.update(expected_tokens=e, speedup=e / r["cost"], speedup_textbook=e / (r["gamma"] * float(ci) + 1.0))
    return rows


def best_row(rows: Sequence[dict], key: str = "speedup") -> dict:
    """The row with the largest ``key`` (ties: smallest γ)."""
    return max(rows, key=lambda r: (r[key], -r["gamma"]))


def compare(alpha: float, gamma: int, run: dict, row: dict | None = None, coverage: float = 1.0) -> dict:
    """Predicted (theory at α) next to measured (the loop's counters) at one γ.

    ``expected_tokens`` is E(N) = (1 − α^{γ+1})/(1 − α) (Eq. 1), which assumes each draft
    is accepted independently with probability α; the loop's ``mean_accepted_tokens``
    (new tokens ÷ target calls, bonus/residual token included) differs because real
    acceptances are correlated (easy stretches accept runs of drafts) and because rounds
    are clipped near ``max_new_tokens`` and cut at EOS.

    With ``coverage`` f < 1 (an n-gram drafter proposes at a fraction f of positions; the
    loop takes a plain one-token step elsewhere) a first-order correction is also given,
    taking f as the fraction of rounds with a proposal:
    ``(f E(N) + 1 − f) / (γ c + f v(γ) + 1 − f)``.
    """
    e = float(analysis.expected_tokens(alpha, gamma))
    spec = run["spec"]
    out = {
        "gamma": int(gamma),
        "alpha": float(alpha),
        "expected_tokens": e,
        "mean_accepted_tokens": spec["mean_accepted_tokens"],
        "tokens_discrepancy": difference(spec["mean_accepted_tokens"], e),
        "acceptance_rate": spec["acceptance_rate"],
        "measured_speedup": run.get("speedup"),
        "tokens_per_s_spec": spec["tokens_per_s"],
        "tokens_per_s_ar": run["ar"]["tokens_per_s"] if "ar" in run else None,
    }
    if row is not None:
        out["predicted_speedup"] = row["speedup"]
        out["predicted_speedup_textbook"] = row["speedup_textbook"]
        # the cost model alone: measured tokens per round over the predicted round cost
        out["predicted_speedup_from_measured_tokens"] = ratio(spec["mean_accepted_tokens"], row["cost"])
        if coverage < 1.0:
            f = float(coverage)
            gamma_c = row["expected_tokens"] / row["speedup_textbook"] - 1.0  # textbook cost is γc + 1
            v_g = row["cost"] - gamma_c
            out["coverage"] = f
            out["predicted_speedup_coverage_adjusted"] = (f * e + 1 - f) / (gamma_c + f * v_g + 1 - f)
        ms = out["measured_speedup"]
        out["speedup_relative_error"] = ratio(difference(row["speedup"], ms), ms)
    return out
