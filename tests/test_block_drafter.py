"""The block drafter (issue 28): one drafter pass per round, exact at any temperature.

* the decode call equals the packed training call (what training teaches is what decoding runs);
* exact enumeration (≤ 1e-6) of the whole first round's output with a real tiny block drafter on a
  real tiny target (γ 3, vocabulary 6, temperature 0.7, top-k 4, top-p 0.9), chain and tree: the round's emitted
  tokens, completed autoregressively to γ + 1 tokens, are distributed exactly as autoregressive
  decoding's first γ + 1 tokens. Negative controls that must fail it: the block positions drawn
  with ONE shared uniform (inverse CDF), and a q in the acceptance ratio that is not the q
  sampled from (the temperature-1 softmax without top-k/top-p);
* the drafter's own draws use independent noise per block position (chi-square of (x_1, x_2)
  against q_1 ⊗ q_2; a shared-noise drafter fails it);
* greedy speculative == greedy autoregressive (chain γ 1/3, tree, batch 1 and 4, every weight
  format of the drafter) on a tiny target.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_model
from stats_helpers import R_ACCEPT, R_REJECT, chi2_test

from specjax.core.acceptance import verify
from specjax.core.drafting import DraftContext, TreeShape
from specjax.core.sampling import SamplingParams
from specjax.drafters import block, block_net
from specjax.models import llama
from specjax.runtime.decoder import Decoder

V = 6
GAMMA = 3
PROMPT = (2, 5, 1, 3)
FEATURES = (0, 1)
SETTINGS = dict(temperature=0.7, top_k=4, top_p=0.9)

_verify = jax.jit(verify)


@functools.lru_cache(maxsize=None)
def tiny_block_pair():
    target = tiny_model(seed=3, scale=2.0, vocab_size=V)
    cfg = block_net.BlockConfig.for_target(target.config, num_layers=1, block_size=GAMMA, sub_vocab=V,
                                           intermediate_size=32, feature_layers=FEATURES)
    tp = block_net.init_params(cfg, 5)
    # sharper attention (the slots differ only by RoPE position) and a larger head scale: q_i peaked
    # (top-k/top-p cut the support) and unequal across the block's slots
    tp["layers"] = [dict(layer, w_qkv=layer["w_qkv"] * 20) for layer in tp["layers"]]
    tp["out_norm"] = tp["out_norm"] * 8
    drafter = block.make_drafter(cfg, tp, target, np.arange(V, dtype=np.int32))
    return target, drafter


def _sp(batch=1, **kw):
    return SamplingParams.create(batch, **(kw or SETTINGS))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _features_and_logits(graphdef, cfg, params, toks):
    b, s = toks.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    out = llama.apply(graphdef, params, toks, pos, llama.KVCache.create(cfg, b, s), cfg, return_hidden=True,
                      feature_layers=FEATURES)
    return out.hidden, out.logits


@functools.lru_cache(maxsize=None)
def target_p(ctx: tuple) -> np.ndarray:
    """The target's processed p after ``ctx`` (the loop's processor), float64 ``[V]``."""
    target, _ = tiny_block_pair()
    _, logits = _features_and_logits(target.graphdef, target.config, target.params, jnp.asarray([ctx], jnp.int32))
    return np.asarray(_sp().process(logits[:, -1]), np.float64)[0]


def drafter_q(ctx: tuple, gamma: int = GAMMA, temperature_one: bool = False) -> np.ndarray:
    """q_1..q_γ ``[γ, V]`` of the first round after a prefill of ``ctx``, made by the real drafter
    (``init_state`` + ``propose``); ``temperature_one``: the unprocessed softmax of the same logits."""
    target, d = tiny_block_pair()
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, jnp.asarray([ctx], jnp.int32))
    q, logits = _first_round(d, d.params, jnp.asarray([list(ctx) + [0] * (gamma + 2)], jnp.int32), feats, gamma)
    return np.asarray(jax.nn.softmax(logits, -1) if temperature_one else q, np.float64)[0]


@functools.partial(jax.jit, static_argnums=(0, 4))
def _first_round(d, params, toks, feats, gamma):  # params: an argument (a drafter hashes without them)
    n = feats.shape[1]
    sp = _sp()
    ctx0 = DraftContext(toks, jnp.asarray([n], jnp.int32), sp, feats, jnp.zeros((1,), jnp.int32))
    state = d.init_state(params, ctx0, toks.shape[1])
    ctx = DraftContext(toks, jnp.asarray([n], jnp.int32), sp,
                       jnp.zeros((1, gamma + 1, feats.shape[-1]), jnp.float32), jnp.zeros((1,), jnp.int32))
    logits, _ = d.block_logits(params, state, ctx, gamma)
    prop = d.propose(params, state, ctx, jax.random.split(jax.random.key(0), gamma)[None], gamma, V)
    return prop.probs, logits


def ar_joint(k: int) -> np.ndarray:
    out = np.zeros((V,) * k)
    for ys in itertools.product(range(V), repeat=k):
        prob = 1.0
        for i in range(k):
            prob *= target_p(PROMPT + ys[:i])[ys[i]]
            if prob == 0:
                break
        out[ys] = prob
    return out


def complete(dist: dict, k: int) -> np.ndarray:
    """Emitted tuples (with probabilities) completed autoregressively to ``k`` tokens."""
    out = np.zeros((V,) * k)

    def walk(prefix, prob):
        if len(prefix) >= k:
            out[prefix[:k]] += prob
            return
        p = target_p(PROMPT + prefix)
        for y in np.flatnonzero(p):
            walk(prefix + (int(y),), prob * p[y])

    for e, pr in dist.items():
        walk(e, pr)
    return out


def shared_noise_law(qs: np.ndarray) -> dict:
    """NEGATIVE CONTROL's draft law: every block position drawn by inverse CDF from ONE uniform."""
    cdfs = [np.cumsum(q) / q.sum() for q in qs]
    cuts = np.unique(np.concatenate([[0.0, 1.0]] + cdfs))
    law: dict = {}
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi <= lo:
            continue
        u = (lo + hi) / 2
        x = tuple(int(min(np.searchsorted(c, u, side="right"), V - 1)) for c in cdfs)
        law[x] = law.get(x, 0.0) + (hi - lo)
    return law


