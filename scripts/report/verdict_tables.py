"""The reproduction verdict's tables, rendered from its records (``scripts.report.verdict``); part of
``make tables``. Per backbone of the results (``.md``, ``.tex``, ``.csv`` beside the other tables):

- ``verdict_claims_<backbone>``: each comparative claim of the paper the results cover: the paper's
  gain (or pairs won of pairs), the reproduced one over the +ResKV pairs of the claim's scope the
  results hold (any length), its 95% interval, its test's p-value and Holm's, the two verdicts, and
  what carried them. A backbone the paper did not run gets this table only: its absolute numbers are
  never held against another backbone's.
- ``verdict_pairs_<backbone>`` (the paper's backbones): every +ResKV pair of the paper's tables the
  results cover, with the same verdicts in points, each pair read alone.
- ``verdict_cells_<backbone>`` (the paper's backbones): every cell of the paper's tables the results
  cover: the paper's value, the reproduced one with its interval, and whether the paper's value lies
  inside it.
"""

from __future__ import annotations

from scripts.report.index import ResultIndex
from scripts.report.names import SETTING_NAMES, TASK_NAMES, backbone_name, benchmark_name, retained
from scripts.report.paper_numbers import (
    ABLATION_TABLE,
    CAM_TABLE,
    PAPER_BACKBONES,
    PaperCell,
    PaperPair,
    paper_numbers,
)
from scripts.report.render import MIDRULE, Cell, Row, Table
from scripts.report.statistics import (
    CONSISTENT,
    DRAWS,
    EXACT_LIMIT,
    LARGER,
    NEEDED_MIN_PROMPTS,
    NO_INFORMATION,
    SMALLER,
    Estimate,
    Ratio,
    interval_text,
    samples_text,
)
from scripts.report.verdict import (
    DIRECTIONS,
    NO_LOSS,
    OUTSIDE,
    SIZES,
    UNBOUNDED,
    WITHIN,
    ClaimEvidence,
    ClaimResult,
    Counts,
    PairResult,
    Reproduction,
    cell_results,
    claim_results,
    pair_results,
)

STUB_HEADS = ["Table", "Benchmark", "Budget", "Setting", "Task"]  # where a pair or cell of the paper is
CLAIM_HEADS = (
    "Paper",
    "Reproduced",
    "95% CI",
    "Direction",
    "p",
    "Holm p",
    "Size",
    "Paper here",
    "Pairs",
    "Samples/task",
    "Information",
    "Carried by",
    "Recovered: paper",
    "Recovered",
    "LL recovered",
    "Needed: observed",
    "Needed: paper",
)
PAIR_HEADS = (
    "Paper",
    "Reproduced",
    "95% CI",
    "p",
    "Samples/task",
    "Information",
    "Direction",
    "Size",
    "Needed",
)
CELL_HEADS = ("Paper", "Reproduced", "95% CI", "Difference", "Samples/task", "Verdict")
PAIR_SIZES = (CONSISTENT, SMALLER, LARGER, UNBOUNDED, NO_INFORMATION)  # a pair is sized in points
DESCRIPTION = "description"  # a count claim's direction: counted, not tested
PLAIN_READING = (
    "Direction (does +ResKV help at all?): replicated when an exact test over the prompts finds a "
    "difference on the paper's side of 0 (Holm p at most 0.05), reversed when on the other side, "
    "unresolved when it finds none; more samples may settle it, and the Needed columns say how many "
    "per task.",
    "Size (does it help as much as the paper says?): consistent when the paper's value lies inside the "
    "95% interval, smaller or larger than the paper's when outside it, unbounded when too few prompts "
    "differ to size anything; on a model the paper did not run, the paper's value is its share of the "
    "compression's loss times the loss measured here (Paper here), never its points.",
    "No information: the compared methods scored the same on every sample (a floor or a ceiling), so "
    "the data say nothing about their difference; the interval is then the widest one that many "
    "samples allow, not evidence that the difference is 0.",
)
READING = (
    "Gains: +ResKV minus the method beside it, in points. p: the stratified sign-flip test of the gain "
    "against 0 (null: on every prompt +ResKV and the method beside it are exchangeable; each prompt's "
    "whole contribution to the gain, every pair of the row with it, flips sign, within its task), "
    f"exact over every sign pattern up to {EXACT_LIMIT} differing prompts, else over {DRAWS:,} "
    "drawn ones (seeded; ten times as many near a Holm threshold) with its Monte Carlo error (+-); "
    "with fewer than 6 differing prompts no "
    "pattern can reach 0.05. 95% CI: toward 0 it ends at the test's critical value, so it excludes 0 "
    "exactly when p <= 0.05; away from 0, where a score test stops holding a larger gain, carried by "
    "proportionally more differing prompts; where the test cannot reach 0.05, the exact bound "
    "(Clopper-Pearson on the prompts that differ, each at the largest reach a prompt has) "
    "(scripts/report/statistics.py). "
    "Holm p: adjusted over the rows whose test can reach 0.05, which are nested (a setting's or "
    "budget's pairs are part of the overall row's). Information: tasks, prompts and distinct pair x "
    "prompt cells where the compared methods differ, the cells as +ResKV's gains and losses. Carried "
    "by: the tasks' shares of the gain. Recovered: the share of the compression's loss, "
    "(+ResKV - base) / (full - base), that +ResKV wins back (the paper's from its tables); LL "
    "recovered: the same for the answer's log-likelihood gap to the full cache, with Fieller's 95% "
    "interval. Needed: samples per task at which a paired t test finds, at 80% power, the observed gain "
    f"and the paper's (Paper here, or its points); not estimable from fewer than {NEEDED_MIN_PROMPTS} "
    "differing prompts. The intervals cover the samples drawn, with one seed and greedy decoding; the "
    "paper's own sample counts are unknown."
)
COUNT_READING = (
    "Configurations improved, best on every task: a description, not a test: the distinct pairs whose "
    "gain (as the tables show it) is positive, negative or 0, beside the paper's count; pairs that "
    "share prompts give no independent evidence to test a count with."
)


