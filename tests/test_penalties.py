"""Penalties, min-p, min_tokens and the logit bias: exact under speculation (issue 27).

The exactness argument: a speculative round is exact when the target's p at every draft position
(a tree node) is the distribution autoregressive decoding would use after the same tokens
(Leviathan et al. 2023, A.1). With penalties, p depends on the token history, so the loop must
penalize position i with the committed text PLUS the round's drafts 1..i−1 (a tree node: its
path). These tests build every position's p through the loop's own code
(:func:`specjax.runtime.loop.penalized` → :func:`specjax.core.sampling.penalize` →
``SamplingParams.process``), realize every accept/reject event through the real ``verify``
(chains) and the real ``verify_tree`` walk (trees), and compare the exact joint of the first three
emitted tokens with autoregressive decoding's (≤ 1e-6). The negative control — a history that
ignores the round's earlier drafts, the bug of vLLM #18902 / SGLang #33643 — must fail clearly.
"""

from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stats_helpers import chain_events

from specjax.core import tree as tree_ops
from specjax.core.acceptance import verify
from specjax.core.sampling import Sampling, SamplingParams, penalize, process_logits
from specjax.runtime import loop

V = 5  # vocabulary (≤ 8)
PROMPT = (3, 1)  # the prompt: the repetition penalty counts it, presence/frequency do not
EOS = 4
STRONG = dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)

_verify = jax.jit(verify)


