"""Measuring the theory's inputs on real models and prompts (the other half of
:mod:`specjax.eval.theory`): the acceptance rate α, the cost ratios c and v(γ), and the
speculative run itself.

* :func:`measure_alpha` — α as ``Σ_x min(p, q)`` (Leviathan et al. 2023, Definition 3.1,
  Theorem 3.5) along the target's own output, by teacher forcing: one target forward
  and one drafter forward over prompt + continuation, both processed with the same
  :meth:`SamplingParams.process` the decode loop uses. Independent of the loop's
  acceptance counters.
* :func:`measure_costs` — ``c = t_draft/t_target`` and ``v(γ) = t_target(γ+1)/t_target(1)``
  from timed jitted calls with the decode loop's shapes: the batch, and the buffer length and
  KV-cache dtype of the very programs the :class:`Decoder` runs (:func:`timed_programs`).
* :func:`measure_speedup` — the real decode loop, autoregressive and speculative
  interleaved in the same run: ``mean_accepted_tokens``, ``acceptance_rate``, tokens/s,
  and the measured speedup (defined in :mod:`specjax.eval.speedup`, re-exported here).
* :func:`compare` / :func:`analyze_pair` — the table of predictions next to the measurements.

Prompts are records ``{"ids": [...]} | {"prompt": text}`` with optional ``category`` and
``question_id`` (plain strings and id lists are accepted too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from collections import defaultdict
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval.hostcache import cached_or_measured
from specjax.core.drafting import DraftContext
from specjax.core.sampling import SamplingParams
from specjax.core.settings import as_dict
from specjax.drafters.model import fit_vocab
from specjax.drafters.ngram import NgramDrafter
from specjax.eval import theory as analysis
from specjax.eval.speedup import (  # noqa: F401  (re-exported: measure is the public module)
    _progress, autoregressive_run, best_row, compare, measure_speedup, theory_rows,
)
from specjax.models import llama
from specjax.runtime.decoder import (
    BUFFER_BUCKET, Decoder, Program, _bucket, _validate, prompt_bucket, seed_key,
)
from specjax.runtime.settings import DecodeSettings
from specjax.runtime.loop import verification_mask

__all__ = [
    "prompt_records",
    "measure_alpha",
    "measure_costs",
    "measure_speedup",
    "compare",
    "theory_rows",
    "analyze_pair",
    "timed_programs",
    "alpha_by_decoding",
    "recommend",
    "recommend_gamma",
    "fastest_format",
    "tree_key",
    "tree_program",
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
def prompt_records(prompts, target=None, chat: bool = False, parse_special: bool = True) -> list[dict]:
    """Normalise prompts to ``{"ids", "category", "question_id"}`` (text encoded with
    ``target``'s tokenizer, with its chat template when ``chat``; ``parse_special``: see
    :func:`specjax.api.encode_prompts`)."""
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
            rec["ids"] = encode_prompts(target, [p["prompt"]], chat, parse_special=parse_special)[0]
        if not rec["ids"]:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        recs.append(rec)
    if not recs:
        raise ValueError("no prompts given; pass at least one prompt")
    return recs


def timed_programs(target, drafter, gammas: Sequence[int], prompt_len: int, max_new_tokens: int) -> dict[int, Program]:
    """``{γ: Program}``: the decode programs :class:`Decoder` runs for one prompt of
    ``prompt_len`` tokens and ``max_new_tokens`` new tokens (γ = 0: autoregressive), asked
    of the Decoder itself, so measurements use its ``buffer_len`` (token/KV slots) and
    ``cache_dtype``. Without a drafter, γ > 0 takes the buffer of an n-gram drafter's program
    (a drafter adds no target-cache slots of its own).

    Raises:
      ValueError: ``prompt_len`` not shorter than the context, ``max_new_tokens < 1``, γ < 0.
    """
    out = {}
    for g in sorted({int(g) for g in gammas}):
        if g < 0:
            raise ValueError(f"gammas must be integers >= 0, got {g}")
        dr = None if g == 0 else (drafter if drafter is not None else NgramDrafter())
        out[g] = Decoder(target, dr, g if dr is not None else 0).program(prompt_len, max_new_tokens)
    return out


def _cache_dtype(target) -> Any:
    """The target's KV-cache dtype in the decoder's programs (teacher forcing uses it too)."""
    return jnp.dtype(Decoder(target).cache_dtype)


def _sampling_kw(settings: DecodeSettings) -> dict:
    """Every declared sampling field of ``settings`` (the measurement cache keys include them all:
    a new field can never reuse a stale measurement)."""
    return as_dict(settings.sampling)


# --------------------------------------------------------------------------- (a) alpha
def _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers=()):
    """One teacher-forced forward over ``tokens [B, L]``: processed next-token distributions
    ``[B, width, vocab]`` at positions ``starts + arange(width)``, and the final hidden
    states ``[B, L, D]`` (with ``feature_layers``: the fused features a drafter reads)."""
    b, length = tokens.shape
    cache = llama.KVCache.create(cfg, b, length, cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    hidden, _, feats = llama.run_blocks(graphdef, params, tokens, pos, cache, cfg, feature_layers=feature_layers)
    idx = jnp.clip(starts[:, None] + jnp.arange(width, dtype=jnp.int32), 0, length - 1)
    h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
    logits = fit_vocab(llama.lm_head(graphdef, params, h, cfg), vocab)
    return sampling.process(logits), (feats if feature_layers else hidden)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "width", "vocab", "cache_dtype", "feature_layers"))
def _teacher_probs(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers=()):
    """:func:`_teacher` (jitted)."""
    return _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers)


def _features_of(drafter) -> tuple[int, ...]:
    """The target blocks ``drafter`` reads (its ``feature_layers``: fused features), or ``()``."""
    return tuple(drafter.feature_layers) if drafter is not None else ()


def _feature_size(cfg, drafter) -> int:
    """Width of the target feature ``drafter`` reads."""
    return cfg.hidden_size * max(1, len(_features_of(drafter)))


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


def _sampling(batch, temperature=0.0, top_k=0, top_p=1.0, **fields):
    return SamplingParams.create(batch, temperature, top_k, top_p, **fields)


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
    **sampling: Any,
) -> dict:
    """α = E[Σ_x min(p, q)] along the target's own continuation (teacher forcing).

    For prompt + continuation ``y_1..y_n``, β is computed at the n positions that predict
    ``y_1..y_n``: p from one target forward, q from one drafter forward (a drafter that is a
    whole causal LM, :attr:`~specjax.core.drafting.Drafter.causal_model`: a draft model), both
    through ``SamplingParams.process`` with the given settings. Any other drafter (n-gram, custom) is run as ``propose(γ=1)`` once per
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
    seqs = [list(p["ids"]) + list(c) for p, c in zip(prompts, continuations)]
    starts = [len(p["ids"]) - 1 for p in prompts]
    counts = [len(c) for c in continuations]
    width = _bucket(max(max(counts), 1), 32)
    length = _bucket(max(len(s) for s in seqs) + 1, BUFFER_BUCKET)
    sp_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, **sampling)
    tok = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        tok[i, : len(s)] = s
    if drafter.causal_model is not None:  # q of every position from one teacher-forced forward
        betas = _betas_teacher_forced(target, drafter, tok, starts, counts, width, sp_kw, batch_size, progress)
    else:
        betas = _betas_proposed(target, drafter, tok, starts, counts, width, sp_kw, seed, progress)
    return _alpha_summary(prompts, [np.clip(b, 0.0, 1.0) for b in betas])


