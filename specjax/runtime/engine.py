"""Continuous batching (issue 31): a fixed number of slots decoded by the one jitted loop, with
requests admitted into free slots between chunks of rounds.

:class:`Engine` holds a :class:`~specjax.runtime.loop.DecodeState` of ``slots`` rows whose buffer
holds any request of up to ``context_limit`` tokens (:meth:`Decoder.slot_program`), so every
program has a static shape: one prefill per prompt bucket (batch 1), one insertion, one chunk of
rounds — nothing recompiles per request. A free slot is a row that is ``done`` (done rows do not
change). Each :meth:`Engine.step`:

1. ends cancelled requests (their slot is marked done and is free at once);
2. admits queued requests into free slots, at most :data:`ADMIT_TOKENS` prompt tokens per step
   while requests run (one prefill chunk, :data:`~specjax.runtime.prefill.PREFILL_CHUNK`, when
   none does): each is prefilled alone (batch 1, its prompt bucket; a longer prompt piece by piece
   over the next steps, :func:`~specjax.runtime.prefill.prompt_piece`, bit for bit its one-call
   prefill, so running rows wait for at most one piece) and its row is written into the slot
   (:func:`insert_row`), with
   ``first_round`` = the batch's round so its draws are ``fold_in(key, j)`` for its own j-th round;
3. runs ``rounds_per_chunk`` rounds over all slots (:func:`~specjax.runtime.loop.run_rounds`);
4. reads the newly committed tokens (and log-probabilities) of the running rows and returns
   them as :class:`Update` s; a finished row's final update carries its
   :class:`~specjax.runtime.results.RowStats` and frees its slot.

Exactness under batching: a request's tokens are the tokens of ``Decoder.generate`` for that
prompt alone with ``keys = request_keys(seed, 1)`` (the same key, its own round numbers, and
batch-invariant numerics: docs/design.md "Batch invariance" — exact in bfloat16 and int8;
float32 may differ at near-ties because XLA CPU's float32 dots differ between 1 and ≥ 2 rows).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import Sampling, SamplingParams
from specjax.models.llama import KVCache
from specjax.runtime.engine_rows import (  # noqa: F401  (re-exported: the row operations were defined here)
    end_jit, end_rows, head_jit, head_rows, insert_jit, insert_row, move_jit, move_rows, put_head_jit, put_head_rows,
    row_jit, row_ladder, row_logprobs, row_stats, set_speculate, speculate_jit, zero_jit,
)
from specjax.runtime.decoder import SEED_LIMIT, Decoder, attention_views, prompt_bucket, request_keys, view_for
from specjax.runtime.prefill import PREFILL_CHUNK, prefill_jit, prefill_program, prompt_piece_jit, size_for_gamma
from specjax.runtime.request import Request, request_class
from specjax.runtime.results import RowStats
from specjax.runtime.spec_policy import SPECULATION, AutoSpeculation

_PINNED = object()  # a chunk whose rows cannot switch method (a sampled request runs)
ENGINE_STOP_IDS = 16  # stop-id slots per row (the model's EOS ids + a request's stop token ids)
# While requests run, prompts are prefilled in pieces of this many tokens (a power of two dividing PREFILL_CHUNK:
# pieces never straddle a chunk's key spans): one per step per request waiting for a slot (at most
# ADMIT_PIECES_MAX), so with one arrival a running stream's update waits for one piece (int8, 2 cores: a 512-token chunk of a
# 2,000-token prompt ≈ 0.4–1.5 s; a 64-token piece ≈ 8× less)
ADMIT_TOKENS = 64
ADMIT_PIECES_MAX = 8


def EngineRequest(prompt: Sequence[int], **fields) -> Request:  # noqa: N802  (the older class name)
    """A :class:`~specjax.runtime.request.Request` for an :class:`Engine` (its older name): the prompt's
    token ids (≥ 1, fewer than the engine's ``context_limit``) and the declared request fields as
    keywords (``max_new_tokens`` — capped to ``context_limit − len(prompt)`` —, ``sampling``, ``seed``,
    ``stop_token_ids``, ``logprobs`` up to the engine's ``max_logprobs``, ``ignore_eos``, ``speculative``:
    ``False`` offers the row no drafts, one target token per round drawn from p like a plain step).
    Unlike the declaration's default, ``seed`` defaults to ``None``: the engine draws one (reported in
    :class:`Update`).

    Raises:
      SettingError: a field out of its declared range."""
    fields.setdefault("seed", None)
    return request_class()(prompt=prompt, **fields)


@dataclasses.dataclass(frozen=True)
class Update:
    """What one :meth:`Engine.step` gives a request.

    tokens: newly committed token ids (may be empty).
    logprobs: per new token ``{"id", "logprob", "top": [(id, logprob), ...]}`` (as
      ``GenerationResult.logprobs``), or ``None`` when the request asked for none.
    finish_reason: ``None`` while running; ``"eos"``, ``"stop"``, ``"length"`` or ``"cancelled"``.
    stats: on the final update, the request's :class:`~specjax.runtime.results.RowStats`
      (``None`` for a request cancelled before it was admitted).
    seed: the seed the request samples with.
    """

    request_id: int
    tokens: list
    logprobs: list | None
    finish_reason: str | None
    stats: RowStats | None
    seed: int


@dataclasses.dataclass
class _Running:
    rid: int
    req: Request
    seed: int
    plen: int
    reported: int  # committed length already returned


@dataclasses.dataclass
class _Admitting:
    """A request whose prompt (longer than one step's admission) is prefilled piece by piece, one
    piece per step, into its own one-row cache before it joins a slot (the lowest free one then:
    nothing else is admitted meanwhile, so one is free)."""
    rid: int
    req: Request
    seed: int
    prompt: jax.Array  # [1, P] padded prompt
    cache: KVCache
    hidden: jax.Array  # [1, P, F]
    done: int = 0  # prompt-bucket tokens prefilled so far


def _check_int(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {rng}, got {v!r}")


class Engine:
    """Continuous batching over ``slots`` rows of one :class:`~specjax.runtime.decoder.Decoder`
    (its target, drafter, γ or tree; one device or the Decoder's mesh: rows on ``data``, so
    ``slots`` a multiple of it, weights and caches on ``model``; a request is prefilled at batch 1
    and written into the sharded slots).

    ``max_context``: tokens one request may hold (prompt + new); default the decoder's context.
    Every slot's buffer (and KV cache) holds this many, so it sets memory and the attention
    cost of every round. ``rounds_per_chunk``: rounds between admissions and updates (under the auto
    policy, while a request waits, a speculative chunk runs about the time of that many plain
    rounds: :meth:`chunk_rounds`).
    ``max_logprobs``: the most top alternatives a request may ask for (the programs record this
    many for every row and each request gets its own count); ``None``: log-probabilities off.
    Speculation under load: a chunk in which no running row speculates runs the ``plain``
    program (one-token target calls on the same state, the drafter idle:
    :func:`~specjax.runtime.loop._plain_round`), at autoregressive cost. Greedy requests (the same
    tokens either way) may be switched; a sampled request keeps speculating (its tokens are its
    seed's: ``generate --seed``), so a chunk with one is speculative. ``speculation``:
    ``"always"`` (default) — greedy rows speculate unless ``spec_max_running`` is given and more
    than that many requests run; ``"auto"`` — each chunk whose rows may switch runs the program
    measured faster at its attention view (:class:`~specjax.runtime.spec_policy.AutoSpeculation`:
    seconds per round of each program and τ, re-measured now and then, per row count and view).

    Programs sized to the occupancy (``ladder``, default on; off a mesh): every program computes all
    of its rows, running or free, so a chunk runs on the first ``b`` slots only, ``b`` the smallest of
    :func:`row_ladder` (1, 2, 4, …, ``slots``) that holds the running requests — one client is not
    charged for eight rows. Requests are kept in the lowest slots (an admission takes the lowest
    free one; a request beyond ``b`` moves down, :func:`move_rows`, its tokens unchanged: its
    draws follow its key and its own rounds, never its slot). Each row count is its own program
    (:meth:`warmup` compiles 1 and ``slots``; the others at first use, then from the cache). In
    float32 a request may switch between the one-row and the many-row programs as others come and
    go (docs/design.md "Batch invariance": float32 dots of one row and of ≥ 2 rows may differ at
    near-ties); bfloat16 and int8 are exact either way.

    Thread safety: :meth:`submit` and :meth:`cancel` may be called from any thread; :meth:`step`
    from one thread only.

    Raises:
      ValueError: ``slots``, ``max_context``, ``rounds_per_chunk``, ``max_logprobs``,
        ``spec_max_running`` or ``speculation`` out of range, or ``slots`` not a multiple of the
        mesh's ``data`` axis.
    """

    def __init__(self, decoder: Decoder, slots: int = 8, max_context: int | None = None,
                 rounds_per_chunk: int = 4, max_logprobs: int | None = 20, spec_max_running: int | None = None,
                 speculation: str = "always", ladder: bool = True):
        _check_int("slots", slots, 1)
        if decoder.mesh is not None:
            from specjax.runtime.sharding import DATA

            d = int(decoder.mesh.shape[DATA])
            if slots % d:
                raise ValueError(f"slots ({slots}) must be a multiple of the mesh's data axis ({d}): rows are "
                                 f"split over it; use {slots + (-slots % d)} slots")
        _check_int("rounds_per_chunk", rounds_per_chunk, 1)
        cfg = decoder.target.config
        if max_logprobs is not None:
            _check_int("max_logprobs", max_logprobs, 0, cfg.vocab_size)
        ctx = decoder.context_limit()
        if max_context is not None:
            _check_int("max_context", max_context, 2, ctx)
        if spec_max_running is not None:
            _check_int("spec_max_running", spec_max_running, 0)
        self.spec_max_running = spec_max_running
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
        self.speculation = speculation
        self.auto = AutoSpeculation() if speculation == "auto" and decoder.drafter is not None else None
        self.decoder = decoder
        self.slots = int(slots)
        self.rounds_per_chunk = int(rounds_per_chunk)
        self.max_logprobs = max_logprobs
        self.context_limit = ctx if max_context is None else int(max_context)
        self.prog = decoder.slot_program(self.context_limit, max_logprobs)
        # the rounds when no running row speculates: one-token target calls on the same state
        self._plain = None if decoder.drafter is None else dataclasses.replace(self.prog, plain=True)
        self._sprog = prefill_program(self.prog)
        self._eos = [int(e) for e in cfg.eos_token_ids]
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._cancel: set[int] = set()
        self._next_id = 0
        self._slots: dict[int, _Running] = {}
        self.admitting: _Admitting | None = None
        self.spare = None  # the last admission's (cache, hidden): the next one's, zeroed in place (piece_inputs)
        self._state = None
        self._shardings = None  # on a mesh: the state's shardings (_placed)
        self._speculating = None  # the running rows' switches last set by _policy
        # chunks run on the fewest rows that hold the running requests (off a mesh; on one, every slot)
        self.ladder = row_ladder(self.slots) if ladder and decoder.mesh is None else (self.slots,)
        self.chunks_by_rows: collections.Counter = collections.Counter()  # chunks run per row count
        self.rows_moved = 0  # requests moved down by _compact
        self.admission_programs = 0  # prefills, prompt pieces and insertions dispatched by _admit

    # ---- requests (any thread)
    def submit(self, req: Request) -> int:
        """Queue a :class:`~specjax.runtime.request.Request` whose prompt is token ids; returns its id.
        Raises ValueError (one line) for a bad request."""
        seed = self._check(req)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._queue.append((rid, req, seed))
        return rid

    def cancel(self, request_id: int) -> None:
        """End a queued or running request at the next :meth:`step` (``finish_reason``
        ``"cancelled"``; its slot is free then). Unknown or finished ids are ignored."""
        with self._lock:
            self._cancel.add(int(request_id))

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._slots)

    @property
    def idle(self) -> bool:
        return not self._queue and not self._slots and not self._cancel and self.admitting is None

    def _check(self, req: Request) -> int:
        """The engine's own limits on a request (its declared ranges were checked when it was made):
        the prompt's ids and length, log-probabilities, stop ids; returns its seed (drawn when ``None``)."""
        if not isinstance(req, Request):
            raise ValueError(f"expected a specjax Request, got {type(req).__name__}")
        vocab = self.decoder.target.config.vocab_size
        prompt = list(req.prompt or ())
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.context_limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.context_limit} tokens "
                             "(prompt + at least one new token): shorten the prompt")
        SamplingParams.from_rows([req.sampling]).with_vocab(vocab)
        if req.logprobs is not None:
            if self.max_logprobs is None:
                raise ValueError("log-probabilities are off in this engine (max_logprobs=None)")
            _check_int("logprobs", req.logprobs, 0, self.max_logprobs)
        stops = list(req.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in stops):
            raise ValueError(f"stop token ids must be integers in [0, {vocab})")
        room = ENGINE_STOP_IDS - (0 if req.ignore_eos else len(self._eos))
        if len(stops) > room:
            raise ValueError(f"at most {room} stop token ids per request, got {len(stops)}")
        if req.seed is None:
            return int.from_bytes(os.urandom(8), "little") % SEED_LIMIT
        return int(req.seed)

    # ---- the decode side (one thread)
    def warmup(self, prompt_tokens: int = 512, all_rows: bool = False) -> float:
        """Compile (and run once, on a dummy prompt) the prefill of every prompt bucket up to
        ``prompt_tokens`` (capped to the context) and its :data:`ADMIT_TOKENS` piece, the insertion, ending and switching of a row, and
        the chunk of rounds (speculative and plain) at every attention view, on one row and on every
        slot (:attr:`ladder`'s ends; ``all_rows``: every row count of the ladder); returns the seconds.
        Longer prompt buckets and the ladder's other row counts compile at their first use."""
        t0 = time.perf_counter()
        st = self.ensure_state()
        for rows in self.ladder if all_rows else sorted({self.ladder[0], self.slots}):  # one request; a full house
            args = self.decoder.run_args(st if rows == self.slots else head_jit(st, rows), 0)
            if rows != self.slots:  # the chunk's write-back (compiled here, not in the first burst of traffic)
                st = self._placed(put_head_jit(st, head_jit(st, rows)))
            for prog in (self.prog, self._plain):
                for v in attention_views(self.prog) + [None] if prog is not None else []:  # every view's program
                    self.decoder.compiled_program("run", dataclasses.replace(prog, kv_view=v), args)
        p, row = self.decoder.prompt_bucket, None
        while p <= min(int(prompt_tokens), self.context_limit - 1):
            row = self._row_state([0] * p, 1, 0, Sampling(), (), True)
            if p > ADMIT_TOKENS:  # its piece program: a prompt of this bucket arriving while others run
                arr, cache, hidden = self.piece_inputs([0] * p)
                self.spare = jax.block_until_ready(prompt_piece_jit(  # (kept: the next bucket's compiles
                    self._sprog, self.decoder.target.params, arr, cache, hidden, jnp.int32(0), ADMIT_TOKENS))  # zero_jit)
            p *= 2
        if row is not None:  # the small programs every request meets: insertion, end, switches, a row's read
            st = self._placed(insert_jit(st, row, jnp.int32(0), jnp.bool_(True)))
            st = self._placed(end_jit(st, jax.device_put(np.ones(self.slots, bool))))
            st = self._placed(speculate_jit(st, jax.device_put(np.ones(self.slots, bool))))
            if len(self.ladder) > 1:  # the compaction (1.5-3 s to compile: not mid-traffic)
                st = self._placed(move_jit(st, *(jax.device_put(np.zeros(self.slots, np.int32)),) * 2, jnp.int32(0)))
            if st.logprobs is not None:
                row_jit(st.logprobs, jnp.int32(0))
        self._state = jax.block_until_ready(st)
        return time.perf_counter() - t0

    def _row_state(self, prompt, max_new, seed, sampling, stops, ignore_eos, forward=None):
        dec = self.decoder
        p = len(prompt)
        arr = np.zeros((1, prompt_bucket(p, dec.prompt_bucket)), np.int32)
        arr[0, :p] = prompt
        eos = np.full((1, ENGINE_STOP_IDS), -1, np.int32)
        ids = ([] if ignore_eos else self._eos) + [int(t) for t in stops]
        eos[0, : len(ids)] = ids
        mn = min(int(max_new), self.context_limit - p)
        dparams = None if dec.drafter is None else dec.drafter.params
        put = jax.device_put
        args = (dec.target.params, dparams, put(arr), put(np.array([p], np.int32)), put(np.array([mn], np.int32)),
                put(eos), request_keys(seed, 1), SamplingParams.from_rows([sampling]))
        st = prefill_jit(self._sprog, *args, forward=forward)
        return st if self._sprog is self.prog else size_for_gamma(st, self.prog)

    def ensure_state(self):
        """The slots' state: a dummy one-token row tiled to ``slots`` rows, every row done."""
        if self._state is None:
            row = self._row_state([0], 1, 0, Sampling(), (), True)
            st = jax.tree_util.tree_map(lambda x: jnp.repeat(x, self.slots, axis=0) if jnp.ndim(x) else x, row)
            self._state = self._placed(dataclasses.replace(st, done=jnp.ones((self.slots,), bool)))
        return self._state

    def _placed(self, st):
        """On a mesh, ``st`` with the decode programs' state shardings (rows on ``data``, caches on
        ``model``: :func:`~specjax.runtime.sharding.state_shardings`; a no-op when already so),
        so every compiled program sees the layout it was compiled for; off a mesh ``st``."""
        if self.decoder.mesh is None:
            return st
        from specjax.runtime import sharding

        if self._shardings is None:
            self._shardings = sharding.state_shardings(self.prog, st, self.decoder.mesh)
        return jax.device_put(st, self._shardings)

    def _rows(self) -> int:
        """The row count the next chunk runs on: the smallest of :attr:`ladder` holding the running requests."""
        n = max(self._slots) + 1 if self._slots else 1
        return next(b for b in self.ladder if b >= len(self._slots) and (b >= n or b == self.slots))

    def _compact(self, st):
        """Move running requests beyond the smallest ladder row count that holds them all into the
        free slots below it (one permutation of every row); returns the state."""
        b = next(b for b in self.ladder if b >= len(self._slots))
        high = sorted(s for s in self._slots if s >= b)
        if not high:
            return st
        low = [s for s in range(b) if s not in self._slots][: len(high)]
        src, dst = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        src[: len(high)], dst[: len(high)] = high, low
        for a, d in zip(high, low):
            self._slots[d] = self._slots.pop(a)
            self.rows_moved += 1
            if self._speculating is not None:
                self._speculating[d] = self._speculating[a]
        return self._placed(move_jit(st, jax.device_put(src), jax.device_put(dst), jnp.int32(len(high))))

    def _run_chunk(self, st, rounds: int, plain: bool = False, rows: int | None = None):
        """``rounds`` rounds over the first ``rows`` slots (default all; :meth:`Decoder.run`: its
        attention views follow the longest running row, so short requests do not pay for the context
        the slots are sized to); ``plain``: one-token target calls
        (:func:`~specjax.runtime.loop._plain_round`), for chunks in which no running row speculates.
        Returns ``(state, decode seconds)``."""
        prog = self._plain if plain and self._plain is not None else self.prog
        limit = int(np.asarray(st.round)) + rounds
        self.chunks_by_rows[rows or self.slots] += 1
        if rows is None or rows == self.slots:
            st, _, seconds = self.decoder.run(prog, st, limit)
            return st, seconds
        head, _, seconds = self.decoder.run(prog, head_jit(st, rows), limit)
        return put_head_jit(st, head), seconds

    def step(self) -> list[Update]:
        """Cancel, admit, run one chunk of rounds, report (see the module docstring)."""
        st = self.ensure_state()
        with self._lock:
            cancels, self._cancel = self._cancel, set()
            queued = [q for q in self._queue if q[0] in cancels]
            for q in queued:
                self._queue.remove(q)
        updates = [Update(rid, [], None, "cancelled", None, seed) for rid, _, seed in queued]
        a = self.admitting
        if a is not None and a.rid in cancels:  # cancelled while its prompt was being prefilled
            updates.append(Update(a.rid, [], None, "cancelled", None, a.seed))
            self.admitting, self.spare = None, (a.cache, a.hidden)
        ending = [s for s, r in self._slots.items() if r.rid in cancels]
        if ending:
            mask = np.zeros(self.slots, bool)
            mask[ending] = True
            st = self._placed(end_jit(st, jax.device_put(mask)))
        work = self.admission_programs
        st = self._admit(st)
        admitting = self.admission_programs != work  # its programs still run beside the chunk (async dispatch)
        if any(s not in ending for s in self._slots):
            st = self._compact(st) if not ending else st
            rows = self._rows()
            st, plain, view = self._policy(st, rows)
            before = None if view is _PINNED else self._counters(st)
            st, seconds = self._run_chunk(st, self.chunk_rounds(plain, rows), plain, rows)
            if before is not None:  # the auto policy's measurement (its rows could switch)
                rows = list(self._slots)
                (l0, c0, r0), (l1, c1, r1) = before, self._counters(st)
                self.auto.record(plain, view, seconds, r1 - r0, int((l1 - l0)[rows].sum()),
                                  int((c1 - c0)[rows].sum()), timed=not admitting)
        self._state = st
        return updates + self._report(st, set(ending))

    def chunk_rounds(self, plain: bool, rows: int | None) -> int:
        """Rounds in the next chunk: ``rounds_per_chunk``; but while a request waits for admission, a
        speculative chunk under the auto policy lasts about as long as ``rounds_per_chunk`` plain
        rounds would (``rounds_per_chunk · t_plain / t_spec`` of the measured seconds per round, at
        least 1): admission advances once per chunk, so longer chunks would delay the waiting requests'
        first tokens and leave their slots empty. The tokens do not depend on where chunks end."""
        n = self.rounds_per_chunk
        if plain or self.auto is None or not (self._queue or self.admitting is not None):
            return n
        key = self.view_key(rows)
        ts, tp = self.auto.t_spec.get(key), self.auto.t_plain.get(key)
        return n if not ts or not tp else max(1, min(n, round(n * tp / ts)))

    @staticmethod
    def _counters(st):
        """Host copies of what the auto policy measures: ``(lengths [S], target_calls [S], round)``."""
        return np.asarray(st.lengths), np.asarray(st.stats.target_calls), int(np.asarray(st.round))

    def _admit(self, st):
        """Admit queued requests into free slots, about :meth:`step_tokens` prompt tokens per step:
        a prompt of at most :data:`ADMIT_TOKENS` (at most a chunk when nothing runs) is prefilled at
        once, a longer one piece by piece (:meth:`_advance`), so an admission stalls the running rows
        for about one decode chunk per step at most."""
        idle = not self._slots
        full = budget = self.step_tokens()
        while True:
            if self.admitting is not None:
                if budget < self._next_piece(self.admitting) and budget < full:  # at least one piece a step
                    break
                st, used = self._advance(st)
                budget -= used
                continue
            free = [s for s in range(self.slots) if s not in self._slots]
            with self._lock:
                if budget <= 0 or not free or not self._queue:
                    break
                n = len(self._queue[0][1].prompt)
                big = n > (PREFILL_CHUNK if idle else ADMIT_TOKENS)
                if not big and n > budget and budget < full:  # the next step takes it
                    break
                rid, req, seed = self._queue.popleft()
            slot = free[0]
            if big:
                self.admitting = self._start_admission(rid, req, seed)
                continue
            budget -= len(req.prompt)
            row = self._row_state(list(req.prompt), req.max_new_tokens, seed, req.sampling, req.stop_token_ids,
                                  req.ignore_eos)
            st = self._insert(st, row, slot, rid, req, seed)
        return st

    def _insert(self, st, row, slot, rid, req, seed):
        self.admission_programs += 1
        st = self._placed(insert_jit(st, row, jnp.int32(slot), jnp.bool_(req.speculative)))
        self._slots[slot] = _Running(rid, req, seed, len(req.prompt), len(req.prompt))
        if self._speculating is not None:  # what insert_row set
            self._speculating[slot] = bool(req.speculative)
        return st

    def step_tokens(self) -> int:
        """Prompt tokens one step may prefill: while requests run, one :data:`ADMIT_TOKENS` piece per
        request waiting for a free slot (at least one, at most :data:`ADMIT_PIECES_MAX`: a burst of
        arrivals is admitted about as fast as whole prompts were, a lone long prompt one piece per
        step); when nothing runs, a whole prefill chunk (nobody waits)."""
        running = len(self._slots)
        if not running:
            return PREFILL_CHUNK
        with self._lock:
            queued = len(self._queue)
        waiting = min(queued + (self.admitting is not None), self.slots - running)
        return ADMIT_TOKENS * max(1, min(ADMIT_PIECES_MAX, waiting))

    def _start_admission(self, rid, req, seed) -> _Admitting:
        return _Admitting(rid, req, seed, *self.piece_inputs(req.prompt))

    def piece_inputs(self, prompt):
        """``(padded prompt [1, P], empty one-row cache, zero hidden [1, P, F])`` for
        :func:`~specjax.runtime.prefill.prompt_piece` calls, P the prompt's bucket (a multiple of
        every piece size)."""
        p = prompt_bucket(len(prompt), self.decoder.prompt_bucket)
        arr = np.zeros((1, p), np.int32)
        arr[0, : len(prompt)] = list(prompt)
        shape = (1, p, self._sprog.feature_size)
        (cache, hidden), self.spare = self.spare or (None, None), None
        # the last admission's buffers, zeroed in place: a fresh one-row cache (≈ 100 MB at 2,304 slots)
        # page-faults its memory in, 0.1-0.3 s of the step that starts the admission (BENCHMARKS.md, turn 24)
        cache = (KVCache.create(self.decoder.target.config, 1, self.prog.buffer_len, jnp.dtype(self.prog.cache_dtype))
                 if cache is None else zero_jit(cache))
        hidden = zero_jit(hidden) if hidden is not None and hidden.shape == shape else jnp.zeros(shape, jnp.float32)
        return jax.device_put(arr), cache, hidden

    def _next_piece(self, a: _Admitting) -> int:
        """The next piece's tokens: a whole prefill chunk where one starts and nothing runs, else
        :data:`ADMIT_TOKENS`."""
        p = a.prompt.shape[1]
        if not self._slots and a.done % PREFILL_CHUNK == 0 and p - a.done >= PREFILL_CHUNK:
            return PREFILL_CHUNK
        return ADMIT_TOKENS

    def _advance(self, st):
        """One piece of the prompt being admitted (:meth:`_next_piece`); after its last piece, the
        rest of its prefill (:func:`~specjax.runtime.prefill.prefill` with ``forward=``) and its
        insertion. Returns ``(state, prompt tokens prefilled)``."""
        a = self.admitting
        tparams = self.decoder.target.params
        p, n = a.prompt.shape[1], self._next_piece(a)
        self.admission_programs += 1
        a.cache, a.hidden = prompt_piece_jit(self._sprog, tparams, a.prompt, a.cache, a.hidden,
                                             jnp.int32(a.done), n)
        a.done += n
        if a.done < p:
            return st, n
        self.admitting = None
        row = self._row_state(list(a.req.prompt), a.req.max_new_tokens, a.seed, a.req.sampling,
                              a.req.stop_token_ids, a.req.ignore_eos, forward=(a.hidden, a.cache))
        slot = min(s for s in range(self.slots) if s not in self._slots)  # free since admission began (_admit
        st = self._insert(st, row, slot, a.rid, a.req, a.seed)            # admits nothing else meanwhile)
        self.spare = (a.cache, a.hidden)  # after the insertion: the row may hold these very arrays
        return st, n

    def view_key(self, rows: int | None = None):
        """The attention view the next chunk starts in (:func:`~specjax.runtime.decoder.attention_views`;
        ``None``: the whole buffer); with ``rows`` (the ladder in use), the auto policy's key ``(rows, view)``."""
        longest = max(r.reported for r in self._slots.values())
        view = view_for(attention_views(self.prog), longest, self.prog.round_span)
        return view if rows is None or len(self.ladder) == 1 else (rows, view)

    def _policy(self, st, rows: int | None = None):
        """Set each running row's speculation switch; one small device update when a switch
        changes. A request with ``speculative: false`` never speculates; a sampled request always
        does (its tokens are its seed's, :func:`generate`'s); greedy requests (the same tokens either
        way) speculate unless the chunk can be plain — no sampled request runs — and
        ``spec_max_running`` is exceeded or ``speculation="auto"`` measured plain chunks faster
        (:class:`~specjax.runtime.spec_policy.AutoSpeculation`). Returns ``(state, plain, view)``:
        ``plain`` when no running row speculates, so the chunk runs one-token target calls (a
        verification without drafts would cost more and commit the same one token); ``view`` the
        chunk's attention view for the auto policy's record, or ``_PINNED`` when its rows could not
        switch (nothing to record)."""
        if self.decoder.drafter is None:
            return st, False, _PINNED
        running = self._slots.values()
        switchable = not any(r.req.speculative and r.req.sampling.temperature > 0 for r in running)
        view = self.view_key(rows) if switchable and self.auto is not None else _PINNED
        off = switchable and ((self.spec_max_running is not None and len(self._slots) > self.spec_max_running)
                              or (view is not _PINNED and self.auto.plain(view)))
        want = np.zeros(self.slots, bool)
        for slot, r in self._slots.items():
            want[slot] = r.req.speculative and not off
        if self._speculating is None or not np.array_equal(want[list(self._slots)],
                                                           self._speculating[list(self._slots)]):
            st = self._placed(speculate_jit(st, jax.device_put(want)))
        self._speculating = want
        return st, not want.any(), view

    def _report(self, st, cancelled: set) -> list[Update]:
        if not self._slots:
            return []
        lengths, done = np.asarray(st.lengths), np.asarray(st.done)
        toks = np.asarray(st.tokens)
        out = []
        for slot in sorted(self._slots):
            r = self._slots[slot]
            end = int(lengths[slot])
            new = toks[slot, r.reported: end].tolist()
            lps = None
            if r.req.logprobs is not None:  # this row's buffers only ([L, N] each), not every slot's
                lp = jax.tree_util.tree_map(np.asarray, row_jit(st.logprobs, jnp.int32(slot)))
                lps = row_logprobs(lp, r.reported, end, new, r.req.logprobs)
            r.reported = end
            if not (done[slot] or slot in cancelled):
                out.append(Update(r.rid, new, lps, None, None, r.seed))
                continue
            stats = row_stats(st, slot, toks, lengths, [] if r.req.ignore_eos else self._eos)
            reason = "cancelled" if slot in cancelled else stats.finish_reason
            out.append(Update(r.rid, new, lps, reason, stats, r.seed))
            del self._slots[slot]
        return out
