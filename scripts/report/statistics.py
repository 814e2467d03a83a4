"""Statistics where results are compared: an exact stratified sign-flip test over prompts with the
interval that matches it, an exact bound where too few prompts differ for any test, Wilson's score
interval for a score, Fieller's interval for a share recovered, Holm's adjustment, and the samples per
task a gain of a given size needs.

Every number the tables show is a mean of means: a task score is the mean over its samples, an average
the unweighted mean over its tasks, a claim such as "+3.38 points on average" the mean over
configurations of such averages' differences. ``PromptTable`` takes that structure as *members* (a
configuration, or a +ResKV pair's per-sample differences), each a mapping from *stratum* (a task of one
backbone, benchmark and length) to per-sample values indexed by sample index. The grid runs every method
and configuration on the same prompts of a task, so the prompt is the unit: a prompt's *contribution* is
its weighted sum over the members, divided by its stratum's prompts, and the estimate is the sum of the
contributions. Members that share a stratum are restricted to the samples all of them have.

**The test (direction).** Null hypothesis: within every prompt, +ResKV and the method it is compared
with are exchangeable, so that each prompt's contribution is as likely to be ``c`` as ``-c`` (for a
contrast, the two sides' gains are exchangeable: its contribution is symmetric about 0). No assumption
on how scores are distributed, how many prompts tie, or how the configurations of a prompt move
together: a prompt's whole contribution flips as one, every configuration of the prompt with it, each
task's prompts within their task (stratified). Under the null every one of the ``2^k`` sign patterns of
the ``k`` prompts that differ is equally likely; the two-sided p-value is the share of patterns whose
estimate lies at least as far from 0 as the observed one (Fisher, *The Design of Experiments*, 21;
Good, *Permutation, Parametric and Bootstrap Tests of Hypotheses*, 3.1.2). Up to ``EXACT_LIMIT``
differing prompts every pattern is enumerated: the p-value is exact. Beyond, ``DRAWS`` patterns are
drawn (Monte Carlo, a generator seeded ``SEED`` afresh for every test, so tables regenerate byte for
byte), the p-value is ``(1 + b) / (DRAWS + 1)`` with ``b`` the draws at least as far (a valid p-value at
any number of draws: Phipson & Smyth, *Stat. Appl. Genet. Mol. Biol.* 9, 2010), and its Monte Carlo
standard error is reported with it. A p-value within 4 errors of a threshold Holm's adjustment may hold
it to (0.05 / j) is drawn again with ten times the patterns (a third of the error), so that a printed
word could move with the seed only for a p-value within 4 of those smaller errors of a threshold. With
``k`` differing prompts no p-value falls below ``2 / 2^k``: under 6 the test cannot reach 5%, and says
so (``SignFlip.can_reject``).

**The interval that matches it.** Toward 0 it ends at the test's critical value ``h`` from the
estimate ``T``: the test rejects exactly the estimates farther than ``h`` from 0, so the interval
excludes 0 exactly when the test rejects (at 5%, two-sided; Lehmann, *Nonparametrics*, 4.4, the
randomization interval under a shift). Away from 0 it ends where a score test (the variance taken at the
value tested, Wilson's principle) stops holding the value: on these data a larger gain is carried by
more differing prompts, not by larger differences, so the part of the variance that the prompts' signs
do not cancel grows with it. With ``S`` the contributions' second moment about 0 and ``m = |T| / sum |c|``
the share of their size that does not cancel, the variance at a gain ``d`` is
``S (1 - m^2) + S m^2 d / |T|`` (the sign mix's share fixed, the count's scaling with ``d``), with
Student's t at ``k - 1`` degrees of freedom; never nearer than ``h``. A symmetric interval (``T +- h``)
covers 91-92% on grids as sparse and one-sided as Gemma's at 30 prompts per task; this one covers 96%
there and 96-97% on denser grids, its end toward 0 (the test's, whose null spread is wider than a true
gain's) missing less than its 2.5% (``tests/test_verdict_coverage.py`` simulates discrete, tied,
clustered grids with and without a gain; results/README.md has the figures).

**Exact bound.** Where the test cannot reach 5% (fewer than 6 prompts differ, or none: a floor), the
interval is the exact bound: with ``k`` of ``N`` prompts departing from the value most prompts of their
stratum share, Clopper-Pearson's 95% upper limit ``U(k, N)`` bounds the share of prompts that may depart,
and the estimate lies within ``U N`` prompts' largest reach from that value, the reach of a prompt being
the metric's largest distance times its stratum's weight over its stratum's prompts (the largest over
strata: valid however the departures fall when strata of unequal size are pooled), capped at the
metric's range. A Poisson-binomial count of departures is bounded by Clopper-Pearson's limit as a
binomial one is (Hoeffding, *Ann. Math. Stat.* 27, 1956).

**A score** (one configuration, no pair to flip) carries Wilson's score interval, stratified: the
interval holds every mean ``m`` whose distance from the estimate is within 1.96 standard errors computed
at ``m`` itself, the samples' distribution moved toward the end of the range by the share ``m`` needs
(Wilson, *JASA* 22, 1927; for a binary score on one task it is Wilson's interval exactly).

**A share recovered** ``(+ResKV - base) / (full - base)`` carries Fieller's interval (Fieller, *J. R.
Stat. Soc. B* 16, 1954), numerator and denominator on the same prompts, the stratified variances and
covariance of their per-prompt contributions, normal quantiles; None where the denominator is not
significantly above 0 (no loss to recover).

``samples_needed`` is the t-based sample size of a paired test: the smallest ``n`` with
``(t_{0.975, n-1} + t_{0.8, n-1}) * spread / sqrt(n) <= |gain|`` (the normal approximation of Chow,
Shao & Wang, *Sample Size Calculations in Clinical Research*, 3.1, with the t quantiles in place of
the normal ones), ``spread`` the estimate's (its standard error times the square root of the samples
per stratum); it is not estimable from fewer than ``NEEDED_MIN_PROMPTS`` differing prompts.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

ALPHA = 0.05  # exactly: a p-value of 0.05 rejects
CONFIDENCE = 1 - ALPHA
POWER = 0.8
EXACT_LIMIT = 20  # differing prompts up to which every sign pattern is enumerated (2^20 sums)
DRAWS = 99_999  # Monte Carlo sign patterns beyond it: (DRAWS + 1) * ALPHA is whole
# A Monte Carlo p-value within NEAR of its errors of 0.05 / j (j up to HOLM_REACH: a threshold Holm's
# adjustment may hold it to) is drawn again with REFINED times the patterns, its error shrunk ~3x.
NEAR, HOLM_REACH, REFINED = 4.0, 20, 10
SEED = 0
NEEDED_MIN_PROMPTS = 10  # differing prompts below which a spread, and the samples it asks, is no estimate
DIFFERENCE_RANGE = (-100.0, 100.0)  # a score difference in points
SCORE_RANGE = (0.0, 100.0)
# A contribution within this share of its stratum's range of 0 is rounding left over from members that
# cancel (+a - a summed in another order), not a difference.
ROUNDING = 1e-9

Member = Mapping[Hashable, pd.Series]  # stratum -> per-sample values, indexed by sample index

FLIP, EXACT, SCORE = "sign-flip", "exact bound", "Wilson"


@dataclass(frozen=True)
class SignFlip:
    """The stratified sign-flip test of an estimate against 0 (module docstring): its two-sided
    p-value, the critical value ``critical`` (the test rejects an estimate farther than it from 0), the
    prompts that differ, and whether every pattern was enumerated (``exact``) or ``patterns`` were
    drawn, with the p-value's Monte Carlo standard error and the critical value's (0 when exact): half
    the distance between the drawn values one binomial standard deviation of ranks either side of it."""

    p_value: float
    critical: float
    differing: int
    exact: bool
    patterns: int
    error: float = 0.0
    critical_error: float = 0.0

    @property
    def can_reject(self) -> bool:
        """Whether any sign pattern could give a p-value of 5% or less: ``2 / 2^k <= ALPHA``."""
        return self.differing > 0 and 2.0 ** (1 - self.differing) <= ALPHA

    @property
    def text(self) -> str:
        """The p-value as the tables print it: three decimals, and a Monte Carlo one's error."""
        if self.exact:
            return f"{self.p_value:.3f}"
        return f"{self.p_value:.3f} \u00b1 {self.error:.3f}"


