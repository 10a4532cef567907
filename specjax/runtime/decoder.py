"""The :class:`Decoder`: compiled programs, attention views, chunks of rounds, stop handling and
results, around the jitted loop of :mod:`specjax.runtime.loop` (a batch's checks, shape buckets,
request keys and stop ids: :mod:`specjax.runtime.batch`, re-exported here).

A Decoder compiles one prefill and one decode-loop program per (target, drafter, γ, batch,
buffer bucket) ahead of time, runs the loop in one call (or in chunks of rounds for
streaming and stop strings), and turns the final :class:`~specjax.runtime.loop.DecodeState`
into host results whose counters come from one definition (:func:`row_stats`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.drafting import require_drafter, row_context
from specjax.core.sampling import SamplingParams
from specjax.models.attention import reads_visible_keys_only
from specjax.models.llama import kv_cache_dtype
from specjax.runtime.batch import (  # noqa: F401  (re-exported: the batch's checks and buckets)
    BUFFER_BUCKET, PROMPT_BUCKET, SEED_LIMIT, STOP_IDS_BUCKET, check_gamma, check_rounds_per_chunk, check_tree_drafter,
    decode_buffer_len, prompt_bucket, request_keys, round_up, seed_key, shared_prompts, stop_ids_array, tree_shape,
    validate_batch,
)
from specjax.runtime.loop import (  # noqa: F401  (run_rounds/… re-exported for tests)
    RUN_ROUNDS_DONATE, DecodeState, Logprobs, Program, Stats, run_rounds, run_rounds_jit, tree_scratch,
)
from specjax.runtime import programs
from specjax.runtime.prefill import prefill, prefill_jit, prefill_program, size_for_gamma  # noqa: F401  (prefill: for sharding tests)
from specjax.runtime.progress import phase
from specjax.runtime.results import GenerationResult, RowStats, host_result, row_stats  # noqa: F401  (re-exported)

FIRST_CHUNK_ROUNDS = 1  # rounds of the first chunk of a streamed or stop-checked decode (the first text early)


KV_VIEW_MIN = 256  # the smallest attention view of the decode loop (cache slots; a multiple of ATTENTION_BLOCK)


def kv_views(buffer_len: int, minimum: int | None = None) -> list[int]:
    """The attention views below a buffer of ``buffer_len`` slots, ascending: ``minimum``
    (default :data:`KV_VIEW_MIN`) doubled while it is at most half the buffer (``[]`` for a
    buffer under twice the minimum; the buffer itself is the last view). See :meth:`Decoder.run`."""
    v = KV_VIEW_MIN if minimum is None else int(minimum)
    out = []
    while 2 * v <= buffer_len:
        out.append(v)
        v *= 2
    return out


def attention_views(prog) -> list[int]:
    """The attention views :meth:`Decoder.run` steps ``prog`` through: :func:`kv_views` of its buffer,
    or none where it has a fixed view already, or where its target's attention is the CPU kernel
    (:func:`specjax.models.attention.reads_visible_keys_only`), which reads each row's visible keys
    whatever the buffer — views would only add programs to compile."""
    if prog.kv_view is not None or reads_visible_keys_only(prog.cache_dtype, prog.cfg.head_dim):
        return []
    return kv_views(prog.buffer_len)


def view_for(views: list[int], longest: int, round_span: int) -> int | None:
    """The smallest of ``views`` (:func:`kv_views`) that holds the next round of a running row of
    ``longest`` tokens (cache slots ``< longest - 1 + round_span``), or ``None``: the whole buffer."""
    need = int(longest) - 1 + int(round_span)
    return next((v for v in views if need <= v), None)


class Decoder:
    """Prepared decoding for one target (and optionally one drafter + γ).

    Holds compiled programs keyed by shape bucket; reuse one Decoder across calls
    so prompts of the same bucket never recompile.

    ``mesh``: a ``jax.sharding.Mesh`` with axes ``data``/``model``, a
    :class:`specjax.runtime.sharding.MeshSpec` or ``"data=D,model=M"``; by default the mesh the
    target's parameters are already sharded on (``specjax.io.loading.load_model(..., mesh=)``), else one device.
    On a mesh, parameters (target and drafter, each by its own config), caches and rows
    are sharded (:mod:`specjax.runtime.sharding`); a batch is padded to a multiple of ``data``.

    ``progress``: a :class:`specjax.runtime.progress.Progress` that gets one stderr line per compile
    phase (the command line passes one), or ``None`` (silent).

    ``prompt_bucket``: the smallest padded prompt length in tokens (an integer ≥ 1; default
    ``PROMPT_BUCKET``, 32). Prompts pad to the next power of two, at least this
    (:func:`prompt_bucket`); a larger value compiles fewer prompt shapes for more padding
    (e.g. 512 when prompts of many lengths are decoded).

    ``tree_nodes``, ``tree_depth``, ``tree_topk``: draft trees (all three, or none for chains of
    γ drafts): N nodes, depth D, at most K children per node (:class:`~specjax.core.drafting.TreeShape`;
    ``gamma`` is then ignored: D is the most drafts a round accepts). The drafter proposes a tree
    per round (``propose_tree``; one that proposes chains only: K = 1, its chain), one target call
    verifies all N nodes, and the accepted path is committed (:func:`specjax.runtime.loop._tree_round`).

    Raises:
      ValueError: ``gamma`` not an integer in [1, ``MAX_GAMMA``] (64) with a drafter, ``prompt_bucket`` not an
        integer ≥ 1, or a tree that is incomplete, out of range, without a drafter or with
        K > 1 for a drafter that proposes chains only.
      TypeError: a drafter that does not subclass :class:`specjax.core.drafting.Drafter`.
    """

    compiler_options: dict | None = None  # XLA options of every compile (``specjax plan``: fast CPU codegen)

    def __init__(self, target, drafter=None, gamma: int = 4, mesh=None, progress=None,
                 prompt_bucket: int = PROMPT_BUCKET, tree_nodes: int | None = None,
                 tree_depth: int | None = None, tree_topk: int | None = None):
        self.progress = progress
        self.tree = tree_shape(tree_nodes, tree_depth, tree_topk)
        require_drafter(drafter)
        check_tree_drafter(self.tree, drafter)
        if self.tree is not None:
            gamma = self.tree.depth
        if drafter is not None:
            check_gamma(gamma)
        if isinstance(prompt_bucket, bool) or int(prompt_bucket) != prompt_bucket or prompt_bucket < 1:
            raise ValueError(f"prompt_bucket must be an integer >= 1, got {prompt_bucket!r}")
        self.prompt_bucket = int(prompt_bucket)
        from specjax.runtime import sharding

        self.mesh, target, drafter = sharding.prepare_decoder(target, drafter, mesh)
        self.target = target
        self.drafter = drafter
        self.gamma = int(gamma) if drafter is not None else 0
        self._compiled: dict = {}

    # ---- compile (AOT, timed separately)
    @property
    def compiled(self) -> dict:
        """The programs this Decoder compiled: ``{key: executable}`` with key ``(which, program,
        argument tree structure, ((shape, dtype) per argument leaf))`` — ``which`` ``"start"`` (the
        prefill) or ``"run"`` (the decode loop), ``program`` its :class:`Program` — and the
        executable a ``jax.stages.Compiled`` or :class:`~specjax.runtime.programs.ExportedProgram`.
        ``len(dec.compiled)`` counts the programs compiled so far. Assignable: Decoders of one target
        shape given one dict share their executables (parameters are arguments), and ``{}`` drops them."""
        return self._compiled

    @compiled.setter
    def compiled(self, programs_by_key: dict) -> None:
        self._compiled = programs_by_key

    def _key(self, which, prog, args):
        return (which, prog, jax.tree_util.tree_structure(args),
                tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)))

    def compiled_program(self, which: str, prog: Program, args: tuple):
        """The executable of ``which`` (``"start"``: the prefill, called with :meth:`prepare`'s
        start args; ``"run"``: the decode loop, called with :meth:`run_args`) for ``prog`` and
        ``args`` (arrays or ``ShapeDtypeStruct`` s: only their shapes, dtypes and tree structure
        count), compiled ahead of time on first use and kept in :attr:`compiled`. Returns
        ``(executable, compile seconds)`` (0.0 when it was compiled already)."""
        key = self._key(which, prog, args)
        hit = self._compiled.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        fn = prefill_jit if which == "start" else run_rounds_jit
        compiled = None
        if self.mesh is None and self.compiler_options is None:  # a warm start skips tracing (when on)
            donate = (RUN_ROUNDS_DONATE - 1,) if which == "run" else ()
            compiled = programs.compile_program(fn, which, prog, args, donate)
        if compiled is None:
            if self.mesh is not None:
                from specjax.runtime import sharding

                fn = sharding.decode_jit(which, prog, args, self.mesh)
            compiled = fn.lower(prog, *args).compile(self.compiler_options)
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t0

    def context_limit(self) -> int:
        """The tokens a row may hold (:func:`~specjax.core.drafting.row_context`)."""
        return row_context(self.target.config.max_position_embeddings, self.drafter)

    @property
    def cache_dtype(self) -> str:
        """The target's KV-cache dtype in this Decoder's programs (``"float32"`` or ``"bfloat16"``;
        :func:`specjax.models.llama.kv_cache_dtype` of the target's weight format)."""
        return kv_cache_dtype(self.target.dtype)

    def _spare(self) -> int:
        """Buffer slots a round writes beyond the committed tokens (γ, a tree's scratch, or the
        drafter's own writes when it declares more)."""
        spare = self.gamma if self.tree is None else tree_scratch(self.tree)
        if self.drafter is not None:
            spare = max(spare, self.drafter.scratch_slots(self.gamma, self.tree))
        return spare

    def _program(self, prompt_len: int, max_new_tokens: int, logprobs: int | None) -> Program:
        """The Program for prompts of up to ``prompt_len`` tokens and rows of up to
        ``max_new_tokens`` new tokens (already capped to the context)."""
        buf = decode_buffer_len(int(prompt_len), int(max_new_tokens), self._spare(), self.prompt_bucket)
        return self._with_buffer(buf, logprobs)

    def _with_buffer(self, buffer_len: int, logprobs: int | None) -> Program:
        return Program(self.target.config, self.target.graphdef, self.drafter, self.gamma, buffer_len,
                       self.cache_dtype, -1 if logprobs is None else int(logprobs), self.tree)

    def slot_program(self, context: int, logprobs: int | None = None) -> Program:
        """The Program whose buffer holds any row of at most ``context`` tokens (prompt + new):
        the largest prompt bucket below it, or ``context`` itself, plus the spare slots a round
        writes, rounded up to ``BUFFER_BUCKET`` (:mod:`specjax.runtime.engine`'s slots)."""
        room = max(prompt_bucket(int(context) - 1, self.prompt_bucket), int(context))
        return self._with_buffer(round_up(room + self._spare() + 1, BUFFER_BUCKET), logprobs)

    def program(self, prompt_len: int, max_new_tokens: int = 128, logprobs: int | None = None) -> Program:
        """The decode :class:`Program` this Decoder runs for prompts of ``prompt_len`` tokens:
        its ``buffer_len`` (token/KV slots) and ``cache_dtype`` are what :meth:`prepare` builds
        (``max_new_tokens`` is capped to the context the same way). For measuring the
        programs that run (:mod:`specjax.eval.measure`) without decoding anything.

        Raises:
          ValueError: ``prompt_len < 1`` or not shorter than the context, ``max_new_tokens < 1``.
        """
        ctx_limit = self.context_limit()
        if not 1 <= int(prompt_len) < ctx_limit:
            raise ValueError(f"prompt_len must be in [1, {ctx_limit}) (the model's context), got {prompt_len!r}")
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        return self._program(int(prompt_len), min(int(max_new_tokens), ctx_limit - int(prompt_len)), logprobs)

    def prepare(self, prompts, *, max_new_tokens=128, sampling: SamplingParams | None = None,
                seed=0, keys=None, eos_ids=None, seed_offset: int = 0, stop_token_ids=None,
                logprobs: int | None = None):
        """Validate and bucket a batch; returns ``(program, start args)``.

        ``eos_ids``: ids that end a row (default the model's EOS ids; ``[]`` ignores EOS).
        ``stop_token_ids``: more ids that end a row (``finish_reason`` ``"stop"``): one list
        for every row or one list per row. ``logprobs``: ``None`` (off) or N ≥ 0 top
        alternatives recorded per emitted token (:class:`Logprobs`)."""
        cfg = self.target.config
        ctx_limit = self.context_limit()
        validate_batch(prompts, max_new_tokens, self.gamma or 1, self.drafter, ctx_limit, cfg.vocab_size)
        if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) != logprobs
                                     or not 0 <= logprobs <= cfg.vocab_size):
            raise ValueError(f"logprobs must be None or an integer in [0, {cfg.vocab_size}], got {logprobs!r}")
        b = len(prompts)
        plens = np.array([len(p) for p in prompts], np.int32)
        mn = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (b,))
        mn = np.minimum(mn, ctx_limit - plens).astype(np.int32)  # the context limit, per row
        p_bucket = prompt_bucket(int(plens.max()), self.prompt_bucket)
        shared = shared_prompts(prompts) if self.mesh is None else None  # (a mesh shards rows: no sharing)
        rows = prompts if shared is None else shared[0]
        prompt = np.zeros((len(rows), p_bucket), np.int32)
        for i, p in enumerate(rows):
            prompt[i, : len(p)] = p
        if sampling is None:
            sampling = SamplingParams.create(b)
        elif not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams (SamplingParams.create({b}, temperature=...)), got "
                             f"{type(sampling).__name__}")
        elif sampling.batch != b:  # before anything is traced (JAX's message would be about cond branches)
            raise ValueError(f"sampling has {sampling.batch} rows but {b} prompt{'s are' if b != 1 else ' is'} given; "
                             f"create it with one row per prompt: SamplingParams.create({b}, ...) (or "
                             "SamplingParams.from_rows with one Sampling per prompt)")
        sampling.with_vocab(cfg.vocab_size)
        if keys is None:
            keys = request_keys(seed, b, seed_offset)
        eos_arr = stop_ids_array(list(cfg.eos_token_ids if eos_ids is None else eos_ids), stop_token_ids, b,
                                  cfg.vocab_size)
        prog = self._program(int(plens.max()), int(mn.max()), logprobs)
        dparams = None if self.drafter is None else self.drafter.params
        # device_put, not jnp.asarray: the latter compiles a copy program for every new host array shape
        # (JAX's `stage`), i.e. at each new batch or bucket
        put = jax.device_put
        args = (self.target.params, dparams, put(prompt), put(plens), put(mn), put(eos_arr), put(keys), sampling)
        if shared is not None:
            args += ((put(shared[1]), put(shared[2])),)
        if self.mesh is not None:  # rows on `data` (padded to a multiple of it)
            from specjax.runtime import sharding

            args = sharding.shard_start_args(args, self.mesh)
        return prog, args

    def start(self, prompts, **kw):
        """Prefill: returns ``(program, state, compile_s, prefill_s)``.

        Compiles (once per shape bucket) the prefill AND the decode loop before the prefill
        runs, as one ``progress`` phase (the decode loop's input shapes come from the compiled
        prefill's output, :meth:`run_shapes`), so a later :meth:`run` never compiles; the
        prefill is a phase of its own after it (both lines only when something was compiled).
        The prefill does not depend on γ: off a mesh it is compiled once per (drafter, shape
        bucket) for every γ (:func:`prefill_program`), and the γ-shaped parts of the state are
        sized afterwards (:func:`size_for_gamma`)."""
        prog, args = self.prepare(prompts, **kw)
        sprog = prog if self.mesh is not None else prefill_program(prog)
        known = self._compiled.get(self._key("start", sprog, args))
        fresh = known is None or self._key("run", prog, self.run_args(self.run_shapes(known, sprog, prog), 0)) \
            not in self._compiled
        what = "prefill + decode loop"
        if prog.tree is not None:
            what += f" ({prog.tree.label})"
        elif prog.drafter is not None:
            what += f" (γ = {prog.gamma})"
        p = args[2].shape[1]
        with phase(self.progress if fresh else None,
                   f"compiling {what} for prompts of ≤ {p} tokens "
                   "(once per length bucket; the on-disk cache makes the next run faster)"):
            fn, c = self.compiled_program("start", sprog, args)
            _, c2 = self.compiled_program("run", prog, self.run_args(self.run_shapes(fn, sprog, prog), 0))
        rows = len(prompts)
        with phase(self.progress if fresh else None,
                   f"prefill of {rows} prompt{'s' if rows != 1 else ''} ({p}-token bucket)"):
            t0 = time.perf_counter()
            st = fn(*args)
            if sprog is not prog:
                st = size_for_gamma(st, prog)
            st = jax.block_until_ready(st)
            prefill_s = time.perf_counter() - t0
        return prog, st, c + c2, prefill_s

    @staticmethod
    def run_shapes(compiled_start, sprog: Program, prog: Program):
        """The state :meth:`start` gives to the decode loop of ``prog``, as shapes: a
        :class:`~specjax.runtime.loop.DecodeState` of ``jax.ShapeDtypeStruct`` s with shardings
        (``tokens [B, L]`` int32, ``target_cache`` …, ``L = prog.buffer_len``): the output of
        ``compiled_start``, the prefill compiled for ``sprog`` (:meth:`compiled_program`), with
        :func:`size_for_gamma` applied when ``sprog`` is the normalized program
        (:func:`prefill_program`) rather than ``prog``. Nothing runs."""
        info = compiled_start.out_info
        return info if sprog is prog else jax.eval_shape(lambda s: size_for_gamma(s, prog), info)

    def run_args(self, st, round_limit) -> tuple:
        """The decode loop's arguments for state ``st`` (a :class:`~specjax.runtime.loop.DecodeState`
        of arrays, or of shapes from :meth:`run_shapes`): ``(target params, drafter params or None,
        st, round_limit)`` with ``round_limit`` an int32 scalar (rounds to run up to, counted in
        ``st.round``), replicated over the mesh when there is one."""
        dparams = None if self.drafter is None else self.drafter.params
        args = (self.target.params, dparams, st, jnp.int32(round_limit))
        if self.mesh is not None:
            from specjax.runtime import sharding

            args = (*args[:3], sharding.put_replicated(args[3], self.mesh))
        return args

    def run(self, prog, st, round_limit):
        """Run rounds until done or ``round_limit``; returns ``(state, compile_s, seconds)``.

        A buffer of at least ``2 · KV_VIEW_MIN`` slots runs through a ladder of attention views
        (:func:`attention_views`: none where the attention is the CPU kernel, which reads only the rows'
        keys anyway): each stretch of rounds runs the program whose target attends over the
        smallest view that holds the running rows' next round (``Program.kv_view``; the same
        tokens, :func:`specjax.models.llama.decoder_block`), so a round costs what the live rows
        need, not the whole buffer; one host read of the lengths per view (at most
        log2(buffer / ``KV_VIEW_MIN``) + 1 programs per buffer bucket, each compiled when first needed)."""
        views = attention_views(prog)
        compile_s = seconds = 0.0
        while True:
            p = prog
            if views:
                hv = self._host(st)
                lengths, done = np.asarray(hv.lengths), np.asarray(hv.done)
                v = view_for(views, int(np.max(np.where(done, 1, lengths))), prog.round_span)
                p = prog if v is None else dataclasses.replace(prog, kv_view=v)
            args = self.run_args(st, round_limit)
            fn, c = self.compiled_program("run", p, args)
            t0 = time.perf_counter()
            st = jax.block_until_ready(fn(*args))
            compile_s, seconds = compile_s + c, seconds + time.perf_counter() - t0
            if p is prog:
                return st, compile_s, seconds
            hv = self._host(st)
            if bool(np.all(np.asarray(hv.done))) or int(hv.round) >= int(round_limit):
                return st, compile_s, seconds

    def _host(self, st):
        if self.mesh is None:
            return st
        from specjax.runtime.sharding import host_view

        return host_view(st)

    def generate(self, prompts: Sequence[Sequence[int]], *, stop_fn=None, on_chunk=None,
                 rounds_per_chunk: int = 8, **kw) -> GenerationResult:
        """Decode a batch of token-id prompts to completion (see :func:`generate`).

        ``stop_fn(row, new_tokens) -> int | None``: called after each chunk of
        ``rounds_per_chunk`` rounds with a row's new tokens so far; an int k ends the row
        with its first k new tokens (``finish_reason`` ``"stop"``; nothing after them is
        emitted or counted). ``on_chunk(new_tokens_per_row)``: called after each chunk with
        each row's newly committed tokens (cut where ``stop_fn`` ended a row). Without either,
        the loop runs in one call (no host sync until the end)."""
        eos = self.target.config.eos_token_ids if kw.get("eos_ids") is None else kw["eos_ids"]
        if stop_fn is None and on_chunk is None:
            prog, st, c, prefill_s = self.start(prompts, **kw)
            st, c2, decode_s = self.run(prog, st, np.iinfo(np.int32).max)
            return self._finish(st, len(prompts), c + c2, prefill_s, decode_s, {}, eos)
        check_rounds_per_chunk(rounds_per_chunk)
        prog, st, c, prefill_s = self.start(prompts, **kw)
        decode_s, cuts = 0.0, {}
        for st, newly, dt in self._chunks(prog, st, len(prompts), rounds_per_chunk, stop_fn, cuts):
            decode_s += dt
            if on_chunk is not None:
                on_chunk(newly)
        return self._finish(st, len(prompts), c, prefill_s, decode_s, cuts, eos)

    def _chunks(self, prog, st, rows: int, rounds_per_chunk: int, stop_fn=None, cuts=None):
        """Run ``rounds_per_chunk`` rounds at a time (the first chunk at most
        :data:`FIRST_CHUNK_ROUNDS`: a streamed text starts one round after the prefill) until every row is done; yield
        ``(state, newly committed tokens per row, seconds)`` after each chunk. ``stop_fn`` (see
        :meth:`generate`) may end a row at k new tokens: ``cuts[row] = k`` is recorded, its
        tokens after k are never yielded, and the row is marked done on the device."""
        cuts = {} if cuts is None else cuts
        hv = self._host(st)
        seen = np.asarray(hv.lengths).copy()
        plen = np.asarray(hv.prompt_lengths)
        rounds = min(rounds_per_chunk, FIRST_CHUNK_ROUNDS)  # the first text soon after the prefill
        while True:
            st, _, dt = self.run(prog, st, int(hv.round) + rounds)
            rounds = rounds_per_chunk
            hv = self._host(st)
            lengths, toks = np.asarray(hv.lengths), np.asarray(hv.tokens)
            newly, stopped = [], []
            for i in range(rows):
                end = int(lengths[i]) if i not in cuts else int(seen[i])
                if stop_fn is not None and i not in cuts and end > seen[i]:
                    k = stop_fn(i, toks[i, plen[i]: end].tolist())
                    if k is not None:
                        cuts[i] = int(k)
                        end = min(end, int(plen[i]) + int(k))
                        stopped.append(i)
                newly.append(toks[i, seen[i]: end].tolist())
                seen[i] = max(int(seen[i]), end)
            done = np.asarray(hv.done).copy()
            done[list(cuts)] = True
            if stopped and not np.all(done):  # end those rows on the device too
                mask = np.zeros(np.shape(hv.done), bool)
                mask[stopped] = True
                st = dataclasses.replace(st, done=st.done | jax.device_put(mask, st.done.sharding))
            yield st, newly, dt
            if bool(np.all(done[:rows])):
                return

    def _finish(self, st, n_rows, compile_s, prefill_s, decode_s, cuts, eos) -> GenerationResult:
        res = host_result(self._host(st), compile_s, prefill_s, decode_s, cuts=cuts, model_eos=eos)
        lp = None if res.logprobs is None else res.logprobs[:n_rows]
        return dataclasses.replace(res, tokens=res.tokens[:n_rows], stats=res.stats[:n_rows], logprobs=lp)

    def stream(self, prompts, rounds_per_chunk: int = 8, **kw) -> Iterator[list[list[int]]]:
        """Yield, per chunk of ``rounds_per_chunk`` rounds (the first of at most
        :data:`FIRST_CHUNK_ROUNDS`), each row's newly committed tokens (one host sync per chunk,
        not per token).

        Raises:
          ValueError: ``rounds_per_chunk`` is not an integer >= 1 (0 would loop forever).
        """
        check_rounds_per_chunk(rounds_per_chunk)
        prog, st, _, _ = self.start(prompts, **kw)
        for _, newly, _ in self._chunks(prog, st, len(prompts), rounds_per_chunk):
            yield newly


