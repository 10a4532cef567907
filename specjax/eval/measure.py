"""Measuring the theory's inputs on real models and prompts (the other half of
:mod:`specjax.eval.theory`): the acceptance rate α, the cost ratios c and v(γ), and the
speculative run itself.

* :func:`measure_alpha` — α as ``Σ_x min(p, q)`` (Leviathan et al. 2023, Definition 3.1,
  Theorem 3.5) along the target's own output, by teacher forcing: one target forward
  and one drafter forward over prompt + continuation, both processed with the same
  :meth:`SamplingParams.process` the decode loop uses. Independent of the loop's
  acceptance counters.
* :func:`measure_costs` — ``c = t_draft/t_target`` and ``v(γ) = t_target(γ+1)/t_target(1)``
  from timed jitted calls with the decode loop's shapes (batch, cache buffer length).
* :func:`measure_speedup` — the real decode loop, autoregressive and speculative
  interleaved in the same run: ``mean_accepted_tokens``, ``acceptance_rate``, tokens/s,
  and the measured speedup.
* :func:`compare` / :func:`analyze_pair` — the table of predictions next to the measurements.

Prompts are records ``{"ids": [...]} | {"prompt": text}`` with optional ``category`` and
``question_id`` (plain strings and id lists are accepted too).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval import theory as analysis
from specjax.runtime.decoder import BUFFER_BUCKET, Decoder, _bucket, prompt_bucket, seed_key
from specjax.core.drafting import DraftContext
from specjax.drafters.model import ModelDrafter, fit_vocab
from specjax.models import llama
from specjax.core.sampling import SamplingParams

__all__ = [
    "prompt_records",
    "measure_alpha",
    "measure_costs",
    "measure_speedup",
    "compare",
    "theory_rows",
    "analyze_pair",
    "decode_buffer_len",
]

ALPHA_METHOD = (
    "alpha = mean over positions of beta = sum_x min(p, q) (Leviathan et al. 2023, Def. 3.1), "
    "teacher-forced along the target's own continuation; p and q made by the same "
    "SamplingParams.process; pooled over positions (a category's alpha weights each position equally)"
)
COST_METHOD = (
    "medians of timed jitted calls, round-robin over call kinds after warm-up, with the decode loop's "
    "batch and cache buffer length (donated cache): t_target(T) = llama.apply over T new tokens + "
    "SamplingParams.process; t_draft(gamma) = one whole drafter.propose call of gamma tokens; "
    "c(gamma) = t_draft(gamma) / (gamma * t_target(1)); v(gamma) = t_target(gamma+1) / t_target(1)"
)


# --------------------------------------------------------------------------- prompts
def prompt_records(prompts, target=None, chat: bool = False) -> list[dict]:
    """Normalise prompts to ``{"ids", "category", "question_id"}`` (text encoded with
    ``target``'s tokenizer, with its chat template when ``chat``)."""
    from specjax.api import encode_prompts

    recs = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = {"prompt": p}
        elif not isinstance(p, dict):
            p = {"ids": [int(t) for t in p]}
        rec = {"category": p.get("category", "all"), "question_id": p.get("question_id", i)}
        if "ids" in p:
            rec["ids"] = [int(t) for t in p["ids"]]
        else:
            if target is None:
                raise ValueError("text prompts need the target model (its tokenizer)")
            rec["ids"] = encode_prompts(target, [p["prompt"]], chat)[0]
        if not rec["ids"]:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        recs.append(rec)
    if not recs:
        raise ValueError("no prompts given; pass at least one prompt")
    return recs


def decode_buffer_len(prompt_len: int, max_new_tokens: int, gamma: int) -> int:
    """The token/KV buffer length the decoder uses (``Decoder.prepare``) for one prompt."""
    return _bucket(prompt_bucket(int(prompt_len)) + int(max_new_tokens) + int(gamma) + 1, BUFFER_BUCKET)


def _cache_dtype(model) -> Any:
    return jnp.dtype(model.dtype) if model.dtype in ("float32", "bfloat16") else jnp.float32


# --------------------------------------------------------------------------- (a) alpha
def _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype):
    """One teacher-forced forward over ``tokens [B, L]``: processed next-token distributions
    ``[B, width, vocab]`` at positions ``starts + arange(width)``, and the final hidden
    states ``[B, L, D]``."""
    b, length = tokens.shape
    cache = llama.KVCache.create(cfg, b, length, cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    hidden, _ = llama.forward(graphdef, params, tokens, pos, cache, cfg)
    idx = jnp.clip(starts[:, None] + jnp.arange(width, dtype=jnp.int32), 0, length - 1)
    h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
    logits = fit_vocab(llama.lm_head(graphdef, params, h, cfg), vocab)
    return sampling.process(logits), hidden


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "width", "vocab", "cache_dtype"))
def _teacher_probs(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype):
    """:func:`_teacher` (jitted)."""
    return _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype)


