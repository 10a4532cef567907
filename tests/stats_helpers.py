"""The one chi-square goodness-of-fit helper of the tests (speculative, tree, decode, tree-loop and
sampling tests all use it).

Binning: every outcome of positive probability whose expected count is >= ``MIN_EXPECTED`` is a
bin of its own; the others are pooled into one bin, and that pool, if its expectation is still
below ``MIN_EXPECTED``, is merged into the smallest bin — so every bin has an expectation of at
least ``MIN_EXPECTED`` (the usual validity rule of the chi-square approximation).

It never passes silently: when fewer than 2 bins remain (a single outcome of positive probability,
or too few samples to give two bins of expectation >= ``MIN_EXPECTED``) no meaningful test is
possible and it raises ``AssertionError`` saying so. The test's significance level is the
caller's: the p-value is exact in the sense of the chi-square approximation, so a check
``p > alpha`` of a correct implementation fails with probability ≈ alpha over key choices.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0


class Chi2(NamedTuple):
    pvalue: float
    impossible: int  # samples that fell on outcomes of probability 0 (not part of the statistic)
    bins: int  # bins of the test (>= 2)


def chi2_test(counts, probs, min_expected: float = MIN_EXPECTED) -> Chi2:
    """Chi-square of observed ``counts`` against ``probs`` (same shape, any shape; ``probs`` need
    not be normalized). Samples on outcomes of probability 0 are counted in ``impossible`` (the
    caller asserts on them; a negative control may ignore them) and left out of the statistic,
    whose expectation is scaled to the samples on the support."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    assert counts.shape == probs.shape, f"counts {counts.shape} vs probabilities {probs.shape}"
    assert np.all(probs >= 0) and np.all(counts >= 0) and np.isfinite(probs).all()
    support = probs > 0
    impossible = int(counts[~support].sum())
    obs, p = counts[support], probs[support]
    n = obs.sum()
    if p.size < 2:
        raise AssertionError(f"chi-square impossible: {p.size} outcome(s) of positive probability "
                             "(a distribution test needs at least 2; check the outcome directly)")
    exp = p / p.sum() * n
    big = exp >= min_expected
    o, e = list(obs[big]), list(exp[big])
    pool_o, pool_e = obs[~big].sum(), exp[~big].sum()
    if pool_e >= min_expected:
        o.append(pool_o)
        e.append(pool_e)
    elif pool_e > 0 and e:  # too small for a bin of its own: merged into the smallest bin
        k = int(np.argmin(e))
        o[k] += pool_o
        e[k] += pool_e
    if len(e) < 2:
        raise AssertionError(
            f"chi-square impossible: {int(n)} samples over {p.size} outcomes of positive probability give "
            f"{len(e)} bin(s) of expected count >= {min_expected:g} (need 2: draw more samples)")
    return Chi2(float(stats.chisquare(o, e).pvalue), impossible, len(e))


def chi2_pvalue(counts, probs, min_expected: float = MIN_EXPECTED) -> float:
    """:func:`chi2_test`'s p-value, asserting that no outcome of probability 0 occurred."""
    res = chi2_test(counts, probs, min_expected)
    assert res.impossible == 0, f"{res.impossible} samples on outcomes of probability 0"
    return res.pvalue


R_ACCEPT = np.float32(0.0)  # a uniform that accepts x_i iff p_i(x_i) > 0
R_REJECT = np.float32(1 - 2**-24)  # the largest uniform: rejects x_i iff p_i(x_i) < q_i(x_i)


def chain_events(draft, qs, ps):
    """Every "first rejection at position j" event of one chain round with the draft ``draft``
    (j = γ: all accepted): yields ``(probability, uniforms [γ], j)``. The probability is
    Π q_i(x_i) · Π_{i<j} a_i · (1 − a_j) with a_i = min(1, p_i(x_i) / q_i(x_i)) in float64 (Leviathan et
    al. 2023); the uniforms realize the event through the real ``verify``. ``qs [γ, V]``, ``ps [γ+1, V]``."""
    gamma = len(draft)
    q_x = qs[np.arange(gamma), draft].astype(np.float64)
    if np.prod(q_x) == 0:
        return
    p_x = ps[np.arange(gamma), draft].astype(np.float64)
    a = np.minimum(1.0, p_x / q_x)
    for j in range(gamma + 1):
        prob = np.prod(q_x) * np.prod(a[:j]) * ((1 - a[j]) if j < gamma else 1.0)
        if prob == 0:
            continue
        r = np.full(gamma, 0.5, np.float32)
        r[:j] = R_ACCEPT
        if j < gamma:
            r[j] = R_REJECT
        yield prob, r, j
