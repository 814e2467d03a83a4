"""Intervals where results are compared: a prompt-clustered, studentized bootstrap of the tables'
averages with an exact bound where the samples cannot carry one, the sign test's exact interval, and
the samples per task a gain of a given size needs.

Every score the tables show is a mean of means: a task score is the mean over its samples, an average
the unweighted mean over its tasks, a claim such as "+3.38 points on average" the mean over
configurations of such averages' differences. ``mean_of_means`` takes that structure as *members*
(a configuration, or a +ResKV pair's per-sample differences), each a mapping from *stratum* (a task of
one backbone, benchmark and length) to per-sample values indexed by sample index.

**Clustering.** The grid runs every method and configuration on the same prompts of a task, so the
prompt is the unit of resampling: each draw resamples the prompts of every stratum once
(``PromptDraws``: one index matrix per stratum, the strata drawn apart: stratified) and every member
of the estimate is read on that same draw (paired across methods and configurations). Members that
share a stratum are restricted to the samples all of them have. The draws come from numpy's
generator rather than ``scipy.stats.bootstrap``: the same draw must carry several statistics (the
mean gain, the count of configurations improved, the share of the loss recovered), which scipy's
bootstrap, drawing inside each call, cannot share. The generator is seeded (``SEED``) afresh for
every estimate, so a table regenerates byte for byte on the same numpy, whatever else was estimated
before it.

**Interval: studentized (bootstrap-t).** With ``T`` the estimate and ``SE`` its stratified standard
error (``sqrt(sum_s var_s / n_s)``, sample variance per stratum), each draw gives
``t* = (T* - T) / SE*``, and the interval is ``[T - t*_(0.975) SE, T - t*_(0.025) SE]`` (Efron &
Tibshirani, *An Introduction to the Bootstrap*, ch. 12; Hall, *The Bootstrap and Edgeworth Expansion*,
3.5). Why not the percentile interval: at ten prompts per task it is too narrow (its spread is the
plug-in one, ``(n-1)/n`` of the variance, and it ignores the estimate's own uncertainty about its
spread), and the reproduction's verdicts are read at ten; BCa corrects bias and skew but not that
narrowness. The bootstrap-t carries the t distribution's small-sample widening and the data's skew at
once; ``tests/test_statistics.py`` simulates its coverage at 5, 10 and 30 prompts per task.
A draw without spread (every prompt drawn alike) has ``t* = +-inf`` (0 when ``T* = T``): when more
than 2.5% of draws are such, the samples cannot bound the estimate, and the interval is the exact bound.

**Exact bound.** Where no prompt differs (a floor: every compared method scores the same on every
sample) or too few do for the resampling to bound the estimate, the interval is Clopper-Pearson's:
with ``k`` of ``N`` prompts (pooled over strata) departing from the value most prompts of their
stratum share, the share that may depart is at most the exact 95% upper limit ``U(k, N)``, and the
estimate lies within ``U`` times the largest distance the metric allows from that value (``value_range``:
-100 to 100 points for a score difference, 0 to 100 for a score). Exact where the strata weigh alike
and hold alike numbers of prompts, as a grid's tasks do. ``Estimate.method`` says which interval a
row carries; ``Estimate.informative`` how many strata and prompts carried information.

``samples_needed`` is the t-based sample size of a paired test: the smallest ``n`` with
``(t_{0.975, n-1} + t_{0.8, n-1}) * spread / sqrt(n) <= |gain|`` (the normal approximation of Chow,
Shao & Wang, *Sample Size Calculations in Clinical Research*, 3.1, with the t quantiles in place of
the normal ones), ``spread`` the estimate's (its standard error times the square root of the samples
per stratum).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

CONFIDENCE = 0.95
POWER = 0.8
N_RESAMPLES = 3999  # (N_RESAMPLES + 1) * 0.025 is whole: the interval's ends are order statistics
SEED = 0
DIFFERENCE_RANGE = (-100.0, 100.0)  # a score difference in points
SCORE_RANGE = (0.0, 100.0)

Member = Mapping[Hashable, pd.Series]  # stratum -> per-sample values, indexed by sample index

BOOTSTRAP_T, EXACT = "bootstrap-t", "exact"


@dataclass(frozen=True)
class Estimate:
    """A mean of means, its 95% interval, the samples per stratum behind it, its spread (its standard
    error times the square root of the samples per stratum), the interval's method (``BOOTSTRAP_T``
    or ``EXACT``), its two-sided p-value against 0 (1 on an exact bound, which never excludes its
    centre), and the strata and prompts that carried information (``(k, of)`` each)."""

    value: float
    low: float
    high: float
    samples: tuple[int, int]  # fewest and most samples in a stratum
    spread: float
    method: str = BOOTSTRAP_T
    p_value: float = 1.0
    informative_strata: tuple[int, int] = (0, 0)
    informative_prompts: tuple[int, int] = (0, 0)

    def interval_text(self, sign: str = "") -> str:
        return interval_text(self.low, self.high, sign)

    @property
    def samples_text(self) -> str:
        return samples_text(self.samples)

    @property
    def no_information(self) -> bool:
        return self.informative_prompts[0] == 0


def interval_text(low: float, high: float, sign: str = "") -> str:
    """``[low, high]`` at the tables' two decimals (``sign="+"`` writes the sign of each)."""
    return f"[{low:{sign}.2f}, {high:{sign}.2f}]"


