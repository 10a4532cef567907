"""``--gamma auto`` and ``--dtype auto`` (part of :mod:`specjax.eval.measure`, which re-exports
them): :func:`recommend` — γ with the largest predicted speedup from costs and α measured quickly
(or read from the measurement cache, :mod:`specjax.eval.hostcache`); :func:`fastest_format` —
the fastest weight format that passes the fidelity bar (:mod:`specjax.eval.fidelity`) on this host."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Sequence

import numpy as np

from specjax.eval.alpha import AUTO_NEW_TOKENS, alpha_by_decoding
from specjax.eval.common import sampling_params, sampling_key, prompt_records
from specjax.eval.costs import median_ms, target_case, measure_costs, timed_programs
from specjax.eval.hostcache import cached_or_measured
from specjax.eval.speedup import best_row, theory_rows
from specjax.models import llama
from specjax.runtime.decoder import Decoder, validate_batch
from specjax.runtime.settings import DecodeSettings

AUTO_PROMPTS = 2  # --gamma auto: α over at most this many prompts × AUTO_NEW_TOKENS (specjax.eval.alpha)
FORMAT_SHAPE = (32, 128)  # --dtype auto: the decode step of a program for 32 prompt + 128 new tokens
AUTO_METHOD = (
    "costs: measure_costs at the decode programs' shapes for the run's prompt bucket and max_new_tokens, timing "
    "gamma = 1 and gamma_max only (target calls of 1, 2 and gamma_max+1 tokens, drafter proposals of 1 and gamma_max "
    "tokens; call times linear in gamma in between); alpha: the target's own continuation decoded with those "
    "programs (plus one prefill call over the prompt bucket), then beta = sum_x min(p, q) per position with q from "
    "the drafter's first proposal after a prefill"
)


def recommend(target, drafter, prompts, settings: DecodeSettings | None = None, *, gamma_max: int = 8,
              chat: bool = False, cache=None, progress=None, timing_repeats: int = 7,
              measure_gammas: Sequence[int] | None = None, batch: int = 1) -> tuple[int, dict]:
    """γ with the largest predicted speedup for this pair (``specjax generate --gamma auto``),
    from costs and α measured quickly, or read from ``cache``.

    * costs c(γ), v(γ) (:func:`measure_costs` at ``batch`` rows — the run's batch size: at larger
      batches a (γ+1)-token verification costs relatively more, so a γ that pays at batch 1 may not —
      with the decode programs' buffers for the
      longest of those prompts and ``settings.max_new_tokens``), timed at γ = 1 and ``gamma_max`` only
      (``measure_gammas`` to change that; call times linear in between), ``timing_repeats``
      timings each; 5 programs to compile. Cached per host, target, drafter (with their
      weight formats), buffers and timed γ.
    * α (:func:`alpha_by_decoding`) over ≤ ``AUTO_PROMPTS`` prompts × ≤ ``AUTO_NEW_TOKENS``
      tokens of the target's own continuation, with ``settings``' sampling; it runs the cost
      programs and one prefill call per prompt bucket. Cached per host, target, drafter,
      sampling settings (and seed when sampling) and prompt ids. A drafter that drafts the whole
      block in one pass (a block drafter: ``chain_passes(γ) == 1``) also gets α per position
      (slots 1..``gamma_max`` of one proposal), and E(N) from them
      (:func:`~specjax.eval.theory.expected_tokens_by_position`) instead of Equation (1);
      ``gamma_max`` is capped at its trained block size.

    Args:
      prompts: texts, id lists or records (:func:`prompt_records`).
      settings: sampling, ``max_new_tokens``, seed, ``ignore_eos`` of the run (default
        ``DecodeSettings()``; its batch size is not used: give ``batch``).
      batch: rows decoded together in the run (costs are timed at this batch size).
      cache: a :class:`specjax.eval.hostcache.HostCache`, or ``None`` (measure every time).
      progress: a :class:`specjax.runtime.progress.Progress`: one line per measuring phase.
    Returns:
      ``(γ in [1, gamma_max], report)``; the report holds ``gamma``, ``alpha``, ``alpha_by_position``
      (``None`` but for one-pass drafters), ``batch``, ``coverage``,
      ``positions``, ``gammas``, ``c``, ``v``, ``t_target_ms`` / ``t_draft_ms`` (``{str(T or γ): ms}``),
      ``table`` (:func:`theory_rows`), ``predicted_speedup``, ``costs_source`` / ``alpha_source``
      (:func:`cached_or_measured`) and ``method``.
    Raises:
      ValueError: no drafter; ``gamma_max < 1``; ``batch < 1``; no prompt, an empty one, or one that
        leaves no room in the context for a new token.
    """
    from specjax.eval.hostcache import drafter_fingerprint, model_fingerprint

    if drafter is None:
        raise ValueError("--gamma auto needs a drafter")
    gamma_max = int(gamma_max)
    if gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    if isinstance(batch, bool) or int(batch) != batch or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    block_size = getattr(getattr(drafter, "config", None), "block_size", None)
    if drafter.chain_passes(2) == 1 and block_size:  # a block drafter: slots past its trained block are untrained
        gamma_max = min(gamma_max, int(block_size))
    settings = DecodeSettings() if settings is None else settings
    recs = prompt_records(list(prompts)[:AUTO_PROMPTS], target, chat)
    gammas = list(range(1, gamma_max + 1))
    timed = sorted({1, *(int(g) for g in (measure_gammas or (gamma_max,)) if 1 <= int(g) <= gamma_max)})
    plen = max(len(r["ids"]) for r in recs)  # the buffers hold the longest prompt + its continuation
    mnt = int(settings.max_new_tokens)
    ctx = Decoder(target, drafter, 1).context_limit()
    validate_batch([r["ids"] for r in recs], mnt, 1, drafter, ctx)  # the Decoder's own messages
    progs = timed_programs(target, drafter, [0, *timed], plen, mnt)
    pair = {"target": model_fingerprint(target), "drafter": drafter_fingerprint(drafter)}
    sp_kw = sampling_key(settings)
    costs, costs_src = _auto_costs(target, drafter, pair, gammas, timed, plen, mnt, progs, timing_repeats, sp_kw,
                                   cache, progress, int(batch))
    n_new = min(AUTO_NEW_TOKENS, mnt, ctx - plen)  # within the context, like the run itself
    alpha, alpha_src = _auto_alpha(target, drafter, pair, recs, progs, settings, n_new, sp_kw, cache, progress)
    a = alpha["alpha"] if alpha["alpha"] is not None and np.isfinite(alpha["alpha"]) else 0.0
    by_pos = alpha.get("alpha_by_position")
    rows = theory_rows(a, gammas, costs["c"], costs["v"], by_pos)
    best = best_row(rows)
    report = {"gamma": int(best["gamma"]), "alpha": a, "alpha_by_position": by_pos, "batch": int(batch),
              "coverage": alpha["coverage"], "positions": alpha["positions"],
              "gammas": gammas, "c": costs["c"], "v": costs["v"], "t_target_ms": costs["t_target_ms"],
              "t_draft_ms": costs["t_draft_ms"], "table": rows, "predicted_speedup": best["speedup"],
              "costs_source": costs_src, "alpha_source": alpha_src, "method": AUTO_METHOD}
    return int(best["gamma"]), report


def _auto_costs(target, drafter, pair: dict, gammas, timed, plen: int, mnt: int, progs: dict, timing_repeats: int,
                sp_kw: dict, cache, progress, batch: int = 1) -> tuple[dict, dict]:
    """:func:`recommend`'s costs (:func:`measure_costs` at ``batch`` rows on the programs ``progs``, γ in
    ``timed`` timed) and their source, from ``cache`` when there: ``(costs, source)``."""

    def costs_now():
        m = measure_costs(target, drafter, gammas, batch=batch, prompt_len=plen, max_new_tokens=mnt,
                          repeats=timing_repeats, measure_gammas=timed, **sp_kw)
        return {"c": m["c"], "v": m["v"], "t_target_ms": {str(k): v for k, v in m["t_target_ms"].items()},
                "t_draft_ms": {str(k): v for k, v in m["t_draft_ms"].items()}, "interpolated": m["interpolated"]}

    widths = ", ".join(str(g + 1) for g in [0, *timed])
    return cached_or_measured(
        cache, "costs", {**pair, "batch": batch, "gammas": gammas, "timed": timed, "repeats": int(timing_repeats),
                         "buffer_len": {str(g): pr.buffer_len for g, pr in progs.items()},
                         "cache_dtype": progs[0].cache_dtype}, costs_now, progress,
        f"measuring costs for --gamma auto at batch {batch}: target calls of {widths} tokens, drafter proposals of "
        f"{' and '.join(str(g) for g in timed)} tokens ({1 + 2 * len(timed)} programs to compile)")


def _auto_alpha(target, drafter, pair: dict, recs: list[dict], progs: dict, settings: DecodeSettings, n_new: int,
                sp_kw: dict, cache, progress) -> tuple[dict, dict]:
    """:func:`recommend`'s α (:func:`alpha_by_decoding` over ``n_new`` tokens per prompt) and its
    source, from ``cache`` when there: ``(alpha, source)``."""

    def alpha_now():
        a = alpha_by_decoding(target, drafter, recs, progs, settings, n_new)
        return {k: a[k] for k in ("alpha", "positions", "coverage", "betas", "alpha_by_position") if k in a}

    ids_sha = hashlib.sha256(json.dumps([r["ids"] for r in recs]).encode()).hexdigest()
    return cached_or_measured(
        cache, "alpha", {**pair, "sampling": sp_kw, "seed": int(settings.seed) if settings.temperature > 0 else None,
                         "ignore_eos": bool(settings.ignore_eos), "new_tokens": n_new, "prompts": ids_sha,
                         "slots": max(progs)},
        alpha_now, progress,
        f"measuring α for --gamma auto: the target's own continuation of {len(recs)} prompt"
        f"{'s' if len(recs) > 1 else ''} (≤ {n_new} tokens each; one prefill program to compile), "
        "scored by the drafter")


def recommend_gamma(target, drafter, prompt_texts: Sequence[str], chat: bool = False, gamma_max: int = 8,
                    **kw) -> int:
    """:func:`recommend`'s γ (an int in [1, gamma_max]; 1 when no γ is predicted to pay).
    ``kw``: :func:`recommend`'s ``settings``, ``cache``, ``progress``, ``timing_repeats``,
    ``measure_gammas``, ``batch``.

    Raises:
      ValueError: no drafter; ``gamma_max < 1``.
    """
    if drafter is None:
        raise ValueError("recommend_gamma needs a drafter")
    return recommend(target, drafter, list(prompt_texts), chat=chat, gamma_max=gamma_max, **kw)[0]


# Where --dtype auto takes a format without measuring (the first rule of the host's backend that
# names a candidate and whose condition holds). The default model on an x86 CPU runs int8 where its
# block kernel builds (specjax.models.q8): the GGUF's own Q4_1/Q8_0 blocks kept exactly, two-level
# activations, measured faithful to this model (KL 8e-5 nats, top-1 100% against float32) and the
# fastest format on the x86 CPUs measured (BENCHMARKS.md "Issue 26: a faithful fast int8"); elsewhere
# on a CPU float32 (faithful by construction) until a measurement on this host (`specjax bench
# --dtype auto`) finds a faster faithful format. The int8 of turns 1-14 (per-channel x per-row) was
# predicted here before the fidelity bar existed, at 86% top-1 agreement: the bar removed it. On
# GPU/TPU the default model runs bfloat16 (weights and KV cache): the accelerators' native format,
# measured faithful (KL 0.00029 nats, top-1 100%), half of float32's bytes per step.
PREDICTED_FORMATS = (
    ("cpu", "int8", "the model file's own 4- and 8-bit blocks, measured faithful: KL 8e-5, top-1 100%; the fastest "
                    "on x86"),
    ("cpu", "float32", "faithful by construction; no faster format measured faithful on this host"),
    ("gpu", "bfloat16", "the accelerator's native format, measured faithful: KL 3e-4, top-1 100%"),
    ("tpu", "bfloat16", "the accelerator's native format, measured faithful: KL 3e-4, top-1 100%"),
)


def predicted_format(formats: Sequence[str], model=None, host: dict | None = None) -> tuple[str, str] | None:
    """``(format, reason)`` when ``model`` is the default model (``None``/``"default"``) and this
    host's backend has a rule in :data:`PREDICTED_FORMATS` naming one of ``formats``, else ``None``.

    ``host``: :func:`specjax.eval.hostcache.host_fingerprint` (computed when ``None``)."""
    from specjax.eval.hostcache import host_fingerprint

    if model not in (None, "default"):
        return None
    from specjax.models import q8

    host = host_fingerprint() if host is None else host
    for backend, fmt, why in PREDICTED_FORMATS:
        if host.get("backend") != backend or fmt not in formats:
            continue
        if fmt == "int8" and not (str(host.get("machine", "")).lower() in ("x86_64", "amd64") and q8.expected()):
            continue  # int8's speed is its CPU kernel's (the jnp reference is ~20x slower than float32)
        return fmt, why
    return None


def fastest_format(model, *, formats: Sequence[str] = llama.WEIGHT_FORMATS, tokens: int = 1, cache=None,
                   progress=None, repeats: int = 7, warmup: int = 2, predict: bool = False) -> tuple[str, dict, Any]:
    """The fastest *faithful* weight format for ``model`` on this host (``--dtype auto``).

    First the fidelity bar (:mod:`specjax.eval.fidelity`): each candidate but float32 is
    measured against float32 once per model and host (cached) and dropped if it misses the bar.
    Then each remaining format's step is one target call of ``tokens`` new tokens (1: an
    autoregressive step; γ + 1: a verification) on the KV cache of the Decoder's own program for
    ``FORMAT_SHAPE`` (32 prompt + 128 new tokens) — :func:`target_case`, as
    :func:`measure_costs` times it — warmed up ``warmup`` times, then timed round-robin
    ``repeats`` times; the smallest median wins. The models in the other formats are made in
    memory from one float32 load (:func:`specjax.io.loading.convert_model`).

    Args:
      model: a loaded :class:`~specjax.io.loading.Model` (any format), or a checkpoint
        (``None``/``"default"``, a path or hub id), loaded in float32 only when measuring.
      formats: the candidates (names in :data:`specjax.models.llama.WEIGHT_FORMATS`).
      cache: a :class:`specjax.eval.hostcache.HostCache` (keyed by host, the checkpoint's
        :func:`~specjax.io.loading.source_identity` or the model's fingerprint, formats,
        ``tokens``, shape and repeats), or ``None``.
      predict: without cached measurements (fidelity of every candidate and the speed of the
        faithful ones), take :func:`predicted_format` for the default model (no measurement,
        nothing cached); measure otherwise.
    Returns:
      ``(format, info, model_or_None)``: info holds ``step_ms`` ``{format: ms}`` (empty when
      predicted), ``fidelity`` ``{format: measured fidelity or None when not known}``,
      ``unfaithful`` (the candidates dropped by the bar), ``tokens``, ``source`` (``cached``,
      ``created``, ``seconds``, ``path``, and ``predicted``: the reason, when predicted); the
      model in the chosen format when it was loaded for the measurement, else ``None``.
    Raises:
      ValueError: an unknown or empty list of formats, ``tokens < 1``.
      CheckpointError: the checkpoint cannot be loaded.
    """
    from specjax.eval import fidelity
    from specjax.io.loading import convert_model, load_model

    formats, tokens = _checked_request(formats, tokens)
    loaded = not (model is None or isinstance(model, str))
    ident = fidelity.identity(model)
    box = {}
    fid = {f: fidelity.lookup(model, f, cache, ident) for f in formats}
    if predict:
        guess = _predicted_choice(model, formats, fid, cache, ident, tokens, repeats)
        if guess is not None:
            return guess

    def base():
        if "float32" not in box:
            box["float32"] = convert_model(model, "float32") if loaded else load_model(model, dtype="float32")
        return box["float32"]

    def in_format(fmt):  # a checkpoint is loaded in the format (a GGUF's exact int8 blocks), a model converted
        if fmt not in box:
            box[fmt] = base() if fmt == "float32" else (
                convert_model(base(), fmt) if loaded else load_model(model, dtype=fmt))
        return box[fmt]

    for f in formats:
        if fid[f] is None:
            fid[f] = fidelity.measure(model, f, cache=cache, progress=progress, ident=ident, reference=base())
    faithful = [f for f in formats if fid[f]["faithful"]] or ["float32"]

    measure = functools.partial(_step_ms, faithful, in_format, tokens, warmup, repeats)
    parts = _speed_parts(ident, faithful, tokens, repeats)
    formats, all_formats = faithful, formats
    if len(faithful) == 1:  # nothing to race
        return _only_faithful(model, loaded, box, in_format, faithful[0], all_formats, fid, tokens)
    value, src = cached_or_measured(cache, "format", parts, measure, progress,
                                    _measuring_words(model, loaded or "float32" in box, tokens, formats))
    step = {f: float(value["step_ms"][f]) for f in formats}  # in the order asked (JSON sorts the keys)
    best = min(formats, key=lambda f: (step[f], formats.index(f)))
    chosen = box.get(best)
    if chosen is None and loaded:
        chosen = convert_model(model, best)
    unfaithful = [f for f in all_formats if f not in faithful]
    return best, {"step_ms": step, "tokens": tokens, "source": src, "fidelity": fid, "unfaithful": unfaithful}, chosen


def _checked_request(formats: Sequence[str], tokens) -> tuple[list[str], int]:
    """:func:`fastest_format`'s candidates (canonical names, in order, each once) and ``tokens``.

    Raises:
      ValueError: an unknown or empty list of formats, ``tokens`` not an integer >= 1.
    """
    formats = list(dict.fromkeys(llama.weight_format(f) for f in formats))
    if not formats:
        raise ValueError("formats must name at least one weight format")
    if isinstance(tokens, bool) or int(tokens) != tokens or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    return formats, int(tokens)


def _measuring_words(model, in_memory: bool, tokens: int, formats: list[str]) -> str:
    """The progress line of :func:`fastest_format`'s measurement (``in_memory``: the float32 model
    is at hand, nothing is loaded first)."""
    return (("" if in_memory else
             f"loading {'the default model' if model in (None, 'default') else model} in float32, then ")
            + f"measuring its decode step ({tokens} token{'s' if tokens > 1 else ''} per call) in {', '.join(formats)} "
            "for --dtype auto")


def _speed_parts(ident: dict, fmts: list[str], tokens: int, repeats: int) -> dict:
    """The measurement cache key of :func:`fastest_format`'s step times of the formats ``fmts``."""
    return {"model": ident, "formats": fmts, "tokens": tokens, "shape": list(FORMAT_SHAPE),
            "repeats": int(repeats), "definitions": [llama.FORMAT_DEFINITION[f] for f in fmts]}


