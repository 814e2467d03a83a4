"""The paper's published numbers as data: every cell of its four result tables, and its comparative
claims, each with its source (``reskv-paper.tex``: a cell's table label, a claim's sentence).

    from scripts.report.paper_numbers import paper_numbers
    paper = paper_numbers()          # PaperNumbers: .cells, .claims, .pairs()

The tables: ``tab:ruler_paper`` and ``tab:longbench_paper`` (averages per backbone, length, retained
budget, setting and method, and the full cache), ``tab:snapkv_cam_reskv_tasks`` (SnapKV, +CaM and
+ResKV per task) and ``tab:ablation_main`` (ResKV and its ablations per task). A cell is named as the
results name a configuration (``scripts.harness.store.ResultKey``: backbone, benchmark, length,
setting, method label, ratio) plus its task, None for a benchmark average. The ablation table's
drops in parentheses are not stored: they are the pairs' gains (``PaperPair.gain``), which
``tests/test_paper_numbers.py`` checks against the printed ones.

A length the paper does not state is None: LongBench's (the harness truncates as each backbone's
config says) and the RULER tasks of the CaM table (the paper names RULER-4K for its ablation only).

A claim names the pairs of one table it speaks of (``Scope``) and either states its value (a mean
gain in points, or pairs won of pairs) or, where the text gives no number ("ResKV gives stronger
gains" than CaM), takes it from all of the table's pairs it speaks of, whichever a run covers. A
*contrast* ("improvements are also larger in the query-agnostic setting") is the mean gain over its
scope less the mean gain over the pairs it is set against (``versus``).

The prose claims left out, and why: "CaM's gains are less stable" compares CaM with SnapKV, no
+ResKV pair, and names no measure of stability; the task-level sentences ("task-level gains
concentrate on Variable Tracking, FWE, ...", "most visible on code and retrieval-oriented tasks")
speak of the appendix's task tables, which these data do not hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from scripts.harness.records import MethodLabel
from scripts.report.paper_tables import ABLATIONS

LLAMA, QWEN = "llama3.1-8b-instruct", "qwen2.5-7b-instruct"
PAPER_BACKBONES = (LLAMA, QWEN)
RULER_TABLE, LONGBENCH_TABLE = "tab:ruler_paper", "tab:longbench_paper"
CAM_TABLE, ABLATION_TABLE = "tab:snapkv_cam_reskv_tasks", "tab:ablation_main"
# The budget columns of the averages tables, 10%, 20%, 30%, 40% retained, as compression ratios.
RATIOS = (0.9, 0.8, 0.7, 0.6)

# tab:ruler_paper, row by row: (setting, method) -> LLaMA-3.1-8B 4K, 32K, Qwen-2.5-7B 4K, 32K, each at
# the four RATIOS; the full cache per (backbone, length).
RULER_COLUMNS = tuple(
    (backbone, length, ratio) for backbone in PAPER_BACKBONES for length in (4096, 32768) for ratio in RATIOS
)
RULER_FULL = {(LLAMA, 4096): 95.25, (LLAMA, 32768): 88.57, (QWEN, 4096): 93.57, (QWEN, 32768): 84.91}
RULER_ROWS = {
    ("aware", "adakv"): (
        *(58.94, 75.44, 82.42, 86.04, 72.20, 81.90, 86.06, 87.46),
        *(27.03, 44.07, 54.74, 63.23, 38.57, 45.11, 49.33, 54.88),
    ),
    ("aware", "adakv+reskv"): (
        *(70.51, 83.34, 86.37, 88.34, 77.84, 86.14, 87.83, 88.51),
        *(28.31, 44.84, 57.37, 63.92, 39.85, 46.04, 49.69, 55.01),
    ),
    ("aware", "snapkv"): (
        *(56.37, 71.50, 78.76, 82.66, 69.14, 78.67, 83.18, 86.00),
        *(27.09, 43.08, 51.88, 58.75, 37.78, 42.75, 45.64, 48.30),
    ),
    ("aware", "snapkv+reskv"): (
        *(60.74, 75.59, 80.10, 83.31, 70.31, 78.92, 83.14, 86.50),
        *(28.50, 45.70, 55.64, 60.39, 38.79, 43.74, 46.25, 48.62),
    ),
    ("agnostic", "adakv"): (
        *(21.52, 39.11, 50.55, 60.74, 26.92, 38.23, 52.57, 64.27),
        *(18.38, 26.38, 33.41, 39.43, 25.91, 29.45, 33.89, 36.81),
    ),
    ("agnostic", "adakv+reskv"): (
        *(29.66, 52.47, 65.32, 73.01, 32.74, 47.47, 63.55, 74.30),
        *(19.31, 28.03, 36.92, 45.49, 27.19, 30.90, 35.19, 39.88),
    ),
    ("agnostic", "snapkv"): (
        *(19.38, 34.23, 44.47, 53.45, 24.45, 31.07, 38.59, 47.66),
        *(16.81, 25.42, 30.56, 34.99, 25.09, 28.77, 31.27, 32.99),
    ),
    ("agnostic", "snapkv+reskv"): (
        *(24.89, 40.58, 49.46, 57.53, 27.52, 32.79, 39.51, 47.91),
        *(19.03, 27.49, 33.21, 39.85, 25.84, 29.65, 31.62, 33.89),
    ),
}

# tab:longbench_paper: LLaMA-3.1-8B, Qwen-2.5-7B at the four RATIOS (16 English tasks averaged).
LONGBENCH_COLUMNS = tuple((backbone, None, ratio) for backbone in PAPER_BACKBONES for ratio in RATIOS)
LONGBENCH_FULL = {(LLAMA, None): 48.93, (QWEN, None): 48.14}
LONGBENCH_ROWS = {
    ("aware", "adakv"): (45.64, 47.25, 48.06, 48.18, 42.26, 44.88, 46.10, 46.70),
    ("aware", "adakv+reskv"): (47.39, 48.45, 48.71, 48.81, 42.52, 45.09, 46.49, 47.01),
    ("aware", "snapkv"): (44.59, 47.07, 47.61, 47.99, 42.16, 44.70, 46.05, 46.50),
    ("aware", "snapkv+reskv"): (45.66, 47.52, 48.06, 48.44, 42.82, 45.57, 46.48, 47.08),
    ("agnostic", "adakv"): (36.26, 42.10, 44.78, 45.95, 33.28, 38.86, 41.97, 43.84),
    ("agnostic", "adakv+reskv"): (38.62, 43.99, 46.23, 47.16, 35.63, 41.45, 43.18, 44.95),
    ("agnostic", "snapkv"): (34.79, 40.63, 43.67, 45.17, 33.22, 39.02, 42.08, 43.98),
    ("agnostic", "snapkv+reskv"): (35.79, 41.33, 44.58, 45.92, 35.24, 40.51, 42.64, 44.60),
}

# tab:snapkv_cam_reskv_tasks: Qwen-2.5-7B, 10% retained, query-agnostic; NrtvQA, HotpotQA, RB-P, FWE,
# S-1, QA-1.
CAM_WHERE = (QWEN, "agnostic", 0.9)
CAM_TASKS = (
    ("longbench", None, "narrativeqa"),
    ("longbench", None, "hotpotqa"),
    ("longbench", None, "repobench-p"),
    ("ruler", None, "fwe"),
    ("ruler", None, "niah_single_1"),
    ("ruler", None, "qa_1"),
)
CAM_ROWS = {
    "snapkv": (19.43, 36.48, 56.82, 57.07, 19.20, 20.80),
    "cam": (20.27, 34.98, 56.98, 55.47, 17.60, 18.40),
    "snapkv+reskv": (22.59, 40.59, 59.66, 68.80, 43.20, 24.00),
}

# tab:ablation_main: LLaMA-3.1-8B, SnapKV, 10% retained, query-agnostic; S1 and VT of RULER-4K, Gov.
# and Repo of LongBench. Rows by scripts.report.paper_tables.ABLATIONS' names.
ABLATION_WHERE = (LLAMA, "agnostic", 0.9)
ABLATION_TASKS = (
    ("ruler", 4096, "niah_single_1"),
    ("ruler", 4096, "vt"),
    ("longbench", None, "gov_report"),
    ("longbench", None, "repobench-p"),
)
ABLATION_LABELS = {name: str(MethodLabel("snapkv" + RESIDUAL_SUFFIX, options)) for name, options in ABLATIONS}
ABLATION_ROWS = {
    "ResKV": (67.20, 45.92, 25.33, 50.86),
    "w/o validation": (63.20, 38.88, 25.09, 50.66),
    "w/o dynamic gate": (62.40, 41.44, 25.13, 50.41),
    "w/o shared softmax": (64.00, 43.84, 25.21, 47.86),
}


@dataclass(frozen=True)
class PaperCell:
    """One number of a table: a configuration's average (``task`` None) or task score, in percent."""

    table: str  # the table's label in the paper: the number's source
    backbone: str
    benchmark: str
    length: int | None  # None: the paper states none
    setting: str | None  # None for the full cache
    method: str  # method label (scripts.harness.records.MethodLabel)
    ratio: float | None  # None for the full cache
    task: str | None  # None: the benchmark's average
    value: float

    @property
    def where(self) -> tuple:
        """Everything but the method and value: the cells a table shows side by side share it."""
        return (self.table, self.backbone, self.benchmark, self.length, self.setting, self.ratio, self.task)


