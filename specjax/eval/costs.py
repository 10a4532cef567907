"""The measured cost ratios (part of :mod:`specjax.eval.measure`, which re-exports them):
:func:`measure_costs` — ``c = t_draft/t_target`` and ``v(γ) = t_target(γ+1)/t_target(1)`` (draft
trees: ``c_tree`` and ``v(N)``) from timed jitted calls with the decode loop's shapes: the batch,
and the buffer length and KV-cache dtype of the very programs the :class:`Decoder` runs
(:func:`timed_programs`)."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafting import DraftContext
from specjax.drafters.ngram import NgramDrafter
from specjax.eval import theory as analysis
from specjax.eval.common import draft_call, draft_init, features_of, sampling_params, target_call
from specjax.models import llama
from specjax.runtime.decoder import Decoder, Program
from specjax.runtime.loop import verification_mask

COST_METHOD = (
    "medians of timed jitted calls, round-robin over call kinds after warm-up, with the decode loop's "
    "batch and cache buffer length (donated cache): t_target(T) = llama.apply over T new tokens + "
    "SamplingParams.process; t_draft(gamma) = one whole drafter.propose call of gamma tokens; "
    "c(gamma) = t_draft(gamma) / (gamma * t_target(1)); v(gamma) = t_target(gamma+1) / t_target(1)"
)


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


def _feature_size(cfg, drafter) -> int:
    """Width of the target feature ``drafter`` reads."""
    return cfg.hidden_size * max(1, len(features_of(drafter)))


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
        and drafter call times are interpolated linearly in γ (a quick mode for :func:`~specjax.eval.auto.recommend`).
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
    sp = sampling_params(b, temperature, top_k, top_p, **sampling)
    pos0 = int(prompt_len) + int(max_new_tokens) // 2
    progs = timed_programs(target, drafter, [0, *timed], prompt_len, max_new_tokens)
    calls, tprogs = _cost_calls(target, drafter, progs, timed, trees, b, pos0, sp, prompt_len, max_new_tokens)
    med = median_ms(calls, warmup, repeats)
    return _cost_report(med, gammas, timed, drafter, progs, trees, tprogs, b, repeats)


def _cost_calls(target, drafter, progs: dict, timed: Sequence[int], trees: Sequence[Any], b: int, pos0: int, sp,
                prompt_len: int, max_new_tokens: int) -> tuple[dict, dict]:
    """:func:`measure_costs`' timed calls ``{kind: run()}`` (the target at 1 and γ + 1 tokens, the
    drafter at each timed γ, each tree's target and drafter calls) and the tree programs ``{shape: Program}``."""
    calls = {("target", 1): target_case(target, progs[0], b, 1, pos0, sp)}  # name -> run() -> None
    for g in timed:
        calls[("target", g + 1)] = target_case(target, progs[g], b, g + 1, pos0, sp)
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
    return calls, tprogs


def _cost_report(med: dict, gammas: list[int], timed: list[int], drafter, progs: dict, trees: Sequence[Any],
                 tprogs: dict, b: int, repeats: int) -> dict:
    """:func:`measure_costs`' result from the median call times ``med`` (:func:`median_ms`)."""
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


def target_case(target, prog: Program, b: int, t: int, pos0: int, sp):
    """``run()``: one target call over ``t`` new tokens at positions ``pos0..`` on a donated
    KV cache of ``prog``'s buffer length and cache dtype (batch ``b``)."""
    cfg = target.config
    cache = llama.KVCache.create(cfg, b, prog.buffer_len, jnp.dtype(prog.cache_dtype))
    toks = jnp.asarray(_cost_rng(t).integers(2, cfg.vocab_size, (b, t)), jnp.int32)
    pos = jnp.asarray(np.broadcast_to(pos0 + np.arange(t), (b, t)), jnp.int32)
    box = [cache]
    mask = verification_mask(b, t)

    def run():
        probs, _, box[0] = target_call(target.graphdef, cfg, target.params, toks, pos, box[0], sp, mask,
                                        prog.feature_layers, prog.raw_features)
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
    box = [draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, jnp.asarray(hid), zeros), buf)]
    # a round after a verify call: γ+1 hidden states of the last target call, n = 0
    ctx = DraftContext(toks, lens, sp, jnp.asarray(hid[:, pos0 - 1: pos0 + g]), zeros)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, (b, g, 2), dtype=np.uint32))  # raw threefry keys

    def run():
        t, q, _, box[0] = draft_call(drafter, drafter.params, box[0], ctx, keys, g, vocab)
        jax.block_until_ready((t, q))
    return run


@functools.partial(jax.jit, static_argnames=("drafter", "shape", "vocab"), donate_argnames=("state",))
def _tree_draft_call(drafter, params, state, ctx, keys, shape, vocab):
    """One whole tree proposal as the loop makes it (:func:`specjax.runtime.loop.propose_tree`):
    ``(tokens [B, N], valid [B, N], state)``."""
    from specjax.runtime.loop import propose_tree

    prop = propose_tree(drafter, params, state, ctx, keys, shape, vocab)
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
        probs, _, box[0] = target_call(target.graphdef, cfg, target.params, toks, pos, box[0], sp, mask,
                                        prog.feature_layers, prog.raw_features)
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
    box = [draft_init(drafter, drafter.params, DraftContext(toks, lens, sp, jnp.asarray(hid), zeros), buf)]
    ctx = DraftContext(toks, lens, sp, jnp.asarray(hid[:, pos0 - 1: pos0 + shape.depth]), zeros)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, (b, shape.nodes, 2), dtype=np.uint32))

    def run():
        t, valid, box[0] = _tree_draft_call(drafter, drafter.params, box[0], ctx, keys, shape, vocab)
        jax.block_until_ready((t, valid))
    return run


def median_ms(calls: dict, warmup: int, repeats: int) -> dict:
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
