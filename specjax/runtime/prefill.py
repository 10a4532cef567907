"""The prefill: the prompt into the token buffer, the target's (and the drafter's) caches of it,
and the decode state the loop (:mod:`specjax.runtime.loop`) starts from.

:func:`prefill` is jitted once per (drafter, batch, prompt bucket, buffer bucket) for every γ
(:func:`prefill_program` normalizes γ; :func:`size_for_gamma` gives the state its γ-shaped
arrays afterwards). A batch with repeated prompts prefills each distinct prompt once (``shared``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core.drafting import DraftContext
from specjax.models import llama
from specjax.runtime.loop import DecodeState, Logprobs, Program, Stats


PREFILL_CHUNK = 512  # prompt tokens per target call of the prefill: longer prompts go in chunks of this many
# Each chunk reads only the key spans of PREFILL_CHUNK slots it can see (its own and the earlier chunks';
# llama.forward's key_span): False reads the whole buffer every chunk, as before (benchmarks, tests).
SKIP_MASKED_KEYS = True


def prompt_forward(prog: Program, tparams, prompt, cache):
    """The target over ``prompt [U, P]`` at positions ``0 .. P-1``: ``(hidden or features [U, P, ·],
    cache with the prompt's K/V)``. A prompt longer than :data:`PREFILL_CHUNK` (whose bucket is a
    multiple of it) runs as a ``lax.scan`` of chunk-sized causal calls, each writing its K/V before
    the next attends to them: the score matrix of one call is ``chunk × buffer`` instead of
    ``P × buffer`` (memory linear in the prompt), each query's causal attention unchanged. Chunk i
    reads only the first ``(i + 1) · chunk`` cache slots (:data:`SKIP_MASKED_KEYS`; bit for bit the
    whole buffer's result, at about half its attention cost over a prompt). Prompts of
    ≤ :data:`PREFILL_CHUNK` tokens run as one call, as before."""
    u, p = prompt.shape
    c = PREFILL_CHUNK
    if p <= c or p % c:
        pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
        return llama.forward(prog.graphdef, tparams, prompt, pos, cache, prog.cfg, **prog.feature_args)

    def chunk(cache, i):
        h, cache = _chunk_forward(prog, tparams, prompt, cache, i)
        return cache, h

    cache, hs = jax.lax.scan(chunk, cache, jnp.arange(p // c, dtype=jnp.int32))  # hs [P/c, U, c, ·]
    return hs.transpose(1, 0, 2, 3).reshape(u, p, hs.shape[-1]), cache


def _chunk_forward(prog: Program, tparams, prompt, cache, i):
    """The target over chunk ``i`` (:data:`PREFILL_CHUNK` tokens) of ``prompt [U, P]``: ``(hidden or
    features [U, c, ·], cache with the chunk's K/V)``."""
    return _piece_forward(prog, tparams, prompt, cache, i * PREFILL_CHUNK, PREFILL_CHUNK)


def _piece_forward(prog: Program, tparams, prompt, cache, start, n: int):
    """The target over prompt tokens ``start .. start + n − 1`` of ``prompt [U, P]`` (``n`` static):
    ``(hidden or features [U, n, ·], cache with their K/V)``. Each query's computation does not
    depend on which other queries share the call (the projections and attention dots are row-count
    independent; the key spans read are :data:`PREFILL_CHUNK`-sized whatever ``n``), so pieces of a
    chunk give the chunk's bits (tests/test_engine.py)."""
    u, c = prompt.shape[0], PREFILL_CHUNK
    toks = jax.lax.dynamic_slice_in_dim(prompt, start, n, axis=1)
    pos = jnp.broadcast_to(start + jnp.arange(n, dtype=jnp.int32), (u, n))
    span = c if SKIP_MASKED_KEYS and _valid_span(c) and cache.max_len >= c else None
    return llama.forward(prog.graphdef, tparams, toks, pos, cache, prog.cfg, key_span=span, **prog.feature_args)


def _valid_span(c: int) -> bool:
    """Whether a chunk of ``c`` tokens can be the key span of ``llama.forward(key_span=)``:
    ``ATTENTION_BLOCK`` times a power of two (other chunk sizes, e.g. tests' small ones, read the buffer)."""
    r = c // llama.ATTENTION_BLOCK
    return c % llama.ATTENTION_BLOCK == 0 and r > 0 and r & (r - 1) == 0


def prompt_piece(prog: Program, tparams, prompt, cache, hidden, start, n: int):
    """Part of :func:`prompt_forward` as its own call (the engine interleaves a prompt's prefill with
    decode steps, :mod:`specjax.runtime.engine`): tokens ``start .. start + n − 1`` of ``prompt
    [U, P]`` into ``cache``, their hidden states written into ``hidden [U, P, ·]`` (``n`` static,
    dividing :data:`PREFILL_CHUNK` or a multiple of it, ``start`` a multiple of ``n``). Returns
    ``(cache, hidden)``; once every piece of the prompt bucket has run, they are what
    :func:`prompt_forward` returns (``forward=`` of :func:`prefill`), bit for bit."""
    h, cache = _piece_forward(prog, tparams, prompt, cache, start, n)
    return cache, jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), start, axis=1)


