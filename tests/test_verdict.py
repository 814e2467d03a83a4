"""The verdict (scripts.report.verdict, rendered by scripts.report.verdict_tables) on synthetic
results built to equal the paper's numbers on LLaMA-3.1-8B, and on the same results with the sign of
every +ResKV gain flipped.

Every configuration of the paper's LLaMA cells gets ten samples per task whose task scores average
to the paper's value (the ablation table's tasks at their own values), spread +-2 points. A baseline's
tasks score its +ResKV's less the pair's gain, and a +ResKV (or ablation) sample is its baseline's
(its ResKV's) plus (less) that gain times ``GAIN_SHAPE`` (mean 1): every sample differs by the paper's
sign, so the sign-flip test of any pair or claim finds only the all-aligned patterns as far as the
data (a single task's pair: p = 2 / 2^10, below 0.05 even after Holm over the claims), while the
differences still vary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baselines.registry import FULL_METHOD
from scripts.harness.store import SCHEMA, ResultKey
from scripts.report.index import ResultIndex
from scripts.report.names import averaged_task_set
from scripts.report.paper_numbers import LLAMA, paper_numbers
from scripts.report.render import to_markdown
from scripts.report.verdict import rounds_needed
from scripts.report.verdict_tables import verdict_tables
from tests.test_aggregate_tables import write_result

LONGBENCH_LENGTH = 127500  # configs/backbone/llama3.1-8b-instruct.yaml: longbench_length
SPREAD = (0.02, -0.02) * 5  # around each task score
# A +ResKV sample's difference to its baseline, times the task's gain (mean 1).
GAIN_SHAPE = (1.0, 1.5, 0.5, 1.0, 1.25, 0.75, 1.0, 1.5, 0.5, 1.0)


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
            key = ResultKey(LLAMA, benchmark, length, task, setting, method, ratio)
            write_result(runs_dir, key, scores, samples_total=len(SPREAD))


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


def column(table, head: str) -> list[str]:
    """The texts of the column headed ``head``."""
    heads = [name for name, _ in table.heads[-1]]
    return [row.cells[heads.index(head)].text for row in rows(table)]


def test_results_equal_to_the_paper_lie_within_every_cell(verdicts):
    table = verdicts[False]["verdict_cells_llama3.1-8b-instruct"]
    # Every LLaMA cell: 2 + 32 x 2 RULER, 1 + 32 LongBench, 16 of the ablation table.
    assert len(rows(table)) == 66 + 33 + 16
    assert set(column(table, "Verdict")) == {"within"}
    assert all(row.cells[0].value == row.cells[1].value for row in rows(table))


def test_every_pair_and_claim_the_samples_support_is_replicated(verdicts):
    pairs = verdicts[False]["verdict_pairs_llama3.1-8b-instruct"]
    assert len(rows(pairs)) == 32 + 16 + 12
    assert set(column(pairs, "Direction")) == {"replicated"}
    assert set(column(pairs, "Size")) == {"consistent"}  # the paper's own gains, inside every interval
    assert all(row.cells[0].value == row.cells[1].value for row in rows(pairs))
    claims = verdicts[False]["verdict_claims_llama3.1-8b-instruct"]
    shown = {row.stub[0]: row for row in rows(claims)}
    # All but those that need CaM results (SnapKV and +ResKV run the CaM table's tasks here too).
    names = [claim.name for claim in paper_numbers().claims if "+CaM" not in claim.name]
    assert sorted(shown) == sorted(names)
    counted = {claim.name for claim in paper_numbers().claims if claim.kind == "share"} & set(shown)
    assert {row.cells[3].text for name, row in shown.items() if name not in counted} == {"replicated"}
    # LLaMA's half of the RULER table: 31 of 32 pairs won (SnapKV 32K 30% q-Aware loses by 0.04),
    # counted and shown, not tested.
    assert shown["RULER: configurations improved"].cells[1].text == "31 won, 1 lost, 0 level of 32"
    assert {shown[name].cells[3].text for name in counted} == {"description"}
    assert (
        "Not covered by these results: CaM table: +ResKV over +CaM; "
        "CaM table: +ResKV above +CaM on every task." in claims.notes
    )


def test_flipped_gains_are_reversed(verdicts):
    pairs = verdicts[True]["verdict_pairs_llama3.1-8b-instruct"]
    assert set(column(pairs, "Direction")) == {"reversed"}
    claims = verdicts[True]["verdict_claims_llama3.1-8b-instruct"]
    assert set(column(claims, "Direction")) == {"reversed", "description"}


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
    # as the tables show it. Two prompts differ: no sign pattern can reach 0.05 (p = 2 / 4 at best), so
    # the test is left out of the Holm family and the interval is the exact bound: 2 of 6 prompts differ
    # from 0, Clopper-Pearson's upper limit Beta(0.975; 3, 4) = 0.7772 of 6 prompts, each reaching 50
    # points (a task's half of the range) over 3 prompts: 0.7772 * 6 * 50 / 3 = 77.72 either way. The
    # paper's share cannot be carried over (niah_single_1 has no full-cache run), and with 2 differing
    # prompts no samples needed are estimable.
    row = next(line for line in markdown.splitlines() if line.startswith("| RULER: mean gain |"))
    heads = [name for name, _ in tables[0].heads[-1]]
    cells = dict(zip(heads, [cell.strip() for cell in row.split("|")[2:-1]], strict=True))
    assert cells == {
        "Paper": "3.38",
        "Reproduced": "33.34",
        "95% CI": "[-77.72, 77.72]",
        "Direction": "unresolved",
        "p": "0.500",
        "Holm p": "--",
        "Size": "no full-cache run",
        "Paper here": "--",
        "Pairs": "1/64",
        "Samples/task": "3",
        "Information": "2/2 tasks, 2/6 prompts, 2/6 cells: 2 gains, 0 losses",
        "Carried by": "niah_single_1 50%, vt 50%",
        "Recovered: paper": "0.080",
        "Recovered": "--",
        "LL recovered": "--",
        "Needed: observed": "not estimable",
        "Needed: paper": "not estimable",
    }
    # What the dry run reads: every unresolved claim with the samples per task it has (none estimable).
    unresolved = {found.claim: found for found in rounds_needed(tmp_path)}
    assert sorted(unresolved) == [
        "CaM table: +ResKV over SnapKV",  # its S-1 pair: the paper states no length for its RULER tasks
        "RULER 10%: mean gain",
        "RULER q-Agnostic: mean gain",
        "RULER: mean gain",
    ]
    mean_gain = unresolved["RULER: mean gain"]
    assert (mean_gain.backbone, mean_gain.direction, mean_gain.samples) == ("tiny-llama", "unresolved", 3)
    assert (mean_gain.observed, mean_gain.paper, mean_gain.rounds) == (None, None, None)


def configurations_improved_row(runs_dir: Path, pairs: list[tuple]) -> str:
    """The claim's markdown row over SnapKV / +ResKV pairs on vt: (setting, ratio, base, +ResKV scores),
    with AdaKV and AdaKV+ResKV where the tuple holds their scores too."""
    for setting, ratio, *scores in pairs:
        for method, values in zip(("snapkv", "snapkv+reskv", "adakv", "adakv+reskv"), scores, strict=False):
            key = ResultKey("tiny-llama", "ruler", 1024, "vt", setting, method, ratio)
            write_result(runs_dir, key, values)
    (claims,) = verdict_tables(ResultIndex.from_directory(runs_dir)[0])
    return next(line for line in to_markdown(claims).splitlines() if "configurations improved" in line)


def test_configurations_improved_is_a_count_not_a_test(tmp_path):
    pairs = [
        ("aware", 0.9, [0, 0], [1, 0]),  # won
        ("aware", 0.8, [1, 0], [1, 0]),  # level
        ("agnostic", 0.9, [1, 1], [0, 1]),  # lost
    ]
    # Pairs sharing vt's two prompts give no independent evidence to test a count with: the row shows
    # the count beside the paper's, its direction a description, no interval, p or size.
    row = configurations_improved_row(tmp_path / "runs", pairs)
    assert row == (
        "| RULER: configurations improved | 63/64 | 1 won, 1 lost, 1 level of 3 | -- | description | -- "
        "| -- | -- | -- | 3/64 | 2 | -- | -- | -- | -- | -- | -- | -- |"
    )


def test_twins_are_counted_once(tmp_path):
    # AdaKV's outputs equal SnapKV's, and AdaKV+ResKV's equal SnapKV+ResKV's, on every sample of the
    # 10% q-Aware budget (one KV head: AdaKV has nothing to move): its two pairs are one. At 10%
    # q-Agnostic AdaKV+ResKV differs on one sample: four distinct pairs of five.
    pairs = [
        ("aware", 0.9, [0, 0, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0]),  # twins: won
        ("agnostic", 0.9, [1, 1, 0], [0, 1, 0], [1, 1, 0], [0, 1, 1]),  # lost; AdaKV's level
        ("agnostic", 0.8, [1, 0, 0], [1, 0, 0]),  # level
    ]
    markdown = configurations_improved_row(tmp_path / "runs", pairs)
    assert markdown.split(" | ")[2] == "1 won, 1 lost, 2 level of 4"
    assert markdown.split(" | ")[9] == "5/64, 4 distinct"
    (claims,) = verdict_tables(ResultIndex.from_directory(tmp_path / "runs")[0])
    heads = [name for name, _ in claims.heads[-1]]
    mean_gain = next(row for row in claims.body if row.stub == ["RULER: mean gain"])
    # Cells: 4 distinct pairs x 3 prompts; differing: the won pair's sample 0 (+100, counted once of
    # its twins), the lost pair's sample 0 (-100), AdaKV+ResKV's samples 0 (-100) and 2 (+100). As
    # prompts: sample 0 sums 100 + 100 - 100 - 100 = 0 over the five pairs, sample 2 +100: one differs.
    information = mean_gain.cells[heads.index("Information")].text
    assert information == "1/1 tasks, 1/3 prompts, 4/12 cells: 2 gains, 2 losses"
    assert mean_gain.cells[heads.index("Pairs")].text == "5/64, 4 distinct"
    assert any(
        note.startswith("Identical outputs on every sample, counted once")
        and "SnapKV+ResKV = AdaKV+ResKV (RULER-1K 1 of 2 budgets x settings)" in note
        for note in claims.notes
    )


def test_size_off_the_papers_backbones_is_the_share_of_the_loss_recovered(tmp_path):
    runs_dir = tmp_path / "runs"
    # One task, eight samples: the full cache answers all; +ResKV wins back 20, 10, 20, 10, 10, 10, 0, 0
    # points of SnapKV's losses 80, 60, 90, 70, 50, 80, 70, 60: 80 / 560 = 0.143 of the loss.
    # Log-likelihood gaps to the full cache: SnapKV -4, -6, -5, -3, -4, -2, -3, -5 nats, +ResKV 1, 1, 0,
    # 1, 1, 0, 0, 1 closer: 5 / 32 = 0.156.
    scores = {
        FULL_METHOD: [1.0] * 8,
        "snapkv": [0.2, 0.4, 0.1, 0.3, 0.5, 0.2, 0.3, 0.4],
        "snapkv+reskv": [0.4, 0.5, 0.3, 0.4, 0.6, 0.3, 0.3, 0.4],
    }
    gaps = {
        FULL_METHOD: [0.0] * 8,
        "snapkv": [-4.0, -6.0, -5.0, -3.0, -4.0, -2.0, -3.0, -5.0],
        "snapkv+reskv": [-3.0, -5.0, -5.0, -2.0, -3.0, -2.0, -3.0, -4.0],
    }
    for method in scores:
        full = method == FULL_METHOD
        key = ResultKey(
            "tiny-llama", "ruler", 1024, "vt", None if full else "agnostic", method, None if full else 0.9
        )
        samples = [
            {"index": index, "score": score, "quality": {"answer_log_prob_gap": gap}}
            for index, (score, gap) in enumerate(zip(scores[method], gaps[method], strict=True))
        ]
        path = key.path(runs_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"schema": SCHEMA, "key": key.to_json(), "samples_total": 8, "samples": samples})
        )
    (claims,) = verdict_tables(ResultIndex.from_directory(runs_dir)[0])
    row = next(line for line in to_markdown(claims).splitlines() if line.startswith("| RULER: mean gain |"))
    cells = [cell.strip() for cell in row.split("|")[2:-1]]
    heads = [name for name, _ in claims.heads[-1]]
    recovered, ll_recovered = cells[heads.index("Recovered")], cells[heads.index("LL recovered")]
    assert recovered == "0.143" and ll_recovered.startswith("0.156 [")
    # Size reads the paper's share of its RULER table (0.0799: its gains' sum over its losses') as this
    # backbone would show it: times the loss measured here, 560 / 8 = 70 points: 5.59 points, against the
    # gain's interval. Six prompts
    # gain (contributions 2.5, 1.25, 2.5, 1.25, 1.25, 1.25): p = 2 / 64, and toward 0 the interval ends
    # at the 4th farthest of the 64 patterns' |sums|, 7.5 (one 1.25 flipped): from 10 - 7.5 = 2.5.
    assert cells[heads.index("Recovered: paper")] == "0.080"
    assert cells[heads.index("Paper here")] == "5.59"
    assert cells[heads.index("p")] == f"{2 / 64:.3f}"
    assert cells[heads.index("95% CI")].startswith("[2.50, ")
    assert cells[heads.index("Size")] == "consistent"
