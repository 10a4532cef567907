"""``specjax bench``: throughput of the autoregressive baseline and of every drafter × γ
on a prompts file (Spec-Bench ``question.jsonl`` works as is), per category and overall.

    specjax bench --prompts question.jsonl --limit 5 --draft ngram default --gamma 3 4 \\
        --max-new-tokens 128 --ignore-eos --out results.json

What is measured, per method (``ar``, ``<drafter>@γ<g>``, ``<drafter>@tree(N<n>,D<d>,K<k>)`` for a
draft tree, suffixed ``/<dtype>`` when several weight formats are run) and per category:

* ``tokens_per_s``: new tokens ÷ decode seconds (the jitted decode loop after prefill;
  compilation and the warm-up batch are excluded and reported as ``compile_s`` /
  ``warmup_s``);
* ``speedup``: tokens/s ÷ the baseline's tokens/s on the same prompts in the same run
  (``speedup_decode_time``: the baseline's decode seconds ÷ the method's, equal to
  ``speedup`` when every method makes the same number of tokens, e.g. ``--ignore-eos``).
  The baseline is the float32 ``ar`` when float32 is among ``--dtype``, otherwise the
  ``ar`` of the method's own format;
* ``mean_accepted_tokens`` (τ): new tokens ÷ target calls (each row's calls after prefill);
* ``acceptance_rate``: accepted ÷ checked draft tokens (``null`` for ``ar``);
* ``acceptance_by_position``: α_k per draft position k (tree depth k) from the rounds' accepted
  counts (:attr:`specjax.runtime.stats.RunStats.acceptance_by_position`; ``null`` for ``ar``);
* ``wall_s``: seconds of the timed ``generate`` calls (prefill + decode + host work);
* ``bandwidth_gb_s``: weight bytes read ÷ decode seconds, with bytes read per batch =
  ``batch target calls × target weight bytes + batch draft steps × drafter weight bytes``
  (a batched call reads the weights once for all rows: batch calls = the largest per-row
  count in the batch; a draft-model round is γ drafter forward steps; n-gram drafting
  reads no weights). KV cache and activations are not counted, so it is a lower bound.

Methods are interleaved per batch (``ar``, then each drafter × γ on the same batch) so a
drift in machine speed hits every method alike. Batches never mix categories. Every
prompt uses the request key ``fold_in(PRNGKey(seed), index)`` whatever the method.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import time
from typing import Any, Sequence

import numpy as np

from specjax.core.settings import as_dict
from specjax.eval.bench_io import (  # noqa: F401  (re-exported: bench is the public module)
    json_default, check_out_path, check_writable, filter_split, machine_info, make_batches, select_prompts,
    split_categories, write_json,
)
from specjax.eval.bench_summary import (  # noqa: F401  (re-exported, shared with benchmarks/)
    SUMMARY_FIELDS, MethodSpec, aggregate, baselines, method_name, summarize,
)
from specjax.drafters import registry
from specjax.runtime.request import as_json as request_json
from specjax.runtime.settings import DecodeSettings
from specjax.runtime.stats import tokens_per_second

BANDWIDTH_FORMULA = (
    "bandwidth_gb_s = sum over batches of (batch_target_calls * target_weight_bytes + "
    "batch_draft_steps * drafter_weight_bytes) / decode_s / 1e9; batch_*: the largest per-row count in "
    "the batch (one batched call reads the weights once); draft-model rounds = gamma drafter steps; "
    "n-gram drafting reads no weights; KV cache and activations not counted (lower bound)"
)
TIMING_NOTE = (
    "tokens_per_s = new tokens / decode_s (jitted decode loop after prefill); compilation and the "
    "warm-up batch of each method are excluded (compile_s, warmup_s); wall_s = timed generate calls "
    "(prefill + decode + host work, compilation excluded)"
)


# --------------------------------------------------------------------------- the run
def _drafter_label(spec: str, drafter) -> str:
    kind = registry.find_kind(spec)
    if kind is not None and kind.name in ("ngram", "default"):  # the n-gram's name says its N
        return drafter.name if kind.name == "ngram" else "default"
    return os.path.basename(os.path.normpath(os.path.expanduser(spec))) or spec


def _load_drafter(spec: str, target, dtype: str):
    from specjax.api import load_drafter

    try:
        return load_drafter(spec, target, dtype=dtype)
    except ImportError as e:
        if registry.find_kind(spec) is registry.KINDS["default"]:
            raise ValueError(f"--draft default: no trained drafter is available in this install ({e}); "
                         "train one with `specjax distill` or pass a drafter path") from None
        raise


def _batch_record(method: str, category: str, bi: int, rows_meta: list[dict], res, wall: float, draft_steps_per_call: int) -> dict:
    calls = max((s["target_calls"] for s in res.stats), default=0)
    draft_calls = max((s["draft_calls"] for s in res.stats), default=0)
    rows = []
    for meta, toks, st in zip(rows_meta, res.tokens, res.stats):
        rows.append({"question_id": meta["question_id"], "category": meta["category"], "new_tokens": len(toks),
                     "stats": dict(st), "tokens": toks})
    return {"method": method, "category": category, "batch": bi, "batch_size": len(rows_meta),
            "decode_s": res.decode_s, "prefill_s": res.prefill_s, "wall_s": max(0.0, wall - res.compile_s),
            "calls": calls, "draft_steps": draft_calls * draft_steps_per_call, "rows": rows}


def run_bench(
    prompts: list[dict],
    settings: DecodeSettings | None = None,
    *,
    model: str | None = None,
    drafts: Sequence[str] = ("ngram",),
    gammas: Sequence[int] = (4,),
    trees: Sequence = (),
    dtypes: Sequence[str] = ("float32",),
    draft_dtype: str | None = None,
    parse_special: bool = True,
    chat: bool | None = None,
    warmup: int = 1,
    mesh=None,
    progress: bool = True,
    log=None,
    max_model_len: int | None = None,
) -> dict:
    """Run the benchmark; returns ``{"config", "methods", "prompts"}`` (see module docstring).

    Args:
      prompts: records ``{"prompt", "question_id", "category"}`` (:func:`specjax.io.prompts.read_prompts`).
      settings: sampling, ``max_new_tokens``, seed, ``batch_size`` (prompts per batch, never
        mixing categories; ``None``: a category at once), ``ignore_eos`` (default
        ``DecodeSettings(batch_size=1)``). Prompt i uses request key ``fold_in(seed_key(seed), i)``.
      drafts / gammas / dtypes: the methods (every drafter × γ, per weight format).
      trees: draft tree shapes (:class:`specjax.core.drafting.TreeShape`), each another method
        per drafter (``<drafter>@tree(N..,D..,K..)``; ``gamma`` in its results is the depth D).
      warmup: untimed runs of the first batch per method.
      max_model_len: cap the target's context at this many tokens (``load_model(max_model_len=)``).
    Raises:
      ValueError: two methods with one name; a drafter that cannot be loaded.
    """
    from tqdm import tqdm

    settings = DecodeSettings(batch_size=1) if settings is None else settings
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    drafts = [d for d in dict.fromkeys(drafts) if d not in (None, "none")]
    gammas = list(dict.fromkeys(int(g) for g in gammas))
    trees = list(dict.fromkeys(trees))
    dtypes = list(dict.fromkeys(dtypes))
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t_all = time.perf_counter()
    run = BenchRun(prompts, settings, make_batches(prompts, settings.batch_size or len(prompts)))
    run.parse_special = parse_special
    run.max_model_len = max_model_len
    # disable=None: tqdm shows the bar only when stderr is a terminal (no \r lines in logs)
    bar = tqdm(total=len(run.batches) * len(dtypes) * (1 + len(drafts) * (len(gammas) + len(trees))), desc="bench",
               unit="batch",
               file=sys.stderr, disable=None if progress else True, dynamic_ncols=True)
    if progress and bar.disable:  # not a terminal (a log, a pipe, a notebook cell): plain lines instead
        run.say, run.t0 = log, t_all
    try:
        for dtype in dtypes:
            log(f"specjax bench: loading target ({dtype})")
            run.bench_dtype(model, dtype, draft_dtype or dtype, drafts, gammas, trees, len(dtypes) > 1, chat,
                            warmup, mesh, bar)
    finally:
        bar.close()
    for recs in run.records.values():
        for b in recs:
            for r in b["rows"]:
                r.pop("tokens", None)
    base = baselines(run.specs, len(dtypes) > 1)
    config = bench_config(prompts, settings, run, base, started=started, total_s=time.perf_counter() - t_all,
                           model=model, drafts=drafts, gammas=gammas, trees=trees, dtypes=dtypes,
                           draft_dtype=draft_dtype,
                           chat=chat, warmup=warmup)
    return {"config": config, "methods": summarize(run.specs, run.records, base), "prompts": run.prompt_records}


class BenchRun:
    """The state of one :func:`run_bench`: methods, batch records and per-prompt records."""

    parse_special: bool = True  # how the prompt texts are tokenized (api.encode_prompts)
    max_model_len: int | None = None  # the target's context cap (load_model(max_model_len=))
    chat: bool | None = None  # the chat-template choice the run used

    def __init__(self, prompts: list[dict], settings: DecodeSettings, batches: list[list[int]]):
        from specjax.runtime.decoder import request_keys

        self.prompts, self.settings, self.batches = prompts, settings, batches
        # prompt i's key is fold_in(seed_key(seed), i) whatever its batch (one vectorized fold_in)
        self.keys = request_keys(settings.seed, len(prompts))
        self.specs: list[MethodSpec] = []
        self.records: dict[str, list[dict]] = {}
        self.prompt_records: list[dict] = []
        self.weight_bytes: dict[str, dict] = {}
        self.model_name = None
        self.say = None  # progress lines where there is no bar: ``say(msg)``
        self.t0 = time.perf_counter()

    def _say(self, msg: str) -> None:
        if self.say is not None:
            self.say(f"specjax bench: {msg} ({time.perf_counter() - self.t0:.0f} s elapsed)")

    def bench_dtype(self, model, dtype, ddtype, drafts, gammas, trees, multi, chat, warmup, mesh, bar) -> None:
        """Load the target in ``dtype``, then warm up and time every method on every batch."""
        from specjax.api import encode_prompts
        from specjax.io.loading import load_model

        target = load_model(model, dtype=dtype, max_model_len=self.max_model_len)
        self.model_name = target.name
        if chat is None:  # the rule of every command (cli.common.chat_default): the model's template if any
            chat = target.tokenizer is not None and bool(target.tokenizer.chat_template)
        self.chat = chat
        ids = encode_prompts(target, [p["prompt"] for p in self.prompts], chat, parse_special=self.parse_special)
        methods = self._methods(target, dtype, ddtype, drafts, gammas, trees, multi, mesh)
        for s, dec, _ in methods:  # warm-up: compile + first runs on the first batch, untimed
            for _ in range(max(0, warmup)):
                bar.set_postfix_str(f"warm-up {s.name}")
                res, wall = self._generate(dec, ids, 0)
                s.compile_s += res.compile_s
                s.warmup_s += max(0.0, wall - res.compile_s)
            if warmup > 0:
                self._say(f"warm-up {s.name}: compile {s.compile_s:.1f} s, first batch {s.warmup_s:.1f} s")
        n = len(self.batches)
        for bi in range(n):  # timed: methods interleaved per batch
            self._timed_batch(methods, ids, bi, bar)
            if bi + 1 == n or (bi + 1) % max(1, n // 10) == 0:
                self._say(f"{dtype}: batch {bi + 1}/{n} timed ({len(methods)} methods)")

    def _methods(self, target, dtype, ddtype, drafts, gammas, trees, multi, mesh) -> list[tuple[MethodSpec, Any, int]]:
        """``(spec, decoder, drafter forward steps per round)`` of ``ar`` and every drafter × (γ and tree)."""
        from specjax.models import llama
        from specjax.runtime.decoder import Decoder

        tbytes = llama.param_bytes(target.params)
        self.weight_bytes[dtype] = {"target": tbytes}
        methods = [(MethodSpec(method_name(None, None, dtype, multi), None, None, dtype, tbytes),
                    Decoder(target, None, mesh=mesh), 0)]
        for dspec in drafts:
            drafter = _load_drafter(dspec, target, ddtype)
            label = _drafter_label(dspec, drafter)
            params = getattr(drafter, "params", None)
            dbytes = llama.param_bytes(params) if params is not None else 0
            self.weight_bytes[dtype][label] = dbytes
            for g in gammas:
                s = MethodSpec(method_name(label, g, dtype, multi), label, g, dtype, tbytes, dbytes,
                               extra={"draft_spec": dspec, "draft_dtype": ddtype})
                methods.append((s, Decoder(target, drafter, g, mesh=mesh), drafter.chain_passes(g) if dbytes else 0))
            for t in trees:  # the drafter's passes per tree round (its declared cost shape)
                s = MethodSpec(method_name(label, t.depth, dtype, multi, tree=t), label, t.depth, dtype, tbytes,
                               dbytes, extra={"draft_spec": dspec, "draft_dtype": ddtype,
                                              "tree": {"nodes": t.nodes, "depth": t.depth, "topk": t.topk}})
                dec = Decoder(target, drafter, mesh=mesh, tree_nodes=t.nodes, tree_depth=t.depth, tree_topk=t.topk)
                methods.append((s, dec, drafter.tree_passes(t) if dbytes else 0))
        for s, _, _ in methods:
            if s.name in self.records:
                raise ValueError(f"two methods are both named {s.name!r}; give distinct --draft values")
            self.records[s.name] = []
            self.specs.append(s)
        return methods

    def _generate(self, dec, ids, bi: int):
        """Decode batch ``bi``; returns ``(GenerationResult, wall seconds)``."""
        idx = self.batches[bi]
        st = self.settings
        t0 = time.perf_counter()
        res = dec.generate([ids[i] for i in idx], max_new_tokens=st.max_new_tokens, sampling=st.params(len(idx)),
                           keys=self.keys[np.asarray(idx)], eos_ids=st.eos_ids())
        return res, time.perf_counter() - t0

    def _timed_batch(self, methods, ids, bi: int, bar) -> None:
        """Run every method on batch ``bi``: a batch record each, and a record per prompt."""
        idx = self.batches[bi]
        cat = self.prompts[idx[0]]["category"]
        ar_tokens = None
        for s, dec, steps in methods:
            bar.set_postfix_str(s.name)
            res, wall = self._generate(dec, ids, bi)
            s.compile_s += res.compile_s
            rec = _batch_record(s.name, cat, bi, [self.prompts[i] for i in idx], res, wall, steps)
            self.records[s.name].append(rec)
            if s.drafter is None:
                ar_tokens = res.tokens
            for j, row in enumerate(rec["rows"]):
                same = None
                if self.settings.temperature == 0 and s.drafter is not None and ar_tokens is not None:
                    same = row["tokens"] == ar_tokens[j]
                self.prompt_records.append({
                    "method": s.name, "question_id": row["question_id"], "category": row["category"],
                    "batch": bi, "batch_size": len(idx), "prompt_tokens": len(ids[idx[j]]),
                    "new_tokens": row["new_tokens"], "decode_s": res.decode_s, "prefill_s": res.prefill_s,
                    "tokens_per_s": tokens_per_second(row["new_tokens"], res.decode_s),
                    "same_as_ar": same, "stats": row["stats"],
                })
            bar.update(1)


def bench_config(prompts, settings: DecodeSettings, run: BenchRun, base: dict, **kw) -> dict:
    """The ``config`` section of :func:`run_bench`'s results."""
    mismatches = sum(1 for r in run.prompt_records if r["same_as_ar"] is False)
    cats: dict[str, int] = {}
    for p in prompts:
        cats[p["category"]] = cats.get(p["category"], 0) + 1
    dtypes = kw["dtypes"]
    return {
        "library": "specjax",
        "started_at": kw["started"],
        "total_s": kw["total_s"],
        "model": kw["model"] or "default",
        "model_name": run.model_name,
        "drafts": list(kw["drafts"]),
        "gammas": kw["gammas"],
        "trees": [{"nodes": t.nodes, "depth": t.depth, "topk": t.topk, "label": t.label} for t in kw["trees"]],
        "dtypes": dtypes,
        "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "draft_dtype": kw["draft_dtype"],
        "temperature": settings.temperature,  # (kept at the top level: documented before "sampling")
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "sampling": as_dict(settings.sampling),  # every declared sampling field
        **request_json(settings.request),  # every declared request field (seed, max_new_tokens, ignore_eos, ...)
        "batch_size": settings.batch_size,
        "chat": run.chat if kw["chat"] is None else kw["chat"],
        "parse_special": run.parse_special,
        "warmup": kw["warmup"],
        "num_prompts": len(prompts),
        "prompts_per_category": cats,
        "weight_bytes": run.weight_bytes,
        "baselines": base,
        "greedy_mismatches_vs_ar": mismatches if settings.temperature == 0 else None,
        "bandwidth_formula": BANDWIDTH_FORMULA,
        "timing": TIMING_NOTE,
        "machine": machine_info(),
    }