def chain_round(qs_law, qs_ratio, law=None) -> dict:
    """Exact distribution of the first chain round's emitted tokens: drafts x with probability
    ``law[x]`` (default Π q_i(x_i) from ``qs_law``: independent draws), every accept/reject
    event realized through the real jitted ``verify`` with ``qs_ratio`` in the ratio."""
    gamma = len(qs_law)
    if law is None:
        law = {x: float(np.prod([qs_law[i][x[i]] for i in range(gamma)]))
               for x in itertools.product(range(V), repeat=gamma)}
    events = []
    for x, w in law.items():
        if w == 0:
            continue
        ps = np.stack([target_p(PROMPT + x[:i]) for i in range(gamma + 1)])
        qr = np.array([qs_ratio[i][x[i]] for i in range(gamma)])
        a = np.minimum(1.0, ps[np.arange(gamma), list(x)] / np.where(qr > 0, qr, 1.0))
        for j in range(gamma + 1):
            prob = w * np.prod(a[:j]) * ((1 - a[j]) if j < gamma else 1.0)
            if prob <= 0:
                continue
            r = np.full(gamma, 0.5, np.float32)
            r[:j] = R_ACCEPT
            if j < gamma:
                r[j] = R_REJECT
            events.append((prob, x, ps, r, j))
    n = len(events)
    got_n, _, nxt = _verify(np.array([e[1] for e in events], np.int32),
                            np.broadcast_to(qs_ratio.astype(np.float32), (n,) + qs_ratio.shape),
                            np.stack([e[2] for e in events]).astype(np.float32), np.stack([e[3] for e in events]),
                            jax.random.split(jax.random.key(0), n), np.full(n, gamma, np.int32))
    got_n, nxt = np.asarray(got_n), np.asarray(nxt, np.float64)
    dist: dict = {}
    for (prob, x, *_), k, nx in zip(events, got_n, nxt):
        for y in np.flatnonzero(nx):
            e = tuple(x[:k]) + (int(y),)
            dist[e] = dist.get(e, 0.0) + prob * nx[y]
    return dist, got_n, [e[4] for e in events]


