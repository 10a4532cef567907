"""Tests for specjax.core.acceptance: exactness by enumeration, chi-square, edge cases.

Every check goes through the real jitted ``verify`` / ``verify_row``. Two
deliberately WRONG variants are negative controls; the tests assert that they
fail, so the checks cannot pass vacuously:

* ``_wrong_verify``: on rejection, resample from ``p_{n+1}`` instead of the
  residual ``norm(max(0, p - q))`` (a common bug);
* passing a ``q`` to ``verify`` that is not the distribution the draft was
  actually sampled from.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stats_helpers import R_REJECT, chain_events, chi2_pvalue

from specjax.core.sampling import process_logits, sample
from specjax.core.acceptance import verify, verify_row

_verify = jax.jit(verify)
_verify_row = jax.jit(verify_row)
_process = jax.jit(process_logits)



def _wrong_verify_row(draft_tokens, draft_probs, target_probs, uniforms, key, num_allowed):
    """NEGATIVE CONTROL: same acceptance, but resamples from p on rejection."""
    n, _, _ = verify_row(draft_tokens, draft_probs, target_probs, uniforms, key, num_allowed)
    next_probs = target_probs[n]
    return n, sample(key, next_probs), next_probs


@jax.jit
def _wrong_verify(draft_tokens, draft_probs, target_probs, uniforms, keys, num_allowed):
    return jax.vmap(_wrong_verify_row)(draft_tokens, draft_probs, target_probs, uniforms, keys, num_allowed)


# ---------------------------------------------------- exact enumeration -----


class Model:
    """A toy autoregressive model: a fixed random distribution per prefix."""

    def __init__(self, vocab, seed, kind, role):
        self.vocab, self.seed, self.kind, self.role = vocab, seed, kind, role

    @functools.lru_cache(maxsize=None)
    def __call__(self, prefix: tuple) -> np.ndarray:
        v = self.vocab
        rng = np.random.default_rng([self.seed, len(prefix), *prefix])
        # the target and the drafter draw from different streams, except "identical"
        stream = np.random.default_rng([self.seed, 7 + (self.role == "q"), len(prefix), *prefix])
        kind = self.kind
        if kind == "identical":
            stream = rng
        if kind == "dense":
            d = stream.dirichlet(np.full(v, 0.7))
        elif kind in ("sparse", "identical"):
            d = stream.dirichlet(np.full(v, 1.0))
            d[stream.random(v) < 0.5] = 0.0
            if d.sum() == 0:
                d[stream.integers(v)] = 1.0
        elif kind == "one-hot":  # greedy target and greedy drafter
            d = np.eye(v)[stream.integers(v)]
        elif kind == "disjoint":  # p on even ids, q on odd ids
            d = stream.dirichlet(np.full(v, 1.0)) * (np.arange(v) % 2 == (self.role == "q"))
        elif kind == "one-hot-q":  # deterministic drafter (n-gram), sampled target
            d = np.eye(v)[stream.integers(v)] if self.role == "q" else stream.dirichlet(np.full(v, 1.0))
        elif kind == "one-hot-p":  # greedy target, sampled drafter
            d = np.eye(v)[stream.integers(v)] if self.role == "p" else stream.dirichlet(np.full(v, 1.0))
        else:
            raise ValueError(kind)
        d = (d / d.sum()).astype(np.float32)
        return d


def _round_events(prefix, target, drafter, gamma, num_allowed):
    """Every (draft, first-rejection position) event of one round, with its probability.

    Yields (prob, draft tokens, q [γ,V], p [γ+1,V], uniforms [γ], expected n).
    Draft probability is Π q_i(x_i); "first rejection at position j" has
    probability Π_{i<j} a_i · (1 − a_j), "all accepted" Π a_i, with
    a_i = min(1, p_i(x_i) / q_i(x_i)) computed in float64 from the float32 inputs.
    """
    vocab = target(()).size
    for draft in itertools.product(range(vocab), repeat=gamma):
        qs = np.stack([drafter(prefix + draft[:i]) for i in range(gamma)])
        ps = np.stack([target(prefix + draft[:i]) for i in range(gamma + 1)])
        for prob, r, j in chain_events(draft, qs, ps):
            yield prob, draft, qs, ps, r, min(j, num_allowed)


def _run_events(events, verify_fn, num_allowed):
    """Realize events through the jitted verify.

    Rows are padded to a size fixed by (γ, V) — the bound V^γ·(γ+1)·(V+1) on
    the number of events, rounded up to a power of two — so that every test
    with the same γ and V shares one compilation.
    """
    rows = len(events)
    gamma, vocab = events[0][2].shape
    bound = vocab**gamma * (gamma + 1) * (vocab + 1)
    size = max(256, 1 << (bound - 1).bit_length())
    assert rows <= size
    pad = lambda a: np.concatenate([a, np.repeat(a[:1], size - rows, 0)])
    tokens = pad(np.array([e[1] for e in events], np.int32))
    qs = pad(np.stack([e[2] for e in events]))
    ps = pad(np.stack([e[3] for e in events]))
    rs = pad(np.stack([e[4] for e in events]))
    keys = jax.random.split(jax.random.key(0), size)
    n, _, next_probs = verify_fn(tokens, qs, ps, rs, keys, np.full(size, num_allowed, np.int32))
    n, next_probs = np.asarray(n)[:rows], np.asarray(next_probs, np.float64)[:rows]
    expected_n = np.array([e[5] for e in events])
    # the uniforms realize exactly the intended event
    np.testing.assert_array_equal(n, expected_n)
    return n, next_probs


def _first_two_tokens(target, drafter, gamma, num_allowed=None, verify_fn=_verify):
    """Exact distribution of the first emitted token and of the first two.

    The second token may come from a second round (when the first round emits a
    single token); that round starts from the emitted prefix (y,) and is
    enumerated through the real function as well.
    """
    num_allowed = gamma if num_allowed is None else num_allowed
    vocab = target(()).size
    prefixes = [()] + [(y,) for y in range(vocab)]
    events, owner = [], []
    for k, prefix in enumerate(prefixes):
        evs = list(_round_events(prefix, target, drafter, gamma, num_allowed))
        events += evs
        owner += [k] * len(evs)
    n, next_probs = _run_events(events, verify_fn, num_allowed)
    owner = np.array(owner)

    first = np.zeros((len(prefixes), vocab))  # first-token distribution per prefix
    for i, (prob, draft, *_rest) in enumerate(events):
        if n[i] >= 1:
            first[owner[i], draft[0]] += prob
        else:
            first[owner[i]] += prob * next_probs[i]

    joint = np.zeros((vocab, vocab))
    for i, (prob, draft, *_rest) in enumerate(events):
        if owner[i] != 0:
            continue
        if n[i] >= 2:
            joint[draft[0], draft[1]] += prob
        elif n[i] == 1:
            joint[draft[0]] += prob * next_probs[i]
        else:  # one token this round; the second is the next round's first
            joint += prob * next_probs[i][:, None] * first[1:]
    return first[0], joint, first


def _target_joint(target):
    vocab = target(()).size
    p1 = target(()).astype(np.float64)
    return p1[:, None] * np.stack([target((y,)).astype(np.float64) for y in range(vocab)])


KINDS = ["dense", "sparse", "one-hot", "identical", "disjoint", "one-hot-q", "one-hot-p"]


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_exact_distribution_by_enumeration(kind, gamma):
    vocab = {1: 8, 2: 7, 3: 5}[gamma]
    seed = 100 * gamma + KINDS.index(kind)
    target, drafter = Model(vocab, seed, kind, "p"), Model(vocab, seed, kind, "q")
    first, joint, per_prefix = _first_two_tokens(target, drafter, gamma)
    np.testing.assert_allclose(first, target(()), atol=1e-6, rtol=0)
    for y in range(vocab):
        np.testing.assert_allclose(per_prefix[1 + y], target((y,)), atol=1e-6, rtol=0)
    np.testing.assert_allclose(joint, _target_joint(target), atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma, num_allowed", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_exact_distribution_with_fewer_allowed(gamma, num_allowed):
    vocab = {2: 7, 3: 5}[gamma]
    for kind in ("dense", "sparse"):
        seed = 10 * gamma + num_allowed
        target, drafter = Model(vocab, seed, kind, "p"), Model(vocab, seed, kind, "q")
        first, joint, _ = _first_two_tokens(target, drafter, gamma, num_allowed)
        np.testing.assert_allclose(first, target(()), atol=1e-6, rtol=0)
        np.testing.assert_allclose(joint, _target_joint(target), atol=1e-6, rtol=0)


def test_negative_control_fails_enumeration():
    """The resample-from-p variant must NOT reproduce the target (else the test is blind)."""
    vocab, gamma = 6, 2
    target, drafter = Model(vocab, 5, "dense", "p"), Model(vocab, 5, "dense", "q")
    first, joint, _ = _first_two_tokens(target, drafter, gamma, verify_fn=_wrong_verify)
    assert np.abs(first - target(())).max() > 1e-2
    assert np.abs(joint - _target_joint(target)).max() > 1e-2


class _Constant:
    def __init__(self, probs):
        self.probs = np.asarray(probs, np.float32)

    def __call__(self, prefix):
        return self.probs


def test_seed_example_exact_numbers():
    """p = (.5,.1,.3,.1), q = (.2,.4,.15,.25): β = Σ min(p, q) = 0.55, P(token 1) = 0.10.

    Resampling from p on rejection instead gives P(token 1) = 0.4·(0.1/0.4) +
    (1 − β)·0.1 = 0.145: the wrong variant differs.
    """
    p, q = [0.5, 0.1, 0.3, 0.1], [0.2, 0.4, 0.15, 0.25]
    target, drafter = _Constant(p), _Constant(q)
    events = list(_round_events((), target, drafter, 1, 1))
    n, _ = _run_events(events, _verify, 1)
    beta = sum(e[0] for e, k in zip(events, n) if k == 1)
    assert beta == pytest.approx(0.55, abs=1e-7)

    first, _, _ = _first_two_tokens(target, drafter, 1)
    np.testing.assert_allclose(first, p, atol=1e-6, rtol=0)
    assert first[1] == pytest.approx(0.10, abs=1e-6)

    wrong, _, _ = _first_two_tokens(target, drafter, 1, verify_fn=_wrong_verify)
    assert wrong[1] == pytest.approx(0.145, abs=1e-6)


# --------------------------------------------------------- chi-square -------
#
# Significance: each correct-path check uses alpha = 1e-3 (with fixed keys the
# outcome is deterministic; a correct implementation fails a given check for
# about 1 in 1000 key choices, so ~N × 1e-3 for the N checks here). The
# negative controls must fail with p < 1e-12.
# ``chi2_pvalue`` (tests/stats_helpers.py) merges bins of expected count < 5
# and fails when fewer than 2 bins remain.

N_ROWS = 20_000
GAMMA = 3


@functools.partial(jax.jit, static_argnames=("wrong",))
def _sampled_round(key, p, q_actual, q_claimed, num_allowed, wrong=False):
    """N_ROWS independent rounds with real draft sampling and real uniforms.

    p [γ+1, V], q_actual [γ, V] (what the drafts are sampled from), q_claimed
    [γ, V] (what verify is told). Prefix-independent p_i and q_i. Returns
    (first emitted token [N], second emitted token [N], n [N]); the second is
    -1 where the round emitted one token only.
    """
    draft_key, r_key, next_key = jax.random.split(key, 3)
    draft_keys = jax.random.split(draft_key, GAMMA)
    drafts = jnp.stack(
        [sample(draft_keys[i], jnp.broadcast_to(q_actual[i], (N_ROWS, q_actual.shape[-1]))) for i in range(GAMMA)],
        axis=1,
    )
    r = jax.random.uniform(r_key, (N_ROWS, GAMMA))
    b = lambda a: jnp.broadcast_to(a, (N_ROWS,) + a.shape)
    fn = _wrong_verify if wrong else verify
    n, t, _ = fn(drafts, b(q_claimed), b(p), r, jax.random.split(next_key, N_ROWS), jnp.full((N_ROWS,), num_allowed))
    first = jnp.where(n >= 1, drafts[:, 0], t)
    second = jnp.where(n >= 2, drafts[:, 1], jnp.where(n == 1, t, -1))
    return first, second, n


def _chi2_pvalue(samples, probs):
    """Chi-square p-value of the token ids ``samples`` against ``probs`` [V] (the shared helper:
    small bins merged, an impossible test fails, an emitted zero-probability token fails)."""
    return chi2_pvalue(np.bincount(samples, minlength=np.size(probs)), probs)


V_PAD = 50  # every setting is padded to this vocabulary: one compilation


def _processed(seed, vocab, temperature, top_k, top_p, correlation=0.6):
    """Target p [γ+1, V_PAD] and drafter q [γ, V_PAD] (+ an unrelated q) via process_logits.

    Ids >= vocab get logit -inf, i.e. probability 0 (a padded vocabulary):
    the chi-square helper checks that they are never emitted.
    """
    rng = np.random.default_rng(seed)
    lp = rng.standard_normal((GAMMA + 1, vocab)) * 2
    lq = correlation * lp[:GAMMA] + np.sqrt(1 - correlation**2) * rng.standard_normal((GAMMA, vocab)) * 2
    pad = lambda x: np.pad(x, [(0, 0), (0, V_PAD - vocab)], constant_values=-np.inf)
    proc = lambda x: np.asarray(
        _process(
            jnp.asarray(pad(x), jnp.float32),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
        )
    )
    return proc(lp), proc(lq), proc(rng.standard_normal((GAMMA, vocab)) * 2)


SETTINGS = [  # (vocab, temperature, top_k, top_p)
    (10, 1.0, 0, 1.0),
    (24, 0.7, 6, 1.0),
    (50, 1.3, 0, 0.8),
    (50, 1.0, 12, 0.9),
    (24, 2.0, 0, 1.0),
]


@pytest.mark.parametrize("vocab, temperature, top_k, top_p", SETTINGS)
def test_chi_square_first_and_second_token(vocab, temperature, top_k, top_p):
    p, q, _ = _processed(vocab + top_k, vocab, temperature, top_k, top_p)
    first, second, n = map(np.asarray, _sampled_round(jax.random.key(vocab + top_k), p, q, q, GAMMA))
    assert 0 < (n >= 1).mean() < 1 and (n == GAMMA).any()  # both paths exercised
    assert _chi2_pvalue(first, p[0]) > 1e-3
    # given that the round emitted >= 2 tokens, the second is ~ p_2 (p is prefix-free)
    assert _chi2_pvalue(second[n >= 1], p[1]) > 1e-3


def test_chi_square_greedy_is_target_argmax():
    p, q, _ = _processed(3, 30, 0.0, 0, 1.0, correlation=0.9)
    assert p.shape == (GAMMA + 1, V_PAD)
    first, second, n = map(np.asarray, _sampled_round(jax.random.key(3), p, q, q, GAMMA))
    assert np.all(first == np.argmax(p[0]))
    assert np.all(second[n >= 1] == np.argmax(p[1]))
    # acceptance is an exact prefix match of the argmaxes
    match = np.argmax(q, -1) == np.argmax(p[:GAMMA], -1)
    assert np.all(n == np.cumprod(match).sum())


@pytest.mark.parametrize("vocab, temperature, top_k, top_p", [SETTINGS[0], SETTINGS[3]])
def test_chi_square_negative_controls_fail(vocab, temperature, top_k, top_p):
    p, q, q_other = _processed(vocab + top_k, vocab, temperature, top_k, top_p)
    key = jax.random.key(vocab + top_k)
    good, _, _ = map(np.asarray, _sampled_round(key, p, q, q, GAMMA))
    assert _chi2_pvalue(good, p[0]) > 1e-3
    # (a) resample from p instead of the residual
    wrong_a, _, _ = map(np.asarray, _sampled_round(key, p, q, q, GAMMA, wrong=True))
    assert _chi2_pvalue(wrong_a, p[0]) < 1e-12
    # (b) verify is told a q that is not what the drafts were sampled from
    q_claimed = 0.5 * q + 0.5 * q_other  # same support as q, so no zero-p leak
    wrong_b, _, _ = map(np.asarray, _sampled_round(key, p, q, q_claimed.astype(np.float32), GAMMA))
    assert _chi2_pvalue(wrong_b, p[0]) < 1e-12


def test_chi_square_num_allowed_zero_is_plain_sampling():
    p, q, _ = _processed(17, 24, 1.0, 0, 1.0)
    first, second, n = map(np.asarray, _sampled_round(jax.random.key(17), p, q, q, 0))
    assert np.all(n == 0) and np.all(second == -1)
    assert _chi2_pvalue(first, p[0]) > 1e-3


# ---------------------------------------------------------- edge cases ------


def _row(p, q, tokens, r, num_allowed):
    p, q = np.asarray(p, np.float32), np.asarray(q, np.float32)
    n, t, probs = _verify_row(
        jnp.asarray(tokens, jnp.int32), q, p, jnp.asarray(r, jnp.float32), jax.random.key(0), jnp.int32(num_allowed)
    )
    return int(n), int(t), np.asarray(probs)


def test_r_zero_with_p_zero_is_rejected():
    p = [[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]
    q = [[0.7, 0.1, 0.1, 0.1]]
    n, t, probs = _row(p, q, [0], [0.0], 1)  # q(0) = 0.7, p(0) = 0, r = 0
    assert n == 0
    np.testing.assert_allclose(probs, [0.0, 0.5, 0.5, 0.0], atol=1e-7)  # residual
    assert t in (1, 2)
    n, _, _ = _row(p, q, [3], [0.0], 1)
    assert n == 0


def test_acceptance_threshold_is_strict():
    # accept iff r * q(x) < p(x): p/q = 0.5 exactly in float32 (0.3f == 0.6f / 2)
    p = [[0.3, 0.7], [0.5, 0.5]]
    q = [[0.6, 0.4]]
    assert _row(p, q, [0], [np.nextafter(np.float32(0.5), np.float32(0))], 1)[0] == 1
    assert _row(p, q, [0], [0.5], 1)[0] == 0
    # q(x) <= p(x): always accepted, even with the largest uniform
    assert _row(p, q, [1], [R_REJECT], 1)[0] == 1


def test_out_of_vocab_draft_is_never_accepted():
    p = [[0.25] * 4] * 2
    q = [[0.25] * 4]
    for bad in (4, 100, -1):
        n, t, _ = _row(p, q, [bad], [0.0], 1)
        assert n == 0 and 0 <= t < 4


def test_num_allowed_caps_acceptance_and_uses_p_next():
    rng = np.random.default_rng(0)
    gamma, vocab = 4, 6
    p = rng.dirichlet(np.ones(vocab), gamma + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), gamma).astype(np.float32)
    tokens = np.argmax(p[:gamma], -1)  # p(x) > 0, so r = 0 accepts all
    for k in range(gamma + 1):
        n, _, probs = _row(p, q, tokens, np.zeros(gamma), k)
        assert n == k
        np.testing.assert_array_equal(probs, p[k])  # p_{k+1}: bonus or forced stop
    # a rejection after the cap does not matter: still p_{k+1}, not a residual
    tokens_bad = tokens.copy()
    tokens_bad[2] = np.argmin(p[2] / np.maximum(q[2], 1e-9))
    r = np.zeros(gamma, np.float32)
    r[2] = R_REJECT
    assert p[2, tokens_bad[2]] < q[2, tokens_bad[2]]
    n, _, probs = _row(p, q, tokens_bad, r, 2)
    assert n == 2
    np.testing.assert_array_equal(probs, p[2])
    # ... but a rejection inside the cap gives the residual at that position
    n, _, probs = _row(p, q, tokens_bad, r, 3)
    residual = np.maximum(p[2].astype(np.float64) - q[2], 0)
    assert n == 2
    np.testing.assert_allclose(probs, residual / residual.sum(), atol=1e-6)
    # num_allowed outside [0, γ] is clipped
    assert _row(p, q, tokens, np.zeros(gamma), 99)[0] == gamma
    assert _row(p, q, tokens, np.zeros(gamma), -3)[0] == 0


def test_zero_residual_falls_back_to_p():
    # residual max(0, p - q) sums to 0 only if q >= p everywhere; an unnormalized
    # q realizes that path deterministically
    p = np.array([[0.1, 0.2, 0.3, 0.4], [0.25] * 4], np.float32)
    q = 2 * p[:1]
    n, t, probs = _row(p, q, [3], [0.9], 1)  # 0.9 * 0.8 >= 0.4: reject
    assert n == 0
    np.testing.assert_array_equal(probs, p[0])
    assert 0 <= t < 4


def test_rows_are_independent_and_batch_matches_row():
    rng = np.random.default_rng(1)
    b, gamma, vocab = 6, 3, 9
    p = rng.dirichlet(np.ones(vocab), (b, gamma + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), (b, gamma)).astype(np.float32)
    tokens = rng.integers(0, vocab, (b, gamma)).astype(np.int32)
    r = rng.random((b, gamma)).astype(np.float32)
    keys = jax.random.split(jax.random.key(5), b)
    allowed = np.array([3, 2, 0, 3, 1, 3], np.int32)
    n, t, probs = _verify(tokens, q, p, r, keys, allowed)
    assert n.dtype == jnp.int32 and t.dtype == jnp.int32 and probs.dtype == jnp.float32
    assert n.shape == (b,) and t.shape == (b,) and probs.shape == (b, vocab)
    for i in range(b):
        ni, ti, pi = _verify_row(tokens[i], q[i], p[i], r[i], keys[i], allowed[i])
        assert int(ni) == int(n[i]) and int(ti) == int(t[i])
        np.testing.assert_array_equal(np.asarray(pi), np.asarray(probs[i]))
    # the same row in a different batch gives the same result
    n2, t2, _ = _verify(tokens[::-1], q[::-1], p[::-1], r[::-1], keys[::-1], allowed[::-1])
    np.testing.assert_array_equal(np.asarray(n2)[::-1], n)
    np.testing.assert_array_equal(np.asarray(t2)[::-1], t)


def test_shape_errors_are_reported():
    with pytest.raises(ValueError, match="target_probs"):
        verify_row(jnp.zeros(2, jnp.int32), jnp.ones((2, 4)) / 4, jnp.ones((2, 4)) / 4, jnp.zeros(2), jax.random.key(0), 2)
