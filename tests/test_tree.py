"""Tests for specjax.core.tree: exactness of tree acceptance by enumeration and chi-square, with
negative controls; greedy; the K = 1 chain against core.acceptance.verify; structure helpers; the
EAGLE-2 dynamic tree.

How exactness is proven (the same pattern as tests/test_speculative.py):

1. Enumeration over one node. For every prefix s, every ordered tuple of children the drafting
   scheme can draw (with its probability, computed here independently of the library) and every
   acceptance event (children 1..e-1 rejected, child e accepted; or all rejected), the event's
   probability is the product of the library's kernel ``child_step(..).accept_prob`` values, and the
   event is REALIZED through the real jitted ``verify_tree`` on a one-level tree with uniforms
   forcing it (0 accepts iff p(c) > 0; 1 - 2**-24 rejects iff p(c) < q(c)); the test asserts the
   walk took the intended path and uses the walk's own ``next_probs`` (the residual).
2. The walk on deep trees is these one-node steps composed (realized event by event on whole
   trees: ``test_walk_realizes_every_event_on_fixed_trees``); the enumeration composes them
   recursively over prefixes (a child's subtree is drawn from the drafter at the child's prefix).
3. From that, the exact distribution of a round's emitted tokens: the first token, the first two
   (a second round enumerated when the first emits one token), and every prefix up to D + 1
   tokens (continued by the target: the "stream" check). All must equal the target's within 1e-6.
4. Chi-square with fixed keys: the real walk with random uniforms against the kernels' exact
   outcome distribution, and the whole pipeline (sample_children drafting + walk) against p.

Negative controls (must fail by a wide margin): children drawn without replacement but verified
with q unchanged ("iid" rule); deterministic top-k children verified with the drafter's q (the
RSD update); later siblings accepted by p/q without the residual update.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stats_helpers import chi2_pvalue

from specjax.core import tree as T
from specjax.core.acceptance import verify
from specjax.core.drafting import Proposal
from specjax.core.sampling import process_logits

R_ACCEPT = np.float32(0.0)  # accepts c iff p(c) > 0
R_REJECT = np.float32(1 - 2**-24)  # the largest uniform: rejects c iff p(c) < q_child(c) (up to 2**-24)
V = 5  # vocabulary of the enumeration tests
SCHEMES = T.SCHEMES

_verify_tree = jax.jit(T.verify_tree, static_argnames="scheme")
_greedy = jax.jit(T.verify_tree_greedy)
_process = jax.jit(process_logits)


# ------------------------------------------------------------------ toy models -------------


class Toy:
    """A target p and a drafter q per prefix (all prefixes up to ``max_len`` tokens), made from
    random logits with ``process_logits`` (temperature, top-k, top-p as in the real loop)."""

    ROWS = 1024  # every table is padded to this many rows: one process_logits compilation per V

    def __init__(self, seed, max_len, temperature=1.0, top_k=0, top_p=1.0, correlation=0.6, vocab=V, scale=1.2):
        self.vocab = vocab
        self.prefixes = [s for n in range(max_len + 1) for s in itertools.product(range(vocab), repeat=n)]
        assert len(self.prefixes) <= self.ROWS
        self.row = {s: i for i, s in enumerate(self.prefixes)}
        rng = np.random.default_rng(seed)
        lp = rng.standard_normal((self.ROWS, vocab)) * scale
        lq = correlation * lp + np.sqrt(1 - correlation**2) * rng.standard_normal((self.ROWS, vocab)) * scale
        proc = lambda x: np.asarray(_process(jnp.asarray(x, jnp.float32), jnp.float32(temperature),
                                             jnp.int32(top_k), jnp.float32(top_p)))
        self.p_table, self.q_table = proc(lp), proc(lq)

    def p(self, s):
        return self.p_table[self.row[tuple(s)]]

    def q(self, s):
        return self.q_table[self.row[tuple(s)]]


SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 3, 1.0),
    (1.3, 0, 0.8),
    (1.0, 4, 0.9),
]


# ------------------------------------------------------------ the kernels, batched ---------


@functools.partial(jax.jit, static_argnames=("scheme", "wrong"))
def _sibling_kernels(p, q, tokens, valid, scheme, wrong=None):
    """The library kernels over the children of R nodes: a [R, K] acceptance probability of child
    j given children < j rejected, and p_final [R, V] after all valid children are rejected.

    ``wrong="no_residual"`` is a NEGATIVE CONTROL: later siblings are accepted by p/q with the
    ORIGINAL p (no residual update for the siblings already rejected); the final draw is from
    norm(max(0, p - q)) once.
    """

    def row(p, q, tokens, valid):
        p0, a = p, []
        for j in range(tokens.shape[0]):
            step = T.child_step(p, q, tokens[j], scheme)
            a.append(jnp.where(valid[j], step.accept_prob, 0.0))
            if wrong == "no_residual":
                continue
            p = jnp.where(valid[j], step.p_rejected, p)
            q = jnp.where(valid[j], step.q_rejected, q)
        if wrong == "no_residual":
            p = jnp.where(jnp.any(valid), T.residual(p0, q), p0)
        return jnp.stack(a), p

    return jax.vmap(row)(p, q, tokens, valid)


def _pad_rows(arrays, size):
    return [np.concatenate([a, np.repeat(a[:1], size - len(a), 0)]) for a in arrays]


# ------------------------------------------------- enumeration of one node's children ------


def _draws(q, k, scheme):
    """Every ordered tuple of children ``scheme`` can draw from ``q`` (float32 [V]), with its
    probability — float64, computed here, independently of the library."""
    q64 = q.astype(np.float64) / q.astype(np.float64).sum()
    vocab = q.size
    if scheme == "iid":
        for t in itertools.product(range(vocab), repeat=k):
            prob = np.prod(q64[list(t)])
            if prob > 0:
                yield t, prob
    elif scheme == "without_replacement":
        support = [int(i) for i in np.flatnonzero(q64 > 0)]
        for t in itertools.permutations(support, min(k, len(support))):
            taken, prob = 0.0, 1.0
            for c in t:
                prob *= q64[c] / (1 - taken)
                taken += q64[c]
            yield t, prob
    else:  # deterministic: the top-k of q, ties to the lower id
        yield tuple(sorted(range(vocab), key=lambda i: (-q[i], i))[:k]), 1.0


def _bucket(k):
    """Rows of the one-node enumeration for a given K (fixed, so tests share compilations)."""
    return 1 << (31 * V**k * (k + 1) - 1).bit_length()


def _node_measures(toy, prefixes, k, draw_scheme, walk_scheme, wrong=None, realize=True):
    """For each prefix s: A_s [V] (probability that the root's accepted child is c, summed over
    draws) and R_s [V] (probability mass of "all rejected" times the residual it samples from).

    Draw probabilities come from :func:`_draws`; acceptance probabilities from the library kernels
    (``child_step``); with ``realize`` every event also runs through the real ``verify_tree``.
    """
    rows = []  # (prefix, tuple, prob)
    for s in prefixes:
        for t, prob in _draws(toy.q(s), k, draw_scheme):
            rows.append((s, t, prob))
    size = _bucket(k)
    assert len(rows) <= size
    p = np.stack([toy.p(s) for s, _, _ in rows])
    q = np.stack([toy.q(s) for s, _, _ in rows])
    tokens = np.zeros((len(rows), k), np.int32)
    valid = np.zeros((len(rows), k), bool)
    for i, (_, t, _) in enumerate(rows):
        tokens[i, :len(t)] = t
        valid[i, :len(t)] = True
    a, p_final = map(np.asarray, _sibling_kernels(*_pad_rows([p, q, tokens, valid], size), walk_scheme, wrong))
    a, p_final = a[:len(rows)].astype(np.float64), p_final[:len(rows)].astype(np.float64)

    events = []  # (row, e, weight); e = len(t): all rejected
    for i, (s, t, prob) in enumerate(rows):
        reach = prob
        for e in range(len(t) + 1):
            weight = reach * (a[i, e] if e < len(t) else 1.0)
            if weight > 0:
                events.append((i, e, weight))
            if e < len(t):
                reach *= 1 - a[i, e]

    residuals = p_final
    if realize:
        residuals = _realize_star(toy, rows, tokens, valid, events, k, walk_scheme)
    measures = {s: (np.zeros(V), np.zeros(V)) for s in prefixes}
    for ev, (i, e, weight) in enumerate(events):
        s, t, _ = rows[i]
        acc, rej = measures[s]
        if e < len(t):
            acc[t[e]] += weight
        else:
            rej += weight * (residuals[ev] if realize else p_final[i])
    return measures


def _realize_star(toy, rows, tokens, valid, events, k, scheme):
    """Run every event through the real jitted verify_tree on a one-level tree (the node's
    children only); assert the walk took it; return the walk's next_probs per event."""
    size = _bucket(k)
    assert len(events) <= size
    idx = np.array([i for i, _, _ in events])
    e_arr = np.array([e for _, e, _ in events])
    n_tokens = np.array([len(rows[i][1]) for i in idx])
    uniforms = np.full((len(events), k), 0.5, np.float32)
    for r, e in enumerate(e_arr):
        uniforms[r, :e] = R_REJECT
        if e < k:
            uniforms[r, e] = R_ACCEPT
    target = np.stack([np.concatenate([toy.p(rows[i][0])[None]] +
                                      [toy.p(rows[i][0] + (int(c),))[None] for c in tokens[i]]) for i in idx])
    draft = np.stack([np.concatenate([toy.q(rows[i][0])[None], np.zeros((k, V), np.float32)]) for i in idx])
    tok, val = tokens[idx], valid[idx]
    tok, val, target, draft, uniforms = _pad_rows([tok, val, target, draft, uniforms], size)
    tree = T.DraftTree(jnp.asarray(tok), jnp.full((size, k), -1, jnp.int32), jnp.ones((size, k), jnp.int32),
                       jnp.asarray(val), jnp.asarray(draft), 1, k)
    out = _verify_tree(tree, target, uniforms, jax.random.split(jax.random.key(0), size), scheme=scheme)
    n, path = np.asarray(out.n)[:len(events)], np.asarray(out.path)[:len(events), 0]
    accepted = e_arr < n_tokens
    np.testing.assert_array_equal(n, accepted.astype(int))  # the uniforms realize the event
    np.testing.assert_array_equal(path[accepted], e_arr[accepted])
    return np.asarray(out.next_probs, np.float64)[:len(events)]