def samples_text(samples: tuple[int, int]) -> str:
    """Fewest and most samples per stratum as the tables write them: ``10``, ``5-10``."""
    low, high = samples
    return str(low) if low == high else f"{low}-{high}"


def draw_indices(sizes: Sequence[int]) -> list[np.ndarray]:
    """One draw per stratum: for strata of ``sizes`` prompts (in the estimate's stratum order), an
    ``(N_RESAMPLES, size)`` matrix of prompt positions, each stratum drawn apart from one generator
    seeded ``SEED``; every member and configuration of the stratum is read on the same rows."""
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, size, size=(N_RESAMPLES, size)) for size in sizes]


@dataclass(frozen=True)
class PromptTable:
    """The members of an estimate on their shared prompts: per stratum (sorted), the prompts' sample
    indices and a prompts x members matrix of values, and each member's weight in each stratum (the
    tables' mean of means: ``1 / (members * the member's strata)``; 0 where it has none)."""

    strata: tuple[Hashable, ...]
    prompts: tuple[pd.Index, ...]
    values: tuple[np.ndarray, ...]  # (prompts, members) per stratum; NaN where a member is absent
    weights: np.ndarray  # (strata, members)

    @classmethod
    def of(cls, members: Sequence[Member]) -> PromptTable | None:
        """None without members or when a stratum has no sample its members all have. Missing values
        (NaN) are left out."""
        keys = sorted({key for member in members for key in member})
        if not keys:
            return None
        prompts, values = [], []
        weights = np.zeros((len(keys), len(members)))
        for position, key in enumerate(keys):
            having = [
                (number, member[key].dropna()) for number, member in enumerate(members) if key in member
            ]
            shared = having[0][1].index.sort_values()
            for _, series in having[1:]:
                if not series.index.equals(shared):
                    shared = shared.intersection(series.index).sort_values()
            if shared.empty:
                return None
            matrix = np.full((len(shared), len(members)), np.nan)
            for number, series in having:
                matrix[:, number] = series.loc[shared].to_numpy(float)
                weights[position, number] = 1 / (len(members) * len(members[number]))
            prompts.append(shared)
            values.append(matrix)
        return cls(tuple(keys), tuple(prompts), tuple(values), weights)

    @property
    def samples(self) -> tuple[int, int]:
        counts = [len(prompts) for prompts in self.prompts]
        return min(counts), max(counts)

    def combined(self, coefficients: np.ndarray | None = None) -> list[np.ndarray]:
        """Per stratum, each prompt's weighted sum over members (times ``coefficients``, one per
        member: a contrast's signs): the per-prompt values whose stratum means sum to the estimate."""
        scale = self.weights if coefficients is None else self.weights * coefficients
        return [np.nan_to_num(matrix) @ scale[position] for position, matrix in enumerate(self.values)]

    def draws(self) -> list[np.ndarray]:
        return draw_indices([len(prompts) for prompts in self.prompts])

    def member_means(self, draws: list[np.ndarray]) -> np.ndarray:
        """``(N_RESAMPLES, members)``: each member's own mean of means on every draw, all members on
        the same draw."""
        share = self.weights / self.weights.sum(axis=0, keepdims=True)
        total = np.zeros((N_RESAMPLES, self.weights.shape[1]))
        for position, (matrix, rows) in enumerate(zip(self.values, draws, strict=True)):
            total += np.nan_to_num(matrix)[rows].mean(axis=1) * share[position]
        return total

    def tied(self) -> np.ndarray:
        """``(members,)``: True where a member is 0 on every prompt it has (it ties throughout, so no
        draw can tell which side of 0 it falls on)."""
        return np.logical_and.reduce([np.all(np.nan_to_num(matrix) == 0, axis=0) for matrix in self.values])

    def informative(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Strata, and (member, prompt) cells, where a value departs from 0 (a difference that is not a
        tie): ``((strata informative, strata), (cells informative, cells))``."""
        strata = cells = total = 0
        for matrix, weights in zip(self.values, self.weights, strict=True):
            present = matrix[:, weights > 0]
            differing = int(np.count_nonzero(present != 0))
            strata += differing > 0
            cells += differing
            total += present.size
        return (strata, len(self.values)), (cells, total)


def _variance_of_mean(means: np.ndarray, squares: np.ndarray, size: int) -> np.ndarray:
    """The variance of a stratum mean (the sample variance over ``size``) from the means of the values
    and of their squares."""
    if size < 2:
        return np.zeros_like(means)
    plug_in = squares - means**2
    # Alike values leave rounding noise, not spread: a draw without spread must read as one.
    plug_in[plug_in <= 1e-12 * np.maximum(squares, 1e-300)] = 0.0
    return plug_in / (size - 1)


def studentized(
    combined: Sequence[np.ndarray], draws: Sequence[np.ndarray]
) -> tuple[float, float, np.ndarray]:
    """The estimate (sum of stratum means), its standard error and the studentized statistic ``t*`` of
    every draw (module docstring: ``+-inf`` for a draw without spread)."""
    value = float(sum(values.mean() for values in combined))
    variance = sum(values.var(ddof=1) / len(values) for values in combined if len(values) > 1)
    resampled = np.zeros(N_RESAMPLES)
    resampled_variance = np.zeros(N_RESAMPLES)
    for values, rows in zip(combined, draws, strict=True):
        drawn = values[rows]
        means = drawn.mean(axis=1)
        resampled += means
        resampled_variance += _variance_of_mean(means, (drawn**2).mean(axis=1), len(values))
    error = np.sqrt(resampled_variance)
    departure = resampled - value
    # A departure below float noise is none: the draw reproduced the estimate.
    departure[np.abs(departure) <= 1e-9 * max(1.0, abs(value))] = 0.0
    return value, math.sqrt(variance), _studentize(departure, error)


def _studentize(departure: np.ndarray, error: np.ndarray) -> np.ndarray:
    """``departure / error``, ``+-inf`` where a draw has no spread but departs, 0 where it neither."""
    t = np.zeros_like(departure)
    spread = error > 0
    t[spread] = departure[spread] / error[spread]
    departing = ~spread & (departure != 0)
    t[departing] = np.sign(departure[departing]) * np.inf
    return t


def _order_statistic(t: np.ndarray, share: float) -> float:
    """The ``(N_RESAMPLES + 1) * share``-th smallest ``t``."""
    return float(np.sort(t)[round((len(t) + 1) * share) - 1])


def exact_bound(combined: Sequence[np.ndarray], ranges: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The exact interval (module docstring): per stratum the value most of its prompts share, the
    pooled share of prompts departing from it bounded by Clopper-Pearson's 95% upper limit ``U``, the
    estimate within ``U`` times each stratum's distance from that value to the ends of its ``ranges``
    (the metric's range scaled by the stratum's weight in the estimate)."""
    departing = total = 0
    centre = reach_low = reach_high = 0.0
    for values, (low_end, high_end) in zip(combined, ranges, strict=True):
        found, counts = np.unique(values, return_counts=True)
        mode = float(found[np.lexsort((np.abs(found), -counts))[0]])  # most common; nearest 0 on a tie
        departing += int(np.count_nonzero(values != mode))
        total += len(values)
        centre += mode
        reach_low += mode - low_end
        reach_high += high_end - mode
    upper = clopper_pearson(departing, total)[1]
    return centre - upper * reach_low, centre + upper * reach_high


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """The exact 95% interval of a binomial share ``k`` of ``n``."""
    interval = stats.binomtest(k, n).proportion_ci(confidence_level=CONFIDENCE, method="exact")
    return float(interval.low), float(interval.high)


def _stratum_range(weights: np.ndarray, value_range: tuple[float, float]) -> tuple[float, float]:
    """The range of a stratum's combined value: members with positive weights at the metric's ends,
    those with negative ones (a contrast's other side) at the opposite ends."""
    low_end, high_end = value_range
    positive, negative = weights[weights > 0].sum(), weights[weights < 0].sum()
    low = (low_end * positive if positive else 0.0) + (high_end * negative if negative else 0.0)
    high = (high_end * positive if positive else 0.0) + (low_end * negative if negative else 0.0)
    return low, high


def estimate(
    table: PromptTable,
    value_range: tuple[float, float] = DIFFERENCE_RANGE,
    coefficients: np.ndarray | None = None,
) -> Estimate:
    """The estimate of ``table`` (its members' mean of means, each member times its ``coefficients``
    where given: a contrast), with the bootstrap-t interval or, where the draws cannot bound it, the
    exact one (module docstring); ``value_range``: the metric's (a member value's) range."""
    combined = table.combined(coefficients)
    scale = table.weights if coefficients is None else table.weights * coefficients
    ranges = [_stratum_range(row, value_range) for row in scale]
    value, error, t = studentized(combined, table.draws())
    samples = table.samples
    spread = error * math.sqrt(samples[0])
    strata, cells = table.informative()
    low_t, high_t = _order_statistic(t, (1 - CONFIDENCE) / 2), _order_statistic(t, (1 + CONFIDENCE) / 2)
    if error == 0 or not (math.isfinite(low_t) and math.isfinite(high_t)):
        low, high = exact_bound(combined, ranges)
        return Estimate(value, low, high, samples, spread, EXACT, 1.0, strata, cells)
    # Two-sided against 0, the Monte Carlo p-value (tail + 1) / (draws + 1) doubled: at most 5% exactly
    # when 0 lies outside the interval (t = T / SE beyond the order statistic an end is read from).
    observed = value / error
    tail = min(np.count_nonzero(t >= observed), np.count_nonzero(t <= observed))
    p_value = min(1.0, 2 * (int(tail) + 1) / (N_RESAMPLES + 1))
    low, high = value - high_t * error, value - low_t * error
    return Estimate(value, low, high, samples, spread, BOOTSTRAP_T, p_value, strata, cells)


def mean_of_means(
    members: Sequence[Member], value_range: tuple[float, float] = DIFFERENCE_RANGE
) -> Estimate | None:
    """The mean over ``members`` of each member's mean over its strata of its per-sample values, with
    its 95% interval (module docstring); None without members or when a stratum has no sample that
    all the members having it share. ``value_range``: a per-sample value's (a score difference's)."""
    table = PromptTable.of(members)
    return None if table is None else estimate(table, value_range)


def score_differences(base: Mapping[Hashable, pd.Series], other: Mapping[Hashable, pd.Series]) -> Member:
    """A member of ``mean_of_means``: ``other`` minus ``base`` in points (scores are fractions) on the
    samples both scored, for every stratum both have that shares a sample."""
    member = {}
    for key in sorted(base.keys() & other.keys()):
        difference = (other[key] - base[key]).dropna()
        if len(difference):
            member[key] = 100 * difference
    return member


def sign_test_interval(won: int, decided: int) -> tuple[float, float] | None:
    """The exact (Clopper-Pearson) 95% interval of the share won among the decided pairs, the sign
    test's (ties are left out, as the sign test leaves them); None without a decided pair."""
    return clopper_pearson(won, decided) if decided else None


def samples_needed(spread: float, gain: float) -> int | None:
    """Samples per stratum (task) for a 95% interval to exclude 0 with 80% power if the true gain is
    ``gain``: the smallest ``n`` with ``(t_{0.975, n-1} + t_{0.8, n-1}) * spread / sqrt(n) <= |gain|``
    (module docstring); None for a zero gain or spread."""
    if gain == 0 or spread == 0:
        return None

    def reached(n: int) -> bool:
        t = stats.t.ppf((1 + CONFIDENCE) / 2, n - 1) + stats.t.ppf(POWER, n - 1)
        return t * spread / math.sqrt(n) <= abs(gain)

    high = 2
    while not reached(high):
        high *= 2
    low = max(2, high // 2)
    while low < high:  # the smallest n reached: the condition only grows easier with n
        middle = (low + high) // 2
        low, high = (low, middle) if reached(middle) else (middle + 1, high)
    return low


def flips_spread(gain: float, largest: float = DIFFERENCE_RANGE[1]) -> float:
    """The spread of a gain made of whole-sample flips: ``|gain| / largest`` of the samples differing
    by ``largest`` (a binary metric's only way to differ), the rest tied: ``largest * sqrt(p (1 - p))``.
    What sizes a row no sample of which differed, where the observed spread is 0."""
    share = min(abs(gain) / largest, 1.0)
    return largest * math.sqrt(share * (1 - share))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979): the family's error rate held at the level."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def score_intervals(samples: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Per configuration (``keys``), ``score_low`` and ``score_high``: the 95% interval of its task
    score (percent, two decimals) over its scored samples."""
    rows = []
    scored = samples[samples["score"].notna()]
    for key, group in scored.groupby(list(keys), dropna=False, sort=False):
        found = mean_of_means([{0: 100 * group.set_index("index")["score"]}], SCORE_RANGE)
        rows.append([*key, round(found.low, 2), round(found.high, 2)])
    return pd.DataFrame(rows, columns=[*keys, "score_low", "score_high"])


@dataclass(frozen=True)
class Ratio:
    """A ratio of two means of means on the same draws (a share of a loss recovered): its value and
    95% bootstrap-t interval; ``value`` None where the denominator's own interval holds 0 (no loss
    measured to divide by), ``low`` and ``high`` None where the draws cannot bound the ratio."""

    value: float | None
    low: float | None = None
    high: float | None = None


def ratio_estimate(
    numerators: Sequence[Member], denominators: Sequence[Member], value_range: tuple[float, float]
) -> Ratio | None:
    """The mean of means of ``numerators`` over that of ``denominators`` (member by member on the
    same prompts: a gain over a loss), None when a stratum shares no sample. Its interval is the
    bootstrap-t's, per draw ``t* = (R* - R) / SE*`` with ``SE*`` the delta method's (the stratified
    standard error of ``(numerator - R* denominator) / D*``); the denominator is first estimated on
    its own (``estimate``, ``value_range`` its metric's) and a loss whose interval holds 0 is not
    divided."""
    table = PromptTable.of([*numerators, *denominators])
    if table is None:
        return None
    pick = np.array([1.0] * len(numerators) + [0.0] * len(denominators))
    loss = estimate(table, value_range, coefficients=1 - pick)
    if loss.low <= 0 <= loss.high:
        return Ratio(None)
    numerator, denominator, draws = table.combined(pick), table.combined(1 - pick), table.draws()
    total_n = sum(values.mean() for values in numerator)
    total_d = sum(values.mean() for values in denominator)
    value = total_n / total_d
    error = math.sqrt(
        sum(
            ((n - value * d) / total_d).var(ddof=1) / len(n)
            for n, d in zip(numerator, denominator, strict=True)
            if len(n) > 1
        )
    )
    resampled_n, resampled_d = np.zeros(N_RESAMPLES), np.zeros(N_RESAMPLES)
    for n, d, rows in zip(numerator, denominator, draws, strict=True):
        resampled_n += n[rows].mean(axis=1)
        resampled_d += d[rows].mean(axis=1)
    variance = np.zeros(N_RESAMPLES)
    with np.errstate(divide="ignore", invalid="ignore"):
        resampled = resampled_n / resampled_d
        for n, d, rows in zip(numerator, denominator, draws, strict=True):
            if len(n) > 1:
                linear = (n[rows] - resampled[:, None] * d[rows]) / resampled_d[:, None]
                variance += linear.var(axis=1, ddof=1) / len(n)
        departure = resampled - value
    # Rounding noise is no spread, nor departure (as in ``studentized``); a draw whose loss is 0
    # (an undefined ratio) counts as departing without bound.
    spread = np.where(variance > 1e-24 * np.maximum(resampled**2, 1), np.sqrt(variance), 0.0)
    departure[np.abs(departure) <= 1e-9 * max(1.0, abs(value))] = 0.0
    departure[~np.isfinite(departure)] = np.inf
    spread[~np.isfinite(spread)] = 0.0
    t = _studentize(departure, spread)
    low_t, high_t = _order_statistic(t, (1 - CONFIDENCE) / 2), _order_statistic(t, (1 + CONFIDENCE) / 2)
    if error == 0 or not (math.isfinite(low_t) and math.isfinite(high_t)):
        return Ratio(value)
    return Ratio(value, value - high_t * error, value - low_t * error)


REPLICATED, UNRESOLVED, REVERSED, NO_INFORMATION = "replicated", "unresolved", "reversed", "no information"
CONSISTENT, SMALLER, LARGER = "consistent", "smaller than the paper's", "larger than the paper's"


def direction(paper: float, low: float, high: float, null: float = 0.0) -> str:
    """Whether the reproduced interval ``[low, high]`` settles the sign the paper reports (its value
    against ``null``: 0 for a gain, 1/2 for a share won): ``replicated`` when it lies wholly on the
    paper's side of ``null``, ``reversed`` when wholly on the other, ``unresolved`` when it holds
    ``null``. A paper value equal to ``null`` counts as the positive side."""
    side = 1 if paper >= null else -1
    if side * (low - null) > 0 and side * (high - null) > 0:
        return REPLICATED
    if side * (low - null) < 0 and side * (high - null) < 0:
        return REVERSED
    return UNRESOLVED


def size(paper: float, low: float, high: float) -> str:
    """Where the paper's value lies against the reproduced interval, read on the paper's side of 0:
    inside (``consistent``), beyond its far end (the reproduced effect is ``smaller than the
    paper's``) or short of its near end (``larger than the paper's``)."""
    side = 1 if paper >= 0 else -1
    paper, low, high = side * paper, *sorted((side * low, side * high))
    if paper > high:
        return SMALLER
    if paper < low:
        return LARGER
    return CONSISTENT
