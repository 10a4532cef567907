"""The decode loop: autoregressive and speculative decoding as jitted pure functions.

One compiled program per (model configs, drafter, γ, batch, buffer bucket): the
prefill (:func:`specjax.runtime.prefill.prefill`) and the decode loop (:func:`run_rounds`, a ``lax.while_loop``
over rounds until every row is done or a round limit is reached, so callers can
stream in chunks of rounds without a host sync per token).

Token-buffer convention (per row): ``tokens[b, :lengths[b]]`` are committed (prompt
then generated); the target's KV cache holds positions ``0 .. lengths-2``: the last
committed token is the first input of the next target call, so a speculative round
is ONE target call over ``[last committed, x_1 .. x_γ]`` at positions
``lengths-1 .. lengths-1+γ`` and a plain step is the same with γ = 0. Buffers and
caches keep γ + 1 spare slots beyond the longest allowed sequence, so no write is
ever clamped onto valid entries (``dynamic_update_slice`` clamps its start index).

The state the rounds carry and the static :class:`Program` are :mod:`specjax.runtime.state`'s
(re-exported here).

Leviathan, Kalman & Matias (2023), Algorithm 1; Chen et al. (2023), Algorithm 2.
"""


from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.core import tree as tree_ops
from specjax.core.acceptance import verify
from specjax.core.drafting import DraftContext, TreeProposal, TreeShape
from specjax.core.sampling import SamplingParams, penalize, sample
from specjax.models import llama
from specjax.runtime.state import DecodeState, Logprobs, Program, Stats, tree_scratch  # noqa: F401  (re-exported)


def verification_mask(batch: int, t: int):
    """The ``tree_mask`` of a chain verification call over ``t`` tokens: ``None`` for one token,
    else a lower-triangular bool ``[batch, t, t]`` (a chain tree; see :func:`_target_step`)."""
    return None if t == 1 else jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def _target_step(prog, tparams, st: DecodeState, inputs, with_hidden):
    """One target call over ``inputs [B, T]`` at positions ``lengths-1 + arange(T)``.

    A verification block (T > 1) is run as a chain tree (``tree_mask`` lower-triangular), not as
    a causal call: the tree path computes each query's attention like a one-token call
    (:func:`specjax.models.llama.decoder_block`), so in bfloat16/int8 a token's logits are the
    same whether it is verified in a block or decoded alone. The causal multi-token path is not:
    measured on the default model in int8, the first query of a 2-token causal call at position
    91 of a Spec-Bench prompt got logits 2.4 away from the one-token call's, and greedy
    speculative decoding with the shipped drafter diverged from autoregressive decoding on 5 of 18
    evaluation prompts (tests/test_batch_invariance.py has that prompt).

    Returns ``(p, z, cache, hidden)``: ``z [B, T, V]`` the logits penalized with each position's
    history (the committed text + ``inputs[:, 1:t+1]``, :func:`penalized`), ``p`` their processed
    distribution."""
    b, t = inputs.shape
    pos = (st.lengths - 1)[:, None] + jnp.arange(t, dtype=jnp.int32)
    mask = verification_mask(b, t)
    out = llama.apply(prog.graphdef, tparams, inputs, pos, st.target_cache, prog.cfg, return_hidden=with_hidden,
                      tree_mask=mask, kv_view=prog.kv_view, **prog.feature_args)
    sees = jnp.ones((b, 1, 0), bool) if mask is None else mask[:, :, 1:]
    z = penalized(st, out.logits, inputs[:, 1:], sees, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    return st.sampling.process(z), z, out.cache, out.hidden


def penalized(st: DecodeState, logits, drafts, sees, depth):
    """The target's logits ``[B, T, V]`` of one call with the logit bias, penalties and
    ``min_tokens`` mask of each position's history (:func:`specjax.core.sampling.penalize`):
    the committed text (``st.seen``, ``st.counts``) plus the call's drafts ``drafts [B, S]`` that
    position t sees (``sees [B, T, S]``: a chain's earlier drafts, a tree node's path); ``depth
    [B, T]`` int32 = drafts on position t's path (new tokens before the token it predicts =
    ``new_tokens + depth``). Exactly what autoregressive decoding sees at that position."""
    return penalize(logits, st.sampling, st.seen, st.counts, drafts, sees,
                    st.stats.new_tokens[:, None] + depth, st.eos)


def _emitted_logprobs(prog: Program, sampling: SamplingParams, p, logits, chunk, width: int):
    """Log-probabilities of ``chunk [B, T]`` under ``p [B, T, V]`` (or ``log_softmax(logits)``
    for greedy rows) and the top ``prog.logprobs`` alternatives, padded to ``width`` positions
    (see :class:`Logprobs`). Returns ``(token [B, W], top_ids [B, W, N], top_logprobs [B, W, N])``."""
    greedy = (sampling.temperature <= 0.0)[:, None, None]
    lp = jnp.where(greedy, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), jnp.log(p))
    tok = jnp.take_along_axis(lp, chunk[..., None], axis=-1)[..., 0]
    if prog.logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, prog.logprobs)
    else:
        top_lp = jnp.zeros(lp.shape[:2] + (0,), jnp.float32)
        top_ids = jnp.zeros(lp.shape[:2] + (0,), jnp.int32)
    pad = width - chunk.shape[1]
    if pad:
        tok = jnp.pad(tok, ((0, 0), (0, pad)))
        top_ids = jnp.pad(top_ids, ((0, 0), (0, pad), (0, 0)))
        top_lp = jnp.pad(top_lp, ((0, 0), (0, pad), (0, 0)))
    return tok, top_ids.astype(jnp.int32), top_lp