@dataclass(frozen=True)
class PaperPair:
    """A +ResKV cell and a cell the same table shows beside it: in the averages tables its baseline,
    in the CaM and ablation tables every other row."""

    other: PaperCell
    reskv: PaperCell

    @property
    def gain(self) -> float:
        """+ResKV minus the other, in points (two decimals, as the paper's own differences)."""
        return round(self.reskv.value - self.other.value, 2)

    @property
    def template(self) -> tuple:
        """What a pair of any backbone and length must match: benchmark, setting, ratio, task, labels."""
        cell = self.reskv
        return (
            cell.table,
            cell.benchmark,
            cell.setting,
            cell.ratio,
            cell.task,
            self.other.method,
            cell.method,
        )


@dataclass(frozen=True)
class Scope:
    """The pairs of ``table`` a claim speaks of; a None filter admits every value."""

    table: str
    settings: tuple[str, ...] | None = None
    ratios: tuple[float, ...] | None = None
    others: tuple[str, ...] | None = None  # method labels +ResKV is compared with
    tasks: tuple[str, ...] | None = None

    def admits(self, pair: PaperPair) -> bool:
        cell = pair.reskv
        return (
            cell.table == self.table
            and (self.settings is None or cell.setting in self.settings)
            and (self.ratios is None or cell.ratio in self.ratios)
            and (self.others is None or pair.other.method in self.others)
            and (self.tasks is None or cell.task in self.tasks)
        )


