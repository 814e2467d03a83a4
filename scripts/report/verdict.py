"""The reproduction verdict: the paper's published numbers (``scripts.report.paper_numbers``) beside
the results, with paired statistics (``scripts.report.statistics``). Part of ``make tables``.

Per backbone of the results (``.md``, ``.tex``, ``.csv`` beside the other tables):

- ``verdict_claims_<backbone>``: each comparative claim of the paper the results cover: the paper's
  gain (or pairs won), the reproduced one over the +ResKV pairs of the claim's scope that the results
  hold (any length), its 95% interval and a verdict. A backbone the paper did not run gets this
  table only: its absolute numbers are never held against another backbone's.
- ``verdict_pairs_<backbone>`` (the paper's backbones): every +ResKV pair of the paper's tables the
  results cover: the paper's gain, the reproduced gain, its interval and a verdict.
- ``verdict_cells_<backbone>`` (the paper's backbones): every cell of the paper's tables the results
  cover: the paper's value, the reproduced one with its interval, and whether the paper's value lies
  inside it.

A cell or pair of the paper is covered by results of its backbone, benchmark, setting, budget,
method and task (and length, where the paper states one) whose average covers every task the
paper's does; a claim, by any pair of its scope (a partial task set is named by the table's notes).
Values are the tables' own (``scripts.report.index``: a block of rows compared on the samples all of
them scored); intervals resample those samples within each task, tasks weighted as the tables average
them. Verdicts compare at the tables' two decimals:

- a gain (pairs, claims): **reproduced** when its interval excludes 0 on the paper's side,
  **contradicted** when it excludes the paper's gain and lies on 0's side of it (or beyond),
  **inconclusive** otherwise, with the samples per task that would resolve a gain of the paper's
  size at 80% power (``statistics.samples_needed``);
- a share of pairs won (claims): the same against 1/2, on the sign test's exact interval;
- a cell: **within** or **outside** the reproduced value's interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from scripts.harness.records import MethodLabel
from scripts.report.index import ResultIndex
from scripts.report.names import (
    SETTING_NAMES,
    TASK_NAMES,
    averaged_task_set,
    backbone_name,
    benchmark_name,
    retained,
)
from scripts.report.paper_numbers import (
    PAPER_BACKBONES,
    PaperCell,
    PaperClaim,
    PaperNumbers,
    PaperPair,
    paper_numbers,
)
from scripts.report.render import MIDRULE, Cell, Row, Table
from scripts.report.statistics import (
    CONTRADICTED,
    INCONCLUSIVE,
    REPRODUCED,
    Member,
    classify,
    interval_text,
    mean_of_means,
    samples_needed,
    samples_text,
    sign_test_interval,
)

WITHIN, OUTSIDE = "within", "outside"
STUB_HEADS = ["Table", "Benchmark", "Budget", "Setting", "Task"]  # where a pair or cell of the paper is
GAIN_HEADS = ("Paper", "Reproduced", "95% CI", "Samples/task", "Verdict", "Samples/task needed")
CLAIM_HEADS = (*GAIN_HEADS[:3], "Pairs", *GAIN_HEADS[3:])
CELL_HEADS = ("Paper", "Reproduced", "95% CI", "Difference", "Samples/task", "Verdict")
READING = (
    "Gains: +ResKV minus the method beside it, in points; intervals: 95% bootstrap over samples, "
    "resampled within each task and paired across the methods and configurations run on them, tasks "
    "weighted as the tables average them (scripts/report/statistics.py). reproduced: the interval "
    "excludes 0 on the paper's side; contradicted: it excludes the paper's gain and lies on 0's side "
    "of it or beyond; inconclusive: it holds both, and the last column gives the samples per task at "
    "which a gain of the paper's size would be found at 80% power ([0.00, 0.00]: no sample differed, no "
    "spread to size it on). The intervals cover the samples drawn, with one seed and greedy decoding; "
    "the paper's own sample counts are unknown."
)
SHARE_READING = (
    "Configurations improved: pairs won of pairs, the interval the sign test's exact (Clopper-Pearson) "
    "interval of the share won among pairs not tied, read against 1/2 and the paper's share."
)


@dataclass(frozen=True)
class Measured:
    """A cell or pair of the results: its value as the tables show it and its per-sample values
    (points) per stratum, for ``statistics.mean_of_means``."""

    value: float
    member: Member

    @property
    def samples(self) -> tuple[int, int]:
        counts = [len(values) for values in self.member.values()]
        return min(counts), max(counts)


class Reproduction:
    """The results measured as the paper's tables measure them, block by block (cached)."""

    def __init__(self, index: ResultIndex, paper: PaperNumbers):
        self.index = index
        self.paper = paper
        self.pairs = paper.pairs()
        self._measured: dict[tuple, Measured | None] = {}

    def block_of(self, cell: PaperCell) -> list[str]:
        """The rows the paper's table compares ``cell`` with: its pair in an averages table (or the
        full cache alone), every row of a task table."""
        if cell.task is not None:
            return list(
                dict.fromkeys(other.method for other in self.paper.cells if other.table == cell.table)
            )
        if cell.method == FULL_METHOD:
            return [FULL_METHOD]
        base = MethodLabel.parse(cell.method).base
        return [base, base + RESIDUAL_SUFFIX]

    def lengths(self, cell: PaperCell, backbone: str) -> list[int]:
        found = self.index.lengths(backbone, cell.benchmark)
        return found if cell.length is None else [length for length in found if length == cell.length]

    def complete(self, cell: PaperCell, backbone: str, length: int) -> bool:
        """Whether an average covers every task the paper's does (a task cell always does)."""
        averaged = self.index.averaged_tasks(backbone, cell.benchmark, length)
        return cell.task is not None or set(averaged) == set(averaged_task_set(cell.benchmark))

    def measure(self, cell: PaperCell, backbone: str, length: int) -> Measured | None:
        """``cell``'s configuration in the results of ``backbone`` at ``length``; None if missing."""
        key = (backbone, length, cell.table, cell.benchmark, cell.setting, cell.ratio, cell.method, cell.task)
        if key not in self._measured:
            self._measured[key] = self._measure(cell, backbone, length)
        return self._measured[key]

    def _measure(self, cell: PaperCell, backbone: str, length: int) -> Measured | None:
        where = (backbone, cell.benchmark, length, cell.setting, cell.ratio)
        block = self.block_of(cell)
        compared, scores = self.index.compare(*where, block), self.index.shared_scores(*where, block)
        if cell.task is None:
            tasks = self.index.averaged_tasks(backbone, cell.benchmark, length)
            value = self.index.average(backbone, cell.benchmark, length, compared[cell.method]).value
        else:
            tasks = [cell.task]
            value = compared[cell.method].get(cell.task, Cell()).value
        if value is None:
            return None
        member = {
            (backbone, cell.benchmark, length, task): 100 * scores[task][1][cell.method] for task in tasks
        }
        return Measured(value, member)

    def measure_pair(self, pair: PaperPair, backbone: str, length: int) -> Measured | None:
        reskv, other = (self.measure(cell, backbone, length) for cell in (pair.reskv, pair.other))
        if reskv is None or other is None:
            return None
        member = {key: reskv.member[key] - other.member[key] for key in reskv.member}
        return Measured(round(reskv.value - other.value, 2), member)