def _betas_teacher_forced(target, drafter, tok, starts, counts, width, sp_kw, batch_size, progress):
    """β per prompt for a drafter that is a whole causal LM (its ``causal_model``: a draft model):
    one target and one drafter forward per batch of ``batch_size`` padded rows of ``tok [N, L]``."""
    n = len(tok)
    b = max(1, min(int(batch_size), n))
    sp = _sampling(b, **sp_kw)
    model = drafter.causal_model
    tdt, ddt = _cache_dtype(target), jnp.dtype(model.cache_dtype)
    betas = []
    for lo in _progress(range(0, n, b), "alpha", enabled=progress):
        rows = list(range(lo, min(lo + b, n)))
        rows_pad = rows + [rows[0]] * (b - len(rows))
        st = np.asarray([starts[i] for i in rows_pad], np.int32)
        out = np.asarray(_betas_model(
            target.graphdef, target.config, target.params, model.graphdef, model.config,
            drafter.params, jnp.asarray(tok[rows_pad]), jnp.asarray(st), sp, width, tdt, ddt))
        betas += [out[r, : counts[i]].astype(np.float64) for r, i in enumerate(rows)]
    return betas


def _betas_proposed(target, drafter, tok, starts, counts, width, sp_kw, seed, progress):
    """β per prompt for any other drafter: one 1-token ``propose`` per position (NaN where
    nothing was proposed)."""
    vocab, length = target.config.vocab_size, tok.shape[1]
    sp1, spw = _sampling(1, **sp_kw), _sampling(width, **sp_kw)
    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(seed_key(seed), i), 1))(jnp.arange(width))
    tdt = _cache_dtype(target)
    betas = []
    for i in _progress(range(len(tok)), "alpha", total=len(tok), enabled=progress):
        row = tok[i: i + 1]
        p, hidden = _teacher_probs(target.graphdef, target.config, target.params, jnp.asarray(row),
                                   jnp.asarray([starts[i]], np.int32), sp1, width, vocab, tdt, _features_of(drafter))
        lengths = np.clip(starts[i] + 1 + np.arange(width), 1, length - 1).astype(np.int32)
        buf = jnp.asarray(np.repeat(row, width, axis=0))
        beta, proposed = _betas_generic(drafter, drafter.params, p[0], hidden[0], buf, jnp.asarray(lengths), spw,
                                        keys, vocab)
        beta = np.asarray(beta, np.float64)[: counts[i]]
        beta[~np.asarray(proposed)[: counts[i]]] = np.nan
        betas.append(beta)
    return betas


def _alpha_of(betas: Sequence[np.ndarray]) -> dict:
    """Pooled α over the positions with a proposal (non-NaN β) of ``betas``."""
    a = np.concatenate(betas) if len(betas) else np.zeros(0)
    k = a[~np.isnan(a)]
    return {"alpha": float(k.mean()) if k.size else float("nan"), "positions": int(k.size), "all": int(a.size)}


def _alpha_summary(prompts, betas) -> dict:
    """:func:`measure_alpha`'s result from β per prompt."""
    per_prompt, by_cat = [], defaultdict(list)
    for rec, b in zip(prompts, betas):
        a = _alpha_of([b])
        per_prompt.append({"question_id": rec.get("question_id"), "category": rec.get("category", "all"),
                           "alpha": a["alpha"], "positions": a["positions"],
                           "proposed_fraction": float(a["positions"] / max(b.size, 1))})
        by_cat[rec.get("category", "all")].append(b)
    pooled = _alpha_of(betas)
    return {
        "alpha": pooled["alpha"],
        "positions": pooled["positions"],
        "coverage": float(pooled["positions"] / max(pooled["all"], 1)),
        "by_category": {c: {"alpha": (a := _alpha_of(bs))["alpha"], "positions": a["positions"], "prompts": len(bs)}
                        for c, bs in by_cat.items()},
        "per_prompt": per_prompt,
        "betas": [b.tolist() for b in betas],
        "method": ALPHA_METHOD,
    }


