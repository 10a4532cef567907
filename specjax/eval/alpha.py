"""The measured acceptance rate α (part of :mod:`specjax.eval.measure`, which re-exports it).

* :func:`measure_alpha` — α as ``Σ_x min(p, q)`` (Leviathan et al. 2023, Definition 3.1,
  Theorem 3.5) along the target's own output, by teacher forcing: one target forward
  and one drafter forward over prompt + continuation, both processed with the same
  :meth:`SamplingParams.process` the decode loop uses. Independent of the loop's
  acceptance counters.
* :func:`alpha_by_decoding` — the same β along a continuation the target decodes itself with
  the cost programs (:func:`specjax.eval.costs.timed_programs`), for ``--gamma auto``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafting import DraftContext
from specjax.drafters.model import fit_vocab
from specjax.eval.common import (
    draft_call, draft_init, features_of, raw_features_of, sampling_params, sampling_key, target_call,
)
from specjax.eval.speedup import progress_bar
from specjax.models import llama
from specjax.runtime.decoder import BUFFER_BUCKET, Decoder, Program, round_up, prompt_bucket, seed_key
from specjax.runtime.settings import DecodeSettings

ALPHA_METHOD = (
    "alpha = mean over positions of beta = sum_x min(p, q) (Leviathan et al. 2023, Def. 3.1), "
    "teacher-forced along the target's own continuation; p and q made by the same "
    "SamplingParams.process; pooled over positions (a category's alpha weights each position equally)"
)
AUTO_NEW_TOKENS = 16  # --gamma auto: α over ≤ AUTO_PROMPTS prompts × this many tokens of the target's own continuation


def _cache_dtype(target) -> Any:
    """The target's KV-cache dtype in the decoder's programs (teacher forcing uses it too)."""
    return jnp.dtype(Decoder(target).cache_dtype)


# --------------------------------------------------------------------------- teacher forcing
def _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers=(),
             raw_features=False):
    """One teacher-forced forward over ``tokens [B, L]``: processed next-token distributions
    ``[B, width, vocab]`` at positions ``starts + arange(width)``, and the final hidden
    states ``[B, L, D]`` (with ``feature_layers``: the fused features a drafter reads)."""
    b, length = tokens.shape
    cache = llama.KVCache.create(cfg, b, length, cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    hidden, _, feats = llama.run_blocks(graphdef, params, tokens, pos, cache, cfg, feature_layers=feature_layers,
                                        raw_features=raw_features)
    idx = jnp.clip(starts[:, None] + jnp.arange(width, dtype=jnp.int32), 0, length - 1)
    h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
    logits = fit_vocab(llama.lm_head(graphdef, params, h, cfg), vocab)
    return sampling.process(logits), (feats if feature_layers else hidden)


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "width", "vocab", "cache_dtype", "feature_layers",
                                             "raw_features"))
def _teacher_probs(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers=(),
                   raw_features=False):
    """:func:`_teacher` (jitted)."""
    return _teacher(graphdef, cfg, params, tokens, starts, sampling, width, vocab, cache_dtype, feature_layers,
                    raw_features)


@functools.partial(jax.jit, static_argnames=("tg", "tcfg", "dg", "dcfg", "width", "tdt", "ddt"))
def _betas_model(tg, tcfg, tparams, dg, dcfg, dparams, tokens, starts, sampling, width, tdt, ddt):
    """``β [B, width]`` for a separate draft model: Σ min(p, q) per position."""
    vocab = tcfg.vocab_size
    p, _ = _teacher(tg, tcfg, tparams, tokens, starts, sampling, width, vocab, tdt)
    q, _ = _teacher(dg, dcfg, dparams, tokens, starts, sampling, width, vocab, ddt)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


@functools.partial(jax.jit, static_argnames=("drafter", "vocab", "slots"))
def _betas_generic(drafter, dparams, p, hidden, buf, lengths, sampling, keys, vocab, slots: int = 1):
    """Any drafter: one row per position, each as the first round after a prefill of
    ``buf[:length]`` (``init_state`` with the target's hidden states ``hidden [L, D]`` for
    feature-level drafters, then a ``slots``-token ``propose``); returns ``(β [R], proposed [R])``
    with ``p [R, V]`` the target's distributions at those positions (``slots`` > 1: β ``[R, slots]``,
    row r's slot j against ``p[r + j]``, clipped at the last row)."""
    r = buf.shape[0]
    zeros = jnp.zeros((r,), jnp.int32)
    init_ctx = DraftContext(buf, lengths, sampling, jnp.broadcast_to(hidden, (r,) + hidden.shape), zeros)
    state = drafter.init_state(dparams, init_ctx, buf.shape[1])
    ctx = DraftContext(buf, lengths, sampling, jnp.zeros((r, slots + 1, hidden.shape[-1]), jnp.float32), zeros)
    prop = drafter.propose(dparams, state, ctx, keys, slots, vocab)
    if slots == 1:
        return jnp.sum(jnp.minimum(p, prop.probs[:, 0]), axis=-1), prop.num_valid > 0
    at = jnp.minimum(jnp.arange(r)[:, None] + jnp.arange(slots)[None, :], r - 1)  # [R, slots]
    return jnp.sum(jnp.minimum(p[at], prop.probs), axis=-1), prop.num_valid > 0


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
    slots: int = 1,
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

    With ``slots`` > 1 (a drafter that drafts ``slots`` tokens in ONE pass, so draft i does not
    depend on the drafts before it: a block drafter, ``chain_passes(γ) == 1``) each position's
    proposal is ``propose(γ = slots)`` and slot i is scored against p at the position i − 1 further
    on: the rate at which the i-th draft is accepted when the drafts before it were.

    Args:
      prompts: records from :func:`~specjax.eval.common.prompt_records` (``ids``, ``category``).
      continuations: per prompt, the target's own new tokens (greedy or sampled).
      slots: block slots scored per proposal (1: the first draft only).
    Returns:
      dict: ``alpha`` (pooled over positions), ``positions``, ``coverage`` (fraction of
      positions with a proposal), ``by_category`` ``{cat: {alpha, positions, prompts}}``,
      ``per_prompt`` (``alpha``, ``positions``, ``category``, ``question_id``),
      ``betas`` (per prompt, per position; NaN where nothing was proposed: a numeric mask, written
      to JSON as ``null``), ``method``; with
      ``slots`` > 1 also ``alpha_by_position`` (slots 1..``slots``; slot 1's is ``alpha``). Every
      α is ``None`` where no position was scored (no data: :mod:`specjax.runtime.stats`).
    Raises:
      ValueError: continuations not one per prompt; ``slots`` > 1 for a drafter that is a whole
        causal LM or that drafts with more than one pass.
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"got {len(continuations)} continuations for {len(prompts)} prompts")
    seqs = [list(p["ids"]) + list(c) for p, c in zip(prompts, continuations)]
    starts = [len(p["ids"]) - 1 for p in prompts]
    counts = [len(c) for c in continuations]
    width = round_up(max(max(counts), 1), 32)
    slots = int(slots)
    if slots > 1 and (drafter.causal_model is not None or drafter.chain_passes(slots) != 1):
        raise ValueError("slots > 1 scores the block slots of a one-pass (block) drafter; this drafter drafts "
                         "token by token")
    length = round_up(max(len(s) for s in seqs) + slots, BUFFER_BUCKET)  # room for a block's writes past the end
    sp_kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, **sampling)
    tok = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        tok[i, : len(s)] = s
    if drafter.causal_model is not None:  # q of every position from one teacher-forced forward
        betas = _betas_teacher_forced(target, drafter, tok, starts, counts, width, sp_kw, batch_size, progress)
    else:
        betas = _betas_proposed(target, drafter, tok, starts, counts, width, sp_kw, seed, progress, slots)
    if slots == 1:
        return _alpha_summary(prompts, [np.clip(b, 0.0, 1.0) for b in betas])
    out = _alpha_summary(prompts, [np.clip(b[:, 0], 0.0, 1.0) for b in betas])
    out["alpha_by_position"] = _by_position(betas, slots)
    return out