@dataclass(frozen=True)
class PaperClaim:
    """A comparative claim: the mean gain of +ResKV over its scope's pairs (``gain``, points) or the
    pairs it wins (``share``); ``stated`` is the text's number (points, or won and of), None where the
    text gives none and the table's pairs say it."""

    name: str  # as the verdict's rows show it
    statement: str  # the sentence(s) of the paper, verbatim: the claim's source
    kind: Literal["gain", "share", "contrast"]
    scope: Scope
    stated: float | tuple[int, int] | None = None
    versus: Scope | None = None  # a contrast's other side


RULER_SENTENCE = (
    "ResKV improves 63 of the 64 displayed RULER configurations, with an average gain of 3.38 points "
    "across 4K and 32K contexts and both backbones."
)
RULER_SETTING_SENTENCE = (
    "The improvement is particularly clear in the query-agnostic setting, where the cache is compressed "
    "before the future query is available: ResKV improves this setting by 4.54 points on average, "
    "compared with 2.22 points under query-aware construction."
)
RULER_BUDGET_SENTENCE = (
    "Under constrained cache budgets, ResKV improves the corresponding baseline by 3.47 and 3.66 points "
    r"at 10\% and 20\% retained KV."
)
LONGBENCH_SENTENCE = (
    "ResKV improves all 32 displayed LongBench configurations, with an average gain of 1.02 points on "
    "LLaMA and Qwen."
)
LONGBENCH_BUDGET_SENTENCE = (
    r"The gains are strongest under tight budgets: at 10\% and 20\% retained KV, ResKV improves the "
    "corresponding baseline by 1.43 and 1.17 points."
)
LONGBENCH_SETTING_SENTENCE = (
    "Improvements are also larger in the query-agnostic setting, which better matches practical serving "
    "because the cache is compressed before the next user query is known."
)
CAM_SENTENCE = (
    "CaM can recover useful omitted information on some tasks, but its gains are less stable. ResKV "
    "gives stronger gains by storing omitted information in a separate residual cache while leaving the "
    "main cache unchanged."
)
ABLATION_SENTENCE = "Complete ResKV performs best on all evaluated tasks."
ABLATION_DROPS_SENTENCE = (
    "Removing the validation proxy reduces S1 and VT by 4.00 and 7.04 points, while removing the "
    "dynamic gate reduces them by 4.80 and 4.48 points."
)
SHARED_SOFTMAX_SENTENCE = (
    "Replacing the shared softmax with separate main and residual normalizations reduces RepoBench-P "
    "by 3.00 points."
)


