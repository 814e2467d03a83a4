"""The reproduction verdict: the paper's published numbers (``scripts.report.paper_numbers``) beside
the results, with prompt-clustered statistics (``scripts.report.statistics``). Part of ``make tables``.

Per backbone of the results (``.md``, ``.tex``, ``.csv`` beside the other tables):

- ``verdict_claims_<backbone>``: each comparative claim of the paper the results cover: the paper's
  gain (or pairs won, or contrast), the reproduced one over the +ResKV pairs of the claim's scope the
  results hold (any length), its 95% interval, the information behind it, and two verdicts. A
  backbone the paper did not run gets this table only: its absolute numbers are never held against
  another backbone's, and a claim's size is judged on the share of the compression's loss recovered.
- ``verdict_pairs_<backbone>`` (the paper's backbones): every +ResKV pair of the paper's tables the
  results cover, with the same verdicts in points.
- ``verdict_cells_<backbone>`` (the paper's backbones): every cell of the paper's tables the results
  cover: the paper's value, the reproduced one with its interval, and whether the paper's value lies
  inside it.

A cell or pair of the paper is covered by results of its backbone, benchmark, setting, budget,
method and task (and length, where the paper states one) whose average covers every task the
paper's does; a claim, by any pair of its scope (a partial task set is named by the table's notes).
Values are the tables' own (``scripts.report.index``: a block of rows compared on the samples all of
them scored); intervals resample the prompts of each task once per draw, every pair and
configuration of the claim on that draw, tasks weighted as the tables average them.

The two verdicts, never one word for both (``statistics.direction``, ``statistics.size``):

- **direction**: the interval lies on the paper's side of 0 (*replicated*), holds 0 (*unresolved*)
  or lies on the other side (*reversed*); over a table's gain and contrast claims, which are nested
  (the settings' and budgets' pairs are subsets of the overall row's), Holm's step-down adjustment
  holds the family's error rate at 5%: a row whose interval excludes 0 but whose adjusted p-value
  exceeds 5% is *unresolved (Holm)*. *No information*: no prompt differed between the compared
  methods; the interval is the exact bound, never zero-width evidence;
- **size**: the paper's value inside the interval (*consistent*), above it (*smaller than the
  paper's*) or below it (*larger than the paper's*): in points on the paper's backbones, otherwise
  on the share of the compression's loss recovered, ``(+ResKV - base) / (full - base)``, the paper's
  from its own tables with their full-cache rows, the reproduction's with its interval (a loss
  whose interval holds 0 is not divided: *no loss to recover*).

Beside them: the share of the answer log-likelihood loss (to the full cache) that +ResKV recovers,
paired the same way (it separates methods where every score ties); which tasks carry the gain; and,
for every row whose direction is unresolved, the samples per task a paired t test would need to
resolve the observed gain and the paper's (``statistics.samples_needed``; ``rounds_needed`` gives
them per claim, for the dry run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
    ABLATION_TABLE,
    CAM_TABLE,
    PAPER_BACKBONES,
    PaperCell,
    PaperClaim,
    PaperNumbers,
    PaperPair,
    paper_numbers,
)
from scripts.report.render import MIDRULE, Cell, Row, Table
from scripts.report.statistics import (
    BOOTSTRAP_T,
    CONFIDENCE,
    CONSISTENT,
    DIFFERENCE_RANGE,
    LARGER,
    N_RESAMPLES,
    NO_INFORMATION,
    REPLICATED,
    REVERSED,
    SCORE_RANGE,
    SMALLER,
    UNRESOLVED,
    Estimate,
    Member,
    PromptTable,
    Ratio,
    direction,
    estimate,
    flips_spread,
    holm,
    interval_text,
    mean_of_means,
    ratio_estimate,
    samples_needed,
    samples_text,
    size,
)

WITHIN, OUTSIDE = "within", "outside"
NOT_COMPARABLE, NO_LOSS, UNBOUNDED = "not comparable", "no loss to recover", "unbounded"
NO_FULL = "no full-cache run"  # the share recovered needs the full cache on the claim's tasks
HOLM_UNRESOLVED = UNRESOLVED + " (Holm)"
LL_GAP = "quality.answer_log_prob_gap"  # reskv.quality: the answer's log-likelihood less the full cache's
LL_RANGE = (-np.inf, np.inf)  # a log-likelihood has no largest difference: no exact bound
STUB_HEADS = ["Table", "Benchmark", "Budget", "Setting", "Task"]  # where a pair or cell of the paper is
GAIN_HEADS = ("Paper", "Reproduced", "95% CI", "Samples/task", "Information", "Direction", "Size", "Needed")
CLAIM_HEADS = (
    "Paper",
    "Reproduced",
    "95% CI",
    "Pairs",
    "Samples/task",
    "Information",
    "Carried by",
    "Direction",
    "Holm p",
    "Size",
    "Recovered: paper",
    "Recovered",
    "LL recovered",
    "Needed: observed",
    "Needed: paper",
)
DIRECTION_COLUMN, SIZE_COLUMN = CLAIM_HEADS.index("Direction"), CLAIM_HEADS.index("Size")
CELL_HEADS = ("Paper", "Reproduced", "95% CI", "Difference", "Samples/task", "Verdict")
PLAIN_READING = (
    "Direction (does +ResKV help at all?): replicated when the 95% interval lies wholly on the paper's "
    "side of 0, reversed when wholly on the other side, unresolved when it holds 0; more samples may "
    "settle it, and the Needed columns say how many per task.",
    "Size (does it help as much as the paper says?): consistent when the paper's value lies inside the "
    "interval, smaller or larger than the paper's when outside it; on a model the paper did not run, "
    "size compares the share of the compression's loss that +ResKV wins back, never points.",
    "No information: the compared methods scored the same on every sample (a floor or a ceiling), so "
    "the data say nothing about their difference; the interval is then the widest one that many "
    "samples allow, not evidence that the difference is 0.",
)
READING = (
    "Gains: +ResKV minus the method beside it, in points. 95% CI: studentized (bootstrap-t) interval "
    "over prompts, each task's prompts resampled once per draw and every pair and configuration of "
    "the row read on that draw, tasks weighted as the tables average them; where too few prompts "
    "differ for the draws to bound it, the exact bound (Clopper-Pearson on the share of prompts that "
    "differ, times the metric's largest difference) (scripts/report/statistics.py). Information: tasks "
    "and pair x prompt cells where the compared methods differ. Carried by: the tasks' shares of the "
    "gain. Holm p: the direction test's p-value, Holm-adjusted over the gain and contrast rows, which "
    "are nested (a setting's or budget's pairs are part of the overall row's). Recovered: the share of "
    "the compression's loss, (+ResKV - base) / (full - base), that +ResKV wins back (the paper's from "
    "its tables), with its interval; LL recovered: the same for the answer's log-likelihood gap to "
    "the full cache. Needed: samples per task at which a paired t test finds, at 80% power, the "
    "observed gain and the gain the paper's recovered share (or, where its table has no full cache, "
    "its points) would give here. The intervals cover the samples drawn, with one seed and greedy "
    "decoding; the paper's own sample counts are unknown."
)
SHARE_READING = (
    "Configurations improved: pairs won of pairs; its interval is the range of the count over the same "
    "prompt draws (2.5th to 97.5th percentile; 'all' the share of draws where every pair gains), a pair "
    "tied on every prompt counted lost at its low end and won at its high end (the data cannot tell "
    "its side), read against half of them and the paper's share."
)


@dataclass(frozen=True)
class Measured:
    """A cell or pair of the results: its value as the tables show it and its per-sample values
    (points) per stratum, for ``statistics.PromptTable``."""

    value: float
    member: Member

    @property
    def samples(self) -> tuple[int, int]:
        counts = [len(values) for values in self.member.values()]
        return min(counts), max(counts)


@dataclass(frozen=True)
class MeasuredPair:
    """A +ResKV pair of the results: its gain, and per stratum the base's loss to the full cache
    (points) and the log-likelihood gaps' difference and the base's gap (None where not recorded)."""

    gain: Measured
    loss: Member | None
    ll_gain: Member | None
    ll_loss: Member | None


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

    def _tasks(self, cell: PaperCell, backbone: str, length: int) -> list[str]:
        return (
            self.index.averaged_tasks(backbone, cell.benchmark, length) if cell.task is None else [cell.task]
        )

    def _measure(self, cell: PaperCell, backbone: str, length: int) -> Measured | None:
        where = (backbone, cell.benchmark, length, cell.setting, cell.ratio)
        block = self.block_of(cell)
        compared, scores = self.index.compare(*where, block), self.index.shared_scores(*where, block)
        if cell.task is None:
            value = self.index.average(backbone, cell.benchmark, length, compared[cell.method]).value
        else:
            value = compared[cell.method].get(cell.task, Cell()).value
        if value is None:
            return None
        member = {
            (backbone, cell.benchmark, length, task): 100 * scores[task][1][cell.method]
            for task in self._tasks(cell, backbone, length)
        }
        return Measured(value, member)

    def measure_pair(self, pair: PaperPair, backbone: str, length: int) -> MeasuredPair | None:
        reskv, other = (self.measure(cell, backbone, length) for cell in (pair.reskv, pair.other))
        if reskv is None or other is None:
            return None
        gain = Measured(
            round(reskv.value - other.value, 2),
            {key: reskv.member[key] - other.member[key] for key in reskv.member},
        )
        benchmark, tasks = pair.reskv.benchmark, self._tasks(pair.reskv, backbone, length)
        full = self.index.shared_scores(backbone, benchmark, length, "", None, [FULL_METHOD])
        loss = None
        if all(task in full and len(full[task][1][FULL_METHOD]) for task in tasks):
            loss = {
                (backbone, benchmark, length, task): (
                    100 * full[task][1][FULL_METHOD] - other.member[(backbone, benchmark, length, task)]
                ).dropna()
                for task in tasks
            }
        where = (backbone, benchmark, length, pair.reskv.setting, pair.reskv.ratio)
        gaps = [self.index.sample_values(*where, cell.method, LL_GAP) for cell in (pair.reskv, pair.other)]
        ll_gain = ll_loss = None
        if all(task in found for found in gaps for task in tasks):
            ll_gain, ll_loss = {}, {}
            for task in tasks:
                key = (backbone, benchmark, length, task)
                scored = gain.member[key].index
                ll_gain[key] = (gaps[0][task] - gaps[1][task]).reindex(scored).dropna()
                ll_loss[key] = (-gaps[1][task]).reindex(scored).dropna()
        return MeasuredPair(gain, loss, ll_gain, ll_loss)


def _interval(low: float, high: float) -> tuple[float, float]:
    return round(low, 2), round(high, 2)


def information_text(strata: tuple[int, int], cells: tuple[int, int]) -> str:
    """Tasks, and pair x prompt cells, where the compared methods differ (``PromptTable.informative``)."""
    text = f"{strata[0]}/{strata[1]} tasks, {cells[0]:,}/{cells[1]:,} cells"
    return f"none: {text}" if cells[0] == 0 else text


def carried_by(table: PromptTable, coefficients: np.ndarray | None = None) -> str:
    """The tasks' shares of the estimate, largest first (three at most): which tasks carry it."""
    means = [values.mean() for values in table.combined(coefficients)]
    total = sum(means)
    if total == 0:
        return ""
    shares = sorted(
        ((mean / total, key[-1]) for mean, key in zip(means, table.strata, strict=True) if mean != 0),
        key=lambda share: -abs(share[0]),
    )
    text = ", ".join(f"{task} {100 * share:.0f}%" for share, task in shares[:3])
    return text + (f" (+{len(shares) - 3})" if len(shares) > 3 else "")