def _by_position(betas: Sequence[np.ndarray], slots: int) -> list[float | None]:
    """Per-slot α: the mean β of each column of the ``[n, slots]`` arrays ``betas`` over the positions
    scored (``None`` for a slot never scored)."""
    allb = np.clip(np.concatenate(betas), 0.0, 1.0) if len(betas) else np.zeros((0, slots))
    return [_alpha_of([c])["alpha"] for c in allb.T]


def _betas_teacher_forced(target, drafter, tok, starts, counts, width, sp_kw, batch_size, progress):
    """β per prompt for a drafter that is a whole causal LM (its ``causal_model``: a draft model):
    one target and one drafter forward per batch of ``batch_size`` padded rows of ``tok [N, L]``."""
    n = len(tok)
    b = max(1, min(int(batch_size), n))
    sp = sampling_params(b, **sp_kw)
    model = drafter.causal_model
    tdt, ddt = _cache_dtype(target), jnp.dtype(model.cache_dtype)
    betas = []
    for lo in progress_bar(range(0, n, b), "alpha", enabled=progress):
        rows = list(range(lo, min(lo + b, n)))
        rows_pad = rows + [rows[0]] * (b - len(rows))
        st = np.asarray([starts[i] for i in rows_pad], np.int32)
        out = np.asarray(_betas_model(
            target.graphdef, target.config, target.params, model.graphdef, model.config,
            drafter.params, jnp.asarray(tok[rows_pad]), jnp.asarray(st), sp, width, tdt, ddt))
        betas += [out[r, : counts[i]].astype(np.float64) for r, i in enumerate(rows)]
    return betas