# ------------------------------------------------------------ a round's distribution -------


def _round_measure(toy, depth, nodes):
    """M[(s, d)] = {m: array (V,)*m}: the probability that a round at prefix s with d levels of
    tree emits exactly the m tokens y (accepted path + next token)."""
    memo = {}

    def measure(s, d):
        if (s, d) in memo:
            return memo[s, d]
        if d == 0:  # a leaf: the next token is drawn from p at s
            out = {1: toy.p(s).astype(np.float64)}
        else:
            acc, rej = nodes[s]
            out = {1: rej.copy()}
            below = [measure(s + (c,), d - 1) for c in range(V)]
            for m in range(2, d + 2):
                out[m] = np.stack([acc[c] * below[c][m - 1] for c in range(V)])
        memo[s, d] = out
        return out

    return measure((), depth)


def _target_conditionals(toy, length):
    """P[j] = array (V,)*j + (V,): p after the prefix y_1..y_j (j = 0..length-1)."""
    return [np.stack([toy.p(s) for s in itertools.product(range(V), repeat=j)]).reshape((V,) * j + (V,))
            .astype(np.float64) for j in range(length)]


def _errors(toy, k, depth, draw_scheme, walk_scheme=None, wrong=None, realize=True):
    """Max |error| of the round's emitted-token distribution against the target: 'stream' (every
    prefix up to D + 1 tokens, shorter rounds continued by the target), 'first', 'joint' (first two
    tokens, a second round enumerated when the first emits one token), and the total mass."""
    walk_scheme = walk_scheme or draw_scheme
    prefixes = [s for n in range(max(depth - 1, 1) + 1) for s in itertools.product(range(V), repeat=n)]
    nodes = _node_measures(toy, prefixes, k, draw_scheme, walk_scheme, wrong, realize)
    m = _round_measure(toy, depth, nodes)
    cond = _target_conditionals(toy, depth + 1)
    err = {"mass": abs(sum(a.sum() for a in m.values()) - 1)}

    target = np.ones(())
    carry = np.zeros(())  # rounds shorter than j, continued by the target
    stream = 0.0
    for j in range(1, depth + 2):
        target = target[..., None] * cond[j - 1]
        if j > 1:
            carry = (carry + m[j - 1])[..., None] * cond[j - 1]
        emitted = carry + sum(m[i].reshape(m[i].shape[:j] + (-1,)).sum(-1) for i in range(j, depth + 2))
        stream = max(stream, np.abs(emitted - target).max())
        if j == 1:
            err["first"] = np.abs(emitted - target).max()
    err["stream"] = stream

    # first two tokens with the second round enumerated (not replaced by the target)
    joint = sum(m[i].reshape((V, V, -1)).sum(-1) for i in range(2, depth + 2))
    first_of_round = {y: nodes[(y,)][0] + nodes[(y,)][1] for y in range(V)}
    joint = joint + np.stack([m[1][y] * first_of_round[y] for y in range(V)])
    err["joint"] = np.abs(joint - cond[0][:, None] * cond[1]).max()
    return err