def test_decode_call_equals_training_call():
    """``block_forward`` over a cache of the context (written by ``write_context``, with stale
    slots past the anchor) == ``train_forward`` at that anchor, every slot (≤ 1e-5)."""
    target, d = tiny_block_pair()
    cfg = d.config
    toks = jnp.asarray([[2, 5, 1, 3, 4, 0, 2, 2, 5, 1, 3, 3]], jnp.int32)
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, toks)
    anchors = jnp.asarray([[1, 4, 7]], jnp.int32)
    f_train = block_net.train_forward(cfg, d.params, feats, toks, anchors, GAMMA)  # [1, 3, γ, D]
    cache = block_net.write_context(cfg, d.params["train"], block_net.new_cache(cfg, 1, 16), feats,
                                    jnp.zeros((1,), jnp.int32))
    for j, a in enumerate([1, 4, 7]):
        f = block_net.block_forward(cfg, d.params, cache, toks[:, a], jnp.asarray([a], jnp.int32), GAMMA)
        np.testing.assert_allclose(np.asarray(f[0]), np.asarray(f_train[0, j]), atol=1e-5, rtol=1e-5)


def test_q_is_independent_of_the_drafts_and_unequal_across_slots():
    """The premise of the exactness argument (module docstring of specjax.drafters.block): q_i
    comes from one pass that sees no draft; the slots differ (so the enumeration is not trivial)."""
    qs = drafter_q(PROMPT)
    assert qs.shape == (GAMMA, V) and np.allclose(qs.sum(-1), 1, atol=1e-5)
    assert np.abs(qs[0] - qs[1]).max() > 0.05 and np.abs(qs[1] - qs[2]).max() > 0.05
    assert (qs == 0).any(), "top-k/top-p must cut the support for the test to exercise them"


def test_chain_round_exact_and_negative_controls_fail():
    qs = drafter_q(PROMPT)
    want = ar_joint(GAMMA + 1)
    dist, got_n, events_j = chain_round(qs, qs)
    np.testing.assert_array_equal(got_n, events_j)  # the uniforms realize the events in the real verify
    got = complete(dist, GAMMA + 1)
    assert abs(got.sum() - 1) < 1e-6
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # NEGATIVE CONTROL 1: one uniform shared by the block positions
    shared, *_ = chain_round(qs, qs, law=shared_noise_law(qs))
    err1 = np.abs(complete(shared, GAMMA + 1) - want).max()
    # NEGATIVE CONTROL 2: the ratio uses another q than the one sampled from
    other, *_ = chain_round(qs, drafter_q(PROMPT, temperature_one=True))
    err2 = np.abs(complete(other, GAMMA + 1) - want).max()
    assert err1 > 1e-3 and err2 > 1e-3, f"a negative control passed ({err1:.2e}, {err2:.2e}): the enumeration is blind"


def _tree_round(tokens, parents, depth) -> dict:
    """The deterministic-children rule's outcome distribution of a tree (float64; the real
    ``verify_tree`` walk is gated by tests/test_tree.py's enumeration)."""
    kids = {i: [j for j in range(len(tokens)) if parents[j] == i] for i in range(-1, len(tokens))}
    dist: dict = {}

    def visit(node, path, prob):
        p = target_p(PROMPT + path)
        for c in kids[node]:
            visit(c, path + (int(tokens[c]),), prob * p[tokens[c]])
        tried = {int(tokens[c]) for c in kids[node]}
        for y in np.flatnonzero(p):
            if int(y) not in tried:
                dist[path + (int(y),)] = dist.get(path + (int(y),), 0.0) + prob * p[y]

    visit(-1, (), 1.0)
    return dist