# --------------------------------------------------------------------------- (b) costs
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "feature_layers"), donate_argnames=("cache",))
def _target_call(graphdef, cfg, params, tokens, positions, cache, sampling, tree_mask=None, feature_layers=()):
    """One target call as the loop makes it: ``llama.apply`` over ``tokens [B, T]`` (with
    ``tree_mask [B, T, T]`` for a verification block: :func:`specjax.runtime.loop.verification_mask`
    for a chain, ``tree.block_attention_mask`` for a tree; ``None`` for a prefill or one token),
    then ``SamplingParams.process``: ``(p [B, T, V], hidden [B, T, D], cache)`` (``hidden``: the fused
    features of ``feature_layers`` when given)."""
    out = llama.apply(graphdef, params, tokens, positions, cache, cfg, return_hidden=True, tree_mask=tree_mask,
                      feature_layers=feature_layers)
    return sampling.process(out.logits), out.hidden, out.cache


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "vocab"), donate_argnames=("state",))
def _draft_call(drafter, params, state, ctx, keys, gamma, vocab):
    """One whole ``propose`` call: ``(tokens [B, γ], q [B, γ, V], num_valid [B], state)``."""
    prop = drafter.propose(params, state, ctx, keys, gamma, vocab)
    return prop.tokens, prop.probs, prop.num_valid, prop.state


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
    trees: Sequence[Any] = (),
    **sampling: Any,
) -> dict:
    """Measured c(γ) and v(γ) with the decode loop's shapes (and, for draft trees, c_tree and v(N)).

    The target is timed as the loop runs it: ``llama.apply`` over T new tokens on a
    donated KV cache of the decoder's buffer length for (``prompt_len``,
    ``max_new_tokens``, γ) — γ = 0 for the autoregressive one-token step — followed by
    ``SamplingParams.process``. The drafter is timed as one whole ``propose`` call of γ
    tokens (its own cache of the same buffer length, donated), divided by γ. Each kind
    of call is warmed up, then all kinds are timed round-robin ``repeats`` times and
    the median taken (the machine may be shared: round-robin spreads load drift evenly).

    Args:
      gammas: γ values for which c(γ) and v(γ) are reported.
      measure_gammas: the γ actually timed (default: ``gammas``); for the others the target
        and drafter call times are interpolated linearly in γ (a quick mode for :func:`recommend`).
      trees: :class:`~specjax.core.drafting.TreeShape` s (N, D, K) also timed, in the same
        round-robin as the chain calls: the target call over ``[root, N nodes]`` with the tree mask
        at tree positions on the tree program's cache (:func:`_tree_target_case`), and one whole
        tree proposal of the drafter (:func:`_tree_draft_case`).
    Returns:
      dict: ``gammas``, ``c`` (list, c(γ)), ``v`` (list, v(γ)), ``c_scalar`` (c at the
      largest γ), ``t_target_ms`` ``{T: ms}``, ``t_draft_ms`` ``{γ: ms}``, ``batch``,
      ``buffer_len`` ``{γ: slots}`` and ``cache_dtype`` (the target's KV cache) of the
      decoder's own programs (:func:`timed_programs`), ``interpolated`` (γ not timed), ``method``;
      with ``trees``, ``trees`` ``{"NxDxK": {nodes, depth, topk, label, t_target_ms, t_draft_ms,
      v, c_tree, buffer_len}}``: ``v = t_target(N+1 tokens, tree mask) / t_target(1)`` and
      ``c_tree = t_draft(tree) / t_target(1)`` (the whole tree's drafter cost in target steps).
    Raises:
      ValueError: no γ or a γ < 1; ``prompt_len`` not shorter than the context; trees without
        a drafter or with K > 1 for a drafter that proposes chains only.
    """
    gammas = sorted({int(g) for g in gammas})
    if not gammas or gammas[0] < 1:
        raise ValueError(f"gammas must be integers >= 1, got {gammas}")
    timed = sorted({int(g) for g in (measure_gammas or gammas)})
    b = int(batch)
    sp = _sampling(b, temperature, top_k, top_p, **sampling)
    pos0 = int(prompt_len) + int(max_new_tokens) // 2
    progs = timed_programs(target, drafter, [0, *timed], prompt_len, max_new_tokens)
    calls = {("target", 1): _target_case(target, progs[0], b, 1, pos0, sp)}  # name -> run() -> None
    for g in timed:
        calls[("target", g + 1)] = _target_case(target, progs[g], b, g + 1, pos0, sp)
        if drafter is not None:
            calls[("draft", g)] = _draft_case(target.config, drafter, progs[g].buffer_len, b, g, pos0, sp)
    tprogs = {}
    for shape in trees:
        if drafter is None:
            raise ValueError("timing draft trees needs a drafter")
        tprogs[shape] = tree_program(target, drafter, shape, prompt_len, max_new_tokens)
        calls[("tree_target", shape)] = _tree_target_case(target, tprogs[shape], b, shape, pos0, sp)
        calls[("tree_draft", shape)] = _tree_draft_case(target.config, drafter, tprogs[shape].buffer_len, b, shape,
                                                        pos0, sp)
    med = _median_ms(calls, warmup, repeats)
    t1 = med[("target", 1)]
    # untimed γ: the call times interpolated linearly (a call's cost is about affine in its width)
    v = [t / t1 for t in _interp(timed, [med[("target", g + 1)] for g in timed], gammas)]
    c = ([t / (g * t1) for g, t in zip(gammas, _interp(timed, [med[("draft", g)] for g in timed], gammas))]
         if drafter is not None else [0.0] * len(gammas))
    return {
        "gammas": gammas,
        "c": c,
        "v": v,
        "c_scalar": c[-1],
        "t_target_ms": {1: t1, **{g + 1: med[("target", g + 1)] for g in timed}},
        "t_draft_ms": {g: med[("draft", g)] for g in timed} if drafter is not None else {},
        "batch": b,
        "buffer_len": {g: progs[g].buffer_len for g in progs},
        "cache_dtype": progs[0].cache_dtype,
        "interpolated": [g for g in gammas if g not in timed],
        "repeats": int(repeats),
        "method": COST_METHOD,
        **({"trees": {tree_key(t): {
            "nodes": t.nodes, "depth": t.depth, "topk": t.topk, "label": t.label,
            "t_target_ms": med[("tree_target", t)], "t_draft_ms": med[("tree_draft", t)],
            "v": med[("tree_target", t)] / t1, "c_tree": med[("tree_draft", t)] / t1,
            "buffer_len": tprogs[t].buffer_len} for t in trees}} if trees else {}),
    }


def tree_key(shape) -> str:
    """``"NxDxK"``: how ``specjax analyze --tree-shapes`` and its JSON name a tree shape."""
    return f"{shape.nodes}x{shape.depth}x{shape.topk}"