def _ablation_drop(name: str, ablation: str, task: str, stated: float, statement: str) -> PaperClaim:
    scope = Scope(ABLATION_TABLE, others=(ABLATION_LABELS[ablation],), tasks=(task,))
    return PaperClaim(name, statement, "gain", scope, stated)


CLAIMS = (
    PaperClaim("RULER: configurations improved", RULER_SENTENCE, "share", Scope(RULER_TABLE), (63, 64)),
    PaperClaim("RULER: mean gain", RULER_SENTENCE, "gain", Scope(RULER_TABLE), 3.38),
    PaperClaim(
        "RULER q-Agnostic: mean gain",
        RULER_SETTING_SENTENCE,
        "gain",
        Scope(RULER_TABLE, settings=("agnostic",)),
        4.54,
    ),
    PaperClaim(
        "RULER q-Aware: mean gain",
        RULER_SETTING_SENTENCE,
        "gain",
        Scope(RULER_TABLE, settings=("aware",)),
        2.22,
    ),
    PaperClaim(
        "RULER 10%: mean gain", RULER_BUDGET_SENTENCE, "gain", Scope(RULER_TABLE, ratios=(0.9,)), 3.47
    ),
    PaperClaim(
        "RULER 20%: mean gain", RULER_BUDGET_SENTENCE, "gain", Scope(RULER_TABLE, ratios=(0.8,)), 3.66
    ),
    PaperClaim(
        "LongBench: configurations improved", LONGBENCH_SENTENCE, "share", Scope(LONGBENCH_TABLE), (32, 32)
    ),
    PaperClaim("LongBench: mean gain", LONGBENCH_SENTENCE, "gain", Scope(LONGBENCH_TABLE), 1.02),
    PaperClaim(
        "LongBench 10%: mean gain",
        LONGBENCH_BUDGET_SENTENCE,
        "gain",
        Scope(LONGBENCH_TABLE, ratios=(0.9,)),
        1.43,
    ),
    PaperClaim(
        "LongBench 20%: mean gain",
        LONGBENCH_BUDGET_SENTENCE,
        "gain",
        Scope(LONGBENCH_TABLE, ratios=(0.8,)),
        1.17,
    ),
    PaperClaim(
        "RULER: q-Agnostic gain above q-Aware",
        RULER_SETTING_SENTENCE,
        "contrast",
        Scope(RULER_TABLE, settings=("agnostic",)),
        round(4.54 - 2.22, 2),  # the two means the sentence states
        Scope(RULER_TABLE, settings=("aware",)),
    ),
    PaperClaim(
        "LongBench: q-Agnostic gain above q-Aware",
        LONGBENCH_SETTING_SENTENCE,
        "contrast",
        Scope(LONGBENCH_TABLE, settings=("agnostic",)),
        versus=Scope(LONGBENCH_TABLE, settings=("aware",)),
    ),
    PaperClaim(
        "LongBench: gain at 10-20% above 30-40%",
        LONGBENCH_BUDGET_SENTENCE,
        "contrast",
        Scope(LONGBENCH_TABLE, ratios=(0.9, 0.8)),
        versus=Scope(LONGBENCH_TABLE, ratios=(0.7, 0.6)),
    ),
    PaperClaim("CaM table: +ResKV over +CaM", CAM_SENTENCE, "gain", Scope(CAM_TABLE, others=("cam",))),
    PaperClaim(
        "CaM table: +ResKV above +CaM on every task", CAM_SENTENCE, "share", Scope(CAM_TABLE, others=("cam",))
    ),
    PaperClaim("CaM table: +ResKV over SnapKV", CAM_SENTENCE, "gain", Scope(CAM_TABLE, others=("snapkv",))),
    PaperClaim("Ablations: ResKV best on every task", ABLATION_SENTENCE, "share", Scope(ABLATION_TABLE)),
    _ablation_drop(
        "w/o validation: S1 drop", "w/o validation", "niah_single_1", 4.00, ABLATION_DROPS_SENTENCE
    ),
    _ablation_drop("w/o validation: VT drop", "w/o validation", "vt", 7.04, ABLATION_DROPS_SENTENCE),
    _ablation_drop(
        "w/o dynamic gate: S1 drop", "w/o dynamic gate", "niah_single_1", 4.80, ABLATION_DROPS_SENTENCE
    ),
    _ablation_drop("w/o dynamic gate: VT drop", "w/o dynamic gate", "vt", 4.48, ABLATION_DROPS_SENTENCE),
    _ablation_drop(
        "w/o shared softmax: RB-P drop", "w/o shared softmax", "repobench-p", 3.00, SHARED_SOFTMAX_SENTENCE
    ),
)