CASES = [(k, d, scheme) for k in (1, 2, 3) for d in (1, 2, 3) for scheme in SCHEMES]


def _case_toy(k, d, scheme):
    i = CASES.index((k, d, scheme))
    return Toy(seed=1000 + i, max_len=d + 1, **dict(zip(("temperature", "top_k", "top_p"), SETTINGS[i % 4])))


@pytest.mark.parametrize("k, d, scheme", CASES)
def test_exact_distribution_by_enumeration(k, d, scheme):
    err = _errors(_case_toy(k, d, scheme), k, d, scheme)
    assert max(err.values()) <= 1e-6, err


@pytest.mark.parametrize("scheme", SCHEMES)
def test_exact_distribution_greedy_target_and_drafter(scheme):
    toy = Toy(seed=7, max_len=3, temperature=0.0)
    err = _errors(toy, 2, 2, scheme)
    assert max(err.values()) <= 1e-6, err


@pytest.mark.parametrize("draw, walk, wrong, realize", [
    ("without_replacement", "iid", None, True),  # rejected children not removed from q
    ("deterministic", "without_replacement", None, True),  # top-k children verified with the drafter's q
    ("deterministic", "iid", None, True),
    ("iid", "iid", "no_residual", False),  # later siblings accepted by p/q without the residual update
])
def test_negative_controls_fail_enumeration(draw, walk, wrong, realize):
    """Each wrong variant must miss the target by far more than the 1e-6 tolerance."""
    toy = Toy(seed=5, max_len=3)
    err = _errors(toy, 2, 2, draw, walk, wrong, realize)
    assert err["first"] > 1e-2 and err["joint"] > 1e-2 and err["stream"] > 1e-2, err


def test_chain_of_one_child_is_the_chain_algorithm():
    """K = 1 ("iid") is Leviathan et al.'s chain; every scheme agrees there except through q."""
    toy = Toy(seed=11, max_len=4)
    for scheme in ("iid", "without_replacement"):
        err = _errors(toy, 1, 3, scheme)
        assert max(err.values()) <= 1e-6, (scheme, err)


def test_deterministic_child_worked_example():
    """q = (0.6, 0.4), p = (0.3, 0.7), the top-1 child is token 0 (deterministic). One-hot q
    (EAGLE-2) emits token 0 with probability 0.3 = p(0); the drafter's q would emit it with
    min(1, 0.3/0.6) = 0.5 (the residual norm(max(0, p - q)) = (0, 1) adds nothing)."""
    p, q = jnp.asarray([0.3, 0.7]), jnp.asarray([0.6, 0.4])
    for scheme, want in (("deterministic", 0.3), ("without_replacement", 0.5), ("iid", 0.5)):
        step = T.child_step(p, q, jnp.int32(0), scheme)
        emitted = float(step.accept_prob) + (1 - float(step.accept_prob)) * float(step.p_rejected[0])
        assert emitted == pytest.approx(want, abs=1e-7), scheme


def test_kernels_match_a_float64_reference():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(V, 0.6), 200).astype(np.float32)
    q = rng.dirichlet(np.full(V, 0.6), 200).astype(np.float32)
    p[rng.random(p.shape) < 0.2] = 0.0
    p = (p / np.maximum(p.sum(1, keepdims=True), 1e-9)).astype(np.float32)
    p[p.sum(1) == 0, 0] = 1.0
    tok = rng.integers(0, V, 200).astype(np.int32)
    step = jax.jit(T.child_step, static_argnames="scheme")
    for scheme in SCHEMES:
        out = step(p, q, tok, scheme=scheme)
        p64, q64 = p.astype(np.float64), q.astype(np.float64)
        qc = np.eye(V)[tok] if scheme == "deterministic" else q64
        rows = np.arange(200)
        ref_a = np.where(p64[rows, tok] > 0, np.minimum(1, p64[rows, tok] / np.where(qc[rows, tok] > 0, qc[rows, tok], 1)), 0)
        ref_a = np.where((qc[rows, tok] == 0) & (p64[rows, tok] > 0), 1.0, ref_a)
        res = np.maximum(p64 - qc, 0)
        ref_res = np.where(res.sum(1, keepdims=True) > 0, res / np.maximum(res.sum(1, keepdims=True), 1e-300), p64)
        np.testing.assert_allclose(out.accept_prob, ref_a, atol=1e-6)
        np.testing.assert_allclose(out.p_rejected, ref_res, atol=1e-6)
        np.testing.assert_allclose(out.q_child, qc, atol=0)
        if scheme == "without_replacement":
            kept = q64 * (np.arange(V) != tok[:, None])
            np.testing.assert_allclose(out.q_rejected, kept / kept.sum(1, keepdims=True), atol=1e-6)
        else:
            np.testing.assert_array_equal(out.q_rejected, q)


def test_acceptance_probability_is_the_decision_rule():
    """P(accepts(r, ..)) over r ~ U[0, 1) equals acceptance_probability, also at the edges."""
    p = jnp.asarray([0.0, 0.3, 0.5, 0.2], jnp.float32)
    q = jnp.asarray([0.4, 0.6, 0.0, 0.0], jnp.float32)
    for tok, want in [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.0), (4, 0.0), (-1, 0.0)]:
        a = float(T.acceptance_probability(p, q, jnp.int32(tok)))
        assert a == pytest.approx(want, abs=1e-7)
        assert bool(T.accepts(jnp.float32(0.0), p, q, jnp.int32(tok))) == (want > 0)
        assert bool(T.accepts(R_REJECT, p, q, jnp.int32(tok))) == (want == 1.0)


# ----------------------------------------------------- whole fixed trees, event by event ---


def _full_structure(k, d):
    """parents, depth (numpy [N]) of the full K-ary tree of depth D, level-major order."""
    parents, depth, level = [], [], [-1]
    for lev in range(1, d + 1):
        nxt = []
        for par in level:
            for _ in range(k):
                nxt.append(len(parents))
                parents.append(par)
                depth.append(lev)
        level = nxt
    return np.array(parents, np.int32), np.array(depth, np.int32)