def _interval(low: float, high: float) -> tuple[float, float]:
    return round(low, 2), round(high, 2)


def _gain_cells(paper_gain: float, gain: float, members: list[Member]) -> list[Cell]:
    """Paper, reproduced, 95% CI, samples per task (those every member shares), verdict, samples per
    task needed."""
    estimate = mean_of_means(members)
    if estimate is None:
        return [Cell(paper_gain), Cell(gain), Cell(), Cell(), Cell(text="no shared samples"), Cell()]
    low, high = _interval(estimate.low, estimate.high)
    verdict = classify(paper_gain, low, high)
    needed = samples_needed(estimate.spread, paper_gain) if verdict == INCONCLUSIVE else None
    return [
        Cell(paper_gain),
        Cell(gain),
        Cell(text=interval_text(low, high)),
        Cell(text=estimate.samples_text),
        Cell(text=verdict),
        Cell(float(needed) if needed is not None else None, digits=0),
    ]


def _span(measured: list[Measured]) -> tuple[int, int]:
    return min(m.samples[0] for m in measured), max(m.samples[1] for m in measured)


def claim_row(reproduction: Reproduction, claim: PaperClaim, backbone: str) -> Row | None:
    """The claim over ``backbone``'s pairs in its scope (any length); None when none is covered."""
    scoped = [pair for pair in reproduction.pairs if claim.scope.admits(pair)]
    templates: dict[tuple, list[PaperPair]] = {}
    for pair in scoped:
        templates.setdefault(pair.template, []).append(pair)
    measured, covered = [], []
    for pairs in templates.values():
        for length in reproduction.index.lengths(backbone, pairs[0].reskv.benchmark):
            if found := reproduction.measure_pair(pairs[0], backbone, length):
                measured.append(found)
                covered += [pair for pair in pairs if pair not in covered]
    if not measured:
        return None
    paper_gains = [pair.gain for pair in covered]
    count = Cell(count=(len(measured), len(scoped)))
    if claim.kind == "share":
        won, of = claim.stated or (sum(gain > 0 for gain in paper_gains), len(paper_gains))
        wins = sum(m.value > 0 for m in measured)
        decided = wins + sum(m.value < 0 for m in measured)
        interval = sign_test_interval(wins, decided)
        verdict = classify(won / of, *interval, null=0.5) if interval else INCONCLUSIVE
        cells = [
            Cell(count=(won, of)),
            Cell(count=(wins, len(measured))),
            Cell(text=interval_text(*interval)) if interval else Cell(),
            count,
            Cell(text=samples_text(_span(measured))),
            Cell(text=verdict),
            Cell(),
        ]
        return Row([claim.name], cells)
    paper_gain = claim.stated if claim.stated is not None else round(float(np.mean(paper_gains)), 2)
    gain = round(float(np.mean([m.value for m in measured])), 2)
    cells = _gain_cells(paper_gain, gain, [m.member for m in measured])
    return Row([claim.name], [*cells[:3], count, *cells[3:]])