def information_text(counts: Counts) -> str:
    """Tasks, prompts and distinct cells where the compared methods differ (``verdict.Counts``)."""
    tasks, prompts = counts.tasks, counts.prompts
    text = (
        f"{tasks[0]}/{tasks[1]} tasks, {prompts[0]}/{prompts[1]} prompts, "
        f"{counts.differing_cells:,}/{counts.cells:,} cells"
    )
    if counts.differing_cells == 0:
        return f"none: {text}"
    gains = f"{counts.gains} gain{'s' * (counts.gains != 1)}"
    return f"{text}: {gains}, {counts.losses} loss{'es' * (counts.losses != 1)}"


def pairs_text(counts: Counts, scoped: int) -> str:
    twins = f", {counts.distinct_pairs} distinct" if counts.distinct_pairs < counts.pairs else ""
    return f"{counts.pairs}/{scoped}{twins}"


def _p_text(estimate: Estimate | None) -> Cell:
    if estimate is None or estimate.test is None or estimate.test.differing == 0:
        return Cell()
    return Cell(text=estimate.test.text)


def _count_cell(needed: int | str | None, unit: str = "") -> Cell:
    if needed is None:
        return Cell()
    return Cell(text=f"{needed}{unit}" if isinstance(needed, int) else needed)


def _ratio_cell(share: Ratio | None, interval: bool) -> Cell:
    if share is None:
        return Cell()
    if share.value is None:
        return Cell(text=NO_LOSS)
    if not interval or share.low is None:
        return Cell(text=f"{share.value:.3f}")
    return Cell(text=f"{share.value:.3f} [{share.low:.3f}, {share.high:.3f}]")


def claim_row(result: ClaimResult, found: ClaimEvidence) -> Row:
    """A claim's record as a row of ``CLAIM_HEADS``."""
    scoped = len(found.scoped) + len(found.versus_scoped)
    if result.improved is not None:
        improved = result.improved
        won, of = result.paper
        cells = {
            "Paper": Cell(count=(won, of)),
            "Reproduced": Cell(
                text=f"{improved.won} won, {improved.lost} lost, {improved.level} level "
                f"of {improved.distinct}"
            ),
            "Direction": Cell(text=DESCRIPTION),
            "Pairs": Cell(
                text=f"{improved.pairs}/{scoped}"
                + (f", {improved.distinct} distinct" if improved.distinct < improved.pairs else "")
            ),
            "Samples/task": Cell(text=samples_text(result.samples)),
        }
    elif result.estimate is None:
        cells = {
            "Paper": Cell(result.paper),
            "Reproduced": Cell(result.reproduced),
            "95% CI": Cell(text="no shared samples"),
        }
    else:
        estimate, needed = result.estimate, result.needed
        cells = {
            "Paper": Cell(result.paper),
            "Reproduced": Cell(result.reproduced),
            "95% CI": Cell(text=interval_text(round(estimate.low, 2), round(estimate.high, 2))),
            "Direction": Cell(text=result.direction),
            "p": _p_text(estimate),
            "Holm p": Cell(result.holm_p, digits=3),
            "Size": Cell(text=result.size),
            "Paper here": Cell(result.paper_here) if result.claim.kind != "contrast" else Cell(),
            "Pairs": Cell(text=pairs_text(result.counts, scoped)),
            "Samples/task": Cell(text=estimate.samples_text),
            "Information": Cell(text=information_text(result.counts)),
            "Carried by": Cell(text=result.carried_by or None),
            "Recovered: paper": Cell(result.recovered_paper, digits=3),
            "Recovered": _ratio_cell(result.recovered, interval=False),
            "LL recovered": _ratio_cell(result.ll_recovered, interval=True),
            "Needed: observed": _count_cell(needed.observed),
            "Needed: paper": _count_cell(needed.paper, needed.unit),
        }
    return Row([result.claim.name], [cells.get(head, Cell()) for head in CLAIM_HEADS])