@pytest.mark.parametrize("shape", [(6, 3, 2), (3, 3, 1)])
def test_tree_round_exact(shape):
    """The block's one-pass tree (per-slot top-K, paths by the product of marginals) is a valid tree
    (parents first, depth ≤ D), its K = 1 tree is the greedy chain, and its first round is exact."""
    target, d = tiny_block_pair()
    sh = TreeShape(*shape)
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, jnp.asarray([PROMPT], jnp.int32))
    toks = jnp.asarray([list(PROMPT) + [0] * (sh.depth + 2)], jnp.int32)
    sp = _sp()
    ctx0 = DraftContext(toks, jnp.asarray([len(PROMPT)], jnp.int32), sp, feats, jnp.zeros((1,), jnp.int32))
    state = d.init_state(d.params, ctx0, toks.shape[1])
    ctx = DraftContext(toks, ctx0.lengths, sp, jnp.zeros((1, sh.depth + 1, feats.shape[-1])), jnp.zeros((1,), jnp.int32))
    prop = d.propose_tree(d.params, state, ctx, None, sh, V)
    assert prop.scheme == "deterministic"
    tr = prop.tree
    valid = np.asarray(tr.valid)[0]
    tokens, parents, depth = (np.asarray(a)[0] for a in (tr.tokens, tr.parents, tr.depth))
    assert valid.all() and (depth <= sh.depth).all()
    assert all(parents[i] < i for i in range(len(tokens)))
    if sh.topk == 1:
        logits, _ = d.block_logits(d.params, state, ctx, sh.depth)
        assert tokens.tolist() == np.asarray(jnp.argmax(logits[0], -1)).tolist()
    got = complete(_tree_round(tokens, parents, depth), sh.depth + 1)
    np.testing.assert_allclose(got, ar_joint(sh.depth + 1), atol=1e-6, rtol=0)


def test_block_positions_draw_independent_noise():
    """The drafter's own draws (``propose``, 4,000 rows of the same context, fixed keys): the pair
    (x_1, x_2) passes a chi-square against q_1 ⊗ q_2 (p > 1e-3; a correct drafter fails with
    probability 1e-3 over key choices), and a drafter that draws every position with the first
    position's key (shared noise) fails it (p < 1e-6)."""
    target, d = tiny_block_pair()
    rows = 4000
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, jnp.asarray([PROMPT], jnp.int32))
    toks = jnp.asarray([list(PROMPT) + [0] * (GAMMA + 2)] * rows, jnp.int32)
    sp = _sp(rows)
    lengths = jnp.full((rows,), len(PROMPT), jnp.int32)
    ctx0 = DraftContext(toks, lengths, sp, jnp.broadcast_to(feats, (rows,) + feats.shape[1:]), jnp.zeros((rows,), jnp.int32))
    state = d.init_state(d.params, ctx0, toks.shape[1])
    ctx = DraftContext(toks, lengths, sp, jnp.zeros((rows, GAMMA + 1, feats.shape[-1])), jnp.zeros((rows,), jnp.int32))
    keys = jax.random.split(jax.random.key(7), rows * GAMMA).reshape(rows, GAMMA)
    q = np.asarray(drafter_q(PROMPT))
    expected = np.outer(q[0], q[1])
    for shared in (False, True):
        k = jnp.broadcast_to(keys[:, :1], keys.shape) if shared else keys
        prop = jax.jit(lambda s, c, kk: d.propose(d.params, s, c, kk, GAMMA, V))(state, ctx, k)
        x = np.asarray(prop.tokens)
        counts = np.zeros((V, V))
        np.add.at(counts, (x[:, 0], x[:, 1]), 1)
        res = chi2_test(counts, expected)
        if shared:
            assert res.pvalue < 1e-6, f"the shared-noise control passed (p = {res.pvalue:.2e})"
        else:
            assert res.impossible == 0 and res.pvalue > 1e-3, f"block positions are not independent (p = {res.pvalue:.2e})"


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_greedy_speculative_equals_autoregressive(fmt):
    """Greedy, tiny target (vocabulary 8, peaked), an untrained block drafter in ``fmt``: chain γ 1
    and 3 and a tree, batch 3 and batch 1 (float32; bfloat16 and int8: chain γ 3 and the tree, batch 3)
    == autoregressive, with drafts accepted (a vocabulary of 8 makes chance agreement frequent)."""
    target = tiny_model(seed=4, scale=3.0, vocab_size=8)
    cfg = block_net.BlockConfig.for_target(target.config, num_layers=2, block_size=4, sub_vocab=8,
                                           intermediate_size=32, feature_layers=(0, 1))
    d = block.make_drafter(cfg, block_net.init_params(cfg, 1), target, np.arange(8, dtype=np.int32), dtype=fmt)
    prompts = [[2, 3, 4, 5], [6, 7], [1, 2, 3, 4, 5, 6, 7]]
    ar = Decoder(target).generate(prompts, max_new_tokens=24, eos_ids=[]).tokens
    accepted = 0
    setups = (dict(gamma=1), dict(gamma=3), dict(tree_nodes=6, tree_depth=3, tree_topk=2))
    for kw in setups if fmt == "float32" else setups[1:]:  # the drafter's format changes its guesses only
        dec = Decoder(target, d, **kw)
        res = dec.generate(prompts, max_new_tokens=24, eos_ids=[])
        assert res.tokens == ar, kw
        accepted += sum(s["accepted_tokens"] for s in res.stats)
        if fmt == "float32":
            assert dec.generate(prompts[2:], max_new_tokens=24, eos_ids=[]).tokens[0] == ar[2], kw
    assert accepted > 3, f"only {accepted} drafts accepted: the check would be nearly vacuous"


