"""The reproduction verdict as data: the paper's published numbers (``scripts.report.paper_numbers``)
beside the results, each claim, +ResKV pair and cell read into a typed record (``ClaimResult``,
``PairResult``, ``CellResult``) with prompt-clustered statistics (``scripts.report.statistics``).
Decisions are made here, on those records; ``scripts.report.verdict_tables`` renders them (part of
``make tables``), the dry run reads ``rounds_needed``, and run.py's end table ``pair_gain``.

A cell or pair of the paper is covered by results of its backbone, benchmark, setting, budget,
method and task (and length, where the paper states one) whose average covers every task the
paper's does; a claim, by any pair of its scope (a partial task set is named by the table's notes).
Values are the tables' own (``scripts.report.index``: a block of rows compared on the samples all of
them scored); the tests and intervals treat the prompt as the unit, every pair and configuration of
the claim on it, tasks weighted as the tables average them.

The two verdicts, never one word for both:

- **direction** (``statistics.direction``): the stratified sign-flip test (``statistics.sign_flip``)
  of the claim's estimate against 0: *replicated* when it rejects on the paper's side, *reversed* on
  the other, *unresolved* otherwise. Over a backbone's gain and contrast claims, which are nested (a
  setting's or budget's pairs are part of the overall row's), Holm's step-down adjustment holds the
  family's error rate at 5%: a row the test rejects alone but not after Holm is *unresolved (Holm)*.
  A test that cannot reach 5% (fewer than 6 prompts differ) can never reject and is left out of the
  family (Tarone, *Biometrics* 46, 1990). *No information*: no prompt differed between the compared
  methods (a floor or a ceiling); its interval is the exact bound, never zero-width evidence;
- **size** (``statistics.size``): the paper's value inside the interval (*consistent*), above it
  (*smaller than the paper's*) or below it (*larger than the paper's*). On a backbone the paper did
  not run, the paper's value is its share of the compression's loss recovered,
  ``(+ResKV - base) / (full - base)`` from its own tables, times the loss measured here (*the paper
  here*, points): a claim's size is never the paper's points on another model.

Counts read honestly: configurations whose outputs are identical on every sample (``ResultIndex.twins``:
SnapKV and AdaKV on a model with one KV head) are one configuration in every count (pairs, cells,
gains and losses, configurations improved) and are named under the tables; the estimate stays the
tables' mean over all pairs, and the test, which flips a prompt as a whole, is not moved by them.
"Configurations improved" and "best on every task" are counted, not tested: a count of configurations
sharing prompts has no test here. The samples per task a paired t test would need (``rounds_needed``,
for the dry run) are *not estimable* from fewer than ``NEEDED_MIN_PROMPTS`` differing prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from scripts.harness.records import MethodLabel
from scripts.report.index import ResultIndex
from scripts.report.names import averaged_task_set
from scripts.report.paper_numbers import (
    PAPER_BACKBONES,
    PaperCell,
    PaperClaim,
    PaperNumbers,
    PaperPair,
    paper_numbers,
)
from scripts.report.statistics import (
    CONSISTENT,
    EXACT,
    EXACT_LIMIT,
    LARGER,
    NEEDED_MIN_PROMPTS,
    NO_INFORMATION,
    REPLICATED,
    REVERSED,
    SEED,
    SMALLER,
    UNRESOLVED,
    Estimate,
    Member,
    PromptTable,
    Ratio,
    direction,
    gain_estimate,
    holm,
    mean_of_means,
    ratio_estimate,
    samples_needed,
    score_differences,
    score_estimate,
    size,
)

WITHIN, OUTSIDE = "within", "outside"
NOT_COMPARABLE, NO_LOSS, NO_FULL = "not comparable", "no loss to recover", "no full-cache run"
UNBOUNDED = "unbounded"  # fewer than 6 prompts differ: the exact bound, too wide to size against
HOLM_UNRESOLVED = UNRESOLVED + " (Holm)"
NOT_ESTIMABLE = "not estimable"
LL_GAP = "quality.answer_log_prob_gap"  # reskv.quality: the answer's log-likelihood less the full cache's
DIRECTIONS = (REPLICATED, HOLM_UNRESOLVED, UNRESOLVED, REVERSED, NO_INFORMATION)
SIZES = (CONSISTENT, SMALLER, LARGER, UNBOUNDED, NOT_COMPARABLE, NO_FULL, NO_LOSS, NO_INFORMATION)


@dataclass(frozen=True)
class Measured:
    """A cell or pair of the results: its value as the tables show it and its per-sample values
    (points) per stratum, for ``statistics.PromptTable``."""

    value: float
    member: Member


@dataclass(frozen=True)
class MeasuredPair:
    """A +ResKV pair of the results: its gain, per stratum the base's loss to the full cache (points)
    and the log-likelihood gaps' difference and the base's gap (None where not recorded), and
    ``identity``: where it lies and the configurations it compares, twins (``ResultIndex.twins``)
    named by their group's first label: two pairs of one identity are one pair counted twice."""

    gain: Measured
    loss: Member | None
    ll_gain: Member | None
    ll_loss: Member | None
    identity: tuple


