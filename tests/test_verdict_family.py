"""The verdict's decisions on its records (scripts.report.verdict): Holm's adjustment over the rows whose
test can reach 0.05, floors read as no information, words that do not move with the Monte Carlo seed,
and the records run.py renders. Each test runs in about a second."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from scripts.harness.store import ResultKey
from scripts.report.index import ResultIndex
from scripts.report.paper_numbers import paper_numbers
from scripts.report.render import to_markdown
from scripts.report.statistics import DRAWS, PromptTable, direction, gain_estimate, mean_of_means, sign_flip
from scripts.report.verdict import ClaimResult, family, pair_gain
from scripts.report.verdict_tables import verdict_tables
from tests.test_aggregate_tables import write_result

MEAN_GAIN = next(claim for claim in paper_numbers().claims if claim.name == "RULER: mean gain")


def claim_row(differences: list[float]) -> ClaimResult:
    """A gain claim (the paper's 3.38) on one task whose prompts differ by ``differences`` (points)."""
    estimate = mean_of_means([{"vt": pd.Series(differences)}])
    return ClaimResult(
        MEAN_GAIN, 3.38, estimate.value, estimate, direction=direction(3.38, estimate.value, estimate.p_value)
    )


SIX_GAINS = [100.0] * 6  # p = 2 / 64 = 0.03125
FIVE_OF_SIX = [100.0] * 5 + [-100.0]  # |sum| >= 4 of 6 in 14 of 64 patterns: p = 0.21875
THREE_GAINS = [100.0] * 3 + [0.0] * 3  # 3 prompts differ: no pattern reaches 0.05


def test_holm_adjusts_the_rows_whose_test_can_reject():
    # Alone, six gains out of six is replicated (p 0.03125); beside a row with p 0.21875, Holm doubles
    # it to 0.0625: unresolved (Holm), the raw word kept apart from the adjusted one.
    alone, beside = family([claim_row(SIX_GAINS)]), family([claim_row(SIX_GAINS), claim_row(FIVE_OF_SIX)])
    assert (alone[0].direction, alone[0].holm_p) == ("replicated", pytest.approx(2 / 64))
    assert (beside[0].direction, beside[0].holm_p) == ("unresolved (Holm)", pytest.approx(4 / 64))
    assert (beside[1].direction, beside[1].holm_p) == ("unresolved", pytest.approx(14 / 64))


def test_a_test_that_cannot_reach_5_percent_is_left_out_of_the_family():
    # Three differing prompts can never give p <= 0.05 (2 / 8 at best): counting them would double the
    # six gains' p-value for nothing; they stay unresolved, with no Holm p-value.
    rows = family([claim_row(SIX_GAINS), claim_row(THREE_GAINS)])
    assert (rows[0].direction, rows[0].holm_p) == ("replicated", pytest.approx(2 / 64))
    assert (rows[1].direction, rows[1].holm_p, rows[1].estimate.p_value) == ("unresolved", None, None)


def test_a_floor_is_no_information_whatever_else_the_family_holds(tmp_path):
    # SnapKV and +ResKV tie on every sample of vt and niah_single_1 at 10% q-Aware (a floor), and +ResKV
    # gains on all 8 samples of both at 10% q-Agnostic: the floor's row carries no information and no
    # test, the q-Agnostic row's 16 differing prompts a p-value of 2 / 2^16, replicated after Holm.
    runs_dir = tmp_path / "runs"
    for setting, base, reskv in (("aware", [0] * 8, [0] * 8), ("agnostic", [0] * 8, [1] * 8)):
        for task in ("vt", "niah_single_1"):
            for method, scores in (("snapkv", base), ("snapkv+reskv", reskv)):
                key = ResultKey("tiny-llama", "ruler", 1024, task, setting, method, 0.9)
                write_result(runs_dir, key, scores, samples_total=8)
    (claims,) = verdict_tables(ResultIndex.from_directory(runs_dir)[0])
    heads = [name for name, _ in claims.heads[-1]]
    rows = {row.stub[0]: row.cells for row in claims.body}
    aware = rows["RULER q-Aware: mean gain"]
    assert [aware[heads.index(head)].text for head in ("Direction", "Size", "p")] == [
        "no information",
        "no information",
        None,
    ]
    assert aware[heads.index("Holm p")].value is None
    assert "| RULER q-Aware: mean gain | 2.22 | 0.00 |" in to_markdown(claims)
    agnostic = rows["RULER q-Agnostic: mean gain"]
    assert agnostic[heads.index("Direction")].text == "replicated"
    assert agnostic[heads.index("Holm p")].value < 0.001


# An exact p-value of 0.0461 over 21 prompts (found by search): replicated, 6 Monte Carlo errors
# (0.00066 at 99,999 draws) from 0.05, so no seed's draws should move the word.
NEAR_THRESHOLD = np.array([1, -2, 3, 2, 1, -1, 3, 1, 3, -1, -1, 3, -2, -1, -1, 2, 2, 2, 1, 2, 1], float)


def test_the_words_do_not_move_with_the_monte_carlo_seed():
    exact = sign_flip(NEAR_THRESHOLD, exact_limit=len(NEAR_THRESHOLD))
    assert exact.p_value == pytest.approx(0.04607, abs=1e-5)
    table = PromptTable.of([{"vt": pd.Series(NEAR_THRESHOLD)}])
    words = set()
    for seed in range(40):
        found = gain_estimate(table, seed=seed, exact_limit=0)
        assert not found.test.exact and abs(found.test.p_value - exact.p_value) <= 5 * found.test.error
        words.add(direction(3.38, found.value, found.p_value))
        assert (found.low > 0) == (found.p_value <= 0.05)
    assert words == {"replicated"}
    # 99,999 draws: an error of 0.00066, 6 of them from 0.05 (within 4, the p-value would be drawn
    # again with ten times the patterns).
    assert found.test.patterns == DRAWS and found.test.error < 0.0007
    # An exact p-value of 0.04916 (found by search), 1.3 errors of 99,999 draws from 0.05: drawn again
    # with 999,999 patterns, an error of 0.00022.
    closer = np.array([3, 2, -1, 1, 2, 3, 1, 2, -1, 1, 3, -1, -2, 2, -1, 1, 3, -1, -1, -1, 3], float)
    assert sign_flip(closer, exact_limit=21).p_value == pytest.approx(0.04916, abs=1e-5)
    refined = sign_flip(closer)
    assert refined.patterns == 10 * (DRAWS + 1) - 1 and refined.error < 0.00025


def test_run_py_renders_the_verdicts_record():
    # run.py's end table: one pair, +100 on 6 of vt's 6 samples: the estimate, its interval (within the
    # range: 100 - 200 / 3 to 100), the exact p-value 2 / 64, and the direction it settles.
    base = {"vt": pd.Series([0.0] * 6)}
    gain = pair_gain(base, {"vt": pd.Series([1.0] * 6)})
    assert gain.direction == "replicated" and gain.tasks == 1
    assert gain.estimate.test.text == "0.031"
    assert gain.estimate.interval_text("+") == "[+33.33, +100.00]"
    source = (Path(__file__).resolve().parent.parent / "run.py").read_text()
    assert "scripts.report.statistics" not in source  # run.py keeps no statistics of its own