def _tree_events(tokens, parents, depth, valid, p_all, q_all, k, scheme):
    """Every outcome of the walk on ONE fixed tree: for each final node u (root = -1), the
    probability that the walk accepts the path root → u and rejects all of u's children, with the
    uniforms that force it and the residual the kernels give. Returns a list of
    (u, path, weight, uniforms [N], p_final [V])."""
    n_nodes = tokens.size
    live = valid & (depth <= depth.max())
    children = {u: [i for i in range(n_nodes) if live[i] and parents[i] == u][:k] for u in range(-1, n_nodes)}
    rows = list(range(-1, n_nodes))
    kid_tok = np.zeros((len(rows), k), np.int32)
    kid_val = np.zeros((len(rows), k), bool)
    for r, u in enumerate(rows):
        kid_tok[r, :len(children[u])] = tokens[children[u]]
        kid_val[r, :len(children[u])] = True
    q_rows = q_all if q_all is not None else np.zeros_like(p_all)
    a, p_final = map(np.asarray, _sibling_kernels(p_all, q_rows, kid_tok, kid_val, scheme))
    a = a.astype(np.float64)

    out = []
    for u in rows:
        if u >= 0 and not live[u]:
            continue
        path = []
        v = u
        while v >= 0:
            path.append(v)
            v = int(parents[v])
        path = path[::-1]
        weight, uniforms = 1.0, np.full(n_nodes, 0.5, np.float32)
        for v, w in zip([-1] + path[:-1], path):
            j = children[v].index(w)
            for i in range(j):
                weight *= 1 - a[v + 1, i]
                uniforms[children[v][i]] = R_REJECT
            weight *= a[v + 1, j]
            uniforms[w] = R_ACCEPT
        for i, c in enumerate(children[u]):
            weight *= 1 - a[u + 1, i]
            uniforms[c] = R_REJECT
        if weight > 0:
            out.append((u, path, weight, uniforms, p_final[u + 1]))
    return out


def _random_tree(rng, k, d, scheme, vocab=V, drop=0.15):
    """One fixed tree (numpy): full K-ary structure, children drawn per the scheme from random q,
    some subtrees invalid; random p (with zeros) at every node."""
    parents, depth = _full_structure(k, d)
    n = parents.size
    p_all = rng.dirichlet(np.full(vocab, 0.5), n + 1)
    p_all[rng.random(p_all.shape) < 0.25] = 0
    p_all[np.arange(n + 1), rng.integers(0, vocab, n + 1)] += 0.1
    p_all = (p_all / p_all.sum(1, keepdims=True)).astype(np.float32)
    q_all = rng.dirichlet(np.full(vocab, 0.7), n + 1).astype(np.float32)
    tokens = np.zeros(n, np.int32)
    valid = rng.random(n) > drop
    for u in range(-1, n):
        kids = np.flatnonzero(parents == u)
        if kids.size == 0:
            continue
        q64 = q_all[u + 1].astype(np.float64) / q_all[u + 1].astype(np.float64).sum()
        if scheme == "iid":
            tokens[kids] = rng.choice(vocab, kids.size, p=q64)
        elif scheme == "without_replacement":
            tokens[kids] = rng.choice(vocab, kids.size, replace=False, p=q64)
        else:
            tokens[kids] = np.argsort(-q_all[u + 1], kind="stable")[:kids.size]
    for i in range(n):  # a valid node needs a valid parent
        if parents[i] >= 0 and not valid[parents[i]]:
            valid[i] = False
    return tokens, parents, depth, valid, p_all, q_all


@pytest.mark.parametrize("scheme", SCHEMES)
def test_walk_realizes_every_event_on_fixed_trees(scheme):
    """On whole trees (K = 3, D = 3, invalid subtrees) every outcome happens exactly as the kernels
    compose: the forced uniforms give the intended path, and next_probs is the kernel residual
    (or p at an accepted leaf); the outcome probabilities sum to 1."""
    rng = np.random.default_rng(21)
    k, d = 3, 3
    trees, events = [], []
    for _ in range(6):
        tokens, parents, depth, valid, p_all, q_all = _random_tree(rng, k, d, scheme)
        evs = _tree_events(tokens, parents, depth, valid, p_all, q_all, k, scheme)
        assert sum(e[2] for e in evs) == pytest.approx(1.0, abs=1e-6)
        trees += [(tokens, parents, depth, valid, p_all, q_all)] * len(evs)
        events += evs
    stack = lambda i: np.stack([t[i] for t in trees])
    tree = T.DraftTree.create(stack(0), stack(1), stack(2), stack(3), stack(5), max_depth=d, max_children=k)
    uniforms = np.stack([e[3] for e in events])
    out = _verify_tree(tree, stack(4), uniforms, jax.random.split(jax.random.key(1), len(events)), scheme=scheme)
    for b, (u, path, _, _, p_final) in enumerate(events):
        assert int(out.n[b]) == len(path)
        assert list(np.asarray(out.path[b])) == path + [-1] * (d - len(path))
        np.testing.assert_allclose(np.asarray(out.next_probs[b]), p_final, atol=1e-7)
        if u >= 0 and not any(trees[b][3] & (trees[b][1] == u)):  # an accepted leaf: the bonus p
            np.testing.assert_array_equal(np.asarray(out.next_probs[b]), trees[b][4][u + 1])


# ---------------------------------------------------------------- chi-square -------------
#
# Significance: every correct-path check uses alpha = 1e-3. With fixed keys the outcome is
# deterministic; a correct implementation fails a given check for about 1 in 1000 key choices, so
# about (number of checks) × 1e-3 here (~1%). The negative controls must fail with p < 1e-12.
# ``chi2_pvalue`` (tests/stats_helpers.py) merges bins of expected count < 5 and fails when fewer
# than 2 bins remain.