class Reproduction:
    """The results measured as the paper's tables measure them, block by block (cached)."""

    def __init__(self, index: ResultIndex, paper: PaperNumbers):
        self.index = index
        self.paper = paper
        self.pairs = paper.pairs()
        self._measured: dict[tuple, Measured | None] = {}
        self._evidence: dict[tuple, ClaimEvidence | None] = {}
        self._inputs: dict[tuple, GainInputs] = {}

    def evidence(self, claim: PaperClaim, backbone: str) -> ClaimEvidence | None:
        """``evidence`` of ``claim`` on ``backbone`` (cached)."""
        if (claim.name, backbone) not in self._evidence:
            self._evidence[claim.name, backbone] = evidence(self, claim, backbone)
        return self._evidence[claim.name, backbone]

    def gain_inputs(self, claim: PaperClaim, backbone: str) -> GainInputs:
        """``gain_inputs`` of a gain or contrast ``claim`` the results of ``backbone`` cover (cached):
        what its tests, under any seed, read."""
        if (claim.name, backbone) not in self._inputs:
            self._inputs[claim.name, backbone] = gain_inputs(self, claim, self.evidence(claim, backbone))
        return self._inputs[claim.name, backbone]

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
            value = compared[cell.method].get(cell.task)
            value = value.value if value is not None else None
        if value is None:
            return None
        member = {
            (backbone, cell.benchmark, length, task): 100 * scores[task][1][cell.method]
            for task in self._tasks(cell, backbone, length)
        }
        return Measured(value, member)

    def twin(self, backbone: str, benchmark: str, length: int, cell: PaperCell) -> str:
        """``cell``'s method label, or the first label of its twins' group (``ResultIndex.twins``)."""
        ratio = 0.0 if cell.ratio is None else round(float(cell.ratio), 6)
        key = (backbone, benchmark, length, cell.setting or "", ratio, cell.method)
        return self.index.twins().get(key, cell.method)

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
        identity = (
            *where,
            pair.reskv.task,
            *(self.twin(backbone, benchmark, length, cell) for cell in (pair.reskv, pair.other)),
        )
        return MeasuredPair(gain, loss, ll_gain, ll_loss, identity)


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
class Counts:
    """What a row's evidence holds, twins counted once: its +ResKV pairs (all of them, and distinct),
    the tasks and prompts where the compared methods differ (a prompt differs when its contribution
    to the estimate does), and the distinct pair x prompt cells that differ, as gains and losses."""

    pairs: int
    distinct_pairs: int
    tasks: tuple[int, int]
    prompts: tuple[int, int]
    cells: int  # distinct pair x prompt cells
    gains: int
    losses: int

    @property
    def differing_cells(self) -> int:
        return self.gains + self.losses


def counts(table: PromptTable, identities: list[tuple], found: Estimate) -> Counts:
    """``Counts`` of the estimate ``found`` of ``table``, whose members are pairs of ``identities``."""
    firsts: dict[tuple, int] = {}  # each identity's first member: its twins count once
    for number, identity in enumerate(identities):
        firsts.setdefault(identity, number)
    first = sorted(firsts.values())
    cells = gains = losses = 0
    for matrix, weights in zip(table.values, table.weights, strict=True):
        present = matrix[:, [number for number in first if weights[number] > 0]]
        cells += present.size
        gains += int(np.count_nonzero(present > 0))
        losses += int(np.count_nonzero(present < 0))
    return Counts(
        len(identities), len(first), found.informative_strata, found.differing_prompts, cells, gains, losses
    )


@dataclass(frozen=True)
class Improved:
    """A count claim's pairs, twins once: won (a positive gain as the tables show it), lost, level."""

    won: int
    lost: int
    level: int
    pairs: int  # with twins

    @property
    def distinct(self) -> int:
        return self.won + self.lost + self.level


@dataclass(frozen=True)
class Needed:
    """Samples per task a paired t test would need to resolve the observed gain and the paper's: a
    number, None where there is nothing to size (no gain), ``NOT_ESTIMABLE`` where fewer than
    ``NEEDED_MIN_PROMPTS`` prompts differ; ``unit`` says the paper's is its points, not its share."""

    observed: int | str | None = None
    paper: int | str | None = None
    unit: str = ""