def _commit(st: DecodeState, chunk, count):
    """Append ``chunk[b, :count[b]]`` per row, cut after an EOS. Returns ``(tokens, lengths,
    new_tokens, done, count)`` with ``count [B]`` the tokens each row actually committed."""
    active = ~st.done
    width = chunk.shape[1]
    in_count = jnp.arange(width)[None, :] < count[:, None]
    is_eos = jnp.any(chunk[:, :, None] == st.eos[:, None, :], axis=-1) & in_count
    has_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, count)
    count = jnp.where(active, count, 0).astype(jnp.int32)
    tokens = jax.vmap(lambda row, c, s: jax.lax.dynamic_update_slice(row, c, (s,)))(st.tokens, chunk, st.lengths)
    lengths = st.lengths + count
    new = st.stats.new_tokens + count
    done = st.done | (active & has_eos) | (new >= st.max_new)
    return tokens, lengths, new, done, count


def _history(st: DecodeState, chunk, count):
    """``(seen, counts)`` with ``chunk[b, :count[b]]`` committed (the penalties' token history)."""
    vocab = st.counts.shape[1]
    ids = jnp.where(jnp.arange(chunk.shape[1])[None, :] < count[:, None], chunk, vocab)
    rows = jnp.arange(chunk.shape[0])[:, None]
    counts = st.counts.at[rows, ids].add(1, mode="drop")
    return st.seen.at[rows, ids].set(True, mode="drop"), counts


def _write_rows(buf, values, starts):
    """``buf[b, starts[b]:starts[b]+W] = values[b]`` per row (``buf [B, L, ...]``)."""
    zeros = (0,) * (buf.ndim - 2)
    return jax.vmap(lambda row, v, s: jax.lax.dynamic_update_slice(row, v, (s, *zeros)))(buf, values, starts)


