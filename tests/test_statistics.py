"""The statistics of the tables and the verdict (scripts.report.statistics) against values worked here
from the definitions: the sign-flip test's p-value and critical value by a plain loop over sign
patterns, the exact bound and the sign test's interval from the binomial distribution, Wilson's and
Fieller's intervals from their formulas, the sample size from the t distribution's textbook values.
Every test runs in well under a second; the coverage simulations are tests/test_verdict_coverage.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from scripts.report.statistics import (
    DRAWS,
    EXACT,
    FLIP,
    PromptTable,
    direction,
    exact_bound,
    far_end,
    gain_estimate,
    holm,
    mean_of_means,
    ratio_estimate,
    samples_needed,
    score_differences,
    score_estimate,
    sign_flip,
    sign_test_interval,
    size,
)


def flipped(contributions: list[float]) -> list[float]:
    """The estimate (sum) under every sign pattern of the nonzero ``contributions``: a plain loop."""
    nonzero = [value for value in contributions if value != 0]
    return [
        sum(sign * value for sign, value in zip(signs, nonzero, strict=True))
        for signs in itertools.product((1, -1), repeat=len(nonzero))
    ]


def test_the_estimate_is_the_tables_mean_of_means():
    base = [0.2, 0.5, 0.1, 0.9, 0.4]
    reskv = [0.5, 0.4, 0.6, 1.0, 0.9]  # differences 30, -10, 50, 10, 50 points: mean 26
    estimate = mean_of_means([score_differences({"vt": pd.Series(base)}, {"vt": pd.Series(reskv)})])
    assert estimate.value == pytest.approx(26.0)
    assert estimate.samples == (5, 5)
    # The spread: the differences' sample standard deviation, sqrt(680) (deviations 4, -36, 24, -16, 24).
    assert estimate.spread == pytest.approx(math.sqrt((16 + 1296 + 576 + 256 + 576) / 4))
    assert estimate.informative_cells == (5, 5) and estimate.differing_prompts == (5, 5)


def far_end_by_hand(contributions: list[float]) -> float:
    """The interval's reach beyond the estimate ``T``, away from 0: the larger root ``d`` of
    ``(d - T)^2 = t^2 (S (1 - m^2) + S m^2 d / T)``, less ``T`` (``statistics`` module docstring)."""
    nonzero = [value for value in contributions if value != 0]
    total = abs(sum(contributions))
    second = sum(value * value for value in nonzero)
    share = total / sum(abs(value) for value in nonzero)
    q2 = stats.t.ppf(0.975, len(nonzero) - 1) ** 2
    # d^2 - (2T + q2 S m^2 / T) d + T^2 - q2 S (1 - m^2) = 0
    b = 2 * total + q2 * second * share**2 / total
    c = total**2 - q2 * second * (1 - share**2)
    return (b + math.sqrt(b * b - 4 * c)) / 2 - total


def test_the_p_value_counts_the_sign_patterns_at_least_as_far_from_0():
    # Seven prompts of one task, differences 10, 20, ..., 70 points, one of them a loss: contributions
    # d / 7. The p-value: the share of the 128 patterns whose |sum| reaches the observed one.
    differences = [10.0, 20.0, -30.0, 40.0, 50.0, 60.0, 70.0]
    contributions = [value / 7 for value in differences]
    observed = abs(sum(contributions))
    sums = flipped(contributions)
    expected = sum(abs(value) >= observed - 1e-12 for value in sums) / len(sums)
    test = sign_flip(np.array(contributions))
    assert test.exact and test.patterns == 128 and test.differing == 7
    assert test.p_value == pytest.approx(expected)
    # The critical value: the 7th farthest |sum| (floor(0.05 * 128) + 1): the interval's end toward 0,
    # so that it excludes 0 exactly when fewer than 0.05 of the patterns reach the observed distance.
    critical = sorted(map(abs, sums), reverse=True)[6]
    assert test.critical == pytest.approx(critical)
    found = mean_of_means([{"vt": pd.Series(differences)}])
    assert found.kind == FLIP
    far = max(critical, far_end_by_hand(contributions))
    assert far_end(np.array(contributions), critical) == pytest.approx(far)
    assert (found.low, found.high) == pytest.approx((observed - critical, observed + far))
    assert (found.low > 0) == (test.p_value <= 0.05)


def test_a_prompt_flips_as_a_whole_with_every_configuration_on_it():
    # Two configurations on six prompts of one task: the first gains 100 on prompts 0-5, the second loses
    # 100 on prompts 0-2 (the same prompts). Per prompt, the pair's mean: 0, 0, 0, 50, 50, 50. Flipping
    # prompts as wholes, three contributions of 50 / 6 differ: no pattern reaches 0.05 (p = 2 / 8 at
    # best), and the interval is the exact bound. Flipped cell by cell, nine cells would differ and
    # the all-aligned patterns reach 2 / 512.
    one = {"vt": pd.Series([100.0] * 6)}
    two = {"vt": pd.Series([-100.0] * 3 + [0.0] * 3)}
    found = mean_of_means([one, two])
    assert found.value == pytest.approx(25.0)
    assert found.test.differing == 3 and found.p_value is None and found.kind == EXACT
    assert found.test.p_value == pytest.approx(sum(abs(s) >= 25 - 1e-9 for s in flipped([50 / 6] * 3)) / 8)
    # Mirror images cancel prompt by prompt: no prompt differs, whatever their cells do.
    mirrored = mean_of_means([one, {"vt": -one["vt"]}])
    assert mirrored.value == 0.0 and mirrored.test.differing == 0


def test_tasks_flip_apart_and_weigh_as_the_tables_average_them():
    # Task a (6 prompts) gains 30 on every prompt, task b (3 prompts) loses 30 on each: estimate
    # (30 - 30) / 2 = 0 with contributions 15 / 6 (six) and -15 / 3 (three).
    member = {"a": pd.Series([30.0] * 6), "b": pd.Series([-30.0] * 3)}
    found = mean_of_means([member])
    contributions = [15 / 6] * 6 + [-15 / 3] * 3
    sums = flipped(contributions)
    assert found.value == pytest.approx(0.0)
    assert found.test.p_value == pytest.approx(sum(abs(s) >= -1e-12 for s in sums) / len(sums)) == 1.0
    assert found.test.critical == pytest.approx(sorted(map(abs, sums), reverse=True)[25])  # 512 / 20 + 1


def test_the_interval_excludes_0_exactly_when_the_test_rejects():
    rng = np.random.default_rng(3)
    for trial in range(60):
        tasks = rng.integers(1, 4)
        member = {
            task: pd.Series(
                100.0 * rng.choice([-1, 0, 0, 1, 1], size=rng.integers(3, 12)) / rng.choice([1, 3])
            )
            for task in range(tasks)
        }
        found = mean_of_means([member])
        if found.p_value is None:  # fewer than 6 prompts differ: the exact bound, which holds 0
            assert found.kind == EXACT and found.low <= 0 <= found.high, trial
        else:
            assert (found.p_value <= 0.05) == (found.low > 0 or found.high < 0), trial


def test_a_monte_carlo_p_value_counts_the_observed_pattern():
    # 30 prompts all gaining: no drawn pattern (chance 2 / 2^30 each) reaches the observed sum, and the
    # p-value is 1 / (draws + 1), never 0, with its standard error.
    test = sign_flip(np.full(30, 1.0), seed=5)
    assert not test.exact and test.patterns == DRAWS
    assert test.p_value == 1 / (DRAWS + 1)
    assert test.error == pytest.approx(math.sqrt(test.p_value * (1 - test.p_value) / DRAWS))
    assert test.text == "0.000 \u00b1 0.000"


def test_a_monte_carlo_p_value_is_the_exact_one_to_its_error():
    # 22 prompts (Monte Carlo beyond 20): the same p-value as every pattern enumerated, within 4 errors,
    # and the interval still excludes 0 exactly when the p-value is at most 0.05.
    rng = np.random.default_rng(11)
    contributions = rng.choice([-3.0, -1.0, 1.0, 2.0, 3.0], size=22) / 22 + 0.04
    drawn, exact = sign_flip(contributions, seed=1), sign_flip(contributions, exact_limit=22)
    assert exact.exact and not drawn.exact
    assert abs(drawn.p_value - exact.p_value) <= 4 * drawn.error
    assert (abs(contributions.sum()) > drawn.critical) == (drawn.p_value <= 0.05)


def test_a_drawn_critical_value_carries_its_monte_carlo_error():
    # 40 prompts: the critical value (the interval's end toward 0) read off 99,999 drawn patterns moves
    # with the seed by about the error it reports (the order statistics a binomial deviation apart).
    contributions = np.random.default_rng(0).normal(size=40)
    drawn = [sign_flip(contributions, seed=seed) for seed in range(20)]
    spread = float(np.std([test.critical for test in drawn], ddof=1))
    assert 0.5 < spread / drawn[0].critical_error < 2
    assert sign_flip(contributions[:10]).critical_error == 0.0  # enumerated: exact


def test_no_prompt_differing_is_no_information_and_an_exact_bound():
    # Every one of 10 samples tied in each of two tasks: not a zero-width interval but the exact bound,
    # 0 of 20 prompts departing: Clopper-Pearson's upper limit 1 - 0.025^(1/20) of 20 prompts, each
    # reaching 50 points (a task's half of the range) over 10 prompts.
    tied = {"vt": pd.Series([0.0] * 10), "fwe": pd.Series([0.0] * 10)}
    found = mean_of_means([tied])
    upper = 1 - 0.025 ** (1 / 20)
    assert found.kind == EXACT and found.no_information and found.p_value is None
    assert (found.low, found.high) == pytest.approx((-100 * upper, 100 * upper))
    assert found.informative_strata == (0, 2) and found.informative_cells == (0, 20)


def test_rounding_left_over_by_cancelling_members_is_no_difference():
    # Three configurations whose differences cancel on every prompt up to float rounding (their mean
    # is 1e-15, not 0): no prompt differs, and the interval is the exact bound, not one scaled by a
    # spread of 1e-15 (a studentized interval 1e14 points wide).
    values = (100 / 3, 100 / 3, -200 / 3)
    assert np.array(values) @ np.full(3, 1 / 3) != 0
    found = mean_of_means([{"vt": pd.Series([value] * 8)} for value in values])
    assert found.test.differing == 0 and found.kind == EXACT and found.p_value is None
    upper = 100 * (1 - 0.025 ** (1 / 8))
    assert (found.low, found.high) == pytest.approx((-upper, upper))


def test_one_differing_sample_is_bounded_exactly():
    # One of 10 samples differs by 100 points: the exact bound, 1 of 10 departing from 0, Clopper-
    # Pearson's upper limit of 1/10 of 10 prompts, each reaching 100 / 10 points.
    found = mean_of_means([{"vt": pd.Series([100.0] + [0.0] * 9)}])
    upper = stats.beta.ppf(0.975, 2, 9)
    assert found.value == pytest.approx(10.0)
    assert found.kind == EXACT and not found.no_information
    assert (found.low, found.high) == pytest.approx((-100 * upper, 100 * upper))


def coverage(bound, sizes: tuple[int, int], rates: list[tuple[float, float]]) -> list[float]:
    """The exact coverage of ``bound`` (``exact_bound``'s signature) on two pooled tasks of ``sizes``
    prompts, each prompt of task ``t`` gaining 100 points with chance ``rate[t]``, else tying, for each
    pair of ``rates``: summed over every count of gains in each task with its binomial probability."""
    bounds = {}
    for counts in itertools.product(range(sizes[0] + 1), range(sizes[1] + 1)):
        combined = [np.array([50.0] * k + [0.0] * (n - k)) for k, n in zip(counts, sizes, strict=True)]
        bounds[counts] = bound(combined, [(-50.0, 50.0)] * 2)
    found = []
    for rate in rates:
        truth = sum(100 * chance / 2 for chance in rate)
        found.append(
            sum(
                stats.binom.pmf(k0, sizes[0], rate[0]) * stats.binom.pmf(k1, sizes[1], rate[1])
                for (k0, k1), (low, high) in bounds.items()
                if low <= truth <= high
            )
        )
    return found


def pooled_bound(combined, ranges):
    """The exact bound as a pooled share of prompts times the summed reach (the rule before the worst
    reach): exact only for strata of equal size."""
    departing = sum(int(np.count_nonzero(values)) for values in combined)
    total = sum(len(values) for values in combined)
    upper = stats.beta.ppf(0.975, departing + 1, total - departing) if departing < total else 1.0
    return -upper * sum(high for _, high in ranges), upper * sum(high for _, high in ranges)


def test_the_exact_bound_holds_its_level_when_unequal_tasks_are_pooled():
    # Tasks of 10 and 5 prompts pooled at equal weight (RULER-4K at 10 samples with RULER-16K at 5), the
    # gains all in the smaller task: a pooled share times the summed reach covers less than 95% for
    # some rates; the largest reach a prompt has holds 95% at every rate.
    rates = [(0.0, rate) for rate in np.linspace(0.02, 0.5, 25)]
    assert min(coverage(pooled_bound, (10, 5), rates)) < 0.95
    assert min(coverage(exact_bound, (10, 5), rates)) >= 0.95
    assert min(coverage(exact_bound, (5, 10), [rate[::-1] for rate in rates])) >= 0.95


def test_a_few_differing_prompts_never_settle_a_direction():
    # Up to 5 prompts of a task differing by 100 in either direction, the rest tied (up to 9 prompts in
    # all; one task, so only the counts matter): no test reaches 0.05 (2 / 2^5 > 0.05), and the exact
    # bound that replaces it always holds 0.
    for gains, losses, ties in itertools.product(range(6), range(6), range(9)):
        if 0 < gains + losses <= 5:
            found = mean_of_means([{"vt": pd.Series([100.0] * gains + [-100.0] * losses + [0.0] * ties)}])
            assert found.p_value is None and found.kind == EXACT
            assert found.low <= 0 <= found.high, (gains, losses, ties)


def test_a_score_carries_wilsons_interval():
    # One task, 3 of 10 samples answered: Wilson's interval for 3/10, in points.
    found = score_estimate({"vt": pd.Series([100.0] * 3 + [0.0] * 7)})
    z = stats.norm.ppf(0.975)
    centre, half = (
        (0.3 + z * z / 20) / (1 + z * z / 10),
        z / (1 + z * z / 10) * math.sqrt(0.021 + z * z / 400),
    )
    assert (found.low, found.high) == pytest.approx((100 * (centre - half), 100 * (centre + half)))
    # No sample answered: [0, z^2 / (n + z^2)], never below 0.
    floor = score_estimate({"vt": pd.Series([0.0] * 10)})
    assert (floor.low, floor.high) == pytest.approx((0.0, 100 * z * z / (10 + z * z)))


def test_a_share_recovered_carries_fiellers_interval():
    # One task, six prompts: gains 20, 0, 20, 0, 10, 0 of losses 80, 60, 90, 70, 50, 80 points. Fieller:
    # the R with (g - R l)^2 <= z^2 (Vg - 2 R Cgl + R^2 Vl), the variances of the prompts' means.
    gains = pd.Series([20.0, 0.0, 20.0, 0.0, 10.0, 0.0])
    losses = pd.Series([80.0, 60.0, 90.0, 70.0, 50.0, 80.0])
    found = ratio_estimate([{"vt": gains}], [{"vt": losses}])
    gain, loss = gains.mean(), losses.mean()
    vg, vl, cgl = gains.var() / 6, losses.var() / 6, gains.cov(losses) / 6
    z2 = stats.norm.ppf(0.975) ** 2
    a, b, c = loss * loss - z2 * vl, gain * loss - z2 * cgl, gain * gain - z2 * vg
    roots = ((b - math.sqrt(b * b - a * c)) / a, (b + math.sqrt(b * b - a * c)) / a)
    assert found.value == pytest.approx(50 / 430)
    assert (found.low, found.high) == pytest.approx(roots)
    # A loss not significantly above 0 is none to recover.
    assert ratio_estimate([{"vt": gains}], [{"vt": gains - 5}]).value is None


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
    ("paper", "value", "p_value", "expected"),
    [
        (3.38, 0.5, 0.01, "replicated"),
        (3.38, 0.5, 0.05, "replicated"),  # at most 0.05 rejects
        (3.38, 0.5, 0.05000001, "unresolved"),
        (3.38, -0.5, 0.01, "reversed"),
        (3.38, 0.0, 0.01, "unresolved"),  # an estimate of 0 lies on neither side
        (0.0, 0.5, 0.01, "replicated"),  # a paper value of 0 counts as the positive side
        (-0.04, -0.5, 0.01, "replicated"),
        (-0.04, 0.5, 0.01, "reversed"),
        (3.38, 0.5, None, "unresolved"),  # a test that cannot reach 0.05
    ],
)
def test_direction_is_the_tests_and_the_estimates_side(paper, value, p_value, expected):
    assert direction(paper, value, p_value) == expected


@pytest.mark.parametrize(
    ("paper", "low", "high", "expected"),
    [
        (3.38, 0.10, 1.20, "smaller than the paper's"),
        (3.38, 2.00, 5.00, "consistent"),
        (3.38, -0.50, 4.00, "consistent"),
        (3.38, 4.00, 9.00, "larger than the paper's"),
        (-0.04, -0.50, -0.10, "larger than the paper's"),
        (-0.04, 0.02, 0.06, "smaller than the paper's"),
    ],
)
def test_size_reads_the_papers_value_against_the_interval(paper, low, high, expected):
    assert size(paper, low, high) == expected


def test_holm_on_a_textbook_family():
    # Holm (1979): sorted p 0.01, 0.02, 0.03, 0.04 times 4, 3, 2, 1 -> 0.04, 0.06, 0.06 (monotone), 0.06.
    assert holm([0.03, 0.01, 0.04, 0.02]) == pytest.approx([0.06, 0.04, 0.06, 0.06])


def test_the_estimate_of_a_contrast_flips_its_prompts_whole():
    # Two members on one task, the contrast +1 / -1 (coefficients 2 and -2 over the two members'
    # weights 1/2): per prompt, the first's difference less the second's.
    table = PromptTable.of([{"vt": pd.Series([100.0] * 7)}, {"vt": pd.Series([0.0] * 7)}])
    found = gain_estimate(table, coefficients=np.array([2.0, -2.0]))
    assert found.value == pytest.approx(100.0)
    assert found.test.p_value == pytest.approx(2 / 128)
    # |sums| of 7 contributions of 100 / 7: 100 (2 patterns), 500 / 7 (14), ...: the 7th farthest toward
    # 0; away from it, the score end (all of the contributions' size carried: m = 1), 100 + 144.66,
    # beyond the contrast's range (-200 to 200 points): 200.
    assert far_end_by_hand([100 / 7] * 7) == pytest.approx(144.66, abs=0.01)
    assert (found.low, found.high) == pytest.approx((100 - 500 / 7, 200.0))


def test_the_interval_stays_within_the_metrics_range():
    # Six prompts all gaining 100: the 4th farthest |sum| is 200 / 3 (64 patterns: 100 twice, 200 / 3
    # twelve times), so from 100 - 66.67, its upper end at the largest gain a score allows, 100.
    found = mean_of_means([{"vt": pd.Series([100.0] * 6)}])
    assert found.test.p_value == pytest.approx(2 / 64)
    assert (found.low, found.high) == pytest.approx((100 / 3, 100.0))
