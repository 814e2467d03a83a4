"""The committed verdicts do not move with the Monte Carlo seed: on both committed backbones (SmolLM2-135M's
RULER-4K; Gemma 3 270M's RULER-4K, and its 4K and 16K pooled as results/combined reads them), every
claim's test is drawn (no pattern enumerated) under 40 seeds, and the printed words, direction and size,
are those of the committed tables, each Monte Carlo p-value within 4 of its errors of the committed one.

Cost: loading the three result sets (about 15 seconds); the 40 x 3 verdicts then take a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.harness.store import load_results
from scripts.report.frames import frames_from_results
from scripts.report.index import ResultIndex
from scripts.report.paper_numbers import paper_numbers
from scripts.report.verdict import Reproduction, claim_results

RESULTS = Path(__file__).resolve().parent.parent / "results"
VIEWS = {
    "smollm2-135m": ("ruler4k",),
    "gemma3-270m": ("gemma-ruler4k",),
    "gemma3-270m pooled": ("gemma-ruler4k", "gemma-ruler16384"),
}
SEEDS = 40


def words(reproduction: Reproduction, backbone: str, **test) -> list[tuple]:
    """Per claim: its name, direction, size, and its test (None for a count)."""
    read, _ = claim_results(reproduction, backbone, **test)
    return [
        (result.claim.name, result.direction, result.size, result.estimate and result.estimate.test)
        for result, _ in read
    ]


@pytest.mark.slow
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_the_printed_words_hold_under_40_seeds(view):
    results, unavailable, _ = load_results(*(RESULTS / name / "runs" for name in VIEWS[view]))
    index = ResultIndex(*frames_from_results(results, unavailable))
    backbone = view.split()[0]
    reproduction = Reproduction(index, paper_numbers())
    committed = words(reproduction, backbone)
    for seed in range(SEEDS):
        drawn = words(reproduction, backbone, seed=seed, exact_limit=0)
        assert [row[:3] for row in drawn] == [row[:3] for row in committed], seed
        for (*_, test), (*_, exact) in zip(drawn, committed, strict=True):
            if test is not None and test.differing:
                assert not test.exact and abs(test.p_value - exact.p_value) <= 4 * test.error + exact.error