def _stub(cell: PaperCell, length: int) -> list[str]:
    return [
        cell.table,
        benchmark_name(cell.benchmark, length),
        retained(cell.ratio) if cell.ratio is not None else "",
        SETTING_NAMES.get(cell.setting, ""),
        TASK_NAMES.get(cell.task, cell.task) if cell.task else "Avg.",
    ]


def _tally(rows: list[Row], column: int, names: tuple[str, ...]) -> str:
    shown = [row.cells[column].text for row in rows]
    return ", ".join(f"{shown.count(name)} {name}" for name in names)


def claims_table(reproduction: Reproduction, backbone: str) -> Table | None:
    rows, missing = [], []
    for claim in reproduction.paper.claims:
        if row := claim_row(reproduction, claim, backbone):
            rows.append(row)
        else:
            missing.append(claim.name)
    if not rows:
        return None
    caption = f"The paper's comparative claims on {backbone_name(backbone)}'s results."
    if backbone not in PAPER_BACKBONES:
        caption += (
            f" {backbone_name(backbone)} is not a backbone of the paper: only its comparative claims are "
            "checked, never its absolute numbers."
        )
    table = _table("claims", backbone, caption, ["Claim"], CLAIM_HEADS, rows)
    table.notes = [
        f"Claims: {_tally(rows, 5, (REPRODUCED, CONTRADICTED, INCONCLUSIVE))}.",
        READING,
        SHARE_READING,
        "Pairs: the claim's +ResKV pairs in these results (any length) / in the paper; a claim without "
        "a number in the text takes the paper's mean over the pairs covered.",
        *(
            note
            for benchmark in sorted(set(reproduction.index.configs["benchmark"]))
            for length in reproduction.index.lengths(backbone, benchmark)
            for note in reproduction.index.coverage_notes(backbone, benchmark, length)
        ),
    ]
    if missing:
        table.notes.append(f"Not covered by these results: {'; '.join(missing)}.")
    return table