def generate(target, prompts, *, drafter=None, gamma: int = 4, tree_nodes=None, tree_depth=None, tree_topk=None,
             **kw) -> GenerationResult:
    """Decode token-id prompts with ``target``; speculative when ``drafter`` is given.

    Args:
      target: a loaded :class:`~specjax.io.loading.Model`.
      prompts: list of B token-id lists (different lengths allowed).
      drafter: ``None`` (autoregressive) or a drafter (:mod:`specjax.drafters`).
      gamma: draft tokens per round γ (``num_draft_tokens``), ≥ 1.
      tree_nodes, tree_depth, tree_topk: draft trees instead of chains (see :class:`Decoder`).
      max_new_tokens: int or ``[B]`` ints ≥ 1 (clipped per row to the context).
      sampling: :class:`SamplingParams` (default greedy).
      seed / keys: request keys (see :func:`request_keys`).
      eos_ids: stop ids (default: the model's EOS ids); ``[]`` to ignore EOS.

    Raises:
      ValueError: empty prompt list or prompt, prompt longer than the context,
        ``max_new_tokens < 1``, ``gamma < 1``.
    """
    return Decoder(target, drafter, gamma, tree_nodes=tree_nodes, tree_depth=tree_depth,
                   tree_topk=tree_topk).generate(prompts, **kw)


def speculative_generate(target, drafter, prompts, *, gamma: int = 4, **kw) -> GenerationResult:
    """Speculative decoding (Leviathan et al. 2023, Algorithm 1): ``generate`` with a drafter."""
    if drafter is None:
        raise ValueError("speculative_generate needs a drafter; use generate() for plain decoding")
    return Decoder(target, drafter, gamma).generate(prompts, **kw)