def _needed(spread: float, gain: float | None, strata: int) -> int | None:
    """``samples_needed`` for ``gain``; without a spread (no prompt differed), a gain made of
    whole-sample flips (``statistics.flips_spread``), spread over the row's ``strata``."""
    if gain is None or gain == 0:
        return None
    if spread == 0:
        spread = flips_spread(gain) / np.sqrt(strata)
    return samples_needed(spread, gain)


def _count_cell(needed: int | None, text: str = "") -> Cell:
    return Cell(text=f"{needed}{text}") if needed is not None else Cell()


def _gain_cells(paper_gain: float, gain: float, members: list[Member]) -> list[Cell]:
    """Pairs table, in points: paper, reproduced, 95% CI, samples per task, information, direction,
    size, samples per task needed for the paper's gain where the direction is unresolved."""
    table = PromptTable.of(members)
    if table is None:
        return [
            Cell(paper_gain),
            Cell(gain),
            Cell(),
            Cell(),
            Cell(),
            Cell(text="no shared samples"),
            Cell(),
            Cell(),
        ]
    found = estimate(table)
    low, high = _interval(found.low, found.high)
    if found.no_information:
        verdicts = (NO_INFORMATION, NO_INFORMATION)
    else:
        verdicts = (direction(paper_gain, low, high), size(paper_gain, low, high))
    needed = _needed(found.spread, paper_gain, len(table.strata)) if verdicts[0] != REPLICATED else None
    return [
        Cell(paper_gain),
        Cell(gain),
        Cell(text=interval_text(low, high)),
        Cell(text=found.samples_text),
        Cell(text=information_text(found.informative_strata, found.informative_prompts)),
        Cell(text=verdicts[0]),
        Cell(text=verdicts[1]),
        _count_cell(needed),
    ]