def _predicted_choice(model, formats: list[str], fid: dict, cache, ident: dict, tokens: int, repeats: int):
    """:func:`fastest_format`'s answer with ``predict``: :func:`predicted_format` (nothing measured,
    nothing cached) unless the fidelity of every candidate and the speed of the faithful ones are
    cached; ``None`` when those are cached or nothing is predicted (then measure)."""
    known = all(v is not None for v in fid.values())
    faithful = [f for f in formats if known and fid[f]["faithful"]]
    if not known or not faithful or cache is None or cache.get("format", _speed_parts(ident, faithful, tokens,
                                                                                      repeats)) is None:
        guess = predicted_format([f for f in formats if fid[f] is None or fid[f]["faithful"]], model)
        if guess is not None:
            src = {"cached": False, "created": None, "seconds": 0.0, "path": None, "predicted": guess[1]}
            unfaithful = [f for f in formats if fid[f] is not None and not fid[f]["faithful"]]
            return guess[0], {"step_ms": {}, "tokens": tokens, "source": src, "fidelity": fid,
                              "unfaithful": unfaithful}, None
    return None


def _step_ms(faithful: list[str], in_format, tokens: int, warmup: int, repeats: int) -> dict:
    """``{"step_ms": {format: ms}}``: each faithful format's target step of ``tokens`` new tokens
    (:func:`target_case` on the program for ``FORMAT_SHAPE``), the models from ``in_format(fmt)``;
    timed round-robin (:func:`median_ms`)."""
    plen, mnt = FORMAT_SHAPE
    sp = sampling_params(1, 0.0, 0, 1.0)
    calls = {}
    for fmt in faithful:
        m = in_format(fmt)
        prog = timed_programs(m, None, [tokens - 1], plen, mnt)[tokens - 1]
        calls[("step", fmt)] = target_case(m, prog, 1, tokens, plen + mnt // 2, sp)
    med = median_ms(calls, warmup, repeats)
    return {"step_ms": {fmt: med[("step", fmt)] for fmt in faithful}}


def _only_faithful(model, loaded: bool, box: dict, in_format, only: str, all_formats: list[str], fid: dict,
                   tokens: int):
    """:func:`fastest_format`'s answer when one candidate alone passes the fidelity bar (nothing to
    race): that format, and the model in it when one was loaded for the fidelity measurement."""
    from specjax.io.loading import convert_model

    chosen = box.get(only) or (in_format(only) if "float32" in box else None)
    if chosen is None and loaded:
        chosen = convert_model(model, only)
    src = {"cached": all(fid[f].get("source", {}).get("cached", True) for f in all_formats), "created": None,
           "seconds": 0.0, "path": None, "only_faithful": True}
    return only, {"step_ms": {}, "tokens": tokens, "source": src, "fidelity": fid,
                  "unfaithful": [f for f in all_formats if f != only]}, chosen