def tree_program(target, drafter, shape, prompt_len: int, max_new_tokens: int) -> Program:
    """The decode :class:`Program` a tree Decoder of ``shape`` runs for one prompt of
    ``prompt_len`` tokens (its buffer holds the tree's scratch slots, :func:`specjax.runtime.loop.tree_scratch`)."""
    return Decoder(target, drafter, tree_nodes=shape.nodes, tree_depth=shape.depth,
                   tree_topk=shape.topk).program(prompt_len, max_new_tokens)


def _cost_rng(*salt: int) -> np.random.Generator:
    """The inputs of a timed call: host random numbers (no device ops to compile), fixed per call kind."""
    return np.random.default_rng([0, *salt])


def _target_case(target, prog: Program, b: int, t: int, pos0: int, sp):
    """``run()``: one target call over ``t`` new tokens at positions ``pos0..`` on a donated
    KV cache of ``prog``'s buffer length and cache dtype (batch ``b``)."""
    cfg = target.config
    cache = llama.KVCache.create(cfg, b, prog.buffer_len, jnp.dtype(prog.cache_dtype))
    toks = jnp.asarray(_cost_rng(t).integers(2, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.asarray(np.broadcast_to(pos0 + np.arange(t), (b, t)), jnp.int32)
    box = [cache]
    mask = verification_mask(b, t)

    def run():
        probs, _, box[0] = _target_call(target.graphdef, cfg, target.params, toks, pos, box[0], sp, mask,
                                        prog.feature_layers)
        jax.block_until_ready(probs)
    return run


def _draft_case(cfg, drafter, buf: int, b: int, g: int, pos0: int, sp):
    """``run()``: one whole ``drafter.propose`` call of γ = ``g`` tokens (its state for a buffer
    of ``buf`` slots, donated), as in a round after a verify call."""
    vocab, rng = cfg.vocab_size, _cost_rng(100 + g)
    toks = rng.integers(2, vocab, (b, buf))
    # an n-gram drafter finds a match: repeat the context so lookups succeed as often as in text
    toks[:, pos0 // 2: pos0] = toks[:, : pos0 - pos0 // 2]
    hid = (0.1 * rng.standard_normal((b, buf, _feature_size(cfg, drafter)))).astype(np.float32)
    toks, lens, zeros = jnp.asarray(toks, jnp.int32), jnp.full((b,), pos0, jnp.int32), jnp.zeros((b,), jnp.int32)
    box = [_draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, jnp.asarray(hid), zeros), buf)]
    # a round after a verify call: γ+1 hidden states of the last target call, n = 0
    ctx = DraftContext(toks, lens, sp, jnp.asarray(hid[:, pos0 - 1: pos0 + g]), zeros)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, (b, g, 2), dtype=np.uint32))  # raw threefry keys

    def run():
        t, q, _, box[0] = _draft_call(drafter, drafter.params, box[0], ctx, keys, g, vocab)
        jax.block_until_ready((t, q))
    return run


@functools.partial(jax.jit, static_argnames=("drafter", "shape", "vocab"), donate_argnames=("state",))
def _tree_draft_call(drafter, params, state, ctx, keys, shape, vocab):
    """One whole tree proposal as the loop makes it (:func:`specjax.runtime.loop._propose_tree`):
    ``(tokens [B, N], valid [B, N], state)``."""
    from specjax.runtime.loop import _propose_tree

    prop = _propose_tree(drafter, params, state, ctx, keys, shape, vocab)
    return prop.tree.tokens, prop.tree.valid, prop.state


def _tree_target_case(target, prog: Program, b: int, shape, pos0: int, sp):
    """``run()``: one target call over the root and N nodes of a tree of ``shape`` (the
    topology of :func:`specjax.eval.theory.static_tree` at α = 1/2, random tokens) with the tree
    mask, the root at position ``pos0``, on a donated KV cache of ``prog``'s buffer and dtype."""
    from specjax.core import tree as tree_ops

    cfg = target.config
    parents, _ = analysis.static_tree(shape.nodes, shape.depth, shape.topk, analysis.rank_acceptance(0.5, shape.topk))
    depth = np.zeros(shape.nodes, np.int32)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    rng = _cost_rng(200 + shape.nodes, shape.depth, shape.topk)
    tree = tree_ops.DraftTree.create(rng.integers(2, cfg.vocab_size, (b, shape.nodes)),
                                     np.broadcast_to(parents, (b, shape.nodes)), np.broadcast_to(depth, (b, shape.nodes)),
                                     max_depth=shape.depth, max_children=shape.topk)
    toks = jnp.concatenate([jnp.asarray(rng.integers(2, cfg.vocab_size, (b, 1)), jnp.int32), tree.tokens], axis=1)
    pos = tree_ops.positions(tree, jnp.full((b,), pos0 + 1, jnp.int32))
    mask = tree_ops.block_attention_mask(tree)
    box = [llama.KVCache.create(cfg, b, prog.buffer_len, jnp.dtype(prog.cache_dtype))]

    def run():
        probs, _, box[0] = _target_call(target.graphdef, cfg, target.params, toks, pos, box[0], sp, mask,
                                        prog.feature_layers)
        jax.block_until_ready(probs)
    return run


def _tree_draft_case(cfg, drafter, buf: int, b: int, shape, pos0: int, sp):
    """``run()``: one whole tree proposal of ``shape`` by the drafter (its state for a buffer of
    ``buf`` slots, donated), as in a round after a tree verify call (``target_hidden [B, D+1, ·]``)."""
    vocab, rng = cfg.vocab_size, _cost_rng(300 + shape.nodes, shape.depth, shape.topk)
    toks = rng.integers(2, vocab, (b, buf))
    toks[:, pos0 // 2: pos0] = toks[:, : pos0 - pos0 // 2]  # n-gram matches, as in _draft_case
    hid = (0.1 * rng.standard_normal((b, buf, _feature_size(cfg, drafter)))).astype(np.float32)
    toks, lens, zeros = jnp.asarray(toks, jnp.int32), jnp.full((b,), pos0, jnp.int32), jnp.zeros((b,), jnp.int32)
    box = [_draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, jnp.asarray(hid), zeros), buf)]
    ctx = DraftContext(toks, lens, sp, jnp.asarray(hid[:, pos0 - 1: pos0 + shape.depth]), zeros)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, (b, shape.nodes, 2), dtype=np.uint32))

    def run():
        t, valid, box[0] = _tree_draft_call(drafter, drafter.params, box[0], ctx, keys, shape, vocab)
        jax.block_until_ready((t, valid))
    return run