N_ROWS = 20_000


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chi_square_walk_against_kernels(scheme):
    """The real walk with random uniforms and keys, on one fixed tree, against the exact outcome
    distribution (final node, next token) that the kernels give."""
    rng = np.random.default_rng(31 + SCHEMES.index(scheme))
    k, d = 3, 3
    tokens, parents, depth, valid, p_all, q_all = _random_tree(rng, k, d, scheme)
    n = tokens.size
    exact = np.zeros((n + 1, V))
    for u, _, weight, _, p_final in _tree_events(tokens, parents, depth, valid, p_all, q_all, k, scheme):
        exact[u + 1] += weight * p_final
    b = lambda a: np.broadcast_to(a, (N_ROWS,) + a.shape)
    tree = T.DraftTree.create(b(tokens), b(parents), b(depth), b(valid), b(q_all), max_depth=d, max_children=k)
    key_u, key_s = jax.random.split(jax.random.key(40 + SCHEMES.index(scheme)))
    out = _verify_tree(tree, b(p_all), jax.random.uniform(key_u, (N_ROWS, n)),
                       jax.random.split(key_s, N_ROWS), scheme=scheme)
    nn, path, tok = np.asarray(out.n), np.asarray(out.path), np.asarray(out.next_token)
    last = np.where(nn > 0, path[np.arange(N_ROWS), np.maximum(nn - 1, 0)], -1)
    counts = np.zeros((n + 1, V), int)
    np.add.at(counts, (last + 1, tok), 1)
    assert chi2_pvalue(counts, exact) > 1e-3


@functools.partial(jax.jit, static_argnames=("k", "d", "draw", "walk"))
def _pipeline(key, p_depth, q_depth, k, d, draw, walk):
    """N_ROWS rounds: a full K-ary tree of depth D drafted per row with sample_children (q and p
    depend on the depth only), then the walk. Returns (first token, second token or -1, n)."""
    parents, depth = _full_structure(k, d)
    n = parents.size
    internal = [-1] + [i for i in range(n) if depth[i] < d]
    key_d, key_u, key_s = jax.random.split(key, 3)
    node_keys = jax.random.split(key_d, (N_ROWS, len(internal)))
    tokens = jnp.zeros((N_ROWS, n), jnp.int32)
    own = jnp.zeros((N_ROWS, n), bool)
    for j, u in enumerate(internal):
        kids = np.flatnonzero(parents == u)
        lev = 0 if u < 0 else depth[u]
        t, ok = jax.vmap(lambda kk: T.sample_children(kk, q_depth[lev], k, draw))(node_keys[:, j])
        tokens, own = tokens.at[:, kids].set(t), own.at[:, kids].set(ok)
    valid = own
    for i in range(n):
        if parents[i] >= 0:
            valid = valid.at[:, i].set(valid[:, i] & valid[:, parents[i]])
    rows_p = jnp.concatenate([p_depth[:1], p_depth[jnp.asarray(depth)]])  # [N+1, V] by depth
    rows_q = jnp.concatenate([q_depth[:1], q_depth[jnp.asarray(depth)]])
    bcast = lambda a: jnp.broadcast_to(a, (N_ROWS,) + a.shape)
    tree = T.DraftTree(tokens, bcast(jnp.asarray(parents)), bcast(jnp.asarray(depth)), valid, bcast(rows_q), d, k)
    out = T.verify_tree(tree, bcast(rows_p), jax.random.uniform(key_u, (N_ROWS, n)),
                        jax.random.split(key_s, N_ROWS), scheme=walk)
    toks = T.path_tokens(tree, out.path)
    first = jnp.where(out.n >= 1, toks[:, 0], out.next_token)
    second = jnp.where(out.n >= 2, toks[:, min(1, d - 1)], jnp.where(out.n == 1, out.next_token, -1))
    return first, second, out.n


def _depth_dists(seed, d, temperature=1.0, top_k=0, top_p=1.0, correlation=0.6):
    """p [D+1, V] and q [D+1, V] by depth (prefix-independent), via process_logits."""
    rng = np.random.default_rng(seed)
    lp = rng.standard_normal((d + 1, V))
    lq = correlation * lp + np.sqrt(1 - correlation**2) * rng.standard_normal((d + 1, V))
    proc = lambda x: np.asarray(process_logits(jnp.asarray(x, jnp.float32), temperature, top_k, top_p))
    return proc(lp), proc(lq)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chi_square_pipeline(scheme):
    """Drafting with sample_children + the walk: the first token ~ p_root, the second ~ p_1."""
    p, q = _depth_dists(50 + SCHEMES.index(scheme), 2, 1.0, 4, 1.0)
    first, second, n = map(np.asarray, _pipeline(jax.random.key(7), p, q, 3, 2, scheme, scheme))
    assert 0 < (n >= 1).mean() < 1 and (n == 2).any()
    assert chi2_pvalue(np.bincount(first, minlength=V), p[0]) > 1e-3
    assert chi2_pvalue(np.bincount(second[second >= 0], minlength=V), p[1]) > 1e-3


@pytest.mark.parametrize("draw, walk", [("without_replacement", "iid"), ("deterministic", "without_replacement")])
def test_chi_square_pipeline_negative_controls(draw, walk):
    p, q = _depth_dists(60, 2, correlation=0.3)
    first, _, _ = map(np.asarray, _pipeline(jax.random.key(8), p, q, 3, 2, draw, walk))
    assert chi2_pvalue(np.bincount(first, minlength=V), p[0]) < 1e-12
    first, _, _ = map(np.asarray, _pipeline(jax.random.key(8), p, q, 3, 2, draw, draw))
    assert chi2_pvalue(np.bincount(first, minlength=V), p[0]) > 1e-3


def test_sample_children_laws():
    """Gumbel-top-k is sequential sampling without replacement; iid draws are independent."""
    q = np.array([0.4, 0.3, 0.2, 0.1, 0.0], np.float32)
    keys = jax.random.split(jax.random.key(9), N_ROWS)
    draw = lambda kk, s: jax.jit(jax.vmap(functools.partial(T.sample_children, q=jnp.asarray(q), k=2, scheme=s)))(kk)
    tok, ok = map(np.asarray, draw(keys, "without_replacement"))
    assert ok.all() and (tok[:, 0] != tok[:, 1]).all() and (tok != 4).all()
    exact = np.array([[q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for b in range(V)] for a in range(V)])
    counts = np.zeros((V, V), int)
    np.add.at(counts, (tok[:, 0], tok[:, 1]), 1)
    assert chi2_pvalue(counts, exact) > 1e-3
    tok, ok = map(np.asarray, draw(keys, "iid"))
    counts = np.zeros((V, V), int)
    np.add.at(counts, (tok[:, 0], tok[:, 1]), 1)
    assert ok.all() and chi2_pvalue(counts, np.outer(q, q)) > 1e-3
    tok, ok = map(np.asarray, draw(keys[:2], "deterministic"))
    assert (tok == [0, 1]).all() and ok.all()
    one_hot = jnp.asarray([0, 0, 1, 0, 0], jnp.float32)
    tok, ok = T.sample_children(jax.random.key(0), one_hot, 3, "without_replacement")
    assert int(tok[0]) == 2 and list(np.asarray(ok)) == [True, False, False]


