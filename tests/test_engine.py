"""Continuous batching (:mod:`specjax.runtime.engine`, issue 31): requests admitted into free slots
of a running batch return exactly what ``Decoder.generate`` returns for them alone (greedy and
seeded sampling, chains, trees, a feature-level drafter, log-probabilities), cancellation frees
slots, bad requests are refused in one line, and nothing recompiles per request. Tiny models."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_model
from specjax.core.sampling import Sampling, SamplingParams
from specjax.drafters import eagle
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.io.loading import truncate_model
from specjax.runtime import engine as engine_mod
from specjax.runtime import engine_rows
from specjax.runtime import decoder as decoder_mod
from specjax.runtime.decoder import Decoder, request_keys
from specjax.runtime.engine import Engine, EngineRequest

_M: dict = {}


def _model():
    if "m" not in _M:
        _M["m"] = tiny_model(seed=1, scale=4.0)
    return _M["m"]


def _eagle(target):
    cfg = eagle.EagleConfig.for_target(target.config, 64, 48, copy_ngram=3, feature_layers=(0, 1))
    tp = eagle.init_params(cfg, 7)
    tp["copy_b"] = tp["copy_b"] + 8.0  # copy where prompt lookup finds a candidate: drafts get accepted
    sub = np.arange(0, 128, 2, dtype=np.int32)
    return eagle.EagleDrafter(cfg, {"train": tp, "frozen": eagle.frozen_params(target, sub)}, name="eagle3")


def _decoder(setup):
    m = _model()
    if setup == "ar":
        return Decoder(m)
    if setup == "ngram":
        return Decoder(m, NgramDrafter(3), gamma=3)
    if setup == "model":
        return Decoder(m, ModelDrafter.from_model(truncate_model(m, 1), name="first1"), gamma=3)
    return Decoder(m, _eagle(m), tree_nodes=6, tree_depth=3, tree_topk=2)


def _requests(n=7, seed=0):
    """Mixed prompts (3..30 tokens: one prompt bucket), greedy and seeded sampling, mixed lengths,
    one with log-probabilities, one with speculation off (greedy)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(2, 128, size=int(rng.integers(3, 30))).tolist()
        if i % 3 == 2:  # repeat a stretch: the n-gram and copy drafters find matches
            prompt = prompt + prompt[:8]
        sampling = Sampling() if i % 2 == 0 else Sampling(temperature=0.8, top_k=20, top_p=0.95)
        out.append(EngineRequest(prompt, max_new_tokens=int(rng.choice([8, 16, 24])), sampling=sampling,
                                 seed=1000 + i, logprobs=3 if i == 3 else None, speculative=i != 4))
    return out


def _serve(eng, reqs, arrive_every=2, cancel=()):
    """Submit the first two requests, then one every ``arrive_every`` steps; cancel request j (by
    index) at step ``s`` for ``(j, s)`` in ``cancel`` (``s = "queued"``: as soon as it is submitted). Returns ``{index: (tokens, final Update,
    logprobs)}``."""
    ids, out, k, steps = {}, {}, 0, 0
    cancel = dict(cancel)
    while k < len(reqs) or not eng.idle:
        if k < 2 or (k < len(reqs) and steps % arrive_every == 1):
            ids[eng.submit(reqs[k])] = k
            k += 1
        for j, s in list(cancel.items()):
            if j < k and (s == steps or s == "queued"):  # "queued": cancelled before any step admits it
                eng.cancel(next(r for r, i in ids.items() if i == j))
                del cancel[j]
        for u in eng.step():
            j = ids[u.request_id]
            toks, _, lps = out.get(j, ([], None, []))
            out[j] = (toks + u.tokens, u if u.finish_reason else None, lps + (u.logprobs or []))
        steps += 1
        assert steps < 500
    return out


def _alone(dec, r):
    return dec.generate([list(r.prompt)], max_new_tokens=r.max_new_tokens, keys=request_keys(r.seed, 1),
                        sampling=SamplingParams.from_rows([r.sampling]), logprobs=r.logprobs)