def _median_ms(calls: dict, warmup: int, repeats: int) -> dict:
    """Median milliseconds per call kind: each ``run()`` warmed up ``warmup`` times (compile),
    then all kinds timed round-robin ``repeats`` times (load drift hits every kind alike)."""
    for run in calls.values():
        for _ in range(max(1, int(warmup))):
            run()
    samples = {k: [] for k in calls}
    for _ in range(max(1, int(repeats))):
        for k, run in calls.items():
            t0 = time.perf_counter()
            run()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


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
    sp_kw = _sampling_kw(settings)
    decoders: dict = {}
    say(f"[1/5] target's own output: {len(recs)} prompts × ≤{settings.max_new_tokens} tokens")
    base = autoregressive_run(target, recs, settings, decoders=decoders, progress=progress)
    say("[2/5] alpha by teacher forcing")
    alpha = measure_alpha(target, drafter, recs, base["tokens"], seed=settings.seed, batch_size=4, progress=progress,
                          **sp_kw)
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
    a = alpha["alpha"] if np.isfinite(alpha["alpha"]) else 0.0
    rows = theory_rows(a, gammas, costs["c"], costs["v"])
    best = best_row(rows)
    say(f"[4/5] α = {a:.4f}, c(γ) = {costs['c'][best['gamma'] - 1]:.4f}: recommended γ = {best['gamma']} "
        f"(predicted {best['speedup']:.3f}×)")
    report = _pair_report(target, drafter, settings, chat, recs, plen, alpha, costs, rows, a)
    if measure_run:
        gs = [best["gamma"]] + ([int(gamma)] if gamma is not None and int(gamma) != best["gamma"] else [])
        for g in gs:
            say(f"[5/5] speculative run at γ = {g} (interleaved with autoregressive)")
            run = measure_speedup(target, drafter, recs, g, settings, repeats=repeats, decoders=decoders,
                                  progress=progress)
            row = rows[g - 1] if g <= len(rows) else theory_rows(a, [g], costs["c_scalar"], costs["v"][-1])[0]
            report["measured"].append(_measured_entry(a, g, run, row, alpha, settings))
    for t in trees:
        entry = tree_entry(a, costs["trees"][tree_key(t)], alpha["coverage"])
        if measure_run:
            say(f"[5/5] speculative run with draft trees {tree_key(t)} (interleaved with autoregressive)")
            run = measure_speedup(target, drafter, recs, t.depth, settings, repeats=repeats, decoders=decoders,
                                  progress=progress, tree=t)
            entry.update(_tree_measured(run, entry, settings))
        report["trees"].append(entry)
    if trees:
        report["tree_model"] = TREE_MODEL
    report["recommended"] = recommend_shape(report)
    return report


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
    ms = run.get("speedup", float("nan"))
    return {
        "mean_accepted_tokens": tau,
        "tokens_discrepancy": tau - entry["expected_tokens"],
        "new_tokens": spec["new_tokens"],
        "target_calls": spec["target_calls"],
        "drafted_tokens": spec["drafted_tokens"],
        "accepted_tokens": spec["accepted_tokens"],
        "acceptance_rate": spec["acceptance_rate"],
        "accept_hist": spec["accept_hist"],
        "measured_speedup": ms,
        "predicted_speedup_from_measured_tokens": tau / entry["cost"],
        "speedup_relative_error": (entry["predicted_speedup"] - ms) / ms if ms and np.isfinite(ms) else float("nan"),
        "tokens_per_s_spec": spec["tokens_per_s"],
        "tokens_per_s_ar": run["ar"]["tokens_per_s"] if "ar" in run else float("nan"),
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
                     "median_prompt_tokens": plen, **_sampling_kw(settings)},
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
        "trees": [],
    }


def _measured_entry(a: float, g: int, run: dict, row: dict, alpha: dict, settings: DecodeSettings) -> dict:
    """One ``measured`` entry of the report: :func:`compare` plus per-category α, E(N) and τ."""
    cmp = compare(a, g, run, row, coverage=alpha["coverage"])
    by_cat = {}
    for cat, ca in alpha["by_category"].items():
        ac = ca["alpha"] if np.isfinite(ca["alpha"]) else 0.0
        by_cat[cat] = {"alpha": ca["alpha"], "expected_tokens": float(analysis.expected_tokens(ac, g)),
                       "mean_accepted_tokens": run["spec"]["by_category"].get(cat, {}).get("mean_accepted_tokens")}
    cmp["by_category"] = by_cat
    cmp["accept_hist"] = run["spec"]["accept_hist"]
    cmp["ar_tokens_match"] = run["tokens"] == run["ar_tokens"] if settings.temperature == 0 else None
    return cmp


# --------------------------------------------------------------------------- --gamma auto, --dtype auto
AUTO_PROMPTS = 2  # --gamma auto: α over at most this many prompts …
AUTO_NEW_TOKENS = 16  # … × this many tokens of the target's own continuation
FORMAT_SHAPE = (32, 128)  # --dtype auto: the decode step of a program for 32 prompt + 128 new tokens
AUTO_METHOD = (
    "costs: measure_costs at the decode programs' shapes for the run's prompt bucket and max_new_tokens, timing "
    "gamma = 1 and gamma_max only (target calls of 1, 2 and gamma_max+1 tokens, drafter proposals of 1 and gamma_max "
    "tokens; call times linear in gamma in between); alpha: the target's own continuation decoded with those "
    "programs (plus one prefill call over the prompt bucket), then beta = sum_x min(p, q) per position with q from "
    "the drafter's first proposal after a prefill"
)