def _round_inputs(st: DecodeState, draws: int):
    """What every round starts from: this round's per-row keys ``[B, draws + 2, 2]`` (``fold_in``
    of the request key and the row's own round number; the last one is for the residual/bonus draw), the
    last committed token ``[B, 1]`` and the tokens each row may still emit ``[B]``."""
    rkeys = jax.vmap(lambda k, r: jax.random.split(jax.random.fold_in(k, r), draws + 2))(
        st.keys, st.round - st.first_round)
    last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)
    return rkeys, last, st.max_new - st.stats.new_tokens


def _chunk_of(drafts, n, nxt):
    """The tokens a round emits, ``[B, W]`` (W = drafts + 1): drafts ``x_1..x_n`` of ``drafts [B, W-1]``,
    then the residual/bonus token ``nxt [B]`` at index ``n [B]`` (what follows is never committed)."""
    b, w = drafts.shape[0], drafts.shape[1] + 1
    chunk = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return jnp.where(jnp.arange(w)[None, :] == n[:, None], nxt[:, None], chunk)


def _round_logprobs(prog: Program, sampling: SamplingParams, p, logits, chunk):
    """The round's emitted log-probabilities (:func:`_emitted_logprobs` over the first ``p.shape[1]``
    tokens of ``chunk``, padded to the block), or ``None`` when the program records none."""
    if prog.logprobs < 0:
        return None
    return _emitted_logprobs(prog, sampling, p, logits, chunk[:, :p.shape[1]], prog.block)


def _round(prog: Program, tparams, dparams, st: DecodeState) -> DecodeState:
    """One round for every row: a speculative round (drafter → one target call →
    acceptance → commit), or a plain one-token step when nothing can be accepted.

    Counters count only what is committed (:func:`_count`)."""
    b = st.lengths.shape[0]
    g = prog.gamma
    active = ~st.done
    rkeys, last, remaining = _round_inputs(st, g)  # rkeys [B, γ+2, 2]
    res_keys = rkeys[:, g + 1]
    vocab = prog.cfg.vocab_size
    zeros = jnp.zeros((b,), jnp.int32)

    def logprobs_of(p, logits, chunk):
        return _round_logprobs(prog, st.sampling, p, logits, chunk)

    def plain(st, dstate):
        cache, chunk, hid, lps = _one_token_step(prog, tparams, st, last, res_keys)
        return cache, zeros, chunk, zeros, dstate, hid, lps

    if prog.drafter is None:
        cache, n, chunk, allowed, dstate, hidden, lps = plain(st, st.drafter_state)
    else:
        ctx = DraftContext(st.tokens, st.lengths, st.sampling, st.target_hidden, st.last_accepted)
        prop = prog.drafter.propose(dparams, st.drafter_state, ctx, rkeys[:, :g], g, vocab)
        allowed = jnp.clip(jnp.minimum(prop.num_valid, remaining - 1), 0, g).astype(jnp.int32)
        allowed = jnp.where(active & st.speculate, allowed, 0)
        u = jax.vmap(lambda k: jax.random.uniform(k, (g,), jnp.float32))(rkeys[:, g])

        def spec(st, dstate):
            inputs = jnp.concatenate([last, prop.tokens], axis=1)
            p, logits, cache, hidden = _target_step(prog, tparams, st, inputs, True)
            n, nxt, _ = verify(prop.tokens, prop.probs, p, u, res_keys, allowed)
            chunk = _chunk_of(prop.tokens, n, nxt)
            return cache, n, chunk, allowed, dstate, hidden, logprobs_of(p, logits, chunk)

        def no_match(st, dstate):
            cache, n, chunk, _, dstate, hid, lps = plain(st, dstate)
            return cache, n, chunk, jnp.zeros_like(allowed), dstate, hid, lps

        if prog.drafter.always_proposes:
            # one target program in the loop (compile time); a round with nothing allowed
            # verifies with num_allowed = 0, i.e. samples from p_1 like a plain step
            cache, n, chunk, allowed, dstate, hidden, lps = spec(st, prop.state)
        else:
            # When no row can accept anything, a γ+1-token verify call would be wasted.
            cache, n, chunk, allowed, dstate, hidden, lps = jax.lax.cond(
                jnp.any(allowed > 0), spec, no_match, st, prop.state
            )
    return _finish_round(prog, st, cache, n, chunk, allowed, None, dstate, hidden, lps)


