"""The statistics of the tables and the verdict (scripts.report.statistics) against values worked here
from the definitions: the bootstrap's variance from the plug-in formula, the exact bound and the sign
test's interval from the binomial distribution, the sample size from the t distribution's textbook
values, and the interval's coverage by simulation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from scripts.report.statistics import (
    BOOTSTRAP_T,
    EXACT,
    PromptTable,
    direction,
    draw_indices,
    flips_spread,
    holm,
    mean_of_means,
    samples_needed,
    score_differences,
    sign_test_interval,
    size,
)


def test_the_estimate_is_the_tables_mean_of_means():
    base = [0.2, 0.5, 0.1, 0.9, 0.4]
    reskv = [0.5, 0.4, 0.6, 1.0, 0.9]  # differences 30, -10, 50, 10, 50 points: mean 26
    estimate = mean_of_means([score_differences({"vt": pd.Series(base)}, {"vt": pd.Series(reskv)})])
    assert estimate.value == pytest.approx(26.0)
    assert estimate.samples == (5, 5)
    assert estimate.method == BOOTSTRAP_T
    # The spread: the differences' sample standard deviation, sqrt(680) (deviations 4, -36, 24, -16, 24).
    assert estimate.spread == pytest.approx(math.sqrt((16 + 1296 + 576 + 256 + 576) / 4))
    assert estimate.informative_prompts == (5, 5)


def test_members_on_one_prompt_share_its_draw():
    # Two configurations of one task whose differences are mirror images: on every draw their sum is
    # 0, so the estimate (their mean) is 0 with no spread at all. Drawn apart, it would vary.
    one = {"vt": pd.Series([10.0, -20.0, 30.0, 5.0])}
    two = {"vt": -one["vt"]}
    estimate = mean_of_means([one, two])
    assert (estimate.value, estimate.spread) == (0.0, 0.0)
    # And each configuration's own mean moves with the other's, draw by draw.
    table = PromptTable.of([one, {"vt": 2 * one["vt"]}])
    means = table.member_means(table.draws())
    assert np.allclose(means[:, 1], 2 * means[:, 0])


def test_tasks_are_drawn_apart():
    # Task b mirrors task a: drawn together their means would cancel on every draw. Drawn apart, the
    # bootstrap variance of the estimate (their mean) is the plug-in one, 2 * (1/2)^2 * var_a / n.
    a = pd.Series([0.0, 0.0, 10.0, 40.0, 5.0, 0.0])
    estimate = mean_of_means([{"a": a, "b": -a}])
    table = PromptTable.of([{"a": a, "b": -a}])
    resampled = table.member_means(table.draws())[:, 0]
    plug_in = 2 * 0.25 * a.var(ddof=0) / len(a)
    assert resampled.var() == pytest.approx(plug_in, rel=0.1)
    assert estimate.high - estimate.low > 5
    # Every stratum gets its own rows even when the sizes agree.
    first, second = draw_indices([6, 6])
    assert not np.array_equal(first, second)


def test_the_p_value_rejects_exactly_where_the_interval_excludes_0():
    rng = np.random.default_rng(3)
    for shift in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0):
        found = mean_of_means([{task: pd.Series(shift + rng.normal(0, 3, 10)) for task in range(3)}])
        assert (found.p_value <= 0.05) == (found.low > 0 or found.high < 0), shift


def test_tied_strata_carry_no_information_and_an_exact_bound():
    # Every one of 10 samples tied in each of two tasks: not a zero-width interval but the exact bound,
    # 0 of 20 prompts differing: the share may be up to 1 - 0.025^(1/20), times 100 points either way.
    tied = {"vt": pd.Series([0.0] * 10), "fwe": pd.Series([0.0] * 10)}
    estimate = mean_of_means([tied])
    upper = 1 - 0.025 ** (1 / 20)
    assert estimate.method == EXACT and estimate.no_information
    assert (estimate.low, estimate.high) == pytest.approx((-100 * upper, 100 * upper))
    assert estimate.informative_strata == (0, 2) and estimate.informative_prompts == (0, 20)


def test_one_differing_sample_is_bounded_exactly_not_by_the_draws():
    # One of 10 samples differs by 100 points: a third of the draws miss it, so the resampling cannot
    # bound the gain; the exact bound: 1 of 10 departing from 0, Clopper-Pearson's upper limit of 1/10.
    estimate = mean_of_means([{"vt": pd.Series([100.0] + [0.0] * 9)}])
    upper = stats.beta.ppf(0.975, 2, 9)  # Clopper-Pearson's upper end for 1 of 10
    assert estimate.value == pytest.approx(10.0)
    assert estimate.method == EXACT and not estimate.no_information
    assert (estimate.low, estimate.high) == pytest.approx((-100 * upper, 100 * upper))


def test_a_score_is_bounded_within_its_range():
    # A task scoring 0 on all 10 samples: [0, 100 * (1 - 0.025^(1/10))], never below 0.
    estimate = mean_of_means([{"vt": pd.Series([0.0] * 10)}], value_range=(0.0, 100.0))
    assert (estimate.low, estimate.high) == pytest.approx((0.0, 100 * (1 - 0.025**0.1)))


def simulated_coverage(prompts: int, simulations: int, seed: int) -> float:
    """The share of simulated grids whose 95% interval holds the true mean gain. A grid: 6 tasks, 2 of
    them at a floor (every configuration ties on every prompt), 4 configurations sharing each task's
    prompts (a prompt effect common to them, sd 6 points), each configuration's own skewed noise
    (centred exponential, sd 4) and a true gain of 2 points in every informative task: the mean gain
    over the 6 tasks is 2 * 4 / 6."""
    rng = np.random.default_rng(seed)
    truth = 2.0 * 4 / 6
    covered = 0
    for _ in range(simulations):
        members = [{} for _ in range(4)]
        for task in range(6):
            if task >= 4:
                for member in members:
                    member[task] = pd.Series(np.zeros(prompts))
                continue
            common = rng.normal(0, 6, prompts)
            for member in members:
                member[task] = pd.Series(2.0 + common + rng.exponential(4, prompts) - 4)
        estimate = mean_of_means(members)
        covered += estimate.low <= truth <= estimate.high
    return covered / simulations


@pytest.mark.parametrize("prompts", [5, 10, 30])
def test_the_interval_holds_its_coverage(prompts):
    # 1000 grids: a coverage of 95% is measured to +-1.4 points (two standard errors).
    assert 0.93 <= simulated_coverage(prompts, 1000, seed=prompts) <= 0.97


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


def test_samples_needed_from_the_t_distribution():
    # The smallest n with (t_0.975,n-1 + t_0.8,n-1) / sqrt(n) <= gain / spread (t quantiles from
    # tables). Effect size 0.5: the normal approximation's 31.4 becomes n = 34: at df 33,
    # (2.0345 + 0.8526) / sqrt(34) = 0.4951 <= 0.5; at df 32, (2.0369 + 0.8530) / sqrt(33) = 0.5031.
    assert samples_needed(spread=1.0, gain=0.5) == 34
    # Effect size 1: n = 10: (2.2622 + 0.8834) / sqrt(10) = 0.9947; at 9, (2.3060 + 0.8889) / 3 = 1.065.
    assert samples_needed(spread=10.0, gain=-10.0) == 10
    assert samples_needed(spread=0.0, gain=1.0) is None and samples_needed(spread=1.0, gain=0.0) is None


@pytest.mark.parametrize(
    ("paper", "low", "high", "null", "expected_direction", "expected_size"),
    [
        (3.38, 0.10, 1.20, 0.0, "replicated", "smaller than the paper's"),  # both at once, each said
        (3.38, 2.00, 5.00, 0.0, "replicated", "consistent"),
        (3.38, -0.50, 2.00, 0.0, "unresolved", "smaller than the paper's"),
        (3.38, -2.00, -0.50, 0.0, "reversed", "smaller than the paper's"),
        (3.38, -0.50, 4.00, 0.0, "unresolved", "consistent"),
        (3.38, 4.00, 9.00, 0.0, "replicated", "larger than the paper's"),
        (-0.04, -0.50, -0.10, 0.0, "replicated", "larger than the paper's"),
        (-0.04, 0.02, 0.06, 0.0, "reversed", "smaller than the paper's"),
        (63 / 64, 0.79, 1.00, 0.5, "replicated", "consistent"),
        (1.0, 0.35, 0.85, 0.5, "unresolved", "smaller than the paper's"),
    ],
)
def test_direction_and_size_are_separate_verdicts(paper, low, high, null, expected_direction, expected_size):
    assert direction(paper, low, high, null) == expected_direction
    assert size(paper, low, high) == expected_size


def test_a_gain_without_spread_is_sized_as_whole_sample_flips():
    # A 4-point gain made of 100-point flips: 4% of samples flip, the rest tie: sd 100 * sqrt(.04 * .96).
    assert flips_spread(4.0) == pytest.approx(19.5959, abs=1e-4)
    assert flips_spread(-4.0) == flips_spread(4.0) and flips_spread(0.0) == 0.0


def test_holm_on_a_textbook_family():
    # Holm (1979): sorted p 0.01, 0.02, 0.03, 0.04 times 4, 3, 2, 1 -> 0.04, 0.06, 0.06 (monotone), 0.06.
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])