@dataclass(frozen=True)
class ClaimResult:
    """A claim of the paper read on one backbone's results: the paper's value (points, or pairs won
    of pairs), the reproduced one as the tables show it, its estimate (interval and test), the Holm-
    adjusted p-value, the two verdicts, counts and twins, the shares of the loss recovered (the paper's,
    the reproduced one, the log-likelihood's with its interval), the paper's gain as this backbone
    would show it (points), the samples needed and which tasks carry the estimate. A count claim
    (``improved``) has no estimate, test or verdict."""

    claim: PaperClaim
    paper: float | tuple[int, int]
    reproduced: float | None = None
    estimate: Estimate | None = None
    counts: Counts | None = None
    improved: Improved | None = None
    holm_p: float | None = None
    direction: str = ""
    size: str = ""
    recovered_paper: float | None = None
    recovered: Ratio | None = None
    ll_recovered: Ratio | None = None
    paper_here: float | None = None
    needed: Needed = Needed()
    carried_by: str = ""
    samples: tuple[int, int] = (0, 0)  # fewest and most samples per task

    @property
    def in_family(self) -> bool:
        """Whether the row's test can reject, so that it counts in the Holm family."""
        return self.estimate is not None and self.estimate.p_value is not None


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


def needed(found: Estimate, gain: float | None) -> int | str | None:
    """``samples_needed`` for ``gain`` at ``found``'s spread; ``NOT_ESTIMABLE`` where the spread rests
    on fewer than ``NEEDED_MIN_PROMPTS`` differing prompts."""
    if found.differing_prompts[0] < NEEDED_MIN_PROMPTS:
        return NOT_ESTIMABLE
    return None if gain is None else samples_needed(found.spread, gain)


def _ratio(numerators: list[Member | None], denominators: list[Member | None]) -> Ratio | None:
    """The share of a loss recovered over pairs (``statistics.ratio_estimate``); None where a pair
    lacks what it needs."""
    if not numerators or any(member is None for member in numerators + denominators):
        return None
    return ratio_estimate(numerators, denominators)


def _mean_loss(losses: list[Member | None]) -> float | None:
    if not losses or any(member is None for member in losses):
        return None
    table = PromptTable.of(losses)
    return None if table is None else float(sum(values.mean() for values in table.combined()))


@dataclass(frozen=True)
class GainInputs:
    """What a gain or contrast claim's evidence measures, before any test: the paper's value and the
    reproduced one as the tables show them (points), the pairs' prompts and the contrast's
    coefficients (None for a gain), the shares of the loss recovered (the paper's, the reproduced one,
    the log-likelihood's) and the mean loss to the full cache (points; None without a full cache)."""

    paper: float
    shown: float
    table: PromptTable | None
    coefficients: np.ndarray | None
    identities: list[tuple]
    recovered_paper: float | None = None
    recovered: Ratio | None = None
    ll_recovered: Ratio | None = None
    loss: float | None = None


def gain_inputs(reproduction: Reproduction, claim: PaperClaim, found: ClaimEvidence) -> GainInputs:
    """``GainInputs`` of a gain or contrast claim."""
    pairs = found.measured + found.versus
    count, against = len(found.measured), len(found.versus)
    coefficients = None
    paper_gain = claim.stated
    values = [pair.gain.value for pair in pairs]
    if claim.kind == "contrast":
        total = count + against
        coefficients = np.array([total / count] * count + [-total / against] * against)
        if paper_gain is None:
            paper_gain = float(
                np.mean([p.gain for p in found.scoped]) - np.mean([p.gain for p in found.versus_scoped])
            )
        shown = float(np.mean(values[:count]) - np.mean(values[count:]))
    else:
        if paper_gain is None:
            paper_gain = float(np.mean([pair.gain for pair in found.scoped]))
        shown = float(np.mean(values))
    table = PromptTable.of([pair.gain.member for pair in pairs])
    inputs = GainInputs(
        round(paper_gain, 2), round(shown, 2), table, coefficients, [pair.identity for pair in pairs]
    )
    if claim.kind != "gain" or table is None:
        return inputs
    return replace(
        inputs,
        recovered_paper=reproduction.paper.recovered_share(found.scoped),
        recovered=_ratio([p.gain.member for p in found.measured], [p.loss for p in found.measured]),
        ll_recovered=_ratio([p.ll_gain for p in found.measured], [p.ll_loss for p in found.measured]),
        loss=_mean_loss([p.loss for p in found.measured]),
    )