@functools.partial(jax.jit, static_argnames=("tg", "tcfg", "dg", "dcfg", "width", "tdt", "ddt"))
def _betas_model(tg, tcfg, tparams, dg, dcfg, dparams, tokens, starts, sampling, width, tdt, ddt):
    """``β [B, width]`` for a separate draft model: Σ min(p, q) per position."""
    vocab = tcfg.vocab_size
    p, _ = _teacher(tg, tcfg, tparams, tokens, starts, sampling, width, vocab, tdt)
    q, _ = _teacher(dg, dcfg, dparams, tokens, starts, sampling, width, vocab, ddt)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


@functools.partial(jax.jit, static_argnames=("drafter", "vocab"))
def _betas_generic(drafter, dparams, p, hidden, buf, lengths, sampling, keys, vocab):
    """Any drafter: one row per position, each as the first round after a prefill of
    ``buf[:length]`` (``init_state`` with the target's hidden states ``hidden [L, D]`` for
    feature-level drafters, then a 1-token ``propose``); returns ``(β [R], proposed [R])``
    with ``p [R, V]`` the target's distributions at those positions."""
    r = buf.shape[0]
    zeros = jnp.zeros((r,), jnp.int32)
    init_ctx = DraftContext(buf, lengths, sampling, jnp.broadcast_to(hidden, (r,) + hidden.shape), zeros)
    state = drafter.init_state(dparams, init_ctx, buf.shape[1])
    ctx = DraftContext(buf, lengths, sampling, jnp.zeros((r, 2, hidden.shape[-1]), jnp.float32), zeros)
    prop = drafter.propose(dparams, state, ctx, keys, 1, vocab)
    q = prop.probs[:, 0]
    return jnp.sum(jnp.minimum(p, q), axis=-1), prop.num_valid > 0


def _sampling(batch, temperature, top_k, top_p):
    return SamplingParams.create(batch, temperature, top_k, top_p)