def _continuation(target, progs: dict, ids: Sequence[int], n_new: int, sp, rng, eos: set,
                  feature_layers: tuple[int, ...] = ()) -> tuple:
    """The target's own continuation of ``ids``, decoded with :func:`_target_call` on a KV
    cache of ``progs[0]``'s buffer (the autoregressive program's): the prompt in one call over
    its padded bucket, as the Decoder's prefill writes it (in bfloat16/int8 a prompt fed token
    by token gets other K/V and may continue differently at a near-tie), then one token per
    call, greedy (``rng`` ``None``) or drawn from p with ``rng``, ending after an EOS id or
    ``n_new`` tokens. Greedy, it is the Decoder's autoregressive output.

    Returns:
      ``(new ids [n], p [n, V] float32, hidden [len(ids) + n - 1, D] float32)``: p of each new
      token (processed: what it was drawn from) and the target's final hidden state (or the fused
      features of ``feature_layers``) at every
      position before the last new token.
    """
    cfg, prog = target.config, progs[0]
    box = [llama.KVCache.create(cfg, 1, prog.buffer_len, jnp.dtype(prog.cache_dtype))]

    def call(tokens, start):
        t = len(tokens)
        probs, h, box[0] = _target_call(target.graphdef, cfg, target.params, jnp.asarray([tokens], jnp.int32),
                                        jnp.asarray([np.arange(start, start + t)], jnp.int32), box[0], sp,
                                        None, feature_layers)
        return probs[0], np.asarray(h[0], np.float32)

    plen = len(ids)
    padded = list(ids) + [0] * (prompt_bucket(plen) - plen)  # slots ≥ plen are overwritten before they are read
    hidden = [call(padded, 0)[1][: plen - 1]]
    out, ps, tok = [], [], int(ids[-1])
    for j in range(int(n_new)):
        p, h = call([tok], plen - 1 + j)
        hidden.append(h)
        p = np.asarray(p[0], np.float64)
        ps.append(p.astype(np.float32))
        tok = int(np.argmax(p)) if rng is None else int(rng.choice(p.size, p=p / p.sum()))
        out.append(tok)
        if tok in eos:
            break
    return out, np.stack(ps), np.concatenate(hidden)


def _betas_first_proposal(cfg, drafter, prog: Program, ids, new, p, hidden, sp, rng) -> np.ndarray:
    """β at each position of ``new`` with the cost programs' drafter calls (γ = 1, buffer of
    ``prog``): per position k, the drafter state after a prefill of ``ids + new[:k]``
    (``init_state`` with the target's hidden states), then one 1-token ``propose`` — its first
    proposal there, as in :func:`_betas_generic`; β = Σ min(p, q), NaN without a proposal.

    Args:
      p: ``[n, V]`` the target's processed distributions of ``new``; hidden: ``[len(ids) + n - 1, D]``;
        rng: a numpy Generator for the drafter's keys (β does not depend on them).
    Returns:
      ``[n]`` float64.
    """
    buf, vocab = prog.buffer_len, cfg.vocab_size
    seq = np.zeros((1, buf), np.int32)
    full = list(ids) + list(new)
    seq[0, : len(full)] = full
    hid = np.zeros((1, buf, hidden.shape[-1]), np.float32)
    hid[0, : len(hidden)] = hidden
    toks, hid = jnp.asarray(seq), jnp.asarray(hid)
    zeros, last = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, hidden.shape[-1]), jnp.float32)
    betas = np.full(len(new), np.nan)
    for k in range(len(new)):
        lens = jnp.asarray([len(ids) + k], jnp.int32)
        state = _draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, hid, zeros), buf)
        keys = jnp.asarray(rng.integers(0, 2 ** 32, (1, 1, 2), dtype=np.uint32))  # raw threefry keys (q is not drawn)
        _, q, valid, _ = _draft_call(drafter, drafter.params, state, DraftContext(toks, lens, sp, last, zeros),
                                     keys, 1, vocab)
        if int(valid[0]) > 0:
            betas[k] = float(np.minimum(p[k], np.asarray(q[0, 0], np.float32)).sum())
    return np.clip(betas, 0.0, 1.0)


def alpha_by_decoding(target, drafter, prompts: Sequence[dict], progs: dict, settings: DecodeSettings,
                      new_tokens: int = AUTO_NEW_TOKENS) -> dict:
    """α with the programs :func:`measure_costs` compiled and one prefill call: each prompt's own
    continuation by the target (:func:`_continuation`; greedy, or sampled with
    ``settings``' temperature, top-k, top-p and seed; EOS ends it unless ``ignore_eos``), then β
    per position from the drafter's first proposal there (:func:`_betas_first_proposal`). The
    same β as :func:`measure_alpha`'s, without its teacher-forced forward.

    Args:
      prompts: records (:func:`prompt_records`); progs: ``{γ: Program}`` holding γ = 0 and 1
        (:func:`timed_programs`).
    Returns:
      :func:`measure_alpha`'s dict, plus ``continuations`` (new ids per prompt).
    """
    sp_kw = _sampling_kw(settings)
    sp = _sampling(1, **sp_kw)
    eos = set() if settings.ignore_eos else set(target.config.eos_token_ids)
    betas, conts = [], []
    for i, rec in enumerate(prompts):
        rng = None if settings.temperature == 0 else np.random.default_rng([int(settings.seed), i])
        new, p, hidden = _continuation(target, progs, rec["ids"], new_tokens, sp, rng, eos, _features_of(drafter))
        keys = np.random.default_rng([int(settings.seed), i, 1])
        betas.append(_betas_first_proposal(target.config, drafter, progs[1], rec["ids"], new, p, hidden, sp, keys))
        conts.append(new)
    return {**_alpha_summary(prompts, betas), "continuations": conts}