def judge_gain(
    claim: PaperClaim, backbone: str, inputs: GainInputs, seed: int = SEED, exact_limit: int = EXACT_LIMIT
) -> ClaimResult:
    """A gain or contrast claim, before the family's Holm adjustment (``seed`` and ``exact_limit``: its
    test's, ``statistics.sign_flip``)."""
    paper_gain, table = inputs.paper, inputs.table
    if table is None:
        return ClaimResult(claim, paper_gain, inputs.shown)
    result = gain_estimate(table, inputs.coefficients, seed, exact_limit)
    low, high = round(result.low, 2), round(result.high, 2)
    on_paper_backbone = backbone in PAPER_BACKBONES
    paper_here = None
    if on_paper_backbone:
        paper_here, judged_size = paper_gain, size(paper_gain, low, high)
    elif claim.kind == "contrast" or inputs.recovered_paper is None:  # no share to carry to this backbone
        judged_size = NOT_COMPARABLE
    elif inputs.loss is None:
        judged_size = NO_FULL
    elif inputs.loss <= 0:
        judged_size = NO_LOSS
    else:
        paper_here = round(inputs.recovered_paper * inputs.loss, 2)
        judged_size = size(paper_here, low, high)
    if result.no_information:
        verdicts = (NO_INFORMATION, NO_INFORMATION)
    else:
        if result.kind == EXACT and judged_size in (CONSISTENT, SMALLER, LARGER):
            judged_size = UNBOUNDED
        verdicts = (direction(paper_gain, result.value, result.p_value), judged_size)
    # The samples the paper's gain needs: as this backbone would show it, or where that cannot be
    # carried over (no full cache, no loss), its points; none for a contrast off the paper's backbones.
    target, unit = (paper_here, "") if paper_here is not None else (paper_gain, " (points)")
    if not on_paper_backbone and claim.kind == "contrast":
        target = None
    return ClaimResult(
        claim,
        paper_gain,
        inputs.shown,
        result,
        counts(table, inputs.identities, result),
        direction=verdicts[0],
        size=verdicts[1],
        recovered_paper=inputs.recovered_paper,
        recovered=inputs.recovered,
        ll_recovered=inputs.ll_recovered,
        paper_here=paper_here,
        needed=Needed(needed(result, result.value), needed(result, target), unit),
        carried_by=carried_by(table, inputs.coefficients),
        samples=table.samples,
    )


def judge_count(claim: PaperClaim, found: ClaimEvidence) -> ClaimResult:
    """Configurations improved (or best on every task): distinct pairs won, lost and level, counted
    and shown beside the paper's count, not tested."""
    paper = claim.stated or (sum(pair.gain > 0 for pair in found.scoped), len(found.scoped))
    distinct = {pair.identity: pair.gain.value for pair in found.measured}
    improved = Improved(
        sum(gain > 0 for gain in distinct.values()),
        sum(gain < 0 for gain in distinct.values()),
        sum(gain == 0 for gain in distinct.values()),
        len(found.measured),
    )
    table = PromptTable.of([pair.gain.member for pair in found.measured])
    return ClaimResult(claim, paper, improved=improved, samples=table.samples if table else (0, 0))


def family(results: list[ClaimResult]) -> list[ClaimResult]:
    """``results`` with the Holm-adjusted p-value and direction of every row whose test can reject
    (``ClaimResult.in_family``), over all of them; a row the test rejects alone but not after Holm
    reads ``unresolved (Holm)``, and a resolved row needs no samples."""
    members = [number for number, result in enumerate(results) if result.in_family]
    adjusted = holm([results[number].estimate.p_value for number in members])
    results = list(results)
    for number, p_value in zip(members, adjusted, strict=True):
        result = results[number]
        judged = direction(result.paper, result.estimate.value, p_value)
        if judged == UNRESOLVED and result.direction in (REPLICATED, REVERSED):
            judged = HOLM_UNRESOLVED
        resolved = judged in (REPLICATED, REVERSED)
        results[number] = replace(
            result, holm_p=p_value, direction=judged, needed=Needed() if resolved else result.needed
        )
    return results


def claim_results(
    reproduction: Reproduction, backbone: str, seed: int = SEED, exact_limit: int = EXACT_LIMIT
) -> tuple[list[tuple[ClaimResult, ClaimEvidence]], list[str]]:
    """Every claim ``backbone``'s results cover, read and Holm-adjusted (``seed`` and ``exact_limit``:
    the tests', ``statistics.sign_flip``); and the names of those not covered."""
    read, missing = [], []
    for claim in reproduction.paper.claims:
        found = reproduction.evidence(claim, backbone)
        if found is None:
            missing.append(claim.name)
            continue
        if claim.kind == "share":
            judged = judge_count(claim, found)
        else:
            inputs = reproduction.gain_inputs(claim, backbone)
            judged = judge_gain(claim, backbone, inputs, seed, exact_limit)
        read.append((judged, found))
    adjusted = family([judged for judged, _ in read])
    return [(judged, found) for judged, (_, found) in zip(adjusted, read, strict=True)], missing