@pytest.fixture
def blocked_attention(monkeypatch):
    """The blocked jnp attention (``SPECJAX_ATTENTION=xla``: meshes, GPU/TPU), which reads the cache it
    is given, so the decode loop steps through attention views (on one CPU the kernel reads each row's
    keys and needs none: ``decoder.attention_views``). Programs traced before or after with the kernel
    are dropped (``jax.clear_caches``), so no other test runs a program traced here."""
    monkeypatch.setenv("SPECJAX_ATTENTION", "xla")
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("setup", ["ar", "ngram", "model", "eagle3-tree"])
def test_requests_in_slots_equal_their_alone_runs(setup, monkeypatch, request):
    """3 slots, 7 requests arriving while others run (with the row ladder, ar and eagle3-tree: chunks on
    1, 2 and 3 rows, requests moved down to the lowest slots as others finish; the other tests run every
    chunk on all slots, fewer programs to compile): every request's tokens, finish reason and
    counters equal ``Decoder.generate`` of it alone with ``request_keys(seed, 1)`` (greedy and
    sampled; a row's draws use its own round numbers, not the batch's); log-probabilities equal.
    The slots hold 320 tokens; with the blocked attention (the n-gram setup) they attend through views
    of 64 and 128 slots (``KV_VIEW_MIN`` 64), as a served context of thousands would through views of
    256, 512, ... on a mesh or an accelerator."""
    if setup == "ngram":
        request.getfixturevalue("blocked_attention")
    monkeypatch.setattr(decoder_mod, "KV_VIEW_MIN", 64)
    dec = _decoder(setup)
    ladder = setup in ("ar", "eagle3-tree")  # the row ladder here (its programs cost compile time: two setups)
    eng = Engine(dec, slots=3, max_context=300, rounds_per_chunk=2, max_logprobs=4, ladder=ladder)
    reqs = _requests()
    out = _serve(eng, reqs)
    assert sorted(out) == list(range(len(reqs)))
    accepted = drafted = 0
    for j, r in enumerate(reqs):
        toks, fin, lps = out[j]
        assert fin is not None and fin.seed == r.seed
        if not r.speculative:  # greedy with no drafts offered: the target's own tokens, nothing drafted
            assert toks == _alone(dec, r).tokens[0], j
            assert fin.stats.drafted_tokens == 0 and fin.stats.target_calls == len(toks)
            continue
        ref = _alone(dec, r)
        assert toks == ref.tokens[0], (setup, j)
        assert fin.finish_reason == ref.stats[0].finish_reason
        assert dict(fin.stats) == dict(ref.stats[0]), (setup, j)
        accepted += fin.stats.accepted_tokens
        drafted += fin.stats.drafted_tokens
        if r.logprobs is not None:
            assert [x["id"] for x in lps] == toks
            np.testing.assert_allclose([x["logprob"] for x in lps], [x["logprob"] for x in ref.logprobs[0]],
                                       atol=1e-5)
            assert [[i for i, _ in x["top"]] for x in lps] == [[i for i, _ in x["top"]] for x in ref.logprobs[0]]
    if setup != "ar":  # speculation happened: drafts verified (and, but for the n-gram drafter on random text, accepted)
        assert drafted > 0 and (accepted > 0 or setup == "ngram"), (drafted, accepted)
    # chunks ran on 1, 2 and 3 rows (the ladder), and requests were moved down to the lowest slots
    if ladder:
        assert eng.ladder == (1, 2, 3) and {1, 2} <= set(eng.chunks_by_rows), eng.chunks_by_rows
        assert eng.rows_moved > 0
    else:
        assert set(eng.chunks_by_rows) == {3} and eng.rows_moved == 0


def test_cancellation_frees_the_slot_and_nothing_recompiles():
    """Cancelling a running and a queued request ends both ("cancelled") and frees the slot for
    the next; the others still equal their alone runs; after the first requests of a prompt
    bucket, further requests compile nothing (insertion, chunk program)."""
    dec = _decoder("ngram")
    eng = Engine(dec, slots=2, max_context=160, rounds_per_chunk=2, max_logprobs=4, ladder=False)
    eng.warmup()
    reqs = _requests(6, seed=3)
    _serve(eng, reqs[:2])  # the prompt bucket's prefill compiled
    sizes = (engine_rows.compiled_programs("insert_row"), len(dec.compiled))
    out = _serve(eng, reqs, cancel=[(0, 1), (5, "queued")])
    assert (engine_rows.compiled_programs("insert_row"), len(dec.compiled)) == sizes
    assert out[0][1].finish_reason == "cancelled" and out[5][1].finish_reason == "cancelled"
    assert 0 < len(out[0][0]) < reqs[0].max_new_tokens and out[5][0] == [] and out[5][1].stats is None
    for j in (1, 2, 3):
        assert out[j][0] == _alone(dec, reqs[j]).tokens[0]
    assert eng.idle and eng.running == 0 and eng.queued == 0


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[5] * 160), "shorten the prompt"),
    (dict(prompt=[1, 999]), "token ids must be integers in"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(sampling=0.7), "sampling must be a specjax Sampling"),
    (dict(logprobs=5), "logprobs must be an integer in [0, 4]"),
    (dict(stop_token_ids=list(range(20))), "stop token ids per request"),
    (dict(seed=-1), "seed must be an integer"),
])
def test_bad_requests_are_refused_in_one_line(bad, message):
    eng = Engine(_decoder("ar"), slots=2, max_context=160, max_logprobs=4, ladder=False)
    kw = dict(prompt=[3, 4, 5], max_new_tokens=4)
    kw.update(bad)
    with pytest.raises(ValueError, match=None) as e:
        eng.submit(EngineRequest(**kw))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert eng.idle


