"""The shared chi-square helper (tests/stats_helpers.py) merges small bins and never passes an
impossible test."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from stats_helpers import chi2_pvalue, chi2_test


def test_small_bins_are_merged_and_every_bin_has_expectation_5():
    probs = np.array([0.5, 0.3, 0.196, 0.002, 0.002, 0.0])
    counts = np.array([510, 290, 196, 2, 2, 0])  # n = 1000: expectations 500, 300, 196, 2, 2
    res = chi2_test(counts, probs)
    # the pool (expectation 4 < 5) joins the smallest bin: [500, 300, 196 + 4]
    assert res.bins == 3 and res.impossible == 0
    assert res.pvalue == pytest.approx(stats.chisquare([510, 290, 200], [500, 300, 200]).pvalue)
    # a pool of expectation >= 5 is a bin of its own
    res = chi2_test([500, 280, 190, 15, 15], [0.5, 0.3, 0.192, 0.004, 0.004])  # expectations 4 and 4
    assert res.bins == 4
    assert res.pvalue == pytest.approx(stats.chisquare([500, 280, 190, 30], [500, 300, 192, 8]).pvalue)


def test_two_outcomes_with_enough_samples_give_two_bins():
    res = chi2_test([60, 40], [0.5, 0.5])
    assert res.bins == 2 and res.pvalue == pytest.approx(stats.chisquare([60, 40]).pvalue)


def test_an_impossible_test_fails_instead_of_passing():
    with pytest.raises(AssertionError, match="1 outcome.* of positive probability"):
        chi2_test([100, 0, 0], [1.0, 0.0, 0.0])  # a single possible outcome: nothing to test
    with pytest.raises(AssertionError, match="give 1 bin"):
        chi2_test([998, 2], [0.999, 0.001])  # expectations 999 and 1: too few samples for 2 bins
    with pytest.raises(AssertionError, match="give 0 bin"):
        chi2_test([1, 1, 1], [1 / 3] * 3)  # 3 samples


def test_a_sample_of_probability_zero_fails_chi2_pvalue():
    counts, probs = [50, 49, 1], [0.5, 0.5, 0.0]
    assert chi2_test(counts, probs).impossible == 1  # chi2_test reports it (negative controls)
    with pytest.raises(AssertionError, match="1 samples on outcomes of probability 0"):
        chi2_pvalue(counts, probs)


def test_a_wrong_distribution_is_rejected():
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.choice(4, 4000, p=[0.4, 0.3, 0.2, 0.1]), minlength=4)
    assert chi2_pvalue(counts, [0.4, 0.3, 0.2, 0.1]) > 1e-3
    assert chi2_pvalue(counts, [0.25, 0.25, 0.25, 0.25]) < 1e-12