def _tally(rows: list[Row], column: int, names: tuple[str, ...]) -> str:
    shown = [row.cells[column].text for row in rows]
    return ", ".join(f"{shown.count(name)} {name}" for name in names)


def drawn_notes(results: list[ClaimResult]) -> list[str]:
    """Where a test was drawn, not enumerated: the Monte Carlo error of its p-value (in the p column)
    and of the interval's end toward 0, which its critical value sets."""
    drawn = [
        f"{result.claim.name} ({result.estimate.test.differing} differing prompts, "
        f"{result.estimate.test.patterns:,} patterns: the interval's end toward 0 "
        f"+-{result.estimate.test.critical_error:.3f})"
        for result in results
        if result.estimate is not None and result.estimate.test.differing and not result.estimate.test.exact
    ]
    return [f"Drawn tests: {'; '.join(drawn)}."] if drawn else []


def twins_notes(reproduction: Reproduction, backbone: str) -> list[str]:
    """Which configurations of ``backbone`` are twins (identical outputs, ``ResultIndex.twins``), and in
    how many of the budgets x settings where both ran."""
    index = reproduction.index
    found: dict[tuple, dict[tuple, int]] = {}
    for (where_backbone, benchmark, length, *_, label), first in index.twins().items():
        if where_backbone == backbone and label != first:
            places = found.setdefault((first, label), {})
            places[(benchmark, length)] = places.get((benchmark, length), 0) + 1
    notes = []
    for (first, label), places in sorted(found.items()):
        counted = []
        for (benchmark, length), twins in sorted(places.items()):
            both = sum(
                {first, label} <= set(rows["label"])
                for where, rows in index.slices.items()
                if where[:3] == (backbone, benchmark, length)
            )
            counted.append(f"{benchmark_name(benchmark, length)} {twins} of {both} budgets x settings")
        notes.append(f"{index.method_name(label)} = {index.method_name(first)} ({', '.join(counted)})")
    if not notes:
        return []
    return [
        "Identical outputs on every sample, counted once in Pairs, Information and the counts: "
        f"{'; '.join(notes)}. The gains still average every pair, as the tables do."
    ]