def pairs_table(reproduction: Reproduction, backbone: str) -> Table | None:
    rows = []
    for pair in reproduction.pairs:
        if pair.reskv.backbone != backbone:
            continue
        for length in reproduction.lengths(pair.reskv, backbone):
            measured = reproduction.complete(pair.reskv, backbone, length) and reproduction.measure_pair(
                pair, backbone, length
            )
            if measured:
                cells = _gain_cells(pair.gain, measured.value, [measured.member])
                other = f"vs {reproduction.index.method_name(pair.other.method)}"
                rows.append(Row([*_stub(pair.reskv, length), other], cells))
    if not rows:
        return None
    caption = f"The paper's +ResKV pairs on {backbone_name(backbone)}: its gain against the reproduced one."
    table = _table("pairs", backbone, caption, [*STUB_HEADS, "+ResKV"], GAIN_HEADS, _grouped(rows))
    table.notes = [f"Pairs: {_tally(rows, 4, (REPRODUCED, CONTRADICTED, INCONCLUSIVE))}.", READING]
    return table


def cells_table(reproduction: Reproduction, backbone: str) -> Table | None:
    rows = []
    for cell in reproduction.paper.cells:
        if cell.backbone != backbone:
            continue
        for length in reproduction.lengths(cell, backbone):
            measured = reproduction.complete(cell, backbone, length) and reproduction.measure(
                cell, backbone, length
            )
            if not measured:
                continue
            estimate = mean_of_means([measured.member])
            low, high = _interval(estimate.low, estimate.high)
            cells = [
                Cell(cell.value),
                Cell(measured.value),
                Cell(text=interval_text(low, high)),
                Cell(round(measured.value - cell.value, 2)),
                Cell(text=estimate.samples_text),
                Cell(text=WITHIN if low <= cell.value <= high else OUTSIDE),
            ]
            rows.append(Row([*_stub(cell, length), reproduction.index.method_name(cell.method)], cells))
    if not rows:
        return None
    caption = f"The paper's numbers on {backbone_name(backbone)} against the reproduced ones."
    table = _table("cells", backbone, caption, [*STUB_HEADS, "Method"], CELL_HEADS, _grouped(rows))
    table.notes = [
        f"Cells: {_tally(rows, 5, (WITHIN, OUTSIDE))} the reproduced value's 95% interval (bootstrap over "
        "samples, resampled within each task, tasks weighted as the tables average them). One seed, "
        "greedy decoding; the paper's own sample counts are unknown, so its values carry an error of their "
        "own that no interval here shows."
    ]
    return table


def _table(kind: str, backbone: str, caption: str, stub_heads: list[str], heads: tuple, body: list) -> Table:
    name = f"verdict_{kind}_{backbone.replace('/', '--')}"
    return Table(
        name, caption, f"tab:verdict_{kind}_{backbone}", stub_heads, [[(head, 1) for head in heads]], body
    )


def _grouped(rows: list[Row]) -> list[Row | str]:
    """Rows with a rule between the paper's tables."""
    body: list[Row | str] = []
    for row in rows:
        if body and body[-1].stub[0] != row.stub[0]:
            body.append(MIDRULE)
        body.append(row)
    return body


def verdict_tables(index: ResultIndex, paper: PaperNumbers | None = None) -> list[Table]:
    """Per backbone of the results: the claims, and on the paper's backbones the pairs and cells."""
    reproduction = Reproduction(index, paper or paper_numbers())
    tables = []
    for backbone in sorted(set(index.configs["backbone"])):
        for build in (claims_table, pairs_table, cells_table):
            if table := build(reproduction, backbone):
                tables.append(table)
    return tables