def _betas_proposed(target, drafter, tok, starts, counts, width, sp_kw, seed, progress, slots: int = 1):
    """β per prompt for any other drafter: one 1-token ``propose`` per position (NaN where
    nothing was proposed); with ``slots`` > 1 one ``slots``-token proposal per position, β ``[n, slots]``
    (slot i against p at the position i − 1 further on; NaN past the continuation's end)."""
    vocab, length = target.config.vocab_size, tok.shape[1]
    sp1, spw = sampling_params(1, **sp_kw), sampling_params(width, **sp_kw)
    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(seed_key(seed), i), slots))(jnp.arange(width))
    tdt = _cache_dtype(target)
    betas = []
    for i in progress_bar(range(len(tok)), "alpha", total=len(tok), enabled=progress):
        row = tok[i: i + 1]
        p, hidden = _teacher_probs(target.graphdef, target.config, target.params, jnp.asarray(row),
                                   jnp.asarray([starts[i]], np.int32), sp1, width, vocab, tdt, features_of(drafter),
                                   raw_features_of(drafter))
        lengths = np.clip(starts[i] + 1 + np.arange(width), 1, length - 1).astype(np.int32)
        buf = jnp.asarray(np.repeat(row, width, axis=0))
        beta, proposed = _betas_generic(drafter, drafter.params, p[0], hidden[0], buf, jnp.asarray(lengths), spw,
                                        keys, vocab, slots)
        n = counts[i]
        beta = np.asarray(beta, np.float64)[:n]
        beta[~np.asarray(proposed)[:n]] = np.nan
        if slots > 1:  # row r's slot j scores position r + j: NaN where that is past the continuation
            beta[np.arange(n)[:, None] + np.arange(slots)[None, :] >= n] = np.nan
        betas.append(beta)
    return betas


def _alpha_of(betas: Sequence[np.ndarray]) -> dict:
    """Pooled α over the positions with a proposal (non-NaN β) of ``betas``."""
    a = np.concatenate(betas) if len(betas) else np.zeros(0)
    k = a[~np.isnan(a)]
    return {"alpha": float(k.mean()) if k.size else None, "positions": int(k.size), "all": int(a.size)}


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