def test_engine_arguments_are_checked():
    dec = _decoder("ar")
    for kw, msg in [(dict(slots=0), "slots"), (dict(max_context=10 ** 6), "max_context"),
                    (dict(rounds_per_chunk=0), "rounds_per_chunk"), (dict(max_logprobs=-1), "max_logprobs")]:
        with pytest.raises(ValueError, match=msg):
            Engine(dec, **kw, ladder=False)


@pytest.mark.parametrize("setup", ["model", "eagle3-tree"])
def test_speculation_under_load_keeps_every_guarantee(setup):
    """``spec_max_running=0``: while only greedy requests run, chunks run the ``plain`` program
    (one-token target calls, the drafter idle) on the same state, between speculative chunks
    (chain and tree states); sampled requests keep speculating and still equal ``generate --seed``
    alone; greedy requests equal their alone runs whichever program committed their tokens."""
    dec = _decoder(setup)
    eng = Engine(dec, slots=3, max_context=160, rounds_per_chunk=2, max_logprobs=4, spec_max_running=0, ladder=False)
    reqs = _requests(6, seed=5)
    out = _serve(eng, reqs)
    skipped = 0  # draft calls that plain rounds saved
    for j, r in enumerate(reqs):
        toks, fin, lps = out[j]
        assert toks == _alone(dec, r).tokens[0], j
        skipped += fin.stats.target_calls - fin.stats.draft_calls
        if r.sampling.temperature > 0 and r.speculative:
            assert fin.stats.draft_calls == fin.stats.target_calls and fin.stats.drafted_tokens > 0, j
        if r.logprobs is not None:
            assert [x["id"] for x in lps] == toks
    plain = {k[1].plain for k in dec.compiled if k[0] == "run"}
    assert plain == {False, True} and skipped > 0, (plain, skipped)  # both programs ran


def test_plain_rounds_give_the_speculative_rounds_tokens():
    """A request alone with ``speculative: false`` runs only plain chunks (no draft call, one target
    call per token) and gets the tokens of the same request in the speculative program with no
    drafts offered (the same per-round key, the same one-token logits): greedy and seeded sampling."""
    dec = _decoder("model")
    reqs = [EngineRequest(list(range(3, 20)), max_new_tokens=12, seed=7, speculative=False,
                          sampling=s) for s in (Sampling(), Sampling(temperature=0.9, top_k=30))]
    for r in reqs:
        eng = Engine(dec, slots=2, max_context=160, rounds_per_chunk=3, max_logprobs=None, ladder=False)
        eng.submit(r)
        ups = [u for _ in range(20) for u in eng.step()]
        toks, fin = [t for u in ups for t in u.tokens], ups[-1]
        mixed = Engine(dec, slots=2, max_context=160, rounds_per_chunk=3, max_logprobs=None, ladder=False)
        other = EngineRequest(list(range(30, 40)), max_new_tokens=12, seed=1)  # speculates: the chunks are not plain
        out = _serve(mixed, [r, other])
        assert fin.stats.draft_calls == 0 and fin.stats.target_calls == len(toks) == 12
        assert toks == out[0][0] and out[0][1].stats.drafted_tokens == 0


class _NoAbsorb(eagle.EagleDrafter):
    """The negative control: a drafter that keeps nothing of plain rounds (the holes of turn 23)."""

    def absorb(self, params, state, context):
        return state

    def _key(self):
        return super()._key() + ("no-absorb",)


