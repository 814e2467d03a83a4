"""Coverage of the verdict's interval and the error rate of its direction test (scripts.report.statistics:
``flip_interval``, the code the tables run) on simulated grids built like the committed reproductions'
data, at 5, 10 and 30 prompts per task.

A grid: 11 tasks (RULER's available ones) of 16 configurations each (+ResKV pairs sharing every
prompt of their task), weighted as the tables average them. Most tasks sit at a floor (no prompt ever
differs); in the others a prompt differs with chance ``fragile``, and then in several configurations
at once (1 + Binomial(15, ``shared``)), each moving in the prompt's direction with chance 0.9;
a binary task moves by 100 points, a multi-answer one (3, 4 or 10 answers, as FWE, MV and CWE score) by
a whole number of answers. A prompt's direction is +ResKV's gain with chance ``gain_side``: 0.5 is the
null (no gain, the test's null), above it a true gain. Pooled designs add a second length whose tasks
hold half the prompts (RULER-4K at 10 samples with RULER-16K at 5). Twins: every differing prompt moves
two configurations alike (SnapKV and AdaKV at one KV head), a sparse grid as Gemma's.

The true gain is known in closed form: per informative task, ``fragile`` x the configurations a prompt
moves on average x the direction's mean x the answer's mean size, over 16 configurations and the tasks.

Cost: about 25 seconds on one core (18 design cells x 1,000 grids, the Monte Carlo tests at 1,999
draws and every pattern enumerated up to 12 differing prompts: the verdict's own 99,999 draws and
limit of 20 give the same p-values to their Monte Carlo error). ``simulate`` is importable for longer
runs (the figures results/README.md quotes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from scripts.report.statistics import ALPHA, flip_interval

TASKS, CONFIGURATIONS = 11, 16
GRIDS = 1000
DRAWS, EXACT_LIMIT = 1999, 12  # (DRAWS + 1) * ALPHA whole, as the verdict's


@dataclass(frozen=True)
class Design:
    floors: int  # tasks at a floor
    fragile: float  # chance that a prompt of an informative task differs
    shared: float  # chance that each other configuration moves with the first
    gain_side: float  # chance that a differing prompt moves toward +ResKV
    answers: tuple[int, ...] = (1, 1, 3, 4)  # per informative task, cycled: 1 binary, else answers
    pooled: bool = False  # a second length at half the prompts
    twins: bool = False  # each differing prompt moves one configuration and its twin alike


DESIGNS = {
    "SmolLM2-like, null": Design(7, 0.3, 0.15, 0.5),
    "SmolLM2-like, gain": Design(7, 0.3, 0.15, 0.8),
    "pooled lengths, null": Design(7, 0.3, 0.15, 0.5, (1, 10, 3, 1), pooled=True),
    "pooled lengths, gain": Design(7, 0.3, 0.15, 0.8, (1, 10, 3, 1), pooled=True),
    "Gemma-like twins, null": Design(7, 0.06, 0.0, 0.5, (1,), pooled=True, twins=True),
    "Gemma-like twins, gain": Design(7, 0.06, 0.0, 0.9, (1,), pooled=True, twins=True),
}


def simulate(design: Design, prompts: int, grids: int = GRIDS, seed: int = 0) -> tuple[float, float, float]:
    """Over ``grids`` simulated grids: the share whose 95% interval holds the true gain, the share whose
    test rejects at 0.05, and the mean number of differing prompts."""
    rng = np.random.default_rng(seed)
    sizes = [prompts] * TASKS + ([max(2, prompts // 2)] * TASKS if design.pooled else [])
    weight = 1 / (CONFIGURATIONS * len(sizes))  # a configuration's weight in a task's mean of means
    reach = 100 * CONFIGURATIONS * weight
    strata, truth = [], 0.0
    for number, size in enumerate(sizes):
        task = number % TASKS
        if task < design.floors:
            strata.append(np.zeros((grids, size)))
            continue
        answers = design.answers[(task - design.floors) % len(design.answers)]
        moved = 2 if design.twins else 1 + rng.binomial(CONFIGURATIONS - 1, design.shared, (grids, size))
        side = np.where(rng.random((grids, size)) < design.gain_side, 1.0, -1.0)
        steps = rng.integers(1, answers + 1, (grids, size, CONFIGURATIONS)) / answers
        follows = np.where(rng.random((grids, size, CONFIGURATIONS)) < 0.9, 1.0, -1.0)
        if design.twins:  # the twin repeats the first configuration's move
            steps[..., 1], follows[..., 1] = steps[..., 0], follows[..., 0]
        moving = np.arange(CONFIGURATIONS) < np.broadcast_to(moved, (grids, size))[..., None]
        total = (100 * steps * follows * moving).sum(axis=2) * side
        strata.append(np.where(rng.random((grids, size)) < design.fragile, weight * total, 0.0))
        moved_mean = 2 if design.twins else 1 + (CONFIGURATIONS - 1) * design.shared
        follow_mean = 1.0 if design.twins else 0.8  # 0.9 - 0.1; the twin copies its first
        size_mean = 100 * (answers + 1) / (2 * answers)
        truth += weight * design.fragile * moved_mean * (2 * design.gain_side - 1) * follow_mean * size_mean
    ranges = [(-reach, reach)] * len(sizes)
    covered = rejected = differing = 0
    for grid in range(grids):
        _, low, high, _, test = flip_interval(
            [values[grid] for values in strata], ranges, exact_limit=EXACT_LIMIT, draws=DRAWS
        )
        covered += low <= truth <= high
        rejected += test.can_reject and test.p_value <= ALPHA
        differing += test.differing
    return covered / grids, rejected / grids, differing / grids


@pytest.mark.parametrize("prompts", [5, 10, 30])
def test_the_interval_covers_and_the_test_holds_its_level(prompts):
    # 1,000 grids measure a coverage of 95% to +-1.4 points and a rejection rate of 5% to +-1.4 (two
    # standard errors): 93% is held strictly, 97% to that error (longer runs put these designs at
    # 95-97%: results/README.md). Without a gain the test rejects at most 5% (it is exact under its
    # null), and the interval holds 0 exactly when the test does not reject. With a gain the interval
    # covers it 93-97% of the time where most grids have the 6 differing prompts a test needs (10 on
    # average); on sparser grids (Gemma's at 5 or 10 prompts per task) it is mostly the exact bound, and
    # covers more.
    for name, design in DESIGNS.items():
        coverage, rejection, differing = simulate(design, prompts, seed=prompts)
        if design.gain_side == 0.5:
            assert rejection <= ALPHA + 0.014, (name, rejection)
            assert coverage == pytest.approx(1 - rejection), name
        elif differing >= 10:  # above 97% by more than the simulation's error: wider than it needs
            assert 0.93 <= coverage <= 0.97 + 2 * math.sqrt(0.97 * 0.03 / GRIDS), (name, coverage, differing)
        else:
            assert coverage >= 0.93, (name, coverage, differing)