def prefill(prog: Program, tparams, dparams, prompt, prompt_lengths, max_new, eos, keys, sampling,
            shared=None, forward=None) -> DecodeState:
    """Prefill: write the prompt into the buffer, fill target (and drafter) caches.

    ``prompt [B, P]`` int32, one row per request; or, with ``shared = (source [B], first [U])``
    int32, ``prompt [U, P]`` holds the DISTINCT prompts of the batch: row b's prompt is
    ``prompt[source[b]]`` and ``first[u]`` is a row whose prompt is u. The target (and drafter)
    prefill then runs once per distinct prompt and its caches are copied to the rows that share it
    (n samples of one prompt cost one prefill: :func:`specjax.runtime.decoder.shared_prompts`). The
    prefill draws nothing (the first new token is sampled by the first round), so sharing changes no
    row's randomness. ``forward``: ``(hidden, cache)`` of the prompt computed already (by
    :func:`prompt_piece` calls; no ``shared``), instead of :func:`prompt_forward` here."""
    b = prompt_lengths.shape[0]
    uprompt = prompt
    if shared is not None:
        source, first = shared
        prompt = jnp.take(uprompt, source, axis=0)
    p = prompt.shape[1]
    tokens = jnp.zeros((b, prog.buffer_len), jnp.int32).at[:, :p].set(prompt)
    u = uprompt.shape[0]
    if forward is None:
        cache = llama.KVCache.create(prog.cfg, u, prog.buffer_len, jnp.dtype(prog.cache_dtype))
        # K/V of every prompt slot (slots ≥ length-1 hold stale values that later writes replace)
        h, cache = prompt_forward(prog, tparams, uprompt, cache)
    else:
        h, cache = forward
    vocab = prog.cfg.vocab_size
    in_prompt = jnp.arange(p)[None, :] < prompt_lengths[:, None]
    seen = jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], jnp.where(in_prompt, prompt, vocab)].set(
        True, mode="drop")
    # Feature-level drafters read the target's hidden states of the prompt ([U, P, D]).
    if shared is None:
        ctx = DraftContext(tokens, prompt_lengths, sampling, h, jnp.zeros((b,), jnp.int32))
    else:
        def pick(tree, rows):
            return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), tree)

        ctx = DraftContext(tokens[first], prompt_lengths[first], pick(sampling, first), h, jnp.zeros((u,), jnp.int32))
    dstate = prog.drafter.init_state(dparams, ctx, prog.buffer_len) if prog.drafter is not None else ()
    if shared is not None:  # every row gets its prompt's caches
        cache, dstate = pick(cache, source), pick(dstate, source)
    cache = dataclasses.replace(cache, lengths=prompt_lengths - 1)
    hidden = None
    if prog.drafter is not None:
        hidden = jnp.zeros((b, prog.gamma + 1, prog.feature_size), jnp.float32)
    return DecodeState(
        tokens=tokens,
        lengths=prompt_lengths,
        prompt_lengths=prompt_lengths,
        max_new=max_new,
        done=max_new <= 0,
        eos=eos,
        keys=keys,
        round=jnp.int32(0),
        first_round=jnp.zeros((b,), jnp.int32),
        speculate=jnp.ones((b,), bool),
        sampling=sampling,
        seen=seen,
        counts=jnp.zeros((b, vocab), jnp.int32),
        target_cache=cache,
        drafter_state=dstate,
        target_hidden=hidden,
        last_accepted=jnp.zeros((b,), jnp.int32),
        stats=Stats.zeros(b, prog.gamma if prog.drafter is not None else 0),
        emit_round=jnp.zeros((b, prog.buffer_len), jnp.int32),
        emit_info=jnp.zeros((b, prog.buffer_len), jnp.int32),
        logprobs=Logprobs.zeros(b, prog.buffer_len, prog.logprobs) if prog.logprobs >= 0 else None,
    )


def prefill_program(prog: Program) -> Program:
    """The program :func:`prefill` is compiled for: γ only shapes the zero ``target_hidden``
    and ``accept_hist`` (see :func:`size_for_gamma`), so it is normalized to 1 (and a tree,
    which the prefill does not use, to none)."""
    if prog.drafter is None or (prog.gamma == 1 and prog.tree is None):
        return prog
    return dataclasses.replace(prog, gamma=1, tree=None)


def size_for_gamma(st: DecodeState, prog: Program) -> DecodeState:
    """Give a state from the γ-normalized prefill the zero ``[B, γ+1, ·]`` arrays of ``prog``."""
    b = st.lengths.shape[0]
    # distinct buffers (the run program donates the state; Stats.zeros shares one array)
    stats = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), Stats.zeros(b, prog.gamma))
    return dataclasses.replace(
        st, target_hidden=jnp.zeros((b, prog.gamma + 1, prog.feature_size), jnp.float32), stats=stats
    )


prefill_jit = jax.jit(prefill, static_argnums=0)
prompt_piece_jit = jax.jit(prompt_piece, static_argnums=(0, 6), donate_argnums=(3, 4))