@functools.lru_cache(maxsize=None)
def raw_logits(ctx: tuple) -> np.ndarray:
    """The tiny target: fixed random logits per context (scale 2: penalties change the ranking)."""
    return (2.0 * np.random.default_rng([11, len(ctx), *ctx]).standard_normal(V)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def q_probs(ctx: tuple) -> np.ndarray:
    """The tiny drafter's q (unpenalized: exactness needs only that x is drawn from the q used)."""
    d = np.random.default_rng([12, len(ctx), *ctx]).dirichlet(np.full(V, 0.8))
    return (d / d.sum()).astype(np.float32)


def _state(sp, out: tuple):
    """The loop state fields :func:`loop.penalized` reads, for the prompt + committed ``out``."""
    seen = np.zeros((1, V), bool)
    seen[0, list(PROMPT + out)] = True
    counts = np.zeros((1, V), np.int32)
    for t in out:
        counts[0, t] += 1
    return SimpleNamespace(sampling=sp, seen=jnp.asarray(seen), counts=jnp.asarray(counts),
                           stats=SimpleNamespace(new_tokens=jnp.asarray([len(out)], jnp.int32)),
                           eos=jnp.asarray([[EOS, -1]], jnp.int32))


@functools.partial(jax.jit, static_argnames=("ignore",))
def _block_p(sp, seen, counts, new, eos, logits, drafts, sees, depth, ignore=False):
    st = SimpleNamespace(sampling=sp, seen=seen, counts=counts, stats=SimpleNamespace(new_tokens=new), eos=eos)
    if ignore:  # NEGATIVE CONTROL: the history ignores the round's drafts
        sees = jnp.zeros_like(sees)
    return sp.process(loop.penalized(st, logits, drafts, sees, depth))


def block_p(sp, out, drafts, sees, depth, ignore=False):
    """p at every position of one target call (the loop's code), ``[T, V]`` float32."""
    ctxs = [PROMPT + out + tuple(path) for path in _paths(drafts, sees)]
    logits = jnp.asarray(np.stack([raw_logits(c) for c in ctxs]))[None]
    st = _state(sp, out)
    return np.asarray(_block_p(sp, st.seen, st.counts, st.stats.new_tokens, st.eos, logits,
                               jnp.asarray(drafts, jnp.int32)[None], jnp.asarray(sees)[None],
                               jnp.asarray(depth, jnp.int32)[None], ignore=ignore))[0]


def _paths(drafts, sees):
    """The draft tokens each position's context ends with (its path), from ``sees [T, S]``."""
    return [[d for d, s in zip(drafts, row) if s] for row in np.asarray(sees)]


def ar_p(sp, out: tuple) -> np.ndarray:
    """Autoregressive decoding's p after prompt + ``out`` (one position, no drafts)."""
    return block_p(sp, out, np.zeros((0,), np.int32), np.zeros((1, 0), bool), [0])[0].astype(np.float64)


def ar_joint(sp, k=3) -> np.ndarray:
    """P(y_1..y_k) of autoregressive decoding with the penalties, enumerated."""
    out = np.zeros((V,) * k)
    for ys in itertools.product(range(V), repeat=k):
        prob = 1.0
        for i in range(k):
            prob *= ar_p(sp, ys[:i])[ys[i]]
            if prob == 0:
                break
        out[ys] = prob
    return out


# ----------------------------------------------------------------- chains --


def chain_round(sp, out: tuple, gamma: int, ignore=False):
    """Exact distribution of one chain round's emitted tokens: ``{emitted tuple: probability}``,
    every (draft, first rejection) event realized through the real jitted ``verify``."""
    events = []
    sees = np.tril(np.ones((gamma + 1, gamma + 1), bool))[:, 1:]  # position t sees drafts 1..t
    for draft in itertools.product(range(V), repeat=gamma):
        qs = np.stack([q_probs(PROMPT + out + draft[:i]) for i in range(gamma)])
        ps = block_p(sp, out, np.asarray(draft, np.int32), sees, np.arange(gamma + 1), ignore)
        for prob, r, j in chain_events(draft, qs, ps):
            events.append((prob, draft, qs, ps, r, j))
    n = len(events)
    tokens = np.array([e[1] for e in events], np.int32)
    got_n, _, nxt = _verify(tokens, np.stack([e[2] for e in events]), np.stack([e[3] for e in events]),
                            np.stack([e[4] for e in events]), jax.random.split(jax.random.key(0), n),
                            np.full(n, gamma, np.int32))
    got_n, nxt = np.asarray(got_n), np.asarray(nxt, np.float64)
    np.testing.assert_array_equal(got_n, [e[5] for e in events])  # the uniforms realize the events
    dist: dict = {}
    for (prob, draft, *_), k, nx in zip(events, got_n, nxt):
        for y in range(V):
            if nx[y] > 0:
                e = tuple(draft[:k]) + (y,)
                dist[e] = dist.get(e, 0.0) + prob * nx[y]
    return dist


def spec_joint(round_fn, k=3) -> np.ndarray:
    """P(y_1..y_k) of speculative decoding: rounds chained until k tokens are emitted."""
    out = np.zeros((V,) * k)

    def walk(prefix: tuple, prob: float):
        if len(prefix) >= k:
            out[prefix[:k]] += prob
            return
        for emitted, pr in round_fn(prefix).items():
            walk(prefix + emitted, prob * pr)

    walk((), 1.0)
    return out


SETTINGS = {
    "strong": STRONG,
    "repetition": dict(temperature=1.0, repetition_penalty=2.0),
    "frequency": dict(temperature=0.8, frequency_penalty=1.0, top_k=4),
    "min_p+presence": dict(temperature=1.0, min_p=0.15, presence_penalty=1.5),
    "min_tokens+bias": dict(temperature=1.0, min_tokens=2, logit_bias={0: 1.5, 2: -1.0}, repetition_penalty=1.5),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("gamma", [1, 2])
def test_chain_first_three_tokens_exact(name, gamma):
    sp = SamplingParams.from_rows([Sampling(**SETTINGS[name])])
    want = ar_joint(sp)
    got = spec_joint(lambda prefix: chain_round(sp, prefix, gamma))
    assert abs(got.sum() - 1) < 1e-6
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_chain_negative_control_fails():
    """A history that ignores the round's earlier drafts is NOT exact: the enumeration sees it."""
    sp = SamplingParams.from_rows([Sampling(**STRONG)])
    got = spec_joint(lambda prefix: chain_round(sp, prefix, 2, ignore=True))
    err = np.abs(got - ar_joint(sp)).max()
    assert err > 1e-2, f"the negative control passed (max error {err:.2e}): the enumeration is blind"


# ------------------------------------------------------------------ trees --


def _tree_of(out: tuple, k: int, d: int):
    """The full K-ary tree of depth D whose children are the top-K of q at each node (the
    deterministic scheme: what n-gram and EAGLE trees propose), in breadth-first node order."""
    tokens, parents, depth = [], [], []
    frontier = [(-1, ())]
    for level in range(1, d + 1):
        nxt = []
        for parent, path in frontier:
            q = q_probs(PROMPT + out + path)
            for c in np.argsort(-q, kind="stable")[:k]:
                tokens.append(int(c))
                parents.append(parent)
                depth.append(level)
                nxt.append((len(tokens) - 1, path + (int(c),)))
        frontier = nxt
    return np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depth, np.int32)


def tree_round(sp, out: tuple, k: int, d: int, ignore=False):
    """Exact distribution of one tree round's emitted tokens. The p of every node comes from ONE
    :func:`loop.penalized` call with the loop's tree mask (``block_attention_mask``); the walk's
    outcome distribution is the deterministic-children rule's (try the children in order, accept
    child c with probability p(c) over the remaining mass, then draw from p without the tried
    children: P(path, y) = Π p(path node) · p(y)), computed in float64 from those p. That the real
    ``verify_tree`` walk implements this rule is gated by tests/test_tree.py's enumeration;
    :func:`test_tree_walk_realizes_the_paths` runs it on these penalized p."""
    tokens, parents, depth = _tree_of(out, k, d)
    tree = tree_ops.DraftTree.create(tokens[None], parents[None], depth[None], max_depth=d, max_children=k)
    mask = np.asarray(tree_ops.block_attention_mask(tree))[0]  # [N+1, N+1]
    ps = block_p(sp, out, tokens, mask[:, 1:], np.concatenate([[0], depth]), ignore).astype(np.float64)
    kids = {i: [j for j in range(len(tokens)) if parents[j] == i] for i in range(-1, len(tokens))}
    dist: dict = {}

    def visit(node: int, path: tuple, prob: float):
        p = ps[node + 1]
        rest = 1.0
        for c in kids[node]:
            visit(c, path + (int(tokens[c]),), prob * p[tokens[c]])
            rest -= p[tokens[c]]
        tried = {int(tokens[c]) for c in kids[node]}
        for y in range(V):
            if y not in tried and p[y] > 0:
                dist[path + (y,)] = dist.get(path + (y,), 0.0) + prob * p[y]

    visit(-1, (), 1.0)
    return dist


def tree_joint(sp, k, d, ignore=False):
    return spec_joint(lambda prefix: tree_round(sp, prefix, k, d, ignore))


@pytest.mark.parametrize("name", ["strong", "min_tokens+bias"])
@pytest.mark.parametrize("k, d", [(2, 2), (1, 2)])
def test_tree_first_three_tokens_exact(name, k, d):
    sp = SamplingParams.from_rows([Sampling(**SETTINGS[name])])
    got = tree_joint(sp, k, d)
    assert abs(got.sum() - 1) < 1e-6
    np.testing.assert_allclose(got, ar_joint(sp), atol=1e-6, rtol=0)


def test_tree_negative_control_fails():
    sp = SamplingParams.from_rows([Sampling(**STRONG)])
    err = np.abs(tree_joint(sp, 2, 2, ignore=True) - ar_joint(sp)).max()
    assert err > 1e-2, f"the negative control passed (max error {err:.2e}): the enumeration is blind"


def test_tree_walk_realizes_the_paths():
    """The real ``verify_tree`` walk, given the loop's penalized p of a tree, follows the paths
    the enumeration counts: with uniforms 0 (accept whenever p(child) > 0) it takes the first
    child with positive p at every level — checked against the float64 rule."""
    sp = SamplingParams.from_rows([Sampling(**STRONG)])
    for out in [(), (0,), (2, 2)]:
        tokens, parents, depth = _tree_of(out, 2, 2)
        tree = tree_ops.DraftTree.create(tokens[None], parents[None], depth[None], max_depth=2, max_children=2)
        mask = np.asarray(tree_ops.block_attention_mask(tree))[0]
        ps = block_p(sp, out, tokens, mask[:, 1:], np.concatenate([[0], depth]))
        acc = tree_ops.verify_tree(tree, jnp.asarray(ps)[None], jnp.zeros((1, len(tokens)), jnp.float32),
                                   jax.random.split(jax.random.key(1), 1), "deterministic")
        node, want = -1, []
        for _ in range(2):
            kids = [j for j in range(len(tokens)) if parents[j] == node and ps[node + 1][tokens[j]] > 0]
            if not kids:
                break
            node = kids[0]
            want.append(node)
        assert int(acc.n[0]) == len(want)
        assert list(np.asarray(acc.path[0])[: len(want)]) == want


# --------------------------------------------------------------- penalize --


def test_penalize_rules_by_hand():
    """Each rule on one position: bias, CTRL repetition (prompt + output), OpenAI presence and
    frequency (output only), min_tokens masks the stop ids."""
    z = jnp.asarray([[[2.0, -1.0, 0.5, 3.0, 1.0]]])
    sp = SamplingParams.from_rows([Sampling(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                                            min_tokens=3, logit_bias={1: 1.0})])
    seen = jnp.asarray([[True, True, False, True, False]])  # 3 only in the prompt
    counts = jnp.asarray([[2, 1, 0, 0, 0]], jnp.int32)
    out = penalize(z, sp, seen, counts, jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 1, 0), bool),
                   jnp.asarray([[2]], jnp.int32), jnp.asarray([[4, -1]], jnp.int32))
    want = [2.0 / 2 - 0.5 * 2 - 0.25, (-1.0 + 1.0) * 2 - 0.5 - 0.25, 0.5, 3.0 / 2, -np.inf]
    np.testing.assert_allclose(np.asarray(out)[0, 0], want, rtol=0, atol=1e-7)
    # 3 new tokens: EOS allowed again
    out = penalize(z, sp, seen, counts, jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 1, 0), bool),
                   jnp.asarray([[3]], jnp.int32), jnp.asarray([[4, -1]], jnp.int32))
    assert np.asarray(out)[0, 0, 4] == 1.0