@dataclass(frozen=True)
class PairResult:
    """A +ResKV pair of the paper against its reproduction (points): the paper's gain, the reproduced
    one as the tables show it, its estimate, its verdicts (the pair read alone, no family) and the
    samples per task the paper's gain would need where its direction stays open."""

    pair: PaperPair
    length: int
    paper: float
    reproduced: float
    estimate: Estimate | None
    direction: str = ""
    size: str = ""
    needed: int | str | None = None


def pair_results(reproduction: Reproduction, backbone: str) -> list[PairResult]:
    """Every +ResKV pair of the paper on ``backbone`` (a paper backbone) the results cover."""
    found = []
    for pair in reproduction.pairs:
        if pair.reskv.backbone != backbone:
            continue
        for length in reproduction.lengths(pair.reskv, backbone):
            measured = reproduction.complete(pair.reskv, backbone, length) and reproduction.measure_pair(
                pair, backbone, length
            )
            if not measured:
                continue
            estimate = mean_of_means([measured.gain.member])
            result = PairResult(pair, length, pair.gain, measured.gain.value, estimate)
            if estimate is not None:
                low, high = round(estimate.low, 2), round(estimate.high, 2)
                judged = direction(pair.gain, estimate.value, estimate.p_value)
                sized = UNBOUNDED if estimate.kind == EXACT else size(pair.gain, low, high)
                result = replace(
                    result,
                    direction=NO_INFORMATION if estimate.no_information else judged,
                    size=NO_INFORMATION if estimate.no_information else sized,
                    needed=needed(estimate, pair.gain) if judged != REPLICATED else None,
                )
            found.append(result)
    return found


@dataclass(frozen=True)
class CellResult:
    """A number of the paper's tables against the reproduced one: the reproduced score's estimate
    (Wilson's interval) and whether the paper's value lies within it."""

    cell: PaperCell
    length: int
    reproduced: float
    estimate: Estimate

    @property
    def verdict(self) -> str:
        low, high = round(self.estimate.low, 2), round(self.estimate.high, 2)
        return WITHIN if low <= self.cell.value <= high else OUTSIDE


def cell_results(reproduction: Reproduction, backbone: str) -> list[CellResult]:
    """Every cell of the paper on ``backbone`` (a paper backbone) the results cover."""
    found = []
    for cell in reproduction.paper.cells:
        if cell.backbone != backbone:
            continue
        for length in reproduction.lengths(cell, backbone):
            measured = reproduction.complete(cell, backbone, length) and reproduction.measure(
                cell, backbone, length
            )
            if measured:
                found.append(CellResult(cell, length, measured.value, score_estimate(measured.member)))
    return found


@dataclass(frozen=True)
class RoundsNeeded:
    """A claim whose direction the results leave unresolved: the samples per task it has, and the
    samples per task a paired t test needs to resolve the observed gain and the paper's (None where
    there is no gain to size or the spread is not estimable); ``rounds``: the more rounds (one sample
    per task each) the larger of the two asks."""

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
        for result, _ in claim_results(reproduction, backbone)[0]:
            if (
                result.direction in (UNRESOLVED, HOLM_UNRESOLVED, NO_INFORMATION)
                and result.estimate is not None
            ):
                asked = [
                    value if isinstance(value, int) else None
                    for value in (result.needed.observed, result.needed.paper)
                ]
                found.append(
                    RoundsNeeded(backbone, result.claim.name, result.direction, result.samples[0], *asked)
                )
    return found


@dataclass(frozen=True)
class PairGain:
    """One +ResKV configuration against its baseline on the samples both scored (run.py's end table):
    the estimate of the task-average score difference (points), the direction it settles ("ResKV
    helps": the positive side), and the tasks it covers."""

    estimate: Estimate
    direction: str
    tasks: int


def pair_gain(base: dict, reskv: dict) -> PairGain | None:
    """``PairGain`` of per-task sample scores (fractions by sample index) of a baseline and its
    +ResKV; None without a shared sample."""
    member = score_differences(base, reskv)
    found = mean_of_means([member])
    if found is None:
        return None
    read = NO_INFORMATION if found.no_information else direction(1.0, found.value, found.p_value)
    return PairGain(found, read, len(member))