# ------------------------------------------------------- the chain (K = 1) is verify -------


def test_chain_tree_is_bit_identical_to_verify():
    rng = np.random.default_rng(4)
    b, gamma, vocab = 512, 4, 9
    p = rng.dirichlet(np.full(vocab, 0.5), (b, gamma + 1)).astype(np.float32)
    p[rng.random(p.shape) < 0.2] = 0
    p[..., 0] += 1e-3
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    q = rng.dirichlet(np.full(vocab, 0.5), (b, gamma)).astype(np.float32)
    q[: b // 4] = np.eye(vocab, dtype=np.float32)[rng.integers(0, vocab, (b // 4, gamma))]  # deterministic drafter
    q64 = q.astype(np.float64) / q.astype(np.float64).sum(-1, keepdims=True)
    tokens = np.array([[rng.choice(vocab, p=q64[i, j]) for j in range(gamma)] for i in range(b)], np.int32)
    tokens[rng.random(tokens.shape) < 0.05] = vocab + 3  # out of vocab: never accepted
    r = rng.random((b, gamma)).astype(np.float32)
    r[rng.random(r.shape) < 0.1] = 0.0
    keys = jax.random.split(jax.random.key(2), b)
    num_valid = rng.integers(0, gamma + 1, b).astype(np.int32)
    n, t, probs = jax.jit(verify)(tokens, q, p, r, keys, num_valid)
    tree = T.chain_tree(Proposal(tokens, q, num_valid, None))
    T.check_tree(tree)
    out = _verify_tree(tree, p, r, keys, scheme="iid")
    np.testing.assert_array_equal(out.n, n)
    np.testing.assert_array_equal(out.next_token, t)
    np.testing.assert_array_equal(out.next_probs, probs)
    want_path = np.where(np.arange(gamma)[None] < np.asarray(n)[:, None], np.arange(gamma)[None], -1)
    np.testing.assert_array_equal(out.path, want_path)
    np.testing.assert_array_equal(T.path_tokens(tree, out.path), np.where(want_path >= 0, tokens, -1))
    # limit_depth is verify's num_allowed
    full = T.chain_tree(Proposal(tokens, q, np.full(b, gamma, np.int32), None))
    out2 = _verify_tree(T.limit_depth(full, num_valid), p, r, keys, scheme="iid")
    np.testing.assert_array_equal(out2.next_token, t)
    np.testing.assert_array_equal(out2.next_probs, probs)
    # rows with a one-hot q (a deterministic drafter), all drafts in vocab: "deterministic" = "iid"
    det = _verify_tree(tree, p, r, keys, scheme="deterministic")
    one = np.flatnonzero((np.arange(b) < b // 4) & (tokens < vocab).all(1))
    assert one.size > 50
    np.testing.assert_array_equal(np.asarray(det.n)[one], np.asarray(n)[one])
    np.testing.assert_allclose(np.asarray(det.next_probs)[one], np.asarray(probs)[one], atol=1e-6)


# ----------------------------------------------------------------------- greedy ---------


def _hand_tree(valid=None):
    # node: 0    1    2    3    4    5    6
    tokens = [2, 3, 3, 4, 5, 1, 0]
    parents = [-1, -1, -1, 1, 2, 4, 0]
    depth = [1, 1, 1, 2, 2, 3, 2]
    valid = [True] * 7 if valid is None else valid
    return T.DraftTree.create([tokens], [parents], [depth], [valid], max_depth=3, max_children=3)


def _scores(argmaxes, vocab=6, tie=None):
    """[1, 8, V] scores with the given argmax per row (root first); ``tie`` rows get a tie."""
    s = np.zeros((1, len(argmaxes), vocab), np.float32)
    for i, a in enumerate(argmaxes):
        s[0, i, a] = 1.0
    for i, other in (tie or {}).items():
        s[0, i, other] = 1.0
    return s


def test_greedy_longest_path_through_duplicate_sibling():
    # root -> 3 (nodes 1 and 2 both match), after node 1 -> 0 (node 3 = 4 fails),
    # after node 2 -> 5 (node 4 matches), after node 4 -> 1 (node 5 matches), after node 5 -> 2
    scores = _scores([3, 1, 0, 5, 0, 1, 2, 0])
    out = _greedy(_hand_tree(), scores)
    assert int(out.n[0]) == 3 and list(np.asarray(out.path[0])) == [2, 4, 5] and int(out.next_token[0]) == 2


def test_greedy_invalid_nodes_and_no_match():
    scores = _scores([3, 1, 0, 5, 0, 1, 2, 0])
    out = _greedy(_hand_tree([True, True, True, True, True, False, True]), scores)
    assert int(out.n[0]) == 2 and list(np.asarray(out.path[0])) == [2, 4, -1] and int(out.next_token[0]) == 1
    out = _greedy(_hand_tree([True, True, False, True, False, False, True]), scores)  # node 2 invalid
    assert int(out.n[0]) == 1 and list(np.asarray(out.path[0])) == [1, -1, -1] and int(out.next_token[0]) == 0
    out = _greedy(_hand_tree(), _scores([5, 0, 0, 0, 0, 0, 0, 0]))
    assert int(out.n[0]) == 0 and list(np.asarray(out.path[0])) == [-1, -1, -1] and int(out.next_token[0]) == 5


def test_greedy_ties_take_the_lowest_id():
    # root row ties between 2 and 3: argmax is 2 -> node 0 matches, nodes 1/2 do not;
    # after node 0 the tie 0/4 gives 0 -> node 6 matches; after node 6 the tie 1/3 gives 1
    scores = _scores([3, 4, 0, 0, 0, 0, 0, 3], tie={0: 2, 1: 0, 7: 1})
    out = _greedy(_hand_tree(), scores)
    assert int(out.n[0]) == 2 and list(np.asarray(out.path[0])) == [0, 6, -1] and int(out.next_token[0]) == 1
    # equally deep matches: the lowest node id wins (nodes 1 and 2 both match, nothing below)
    out = _greedy(_hand_tree(), _scores([3, 0, 0, 0, 0, 0, 0, 0]))
    assert int(out.n[0]) == 1 and list(np.asarray(out.path[0])) == [1, -1, -1]


def test_greedy_matches_autoregressive_on_random_trees():
    """The emitted tokens are the target's own greedy continuation, and the exact walk with
    one-hot p agrees (trees without duplicate siblings)."""
    rng = np.random.default_rng(5)
    k, d, vocab = 2, 3, 4
    parents, depth = _full_structure(k, d)
    n = parents.size
    toy = Toy(seed=3, max_len=d + 1, temperature=0.0, vocab=vocab)
    rows = []
    for _ in range(64):
        tokens = np.zeros(n, np.int32)
        for u in range(-1, n):
            kids = np.flatnonzero(parents == u)
            tokens[kids] = rng.choice(vocab, kids.size, replace=False)
        rows.append(tokens)
    tokens = np.stack(rows)
    valid = rng.random(tokens.shape) > 0.1
    for i in range(n):
        if parents[i] >= 0:
            valid[:, i] &= valid[:, parents[i]]
    tree = T.DraftTree.create(tokens, np.broadcast_to(parents, tokens.shape), np.broadcast_to(depth, tokens.shape),
                              valid, max_depth=d, max_children=k)
    paths = np.asarray(T.node_paths(tree))
    prefix = lambda b, i: tuple(int(tokens[b, j]) for j in paths[b, i] if j >= 0)
    p = np.stack([np.stack([toy.p(())] + [toy.p(prefix(b, i)) for i in range(n)]) for b in range(64)])
    out = _greedy(tree, p)
    for b in range(64):
        emitted = list(np.asarray(T.path_tokens(tree, out.path)[b, : int(out.n[b])])) + [int(out.next_token[b])]
        ar, s = [], ()
        for _ in range(len(emitted)):
            ar.append(int(np.argmax(toy.p(s))))
            s = s + (ar[-1],)
        assert emitted == ar
    walk = _verify_tree(tree, p, np.full(tokens.shape, 0.5, np.float32), jax.random.split(jax.random.key(0), 64),
                        scheme="deterministic")
    np.testing.assert_array_equal(walk.n, out.n)
    np.testing.assert_array_equal(walk.path, out.path)
    np.testing.assert_array_equal(walk.next_token, out.next_token)


# ------------------------------------------------------------ structure helpers --------


def test_masks_positions_paths_children():
    tree = _hand_tree([True, True, True, True, True, True, False])
    anc = np.asarray(T.ancestor_matrix(tree))[0]
    want = np.zeros((7, 7), bool)
    want[3, 1] = want[4, 2] = want[5, 4] = want[5, 2] = want[6, 0] = True
    np.testing.assert_array_equal(anc, want)
    np.testing.assert_array_equal(np.asarray(T.attention_mask(tree))[0], want | np.eye(7, dtype=bool))
    block = np.asarray(T.block_attention_mask(tree))[0]
    assert block.shape == (8, 8) and block[0].tolist() == [True] + [False] * 7 and block[1:, 0].all()
    np.testing.assert_array_equal(block[1:, 1:], want | np.eye(7, dtype=bool))
    np.testing.assert_array_equal(T.positions(tree, jnp.asarray([10])), [[9, 10, 10, 10, 11, 11, 12, 11]])
    paths = np.asarray(T.node_paths(tree))[0]
    assert paths[5].tolist() == [2, 4, 5] and paths[3].tolist() == [1, 3, -1] and paths[0].tolist() == [0, -1, -1]
    table = np.asarray(T.children_table(tree))[0]
    assert table[0].tolist() == [0, 1, 2] and table[1].tolist() == [-1, -1, -1]  # node 6 is invalid
    assert table[3].tolist() == [4, -1, -1] and table[5].tolist() == [5, -1, -1]
    T.check_tree(tree, vocab_size=6)


def test_chain_tree_fields():
    q = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(5), (2, 3)), jnp.float32)
    tree = T.chain_tree(Proposal(jnp.asarray([[1, 2, 3], [4, 0, 1]]), q, jnp.asarray([3, 1]), None))
    assert tree.max_depth == 3 and tree.max_children == 1
    np.testing.assert_array_equal(tree.parents, [[-1, 0, 1]] * 2)
    np.testing.assert_array_equal(tree.depth, [[1, 2, 3]] * 2)
    np.testing.assert_array_equal(tree.valid, [[True] * 3, [True, False, False]])
    np.testing.assert_array_equal(tree.draft_probs[:, :3], q)
    np.testing.assert_array_equal(tree.draft_probs[:, 3], 0)


@pytest.mark.parametrize("edit, message", [
    (dict(parents=[[-1, 1, 0]]), "parent 1 must be"),
    (dict(parents=[[-1, -2, 0]]), "parent -2"),
    (dict(depth=[[1, 1, 3]]), "depth 3, expected 2"),
    (dict(valid=[[False, True, True]], parents=[[-1, 0, 0]], depth=[[1, 2, 2]]), "its parent 0 is invalid"),
    (dict(parents=[[-1, -1, -1]], depth=[[1, 1, 1]]), "3 valid children > max_children 2"),
    (dict(tokens=[[0, 9, 1]]), "token 9 outside"),
])
def test_check_tree_errors(edit, message):
    fields = dict(tokens=[[0, 1, 2]], parents=[[-1, -1, 0]], depth=[[1, 1, 2]], valid=[[True] * 3])
    fields.update(edit)
    tree = T.DraftTree.create(fields["tokens"], fields["parents"], fields["depth"], fields["valid"],
                              max_depth=2, max_children=2)
    with pytest.raises(ValueError, match=message):
        T.check_tree(tree, vocab_size=5)


def test_argument_errors():
    tree = _hand_tree()
    p = jnp.ones((1, 8, 6)) / 6
    with pytest.raises(ValueError, match="scheme must be one of"):
        T.verify_tree(tree, p, jnp.zeros((1, 7)), jax.random.split(jax.random.key(0), 1), scheme="topk")
    with pytest.raises(ValueError, match="needs tree.draft_probs"):
        T.verify_tree(tree, p, jnp.zeros((1, 7)), jax.random.split(jax.random.key(0), 1), scheme="iid")
    with pytest.raises(ValueError, match="target_probs must be"):
        T.verify_tree(tree, p[:, :7], jnp.zeros((1, 7)), jax.random.split(jax.random.key(0), 1), scheme="deterministic")
    with pytest.raises(ValueError, match="uniforms must be"):
        T.verify_tree(tree, p, jnp.zeros((1, 8)), jax.random.split(jax.random.key(0), 1), scheme="deterministic")
    with pytest.raises(ValueError, match="target_scores must be"):
        T.verify_tree_greedy(tree, p[:, 1:])
    with pytest.raises(ValueError, match="draft_probs must be"):
        T.DraftTree.create([[0]], [[-1]], [[1]], draft_probs=jnp.ones((1, 1, 4)))
    with pytest.raises(ValueError, match="all \\[B, N\\]"):
        T.DraftTree.create([[0, 1]], [[-1]], [[1]])
    with pytest.raises(ValueError, match="max_depth must be"):
        T.DraftTree.create([[0]], [[-1]], [[1]], max_depth=0)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        T.sample_children(jax.random.key(0), jnp.ones(4) / 4, 5, "iid")
    with pytest.raises(ValueError, match="γ >= 1"):
        T.chain_tree(Proposal(jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0, 4)), jnp.zeros(1, jnp.int32), None))


