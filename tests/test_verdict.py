"""The verdict (scripts.report.verdict) on synthetic results built to equal the paper's numbers on
LLaMA-3.1-8B, and on the same results with the sign of every +ResKV gain flipped.

Every configuration of the paper's LLaMA cells gets four samples per task whose task scores average
to the paper's value (the ablation table's tasks at their own values), spread +-2 points. A baseline's
tasks score its +ResKV's less the pair's gain, and a +ResKV (or ablation) sample is its baseline's
(its ResKV's) plus (less) that gain times (1, 1.5, 0.5, 1): every sample differs by the paper's sign,
so every resample of any pair or claim has that sign (the samples support every gain), while the
differences still vary.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baselines.registry import FULL_METHOD
from scripts.harness.store import ResultKey
from scripts.report.index import ResultIndex
from scripts.report.names import averaged_task_set
from scripts.report.paper_numbers import LLAMA, paper_numbers
from scripts.report.render import to_markdown
from scripts.report.verdict import verdict_tables
from tests.test_aggregate_tables import write_result

LONGBENCH_LENGTH = 127500  # configs/backbone/llama3.1-8b-instruct.yaml: longbench_length
SPREAD = (0.02, -0.02, 0.02, -0.02)  # around each task score
GAIN_SHAPE = (1.0, 1.5, 0.5, 1.0)  # a +ResKV sample's difference to its baseline, times the task's gain


def task_targets(benchmark: str, average: float, fixed: dict[str, float]) -> dict[str, float]:
    """Task scores (two decimals) averaging to ``average``: ``fixed`` ones as given, the rest alike,
    the last taking what the rounding leaves (worked in hundredths)."""
    tasks = list(averaged_task_set(benchmark))
    rest = [task for task in tasks if task not in fixed]
    left = round(average * 100) * len(tasks) - sum(round(value * 100) for value in fixed.values())
    each = left // len(rest)
    cents = {task: each for task in rest[:-1]} | {rest[-1]: left - each * (len(rest) - 1)}
    return {**fixed, **{task: value / 100 for task, value in cents.items()}}


def grid_samples(flip: bool) -> dict[tuple, dict[str, list[float]]]:
    """{(benchmark, length, setting, method, ratio): {task: sample scores}} of every LLaMA cell."""
    cells = [cell for cell in paper_numbers().cells if cell.backbone == LLAMA]

    def where(cell) -> tuple:
        return (cell.benchmark, cell.length or LONGBENCH_LENGTH, cell.setting, cell.method, cell.ratio)

    averages = {where(cell): cell.value for cell in cells if cell.task is None}
    fixed: dict[tuple, dict[str, float]] = {}
    for cell in cells:
        if cell.task is not None and where(cell) in averages:  # ResKV in the ablation table
            fixed.setdefault(where(cell), {})[cell.task] = cell.value
    # The full cache and +ResKV around their averages; a baseline at its +ResKV's task scores less
    # the pair's gain (worked in hundredths), so that every task gains what the average does.
    targets = {
        key: task_targets(key[0], value, fixed.get(key, {}))
        for key, value in averages.items()
        if key[3] == FULL_METHOD or key[3].endswith("+reskv")
    }
    gains = {}
    for key, value in averages.items():
        if key not in targets:
            reskv = (*key[:3], key[3] + "+reskv", key[4])
            gains[reskv] = round(averages[reskv] * 100) - round(value * 100)
            targets[key] = {
                task: (round(score * 100) - gains[reskv]) / 100 for task, score in targets[reskv].items()
            }
    sign = -1 if flip else 1
    samples = {
        key: {task: [score / 100 + spread for spread in SPREAD] for task, score in tasks.items()}
        for key, tasks in targets.items()
        if key not in gains
    }
    for key in gains:
        base = samples[(*key[:3], key[3].removesuffix("+reskv"), key[4])]
        samples[key] = {
            task: [
                score + sign * gains[key] / 10000 * shape
                for score, shape in zip(base[task], GAIN_SHAPE, strict=True)
            ]
            for task in targets[key]
        }
    for cell in cells:  # the ablations: ResKV's samples less the drop
        if cell.task is not None and where(cell) not in averages:
            reskv = (*where(cell)[:3], "snapkv+reskv", cell.ratio)
            drop = targets[reskv][cell.task] - cell.value
            samples.setdefault(where(cell), {})[cell.task] = [
                score - sign * drop / 100 * shape
                for score, shape in zip(samples[reskv][cell.task], GAIN_SHAPE, strict=True)
            ]
    return samples


def write_grid(runs_dir: Path, flip: bool) -> None:
    for (benchmark, length, setting, method, ratio), tasks in grid_samples(flip).items():
        for task, scores in tasks.items():
            write_result(runs_dir, ResultKey(LLAMA, benchmark, length, task, setting, method, ratio), scores)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[bool, dict[str, object]]:
    found = {}
    for flip in (False, True):
        runs_dir = tmp_path_factory.mktemp("flipped" if flip else "paper") / "runs"
        write_grid(runs_dir, flip)
        index, warnings = ResultIndex.from_directory(runs_dir)
        assert warnings == []
        found[flip] = {table.name: table for table in verdict_tables(index)}
    return found


def rows(table) -> list:
    return [row for row in table.body if not isinstance(row, str)]


def verdicts_of(table) -> list[str]:
    return [row.cells[-2].text if "cells" not in table.name else row.cells[-1].text for row in rows(table)]


def test_results_equal_to_the_paper_lie_within_every_cell(verdicts):
    table = verdicts[False]["verdict_cells_llama3.1-8b-instruct"]
    # Every LLaMA cell: 2 + 32 x 2 RULER, 1 + 32 LongBench, 16 of the ablation table.
    assert len(rows(table)) == 66 + 33 + 16
    assert set(verdicts_of(table)) == {"within"}
    assert all(row.cells[0].value == row.cells[1].value for row in rows(table))


def test_every_pair_and_claim_the_samples_support_is_reproduced(verdicts):
    pairs = verdicts[False]["verdict_pairs_llama3.1-8b-instruct"]
    assert len(rows(pairs)) == 32 + 16 + 12
    assert set(verdicts_of(pairs)) == {"reproduced"}
    assert all(row.cells[0].value == row.cells[1].value for row in rows(pairs))  # the paper's own gains
    claims = verdicts[False]["verdict_claims_llama3.1-8b-instruct"]
    shown = {row.stub[0]: row for row in rows(claims)}
    # All but the one that needs CaM results (SnapKV and +ResKV run the CaM table's tasks here too).
    names = [claim.name for claim in paper_numbers().claims if claim.name != "CaM table: +ResKV over +CaM"]
    assert sorted(shown) == sorted(names)
    assert set(verdicts_of(claims)) == {"reproduced"}
    # LLaMA's half of the RULER table: 31 of 32 pairs won (SnapKV 32K 30% q-Aware loses by 0.04).
    assert shown["RULER: configurations improved"].cells[1].count == (31, 32)
    assert "Not covered by these results: CaM table: +ResKV over +CaM." in claims.notes


def test_flipped_gains_are_contradicted(verdicts):
    pairs = verdicts[True]["verdict_pairs_llama3.1-8b-instruct"]
    assert set(verdicts_of(pairs)) == {"contradicted"}
    claims = verdicts[True]["verdict_claims_llama3.1-8b-instruct"]
    assert set(verdicts_of(claims)) == {"contradicted"}


def test_a_backbone_the_paper_did_not_run_gets_only_the_claims(tmp_path):
    runs_dir = tmp_path / "runs"
    for method, scores in (("snapkv", [0, 0, 1, 0]), ("snapkv+reskv", [1, 0, 1])):  # 3 shared samples
        for task in ("niah_single_1", "vt"):
            key = ResultKey("tiny-llama", "ruler", 1024, task, "agnostic", method, 0.9)
            write_result(runs_dir, key, scores)
    write_result(
        runs_dir, ResultKey("tiny-llama", "ruler", 1024, "vt", None, FULL_METHOD, None), [1, 1, 1, 1]
    )
    tables = verdict_tables(ResultIndex.from_directory(runs_dir)[0])
    assert [table.name for table in tables] == ["verdict_claims_tiny-llama"]
    markdown = to_markdown(tables[0])
    assert "tiny-llama is not a backbone of the paper: only its comparative claims are checked" in markdown
    # Each task on its 3 shared samples: SnapKV 33.33, +ResKV 66.67 (+100, 0, 0 points): a gain of 33.34
    # as the tables show it. Each task's mean resamples to 0, 33.3, 66.7, 100 with chances 8, 12, 6, 1
    # in 27; the two tasks' average is 0 with chance (8/27)^2 = 8.8% and 83.3 or more with 1.8%: the
    # interval is [0, 66.67]. Samples needed: per task the values (50, 0, 0) (a difference halved by
    # the average), variance 833.3 each; n = 2.8016^2 * 1666.7 / 3.38^2 = 1145.03 -> 1146.
    assert "| RULER: mean gain | 3.38 | 33.34 | [0.00, 66.67] | 1/64 | 3 | inconclusive | 1146 |" in markdown


def test_ties_count_for_neither_side_of_the_sign_test(tmp_path):
    runs_dir = tmp_path / "runs"
    for setting, ratio, base, reskv in (
        ("aware", 0.9, [0, 0], [1, 0]),  # won
        ("aware", 0.8, [1, 0], [1, 0]),  # tied
        ("agnostic", 0.9, [1, 1], [0, 1]),  # lost
    ):
        for method, scores in (("snapkv", base), ("snapkv+reskv", reskv)):
            write_result(
                runs_dir, ResultKey("tiny-llama", "ruler", 1024, "vt", setting, method, ratio), scores
            )
    (claims,) = verdict_tables(ResultIndex.from_directory(runs_dir)[0])
    # 1 won of 3 pairs; the interval is Clopper-Pearson's for 1 of the 2 decided (the tie left out):
    # 1 - (1 - p)^2 = 0.025 and 1 - p^2 = 0.025 give [1 - sqrt(0.975), sqrt(0.975)] = [0.0126, 0.9874].
    assert (
        "| RULER: configurations improved | 63/64 | 1/3 | [0.01, 0.99] | 3/64 | 2 | inconclusive | -- |"
        in (to_markdown(claims))
    )