@dataclass(frozen=True)
class ClaimEvidence:
    """The pairs of ``backbone``'s results a claim covers (its scope's, then its ``versus``'s), with the
    paper's pairs they cover and all its scope's."""

    measured: list[MeasuredPair]
    versus: list[MeasuredPair]
    covered: list[PaperPair]
    scoped: list[PaperPair]
    versus_scoped: list[PaperPair]


def _covered(
    reproduction: Reproduction, scope, backbone: str
) -> tuple[list[MeasuredPair], list[PaperPair], list[PaperPair]]:
    scoped = [pair for pair in reproduction.pairs if scope.admits(pair)]
    templates: dict[tuple, list[PaperPair]] = {}
    for pair in scoped:
        templates.setdefault(pair.template, []).append(pair)
    measured, covered = [], []
    for pairs in templates.values():
        for length in reproduction.index.lengths(backbone, pairs[0].reskv.benchmark):
            if found := reproduction.measure_pair(pairs[0], backbone, length):
                measured.append(found)
                covered += [pair for pair in pairs if pair not in covered]
    return measured, covered, scoped


def evidence(reproduction: Reproduction, claim: PaperClaim, backbone: str) -> ClaimEvidence | None:
    measured, covered, scoped = _covered(reproduction, claim.scope, backbone)
    versus, _, versus_scoped = (
        _covered(reproduction, claim.versus, backbone) if claim.versus else ([], [], [])
    )
    if not measured or (claim.versus and not versus):
        return None
    return ClaimEvidence(measured, versus, covered, scoped, versus_scoped)