# ------------------------------------------------------------- EAGLE-2 dynamic tree -------


def _toy_expand(toy, max_len):
    """expand(level, frontier, pool) for build_dynamic_tree: the toy drafter's q after each
    frontier node's path (looked up by prefix, in jnp)."""
    q_table = jnp.asarray(toy.q_table)
    offsets = np.cumsum([0] + [V**n for n in range(max_len + 1)])

    def expand(level, frontier, pool):
        paths = T.node_paths(pool)  # [B, C, D]
        rows = jnp.take_along_axis(paths, frontier[:, :, None], axis=1)[..., :level]  # [B, W, level]
        toks = jnp.take_along_axis(pool.tokens, rows.reshape(rows.shape[0], -1), axis=1).reshape(rows.shape)
        code = jnp.sum(toks * (V ** jnp.arange(level - 1, -1, -1)), axis=-1)
        return q_table[offsets[level] + code]

    return expand


def _log32(x):
    x = np.float32(x)
    return np.float32(np.log(x)) if x > 0 else np.float32(-np.inf)


def _reference_dynamic(toy, depth, k, w, n):
    """EAGLE-2's selection written plainly (python lists): candidates (score, id, token, parent, prefix)."""
    cands = []
    for j, tok in enumerate(sorted(range(V), key=lambda i: (-toy.q(())[i], i))[:k]):
        cands.append(dict(id=j, tok=tok, parent=-1, depth=1, prefix=(tok,), score=_log32(toy.q(())[tok])))
    level = cands[:]
    for lev in range(2, depth + 1):
        frontier = sorted(level, key=lambda c: (-c["score"], c["id"]))[:w]
        level = []
        for f in frontier:
            q = toy.q(f["prefix"])
            for tok in sorted(range(V), key=lambda i: (-q[i], i))[:k]:
                c = dict(id=len(cands), tok=tok, parent=f["id"], depth=lev, prefix=f["prefix"] + (tok,),
                         score=np.float32(f["score"]) + _log32(q[tok]))
                cands.append(c)
                level.append(c)
    keep = sorted(sorted(cands, key=lambda c: (-c["score"], c["id"]))[:n], key=lambda c: c["id"])
    node_of = {c["id"]: i for i, c in enumerate(keep)}
    return ([c["tok"] for c in keep], [node_of[c["parent"]] if c["parent"] >= 0 else -1 for c in keep],
            [c["depth"] for c in keep], [c["prefix"] for c in keep])


