"""Intervals where results are compared: a stratified, paired bootstrap of the tables' averages, the
sign test's exact interval, and the samples per task a gain of a given size needs.

Every score the tables show is a mean of means: a task score is the mean over its samples, an average
the unweighted mean over its tasks, a claim such as "+3.38 points on average" the mean over
configurations of such averages' differences. ``mean_of_means`` takes that structure as *members*
(a configuration, or a +ResKV pair's per-sample differences), each a mapping from *stratum* (a task of
one backbone, benchmark and length) to per-sample values indexed by sample index, and resamples the
samples within each stratum (scipy.stats.bootstrap, one resample per stratum, percentile interval).
Members that share a stratum share its draw and are restricted to the samples all of them have: two
methods, or two budgets, run on the same prompt are compared on that prompt (paired). The generator
is seeded (``SEED``) afresh for every estimate, so a table regenerates byte for byte on the same
numpy and scipy, whatever else was estimated before it.

``samples_needed`` is the normal approximation to a paired test's sample size,
``n = ((z_{1-alpha/2} + z_{power}) * sigma / gain)^2`` rounded up (e.g. Chow, Shao & Wang, *Sample
Size Calculations in Clinical Research*, one-sample / paired mean), with ``sigma`` the estimate's
``spread``: with ``n`` samples in every stratum its standard error is ``spread / sqrt(n)``.
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
N_RESAMPLES = 9999
BATCH = 1000  # resamples drawn at a time: bounds memory; part of what the draws are (keep it fixed)
SEED = 0

Member = Mapping[Hashable, pd.Series]  # stratum -> per-sample values, indexed by sample index


@dataclass(frozen=True)
class Estimate:
    """A mean of means, its 95% bootstrap interval, the samples per stratum behind it and its spread
    (the standard deviation of the estimate times the square root of the samples per stratum)."""

    value: float
    low: float
    high: float
    samples: tuple[int, int]  # fewest and most samples in a stratum
    spread: float

    def interval_text(self, sign: str = "") -> str:
        return interval_text(self.low, self.high, sign)

    @property
    def samples_text(self) -> str:
        return samples_text(self.samples)


def interval_text(low: float, high: float, sign: str = "") -> str:
    """``[low, high]`` at the tables' two decimals (``sign="+"`` writes the sign of each)."""
    return f"[{low:{sign}.2f}, {high:{sign}.2f}]"


def samples_text(samples: tuple[int, int]) -> str:
    """Fewest and most samples per stratum as the tables write them: ``10``, ``5-10``."""
    low, high = samples
    return str(low) if low == high else f"{low}-{high}"


def _sum_of_means(*samples: np.ndarray, axis: int) -> np.ndarray:
    return sum(sample.mean(axis=axis) for sample in samples)


def mean_of_means(members: Sequence[Member]) -> Estimate | None:
    """The mean over ``members`` of each member's mean over its strata of its per-sample values, with
    its 95% percentile bootstrap interval (module docstring); None without members or when a stratum
    has no sample that all the members having it share. Missing values (NaN) are left out."""
    strata: dict[Hashable, list[tuple[float, pd.Series]]] = {}
    for member in members:
        for key, values in member.items():
            strata.setdefault(key, []).append((1 / (len(members) * len(member)), values.dropna()))
    arrays = []
    for key in sorted(strata):
        parts = strata[key]
        shared = parts[0][1].index.sort_values()
        for _, values in parts[1:]:
            if not values.index.equals(shared):
                shared = shared.intersection(values.index).sort_values()
        if shared.empty:
            return None
        arrays.append(
            sum(
                weight * (values if values.index.equals(shared) else values.loc[shared]).to_numpy(float)
                for weight, values in parts
            )
        )
    if not arrays:
        return None
    value = float(sum(array.mean() for array in arrays))
    spread = math.sqrt(sum(array.var(ddof=1) for array in arrays if len(array) > 1))
    counts = [len(array) for array in arrays]
    varying = tuple(array for array in arrays if np.ptp(array) > 0)
    if not varying:  # every resample gives the value itself
        return Estimate(value, value, value, (min(counts), max(counts)), spread)
    fixed = float(sum(array.mean() for array in arrays if not np.ptp(array) > 0))
    result = stats.bootstrap(
        varying,
        _sum_of_means,
        n_resamples=N_RESAMPLES,
        batch=BATCH,
        vectorized=True,
        paired=False,  # each stratum resampled on its own: stratified
        confidence_level=CONFIDENCE,
        method="percentile",
        rng=np.random.default_rng(SEED),
    )
    low, high = result.confidence_interval
    return Estimate(value, fixed + float(low), fixed + float(high), (min(counts), max(counts)), spread)


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
    if decided == 0:
        return None
    interval = stats.binomtest(won, decided).proportion_ci(confidence_level=CONFIDENCE, method="exact")
    return float(interval.low), float(interval.high)


def samples_needed(spread: float, gain: float) -> int | None:
    """Samples per stratum (task) for a 95% interval to exclude 0 with 80% power if the true gain is
    ``gain``: ``((z_0.975 + z_0.8) * spread / gain)^2`` rounded up; None for a zero gain or spread."""
    if gain == 0 or spread == 0:
        return None
    z = stats.norm.ppf(1 - (1 - CONFIDENCE) / 2) + stats.norm.ppf(POWER)
    return math.ceil((z * spread / abs(gain)) ** 2)


REPRODUCED, CONTRADICTED, INCONCLUSIVE = "reproduced", "contradicted", "inconclusive"


def classify(paper: float, low: float, high: float, null: float = 0.0) -> str:
    """The verdict on a paper's effect (a gain, ``null`` 0; a share of pairs won, ``null`` 1/2) from
    the reproduced interval ``[low, high]``: ``reproduced`` when it excludes ``null`` on the paper's
    side; ``contradicted`` when it excludes the paper's value and lies on ``null``'s side of it (or
    beyond); ``inconclusive`` otherwise (it holds both), and for an interval that is ``null`` alone:
    no pair differed in any sample, so there was no variation to measure."""
    if low == high == null:
        return INCONCLUSIVE
    side = np.sign(paper - null)
    if side and side * (low - null) > 0 and side * (high - null) > 0:
        return REPRODUCED
    if (side > 0 and high < paper) or (side < 0 and low > paper):
        return CONTRADICTED
    return INCONCLUSIVE


def score_intervals(samples: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Per configuration (``keys``), ``score_low`` and ``score_high``: the 95% bootstrap interval of
    its task score (percent, two decimals) over its scored samples."""
    rows = []
    scored = samples[samples["score"].notna()]
    for key, group in scored.groupby(list(keys), dropna=False, sort=False):
        estimate = mean_of_means([{0: 100 * group.set_index("index")["score"]}])
        rows.append([*key, round(estimate.low, 2), round(estimate.high, 2)])
    return pd.DataFrame(rows, columns=[*keys, "score_low", "score_high"])