def _finish_round(prog: Program, st: DecodeState, cache, n, chunk, allowed, rejected, dstate, hidden, lps):
    """The end of every round (chain or tree): commit ``chunk [B, W]`` (``n + 1`` tokens per row,
    cut after an EOS), count (:func:`_count`; ``rejected`` ``None`` for a chain), write the
    emitted tokens' log-probabilities ``lps`` (or ``None``), set the cache's committed length and
    return the next state."""
    tokens, lengths, new, done, count = _commit(st, chunk, n + 1)
    seen, counts = _history(st, chunk, count)
    stats, emit_info, emit_round = _count(prog, st, n, allowed, count, new, rejected)
    logprobs = st.logprobs
    if lps is not None:
        logprobs = Logprobs(*(_write_rows(buf, v, st.lengths) for buf, v in
                              zip((logprobs.token, logprobs.top_ids, logprobs.top_logprobs), lps)))
    cache = dataclasses.replace(cache, lengths=lengths - 1)
    return dataclasses.replace(
        st, tokens=tokens, lengths=lengths, done=done, round=st.round + 1, target_cache=cache, seen=seen, counts=counts,
        drafter_state=dstate, target_hidden=hidden, last_accepted=n, stats=stats,
        emit_round=emit_round, emit_info=emit_info, logprobs=logprobs,
    )


def _count(prog: Program, st: DecodeState, n, allowed, count, new, rejected=None):
    """The round's counters and per-token record, counting only committed tokens: an EOS on
    an accepted draft (``count <= n``) ends the round's counts there (the drafts up to it are
    offered, checked and accepted; nothing after it). ``n``, ``allowed``, ``count``, ``new``:
    ``[B]`` int32 accepted drafts, drafts allowed (a tree: valid nodes offered), tokens
    committed, new tokens so far. ``rejected``: ``[B]`` bool, the round ended with a rejected
    draft (default: a chain's ``n < allowed``; a tree passes whether the accepted node had a
    valid child). Returns ``(Stats, emit_info [B, L], emit_round [B, L])``."""
    b, width = st.lengths.shape[0], prog.block
    a = (~st.done).astype(jnp.int32)
    cut = count <= n
    accepted = jnp.where(cut, count, n) * a
    if rejected is None:
        rejected = n < allowed
    rejected = (rejected & ~cut).astype(jnp.int32) * a
    drafted = jnp.where(cut, count, allowed) * a
    s = st.stats
    stats = Stats(
        target_calls=s.target_calls + a,
        draft_calls=s.draft_calls + (a if prog.drafter is not None and not prog.plain else 0),
        drafted_tokens=s.drafted_tokens + drafted,
        accepted_tokens=s.accepted_tokens + accepted,
        checked_tokens=s.checked_tokens + accepted + rejected,
        new_tokens=new,
        accept_hist=s.accept_hist + a[:, None] * jax.nn.one_hot(accepted, s.accept_hist.shape[1], dtype=jnp.int32),
    )
    info = ((jnp.arange(width)[None, :] < accepted[:, None]).astype(jnp.int32)
            + 2 * rejected[:, None] + 4 * int(prog.plain) + 8 * drafted[:, None])
    emit_info = _write_rows(st.emit_info, info, st.lengths)
    emit_round = _write_rows(st.emit_round, jnp.broadcast_to(st.round, (b, width)).astype(jnp.int32), st.lengths)
    return stats, emit_info, emit_round