@dataclass(frozen=True)
class PaperNumbers:
    cells: tuple[PaperCell, ...]
    claims: tuple[PaperClaim, ...]

    def full(self, cell: PaperCell) -> float | None:
        """The full cache's value in ``cell``'s table, backbone, benchmark and length (the averages
        tables give one; the task tables none)."""
        for other in self.cells:
            if other.method == FULL_METHOD and other.where[:4] == cell.where[:4]:
                return other.value
        return None

    def recovered_share(self, pairs: list[PaperPair]) -> float | None:
        """The share of the compression's loss that +ResKV recovers over ``pairs``: their gains' sum
        over their losses' (full cache less the other), None without a full cache or a loss."""
        fulls = [self.full(pair.reskv) for pair in pairs]
        if not pairs or any(full is None for full in fulls):
            return None
        loss = sum(full - pair.other.value for full, pair in zip(fulls, pairs, strict=True))
        return sum(pair.gain for pair in pairs) / loss if loss > 0 else None

    def pairs(self) -> list[PaperPair]:
        """Every +ResKV cell (no options) with each cell its table shows beside it, in table order."""
        pairs = []
        for reskv in self.cells:
            label = MethodLabel.parse(reskv.method)
            if not label.residual or label.options:
                continue
            for other in self.cells:
                beside = other.where == reskv.where and other is not reskv
                if beside and (reskv.task is not None or other.method == label.base):
                    pairs.append(PaperPair(other, reskv))
        return pairs


def _average_cells(table, benchmark, columns, full, rows) -> list[PaperCell]:
    cells = [
        PaperCell(table, backbone, benchmark, length, None, FULL_METHOD, None, None, value)
        for (backbone, length), value in full.items()
    ]
    for (setting, method), values in rows.items():
        for (backbone, length, ratio), value in zip(columns, values, strict=True):
            cells.append(PaperCell(table, backbone, benchmark, length, setting, method, ratio, None, value))
    return cells


def _task_cells(table, where, tasks, rows) -> list[PaperCell]:
    backbone, setting, ratio = where
    return [
        PaperCell(table, backbone, benchmark, length, setting, method, ratio, task, value)
        for method, values in rows.items()
        for (benchmark, length, task), value in zip(tasks, values, strict=True)
    ]


@functools.cache
def paper_numbers() -> PaperNumbers:
    """The paper's four result tables as cells, and its comparative claims."""
    ablation_rows = {ABLATION_LABELS[name]: values for name, values in ABLATION_ROWS.items()}
    cells = [
        *_average_cells(RULER_TABLE, "ruler", RULER_COLUMNS, RULER_FULL, RULER_ROWS),
        *_average_cells(LONGBENCH_TABLE, "longbench", LONGBENCH_COLUMNS, LONGBENCH_FULL, LONGBENCH_ROWS),
        *_task_cells(CAM_TABLE, CAM_WHERE, CAM_TASKS, CAM_ROWS),
        *_task_cells(ABLATION_TABLE, ABLATION_WHERE, ABLATION_TASKS, ablation_rows),
    ]
    return PaperNumbers(tuple(cells), CLAIMS)
