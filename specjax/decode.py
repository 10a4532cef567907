"""Autoregressive and speculative decoding as jitted pure functions.

One compiled program per (model configs, drafter, γ, batch, buffer bucket): the
prefill (:func:`_start`) and the decode loop (:func:`_run`, a ``lax.while_loop``
over rounds until every row is done or a round limit is reached, so callers can
stream in chunks of rounds without a host sync per token).

Token-buffer convention (per row): ``tokens[b, :lengths[b]]`` are committed (prompt
then generated); the target's KV cache holds positions ``0 .. lengths-2``: the last
committed token is the first input of the next target call, so a speculative round
is ONE target call over ``[last committed, x_1 .. x_γ]`` at positions
``lengths-1 .. lengths-1+γ`` and a plain step is the same with γ = 0. Buffers and
caches keep γ + 1 spare slots beyond the longest allowed sequence, so no write is
ever clamped onto valid entries (``dynamic_update_slice`` clamps its start index).

Leviathan, Kalman & Matias (2023), Algorithm 1; Chen et al. (2023), Algorithm 2.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters.base import DraftContext
from specjax.models import llama
from specjax.sampling import SamplingParams, sample
from specjax.speculative import verify

PROMPT_BUCKET = 32  # smallest prompt bucket; prompts pad to the next power of two ≥ this
BUFFER_BUCKET = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stats:
    """Per-row counters (all int32 ``[B]`` unless noted), defined exactly:

    target_calls: target forward calls after prefill (verify calls and plain one-token steps).
    draft_calls: drafter ``propose`` calls: every round of a speculative decoder (the drafter
      runs each round, also when it proposes nothing and the round is a plain step); 0 for
      plain autoregressive decoding.
    drafted_tokens: draft tokens offered for checking (after the per-row cap near
      ``max_new_tokens``; 0 for a row with no n-gram match).
    accepted_tokens: draft tokens accepted by the rejection test.
    checked_tokens: draft tokens the test examined: accepted ones plus the first rejected one.
    new_tokens: tokens committed after the prompt (EOS included, nothing after it).
    accept_hist: ``[B, γ+1]`` rounds by number of accepted draft tokens.
    """

    target_calls: jax.Array
    draft_calls: jax.Array
    drafted_tokens: jax.Array
    accepted_tokens: jax.Array
    checked_tokens: jax.Array
    new_tokens: jax.Array
    accept_hist: jax.Array

    @classmethod
    def zeros(cls, batch: int, gamma: int) -> "Stats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, z, z, z, jnp.zeros((batch, gamma + 1), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the loop carries (a pytree). ``B`` batch, ``L`` buffer slots.

    tokens: ``[B, L]`` int32 committed tokens (slots ≥ lengths are stale).
    lengths: ``[B]`` int32 committed tokens per row (prompt + new).
    prompt_lengths, max_new: ``[B]`` int32.
    done: ``[B]`` bool; a finished row stops changing.
    eos: ``[B, E]`` int32 stop ids per row (−1 = unused).
    keys: ``[B, 2]`` uint32 request keys; round r uses ``fold_in(key, r)``.
    round: int32 scalar rounds run so far.
    sampling: per-row sampling settings.
    target_cache, drafter_state: KV cache pytrees.
    target_hidden: ``[B, γ+1, D]`` hidden states of the last target call, or None.
    last_accepted: ``[B]`` int32 draft tokens accepted in the last round (n).
    stats: :class:`Stats`.
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    max_new: jax.Array
    done: jax.Array
    eos: jax.Array
    keys: jax.Array
    round: jax.Array
    sampling: SamplingParams
    target_cache: llama.KVCache
    drafter_state: Any
    target_hidden: Any
    last_accepted: jax.Array
    stats: Stats


@dataclasses.dataclass(frozen=True)
class Program:
    """Static description of one compiled decode program (hashable)."""

    cfg: ModelConfig
    graphdef: Any
    drafter: Any  # None for plain autoregressive decoding
    gamma: int
    buffer_len: int
    cache_dtype: str = "float32"

    @property
    def block(self) -> int:
        return self.gamma + 1 if self.drafter is not None else 1


def _start(prog: Program, tparams, dparams, prompt, prompt_lengths, max_new, eos, keys, sampling) -> DecodeState:
    """Prefill: write the prompt into the buffer, fill target (and drafter) caches."""
    b, p = prompt.shape
    tokens = jnp.zeros((b, prog.buffer_len), jnp.int32).at[:, :p].set(prompt)
    cache = llama.KVCache.create(prog.cfg, b, prog.buffer_len, jnp.dtype(prog.cache_dtype))
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    # K/V of every prompt slot (slots ≥ length-1 hold stale values that later writes replace)
    h, cache = llama.forward(prog.graphdef, tparams, prompt, pos, cache, prog.cfg)
    cache = dataclasses.replace(cache, lengths=prompt_lengths - 1)
    # Feature-level drafters read the target's hidden states of the prompt ([B, P, D]).
    ctx = DraftContext(tokens, prompt_lengths, sampling, h, jnp.zeros((b,), jnp.int32))
    dstate = prog.drafter.init_state(dparams, ctx, prog.buffer_len) if prog.drafter is not None else ()
    hidden = None
    if prog.drafter is not None:
        hidden = jnp.zeros((b, prog.gamma + 1, prog.cfg.hidden_size), jnp.float32)
    return DecodeState(
        tokens=tokens,
        lengths=prompt_lengths,
        prompt_lengths=prompt_lengths,
        max_new=max_new,
        done=max_new <= 0,
        eos=eos,
        keys=keys,
        round=jnp.int32(0),
        sampling=sampling,
        target_cache=cache,
        drafter_state=dstate,
        target_hidden=hidden,
        last_accepted=jnp.zeros((b,), jnp.int32),
        stats=Stats.zeros(b, prog.gamma if prog.drafter is not None else 0),
    )


def _target_step(prog, tparams, st: DecodeState, inputs, with_hidden):
    """One target call over ``inputs [B, T]`` at positions ``lengths-1 + arange(T)``."""
    t = inputs.shape[1]
    pos = (st.lengths - 1)[:, None] + jnp.arange(t, dtype=jnp.int32)
    out = llama.apply(prog.graphdef, tparams, inputs, pos, st.target_cache, prog.cfg, return_hidden=with_hidden)
    return st.sampling.process(out.logits), out.cache, out.hidden


def _commit(st: DecodeState, chunk, count):
    """Append ``chunk[b, :count[b]]`` per row, cut after an EOS, update done/stats fields."""
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
    return tokens, lengths, new, done


def _round(prog: Program, tparams, dparams, st: DecodeState) -> DecodeState:
    """One round for every row: a speculative round (drafter → one target call →
    acceptance → commit), or a plain one-token step when nothing can be accepted."""
    b = st.lengths.shape[0]
    g = prog.gamma
    active = ~st.done
    rkeys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, st.round), g + 2))(st.keys)  # [B, γ+2, 2]
    res_keys = rkeys[:, g + 1]
    last = jnp.take_along_axis(st.tokens, (st.lengths - 1)[:, None], axis=1)  # [B, 1]
    remaining = st.max_new - st.stats.new_tokens
    vocab = prog.cfg.vocab_size

    def plain(st, dstate):
        p, cache, hidden = _target_step(prog, tparams, st, last, prog.drafter is not None)
        nxt = jax.vmap(sample)(res_keys, p[:, 0])
        zeros = jnp.zeros((b,), jnp.int32)
        hid = None
        if prog.drafter is not None:  # the one hidden state sits at index 0 (= n) of the block
            hid = jnp.zeros_like(st.target_hidden).at[:, :1].set(hidden)
        return cache, zeros, nxt, zeros, dstate, hid

    if prog.drafter is None:
        cache, n, nxt, allowed, dstate, hidden = plain(st, st.drafter_state)
        drafted = jnp.zeros((b,), bool)
    else:
        ctx = DraftContext(st.tokens, st.lengths, st.sampling, st.target_hidden, st.last_accepted)
        prop = prog.drafter.propose(dparams, st.drafter_state, ctx, rkeys[:, :g], g, vocab)
        allowed = jnp.clip(jnp.minimum(prop.num_valid, remaining - 1), 0, g).astype(jnp.int32)
        allowed = jnp.where(active, allowed, 0)
        u = jax.vmap(lambda k: jax.random.uniform(k, (g,), jnp.float32))(rkeys[:, g])

        def spec(st, dstate):
            inputs = jnp.concatenate([last, prop.tokens], axis=1)
            p, cache, hidden = _target_step(prog, tparams, st, inputs, True)
            n, nxt, _ = verify(prop.tokens, prop.probs, p, u, res_keys, allowed)
            return cache, n, nxt, allowed, dstate, hidden

        def no_match(st, dstate):
            cache, n, nxt, _, dstate, hid = plain(st, dstate)
            return cache, n, nxt, jnp.zeros_like(allowed), dstate, hid

        # When no row can accept anything, a γ+1-token verify call would be wasted.
        cache, n, nxt, allowed, dstate, hidden = jax.lax.cond(
            jnp.any(allowed > 0), spec, no_match, st, prop.state
        )
        drafted = active

    chunk = jnp.concatenate([jnp.zeros((b, g), jnp.int32) if prog.drafter is None else prop.tokens,
                             jnp.zeros((b, 1), jnp.int32)], axis=1)
    if prog.drafter is None:
        chunk = chunk[:, :1]
    chunk = jnp.where(jnp.arange(chunk.shape[1])[None, :] == n[:, None], nxt[:, None], chunk)
    tokens, lengths, new, done = _commit(st, chunk, n + 1)

    a = active.astype(jnp.int32)
    rejected = (n < allowed).astype(jnp.int32)
    s = st.stats
    stats = Stats(
        target_calls=s.target_calls + a,
        draft_calls=s.draft_calls + (drafted & active).astype(jnp.int32),
        drafted_tokens=s.drafted_tokens + a * allowed,
        accepted_tokens=s.accepted_tokens + a * n,
        checked_tokens=s.checked_tokens + a * (n + rejected),
        new_tokens=new,
        accept_hist=s.accept_hist + a[:, None] * jax.nn.one_hot(n, s.accept_hist.shape[1], dtype=jnp.int32),
    )
    cache = dataclasses.replace(cache, lengths=lengths - 1)
    return dataclasses.replace(
        st, tokens=tokens, lengths=lengths, done=done, round=st.round + 1, target_cache=cache,
        drafter_state=dstate, target_hidden=hidden, last_accepted=n, stats=stats,
    )


def _run(prog: Program, tparams, dparams, st: DecodeState, round_limit) -> DecodeState:
    """``lax.while_loop`` of rounds until every row is done or ``round`` reaches ``round_limit``."""
    return jax.lax.while_loop(
        lambda s: jnp.any(~s.done) & (s.round < round_limit),
        lambda s: _round(prog, tparams, dparams, s),
        st,
    )


def _start_program(prog: Program) -> Program:
    """The program :func:`_start` is compiled for: γ only shapes the zero ``target_hidden``
    and ``accept_hist`` (see :func:`_size_for_gamma`), so it is normalized to 1."""
    return dataclasses.replace(prog, gamma=1) if prog.drafter is not None and prog.gamma != 1 else prog


def _size_for_gamma(st: DecodeState, prog: Program) -> DecodeState:
    """Give a state from the γ-normalized prefill the zero ``[B, γ+1, ·]`` arrays of ``prog``."""
    b = st.lengths.shape[0]
    # distinct buffers (the run program donates the state; Stats.zeros shares one array)
    stats = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), Stats.zeros(b, prog.gamma))
    return dataclasses.replace(
        st, target_hidden=jnp.zeros((b, prog.gamma + 1, prog.cfg.hidden_size), jnp.float32), stats=stats
    )


_start_jit = jax.jit(_start, static_argnums=0)
_run_jit = jax.jit(_run, static_argnums=0, donate_argnums=3)


# --------------------------------------------------------------------------- host API
@dataclasses.dataclass
class GenerationResult:
    """Output of :func:`generate` for a batch.

    tokens: per row, the new token ids (EOS included when it ended the row).
    stats: per row, a dict: ``new_tokens``, ``target_calls``, ``draft_calls``,
      ``drafted_tokens``, ``accepted_tokens``, ``checked_tokens``,
      ``mean_accepted_tokens`` (new tokens ÷ target calls, Spec-Bench's τ),
      ``acceptance_rate`` (accepted ÷ checked draft tokens), ``accept_hist``,
      ``finish_reason`` (``eos`` or ``length``).
    compile_s, prefill_s, decode_s: seconds (compile excluded from the other two;
      0 when the programs were already compiled).
    """

    tokens: list[list[int]]
    stats: list[dict]
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        """All rows' new tokens ÷ decode seconds."""
        n = sum(len(t) for t in self.tokens)
        return n / self.decode_s if self.decode_s > 0 else float("nan")


def kv_cache_dtype(weight_format: str) -> str:
    """KV-cache dtype for a weight format: bfloat16 caches for bfloat16 weights on GPU/TPU;
    float32 otherwise (XLA CPU has no fast batched bf16 attention dot)."""
    if weight_format == "bfloat16" and jax.default_backend() != "cpu":
        return "bfloat16"
    return "float32"


def _bucket(n: int, size: int) -> int:
    return max(size, -(-n // size) * size)


def prompt_bucket(n: int) -> int:
    """Padded prompt length for a prompt of ``n`` tokens: the next power of two, at least
    ``PROMPT_BUCKET``. Each bucket compiles its own prefill and decode programs, so
    geometric buckets keep the number of programs logarithmic in the prompt lengths
    seen (at most 2× prefill padding; the decode loop never attends to the padding)."""
    return max(PROMPT_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def seed_key(seed: int) -> jax.Array:
    """``PRNGKey(seed)`` for a seed in ``[0, 2**64)`` (seeds from 2**63 on are passed as the
    int64 with the same bits; smaller seeds give exactly ``PRNGKey(seed)``)."""
    s = int(seed)
    if s >= 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {s}")
    return jax.random.PRNGKey(s - 2**64 if s >= 2**63 else s)


def request_keys(seed: int | Sequence[int], batch: int, offset: int = 0) -> jax.Array:
    """Per-row request keys ``[B, 2]``: ``fold_in(PRNGKey(seed), offset + i)`` for an int seed
    (row identity = its index in the request list, not its batch slot), or
    ``PRNGKey(seed_i)`` for a list of per-row seeds."""
    if isinstance(seed, (list, tuple, np.ndarray)):
        if len(seed) != batch:
            raise ValueError(f"got {len(seed)} seeds for {batch} prompts; pass one per prompt or a single int")
        return jnp.stack([jax.random.PRNGKey(int(s)) for s in seed])
    base = seed_key(seed)
    # one vectorized fold_in (a Python loop of B eager fold_ins took 142 s for B = 4000)
    rows = jnp.asarray(np.arange(offset, offset + batch, dtype=np.uint32))
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(rows)


def _validate(prompts, max_new_tokens, gamma, drafter, ctx_limit):
    if not prompts:
        raise ValueError("no prompts given; pass at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token (text) per prompt")
        if len(p) >= ctx_limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens, longer than the model's context of {ctx_limit} "
                "(it must leave room for at least one new token); shorten the prompt"
            )
    mn = np.asarray(max_new_tokens).reshape(-1)
    if np.any(mn < 1) or np.any(mn != np.round(mn)):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if drafter is not None and (int(gamma) != gamma or gamma < 1):
        raise ValueError(f"gamma (num_draft_tokens) must be an integer >= 1, got {gamma!r}")


class Decoder:
    """Prepared decoding for one target (and optionally one drafter + γ).

    Holds compiled programs keyed by shape bucket; reuse one Decoder across calls
    so prompts of the same bucket never recompile.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ``data``/``model``, a
    :class:`specjax.sharding.MeshSpec` or ``"data=D,model=M"``; by default the mesh the
    target's parameters are already sharded on (``MeshSpec.load_model``), else one device.
    On a mesh, parameters (target and drafter, each by its own config), caches and rows
    are sharded (:mod:`specjax.sharding`); a batch is padded to a multiple of ``data``.
    """

    def __init__(self, target, drafter=None, gamma: int = 4, mesh=None):
        if drafter is not None and (int(gamma) != gamma or gamma < 1):
            raise ValueError(f"gamma (num_draft_tokens) must be an integer >= 1, got {gamma!r}")
        from specjax import sharding

        self.mesh, target, drafter = sharding.prepare_decoder(target, drafter, mesh)
        self.target = target
        self.drafter = drafter
        self.gamma = int(gamma) if drafter is not None else 0
        self._compiled: dict = {}

    # ---- compile (AOT, timed separately)
    def _get(self, which, prog, args):
        key = (which, prog, jax.tree_util.tree_structure(args),
               tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)))
        hit = self._compiled.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        fn = _start_jit if which == "start" else _run_jit
        if self.mesh is not None:
            from specjax import sharding

            fn = sharding.decode_jit(which, prog, args, self.mesh)
        compiled = fn.lower(prog, *args).compile()
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t0

    def context_limit(self) -> int:
        lim = self.target.config.max_position_embeddings
        if self.drafter is not None and getattr(self.drafter, "config", None) is not None:
            lim = min(lim, self.drafter.config.max_position_embeddings)
        return lim

    def prepare(self, prompts, *, max_new_tokens=128, sampling: SamplingParams | None = None,
                seed=0, keys=None, eos_ids=None, seed_offset: int = 0):
        """Validate and bucket a batch; returns ``(program, start args)``."""
        cfg = self.target.config
        ctx_limit = self.context_limit()
        _validate(prompts, max_new_tokens, self.gamma or 1, self.drafter, ctx_limit)
        b = len(prompts)
        plens = np.array([len(p) for p in prompts], np.int32)
        mn = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (b,))
        mn = np.minimum(mn, ctx_limit - plens).astype(np.int32)  # the context limit, per row
        p_bucket = prompt_bucket(int(plens.max()))
        buf = _bucket(p_bucket + int(mn.max()) + self.gamma + 1, BUFFER_BUCKET)
        prompt = np.zeros((b, p_bucket), np.int32)
        for i, p in enumerate(prompts):
            prompt[i, : len(p)] = p
        if sampling is None:
            sampling = SamplingParams.create(b)
        if keys is None:
            keys = request_keys(seed, b, seed_offset)
        eos = list(cfg.eos_token_ids if eos_ids is None else eos_ids)
        eos_arr = np.full((b, max(1, len(eos))), -1, np.int32)
        eos_arr[:, : len(eos)] = eos
        cache_dtype = kv_cache_dtype(self.target.dtype)
        prog = Program(cfg, self.target.graphdef, self.drafter, self.gamma, buf, cache_dtype)
        dparams = None if self.drafter is None else self.drafter.params
        args = (self.target.params, dparams, jnp.asarray(prompt), jnp.asarray(plens), jnp.asarray(mn),
                jnp.asarray(eos_arr), jnp.asarray(keys), sampling)
        if self.mesh is not None:  # rows on `data` (padded to a multiple of it)
            from specjax import sharding

            args = sharding.shard_start_args(args, self.mesh)
        return prog, args

    def start(self, prompts, **kw):
        """Prefill: returns ``(state, compile_s, prefill_s)``.

        The prefill does not depend on γ: off a mesh it is compiled once per (drafter, shape
        bucket) for every γ (:func:`_start_program`), and the γ-shaped parts of the state
        are sized afterwards (:func:`_size_for_gamma`)."""
        prog, args = self.prepare(prompts, **kw)
        sprog = prog if self.mesh is not None else _start_program(prog)
        fn, c = self._get("start", sprog, args)
        t0 = time.perf_counter()
        st = fn(*args)
        if sprog is not prog:
            st = _size_for_gamma(st, prog)
        st = jax.block_until_ready(st)
        return prog, st, c, time.perf_counter() - t0

    def run(self, prog, st, round_limit):
        """Run rounds until done or ``round_limit``; returns ``(state, compile_s, seconds)``."""
        dparams = None if self.drafter is None else self.drafter.params
        args = (self.target.params, dparams, st, jnp.int32(round_limit))
        if self.mesh is not None:
            from specjax import sharding

            args = (*args[:3], sharding.put_replicated(args[3], self.mesh))
        fn, c = self._get("run", prog, args)
        t0 = time.perf_counter()
        st = jax.block_until_ready(fn(*args))
        return st, c, time.perf_counter() - t0

    def generate(self, prompts: Sequence[Sequence[int]], **kw) -> GenerationResult:
        """Decode a batch of token-id prompts to completion (see :func:`generate`)."""
        prog, st, c1, prefill_s = self.start(prompts, **kw)
        st, c2, decode_s = self.run(prog, st, np.iinfo(np.int32).max)
        if self.mesh is not None:  # gather across hosts; drop the padding rows
            from specjax import sharding

            res = _result(sharding.host_view(st), c1 + c2, prefill_s, decode_s)
            return dataclasses.replace(res, tokens=res.tokens[:len(prompts)], stats=res.stats[:len(prompts)])
        return _result(st, c1 + c2, prefill_s, decode_s)

    def stream(self, prompts, rounds_per_chunk: int = 8, **kw) -> Iterator[list[list[int]]]:
        """Yield, per chunk of ``rounds_per_chunk`` rounds, each row's newly committed tokens
        (one host sync per chunk, not per token).

        Raises:
          ValueError: ``rounds_per_chunk`` is not an integer >= 1 (0 would loop forever).
        """
        if isinstance(rounds_per_chunk, bool) or int(rounds_per_chunk) != rounds_per_chunk or rounds_per_chunk < 1:
            raise ValueError(f"rounds_per_chunk must be an integer >= 1, got {rounds_per_chunk!r}")
        from specjax.sharding import host_view  # a no-op off a multi-host mesh

        prog, st, _, _ = self.start(prompts, **kw)
        hv = host_view(st)
        seen = np.asarray(hv.lengths).copy()
        while True:
            st, _, _ = self.run(prog, st, int(hv.round) + rounds_per_chunk)
            hv = host_view(st)
            lengths = np.asarray(hv.lengths)
            toks = np.asarray(hv.tokens)
            yield [toks[i, seen[i]: lengths[i]].tolist() for i in range(len(prompts))]
            seen = lengths.copy()
            if bool(np.all(np.asarray(hv.done))):
                return


