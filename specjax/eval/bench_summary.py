"""``specjax bench``'s aggregation, shared with ``benchmarks/`` (part of :mod:`specjax.eval.bench`,
which re-exports it): a benchmarked method (:class:`MethodSpec`), its batch records pooled as
:class:`~specjax.runtime.stats.RunStats` (tokens/s, τ, acceptance, bandwidth), and speedups
against each method's baseline."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from specjax.runtime.stats import RunStats, ratio

SUMMARY_FIELDS = ("tokens_per_s", "speedup", "speedup_decode_time", "mean_accepted_tokens", "acceptance_rate",
                  "new_tokens", "target_calls", "accepted_tokens", "checked_tokens", "prompts", "decode_s",
                  "prefill_s", "wall_s", "bandwidth_gb_s")


@dataclasses.dataclass
class MethodSpec:
    """One benchmarked method. ``drafter_bytes``: weight bytes read per drafter forward step."""

    name: str
    drafter: str | None
    gamma: int | None
    dtype: str
    target_bytes: int
    drafter_bytes: int = 0
    compile_s: float = 0.0
    warmup_s: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)


def aggregate(batches: Iterable[dict], spec: MethodSpec) -> dict:
    """Summary of batch records: each ``{"decode_s", "prefill_s", "wall_s", "calls",
    "draft_steps", "rows": [{"new_tokens", "stats": {"target_calls", "accepted_tokens",
    "checked_tokens", ...}}]}`` (see the module docstring for the definitions), the counters
    pooled as :class:`RunStats` (a batch's seconds counted once)."""
    total = RunStats()
    wall = 0.0
    bytes_read = 0
    for b in batches:
        rows = [dict(r["stats"], new_tokens=r["new_tokens"]) for r in b["rows"]]
        total += RunStats.from_batch(rows, decode_s=b["decode_s"], prefill_s=b["prefill_s"])
        wall += b["wall_s"]
        bytes_read += b["calls"] * spec.target_bytes + b["draft_steps"] * spec.drafter_bytes
    drafting = spec.drafter is not None
    dec = total.decode_s
    return {
        "tokens_per_s": total.tokens_per_s,
        "speedup": None,
        "speedup_decode_time": None,
        "mean_accepted_tokens": total.mean_accepted_tokens,
        "acceptance_rate": total.acceptance_rate if drafting else None,
        "acceptance_by_position": total.acceptance_by_position if drafting else None,
        "new_tokens": total.new_tokens,
        "target_calls": total.target_calls,
        "accepted_tokens": total.accepted_tokens if drafting else None,
        "checked_tokens": total.checked_tokens if drafting else None,
        "prompts": total.rows,
        "decode_s": dec,
        "prefill_s": total.prefill_s,
        "wall_s": wall,
        "bandwidth_gb_s": bytes_read / dec / 1e9 if dec > 0 else None,
        "bytes_read": bytes_read,
    }


def summarize(specs: Sequence[MethodSpec], batch_records: dict[str, list[dict]],
              baseline_of: dict[str, str]) -> dict:
    """``{"<method>": {"drafter", "gamma", "dtype", "baseline", "overall", "per_category",
    "compile_s", "warmup_s", ...}}`` with speedups against each method's baseline."""
    out: dict[str, dict] = {}
    for spec in specs:
        recs = batch_records.get(spec.name, [])
        cats: dict[str, list[dict]] = {}
        for b in recs:
            cats.setdefault(b["category"], []).append(b)
        out[spec.name] = {
            "drafter": spec.drafter,
            "gamma": spec.gamma,
            "dtype": spec.dtype,
            "baseline": baseline_of.get(spec.name),
            "target_weight_bytes": spec.target_bytes,
            "drafter_weight_bytes": spec.drafter_bytes,
            "compile_s": spec.compile_s,
            "warmup_s": spec.warmup_s,
            **spec.extra,
            "overall": aggregate(recs, spec),
            "per_category": {c: aggregate(bs, spec) for c, bs in cats.items()},
        }
    for name, m in out.items():
        base = out.get(m["baseline"]) if m["baseline"] else None
        pairs = [(m["overall"], base["overall"] if base else None)]
        pairs += [(v, base["per_category"].get(c) if base else None) for c, v in m["per_category"].items()]
        for mine, ref in pairs:
            if ref is None:
                continue
            mine["speedup"] = ratio(mine["tokens_per_s"], ref["tokens_per_s"])
            mine["speedup_decode_time"] = ratio(ref["decode_s"], mine["decode_s"])
    return out


def method_name(label: str | None, gamma: int | None, dtype: str, multi_dtype: bool, tree=None) -> str:
    """``ar``, ``<label>@γ<g>`` or ``<label>@tree(N..,D..,K..)`` (+ ``/<dtype>`` when several formats run)."""
    base = "ar" if label is None else f"{label}@{tree.label}" if tree is not None else f"{label}@γ{gamma}"
    return f"{base}/{dtype}" if multi_dtype else base


def baselines(specs: Sequence[MethodSpec], multi_dtype: bool) -> dict[str, str]:
    """Each method's baseline: the float32 ``ar`` when present, else the ``ar`` of its dtype."""
    ar = {s.dtype: s.name for s in specs if s.drafter is None}
    ref32 = ar.get("float32")
    return {s.name: ref32 or ar.get(s.dtype) for s in specs}
