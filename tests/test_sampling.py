"""Tests for specjax.core.sampling: process_logits, sample, SamplingParams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stats_helpers import chi2_pvalue

from specjax.core.sampling import SamplingParams, inverse_cdf, process_logits, sample

_process = jax.jit(process_logits)
_sample = jax.jit(sample)
_inv_cdf = jax.jit(inverse_cdf)


def _rows(n, value, dtype):
    return jnp.full((n,), value, dtype)


def _plain_softmax(logits, temperature):
    """process_logits with no filtering: the float32 probabilities the filters see."""
    n = logits.shape[0]
    return np.asarray(
        _process(logits, temperature, _rows(n, 0, jnp.int32), _rows(n, 1.0, jnp.float32))
    )


def _reference_filter(s, top_k, top_p):
    """Numpy full-sort reference of top-k then top-p with the ties-kept rule.

    s: float32 [V] (the unfiltered probabilities). Returns (keep mask, probs,
    margin): the margin is the distance of the top-p target from the nearest
    cumulative mass, so rows where float32 vs float64 sums could decide
    differently can be told apart.
    """
    s64 = s.astype(np.float64)
    keep = np.ones(s.shape, bool)
    if 0 < top_k < s.size:
        tau_k = np.sort(s)[::-1][top_k - 1]  # k-th largest, with multiplicity
        keep &= s >= tau_k
    margin = np.inf
    if top_p < 1.0:
        vals = np.sort(s64[keep])[::-1]
        cum = np.cumsum(vals)
        target = np.float64(np.float32(top_p)) * cum[-1]
        m = min(int(np.searchsorted(cum, target, side="left")), vals.size - 1)
        keep &= s64 >= vals[m]  # everything tied with the m-th value is kept
        margin = float(np.min(np.abs(cum - target)))
    w = np.where(keep, s64, 0.0)
    return keep, w / w.sum(), margin


def _check_filter_properties(s, out, top_k, top_p):
    """The defining properties, checked with a float tolerance (no sort ties)."""
    kept = out > 0
    s64 = s.astype(np.float64)
    if kept.any() and (~kept & (s > 0)).any():  # an upper set {s >= t}
        assert s[kept].min() > s[~kept & (s > 0)].max()
    if 0 < top_k < s.size:
        assert kept.sum() <= max(top_k, (s >= np.sort(s)[::-1][top_k - 1]).sum())
    if top_p < 1.0:
        after_k = np.ones(s.shape, bool)
        if 0 < top_k < s.size:
            after_k = s >= np.sort(s)[::-1][top_k - 1]
        mass_k = s64[after_k].sum()
        mass = s64[kept].sum()
        smallest = s[kept].min()
        assert mass >= top_p * mass_k - 1e-6
        assert mass - s64[kept & (s == smallest)].sum() < top_p * mass_k + 1e-6
    np.testing.assert_allclose(out[kept], s64[kept] / s64[kept].sum(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- greedy ----


def test_greedy_is_one_hot_at_lowest_index_on_ties():
    logits = jnp.array(
        [
            [0.0, 3.0, 1.0, 3.0, 3.0],
            [5.0, 5.0, 5.0, 5.0, 5.0],
            [-1.0, -2.0, -1.0, -9.0, -1.0],
            [0.0, 1.0, 2.0, 7.0, 7.0],
        ],
        jnp.float32,
    )
    n = logits.shape[0]
    out = np.asarray(
        _process(logits, _rows(n, 0.0, jnp.float32), _rows(n, 2, jnp.int32), _rows(n, 0.5, jnp.float32))
    )
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.eye(5, dtype=np.float32)[[1, 0, 0, 3]])


def test_greedy_and_sampled_rows_mix_in_one_call():
    logits = jax.random.normal(jax.random.key(0), (4, 5)) * 2  # same shape: no new compile
    t = jnp.array([0.0, 1.0, 0.0, 0.5], jnp.float32)
    out = np.asarray(_process(logits, t, _rows(4, 0, jnp.int32), _rows(4, 1.0, jnp.float32)))
    am = np.argmax(np.asarray(logits), -1)
    np.testing.assert_array_equal(out[0], np.eye(5)[am[0]])
    np.testing.assert_array_equal(out[2], np.eye(5)[am[2]])
    np.testing.assert_allclose(out[1], jax.nn.softmax(logits[1] / 1.0), atol=1e-6)
    np.testing.assert_allclose(out[3], jax.nn.softmax(logits[3] / 0.5), atol=1e-6)


def test_bfloat16_logits_give_float32_probs():
    logits = (jax.random.normal(jax.random.key(1), (3, 40)) * 3).astype(jnp.bfloat16)
    out = _process(logits, _rows(3, 0.8, jnp.float32), _rows(3, 5, jnp.int32), _rows(3, 0.9, jnp.float32))
    assert out.dtype == jnp.float32 and out.shape == (3, 40)
    np.testing.assert_allclose(np.asarray(out).sum(-1), 1.0, atol=1e-6)


# ------------------------------------------------------------ top-k/top-p ---


def test_identity_when_filters_are_off_or_trivial():
    logits = jax.random.normal(jax.random.key(2), (6, 33)) * 4
    t = jnp.array([1.0, 0.3, 2.0, 1.0, 0.7, 5.0], jnp.float32)
    expected = np.asarray(jax.nn.softmax(logits / t[:, None], axis=-1))
    for top_k in (0, 33, 34, 10**6):
        out = _process(logits, t, _rows(6, top_k, jnp.int32), _rows(6, 1.0, jnp.float32))
        np.testing.assert_allclose(np.asarray(out), expected, atol=1e-6, rtol=0)
    # one row with an active filter runs the filtering branch for every row;
    # the rows without one must still come out unfiltered
    top_k = jnp.array([0, 33, 0, 3, 0, 0], jnp.int32)
    top_p = jnp.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.5], jnp.float32)
    out = np.asarray(_process(logits, t, top_k, top_p))
    for row in (0, 1, 2, 4):
        np.testing.assert_allclose(out[row], expected[row], atol=1e-6, rtol=0)
    assert (out[3] > 0).sum() == 3
    assert (out[5] > 0).sum() < 33


def test_top_k_keeps_all_ties_at_the_threshold():
    logits = jnp.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], jnp.float32)
    for k, kept in [(1, 1), (2, 4), (3, 4), (4, 4), (5, 5), (6, 6)]:
        out = np.asarray(_process(logits, _rows(1, 1.0, jnp.float32), _rows(1, k, jnp.int32), _rows(1, 1.0, jnp.float32)))
        assert (out > 0).sum() == kept, (k, out)
        np.testing.assert_allclose(out.sum(), 1.0, atol=1e-6)


def test_top_p_keeps_all_ties_at_the_threshold():
    probs = np.array([0.4, 0.2, 0.2, 0.1, 0.05, 0.05])
    logits = jnp.asarray(np.log(probs)[None], jnp.float32)
    cases = [(0.3, [0]), (0.5, [0, 1, 2]), (0.7, [0, 1, 2]), (0.85, [0, 1, 2, 3]), (0.95, [0, 1, 2, 3, 4, 5])]
    for top_p, kept in cases:
        out = np.asarray(
            _process(logits, _rows(1, 1.0, jnp.float32), _rows(1, 0, jnp.int32), _rows(1, top_p, jnp.float32))
        )[0]
        np.testing.assert_array_equal(np.flatnonzero(out), kept)
        np.testing.assert_allclose(out[kept], probs[kept] / probs[kept].sum(), atol=1e-6)


@pytest.mark.parametrize("integer_logits", [False, True], ids=["continuous", "many-ties"])
def test_top_k_top_p_match_full_sort_reference(integer_logits):
    rng = np.random.default_rng(7 + integer_logits)
    n, vocab = 256, 37
    if integer_logits:
        logits = rng.integers(-3, 3, size=(n, vocab)).astype(np.float32)
    else:
        logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    temperature = rng.choice([0.25, 0.7, 1.0, 1.6], size=n).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 5, 17, 36, 37, 50], size=n).astype(np.int32)
    top_p = rng.choice([1.0, 0.05, 0.3, 0.5, 0.9, 0.99], size=n).astype(np.float32)
    top_p = np.where(rng.random(n) < 0.3, rng.uniform(0.01, 1.0, n), top_p).astype(np.float32)
    out = np.asarray(_process(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)))
    soft = _plain_softmax(jnp.asarray(logits), jnp.asarray(temperature))
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-6)
    checked = 0
    for i in range(n):
        _check_filter_properties(soft[i], out[i], int(top_k[i]), float(top_p[i]))
        keep, ref, margin = _reference_filter(soft[i], int(top_k[i]), float(top_p[i]))
        if margin < 1e-5:  # float32-vs-float64 mass could decide either way
            continue
        checked += 1
        np.testing.assert_array_equal(out[i] > 0, keep & (soft[i] > 0), err_msg=f"row {i}")
        np.testing.assert_allclose(out[i], ref, atol=1e-6, rtol=0, err_msg=f"row {i}")
    # the skipped rows still passed the property check
    assert checked >= 0.9 * n, f"only {checked} of {n} rows compared with the reference"


def test_large_vocab_top_k_top_p_match_reference():
    # the production shape (9 rows, V = 49,152) through the bisection
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((9, 49152)) * 3).astype(np.float32)
    t = np.full(9, 0.8, np.float32)
    top_k = np.array([0, 1, 50, 1000, 0, 50, 49152, 0, 7], np.int32)
    top_p = np.array([0.9, 1.0, 1.0, 0.95, 0.5, 0.8, 1.0, 1.0, 0.999], np.float32)
    out = np.asarray(_process(jnp.asarray(logits), jnp.asarray(t), jnp.asarray(top_k), jnp.asarray(top_p)))
    soft = _plain_softmax(jnp.asarray(logits), jnp.asarray(t))
    checked = []
    for i in range(9):
        _check_filter_properties(soft[i], out[i], int(top_k[i]), float(top_p[i]))
        keep, ref, margin = _reference_filter(soft[i], int(top_k[i]), float(top_p[i]))
        if margin < 1e-6:  # the tail of a 49,152-token softmax is very fine-grained
            continue
        checked.append(i)
        np.testing.assert_array_equal(out[i] > 0, keep & (soft[i] > 0), err_msg=f"row {i}")
        np.testing.assert_allclose(out[i], ref, atol=1e-6, rtol=0, err_msg=f"row {i}")
    # every row is compared with the reference today (the smallest top-p margin is 2e-5): at most one
    # row, and none of the top-k-only rows, may be left to the property check alone
    assert len(checked) >= 8 and {1, 2, 6} <= set(checked), f"rows compared with the reference: {checked}"


def test_changing_settings_does_not_recompile():
    traces = []

    @jax.jit
    def fn(logits, t, k, p):
        traces.append(1)  # Python side effect: runs once per trace
        return process_logits(logits, t, k, p)

    logits = jax.random.normal(jax.random.key(4), (3, 20))
    for t, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 3, 1.0), (1.5, 0, 0.7), (0.9, 19, 0.2), (0.0, 4, 0.5)]:
        fn(logits, _rows(3, t, jnp.float32), _rows(3, k, jnp.int32), _rows(3, p, jnp.float32)).block_until_ready()
    params = [SamplingParams.create(3, temperature=t, top_k=k, top_p=p) for t, k, p in [(0.0, 0, 1.0), (0.7, [1, 2, 3], [0.5, 1.0, 0.9])]]
    for sp in params:
        fn(logits, sp.temperature, sp.top_k, sp.top_p).block_until_ready()
    assert len(traces) == 1


# -------------------------------------------------------- SamplingParams ----


def test_sampling_params_create_and_process():
    sp = SamplingParams.create(4, temperature=[0.0, 1.0, 0.5, 2.0], top_k=5, top_p=[1.0, 0.9, 0.5, 1.0])
    assert sp.temperature.dtype == jnp.float32 and sp.temperature.shape == (4,)
    assert sp.top_k.dtype == jnp.int32 and sp.top_k.shape == (4,)
    assert sp.top_p.dtype == jnp.float32 and sp.top_p.shape == (4,)
    assert sp.batch == 4
    leaves, treedef = jax.tree_util.tree_flatten(sp)
    # one [B] array per declared device field of Sampling, plus the logit bias's ids and values
    from specjax.core.settings import knobs
    from specjax.core.sampling import Sampling
    device = {n for n, k, _ in knobs(Sampling) if k.device}
    assert set(sp.rows) == device | {"bias_ids", "bias_values"} and len(leaves) == len(device) + 2
    assert {"min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens"} <= device
    logits = jax.random.normal(jax.random.key(5), (4, 2, 5)) * 2
    out = jax.jit(lambda sp, x: sp.process(x))(sp, logits)
    assert out.shape == (4, 2, 5)
    for j in range(2):  # row b of every position uses row b's settings
        expected = _process(logits[:, j], sp.temperature, sp.top_k, sp.top_p)
        np.testing.assert_allclose(np.asarray(out[:, j]), np.asarray(expected), atol=1e-7)
    d = SamplingParams.create(2)
    np.testing.assert_array_equal(d.temperature, [0.0, 0.0])
    np.testing.assert_array_equal(d.top_k, [0, 0])
    np.testing.assert_array_equal(d.top_p, [1.0, 1.0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=[1.0, -1.0]), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=[0.5, 0.5, 0.5]), "top_p"),
    ],
)
def test_sampling_params_validation(kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams.create(2, **kwargs)
    if name == "top_p" and "shape" not in str(info.value):
        assert "(0, 1]" in str(info.value)


# ------------------------------------------------------------------ sample --


def test_sample_is_deterministic_and_int32():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(6), (5, 7, 30)))
    a = _sample(jax.random.key(11), probs)
    b = _sample(jax.random.key(11), probs)
    c = _sample(jax.random.key(12), probs)
    assert a.dtype == jnp.int32 and a.shape == (5, 7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    raw = _sample(jax.random.PRNGKey(3), probs)  # raw uint32 keys work too
    assert raw.shape == (5, 7)


@pytest.mark.parametrize("vocab", [20, 700], ids=["one-level", "two-level"])
def test_sample_matches_probs_chi_square(vocab):
    # alpha = 1e-3: with fixed keys the test is deterministic; a correct sampler
    # fails it for ~1 in 1000 key choices.
    rng = np.random.default_rng(vocab)
    p = rng.dirichlet(np.full(vocab, 0.3 if vocab > 100 else 1.0))
    p[rng.random(vocab) < 0.3] = 0.0
    p = (p / p.sum()).astype(np.float32)
    n = 30_000
    keys = jax.random.split(jax.random.key(21), n)
    ids = np.asarray(jax.jit(jax.vmap(sample, (0, None)))(keys, jnp.asarray(p)))
    counts = np.bincount(ids, minlength=vocab)
    assert counts[p == 0].sum() == 0
    if vocab > 100:  # merge into ~20 bins of similar expected mass
        order = np.argsort(-p)
        bins = np.minimum((np.cumsum(p[order]) * 20).astype(int), 19)
        obs, exp = np.bincount(bins, counts[order], 20), np.bincount(bins, p[order].astype(np.float64), 20)
    else:
        obs, exp = counts, p.astype(np.float64)
    assert chi2_pvalue(obs, exp) > 1e-3  # the shared helper: bins of expectation < 5 merged


def test_inverse_cdf_extreme_uniforms_skip_zeros():
    probs = jnp.array(
        [
            [0.0, 0.0, 0.5, 0.0, 0.5, 0.0],
            [0.0, 1e-30, 0.0, 0.0, 0.0, 0.0],
            [1e-37, 0.0, 0.0, 0.0, 0.0, 1.0],
            [0.0, 0.3, 0.0, 0.2, 0.5, 0.0],
            [0.0, 0.0, 1e-39, 0.0, 0.0, 0.0],  # subnormal: XLA CPU sums it as 0
            [1e-39, 0.0, 0.0, 0.0, 1.0, 0.0],
        ],
        jnp.float32,
    )
    top = np.float32(1 - 2**-24)  # the largest float32 uniform in [0, 1)
    np.testing.assert_array_equal(_inv_cdf(probs, jnp.zeros(6)), [2, 1, 0, 1, 2, 4])
    np.testing.assert_array_equal(_inv_cdf(probs, jnp.full(6, top)), [4, 1, 5, 4, 2, 4])
    big = jnp.zeros((2, 3000)).at[0, 2999].set(1.0).at[1, 0].set(0.25).at[1, 700].set(0.75)
    np.testing.assert_array_equal(_inv_cdf(big, jnp.zeros(2)), [2999, 0])
    np.testing.assert_array_equal(_inv_cdf(big, jnp.full(2, top)), [2999, 700])
    tiny = jnp.zeros((1, 3000)).at[0, 1234].set(1e-39)  # only a subnormal, two-level path
    np.testing.assert_array_equal(_inv_cdf(tiny, jnp.array([0.5])), [1234])


_SPARSE_DRAWS = 256


@st.composite
def _sparse_probs(draw, vocab):
    n_pos = draw(st.integers(1, min(vocab, 6)))
    idx = draw(st.lists(st.integers(0, vocab - 1), min_size=n_pos, max_size=n_pos, unique=True))
    vals = draw(
        st.lists(
            st.one_of(st.floats(1e-30, 1.0), st.sampled_from([1e-39, 1e-38, 1e-20, 0.5, 1.0])),
            min_size=n_pos,
            max_size=n_pos,
        )
    )
    p = np.zeros(vocab, np.float32)
    p[idx] = vals
    return p


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=_sparse_probs(16), seed=st.integers(0, 2**31 - 1), normalize=st.booleans())
def test_sample_never_returns_zero_probability_id(p, seed, normalize):
    if normalize:
        p = (p / p.astype(np.float64).sum()).astype(np.float32)
    probs = jnp.broadcast_to(jnp.asarray(p), (_SPARSE_DRAWS, p.size))
    ids = np.asarray(_sample(jax.random.key(seed), probs))
    assert np.all(p[ids] > 0), (p, ids)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=_sparse_probs(1100), seed=st.integers(0, 2**31 - 1))
def test_sample_never_returns_zero_probability_id_large_vocab(p, seed):
    probs = jnp.broadcast_to(jnp.asarray(p), (_SPARSE_DRAWS, p.size))
    ids = np.asarray(_sample(jax.random.key(seed), probs))
    assert np.all(p[ids] > 0), (np.flatnonzero(p), ids)