@pytest.mark.parametrize("depth, k, w, n", [(3, 3, 2, 8), (3, 2, 2, 6), (2, 4, 1, 5), (1, 3, 3, 3), (3, 3, 3, 21)])
def test_dynamic_tree_matches_reference_and_is_exact(depth, k, w, n):
    toy = Toy(seed=77 + n, max_len=depth + 1, temperature=1.0, top_k=3)  # k = 4 reaches q = 0: invalid nodes
    build = jax.jit(lambda r: T.build_dynamic_tree(r, _toy_expand(toy, depth + 1), depth=depth, children=k,
                                                   expand_width=w, num_nodes=n))
    tree, scores = build(jnp.asarray(toy.q(()))[None])
    tokens, parents, depths, prefixes = _reference_dynamic(toy, depth, k, w, n)
    assert np.asarray(tree.tokens)[0].tolist() == tokens
    assert np.asarray(tree.parents)[0].tolist() == parents
    assert np.asarray(tree.depth)[0].tolist() == depths
    T.check_tree(tree, vocab_size=V)
    assert tree.draft_probs is None and tree.max_depth == depth and tree.max_children == k
    # the N kept nodes have the N highest path probabilities (score = Σ log q along the path)
    want = [sum(np.float64(_log32(toy.q(s[:i])[s[i]])) for i in range(len(s))) for s in prefixes]
    np.testing.assert_allclose(np.asarray(scores)[0], want, atol=1e-5)
    valid = np.asarray(tree.valid)[0]
    assert valid.tolist() == [np.isfinite(x) for x in want]

    # exact: enumerate every outcome of the deterministic walk on this tree (target = the toy's p)
    p_all = np.stack([toy.p(())] + [toy.p(s) for s in prefixes])
    events = _tree_events(np.asarray(tree.tokens)[0], np.asarray(tree.parents)[0], np.asarray(tree.depth)[0], valid,
                          p_all, None, k, "deterministic")
    m = {j: np.zeros((V,) * j) for j in range(1, depth + 2)}
    for u, path, weight, _, p_final in events:
        m[len(path) + 1][tuple(int(tokens[i]) for i in path)] += weight * p_final
    cond = _target_conditionals(toy, depth + 1)
    target, carry = np.ones(()), np.zeros(())
    for j in range(1, depth + 2):
        target = target[..., None] * cond[j - 1]
        if j > 1:
            carry = (carry + m[j - 1])[..., None] * cond[j - 1]
        emitted = carry + sum(m[i].reshape(m[i].shape[:j] + (-1,)).sum(-1) for i in range(j, depth + 2))
        assert np.abs(emitted - target).max() <= 1e-6


def test_dynamic_tree_argument_errors():
    root = jnp.ones((1, 4)) / 4
    expand = lambda level, frontier, pool: jnp.ones(frontier.shape + (4,)) / 4
    with pytest.raises(ValueError, match="num_nodes"):
        T.build_dynamic_tree(root, expand, depth=2, children=2, expand_width=1, num_nodes=5)
    with pytest.raises(ValueError, match="expand_width"):
        T.build_dynamic_tree(root, expand, depth=2, children=2, expand_width=3, num_nodes=2)
    with pytest.raises(ValueError, match="children"):
        T.build_dynamic_tree(root, expand, depth=2, children=5, expand_width=1, num_nodes=2)
    with pytest.raises(ValueError, match="expand must return"):
        T.build_dynamic_tree(root, lambda *a: jnp.ones((1, 4)), depth=2, children=2, expand_width=1, num_nodes=2)