def test_gamma_auto_scores_every_block_slot():
    """``--gamma auto`` with a block drafter (issue 28): α per slot from ONE proposal at each position
    of the target's own continuation (slot i against the target's p at position k + i − 1),
    checked against an independent computation with the real drafter's first-round q
    (:func:`drafter_q`) and the target's p (:func:`target_p`); E(N) per γ is 1 + Σ_k Π_{i≤k} α_i and
    γ is capped at the trained block size; costs are timed at the run's batch size."""
    from specjax.drafters.model import ModelDrafter
    from specjax.eval.alpha import alpha_by_decoding, measure_alpha
    from specjax.eval.auto import recommend
    from specjax.eval.costs import timed_programs
    from specjax.eval.theory import expected_tokens_by_position
    from specjax.runtime.settings import DecodeSettings

    target, d = tiny_block_pair()
    target_drafter_of = ModelDrafter.from_model  # a drafter that drafts token by token
    prompts = [{"ids": list(PROMPT)}, {"ids": [1, 4, 4, 2, 0, 3]}]
    settings = DecodeSettings(max_new_tokens=12, seed=3, ignore_eos=True, **SETTINGS)
    progs = timed_programs(target, d, [0, 1, GAMMA], 6, 12)
    got = alpha_by_decoding(target, d, prompts, progs, settings, new_tokens=6)
    by_slot = [[] for _ in range(GAMMA)]
    for rec, new in zip(prompts, got["continuations"]):
        assert len(new) == 6
        for k in range(len(new)):
            q = drafter_q(tuple(rec["ids"] + new[:k]))
            for i in range(min(GAMMA, len(new) - k)):
                by_slot[i].append(np.minimum(target_p(tuple(rec["ids"] + new[:k + i])), q[i]).sum())
    want = [float(np.mean(b)) for b in by_slot]
    np.testing.assert_allclose(got["alpha_by_position"], want, atol=1e-4)
    assert got["alpha"] == pytest.approx(want[0], abs=1e-4)
    # specjax analyze's teacher-forced α (one target forward per prompt, every position's block proposal)
    tf = measure_alpha(target, d,
                       [{**r, "category": "c"} for r in prompts], got["continuations"], slots=GAMMA, **SETTINGS)
    np.testing.assert_allclose(tf["alpha_by_position"], want, atol=1e-4)
    with pytest.raises(ValueError, match="one-pass"):
        measure_alpha(target, target_drafter_of(target), prompts, got["continuations"], slots=2)
    assert len(set(np.round(want, 3))) > 1, "slots must differ for the test to tell them apart"

    gamma, rep = recommend(target, d, prompts, settings, gamma_max=8, timing_repeats=2, batch=2)
    assert rep["gammas"] == [1, 2, 3] and rep["batch"] == 2 and len(rep["alpha_by_position"]) == GAMMA
    for row in rep["table"]:
        e = expected_tokens_by_position(rep["alpha_by_position"], row["gamma"])
        assert row["expected_tokens"] == pytest.approx(e) and row["speedup"] == pytest.approx(e / row["cost"])
    assert gamma == max(rep["table"], key=lambda r: (r["speedup"], -r["gamma"]))["gamma"]
    with pytest.raises(ValueError, match="batch"):
        recommend(target, d, prompts, settings, batch=0)