def _progress(iterable, desc: str, total: int | None = None, enabled: bool = False):
    """``iterable`` with a tqdm bar on stderr when ``enabled`` and stderr is a terminal
    (``disable=None``: no carriage-return lines in logs; stdout is never written)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, disable=None if enabled else True, leave=False,
                dynamic_ncols=True)


def measure_alpha(
    target,
    drafter,
    prompts: Sequence[dict],
    continuations: Sequence[Sequence[int]],
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    batch_size: int = 4,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """α = E[Σ_x min(p, q)] along the target's own continuation (teacher forcing).

    For prompt + continuation ``y_1..y_n``, β is computed at the n positions that predict
    ``y_1..y_n``: p from one target forward, q from one drafter forward (a
    :class:`ModelDrafter`), both through ``SamplingParams.process`` with the given
    settings. Any other drafter (n-gram, custom) is run as ``propose(γ=1)`` once per
    position (one row per position, context = the committed tokens); for n-gram
    lookup q is one-hot, so β = p(proposal), and positions without a proposal are left
    out of α (the loop takes a plain step there) and counted in ``coverage``.

    Args:
      prompts: records from :func:`prompt_records` (``ids``, ``category``).
      continuations: per prompt, the target's own new tokens (greedy or sampled).
    Returns:
      dict: ``alpha`` (pooled over positions), ``positions``, ``coverage`` (fraction of
      positions with a proposal), ``by_category`` ``{cat: {alpha, positions, prompts}}``,
      ``per_prompt`` (``alpha``, ``positions``, ``category``, ``question_id``),
      ``betas`` (per prompt, per position; NaN where nothing was proposed), ``method``.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"got {len(continuations)} continuations for {len(prompts)} prompts")
    vocab = target.config.vocab_size
    seqs = [list(p["ids"]) + list(c) for p, c in zip(prompts, continuations)]
    starts = [len(p["ids"]) - 1 for p in prompts]
    counts = [len(c) for c in continuations]
    width = _bucket(max(max(counts), 1), 32)
    length = _bucket(max(len(s) for s in seqs) + 1, BUFFER_BUCKET)
    betas: list[np.ndarray] = []
    if isinstance(drafter, ModelDrafter):
        b = max(1, min(int(batch_size), len(seqs)))
        sp = _sampling(b, temperature, top_k, top_p)
        for lo in _progress(range(0, len(seqs), b), "alpha", enabled=progress):
            rows = list(range(lo, min(lo + b, len(seqs))))
            rows_pad = rows + [rows[0]] * (b - len(rows))
            tok = np.zeros((b, length), np.int32)
            for r, i in enumerate(rows_pad):
                tok[r, : len(seqs[i])] = seqs[i]
            st = np.asarray([starts[i] for i in rows_pad], np.int32)
            out = np.asarray(_betas_model(
                target.graphdef, target.config, target.params, drafter.graphdef, drafter.config,
                drafter.params, jnp.asarray(tok), jnp.asarray(st), sp, width,
                _cache_dtype(target), jnp.dtype(drafter.cache_dtype)))
            for r, i in enumerate(rows):
                betas.append(out[r, : counts[i]].astype(np.float64))
    else:
        sp1 = _sampling(1, temperature, top_k, top_p)
        spw = _sampling(width, temperature, top_k, top_p)
        keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(seed_key(seed), i), 1))(
            jnp.arange(width))
        for i, s in _progress(enumerate(seqs), "alpha", total=len(seqs), enabled=progress):
            tok = np.zeros((1, length), np.int32)
            tok[0, : len(s)] = s
            p, hidden = _teacher_probs(target.graphdef, target.config, target.params, jnp.asarray(tok),
                                       jnp.asarray([starts[i]], np.int32), sp1, width, vocab, _cache_dtype(target))
            lengths = np.clip(starts[i] + 1 + np.arange(width), 1, length - 1).astype(np.int32)
            buf = jnp.asarray(np.repeat(tok, width, axis=0))
            beta, proposed = _betas_generic(drafter, drafter.params, p[0], hidden[0], buf, jnp.asarray(lengths), spw,
                                            keys, vocab)
            beta = np.asarray(beta, np.float64)[: counts[i]]
            beta[~np.asarray(proposed)[: counts[i]]] = np.nan
            betas.append(beta)
    betas = [np.clip(b, 0.0, 1.0) for b in betas]
    per_prompt, by_cat = [], defaultdict(list)
    for rec, b in zip(prompts, betas):
        ok = b[~np.isnan(b)]
        per_prompt.append({"question_id": rec.get("question_id"), "category": rec.get("category", "all"),
                           "alpha": float(ok.mean()) if ok.size else float("nan"),
                           "positions": int(ok.size), "proposed_fraction": float(ok.size / max(b.size, 1))})
        by_cat[rec.get("category", "all")].append(b)
    allb = np.concatenate(betas) if betas else np.zeros(0)
    ok = allb[~np.isnan(allb)]

    def summary(bs):
        a = np.concatenate(bs)
        k = a[~np.isnan(a)]
        return {"alpha": float(k.mean()) if k.size else float("nan"), "positions": int(k.size), "prompts": len(bs)}

    return {
        "alpha": float(ok.mean()) if ok.size else float("nan"),
        "positions": int(ok.size),
        "coverage": float(ok.size / max(allb.size, 1)),
        "by_category": {c: summary(bs) for c, bs in by_cat.items()},
        "per_prompt": per_prompt,
        "betas": [b.tolist() for b in betas],
        "method": ALPHA_METHOD,
    }