def propose_tree(drafter, dparams, dstate, ctx: DraftContext, keys, shape: TreeShape, vocab: int) -> TreeProposal:
    """The drafter's tree: :meth:`~specjax.core.drafting.Drafter.propose_tree`, or for a drafter
    that proposes chains only (``proposes_trees`` false: a draft model) its chain of γ = D drafts as
    a tree of K = 1, verified with ``"iid"`` (one child drawn from q per node: Leviathan et al.'s
    Algorithm 1 exactly)."""
    if drafter.proposes_trees:
        return drafter.propose_tree(dparams, dstate, ctx, keys, shape, vocab)
    if shape.topk != 1:
        raise ValueError(f"drafter {drafter.name!r} proposes chains only; use a tree of "
                         "topk 1 or a drafter that proposes trees (ngram, an EAGLE drafter)")
    prop = drafter.propose(dparams, dstate, ctx, keys, shape.depth, vocab)
    return TreeProposal(tree_ops.chain_tree(prop), "iid", prop.state)


def _walk_ended_on_rejection(tree, path, n):
    """``[B]`` bool: the tree walk ended on a rejection — the last accepted node (the root when
    ``n = 0``) of ``path [B, D]`` has a valid child, so a draft was checked and rejected there."""
    at = jnp.where(n > 0, jnp.take_along_axis(path, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], -1)
    kids = tree_ops.children_table(tree)  # [B, N+1, K]
    return jnp.take_along_axis(kids[:, :, 0], (at + 1)[:, None], axis=1)[:, 0] >= 0