def _anchor_drafter(proj_scale: float):
    """The :func:`tiny_block_pair` drafter with ``anchor_feature`` and ``anchor_proj`` = ``proj_scale`` × a
    random matrix (0: the zero projection a warm start begins with)."""
    target, d = tiny_block_pair()
    cfg = dataclasses.replace(d.config, anchor_feature=True)
    dim = cfg.layer.hidden_size
    proj = proj_scale * jax.random.normal(jax.random.key(7), (dim, dim), jnp.float32) / np.sqrt(dim)
    tp = dict(d.params["train"], anchor_proj=proj)
    return target, block.make_drafter(cfg, tp, target, np.arange(V, dtype=np.int32))


@pytest.mark.parametrize("anchor_feature", [False, True])
def test_decode_rounds_follow_the_training_call(anchor_feature):
    """The decode loop's bookkeeping, round after round (the DraftContext contract: ``target_hidden``
    holds the last target call's features, index n = position L − 2): the prefill, a fresh round, a
    round after 2 accepted drafts, one after a rejection — each round's logits == the training call's
    at the same anchor (≤ 1e-4). With ``anchor_feature`` (a random, non-zero ``anchor_proj``) this
    also checks that the anchor reads the context vector of position L − 2 in every round kind."""
    from specjax.drafters.eagle_net import full_logits

    target, d = _anchor_drafter(4.0) if anchor_feature else tiny_block_pair()
    cfg, params = d.config, d.params
    seq = jnp.asarray([[2, 5, 1, 3, 4, 0, 2, 2, 5, 1, 3, 3]], jnp.int32)
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, seq)
    p_len, g = 4, GAMMA
    f_train = block_net.train_forward(cfg, params, feats, seq, jnp.asarray([[p_len - 1, 6, 7]], jnp.int32), g)
    want = np.asarray(full_logits(params, f_train, V))[0]  # [3 anchors, γ, V]
    sp = _sp()
    buf = jnp.zeros((1, 16), jnp.int32).at[:, :12].set(seq)  # committed prefix + stale slots
    state = d.init_state(params, DraftContext(buf, jnp.asarray([p_len]), sp, feats[:, :p_len],
                                              jnp.zeros((1,), jnp.int32)), 16)
    rounds = [(p_len, jnp.zeros((1, g + 1, feats.shape[-1])), 0),     # fresh: no target call yet
              (7, feats[:, p_len - 1: p_len + g], 2),                   # inputs at P-1.., 2 drafts accepted
              (8, feats[:, 6: 7 + g], 0)]                               # inputs at 6.., the first rejected
    for j, (length, hidden, n) in enumerate(rounds):
        ctx = DraftContext(buf, jnp.asarray([length]), sp, hidden.astype(jnp.float32), jnp.asarray([n]))
        logits, state = d.block_logits(params, state, ctx, g)
        np.testing.assert_allclose(np.asarray(logits)[0], want[j], atol=1e-4, rtol=1e-4, err_msg=f"round {j}")
    if anchor_feature:  # the projection matters: without it the logits differ
        _, plain = tiny_block_pair()
        f0 = block_net.train_forward(plain.config, plain.params, feats, seq, jnp.asarray([[6]], jnp.int32), g)
        assert np.abs(np.asarray(full_logits(plain.params, f0, V))[0, 0] - want[1]).max() > 1e-2