# --------------------------------------------------------------------------- (b) costs
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"), donate_argnames=("cache",))
def _target_call(graphdef, cfg, params, tokens, positions, cache, sampling):
    out = llama.apply(graphdef, params, tokens, positions, cache, cfg)
    return sampling.process(out.logits), out.cache


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "vocab"), donate_argnames=("state",))
def _draft_call(drafter, params, state, ctx, keys, gamma, vocab):
    prop = drafter.propose(params, state, ctx, keys, gamma, vocab)
    return prop.tokens, prop.probs, prop.state


@functools.partial(jax.jit, static_argnames=("drafter", "max_len"))
def _draft_init(drafter, params, ctx, max_len):
    return drafter.init_state(params, ctx, max_len)


def _interp(gs_known: Sequence[int], vals: Sequence[float], gs: Sequence[int]) -> list[float]:
    return [float(x) for x in np.interp(np.asarray(gs, float), np.asarray(gs_known, float), np.asarray(vals, float))]


def measure_costs(
    target,
    drafter,
    gammas: Sequence[int],
    *,
    batch: int = 1,
    prompt_len: int = 64,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repeats: int = 7,
    warmup: int = 2,
    measure_gammas: Sequence[int] | None = None,
) -> dict:
    """Measured c(γ) and v(γ) with the decode loop's shapes.

    The target is timed as the loop runs it: ``llama.apply`` over T new tokens on a
    donated KV cache of the decoder's buffer length for (``prompt_len``,
    ``max_new_tokens``, γ) — γ = 0 for the autoregressive one-token step — followed by
    ``SamplingParams.process``. The drafter is timed as one whole ``propose`` call of γ
    tokens (its own cache of the same buffer length, donated), divided by γ. Each kind
    of call is warmed up, then all kinds are timed round-robin ``repeats`` times and
    the median taken (the machine may be shared: round-robin spreads load drift evenly).

    Args:
      gammas: γ values for which c(γ) and v(γ) are reported.
      measure_gammas: the γ actually timed (default: ``gammas``); the others are
        interpolated linearly (a quick mode for :func:`recommend_gamma`).
    Returns:
      dict: ``gammas``, ``c`` (list, c(γ)), ``v`` (list, v(γ)), ``c_scalar`` (c at the
      largest γ), ``t_target_ms`` ``{T: ms}``, ``t_draft_ms`` ``{γ: ms}``, ``batch``,
      ``buffer_len`` ``{γ: slots}``, ``interpolated`` (γ not timed), ``method``.
    """
    gammas = sorted({int(g) for g in gammas})
    if not gammas or gammas[0] < 1:
        raise ValueError(f"gammas must be integers >= 1, got {gammas}")
    timed = sorted({int(g) for g in (measure_gammas or gammas)})
    cfg = target.config
    b = int(batch)
    sp = _sampling(b, temperature, top_k, top_p)
    vocab = cfg.vocab_size
    pos0 = int(prompt_len) + int(max_new_tokens) // 2
    key = jax.random.PRNGKey(0)
    calls = {}  # name -> [fn () -> None]

    def target_case(t, buf):
        cache = llama.KVCache.create(cfg, b, buf, _cache_dtype(target))
        toks = jax.random.randint(jax.random.fold_in(key, t), (b, t), 2, vocab, jnp.int32)
        pos = jnp.broadcast_to(pos0 + jnp.arange(t, dtype=jnp.int32), (b, t))
        box = [cache]

        def run():
            probs, box[0] = _target_call(target.graphdef, cfg, target.params, toks, pos, box[0], sp)
            jax.block_until_ready(probs)
        return run

    def draft_case(g, buf):
        toks = jax.random.randint(jax.random.fold_in(key, 100 + g), (b, buf), 2, vocab, jnp.int32)
        # an n-gram drafter finds a match: repeat the context so lookups succeed as often as in text
        toks = toks.at[:, pos0 // 2: pos0].set(toks[:, : pos0 - pos0 // 2])
        lens = jnp.full((b,), pos0, jnp.int32)
        zeros = jnp.zeros((b,), jnp.int32)
        d = cfg.hidden_size
        hid = 0.1 * jax.random.normal(jax.random.fold_in(key, 200 + g), (b, buf, d), jnp.float32)
        box = [_draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, hid, zeros), buf)]
        # a round after a verify call: γ+1 hidden states of the last target call, n = 0
        ctx = DraftContext(toks, lens, sp, hid[:, pos0 - 1: pos0 + g], zeros)
        keys = jax.vmap(lambda k: jax.random.split(k, g))(jax.random.split(jax.random.fold_in(key, g), b))

        def run():
            t, q, box[0] = _draft_call(drafter, drafter.params, box[0], ctx, keys, g, vocab)
            jax.block_until_ready((t, q))
        return run

    buf_ar = decode_buffer_len(prompt_len, max_new_tokens, 0)
    bufs = {g: decode_buffer_len(prompt_len, max_new_tokens, g) for g in timed}
    calls[("target", 1)] = target_case(1, buf_ar)
    for g in timed:
        calls[("target", g + 1)] = target_case(g + 1, bufs[g])
        if drafter is not None:
            calls[("draft", g)] = draft_case(g, bufs[g])
    for run in calls.values():  # compile + warm up
        for _ in range(max(1, int(warmup))):
            run()
    samples = {k: [] for k in calls}
    for _ in range(max(1, int(repeats))):
        for k, run in calls.items():
            t0 = time.perf_counter()
            run()
            samples[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    t1 = med[("target", 1)]
    v_t = [med[("target", g + 1)] / t1 for g in timed]
    c_t = [med[("draft", g)] / (g * t1) if drafter is not None else 0.0 for g in timed]
    v = _interp(timed, v_t, gammas)
    c = _interp(timed, c_t, gammas)
    return {
        "gammas": gammas,
        "c": c,
        "v": v,
        "c_scalar": c[-1],
        "t_target_ms": {1: t1, **{g + 1: med[("target", g + 1)] for g in timed}},
        "t_draft_ms": {g: med[("draft", g)] for g in timed} if drafter is not None else {},
        "batch": b,
        "buffer_len": {0: buf_ar, **bufs},
        "interpolated": [g for g in gammas if g not in timed],
        "repeats": int(repeats),
        "method": COST_METHOD,
    }


# --------------------------------------------------------------------------- (c) speedup
def _decode_batches(dec: Decoder, prompts, max_new_tokens, sp_kw, seed, batch_size, ignore_eos):
    """Yield ``(rows, run)`` per batch, where ``run()`` decodes the batch and returns a GenerationResult."""
    ids = [p["ids"] for p in prompts]
    bs = max(1, int(batch_size or len(ids)))
    for lo in range(0, len(ids), bs):
        chunk = ids[lo: lo + bs]
        sp = _sampling(len(chunk), **sp_kw)

        def run(chunk=chunk, sp=sp, lo=lo):
            return dec.generate(chunk, max_new_tokens=max_new_tokens, sampling=sp, seed=seed, seed_offset=lo,
                                eos_ids=[] if ignore_eos else None)
        yield list(range(lo, lo + len(chunk))), run


def _summarise(prompts, results, times, label):
    """Pool per-prompt stats of one decoder over all batches."""
    per, toks = [], []
    for rows, r in results:
        for i, t, st in zip(rows, r.tokens, r.stats):
            per.append(dict(st, question_id=prompts[i].get("question_id"), category=prompts[i].get("category", "all")))
            toks.append(t)
    new = sum(s["new_tokens"] for s in per)
    calls = sum(s["target_calls"] for s in per)
    acc = sum(s["accepted_tokens"] for s in per)
    checked = sum(s["checked_tokens"] for s in per)
    decode_s = float(sum(times))
    out = {
        "label": label,
        "new_tokens": new,
        "target_calls": calls,
        "decode_s": decode_s,
        "tokens_per_s": new / decode_s if decode_s > 0 else float("nan"),
        "mean_accepted_tokens": new / calls if calls else 0.0,
        "acceptance_rate": acc / checked if checked else 0.0,
        "accepted_tokens": acc,
        "checked_tokens": checked,
        "drafted_tokens": sum(s["drafted_tokens"] for s in per),
        "per_prompt": per,
    }
    by_cat = defaultdict(lambda: [0, 0])
    for s in per:
        by_cat[s["category"]][0] += s["new_tokens"]
        by_cat[s["category"]][1] += s["target_calls"]
    out["by_category"] = {c: {"mean_accepted_tokens": n / k if k else 0.0, "new_tokens": n} for c, (n, k) in by_cat.items()}
    hist = None
    for s in per:
        h = np.asarray(s["accept_hist"])
        hist = h if hist is None else hist + h
    out["accept_hist"] = [] if hist is None else hist.tolist()
    return out, toks


def measure_speedup(
    target,
    drafter,
    prompts: Sequence[dict],
    gamma: int,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 1,
    ignore_eos: bool = False,
    repeats: int = 1,
    autoregressive: bool = True,
    decoders: dict | None = None,
    progress: bool = False,
) -> dict:
    """The real decode loop: autoregressive and speculative (γ) on the same prompts,
    interleaved batch by batch (AR, spec, AR, spec, …) so both see the same machine load.

    Each batch is run ``repeats`` times per decoder after a compile (compile time is
    never counted: :class:`Decoder` compiles ahead of time); per batch the median decode
    time is kept. tokens/s = all new tokens ÷ the sum of those times.

    Args:
      decoders: optional cache ``{key: Decoder}`` reused across calls (no recompiles).
    Returns:
      dict: ``gamma``, ``spec`` and ``ar`` summaries (``new_tokens``, ``target_calls``,
      ``decode_s``, ``tokens_per_s``, ``mean_accepted_tokens`` = new tokens ÷ target
      calls, pooled; ``acceptance_rate`` = accepted ÷ checked, pooled; ``accept_hist``;
      ``by_category``; ``per_prompt``), ``speedup`` (spec ÷ AR tokens/s, NaN without AR),
      ``tokens`` (speculative new tokens per prompt), ``ar_tokens``.
    """
    decoders = {} if decoders is None else decoders
    sp_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    def get(dr, g):
        k = (id(target), id(dr), g)
        if k not in decoders:
            decoders[k] = Decoder(target, dr, g)
        return decoders[k]

    kinds = [("spec", get(drafter, int(gamma)))]
    if autoregressive:
        kinds.insert(0, ("ar", get(None, 0)))
    results = {k: [] for k, _ in kinds}
    times = {k: [] for k, _ in kinds}
    gens = {k: list(_decode_batches(dec, prompts, max_new_tokens, sp_kw, seed, batch_size, ignore_eos))
            for k, dec in kinds}
    n_batches = len(gens["spec"])
    for bi in _progress(range(n_batches), f"speedup γ={gamma}", enabled=progress):
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
    spec, spec_tokens = _summarise(prompts, results["spec"], times["spec"], f"speculative γ={gamma}")
    out = {"gamma": int(gamma), "spec": spec, "tokens": spec_tokens, "repeats": int(repeats)}
    if autoregressive:
        ar, ar_tokens = _summarise(prompts, results["ar"], times["ar"], "autoregressive")
        out["ar"] = ar
        out["ar_tokens"] = ar_tokens
        out["speedup"] = spec["tokens_per_s"] / ar["tokens_per_s"]
    else:
        out["speedup"] = float("nan")
    return out


def autoregressive_run(target, prompts, **kw) -> dict:
    """The target alone (its own output for :func:`measure_alpha`, and a warm AR decoder)."""
    decoders = kw.pop("decoders", None)
    progress = kw.pop("progress", False)
    decoders = {} if decoders is None else decoders
    k = (id(target), id(None), 0)
    dec = decoders.setdefault(k, Decoder(target, None, 0))
    sp_kw = {n: kw.pop(n) for n in ("temperature", "top_k", "top_p") if n in kw}
    sp_kw = dict(dict(temperature=0.0, top_k=0, top_p=1.0), **sp_kw)
    res, times = [], []
    bs = max(1, int(kw.get("batch_size", 1) or len(prompts)))
    for rows, run in _progress(_decode_batches(dec, prompts, kw.get("max_new_tokens", 128), sp_kw, kw.get("seed", 0),
                                               kw.get("batch_size", 1), kw.get("ignore_eos", False)),
                               "target", total=-(-len(prompts) // bs), enabled=progress):
        r = run()
        res.append((rows, r))
        times.append(r.decode_s)
    summary, toks = _summarise(prompts, res, times, "autoregressive")
    return {"ar": summary, "tokens": toks}


# --------------------------------------------------------------------------- theory ↔ measurement
def theory_rows(alpha: float, gammas: Sequence[int], c: Sequence[float] | float, v: Sequence[float] | None) -> list[dict]:
    """:func:`analysis.theory_table` rows with a per-γ measured c(γ) and v(γ): ``cost`` =
    γ c(γ) + v(γ), ``speedup`` = E(N)/cost, ``speedup_textbook`` = E(N)/(γ c(γ) + 1)."""
    gammas = [int(g) for g in gammas]
    cs = np.broadcast_to(np.asarray(c, float), (len(gammas),))
    vs = np.ones(len(gammas)) if v is None else np.broadcast_to(np.asarray(v, float), (len(gammas),))
    return [analysis.theory_table(alpha, float(ci), [g], float(vi))[0] for g, ci, vi in zip(gammas, cs, vs)]


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
        "tokens_discrepancy": spec["mean_accepted_tokens"] - e,
        "acceptance_rate": spec["acceptance_rate"],
        "measured_speedup": run.get("speedup", float("nan")),
        "tokens_per_s_spec": spec["tokens_per_s"],
        "tokens_per_s_ar": run["ar"]["tokens_per_s"] if "ar" in run else float("nan"),
    }
    if row is not None:
        out["predicted_speedup"] = row["speedup"]
        out["predicted_speedup_textbook"] = row["speedup_textbook"]
        # the cost model alone: measured tokens per round over the predicted round cost
        out["predicted_speedup_from_measured_tokens"] = spec["mean_accepted_tokens"] / row["cost"]
        if coverage < 1.0:
            f = float(coverage)
            gamma_c = row["expected_tokens"] / row["speedup_textbook"] - 1.0  # textbook cost is γc + 1
            v_g = row["cost"] - gamma_c
            out["coverage"] = f
            out["predicted_speedup_coverage_adjusted"] = (f * e + 1 - f) / (gamma_c + f * v_g + 1 - f)
        ms = out["measured_speedup"]
        out["speedup_relative_error"] = (row["speedup"] - ms) / ms if ms and np.isfinite(ms) else float("nan")
    return out


def analyze_pair(
    target,
    drafter,
    prompts: Sequence[Any],
    *,
    gamma_max: int = 8,
    gamma: int | None = None,
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 1,
    ignore_eos: bool = False,
    repeats: int = 1,
    timing_repeats: int = 7,
    quick_costs: bool = False,
    measure_run: bool = True,
    log=None,
    progress: bool = False,
) -> dict:
    """Everything ``specjax analyze`` reports for one target/drafter pair.

    Steps: (1) the target alone decodes every prompt (its own output, and the AR
    baseline decoder warmed up); (2) α by teacher forcing along that output
    (:func:`measure_alpha`); (3) c(γ), v(γ) for γ = 1..``gamma_max``
    (:func:`measure_costs`, batch = ``batch_size``, buffer for the median prompt);
    (4) the theory table and the recommended γ (largest predicted speedup with the
    measured c(γ), v(γ)); (5) the real speculative run at the recommended γ (and at
    ``gamma`` if given), interleaved with AR (:func:`measure_speedup`). ``progress``: tqdm
    bars on stderr over the prompts / batches of steps 1, 2 and 5 (only when stderr is a terminal).

    Returns a JSON-serialisable dict (see ``specjax analyze --json``).
    """
    say = log or (lambda *_: None)
    recs = prompt_records(prompts, target, chat)
    sp_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    run_kw = dict(max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size, ignore_eos=ignore_eos, **sp_kw)
    decoders: dict = {}
    say(f"[1/5] target's own output: {len(recs)} prompts × ≤{max_new_tokens} tokens")
    base = autoregressive_run(target, recs, decoders=decoders, progress=progress, **run_kw)
    say("[2/5] alpha by teacher forcing")
    alpha = measure_alpha(target, drafter, recs, base["tokens"], seed=seed, batch_size=4, progress=progress, **sp_kw)
    gammas = list(range(1, int(gamma_max) + 1))
    plen = int(np.median([len(r["ids"]) for r in recs]))
    say(f"[3/5] costs c(γ), v(γ) for γ = 1..{gamma_max} (batch {batch_size}, prompt {plen} tokens)")
    mg = sorted({g for g in (1, 2, 4, 8, int(gamma_max)) if g <= gamma_max}) if quick_costs else None
    costs = measure_costs(target, drafter, gammas, batch=batch_size, prompt_len=plen, max_new_tokens=max_new_tokens,
                          repeats=timing_repeats, measure_gammas=mg, **sp_kw)
    a = alpha["alpha"] if np.isfinite(alpha["alpha"]) else 0.0
    rows = theory_rows(a, gammas, costs["c"], costs["v"])
    best = best_row(rows)
    best_tb = best_row(rows, "speedup_textbook")
    say(f"[4/5] α = {a:.4f}, c(γ) = {costs['c'][best['gamma'] - 1]:.4f}: recommended γ = {best['gamma']} "
        f"(predicted {best['speedup']:.3f}×)")
    report = {
        "target": getattr(target, "name", ""),
        "drafter": getattr(drafter, "name", type(drafter).__name__),
        "settings": {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "chat": chat, "seed": seed,
                     "ignore_eos": ignore_eos, "prompts": len(recs), "median_prompt_tokens": plen, **sp_kw},
        "alpha": {k: alpha[k] for k in ("alpha", "positions", "coverage", "by_category", "per_prompt", "method")},
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
    }
    if measure_run:
        gs = [best["gamma"]] + ([int(gamma)] if gamma is not None and int(gamma) != best["gamma"] else [])
        for g in gs:
            say(f"[5/5] speculative run at γ = {g} (interleaved with autoregressive)")
            run = measure_speedup(target, drafter, recs, g, repeats=repeats, decoders=decoders, progress=progress,
                                  **run_kw)
            row = rows[g - 1] if g <= len(rows) else theory_rows(a, [g], costs["c_scalar"], costs["v"][-1])[0]
            cmp = compare(a, g, run, row, coverage=alpha["coverage"])
            by_cat = {}
            for cat, ca in alpha["by_category"].items():
                ac = ca["alpha"] if np.isfinite(ca["alpha"]) else 0.0
                by_cat[cat] = {"alpha": ca["alpha"], "expected_tokens": float(analysis.expected_tokens(ac, g)),
                               "mean_accepted_tokens": run["spec"]["by_category"].get(cat, {}).get("mean_accepted_tokens")}
            cmp["by_category"] = by_cat
            cmp["accept_hist"] = run["spec"]["accept_hist"]
            cmp["ar_tokens_match"] = run["tokens"] == run["ar_tokens"] if temperature == 0 else None
            report["measured"].append(cmp)
    return report


def recommend(target, drafter, prompts, *, gamma_max: int = 8, chat: bool = False, max_new_tokens: int = 16,
              max_prompts: int = 2, **kw) -> tuple[int, dict]:
    """Fast γ recommendation: α over ≤ ``max_prompts`` prompts × ``max_new_tokens``, c and v
    timed at γ ∈ {1, 2, 4, 8, γ_max} only (linear in between), 3 timings each, no
    speculative run. Returns ``(γ, report)``."""
    recs = prompt_records(list(prompts)[: max(1, int(max_prompts))], target, chat)
    rep = analyze_pair(target, drafter, recs, gamma_max=gamma_max, max_new_tokens=max_new_tokens,
                       timing_repeats=kw.pop("timing_repeats", 3), quick_costs=True, measure_run=False, **kw)
    return int(rep["recommended_gamma"]), rep


def recommend_gamma(target, drafter, prompt_texts: Sequence[str], chat: bool = False, gamma_max: int = 8) -> int:
    """γ with the largest predicted speedup for this pair, measured quickly (used by
    ``specjax generate --gamma auto``): α by teacher forcing over ≤ 2 prompts × 16 greedy
    tokens, c and v timed at γ ∈ {1, 2, 4, 8, γ_max} (3 timings each, linear in between).
    Returns an int in [1, gamma_max]; 1 when no γ is predicted to pay."""
    if drafter is None:
        raise ValueError("recommend_gamma needs a drafter")
    if int(gamma_max) < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    g, _ = recommend(target, drafter, list(prompt_texts), gamma_max=int(gamma_max), chat=chat)
    return g