# --------------------------------------------------------------------------- along the target's decoded continuation
def _continuation(target, progs: dict, ids: Sequence[int], n_new: int, sp, rng, eos: set,
                  feature_layers: tuple[int, ...] = (), raw_features: bool = False) -> tuple:
    """The target's own continuation of ``ids``, decoded with :func:`target_call` on a KV
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
        probs, h, box[0] = target_call(target.graphdef, cfg, target.params, jnp.asarray([tokens], jnp.int32),
                                        jnp.asarray([np.arange(start, start + t)], jnp.int32), box[0], sp,
                                        None, feature_layers, raw_features)
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


def _betas_first_proposal(cfg, drafter, prog: Program, ids, new, p, hidden, sp, rng, slots: int = 1) -> np.ndarray:
    """β at each position of ``new`` with the cost programs' drafter calls (buffer of ``prog``):
    per position k, the drafter state after a prefill of ``ids + new[:k]`` (``init_state`` with the
    target's hidden states), then one ``propose`` of ``slots`` tokens — its first proposal there, as
    in :func:`_betas_generic`; β = Σ min(p, q), NaN without a proposal. With ``slots`` > 1 (a drafter
    that drafts all slots in one pass, so slot i's q_i does not depend on the drafts before it: a
    block drafter) slot i is scored against the target's p at position k + i − 1, i.e. the rate at
    which the i-th draft is accepted when the drafts before it were (the target's own tokens).

    Args:
      p: ``[n, V]`` the target's processed distributions of ``new``; hidden: ``[len(ids) + n - 1, D]``;
        rng: a numpy Generator for the drafter's keys (β does not depend on them).
    Returns:
      ``[n]`` float64 (``slots`` = 1), else ``[n, slots]`` (NaN past the end of ``new``).
    """
    buf, vocab = prog.buffer_len, cfg.vocab_size
    seq = np.zeros((1, buf), np.int32)
    full = list(ids) + list(new)
    seq[0, : len(full)] = full
    hid = np.zeros((1, buf, hidden.shape[-1]), np.float32)
    hid[0, : len(hidden)] = hidden
    toks, hid = jnp.asarray(seq), jnp.asarray(hid)
    zeros, last = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, hidden.shape[-1]), jnp.float32)
    betas = np.full((len(new), slots), np.nan)
    for k in range(len(new)):
        lens = jnp.asarray([len(ids) + k], jnp.int32)
        state = draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, hid, zeros), buf)
        keys = jnp.asarray(rng.integers(0, 2 ** 32, (1, slots, 2), dtype=np.uint32))  # raw threefry keys (q is not drawn)
        _, q, valid, _ = draft_call(drafter, drafter.params, state, DraftContext(toks, lens, sp, last, zeros),
                                     keys, slots, vocab)
        q = np.asarray(q[0], np.float32)
        for i in range(min(int(valid[0]), len(new) - k)):
            betas[k, i] = float(np.minimum(p[k + i], q[i]).sum())
    betas = np.clip(betas, 0.0, 1.0)
    return betas[:, 0] if slots == 1 else betas


def alpha_by_decoding(target, drafter, prompts: Sequence[dict], progs: dict, settings: DecodeSettings,
                      new_tokens: int = AUTO_NEW_TOKENS) -> dict:
    """α with the programs :func:`~specjax.eval.costs.measure_costs` compiled and one prefill call: each prompt's own
    continuation by the target (:func:`_continuation`; greedy, or sampled with
    ``settings``' temperature, top-k, top-p and seed; EOS ends it unless ``ignore_eos``), then β
    per position from the drafter's first proposal there (:func:`_betas_first_proposal`). The
    same β as :func:`measure_alpha`'s, without its teacher-forced forward.

    Args:
      prompts: records (:func:`~specjax.eval.common.prompt_records`); progs: ``{γ: Program}`` holding γ = 0 and 1
        (:func:`~specjax.eval.costs.timed_programs`).
    Returns:
      :func:`measure_alpha`'s dict, plus ``continuations`` (new ids per prompt); for a drafter that
      drafts γ slots in one pass (``chain_passes(γ) == 1``, a block drafter) with programs up to γ > 1,
      also ``alpha_by_position`` (slots 1..γ of one proposal: :func:`_betas_first_proposal`).
    """
    sp_kw = sampling_key(settings)
    sp = sampling_params(1, **sp_kw)
    eos = set() if settings.ignore_eos else set(target.config.eos_token_ids)
    slots = max(progs) if drafter.chain_passes(max(progs)) == 1 and max(progs) > 1 else 1
    betas, by_slot, conts = [], [], []
    for i, rec in enumerate(prompts):
        rng = None if settings.temperature == 0 else np.random.default_rng([int(settings.seed), i])
        new, p, hidden = _continuation(target, progs, rec["ids"], new_tokens, sp, rng, eos, features_of(drafter),
                                       raw_features_of(drafter))
        keys = np.random.default_rng([int(settings.seed), i, 1])
        b = _betas_first_proposal(target.config, drafter, progs[slots], rec["ids"], new, p, hidden, sp, keys, slots)
        betas.append(b if slots == 1 else b[:, 0])
        by_slot.append(b.reshape(len(new), slots))
        conts.append(new)
    out = {**_alpha_summary(prompts, betas), "continuations": conts}
    if slots > 1:  # one pass drafts every slot: per-slot rates
        out["alpha_by_position"] = _by_position(by_slot, slots)
    return out