def recommend(target, drafter, prompts, settings: DecodeSettings | None = None, *, gamma_max: int = 8,
              chat: bool = False, cache=None, progress=None, timing_repeats: int = 7,
              measure_gammas: Sequence[int] | None = None) -> tuple[int, dict]:
    """γ with the largest predicted speedup for this pair (``specjax generate --gamma auto``),
    from costs and α measured quickly, or read from ``cache``.

    * costs c(γ), v(γ) (:func:`measure_costs`, batch 1, the decode programs' buffers for the
      longest of those prompts and ``settings.max_new_tokens``), timed at γ = 1 and ``gamma_max`` only
      (``measure_gammas`` to change that; call times linear in between), ``timing_repeats``
      timings each; 5 programs to compile. Cached per host, target, drafter (with their
      weight formats), buffers and timed γ.
    * α (:func:`alpha_by_decoding`) over ≤ ``AUTO_PROMPTS`` prompts × ≤ ``AUTO_NEW_TOKENS``
      tokens of the target's own continuation, with ``settings``' sampling; it runs the cost
      programs and one prefill call per prompt bucket. Cached per host, target, drafter,
      sampling settings (and seed when sampling) and prompt ids.

    Args:
      prompts: texts, id lists or records (:func:`prompt_records`).
      settings: sampling, ``max_new_tokens``, seed, ``ignore_eos`` of the run (default
        ``DecodeSettings()``; its batch size is not used: costs are timed at batch 1).
      cache: a :class:`specjax.eval.hostcache.HostCache`, or ``None`` (measure every time).
      progress: a :class:`specjax.runtime.progress.Progress`: one line per measuring phase.
    Returns:
      ``(γ in [1, gamma_max], report)``; the report holds ``gamma``, ``alpha``, ``coverage``,
      ``positions``, ``gammas``, ``c``, ``v``, ``t_target_ms`` / ``t_draft_ms`` (``{str(T or γ): ms}``),
      ``table`` (:func:`theory_rows`), ``predicted_speedup``, ``costs_source`` / ``alpha_source``
      (:func:`cached_or_measured`) and ``method``.
    Raises:
      ValueError: no drafter; ``gamma_max < 1``; no prompt, an empty one, or one that leaves no
        room in the context for a new token.
    """
    from specjax.eval.hostcache import drafter_fingerprint, model_fingerprint

    if drafter is None:
        raise ValueError("--gamma auto needs a drafter")
    gamma_max = int(gamma_max)
    if gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    settings = DecodeSettings() if settings is None else settings
    recs = prompt_records(list(prompts)[:AUTO_PROMPTS], target, chat)
    gammas = list(range(1, gamma_max + 1))
    timed = sorted({1, *(int(g) for g in (measure_gammas or (gamma_max,)) if 1 <= int(g) <= gamma_max)})
    plen = max(len(r["ids"]) for r in recs)  # the buffers hold the longest prompt + its continuation
    mnt = int(settings.max_new_tokens)
    ctx = Decoder(target, drafter, 1).context_limit()
    _validate([r["ids"] for r in recs], mnt, 1, drafter, ctx)  # the Decoder's own messages
    progs = timed_programs(target, drafter, [0, *timed], plen, mnt)
    pair = {"target": model_fingerprint(target), "drafter": drafter_fingerprint(drafter)}
    sp_kw = _sampling_kw(settings)

    def costs_now():
        m = measure_costs(target, drafter, gammas, batch=1, prompt_len=plen, max_new_tokens=mnt,
                          repeats=timing_repeats, measure_gammas=timed, **sp_kw)
        return {"c": m["c"], "v": m["v"], "t_target_ms": {str(k): v for k, v in m["t_target_ms"].items()},
                "t_draft_ms": {str(k): v for k, v in m["t_draft_ms"].items()}, "interpolated": m["interpolated"]}

    widths = ", ".join(str(g + 1) for g in [0, *timed])
    costs, costs_src = cached_or_measured(
        cache, "costs", {**pair, "batch": 1, "gammas": gammas, "timed": timed, "repeats": int(timing_repeats),
                         "buffer_len": {str(g): pr.buffer_len for g, pr in progs.items()},
                         "cache_dtype": progs[0].cache_dtype}, costs_now, progress,
        f"measuring costs for --gamma auto: target calls of {widths} tokens, drafter proposals of "
        f"{' and '.join(str(g) for g in timed)} tokens ({1 + 2 * len(timed)} programs to compile)")
    n_new = min(AUTO_NEW_TOKENS, mnt, ctx - plen)  # within the context, like the run itself

    def alpha_now():
        a = alpha_by_decoding(target, drafter, recs, progs, settings, n_new)
        return {k: a[k] for k in ("alpha", "positions", "coverage", "betas")}

    ids_sha = hashlib.sha256(json.dumps([r["ids"] for r in recs]).encode()).hexdigest()
    alpha, alpha_src = cached_or_measured(
        cache, "alpha", {**pair, "sampling": sp_kw, "seed": int(settings.seed) if settings.temperature > 0 else None,
                         "ignore_eos": bool(settings.ignore_eos), "new_tokens": n_new, "prompts": ids_sha},
        alpha_now, progress,
        f"measuring α for --gamma auto: the target's own continuation of {len(recs)} prompt"
        f"{'s' if len(recs) > 1 else ''} (≤ {n_new} tokens each; one prefill program to compile), "
        "scored by the drafter")
    a = alpha["alpha"] if alpha["alpha"] is not None and np.isfinite(alpha["alpha"]) else 0.0
    rows = theory_rows(a, gammas, costs["c"], costs["v"])
    best = best_row(rows)
    report = {"gamma": int(best["gamma"]), "alpha": a, "coverage": alpha["coverage"], "positions": alpha["positions"],
              "gammas": gammas, "c": costs["c"], "v": costs["v"], "t_target_ms": costs["t_target_ms"],
              "t_draft_ms": costs["t_draft_ms"], "table": rows, "predicted_speedup": best["speedup"],
              "costs_source": costs_src, "alpha_source": alpha_src, "method": AUTO_METHOD}
    return int(best["gamma"]), report


def recommend_gamma(target, drafter, prompt_texts: Sequence[str], chat: bool = False, gamma_max: int = 8,
                    **kw) -> int:
    """:func:`recommend`'s γ (an int in [1, gamma_max]; 1 when no γ is predicted to pay).
    ``kw``: :func:`recommend`'s ``settings``, ``cache``, ``progress``, ``timing_repeats``,
    ``measure_gammas``.

    Raises:
      ValueError: no drafter; ``gamma_max < 1``.
    """
    if drafter is None:
        raise ValueError("recommend_gamma needs a drafter")
    return recommend(target, drafter, list(prompt_texts), chat=chat, gamma_max=gamma_max, **kw)[0]