@dataclass(frozen=True)
class ClaimVerdict:
    """A claim's evidence read: its estimate (a gain or contrast; None for a share), its unadjusted
    direction, and what the row needs to be written."""

    claim: PaperClaim
    found: Estimate | None
    cells: list[Cell]
    needed: tuple[int | None, int | None]
    samples: int

    @property
    def p_value(self) -> float | None:
        """The direction test's p-value; None for a share, and for an exact bound, which is left out
        of the Holm family: centred where most prompts lie (on 0 where they tie), it cannot reject,
        and a test that cannot reject need not count (Tarone, *Biometrics* 46, 1990)."""
        return self.found.p_value if self.found is not None and self.found.method == BOOTSTRAP_T else None


def _ratio(numerators: list[Member | None], denominators: list[Member | None], value_range) -> Ratio | None:
    """The share of a loss recovered over pairs (``statistics.ratio_estimate``); None where a pair
    lacks what it needs."""
    if not numerators or any(member is None for member in numerators + denominators):
        return None
    return ratio_estimate(numerators, denominators, value_range)


def _share_cell(share: Ratio | None) -> Cell:
    if share is None:
        return Cell()
    return Cell(text=_share_text(share))


def _share_text(share: Ratio) -> str:
    if share.value is None:
        return NO_LOSS
    if share.low is None:
        return f"{share.value:.3f} ({UNBOUNDED})"
    return f"{share.value:.3f} [{share.low:.3f}, {share.high:.3f}]"


def _mean_loss(losses: list[Member | None]) -> float | None:
    if not losses or any(member is None for member in losses):
        return None
    table = PromptTable.of(losses)
    return None if table is None else float(sum(values.mean() for values in table.combined()))