@pytest.mark.parametrize("kind, tree", [("eagle3", False), ("eagle3", True), ("published-head", False)],
                         ids=["chain", "tree", "published-head"])
def test_plain_rounds_leave_no_holes_in_the_drafters_cache(kind, tree, tmp_path):
    """Plain rounds (the engine's one-token target calls, no drafter call) record their features
    and the next speculative round encodes them (:meth:`EagleDrafter.absorb`): after a stretch of
    plain rounds between speculative ones, the drafter's K/V at every committed position equal
    those of a run that speculated every round (greedy: the same tokens; float32 tolerance, the
    features come from one-token vs verification calls). The negative control, a drafter that keeps
    nothing, differs there. The published-head layout (position t at slot t − 1) too."""
    import dataclasses

    if kind == "eagle3":
        m = _model()
        base = _eagle(m)
    else:
        from specjax.api import load_drafter
        from test_eagle3_published import head_target, write_head

        m = head_target(scale=4.0)
        base = load_drafter(write_head(tmp_path / "head", m, seed=1)[0], m)
    prompt = np.random.default_rng(3).integers(2, 128, size=21).tolist()

    def decode(drafter, schedule):
        dec = Decoder(m, drafter, gamma=3) if not tree else Decoder(m, drafter, tree_nodes=6, tree_depth=3, tree_topk=2)
        prog, st, _, _ = dec.start([prompt], max_new_tokens=60, eos_ids=[])
        for plain, n in schedule:
            p = dataclasses.replace(prog, plain=True) if plain else prog
            st, _, _ = dec.run(p, st, int(st.round) + n)
        return st

    def kv(st):
        return np.asarray(st.drafter_state["cache"].k[0])[0], np.asarray(st.drafter_state["cache"].v[0])[0]

    ref = decode(base, [(False, 100)])
    mixed = decode(base, [(False, 2), (True, 9), (False, 2), (True, 5), (False, 100)])
    no_absorb = type("NoAbsorb", (_NoAbsorb, type(base)), {})
    holes = decode(no_absorb(base.config, base.params, name=base.name), [(False, 2), (True, 9), (False, 100)])
    for st in (mixed, holes):
        assert np.array_equal(np.asarray(st.tokens), np.asarray(ref.tokens))  # greedy: the same tokens
    end = int(min(np.asarray(s.lengths)[0] - np.asarray(s.last_accepted)[0] - 1 for s in (ref, mixed, holes)))
    assert end > len(prompt) + 20
    for a, b in zip(kv(ref), kv(mixed)):
        np.testing.assert_allclose(a[:, 1:end], b[:, 1:end], atol=2e-4)
    gap = max(float(np.abs(a[:, 1:end] - b[:, 1:end]).max()) for a, b in zip(kv(ref), kv(holes)))
    assert gap > 1e-2, gap


@pytest.mark.parametrize("fmt, setup", [("int8", "ngram"), ("float32", "eagle3-tree")])
def test_attention_views_give_the_full_buffers_tokens(fmt, setup, monkeypatch, blocked_attention):
    """``Decoder.run``'s ladder of attention views (issue 29: decode cost follows the live length) on the
    blocked attention: rows of 5, 40 and 90 prompt tokens decoding 150 new tokens through views of 64
    and 128 slots, then the whole buffer, give exactly the tokens of the whole buffer from the start."""
    from specjax.io.loading import convert_model

    m = _model() if fmt == "float32" else convert_model(_model(), fmt)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 128, size=n).tolist() for n in (5, 40, 90)]

    def run(view_min):
        monkeypatch.setattr(decoder_mod, "KV_VIEW_MIN", view_min)
        dec = Decoder(m, NgramDrafter(3), gamma=3) if setup == "ngram" else \
            Decoder(m, _eagle(m), tree_nodes=6, tree_depth=3, tree_topk=2)
        res = dec.generate(prompts, max_new_tokens=150, eos_ids=[])
        return res, sorted(k[1].kv_view or 0 for k in dec.compiled if k[0] == "run")

    full, views_full = run(10 ** 9)
    viewed, views = run(64)
    assert views_full == [0] and views == [0, 128]  # the 90-token row starts beyond 64 slots
    assert viewed.tokens == full.tokens
    assert [dict(s) for s in viewed.stats] == [dict(s) for s in full.stats]