def claims_table(reproduction: Reproduction, backbone: str) -> Table | None:
    read, missing = claim_results(reproduction, backbone)
    if not read:
        return None
    rows = [claim_row(result, found) for result, found in read]
    caption = f"The paper's comparative claims on {backbone_name(backbone)}'s results."
    if backbone not in PAPER_BACKBONES:
        caption += (
            f" {backbone_name(backbone)} is not a backbone of the paper: only its comparative claims are "
            "checked, their size on the share of the compression's loss recovered, never its absolute "
            "numbers."
        )
    table = _table("claims", backbone, caption, ["Claim"], CLAIM_HEADS, rows)
    direction, size = CLAIM_HEADS.index("Direction"), CLAIM_HEADS.index("Size")
    table.notes = [
        f"Direction: {_tally(rows, direction, DIRECTIONS)}, {_tally(rows, direction, (DESCRIPTION,))}. "
        f"Size: {_tally(rows, size, SIZES)}.",
        *PLAIN_READING,
        READING,
        COUNT_READING,
        "Pairs: the claim's +ResKV pairs in these results (any length) / in the paper; a claim without "
        "a number in the text takes the paper's mean over all of its pairs, covered here or not.",
        *twins_notes(reproduction, backbone),
        *drawn_notes([result for result, _ in read]),
        *(
            f"{result.claim.name}: covers {', '.join(_pair_names(found.covered, reproduction.index))} of the "
            f"paper's {len(found.scoped)}."
            for result, found in read
            if result.claim.scope.table in (CAM_TABLE, ABLATION_TABLE)
            and len(found.covered) < len(found.scoped)
        ),
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


def _pair_names(pairs: list[PaperPair], index: ResultIndex) -> list[str]:
    names = []
    for pair in pairs:
        task = TASK_NAMES.get(pair.reskv.task, pair.reskv.task)
        names.append(f"{task} vs {index.method_name(pair.other.method)}")
    return names


def _stub(cell: PaperCell, length: int) -> list[str]:
    return [
        cell.table,
        benchmark_name(cell.benchmark, length),
        retained(cell.ratio) if cell.ratio is not None else "",
        SETTING_NAMES.get(cell.setting, ""),
        TASK_NAMES.get(cell.task, cell.task) if cell.task else "Avg.",
    ]


def pair_row(result: PairResult, index: ResultIndex) -> Row:
    """A +ResKV pair's record as a row of ``PAIR_HEADS``."""
    estimate = result.estimate
    stub = [*_stub(result.pair.reskv, result.length), f"vs {index.method_name(result.pair.other.method)}"]
    if estimate is None:
        cells = [Cell(result.paper), Cell(result.reproduced), Cell(text="no shared samples")]
        return Row(stub, cells + [Cell()] * (len(PAIR_HEADS) - 3))
    strata, prompts = estimate.informative_strata, estimate.differing_prompts
    information = f"{strata[0]}/{strata[1]} tasks, {prompts[0]}/{prompts[1]} prompts"
    cells = [
        Cell(result.paper),
        Cell(result.reproduced),
        Cell(text=interval_text(round(estimate.low, 2), round(estimate.high, 2))),
        _p_text(estimate),
        Cell(text=estimate.samples_text),
        Cell(text=f"none: {information}" if estimate.no_information else information),
        Cell(text=result.direction),
        Cell(text=result.size),
        _count_cell(result.needed),
    ]
    return Row(stub, cells)


def pairs_table(reproduction: Reproduction, backbone: str) -> Table | None:
    rows = [pair_row(result, reproduction.index) for result in pair_results(reproduction, backbone)]
    if not rows:
        return None
    caption = f"The paper's +ResKV pairs on {backbone_name(backbone)}: its gain against the reproduced one."
    table = _table("pairs", backbone, caption, [*STUB_HEADS, "+ResKV"], PAIR_HEADS, _grouped(rows))
    directions = tuple(name for name in DIRECTIONS if "Holm" not in name)
    table.notes = [
        f"Direction: {_tally(rows, PAIR_HEADS.index('Direction'), directions)}. Size: "
        f"{_tally(rows, PAIR_HEADS.index('Size'), PAIR_SIZES)}.",
        *PLAIN_READING,
        READING,
        "Each pair is read alone (no family adjustment); Needed: for the paper's gain.",
        *twins_notes(reproduction, backbone),
    ]
    return table


def cells_table(reproduction: Reproduction, backbone: str) -> Table | None:
    rows = []
    for result in cell_results(reproduction, backbone):
        estimate = result.estimate
        cells = [
            Cell(result.cell.value),
            Cell(result.reproduced),
            Cell(text=interval_text(round(estimate.low, 2), round(estimate.high, 2))),
            Cell(round(result.reproduced - result.cell.value, 2)),
            Cell(text=samples_text(estimate.samples)),
            Cell(text=result.verdict),
        ]
        method = reproduction.index.method_name(result.cell.method)
        rows.append(Row([*_stub(result.cell, result.length), method], cells))
    if not rows:
        return None
    caption = f"The paper's numbers on {backbone_name(backbone)} against the reproduced ones."
    table = _table("cells", backbone, caption, [*STUB_HEADS, "Method"], CELL_HEADS, _grouped(rows))
    table.notes = [
        f"Cells: {_tally(rows, 5, (WITHIN, OUTSIDE))} the reproduced value's 95% interval (Wilson's score "
        "interval over the prompts, stratified by task, tasks weighted as the tables average them: "
        "scripts/report/statistics.py). One seed, greedy decoding; the paper's own sample counts are "
        "unknown, so its values carry an error of their own that no interval here shows."
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


def verdict_tables(index: ResultIndex, paper=None) -> list[Table]:
    """Per backbone of the results: the claims, and on the paper's backbones the pairs and cells."""
    reproduction = Reproduction(index, paper or paper_numbers())
    tables = []
    for backbone in sorted(set(index.configs["backbone"])):
        for build in (claims_table, pairs_table, cells_table):
            if table := build(reproduction, backbone):
                tables.append(table)
    return tables