def judge_gain(
    reproduction: Reproduction, claim: PaperClaim, backbone: str, found: ClaimEvidence
) -> ClaimVerdict:
    """A gain or contrast claim, before the family's Holm adjustment."""
    gains = [pair.gain for pair in found.measured + found.versus]
    members = [measured.member for measured in gains]
    count, against = len(found.measured), len(found.versus)
    coefficients = None
    paper_gain = claim.stated
    if claim.kind == "contrast":
        total = count + against
        coefficients = np.array([total / count] * count + [-total / against] * against)
        if paper_gain is None:
            paper_gain = round(
                float(
                    np.mean([p.gain for p in found.scoped]) - np.mean([p.gain for p in found.versus_scoped])
                ),
                2,
            )
        shown = round(
            float(np.mean([g.value for g in gains[:count]]) - np.mean([g.value for g in gains[count:]])), 2
        )
    else:
        if paper_gain is None:
            paper_gain = round(float(np.mean([pair.gain for pair in found.scoped])), 2)
        shown = round(float(np.mean([g.value for g in gains])), 2)
    table = PromptTable.of(members)
    if table is None:
        return ClaimVerdict(claim, None, [Cell(paper_gain), Cell(shown)], (None, None), 0)
    result = estimate(table, coefficients=coefficients)
    low, high = _interval(result.low, result.high)
    paper_share = share = ll_share = None
    if claim.kind == "gain":
        paper_share = reproduction.paper.recovered_share(found.scoped)
        share = _ratio(
            [p.gain.member for p in found.measured], [p.loss for p in found.measured], DIFFERENCE_RANGE
        )
        ll_share = _ratio([p.ll_gain for p in found.measured], [p.ll_loss for p in found.measured], LL_RANGE)
    on_paper_backbone = backbone in PAPER_BACKBONES
    if result.no_information:
        verdicts = (NO_INFORMATION, NO_INFORMATION)
    else:
        judged_size = size(paper_gain, low, high)
        if not on_paper_backbone:
            if claim.kind == "contrast" or paper_share is None:
                judged_size = NOT_COMPARABLE
            elif share is None:
                judged_size = NO_FULL
            elif share.value is None:
                judged_size = NO_LOSS
            elif share.low is None:
                judged_size = UNBOUNDED
            else:
                judged_size = size(paper_share, share.low, share.high)
        verdicts = (direction(paper_gain, low, high), judged_size)
    # Samples needed (kept for the rows whose direction stays unresolved, ``claim_verdicts``): for
    # the observed gain, and for the paper's: its recovered share of the loss measured here, or on
    # its own backbones (or a table without a full cache) its points.
    strata = len(table.strata)
    observed = None if result.no_information else _needed(result.spread, result.value, strata)
    target, unit = paper_gain, "" if on_paper_backbone else " (points)"
    loss = _mean_loss([p.loss for p in found.measured]) if claim.kind == "gain" else None
    if not on_paper_backbone and paper_share is not None and loss is not None and loss > 0:
        target, unit = paper_share * loss, ""
    elif not on_paper_backbone and claim.kind == "contrast":
        target = None
    needed = (observed, _needed(result.spread, target, strata))
    cells = [
        Cell(paper_gain),
        Cell(shown),
        Cell(text=interval_text(low, high)),
        None,  # pairs: filled by claim_row
        Cell(text=result.samples_text),
        Cell(text=information_text(result.informative_strata, result.informative_prompts)),
        Cell(text=carried_by(table, coefficients) or None),
        Cell(text=verdicts[0]),
        None,  # Holm p: filled over the family
        Cell(text=verdicts[1]),
        Cell(paper_share, digits=3) if paper_share is not None else Cell(),
        _share_cell(share),
        _share_cell(ll_share),
        _count_cell(needed[0]),
        _count_cell(needed[1], unit),
    ]
    return ClaimVerdict(claim, result, cells, needed, table.samples[0])