def _tree_round(prog: Program, tparams, dparams, st: DecodeState) -> DecodeState:
    """One round with a draft tree for every row (issue 18; the chain's :func:`_round` with a tree).

    1. The drafter proposes a tree of ``prog.tree`` = (N, D, K) per row (:func:`propose_tree`);
       nodes deeper than ``max_new - new - 1`` are made invalid (:func:`specjax.core.tree.limit_depth`:
       at most that many drafts may be accepted; the walk then draws from p, not a residual).
    2. ONE target call over ``[last committed, node_0 .. node_{N-1}]`` at positions
       ``lengths - 1 + depth`` with the tree mask; its K/V go to slots ``lengths-1 .. lengths-1+N``.
       (A drafter that may propose nothing gets a one-token step instead when no row has a valid
       node, as for chains.)
    3. :func:`specjax.core.tree.verify_tree` with the drafter's scheme on the processed p of every
       row — greedy rows included (one-hot p: the path the target's argmax follows) — gives the
       accepted path (n nodes) and the next token.
    4. Commit the path's tokens and the next token (cut after an EOS, :func:`_commit`);
       :func:`specjax.models.llama.compact_tree_cache` moves the path's K/V to slots
       ``lengths .. lengths + n - 1`` (the causal cache again); the target's hidden states and
       p at ``[root, path...]`` become ``target_hidden [B, D+1, ·]`` (feature drafters) and the
       emitted tokens' log-probabilities.

    Keys: ``fold_in(key, round)`` split in N + 2: one drafter key per node, the node uniforms
    (``[N]``, one per node), the final draw's key — for K = 1 (N = γ) the chain's layout.
    Counters (:func:`_count`): drafted = valid nodes offered; accepted = n; checked = n + 1 when
    the walk ended on a rejection (the accepted node — the root if n = 0 — had a valid child),
    else n; ``accept_hist`` by n (D + 1 bins). For K = 1 these are the chain's counters."""
    shape = prog.tree
    b = st.lengths.shape[0]
    nodes, depth = shape.nodes, shape.depth
    active = ~st.done
    rkeys, last, remaining = _round_inputs(st, nodes)  # rkeys [B, N+2, 2]
    res_keys = rkeys[:, nodes + 1]
    vocab = prog.cfg.vocab_size
    zeros, no = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)

    ctx = DraftContext(st.tokens, st.lengths, st.sampling, st.target_hidden, st.last_accepted)
    prop = propose_tree(prog.drafter, dparams, st.drafter_state, ctx, rkeys[:, :nodes], shape, vocab)
    allowed = jnp.where(active & st.speculate, jnp.clip(remaining - 1, 0, depth), 0).astype(jnp.int32)
    tree = tree_ops.limit_depth(prop.tree, allowed)
    live = tree.valid & (tree.depth >= 1) & (tree.depth <= depth)  # the nodes the walk may accept
    offered = jnp.sum(live, axis=1, dtype=jnp.int32)
    u = jax.vmap(lambda k: jax.random.uniform(k, (nodes,), jnp.float32))(rkeys[:, nodes])

    def logprobs_of(p, logits, chunk):
        return _round_logprobs(prog, st.sampling, p, logits, chunk)

    def spec(st, dstate):
        inputs = jnp.concatenate([last, tree.tokens], axis=1)  # [B, N+1]
        mask = tree_ops.block_attention_mask(tree)  # [B, N+1, N+1]: a node sees its path
        out = llama.apply(prog.graphdef, tparams, inputs, tree_ops.positions(tree, st.lengths), st.target_cache,
                          prog.cfg, return_hidden=True, tree_mask=mask, kv_view=prog.kv_view, **prog.feature_args)
        depth = jnp.concatenate([zeros[:, None], tree.depth], axis=1)
        z = penalized(st, out.logits, jnp.where(tree.valid, tree.tokens, -1), mask[:, :, 1:], depth)
        p = st.sampling.process(z)  # [B, N+1, V]
        acc = tree_ops.verify_tree(tree, p, u, res_keys, prop.scheme)
        n, path = acc.n, acc.path
        drafts = jnp.maximum(tree_ops.path_tokens(tree, path), 0)  # [B, D]
        chunk = _chunk_of(drafts, n, acc.next_token)
        rows = jnp.concatenate([zeros[:, None], jnp.where(path >= 0, path + 1, 0)], axis=1)  # [root, path] in the block
        hidden = jnp.take_along_axis(out.hidden, rows[..., None], axis=1)  # [B, D+1, D_h]
        cache = llama.compact_tree_cache(out.cache, st.lengths - 1, path, n)
        rejected = _walk_ended_on_rejection(tree, path, n)
        lps = None
        if prog.logprobs >= 0:
            gather = lambda x: jnp.take_along_axis(x, rows[..., None], axis=1)  # noqa: E731
            lps = logprobs_of(gather(p), gather(z), chunk)
        return cache, n, chunk, offered, rejected, dstate, hidden, lps

    def plain(st, dstate):  # no row has a valid node: a one-token step (as the chain's no_match)
        cache, chunk, hidden, lps = _one_token_step(prog, tparams, st, last, res_keys)
        return cache, zeros, chunk, zeros, no, dstate, hidden, lps

    if prog.drafter.always_proposes:
        cache, n, chunk, offered, rejected, dstate, hidden, lps = spec(st, prop.state)
    else:
        cache, n, chunk, offered, rejected, dstate, hidden, lps = jax.lax.cond(
            jnp.any(offered > 0), spec, plain, st, prop.state)
    return _finish_round(prog, st, cache, n, chunk, offered, rejected, dstate, hidden, lps)


