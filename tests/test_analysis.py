"""Tests for specjax.eval.theory against Leviathan, Kalman & Matias (2023)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from specjax.eval.theory import (
    acceptance_rate,
    beta,
    d_lk,
    expected_tokens,
    format_table,
    operations_factor,
    optimal_gamma,
    oracle_bound,
    plot_speedup,
    speedup,
    theory_table,
    walltime_improvement,
)

GAMMAS = [1, 2, 3, 5, 7, 10, 15, 20, 25]
GATE_EN = [1.80, 2.44, 2.95, 3.69, 4.16, 4.57, 4.86, 4.95, 4.98]
GATE_IMPROVEMENT = [1.76, 2.35, 2.78, 3.35, 3.65, 3.81, 3.74, 3.54, 3.32]


# --- gates: alpha = 0.8, c = 0.02 ------------------------------------------


def test_gate_expected_tokens():
    got = np.round(expected_tokens(0.8, GAMMAS), 2)
    assert got.tolist() == GATE_EN


def test_gate_walltime_improvement():
    got = np.round(walltime_improvement(0.8, GAMMAS, 0.02), 2)
    assert got.tolist() == GATE_IMPROVEMENT


def test_gate_optimal_gamma():
    g, s = optimal_gamma(0.8, 0.02)
    assert isinstance(g, int) and isinstance(s, float)
    assert g == 11
    assert round(s, 3) == 3.817
    assert round(float(walltime_improvement(0.8, 10, 0.02)), 3) == 3.809
    assert s > float(walltime_improvement(0.8, 10, 0.02))


def test_gate_oracle_bound():
    assert oracle_bound(0.8) == pytest.approx(5.0)
    assert np.isinf(oracle_bound(1.0))
    # E(N) approaches the bound from below as gamma grows.
    assert expected_tokens(0.8, 200) == pytest.approx(5.0)
    assert np.all(expected_tokens(0.8, GAMMAS) < 5.0)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("c", [0.0, 0.02, 0.5])
def test_gate_gamma_one(alpha, c):
    assert walltime_improvement(alpha, 1, c) == pytest.approx((1 + alpha) / (1 + c))


# --- D_LK and beta -----------------------------------------------------------


def _dist(n):
    return arrays(np.float64, n, elements=st.floats(0.0, 1.0)).filter(lambda x: x.sum() > 1e-3).map(lambda x: x / x.sum())


@st.composite
def dist_pair(draw):
    n = draw(st.integers(1, 12))
    return draw(_dist(n)), draw(_dist(n))


@settings(max_examples=200, deadline=None)
@given(dist_pair())
def test_d_lk_properties(pq):
    p, q = pq
    d = d_lk(p, q)
    assert d == pytest.approx(d_lk(q, p), abs=1e-12)  # symmetric
    assert -1e-12 <= d <= 1 + 1e-12
    assert d == pytest.approx(1 - beta(p, q), abs=1e-9)  # Lemma 3.3
    assert d_lk(p, p) == 0.0
    if not np.allclose(p, q, rtol=0, atol=1e-9):
        assert d > 0  # 0 only if p == q


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 12), st.data())
def test_d_lk_disjoint_supports(n, data):
    k = data.draw(st.integers(1, n - 1))
    p = np.zeros(n)
    q = np.zeros(n)
    p[:k] = data.draw(_dist(k))
    q[k:] = data.draw(_dist(n - k))
    assert d_lk(p, q) == pytest.approx(1.0)
    assert beta(p, q) == pytest.approx(0.0)
    # and D_LK = 1 only for disjoint supports
    q2 = q.copy()
    q2[np.argmax(p)] = 1.0  # overlap on p's mode
    q2 /= q2.sum()
    assert d_lk(p, q2) < 1.0


def test_beta_shapes_and_jax():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7), size=(3, 4))
    q = rng.dirichlet(np.ones(7), size=(3, 4))
    b = beta(p, q)
    assert b.shape == (3, 4) and b.dtype == np.float64
    np.testing.assert_allclose(beta(jnp.asarray(p), jnp.asarray(q)), b, rtol=1e-6)
    np.testing.assert_allclose(d_lk(p, q), 1 - b, atol=1e-12)
    assert beta(p, q[0, 0]).shape == (3, 4)  # broadcast over leading axes


def test_acceptance_rate():
    b = np.array([[0.5, 1.0], [0.0, 0.5]])
    assert acceptance_rate(b) == pytest.approx(0.5)
    np.testing.assert_allclose(acceptance_rate(b, axis=0), [0.25, 0.75])
    assert acceptance_rate(b, weights=[[1, 1], [0, 0]]) == pytest.approx(0.75)
    assert acceptance_rate(jnp.asarray(b)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="betas"):
        acceptance_rate([0.5, 1.5])


# --- E(N), speedups ----------------------------------------------------------


def test_expected_tokens_alpha_one_exact_and_continuous():
    g = np.array([1, 3, 10])
    assert expected_tokens(1.0, g).tolist() == [2.0, 4.0, 11.0]
    mixed = expected_tokens(np.array([0.5, 1.0, 0.0]), 3)
    np.testing.assert_array_equal(mixed, [1.875, 4.0, 1.0])
    for eps in [1e-3, 1e-6, 1e-9, 1e-12, 1e-15]:
        np.testing.assert_allclose(expected_tokens(1 - eps, g), g + 1, rtol=10 * eps * g.max())
    # agrees with the geometric sum sum_{k=0}^{gamma} alpha^k
    a = np.linspace(0, 1, 101)
    for gi in [1, 4, 9]:
        np.testing.assert_allclose(expected_tokens(a, gi), sum(a**k for k in range(gi + 1)), rtol=1e-12)


def test_broadcasting_and_jax():
    a = jnp.array([0.6, 0.8, 0.9])[:, None]
    g = jnp.array([1, 2, 4])
    e = expected_tokens(a, g)
    assert e.shape == (3, 3) and e.dtype == np.float64
    assert walltime_improvement(a, g, jnp.float32(0.1)).shape == (3, 3)
    assert isinstance(expected_tokens(0.5, 2), np.floating)


def test_speedup_textbook_and_v():
    a, g, c = np.array([0.5, 0.8, 1.0])[:, None], np.arange(1, 9), 0.05
    np.testing.assert_array_equal(speedup(a, g, c), walltime_improvement(a, g, c))
    np.testing.assert_allclose(speedup(a, g, c, v=1.0), walltime_improvement(a, g, c))
    np.testing.assert_allclose(speedup(a, g, c, v=np.ones(8)), walltime_improvement(a, g, c))
    np.testing.assert_allclose(speedup(a, g, c, v=lambda gg: 1.0), walltime_improvement(a, g, c))
    v = 1 + 0.1 * g
    np.testing.assert_allclose(speedup(0.8, g, c, v=v), expected_tokens(0.8, g) / (g * c + v))
    as_dict = {int(k): float(x) for k, x in zip(g, v)}
    np.testing.assert_allclose(speedup(0.8, g, c, v=as_dict), speedup(0.8, g, c, v=v))
    np.testing.assert_allclose(speedup(0.8, g, c, v=lambda gg: 1 + 0.1 * gg), speedup(0.8, g, c, v=v))
    assert speedup(0.8, 2, c, v=0.5) > speedup(0.8, 2, c)  # v < 1 allowed
    with pytest.raises(ValueError, match="gamma=3"):
        speedup(0.8, 3, c, v={1: 1.0, 2: 1.1})


def test_operations_factor():
    # Theorem 3.11 formula, and (gamma mu + gamma + 1) / E(N)
    a, g, mu = 0.8, np.array([1, 3, 7]), 0.05
    expected = (1 - a) * (g * mu + g + 1) / (1 - a ** (g + 1))
    np.testing.assert_allclose(operations_factor(a, g, mu), expected)
    np.testing.assert_allclose(operations_factor(1.0, g, mu), (g * mu + g + 1) / (g + 1))
    assert np.all(operations_factor(np.linspace(0, 1, 11)[:, None], g, mu) >= 1.0)


# --- optimal gamma -----------------------------------------------------------


def test_optimal_gamma_with_v_array_and_dict():
    v = np.array([1.0, 1.02, 1.05, 1.2, 1.6, 2.2])  # v(gamma = 1..6)
    g, s = optimal_gamma(0.8, 0.02, v=v)
    brute = [float(speedup(0.8, i + 1, 0.02, v=v[i])) for i in range(len(v))]
    assert g == int(np.argmax(brute)) + 1 == 3
    assert s == pytest.approx(max(brute))
    assert g <= len(v)
    g2, s2 = optimal_gamma(0.8, 0.02, v={2: 1.02, 5: 1.1, 11: 1.0})
    assert g2 == 11 and s2 == pytest.approx(float(walltime_improvement(0.8, 11, 0.02)))
    g3, _ = optimal_gamma(0.8, 0.02, v={2: 1.02, 5: 1.1, 11: 1.0}, max_gamma=8)
    assert g3 == 5
    # constant v scales the textbook cost; v=1 is the textbook answer
    assert optimal_gamma(0.8, 0.02, v=1.0) == optimal_gamma(0.8, 0.02)


def test_optimal_gamma_vectorized():
    alphas = jnp.array([0.6, 0.8, 0.9])
    g, s = optimal_gamma(alphas, 0.02)
    assert g.shape == s.shape == (3,)
    assert g[1] == 11
    for ai, gi, si in zip(np.asarray(alphas), g, s):
        assert (int(gi), float(si)) == pytest.approx(optimal_gamma(float(ai), 0.02))
    assert optimal_gamma(0.0, 0.02)[0] == 1
    assert optimal_gamma(1.0, 0.02, max_gamma=20)[0] == 20


# --- tables and plot ---------------------------------------------------------


def test_theory_table():
    rows = theory_table(0.8, 0.02, GAMMAS)
    assert [r["gamma"] for r in rows] == GAMMAS
    for r, en, imp in zip(rows, GATE_EN, GATE_IMPROVEMENT):
        assert set(r) == {"gamma", "expected_tokens", "cost", "speedup", "speedup_textbook"}
        assert type(r["gamma"]) is int
        assert all(type(r[k]) is float for k in r if k != "gamma")
        assert round(r["expected_tokens"], 2) == en
        assert round(r["speedup"], 2) == round(r["speedup_textbook"], 2) == imp
        assert r["cost"] == pytest.approx(r["gamma"] * 0.02 + 1)
    json.dumps(rows)
    rows_v = theory_table(0.8, 0.02, [1, 4], v=[1.1, 1.5])
    assert rows_v[1]["cost"] == pytest.approx(4 * 0.02 + 1.5)
    assert rows_v[1]["speedup"] == pytest.approx(rows_v[1]["expected_tokens"] / rows_v[1]["cost"])
    assert rows_v[1]["speedup_textbook"] == pytest.approx(float(walltime_improvement(0.8, 4, 0.02)))


def test_format_table():
    md = format_table(theory_table(0.8, 0.02, [1, 2]))
    lines = md.splitlines()
    assert lines[0] == "| gamma | expected_tokens | cost | speedup | speedup_textbook |"
    assert lines[1].startswith("|---")
    assert len(lines) == 4 and "1.800" in lines[2]
    assert format_table([]) == ""


def test_plot_speedup_png(tmp_path):
    path = tmp_path / "speedup.png"
    measured = [{"gamma": 4, "speedup": 2.5, "label": "measured"}, {"gamma": 6, "speedup": 2.7, "label": "measured"}]
    out = plot_speedup(str(path), max_gamma=8, v=lambda g: 1 + 0.02 * g, measured=measured)
    assert out == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    plot_speedup(str(tmp_path / "default.png"))
    assert (tmp_path / "default.png").read_bytes()[:4] == b"\x89PNG"


# --- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: expected_tokens(1.2, 3), "alpha"),
        (lambda: expected_tokens(-0.1, 3), "alpha"),
        (lambda: expected_tokens(np.array([0.5, np.nan]), 3), "alpha"),
        (lambda: expected_tokens(0.5, 0), "gamma"),
        (lambda: walltime_improvement(0.5, [1, 0.5], 0.1), "gamma"),
        (lambda: walltime_improvement(0.5, 2, -0.1), "c"),
        (lambda: speedup(0.5, 2, 0.1, v=0.0), "v"),
        (lambda: speedup(0.5, 2, 0.1, v=-1.0), "v"),
        (lambda: speedup(0.5, [1, 2], 0.1, v=[1.0, 0.0]), "v"),
        (lambda: operations_factor(0.5, 2, -1.0), "mu"),
        (lambda: oracle_bound(2.0), "alpha"),
        (lambda: optimal_gamma(0.5, -0.1), "c"),
        (lambda: optimal_gamma(0.5, 0.1, max_gamma=0), "max_gamma"),
        (lambda: theory_table(0.5, 0.1, [0, 1]), "gamma"),
    ],
)
def test_bad_input_raises(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        call()


def test_bad_input_message_names_range():
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError, match=r"gamma must be .*>= 1"):
        expected_tokens(0.5, 0)
    with pytest.raises(ValueError, match=r"c must be .*>= 0"):
        speedup(0.5, 1, -1)
    with pytest.raises(ValueError, match=r"v must be .*> 0"):
        speedup(0.5, 1, 0.1, v=0)