def test_penalize_counts_each_draft_on_the_path():
    """A draft counted at every later position of its chain, with multiplicity (frequency)."""
    z = jnp.zeros((1, 3, 4))
    sp = SamplingParams.from_rows([Sampling(frequency_penalty=1.0)])
    sees = jnp.asarray(np.tril(np.ones((3, 3), bool))[None, :, 1:])
    out = np.asarray(penalize(z, sp, jnp.zeros((1, 4), bool), jnp.zeros((1, 4), jnp.int32),
                              jnp.asarray([[2, 2]], jnp.int32), sees, jnp.zeros((1, 3), jnp.int32),
                              jnp.full((1, 1), -1, jnp.int32)))
    np.testing.assert_array_equal(out[0, :, 2], [0.0, -1.0, -2.0])
    np.testing.assert_array_equal(out[0, :, [0, 1, 3]], 0.0)


def test_min_p_matches_transformers():
    """min-p's processed probabilities equal transformers' MinPLogitsWarper (after temperature,
    top-k, top-p as in transformers' order) within 1e-6."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(5)
    logits = (3 * rng.standard_normal((6, 300))).astype(np.float32)
    checked = 0
    for t, k, p, m in [(1.0, 0, 1.0, 0.1), (0.7, 50, 1.0, 0.05), (1.3, 0, 0.9, 0.2), (1.0, 20, 0.8, 0.3)]:
        x = torch.from_numpy(logits.copy())
        x = TemperatureLogitsWarper(t)(None, x)
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        x = MinPLogitsWarper(m)(None, x)
        want = torch.softmax(x, -1).numpy()
        got = np.asarray(process_logits(jnp.asarray(logits), t, k, p, m))
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        assert ((got > 0) == (want > 0)).all()
        checked += 1
    assert checked == 4


def test_one_program_for_mixed_rows():
    """Penalties and min-p are traced per-row values: plain and penalized rows share one trace."""
    traces = []

    @jax.jit
    def f(sp, z):
        traces.append(1)
        return sp.process(penalize(z, sp, jnp.zeros((2, V), bool), jnp.zeros((2, V), jnp.int32),
                                   jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 1, 0), bool),
                                   jnp.zeros((2, 1), jnp.int32), jnp.full((2, 1), EOS, jnp.int32)))

    z = jnp.ones((2, 1, V))
    f(SamplingParams.from_rows([Sampling(), Sampling()]), z)
    f(SamplingParams.from_rows([Sampling(repetition_penalty=1.3, min_p=0.1), Sampling(frequency_penalty=0.5)]), z)
    f(SamplingParams.from_rows([Sampling(logit_bias={1: 2.0}), Sampling(min_tokens=4, presence_penalty=-1.0)]), z)
    assert len(traces) == 1


@pytest.mark.parametrize("kw, words", [
    (dict(min_p=1.5), "min_p must be a finite number in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(frequency_penalty=3.0), "frequency_penalty must be a finite number in [-2, 2]"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number in [-2, 2]"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(logit_bias={-3: 1.0}), "logit_bias must be a map"),
    (dict(logit_bias={3: 500.0}), "logit_bias must be a map"),
])
def test_bad_values_name_the_field(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Sampling(**kw)