def _plain_round(prog: Program, tparams, dparams, st: DecodeState) -> DecodeState:
    """A round of a ``plain`` program: one target call over each row's last committed token, the
    next token drawn from p (autoregressive decoding), on the state of a speculative program (γ or
    a tree) — the serving engine's rounds when no running row may speculate
    (:class:`specjax.runtime.engine.Engine`): a row that speculates gets nothing from a verification
    without drafts, so this round costs what autoregressive decoding costs.

    The state afterwards is the one a speculative round leaves when it accepts no draft
    (``last_accepted`` 0, the step's hidden state at index 0 of ``target_hidden``), so a
    speculative round may follow. The drafter does not run: its own state (a feature drafter's
    K/V of the committed tokens) would miss the tokens committed by plain rounds, which lowers its
    acceptance later and never changes the output distribution (q is still what is sampled from)
    — unless it keeps them (:meth:`~specjax.core.drafting.Drafter.absorb`: the EAGLE drafters keep the
    features and encode them in their next call). Keys: the chain's or tree's layout (the last of
    ``fold_in(key, round)``'s draws); a greedy row's tokens are those of a speculative round (the
    verification's logits equal a one-token call's)."""
    b = st.lengths.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    rkeys, last, _ = _round_inputs(st, prog.gamma if prog.tree is None else prog.tree.nodes)
    cache, chunk, hidden, lps = _one_token_step(prog, tparams, st, last, rkeys[:, -1])
    rejected = None if prog.tree is None else jnp.zeros((b,), bool)
    dstate = st.drafter_state
    if prog.drafter is not None:
        ctx = DraftContext(st.tokens, st.lengths, st.sampling, st.target_hidden, st.last_accepted)
        dstate = prog.drafter.absorb(dparams, dstate, ctx)
    return _finish_round(prog, st, cache, zeros, chunk, zeros, rejected, dstate, hidden, lps)


def _one_token_step(prog: Program, tparams, st: DecodeState, last, keys):
    """One target call over each row's last committed token ``last [B, 1]`` and the next token drawn
    from p with ``keys [B, 2]`` (the plain step of every round kind): ``(cache, chunk [B, W], hidden,
    logprobs)``, ``hidden`` in ``target_hidden``'s layout (the one hidden state at index 0, as after a
    round that accepts no draft; ``None`` without a drafter)."""
    b = st.lengths.shape[0]
    p, logits, cache, h = _target_step(prog, tparams, st, last, prog.drafter is not None)
    nxt = jax.vmap(sample)(keys, p[:, 0])
    hidden = None if prog.drafter is None else jnp.zeros_like(st.target_hidden).at[:, :1].set(h)
    chunk = _chunk_of(jnp.zeros((b, prog.block - 1), jnp.int32), jnp.zeros((b,), jnp.int32), nxt)
    return cache, chunk, hidden, _round_logprobs(prog, st.sampling, p, logits, chunk)


def view_fits(prog: Program, st: DecodeState):
    """Whether the next round of every running row stays inside ``prog.kv_view`` (a bool scalar;
    always true without a view)."""
    if prog.kv_view is None:
        return jnp.bool_(True)
    return live_span(prog, st) <= prog.kv_view


def live_span(prog: Program, st: DecodeState):
    """The cache slots the next round needs: ``max(lengths of running rows) - 1 + round_span``
    (an int32 scalar; done rows do not count)."""
    return jnp.max(jnp.where(st.done, 1, st.lengths)) - 1 + prog.round_span


def run_rounds(prog: Program, tparams, dparams, st: DecodeState, round_limit) -> DecodeState:
    """``lax.while_loop`` of rounds until every row is done, ``round`` reaches ``round_limit``, or
    (a program with a ``kv_view``) the next round would attend beyond the view — then the caller
    continues with a larger view (:meth:`specjax.runtime.decoder.Decoder.run`): the target's
    attention costs what the live rows need, not the whole buffer, with the same tokens (chain
    rounds :func:`_round`, or :func:`_tree_round` for a program with a tree; :func:`_plain_round` for a
    ``plain`` one)."""
    round_fn = _plain_round if prog.plain else _round if prog.tree is None else _tree_round
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done) & (s.round < round_limit) & view_fits(prog, s),
        lambda s: round_fn(prog, tparams, dparams, s),
        st,
    )


RUN_ROUNDS_DONATE = 3  # run_rounds' argument whose buffers the program reuses: the state
run_rounds_jit = jax.jit(run_rounds, static_argnums=0, donate_argnums=RUN_ROUNDS_DONATE)


# --------------------------------------------------------------------------- host API