def _result(st: DecodeState, compile_s, prefill_s, decode_s) -> GenerationResult:
    toks = np.asarray(st.tokens)
    plen = np.asarray(st.prompt_lengths)
    lengths = np.asarray(st.lengths)
    eos = np.asarray(st.eos)
    s = jax.tree_util.tree_map(np.asarray, st.stats)
    out_tokens, out_stats = [], []
    for i in range(toks.shape[0]):
        new = toks[i, plen[i]: lengths[i]].tolist()
        out_tokens.append(new)
        calls = int(s.target_calls[i])
        checked = int(s.checked_tokens[i])
        out_stats.append({
            "new_tokens": len(new),
            "target_calls": calls,
            "draft_calls": int(s.draft_calls[i]),
            "drafted_tokens": int(s.drafted_tokens[i]),
            "accepted_tokens": int(s.accepted_tokens[i]),
            "checked_tokens": checked,
            "mean_accepted_tokens": len(new) / calls if calls else 0.0,
            "acceptance_rate": int(s.accepted_tokens[i]) / checked if checked else 0.0,
            "accept_hist": s.accept_hist[i].tolist(),
            "finish_reason": "eos" if new and new[-1] in set(eos[i].tolist()) - {-1} else "length",
        })
    return GenerationResult(out_tokens, out_stats, compile_s, prefill_s, decode_s)