def test_zero_anchor_projection_is_the_drafter_without_it():
    """A warm start (``--init-from`` + ``--anchor-feature``) begins with ``anchor_proj`` = 0: the
    same drafter, bit for bit in the training call."""
    target, plain = tiny_block_pair()
    _, zero = _anchor_drafter(0.0)
    seq = jnp.asarray([[2, 5, 1, 3, 4, 0, 2, 2, 5, 1, 3, 3]], jnp.int32)
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, seq)
    anchors = jnp.asarray([[1, 4, 7]], jnp.int32)
    a = block_net.train_forward(plain.config, plain.params, feats, seq, anchors, GAMMA)
    b = block_net.train_forward(zero.config, zero.params, feats, seq, anchors, GAMMA)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert block_net.with_anchor_proj(zero.config, dict(plain.params["train"]))["anchor_proj"].shape == (
        plain.config.layer.hidden_size,) * 2


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_anchor_feature_drafter_greedy_equals_autoregressive_and_round_trips(fmt, tmp_path):
    """An ``anchor_feature`` block drafter: greedy speculative == autoregressive (chain γ 3 and a tree,
    batch 3); saved and loaded it is the same drafter; a file without its ``anchor_proj`` is one line."""
    import json as _json

    from specjax.models.config import CheckpointError

    target = tiny_model(seed=4, scale=3.0, vocab_size=8)
    cfg = block_net.BlockConfig.for_target(target.config, num_layers=2, block_size=4, sub_vocab=8,
                                           intermediate_size=32, feature_layers=(0, 1), anchor_feature=True)
    tp = block_net.init_params(cfg, 1)
    tp["anchor_proj"] = 0.3 * jax.random.normal(jax.random.key(2), tp["anchor_proj"].shape)
    d = block.make_drafter(cfg, tp, target, np.arange(8, dtype=np.int32), dtype=fmt)
    prompts = [[2, 3, 4, 5], [6, 7], [1, 2, 3, 4, 5, 6, 7]]
    ar = Decoder(target).generate(prompts, max_new_tokens=24, eos_ids=[]).tokens
    for kw in (dict(gamma=3), dict(tree_nodes=6, tree_depth=3, tree_topk=2)):
        assert Decoder(target, d, **kw).generate(prompts, max_new_tokens=24, eos_ids=[]).tokens == ar, kw
    if fmt != "float32":
        return
    path = tmp_path / "d"
    block.save_drafter(str(path), cfg, tp, np.arange(8, dtype=np.int32), target)
    back = block.load_drafter(str(path), target)
    assert back.config == cfg and np.array_equal(np.asarray(back.params["train"]["anchor_proj"]),
                                                 np.asarray(tp["anchor_proj"]))
    meta = _json.loads((path / block.MARKER).read_text())
    plain = block.make_drafter(dataclasses.replace(cfg, anchor_feature=False), tp, target, np.arange(8, dtype=np.int32))
    block.save_drafter(str(path), plain.config, {k: v for k, v in tp.items() if k != "anchor_proj"},
                       np.arange(8, dtype=np.int32), target)
    (path / block.MARKER).write_text(_json.dumps(meta))  # says anchor_feature, the weights lack anchor_proj
    with pytest.raises(CheckpointError) as e:
        block.load_drafter(str(path), target)
    assert "\n" not in str(e.value) and "anchor_proj" in str(e.value)


def test_anchor_feature_reads_position_l_minus_2_per_row():
    """``prev`` (the anchor's context vector) is c at L − 2 for each row: after a prefill of rows with
    different prompt lengths (a padded bucket), in the first round, and in a first round that comes
    after plain (drafter-idle) rounds, where ``target_hidden[:, 0]`` holds L − 2."""
    target, d = _anchor_drafter(4.0)
    cfg, params = d.config, d.params
    seq = jnp.asarray([[2, 5, 1, 3, 4, 0, 2, 2, 5, 1, 3, 3], [1, 4, 4, 2, 0, 3, 5, 5, 1, 2, 0, 4]], jnp.int32)
    feats, _ = _features_and_logits(target.graphdef, target.config, target.params, seq)
    c = np.asarray(block_net.context(cfg, params["train"], feats))  # [2, 12, D]
    plen = jnp.asarray([5, 3], jnp.int32)
    sp = _sp(2)
    buf = jnp.zeros((2, 16), jnp.int32).at[:, :12].set(seq)
    state = d.init_state(params, DraftContext(buf, plen, sp, feats[:, :5], jnp.zeros((2,), jnp.int32)), 16)
    np.testing.assert_allclose(np.asarray(state["prev"]), c[[0, 1], [3, 1]], atol=1e-5)
    zeros = jnp.zeros((2, GAMMA + 1, feats.shape[-1]), jnp.float32)
    _, s1 = d.block_logits(params, state, DraftContext(buf, plen, sp, zeros, jnp.zeros((2,), jnp.int32)), GAMMA)
    np.testing.assert_allclose(np.asarray(s1["prev"]), c[[0, 1], [3, 1]], atol=1e-5)
    # two plain rounds first (the engine's speculation off): lengths moved on, the drafter still fresh
    moved = plen + 2
    hidden = zeros.at[:, 0].set(feats[jnp.arange(2), moved - 2])
    _, s2 = d.block_logits(params, state, DraftContext(buf, moved, sp, hidden, jnp.zeros((2,), jnp.int32)), GAMMA)
    np.testing.assert_allclose(np.asarray(s2["prev"]), c[[0, 1], [5, 3]], atol=1e-5)