# Where --dtype auto takes a format without measuring: the default model on a CPU runs float32
# (faithful by construction) until a measurement on this host (`specjax bench --dtype auto`) has
# found a faster format that passes the fidelity bar (specjax.eval.fidelity). int8 was predicted
# here before the bar existed: fastest on every x86 CPU measured, but 86% top-1 agreement with
# float32 (BENCHMARKS.md, "Weight formats: accuracy against float32").
PREDICTED_FORMATS = (("cpu", "float32"),)


def predicted_format(formats: Sequence[str], model=None, host: dict | None = None) -> tuple[str, str] | None:
    """``(format, reason)`` when ``model`` is the default model (``None``/``"default"``) and this
    host's backend has a rule in :data:`PREDICTED_FORMATS` naming one of ``formats``, else ``None``.

    ``host``: :func:`specjax.eval.hostcache.host_fingerprint` (computed when ``None``)."""
    from specjax.eval.hostcache import host_fingerprint

    if model not in (None, "default"):
        return None
    host = host_fingerprint() if host is None else host
    for backend, fmt in PREDICTED_FORMATS:
        if host.get("backend") == backend and fmt in formats:
            return fmt, (f"predicted: {fmt} is faithful by construction, and no faster format has been measured "
                         "faithful on this host")
    return None


def fastest_format(model, *, formats: Sequence[str] = llama.WEIGHT_FORMATS, tokens: int = 1, cache=None,
                   progress=None, repeats: int = 7, warmup: int = 2, predict: bool = False) -> tuple[str, dict, Any]:
    """The fastest *faithful* weight format for ``model`` on this host (``--dtype auto``).

    First the fidelity bar (:mod:`specjax.eval.fidelity`): each candidate but float32 is
    measured against float32 once per model and host (cached) and dropped if it misses the bar.
    Then each remaining format's step is one target call of ``tokens`` new tokens (1: an
    autoregressive step; γ + 1: a verification) on the KV cache of the Decoder's own program for
    ``FORMAT_SHAPE`` (32 prompt + 128 new tokens) — :func:`_target_case`, as
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

    formats = list(dict.fromkeys(llama.weight_format(f) for f in formats))
    if not formats:
        raise ValueError("formats must name at least one weight format")
    if isinstance(tokens, bool) or int(tokens) != tokens or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    tokens = int(tokens)
    loaded = not (model is None or isinstance(model, str))
    ident = fidelity.identity(model)
    box = {}

    def speed_parts(fmts):
        return {"model": ident, "formats": fmts, "tokens": tokens, "shape": list(FORMAT_SHAPE),
                "repeats": int(repeats), "definitions": [llama.FORMAT_DEFINITION[f] for f in fmts]}

    fid = {f: fidelity.lookup(model, f, cache, ident) for f in formats}
    if predict:
        known = all(v is not None for v in fid.values())
        faithful = [f for f in formats if known and fid[f]["faithful"]]
        if not known or not faithful or cache is None or cache.get("format", speed_parts(faithful)) is None:
            guess = predicted_format(formats, model)
            if guess is not None:
                src = {"cached": False, "created": None, "seconds": 0.0, "path": None, "predicted": guess[1]}
                unfaithful = [f for f in formats if fid[f] is not None and not fid[f]["faithful"]]
                return guess[0], {"step_ms": {}, "tokens": tokens, "source": src, "fidelity": fid,
                                  "unfaithful": unfaithful}, None

    def base():
        if "float32" not in box:
            box["float32"] = convert_model(model, "float32") if loaded else load_model(model, dtype="float32")
        return box["float32"]

    for f in formats:
        if fid[f] is None:
            fid[f] = fidelity.measure(model, f, cache=cache, progress=progress, ident=ident, reference=base())
    faithful = [f for f in formats if fid[f]["faithful"]] or ["float32"]

    def measure():
        plen, mnt = FORMAT_SHAPE
        sp = _sampling(1, 0.0, 0, 1.0)
        calls = {}
        for fmt in faithful:
            m = box[fmt] = convert_model(base(), fmt)
            prog = timed_programs(m, None, [tokens - 1], plen, mnt)[tokens - 1]
            calls[("step", fmt)] = _target_case(m, prog, 1, tokens, plen + mnt // 2, sp)
        med = _median_ms(calls, warmup, repeats)
        return {"step_ms": {fmt: med[("step", fmt)] for fmt in faithful}}

    parts = speed_parts(faithful)
    formats, all_formats = faithful, formats
    if len(faithful) == 1:  # nothing to race
        only = faithful[0]
        chosen = box.get(only) or (convert_model(box["float32"], only) if "float32" in box else None)
        if chosen is None and loaded:
            chosen = convert_model(model, only)
        src = {"cached": all(fid[f].get("source", {}).get("cached", True) for f in all_formats), "created": None,
               "seconds": 0.0, "path": None, "only_faithful": True}
        return only, {"step_ms": {}, "tokens": tokens, "source": src, "fidelity": fid,
                      "unfaithful": [f for f in all_formats if f != only]}, chosen
    value, src = cached_or_measured(
        cache, "format", parts, measure, progress,
        ("" if loaded or "float32" in box else
         f"loading {'the default model' if model in (None, 'default') else model} in float32, then ")
        + f"measuring its decode step ({tokens} token{'s' if tokens > 1 else ''} per call) in {', '.join(formats)} "
        "for --dtype auto")
    step = {f: float(value["step_ms"][f]) for f in formats}  # in the order asked (JSON sorts the keys)
    best = min(formats, key=lambda f: (step[f], formats.index(f)))
    chosen = box.get(best)
    if chosen is None and loaded:
        chosen = convert_model(model, best)
    unfaithful = [f for f in all_formats if f not in faithful]
    return best, {"step_ms": step, "tokens": tokens, "source": src, "fidelity": fid, "unfaithful": unfaithful}, chosen