def _all_sums(magnitudes: np.ndarray) -> np.ndarray:
    """The estimate under every one of the ``2^k`` sign patterns of ``magnitudes``."""
    sums = np.zeros(1)
    for magnitude in magnitudes:
        sums = np.concatenate((sums + magnitude, sums - magnitude))
    return sums


def _drawn_sums(magnitudes: np.ndarray, draws: int, seed: int) -> np.ndarray:
    """The estimate under ``draws`` sign patterns drawn from a generator seeded ``seed``: one random
    byte per eight prompts, a set bit flipping its prompt's sign, each byte's flipped share read from a
    table of its 256 patterns."""
    rng = np.random.default_rng(seed)
    groups = (len(magnitudes) + 7) // 8
    padded = np.zeros(groups * 8)
    padded[: len(magnitudes)] = magnitudes
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)  # (256, 8)
    tables = bits @ padded.reshape(groups, 8).T  # (256, groups): each byte's flipped magnitudes
    rows = max(1, 2**22 // groups)  # patterns per chunk: a few MB at a time
    total, columns = float(magnitudes.sum()), np.arange(groups)
    found = []
    for start in range(0, draws, rows):
        packed = rng.integers(0, 256, size=(min(rows, draws - start), groups), dtype=np.uint8)
        found.append(total - 2.0 * tables[packed, columns].sum(axis=1))
    return np.concatenate(found)


def sign_flip(
    contributions: np.ndarray, seed: int = SEED, exact_limit: int = EXACT_LIMIT, draws: int = DRAWS
) -> SignFlip:
    """The sign-flip test of ``sum(contributions)`` against 0 (module docstring): each contribution
    (a prompt's, 0 where it ties) flips as a whole; exact up to ``exact_limit`` differing prompts,
    else ``draws`` Monte Carlo patterns (``(draws + 1) * ALPHA`` whole) from a generator seeded
    ``seed``."""
    magnitudes = np.abs(contributions[contributions != 0])
    differing = len(magnitudes)
    value = abs(float(contributions.sum()))
    if differing == 0:
        return SignFlip(1.0, 0.0, 0, True, 1)
    tolerance = 1e-9 * float(magnitudes.sum())  # sums of the same terms in another order
    if differing <= exact_limit:
        sums = np.abs(_all_sums(magnitudes))
        patterns = len(sums)
        p_value = np.count_nonzero(sums >= value - tolerance) / patterns
        # Rejected exactly when fewer than ALPHA * patterns lie at least as far: when the estimate lies
        # beyond the (floor(ALPHA * patterns) + 1)-th farthest.
        rank = math.floor(ALPHA * patterns) + 1
        error, exact = 0.0, True
    else:
        for patterns in (draws, REFINED * (draws + 1) - 1):
            sums = np.abs(_drawn_sums(magnitudes, patterns, seed))
            beyond = np.count_nonzero(sums >= value - tolerance)
            p_value = (1 + beyond) / (patterns + 1)
            error = math.sqrt(p_value * (1 - p_value) / patterns)
            if all(abs(p_value - ALPHA / j) > NEAR * error for j in range(1, HOLM_REACH + 1)):
                break
        # (1 + b) / (patterns + 1) <= ALPHA exactly when b < rank = ALPHA * (patterns + 1).
        rank, exact = round(ALPHA * (patterns + 1)), False
    critical = float(np.partition(sums, len(sums) - rank)[len(sums) - rank])
    if exact:
        return SignFlip(float(p_value), critical, differing, exact, patterns)
    spread = math.ceil(math.sqrt(rank * (1 - rank / patterns)))
    near = np.partition(sums, [len(sums) - rank - spread, len(sums) - rank + spread])
    critical_error = float(near[len(sums) - rank + spread] - near[len(sums) - rank - spread]) / 2
    return SignFlip(float(p_value), critical, differing, exact, patterns, error, critical_error)


@dataclass(frozen=True)
class Estimate:
    """A mean of means, its 95% interval and the interval's kind (``FLIP``, ``EXACT`` or ``SCORE``),
    the samples per stratum behind it, its spread (standard error times the square root of the
    samples per stratum), its sign-flip test (None for a score), and the strata and member x prompt
    cells that carried information (``(k, of)`` each) and the prompts whose contribution differs from
    0 (``(k, of)``)."""

    value: float
    low: float
    high: float
    kind: str
    samples: tuple[int, int]  # fewest and most samples in a stratum
    spread: float
    test: SignFlip | None = None
    informative_strata: tuple[int, int] = (0, 0)
    informative_cells: tuple[int, int] = (0, 0)
    differing_prompts: tuple[int, int] = (0, 0)

    def interval_text(self, sign: str = "") -> str:
        return interval_text(self.low, self.high, sign)

    @property
    def samples_text(self) -> str:
        return samples_text(self.samples)

    @property
    def no_information(self) -> bool:
        """No member differs from 0 on any prompt: the data say nothing about the difference."""
        return self.informative_cells[0] == 0

    @property
    def p_value(self) -> float | None:
        """The test's p-value where the test can reach 5%; None otherwise (and for a score)."""
        return self.test.p_value if self.test is not None and self.test.can_reject else None


def interval_text(low: float, high: float, sign: str = "") -> str:
    """``[low, high]`` at the tables' two decimals (``sign="+"`` writes the sign of each)."""
    return f"[{low:{sign}.2f}, {high:{sign}.2f}]"


def samples_text(samples: tuple[int, int]) -> str:
    """Fewest and most samples per stratum as the tables write them: ``10``, ``5-10``."""
    low, high = samples
    return str(low) if low == high else f"{low}-{high}"


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
        scale = self.scale(coefficients)
        return [np.nan_to_num(matrix) @ scale[position] for position, matrix in enumerate(self.values)]

    def scale(self, coefficients: np.ndarray | None = None) -> np.ndarray:
        """``(strata, members)``: each member's weight in each stratum, times its coefficient."""
        return self.weights if coefficients is None else self.weights * coefficients

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


def stratum_range(weights: np.ndarray, value_range: tuple[float, float]) -> tuple[float, float]:
    """The range of a stratum's combined value: members with positive weights at the metric's ends,
    those with negative ones (a contrast's other side) at the opposite ends."""
    low_end, high_end = value_range
    positive, negative = weights[weights > 0].sum(), weights[weights < 0].sum()
    low = (low_end * positive if positive else 0.0) + (high_end * negative if negative else 0.0)
    high = (high_end * positive if positive else 0.0) + (low_end * negative if negative else 0.0)
    return low, high


def _cleaned(combined: Sequence[np.ndarray], ranges: Sequence[tuple[float, float]]) -> list[np.ndarray]:
    """``combined`` with rounding leftovers (module constant ``ROUNDING``) set to exactly 0."""
    cleaned = []
    for values, (low_end, high_end) in zip(combined, ranges, strict=True):
        values = values.copy()
        values[np.abs(values) <= ROUNDING * (high_end - low_end)] = 0.0
        cleaned.append(values)
    return cleaned


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """The exact 95% interval of a binomial share ``k`` of ``n``: the beta quantiles that
    ``scipy.stats.binomtest(k, n).proportion_ci(method="exact")`` reads, without building the test."""
    low = float(stats.beta.ppf(ALPHA / 2, k, n - k + 1)) if k > 0 else 0.0
    high = float(stats.beta.ppf(1 - ALPHA / 2, k + 1, n - k)) if k < n else 1.0
    return low, high


def exact_bound(combined: Sequence[np.ndarray], ranges: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The exact interval (module docstring): per stratum the value most of its prompts share (nearest 0
    on a tie), the pooled count of prompts departing from it bounded by Clopper-Pearson's 95% upper
    limit, each departure at the largest reach a prompt of any stratum has (its stratum's distance from
    that value to the ends of its ``ranges``, over its prompts), capped at the ``ranges``' sums."""
    departing = total = 0
    centre = reach_low = reach_high = 0.0
    for values, (low_end, high_end) in zip(combined, ranges, strict=True):
        found, counts = np.unique(values, return_counts=True)
        mode = float(found[np.lexsort((np.abs(found), -counts))[0]])
        departing += int(np.count_nonzero(values != mode))
        total += len(values)
        centre += mode
        reach_low = max(reach_low, (mode - low_end) / len(values))
        reach_high = max(reach_high, (high_end - mode) / len(values))
    departures = clopper_pearson(departing, total)[1] * total
    lowest, highest = sum(low for low, _ in ranges), sum(high for _, high in ranges)
    return max(lowest, centre - departures * reach_low), min(highest, centre + departures * reach_high)


def _spread(combined: Sequence[np.ndarray], samples: int) -> float:
    """The stratified standard error, ``sqrt(sum_s var_s / n_s)``, times ``sqrt(samples)``."""
    variance = sum(values.var(ddof=1) / len(values) for values in combined if len(values) > 1)
    return math.sqrt(variance * samples)


def far_end(contributions: np.ndarray, critical: float) -> float:
    """How far beyond the estimate, away from 0, the interval reaches (module docstring): the score
    end ``d`` of ``(d - T)^2 = t^2 V(d)``, ``V(d) = S (1 - m^2) + S m^2 d / T``, with ``T`` the
    estimate's distance from 0, ``S`` the contributions' second moment about 0, ``m = T / sum |c|`` the
    share of their size that does not cancel and ``t`` Student's 97.5% quantile at ``k - 1`` degrees of
    freedom; at least ``critical``."""
    nonzero = contributions[contributions != 0]
    distance, second = abs(float(contributions.sum())), float((nonzero**2).sum())
    share = distance / float(np.abs(nonzero).sum())
    q2 = float(stats.t.ppf((1 + CONFIDENCE) / 2, len(nonzero) - 1)) ** 2
    growing = second * share * share / distance if distance > 0 else 0.0
    b = 2 * distance + q2 * growing
    root = (b + math.sqrt(b * b - 4 * (distance**2 - q2 * second * (1 - share * share)))) / 2
    return max(critical, root - distance)


def flip_interval(
    combined: Sequence[np.ndarray],
    ranges: Sequence[tuple[float, float]],
    seed: int = SEED,
    exact_limit: int = EXACT_LIMIT,
    draws: int = DRAWS,
) -> tuple[float, float, float, str, SignFlip]:
    """The estimate of per-stratum prompt values ``combined`` (the sum of their stratum means), its
    95% interval and the interval's kind, and its sign-flip test (``sign_flip``'s ``seed``,
    ``exact_limit`` and ``draws``): toward 0 the test's critical value, away from 0 ``far_end``, within
    the metric's ``ranges``; the exact bound where the test cannot reach 5% (module docstring)."""
    combined = _cleaned(combined, ranges)
    value = float(sum(values.mean() for values in combined))
    contributions = np.concatenate([values / len(values) for values in combined])
    test = sign_flip(contributions, seed, exact_limit, draws)
    if not test.can_reject:
        return value, *exact_bound(combined, ranges), EXACT, test
    far = far_end(contributions, test.critical)
    near = test.critical if test.p_value <= ALPHA else max(test.critical, abs(value))  # 0 kept inside
    if value > 0:
        low, high = value - near, value + far
    elif value < 0:
        low, high = value - far, value + near
    else:
        low, high = -far, far
    lowest, highest = sum(low for low, _ in ranges), sum(high for _, high in ranges)
    return value, max(lowest, low), min(highest, high), FLIP, test


def gain_estimate(
    table: PromptTable,
    coefficients: np.ndarray | None = None,
    seed: int = SEED,
    exact_limit: int = EXACT_LIMIT,
    draws: int = DRAWS,
) -> Estimate:
    """The estimate of ``table`` (its members' mean of means, each member times its ``coefficients``
    where given: a contrast) as a difference in points, with its sign-flip test and interval
    (``flip_interval``)."""
    ranges = [stratum_range(row, DIFFERENCE_RANGE) for row in table.scale(coefficients)]
    combined = table.combined(coefficients)
    value, low, high, kind, test = flip_interval(combined, ranges, seed, exact_limit, draws)
    samples = table.samples
    strata, cells = table.informative()
    prompts = (test.differing, sum(len(values) for values in combined))
    return Estimate(
        value, low, high, kind, samples, _spread(combined, samples[0]), test, strata, cells, prompts
    )


def mean_of_means(members: Sequence[Member]) -> Estimate | None:
    """``gain_estimate`` of ``members`` (per-sample differences, points); None without members or when
    a stratum has no sample that all the members having it share."""
    table = PromptTable.of(members)
    return None if table is None else gain_estimate(table)


def _wilson_end(value: float, variance: float, reach: float, gap: float, z2: float) -> float:
    """How far from ``value`` Wilson's interval reaches toward one end: the ``e`` in [0, 1] of
    ``(e * reach)^2 = z2 * V(e)``, ``V(e) = variance + e * (gap - variance) - e^2 * gap`` the standard
    error squared when a share ``e`` of every stratum's samples moves to that end, times ``reach``."""
    if reach <= 0:
        return 0.0
    a, b, c = reach * reach + z2 * gap, -z2 * (gap - variance), -z2 * variance
    return reach * (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def score_estimate(member: Member) -> Estimate | None:
    """A score's mean of means (points) with Wilson's stratified score interval (module docstring)."""
    table = PromptTable.of([member])
    if table is None:
        return None
    ranges = [stratum_range(row, SCORE_RANGE) for row in table.scale()]
    combined = table.combined()
    value = float(sum(values.mean() for values in combined))
    variance = sum(values.var() / len(values) for values in combined)  # at the estimate: plug-in
    z2 = stats.norm.ppf((1 + CONFIDENCE) / 2) ** 2
    ends = []
    for side in (0, 1):
        gaps = [abs(end[side] - values.mean()) for values, end in zip(combined, ranges, strict=True)]
        gap = sum(distance**2 / len(values) for distance, values in zip(gaps, combined, strict=True))
        ends.append(_wilson_end(value, variance, sum(gaps), gap, z2))
    samples = table.samples
    strata, cells = table.informative()
    return Estimate(
        value,
        value - ends[0],
        value + ends[1],
        SCORE,
        samples,
        _spread(combined, samples[0]),
        None,
        strata,
        cells,
    )


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
    score (percent, two decimals) over its scored samples (Wilson's)."""
    rows = []
    scored = samples[samples["score"].notna()]
    for key, group in scored.groupby(list(keys), dropna=False, sort=False):
        found = score_estimate({0: 100 * group.set_index("index")["score"]})
        rows.append([*key, round(found.low, 2), round(found.high, 2)])
    return pd.DataFrame(rows, columns=[*keys, "score_low", "score_high"])


@dataclass(frozen=True)
class Ratio:
    """A ratio of two means of means on the same prompts (a share of a loss recovered): its value and
    Fieller's 95% interval; ``value`` None where the denominator is not significantly above 0 (no loss
    to recover), ``low`` and ``high`` None where the numerator has no spread (every prompt ties)."""

    value: float | None
    low: float | None = None
    high: float | None = None


def ratio_estimate(numerators: Sequence[Member], denominators: Sequence[Member]) -> Ratio | None:
    """The mean of means of ``numerators`` over that of ``denominators`` (member by member on the same
    prompts: a gain over a loss), with Fieller's interval (module docstring); None when a stratum
    shares no sample."""
    table = PromptTable.of([*numerators, *denominators])
    if table is None:
        return None
    pick = np.array([1.0] * len(numerators) + [0.0] * len(denominators))
    numerator, denominator = table.combined(pick), table.combined(1 - pick)
    gain = sum(values.mean() for values in numerator)
    loss = sum(values.mean() for values in denominator)

    def covariance(first: list[np.ndarray], second: list[np.ndarray]) -> float:
        return sum(
            float(np.cov(x, y)[0, 1]) / len(x) for x, y in zip(first, second, strict=True) if len(x) > 1
        )

    z2 = stats.norm.ppf((1 + CONFIDENCE) / 2) ** 2
    a = loss**2 - z2 * covariance(denominator, denominator)
    if loss <= 0 or a <= 0:
        return Ratio(None)
    value = gain / loss
    gain_variance = covariance(numerator, numerator)
    if gain_variance <= ROUNDING * max(1.0, gain**2):
        return Ratio(value)
    # (gain - R loss)^2 <= z2 Var(gain - R loss): a R^2 - 2 b R + c <= 0, a bounded interval when a > 0.
    b = gain * loss - z2 * covariance(numerator, denominator)
    c = gain**2 - z2 * gain_variance
    root = math.sqrt(max(b * b - a * c, 0.0))
    return Ratio(value, (b - root) / a, (b + root) / a)


REPLICATED, UNRESOLVED, REVERSED, NO_INFORMATION = "replicated", "unresolved", "reversed", "no information"
CONSISTENT, SMALLER, LARGER = "consistent", "smaller than the paper's", "larger than the paper's"


def direction(paper: float, value: float, p_value: float | None) -> str:
    """Whether the test settles the sign the paper reports: ``replicated`` when its (adjusted) p-value
    is at most 5% and the estimate lies on the paper's side of 0 (a paper value of 0 counts as the
    positive side), ``reversed`` when on the other side, ``unresolved`` otherwise, and always for a test
    that cannot reach 5% (``p_value`` None) or an estimate of exactly 0."""
    if p_value is None or p_value > ALPHA:
        return UNRESOLVED
    side = 1 if paper >= 0 else -1
    if side * value > 0:
        return REPLICATED
    return REVERSED if side * value < 0 else UNRESOLVED


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