def test_no_attention_views_where_the_kernel_reads_the_rows_keys(monkeypatch):
    """On one CPU device with the attention kernel, ``Decoder.run`` compiles no view programs (the
    kernel's cost follows each row's visible keys whatever the buffer; a view program would only be
    compiled, and a cut cache copied); elsewhere the ladder of views as above."""
    from specjax.models import attention

    monkeypatch.setattr(decoder_mod, "KV_VIEW_MIN", 64)
    m = _model()
    dec = Decoder(m, NgramDrafter(3), gamma=3)
    dec.generate([[5, 6, 7]], max_new_tokens=150, eos_ids=[])
    views = sorted(k[1].kv_view or 0 for k in dec.compiled if k[0] == "run")
    kernel = attention.reads_visible_keys_only("float32", m.config.head_dim)
    assert views == ([0] if kernel else [0, 64, 128]), (kernel, views)


@pytest.mark.parametrize("chunk,per_step", [(32, 1), (64, 3)])
def test_long_prompts_are_admitted_piece_by_piece(monkeypatch, chunk, per_step):
    """While requests run, a prompt longer than ADMIT_TOKENS is prefilled in pieces, one or three per
    engine step as the measured times allow (running rows wait at most that; here pieces of 16 and
    chunks of 32 or 64 tokens stand for the 64 and 512 of a real server; 64, a power-of-two number of
    attention blocks, reads only the key spans each chunk sees, 32 the whole buffer); an idle engine
    takes a whole chunk per step. Its tokens still
    equal its alone run, whose prefill is one call (prompts of one chunk or less: 45 tokens) or the
    chunks in one scan (70, 100), so the pieces give those calls' bits; and a request cancelled while
    its prompt is being prefilled frees its slot."""
    from specjax.runtime import prefill as prefill_mod

    for mod in (prefill_mod, engine_mod):
        monkeypatch.setattr(mod, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(engine_mod, "ADMIT_TOKENS", 16)
    if per_step > 1:  # the budget the measured times would give when a decode chunk takes 3 pieces' time
        real_budget = Engine.step_tokens
        monkeypatch.setattr(Engine, "step_tokens", lambda self: 16 * per_step if self._slots else real_budget(self))
    pieces = []
    real = engine_mod.prompt_piece_jit
    monkeypatch.setattr(engine_mod, "prompt_piece_jit", lambda *a: pieces.append(a[-1]) or real(*a))
    zeroed, real_zero = [], engine_mod.zero_jit
    monkeypatch.setattr(engine_mod, "zero_jit", lambda t: zeroed.append(1) or real_zero(t))
    m = tiny_model(seed=1, scale=4.0, max_position_embeddings=400 + chunk)  # its own programs (the chunk is traced)
    dec = Decoder(m, NgramDrafter(3), gamma=3)
    eng = Engine(dec, slots=2, max_context=200, rounds_per_chunk=2, max_logprobs=4, ladder=False)
    rng = np.random.default_rng(7)
    reqs = [EngineRequest(rng.integers(2, 128, size=n).tolist(), max_new_tokens=12, seed=50 + i,
                          sampling=Sampling() if i % 2 == 0 else Sampling(temperature=0.8))
            for i, n in enumerate((10, 70, 100, 45, 90))]
    out = _serve(eng, reqs[:4])
    for j, r in enumerate(reqs[:4]):
        assert out[j][0] == _alone(dec, r).tokens[0], j
    assert 16 in pieces  # prompts admitted in pieces while the others ran
    assert zeroed  # the second pieced admission reused the first's buffers (piece_inputs)
    rid = eng.submit(reqs[4])  # 90 tokens into an idle engine: whole chunks; cancelled after the first
    assert eng.step() == [] and eng.admitting is not None and eng.admitting.done == chunk
    eng.cancel(rid)
    assert [(u.request_id, u.finish_reason) for u in eng.step()] == [(rid, "cancelled")] and eng.idle


def test_auto_speculation_measures_both_programs_and_keeps_tokens():
    """``speculation="auto"``: greedy requests alone run chunks of both programs (the speculative
    one first, then a plain one to measure it, then the faster with probes of the other), every
    request equals its alone run, and the policy holds a measured rate for each program."""
    from specjax.runtime.spec_policy import PROBE_SPEC, PROBE_SPEC_MAX, AutoSpeculation, spec_probe_every

    dec = _decoder("model")
    eng = Engine(dec, slots=2, max_context=160, rounds_per_chunk=2, max_logprobs=None, speculation="auto", ladder=False)
    reqs = [EngineRequest(list(range(3 + i, 20 + i)), max_new_tokens=40, seed=i) for i in range(3)]
    out = _serve(eng, reqs)
    for j, r in enumerate(reqs):
        assert out[j][0] == _alone(dec, r).tokens[0], j
    auto = eng.auto
    assert auto.t_spec and auto.t_plain and set(auto.t_spec) == set(auto.t_plain)
    assert 1.0 <= auto.tau <= 1 + dec.gamma
    # the choice: τ / t_spec vs 1 / t_plain, the faster program with probes of the other
    a = AutoSpeculation(t_spec={None: 0.2}, t_plain={None: 0.1}, tau=1.5)  # plain: 10 vs 7.5 tokens/s
    every = spec_probe_every(0.2, 0.1, 1.5)  # a probe loses (0.2 − 0.15) / 0.1 = 0.5 plain rounds: 1 per 17 chunks
    assert every == 17
    picks = []
    for _ in range(2 * every):
        picks.append(a.plain(None))
        a.record(picks[-1], None, 0.4 if picks[-1] else 0.8, 4, 6, 4)  # the same costs and τ again
    assert picks.count(False) == 2 and all(picks[:every - 1])
    # close programs: probes every PROBE_SPEC chunks; a hopeless one: every PROBE_SPEC_MAX
    assert spec_probe_every(0.2, 0.1, 1.99) == PROBE_SPEC and spec_probe_every(1.0, 0.1, 1.0) == PROBE_SPEC_MAX
    from specjax.runtime.spec_policy import SPEC_MARGIN

    c = AutoSpeculation(t_spec={None: 0.2}, t_plain={None: 0.1}, tau=2.2)  # 11 vs 10 tokens/s: a near tie
    assert 2.2 / 0.2 < SPEC_MARGIN / 0.1 and c.plain(None)  # goes to plain chunks (speculation's other costs)
    b = AutoSpeculation(t_spec={None: 0.2}, t_plain={None: 0.1}, tau=2.5)  # speculation: 12.5 vs 10 tokens/s
    assert not b.plain(None) and not b.plain(256)  # another view: its speculative program is measured first,
    b.record(False, 256, 0.6, 4, 10, 4)
    assert b.plain(256)  # then its plain one
    with pytest.raises(ValueError, match="speculation must be one of"):
        Engine(dec, slots=2, max_context=160, speculation="sometimes")


def test_speculative_chunks_are_paced_to_plain_ones_only_while_a_request_waits():
    """Engine.chunk_rounds: rounds_per_chunk · t_plain / t_spec (at least 1, at most rounds_per_chunk)
    for a speculative chunk under auto while a request is queued or being admitted; rounds_per_chunk
    otherwise (plain chunks, nobody waiting, either cost unmeasured, no auto policy)."""
    import types

    from specjax.runtime.spec_policy import AutoSpeculation

    key = (8, 256)

    def fake(t_spec, t_plain, queue=(), admitting=None, auto=True):
        a = AutoSpeculation(t_spec=dict(t_spec), t_plain=dict(t_plain)) if auto else None
        return types.SimpleNamespace(rounds_per_chunk=4, auto=a, _queue=list(queue), admitting=admitting,
                                     view_key=lambda rows: key)

    rounds = Engine.chunk_rounds
    assert rounds(fake({key: 0.2}, {key: 0.1}, queue=[1]), False, 8) == 2  # 4 · 0.1 / 0.2
    assert rounds(fake({key: 0.2}, {key: 0.1}, admitting=object()), False, 8) == 2
    assert rounds(fake({key: 1.0}, {key: 0.1}, queue=[1]), False, 8) == 1  # at least one round
    assert rounds(fake({key: 0.1}, {key: 0.3}, queue=[1]), False, 8) == 4  # never more than rounds_per_chunk
    assert rounds(fake({key: 0.2}, {key: 0.1}, queue=[1]), True, 8) == 4  # a plain chunk
    assert rounds(fake({key: 0.2}, {key: 0.1}), False, 8) == 4  # nobody waits
    assert rounds(fake({key: 0.2}, {}, queue=[1]), False, 8) == 4  # plain cost unmeasured
    assert rounds(fake({}, {}, queue=[1], auto=False), False, 8) == 4  # speculation="always"


def test_compaction_moves_only_the_moved_rows():
    """``move_rows``: row ``src[i]`` lands in row ``dst[i]`` for ``i < count`` (every per-row leaf:
    caches, keys, tokens), the source rows are marked done, every other row and the scalar round are
    untouched; pairs at or beyond ``count`` do nothing."""
    eng = Engine(_decoder("ar"), slots=4, max_context=64, max_logprobs=None)
    st = eng.ensure_state()
    # rows told apart: every per-row leaf of row r filled with r + 1 (bools: r odd)
    st = jax.tree_util.tree_map(
        lambda x: x if np.ndim(x) == 0 else jax.numpy.asarray(
            np.broadcast_to(((np.arange(x.shape[0]) % 2 == 1) if x.dtype == bool else np.arange(x.shape[0]) + 1)
                            .reshape((-1,) + (1,) * (x.ndim - 1)), x.shape).astype(x.dtype)), st)
    before = jax.tree_util.tree_map(np.asarray, st)
    src, dst = np.array([3, 2, 0, 0], np.int32), np.array([0, 1, 0, 0], np.int32)
    out = jax.tree_util.tree_map(np.asarray, engine_mod.move_rows(st, src, dst, np.int32(1)))
    expect_rows = [3, 1, 2, 3]  # only the first pair: row 3 into row 0
    for path, a in jax.tree_util.tree_flatten_with_path(out)[0]:
        b = dict(jax.tree_util.tree_flatten_with_path(before)[0])[path]
        if np.ndim(a) == 0:
            assert a == b, path
        elif jax.tree_util.keystr(path).endswith("done"):
            np.testing.assert_array_equal(a, [True, True, False, True])  # row 3 moved out: done
        else:
            np.testing.assert_array_equal(a, b[expect_rows], err_msg=jax.tree_util.keystr(path))
    none = jax.tree_util.tree_map(np.asarray, engine_mod.move_rows(st, src, dst, np.int32(0)))
    for a, b in zip(jax.tree_util.tree_leaves(none), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(a, b)


def test_auto_policy_ignores_chunk_times_that_ran_beside_an_admission():
    """``AutoSpeculation.record(timed=False)`` (a chunk whose seconds include an admission's
    programs): the seconds per round are taken only while that program is unmeasured; τ and the
    probe counters are updated either way."""
    from specjax.runtime.spec_policy import AutoSpeculation

    a = AutoSpeculation()
    a.record(True, None, 0.8, 4, 4, 4, timed=False)  # unmeasured: taken
    assert a.t_plain[None] == 0.2
    a.record(True, None, 4.0, 4, 4, 4, timed=False)  # measured: ignored
    assert a.t_plain[None] == 0.2 and a.since_spec == 2
    a.record(True, None, 0.4, 4, 4, 4)  # a clean chunk: taken (running mean)
    assert a.t_plain[None] == pytest.approx(0.7 * 0.2 + 0.3 * 0.1)
    a.record(False, None, 0.8, 4, 8, 4, timed=False)
    a.record(False, None, 8.0, 4, 12, 4, timed=False)
    assert a.t_spec[None] == 0.2 and a.tau == pytest.approx(0.7 * 2 + 0.3 * 3) and a.since_plain == 2


def test_an_admission_reuses_the_last_ones_buffers_zeroed_in_place():
    """``piece_inputs``: the last pieced admission's cache and hidden (``spare``) come back as
    zeros, in place (the spare's arrays are donated: a fresh cache of the buffer's size page-faults
    ≈ 100 MB in, 0.1-0.3 s of the step that starts the admission, BENCHMARKS.md turn 24); a hidden
    of another prompt bucket is not reused. Without a spare: a new zero cache."""
    eng = Engine(_decoder("ar"), slots=2, max_context=160, max_logprobs=None)
    _, cache, hidden = eng.piece_inputs([3] * 70)
    ones = lambda t: jax.tree_util.tree_map(lambda x: jax.numpy.ones_like(x), t)  # noqa: E731
    for bucket, reused_hidden in ((70, True), (20, False)):
        spare = (ones(cache), ones(hidden))
        eng.spare = spare
        arr, c2, h2 = eng.piece_inputs([3] * bucket)
        assert eng.spare is None
        assert all(not np.asarray(x).any() for x in jax.tree_util.tree_leaves((c2, h2)))
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(spare[0]))  # donated: the same memory
        assert spare[1].is_deleted() == reused_hidden and h2.shape == (1, arr.shape[1], hidden.shape[2])
        cache, hidden = c2, h2
