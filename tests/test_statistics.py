"""The statistics of the tables and the verdict (scripts.report.statistics) against plain loops written
here from the definitions: the bootstrap distribution enumerated over every resample, the sign test's
interval from the binomial distribution, the sample-size formula on a textbook case."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest

from scripts.report.statistics import (
    classify,
    mean_of_means,
    samples_needed,
    score_differences,
    sign_test_interval,
)

# A Monte Carlo percentile of 9999 resamples against the exact one: a few lattice steps at most.
TOLERANCE = 2.0


def exact_percentile_interval(statistics: list[float]) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the exact bootstrap distribution (every resample once)."""
    return tuple(np.percentile(statistics, [2.5, 97.5]))


def test_paired_bootstrap_of_five_samples_against_every_resample():
    base = [0.2, 0.5, 0.1, 0.9, 0.4]
    reskv = [0.5, 0.4, 0.6, 1.0, 0.9]  # differences 30, -10, 50, 10, 50 points: mean 26
    estimate = mean_of_means([score_differences({"vt": pd.Series(base)}, {"vt": pd.Series(reskv)})])
    # Every one of the 5^5 equally likely resamples of the sample indices, the same for both methods.
    statistics = []
    for indices in itertools.product(range(5), repeat=5):
        statistics.append(sum(100 * (reskv[i] - base[i]) for i in indices) / 5)
    low, high = exact_percentile_interval(statistics)
    assert estimate.value == pytest.approx(26.0)
    assert estimate.samples == (5, 5)
    assert estimate.low == pytest.approx(low, abs=TOLERANCE)
    assert estimate.high == pytest.approx(high, abs=TOLERANCE)
    # Unpaired (each method's samples drawn apart) the interval would be about twice as wide.
    assert high - low < 50


def test_tasks_are_resampled_apart_and_averaged_as_the_tables_average_them():
    near_zero, near_hundred = [0.0, 0.0, 10.0], [90.0, 100.0, 100.0]
    estimate = mean_of_means([{"a": pd.Series(near_zero), "b": pd.Series(near_hundred)}])
    statistics = []
    for first in itertools.product(range(3), repeat=3):
        for second in itertools.product(range(3), repeat=3):
            mean_a = sum(near_zero[i] for i in first) / 3
            mean_b = sum(near_hundred[i] for i in second) / 3
            statistics.append((mean_a + mean_b) / 2)  # the unweighted mean of the two task scores
    low, high = exact_percentile_interval(statistics)
    assert estimate.value == pytest.approx(50.0)
    assert estimate.low == pytest.approx(low, abs=TOLERANCE)
    assert estimate.high == pytest.approx(high, abs=TOLERANCE)
    assert 45 <= estimate.low and estimate.high <= 55  # pooled, the six samples would span 0 to 100


def test_members_sharing_a_stratum_use_only_the_samples_all_of_them_have():
    # Member one has samples 0-2 of "vt", member two 1-3: both are read on samples 1 and 2.
    one = {"vt": pd.Series([10.0, 20.0, 30.0], index=[0, 1, 2])}
    two = {"vt": pd.Series([40.0, 50.0, 60.0], index=[1, 2, 3]), "cwe": pd.Series([7.0, 7.0])}
    estimate = mean_of_means([one, two])
    # Stratum vt: per sample 1/2 * x1 + 1/4 * x2 -> (10 + 10, 15 + 12.5); cwe: 1/4 * 7.
    assert estimate.value == pytest.approx((20 + 27.5) / 2 + 7 / 4)
    assert estimate.samples == (2, 2)
    assert mean_of_means([one, {"vt": pd.Series([1.0], index=[5])}]) is None  # nothing shared


def test_an_estimate_without_variation_is_its_value():
    estimate = mean_of_means([{"vt": pd.Series([25.0, 25.0, 25.0])}])
    assert (estimate.value, estimate.low, estimate.high, estimate.spread) == (25.0, 25.0, 25.0, 0.0)


def binomial_tail(k: int, n: int, p: float, upper: bool) -> float:
    """P(X >= k) (``upper``) or P(X <= k) for X ~ Binomial(n, p), summed term by term."""
    terms = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in terms)


def solve(function, target: float) -> float:
    """The p in [0, 1] where the monotone ``function`` crosses ``target`` (bisection)."""
    low, high = 0.0, 1.0
    rising = function(1.0) > function(0.0)
    for _ in range(100):
        middle = (low + high) / 2
        if (function(middle) < target) == rising:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@pytest.mark.parametrize(("won", "decided"), [(7, 9), (26, 37), (1, 4)])
def test_sign_test_interval_is_clopper_pearson_from_the_binomial(won, decided):
    # Clopper-Pearson: P(X >= won | low) = 2.5% and P(X <= won | high) = 2.5%.
    low = solve(lambda p: binomial_tail(won, decided, p, upper=True), 0.025)
    high = solve(lambda p: binomial_tail(won, decided, p, upper=False), 0.025)
    assert sign_test_interval(won, decided) == pytest.approx((low, high), abs=1e-9)


def test_sign_test_interval_at_the_edges():
    # No win in 10: the upper end solves (1 - p)^10 = 0.025; one win in one: p = 0.025 at the lower.
    assert sign_test_interval(0, 10) == pytest.approx((0.0, 1 - 0.025 ** (1 / 10)))
    assert sign_test_interval(1, 1) == pytest.approx((0.025, 1.0))
    assert sign_test_interval(0, 0) is None


def test_samples_needed_on_the_textbook_case():
    # A paired (one-sample) test at alpha = 0.05 two-sided and 80% power needs
    # n = (1.959964 + 0.841621)^2 (sigma / delta)^2 = 7.849 (sigma / delta)^2: effect size 0.5 -> 31.4 -> 32.
    assert samples_needed(spread=1.0, gain=0.5) == 32
    assert samples_needed(spread=10.0, gain=-10.0) == 8  # 7.849, rounded up
    assert samples_needed(spread=0.0, gain=1.0) is None and samples_needed(spread=1.0, gain=0.0) is None


@pytest.mark.parametrize(
    ("paper", "low", "high", "null", "expected"),
    [
        (3.38, 0.10, 1.20, 0.0, "reproduced"),  # smaller than the paper's, but above 0
        (3.38, 2.00, 5.00, 0.0, "reproduced"),
        (3.38, -0.50, 2.00, 0.0, "contradicted"),  # rules out a gain of the paper's size
        (3.38, -2.00, -0.50, 0.0, "contradicted"),
        (3.38, -0.50, 4.00, 0.0, "inconclusive"),
        (3.38, 0.00, 0.00, 0.0, "inconclusive"),  # no sample differed
        (-0.04, -0.50, -0.10, 0.0, "reproduced"),
        (-0.04, 0.02, 0.06, 0.0, "contradicted"),
        (63 / 64, 0.79, 1.00, 0.5, "reproduced"),
        (1.0, 0.35, 0.85, 0.5, "contradicted"),
        (1.0, 0.40, 1.00, 0.5, "inconclusive"),
    ],
)
def test_verdict_rules(paper, low, high, null, expected):
    assert classify(paper, low, high, null) == expected
