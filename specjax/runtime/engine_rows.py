"""The engine's jitted row operations on a :class:`~specjax.runtime.loop.DecodeState` of ``slots``
rows (issue 50: :class:`~specjax.runtime.engine.Engine` is the scheduling, this module its device side):
inserting a prefilled one-row state into a slot, ending and switching rows, the compaction's moves,
the chunk's row ladder and its head rows. Each is a pure function of the state and a jitted,
state-donating program compiled once per state shape."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from specjax.runtime.results import RowStats, host_result


def insert_row(state, row, slot, speculate):
    """``state`` with batch row ``slot`` replaced by the one-row state ``row`` (every per-row
    leaf; the scalar ``round`` stays the batch's), ``first_round[slot]`` = the batch's round and
    ``speculate[slot]`` = ``speculate`` (a bool scalar)."""
    def put(big, small):
        if jnp.ndim(big) == 0:
            return big
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)

    out = jax.tree_util.tree_map(put, state, row)
    return dataclasses.replace(out, first_round=out.first_round.at[slot].set(state.round),
                               speculate=out.speculate.at[slot].set(speculate))


def end_rows(state, mask):
    """``state`` with the rows of ``mask [B]`` (bool) done."""
    return dataclasses.replace(state, done=state.done | mask)


def set_speculate(state, speculate):
    """``state`` with ``speculate [B]`` (bool) as its rows' speculation switches."""
    return dataclasses.replace(state, speculate=speculate)


def move_rows(state, src, dst, count):
    """``state`` with row ``src[i]`` copied into row ``dst[i]`` for ``i < count`` and those source
    rows marked done (``src``, ``dst [K]`` int32, ``count`` an int32 scalar ≤ K; every ``src[i]``
    distinct from every ``dst[j]``); the scalar ``round`` stays. The engine's compaction: a running
    request moves into a free slot, its tokens unchanged (``keys`` and ``first_round`` move with it).
    Each move rewrites one row in place (the state is donated), where a permutation of the rows
    (``jnp.take``) rewrites every row: measured at 8 slots × 2,048 tokens, int8 target, 0.25–0.41 s per permutation
    (BENCHMARKS.md, turn 24)."""
    src, dst = jnp.asarray(src), jnp.asarray(dst)

    def move(i, st):
        def one(x):
            if jnp.ndim(x) == 0:
                return x
            return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src[i], 1, axis=0),
                                                       dst[i], axis=0)
        return jax.tree_util.tree_map(one, st)

    out = jax.lax.fori_loop(0, count, move, state)
    moved = jnp.zeros_like(out.done).at[src].max(jnp.arange(src.shape[0]) < count)
    return dataclasses.replace(out, done=out.done | moved)


def head_rows(state, rows: int):
    """The first ``rows`` rows of ``state`` (a state of ``rows`` rows; scalars kept)."""
    return jax.tree_util.tree_map(lambda x: x if jnp.ndim(x) == 0 else x[:rows], state)


def put_head_rows(state, head):
    """``state`` with its first rows replaced by ``head`` (a state of fewer rows) and its scalars
    (``round``) taken from ``head``."""
    return jax.tree_util.tree_map(
        lambda big, small: small if jnp.ndim(big) == 0 else jax.lax.dynamic_update_slice_in_dim(big, small, 0, axis=0),
        state, head)


def row_ladder(slots: int) -> tuple[int, ...]:
    """The row counts a chunk of rounds may run on: the powers of two below ``slots``, then ``slots``.
    Each is its own program (compiled once)."""
    out, n = [], 1
    while n < slots:
        out.append(n)
        n *= 2
    return (*out, int(slots))


_TRACES: dict = {}  # row operation → how many times it was traced (each trace is one compiled program)


def _traced(fn, name: str | None = None):
    """``fn`` counting its traces in :data:`_TRACES` (the body runs once per compiled program)."""
    key = name or fn.__name__

    def counted(*args):
        _TRACES[key] = _TRACES.get(key, 0) + 1
        return fn(*args)
    counted.__name__ = key
    return counted


# the jitted row operations (each compiled once per state shape; the state argument donated: in place)
move_jit = jax.jit(_traced(move_rows), donate_argnums=0)
head_jit = jax.jit(_traced(head_rows), static_argnums=1)
put_head_jit = jax.jit(_traced(put_head_rows), donate_argnums=0)
insert_jit = jax.jit(_traced(insert_row), donate_argnums=0)
end_jit = jax.jit(_traced(end_rows), donate_argnums=0)
speculate_jit = jax.jit(_traced(set_speculate), donate_argnums=0)
zero_jit = jax.jit(_traced(lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree), "zero_tree"), donate_argnums=0,
                   keep_unused=True)  # in place (an unused argument would be pruned, not donated)
row_jit = jax.jit(_traced(lambda tree, i: jax.tree_util.tree_map(lambda x: x[i], tree), "one_row"))  # (a traced index)


def compiled_programs(name: str | None = None) -> int:
    """How many programs the row operations have compiled in this process (``name``: one operation's,
    e.g. ``"insert_row"``; default all): a counter for tests of "nothing recompiles per request"."""
    return _TRACES.get(name, 0) if name is not None else sum(_TRACES.values())


def row_logprobs(lp, a: int, b: int, new: list, top: int) -> list[dict]:
    """Per new token ``{"id", "logprob", "top": [(id, logprob), ...]}`` from one row's host
    log-probability buffers ``lp`` (``token``, ``top_ids``, ``top_logprobs``: [L] / [L, N]) for
    committed positions ``a..b`` (``new``: their ids), the top ``top`` alternatives."""
    return [{"id": int(t), "logprob": float(v),
             "top": [(int(j), float(x)) for j, x in zip(ids[:top], vals[:top]) if np.isfinite(x)]}
            for t, v, ids, vals in zip(new, lp.token[a:b], lp.top_ids[a:b], lp.top_logprobs[a:b])]


def row_stats(st, slot: int, toks, lengths, model_eos) -> RowStats:
    """Row ``slot``'s :class:`~specjax.runtime.results.RowStats` through
    :func:`~specjax.runtime.results.host_result` (the one definition) on a one-row host view of the
    fields it reads (``toks``, ``lengths``: the state's host copies; ``model_eos``: the ids counted
    as EOS, ``[]`` for a request that ignores it)."""
    one = lambda x: np.asarray(x[slot: slot + 1])  # noqa: E731
    view = SimpleNamespace(tokens=toks[slot: slot + 1], lengths=lengths[slot: slot + 1],
                           prompt_lengths=one(st.prompt_lengths), eos=one(st.eos),
                           emit_info=one(st.emit_info), emit_round=one(st.emit_round),
                           stats=SimpleNamespace(accept_hist=one(st.stats.accept_hist)), logprobs=None)
    return host_result(view, 0.0, 0.0, 0.0, model_eos=model_eos).stats[0]