def judge_share(claim: PaperClaim, found: ClaimEvidence) -> ClaimVerdict:
    """Configurations improved: the count of pairs with a positive gain on each prompt draw."""
    won, of = claim.stated or (sum(pair.gain > 0 for pair in found.scoped), len(found.scoped))
    gains = [pair.gain for pair in found.measured]
    wins = sum(measured.value > 0 for measured in gains)
    table = PromptTable.of([measured.member for measured in gains])
    empty = [Cell()] * (len(CLAIM_HEADS) - 2)
    if table is None:
        return ClaimVerdict(
            claim, None, [Cell(count=(won, of)), Cell(count=(wins, len(gains))), *empty], (None, None), 0
        )
    counts = np.sort((table.member_means(table.draws()) > 0).sum(axis=1))
    # A pair that ties on every prompt carries no information on its side of 0: the interval's low
    # end counts it lost, its high end won.
    tied = int(table.tied().sum())
    low = int(counts[round((N_RESAMPLES + 1) * (1 - CONFIDENCE) / 2) - 1])
    high = int(counts[round((N_RESAMPLES + 1) * (1 + CONFIDENCE) / 2) - 1]) + tied
    every = float(np.mean(counts == len(gains)))
    strata, cells = table.informative()
    if cells[0] == 0:
        verdicts = (NO_INFORMATION, NO_INFORMATION)
    else:
        share = won / of
        verdicts = (
            direction(share, low / len(gains), high / len(gains), null=0.5),
            size(share, low / len(gains), high / len(gains)),
        )
    row = [
        Cell(count=(won, of)),
        Cell(text=f"{wins}/{len(gains)}{f', {tied} tied' if tied else ''} (all: {100 * every:.0f}%)"),
        Cell(text=f"[{low}, {high}]"),
        None,
        Cell(text=samples_text(table.samples)),
        Cell(text=information_text(strata, cells)),
        Cell(),
        Cell(text=verdicts[0]),
        Cell(),
        Cell(text=verdicts[1]),
        *[Cell()] * 5,
    ]
    return ClaimVerdict(claim, None, row, (None, None), table.samples[0])


def claim_verdicts(
    reproduction: Reproduction, backbone: str
) -> tuple[list[tuple[ClaimVerdict, ClaimEvidence]], list[str]]:
    """Every claim ``backbone``'s results cover, read, the direction family Holm-adjusted; and the
    names of those not covered."""
    read, missing = [], []
    for claim in reproduction.paper.claims:
        found = evidence(reproduction, claim, backbone)
        if found is None:
            missing.append(claim.name)
            continue
        judged = (
            judge_share(claim, found)
            if claim.kind == "share"
            else judge_gain(reproduction, claim, backbone, found)
        )
        read.append((judged, found))
    family = [judged for judged, _ in read if judged.p_value is not None]
    for judged, adjusted in zip(family, holm([judged.p_value for judged in family]), strict=True):
        judged.cells[CLAIM_HEADS.index("Holm p")] = Cell(adjusted, digits=3)
        if judged.cells[DIRECTION_COLUMN].text in (REPLICATED, REVERSED) and adjusted > 1 - CONFIDENCE:
            judged.cells[DIRECTION_COLUMN] = Cell(text=HOLM_UNRESOLVED)
        if judged.cells[DIRECTION_COLUMN].text in (REPLICATED, REVERSED):  # resolved: nothing to size
            judged.cells[-2:] = [Cell(), Cell()]
    return read, missing