def generate(target, prompts, *, drafter=None, gamma: int = 4, **kw) -> GenerationResult:
    """Decode token-id prompts with ``target``; speculative when ``drafter`` is given.

    Args:
      target: a loaded :class:`~specjax.loading.Model`.
      prompts: list of B token-id lists (different lengths allowed).
      drafter: ``None`` (autoregressive) or a drafter (:mod:`specjax.drafters`).
      gamma: draft tokens per round γ (``num_draft_tokens``), ≥ 1.
      max_new_tokens: int or ``[B]`` ints ≥ 1 (clipped per row to the context).
      sampling: :class:`SamplingParams` (default greedy).
      seed / keys: request keys (see :func:`request_keys`).
      eos_ids: stop ids (default: the model's EOS ids); ``[]`` to ignore EOS.

    Raises:
      ValueError: empty prompt list or prompt, prompt longer than the context,
        ``max_new_tokens < 1``, ``gamma < 1``.
    """
    return Decoder(target, drafter, gamma).generate(prompts, **kw)


def speculative_generate(target, drafter, prompts, *, gamma: int = 4, **kw) -> GenerationResult:
    """Speculative decoding (Leviathan et al. 2023, Algorithm 1): ``generate`` with a drafter."""
    if drafter is None:
        raise ValueError("speculative_generate needs a drafter; use generate() for plain decoding")
    return Decoder(target, drafter, gamma).generate(prompts, **kw)