def claim_row(judged: ClaimVerdict, found: ClaimEvidence) -> Row:
    cells = list(judged.cells)
    if len(cells) == 2:  # no shared samples
        cells += [Cell(text="no shared samples")] + [Cell()] * (len(CLAIM_HEADS) - 3)
    pairs = len(found.measured) + len(found.versus)
    cells[CLAIM_HEADS.index("Pairs")] = Cell(count=(pairs, len(found.scoped) + len(found.versus_scoped)))
    return Row([judged.claim.name], [cell if cell is not None else Cell() for cell in cells])


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
    read, missing = claim_verdicts(reproduction, backbone)
    if not read:
        return None
    rows = [claim_row(judged, found) for judged, found in read]
    caption = f"The paper's comparative claims on {backbone_name(backbone)}'s results."
    if backbone not in PAPER_BACKBONES:
        caption += (
            f" {backbone_name(backbone)} is not a backbone of the paper: only its comparative claims are "
            "checked, their size on the share of the compression's loss recovered, never its absolute "
            "numbers."
        )
    table = _table("claims", backbone, caption, ["Claim"], CLAIM_HEADS, rows)
    directions = (REPLICATED, HOLM_UNRESOLVED, UNRESOLVED, REVERSED, NO_INFORMATION)
    sizes = (CONSISTENT, SMALLER, LARGER, NOT_COMPARABLE, NO_FULL, NO_LOSS, UNBOUNDED, NO_INFORMATION)
    table.notes = [
        f"Direction: {_tally(rows, DIRECTION_COLUMN, directions)}. Size: {_tally(rows, SIZE_COLUMN, sizes)}.",
        *PLAIN_READING,
        READING,
        SHARE_READING,
        "Pairs: the claim's +ResKV pairs in these results (any length) / in the paper; a claim without "
        "a number in the text takes the paper's mean over all of its pairs, covered here or not.",
        *(
            f"{judged.claim.name}: covers {', '.join(_pair_names(found.covered, reproduction.index))} of the "
            f"paper's {len(found.scoped)}."
            for judged, found in read
            if judged.claim.scope.table in (CAM_TABLE, ABLATION_TABLE)
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


@dataclass(frozen=True)
class RoundsNeeded:
    """A claim whose direction the results leave unresolved: the samples per task it has, and the
    samples per task a paired t test needs to resolve the observed gain and the paper's (None where
    there is no gain or spread to size on); ``rounds``: the more rounds (one sample per task each)
    the larger of the two asks."""

    backbone: str
    claim: str
    direction: str
    samples: int
    observed: int | None
    paper: int | None

    @property
    def rounds(self) -> int | None:
        asked = [needed for needed in (self.observed, self.paper) if needed is not None]
        return max(0, max(asked) - self.samples) if asked else None


def rounds_needed(results_dir: str | Path) -> list[RoundsNeeded]:
    """Every claim of the results under ``results_dir`` (reads ``<results_dir>/runs``) whose
    direction is unresolved (or carries no information), with the samples per task that would
    resolve it: what the dry run reports as rounds still to run."""
    index, _ = ResultIndex.from_directory(Path(results_dir) / "runs")
    reproduction = Reproduction(index, paper_numbers())
    found = []
    for backbone in sorted(set(index.configs["backbone"])):
        for judged, _ in claim_verdicts(reproduction, backbone)[0]:
            shown = judged.cells[DIRECTION_COLUMN].text if len(judged.cells) > DIRECTION_COLUMN else ""
            if shown in (UNRESOLVED, HOLM_UNRESOLVED, NO_INFORMATION) and judged.found is not None:
                found.append(RoundsNeeded(backbone, judged.claim.name, shown, judged.samples, *judged.needed))
    return found


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
                cells = _gain_cells(pair.gain, measured.gain.value, [measured.gain.member])
                other = f"vs {reproduction.index.method_name(pair.other.method)}"
                rows.append(Row([*_stub(pair.reskv, length), other], cells))
    if not rows:
        return None
    caption = f"The paper's +ResKV pairs on {backbone_name(backbone)}: its gain against the reproduced one."
    table = _table("pairs", backbone, caption, [*STUB_HEADS, "+ResKV"], GAIN_HEADS, _grouped(rows))
    directions = (REPLICATED, UNRESOLVED, REVERSED, NO_INFORMATION)
    table.notes = [
        f"Direction: {_tally(rows, GAIN_HEADS.index('Direction'), directions)}. Size: "
        f"{_tally(rows, GAIN_HEADS.index('Size'), (CONSISTENT, SMALLER, LARGER, NO_INFORMATION))}.",
        *PLAIN_READING,
        READING,
        "Each pair is read alone (no family adjustment); Needed: for the paper's gain.",
    ]
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
            found = mean_of_means([measured.member], SCORE_RANGE)
            low, high = _interval(found.low, found.high)
            cells = [
                Cell(cell.value),
                Cell(measured.value),
                Cell(text=interval_text(low, high)),
                Cell(round(measured.value - cell.value, 2)),
                Cell(text=found.samples_text),
                Cell(text=WITHIN if low <= cell.value <= high else OUTSIDE),
            ]
            rows.append(Row([*_stub(cell, length), reproduction.index.method_name(cell.method)], cells))
    if not rows:
        return None
    caption = f"The paper's numbers on {backbone_name(backbone)} against the reproduced ones."
    table = _table("cells", backbone, caption, [*STUB_HEADS, "Method"], CELL_HEADS, _grouped(rows))
    table.notes = [
        f"Cells: {_tally(rows, 5, (WITHIN, OUTSIDE))} the reproduced value's 95% interval (studentized "
        "bootstrap over prompts, resampled within each task, tasks weighted as the tables average them; "
        "the exact bound where too few samples differ). One seed, greedy decoding; the paper's own sample "
        "counts are unknown, so its values carry an error of their own that no interval here shows."
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
