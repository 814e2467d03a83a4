"""The paper's tables from the JSON results: LaTeX (booktabs), markdown and CSV.

    python -m scripts.tables [--results-dir results] [--out-dir results/tables]

Tables (each as ``<name>.tex``, ``<name>.md``, ``<name>.csv``; ``tables.tex`` inputs them all):

- ``ruler_averages``, ``longbench_averages`` (tab:ruler_paper, tab:longbench_paper): average score
  per setting x method x backbone x length x retained budget, a full-cache row, bold for the better
  of each baseline / +ResKV pair.
- ``tasks_<backbone>_<benchmark>-<length>`` (the appendix tables): every task and the average per
  budget x setting x method; bold on the better average of each pair.
- ``cam_<backbone>_<ratio>_<setting>`` (tab:snapkv_cam_reskv_tasks): SnapKV, +CaM, +ResKV per
  task; bold on the best of each column.
- ``ablation_<backbone>_<method>_<ratio>_<setting>`` (tab:ablation_main): ResKV and its three
  ablations per task with the drop from ResKV; bold on the best of each column.

Rules every table follows: a configuration that was not run is shown as missing (``--``),
never as 0; a configuration with fewer samples than its task has is marked partial (dagger); a
task whose data is unavailable is shown as ``n/a`` and left out of averages; an average needs
every averaged task of its row, otherwise it is missing. Averages are the unweighted mean of the
task scores shown (each ``round(100 * mean, 2)``), rounded to two decimals; bold compares the
two-decimal values and marks both on a tie. LongBench averages cover its 16 English tasks.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import benchmarks
from baselines import RESIDUAL_SUFFIX
from benchmarks.longbench import ENGLISH_TASKS
from scripts.results_store import FULL_METHOD, TaskResult, load_results

# Baselines with a +ResKV pair, in the paper's row order (AdaKV first), then methods without one.
PAIRED_BASES = ("adakv", "snapkv", "h2o", "tova")
UNPAIRED_METHODS = ("cam",)
METHOD_NAMES = {
    "full": "Full Cache",
    "h2o": "H2O",
    "tova": "TOVA",
    "snapkv": "SnapKV",
    "adakv": "AdaKV",
    "cam": "CaM",
}
SETTING_NAMES = {"aware": "q-Aware", "agnostic": "q-Agnostic"}
BACKBONE_NAMES = {
    "llama3.1-8b-instruct": "LLaMA-3.1-8B",
    "qwen2.5-7b-instruct": "Qwen-2.5-7B",
    "smollm2-135m": "SmolLM2-135M",
    "tiny-llama": "tiny-llama",
    "tiny-qwen2": "tiny-qwen2",
}
BENCHMARK_NAMES = {"ruler": "RULER", "longbench": "LongBench"}
# Column heads; the paper's where it names a task (NrtvQA, RB-P, S-1, ...).
TASK_NAMES = {
    "niah_single_1": "S-1",
    "niah_single_2": "S-2",
    "niah_single_3": "S-3",
    "niah_multikey_1": "MK-1",
    "niah_multikey_2": "MK-2",
    "niah_multikey_3": "MK-3",
    "niah_multivalue": "MV",
    "niah_multiquery": "MQ",
    "vt": "VT",
    "cwe": "CWE",
    "fwe": "FWE",
    "qa_1": "QA-1",
    "qa_2": "QA-2",
    "narrativeqa": "NrtvQA",
    "qasper": "Qasper",
    "multifieldqa_en": "MF-en",
    "hotpotqa": "HotpotQA",
    "2wikimqa": "2WikiMQA",
    "musique": "Musique",
    "gov_report": "Gov.",
    "qmsum": "QMSum",
    "multi_news": "MultiNews",
    "trec": "TREC",
    "triviaqa": "TriviaQA",
    "samsum": "SAMSum",
    "passage_count": "PCount",
    "passage_retrieval_en": "PRe",
    "lcc": "LCC",
    "repobench-p": "RB-P",
    "multifieldqa_zh": "MF-zh",
    "dureader": "DuReader",
    "vcsum": "VCSum",
    "lsht": "LSHT",
    "passage_retrieval_zh": "PRe-zh",
}
# Ablation rows of tab:ablation_main: the method-label suffix run.py gives each ablation switch.
ABLATIONS = (
    ("ResKV", ""),
    ("w/o validation", "~validate=false"),
    ("w/o dynamic gate", "~gate=false"),
    ("w/o shared softmax", "~shared_softmax=false"),
)
DAGGER = r"$^\dagger$"
MISSING_NOTE = "--: not run"
PARTIAL_NOTE = "\u2020: partial (fewer samples than the task has so far)"
UNAVAILABLE_NOTE = "n/a: task data unavailable here, excluded from averages"


def averaged_task_set(benchmark: str) -> tuple[str, ...]:
    """The tasks a benchmark's average is defined over (LongBench: its 16 English tasks)."""
    return tuple(ENGLISH_TASKS) if benchmark == "longbench" else benchmarks.tasks(benchmark)


def retained(ratio: float) -> str:
    """Column head of a compression ratio: the retained share of the KV cache (0.9 -> 10%)."""
    return f"{round((1 - ratio) * 100, 1):g}%"


def backbone_name(backbone: str) -> str:
    return BACKBONE_NAMES.get(backbone, backbone)


def length_name(benchmark: str, length: int) -> str:
    return f"{length // 1024}K" if benchmark == "ruler" and length % 1024 == 0 else str(length)


@dataclass
class Cell:
    """One number of a table; ``value`` None is a missing cell."""

    value: float | None = None
    partial: bool = False
    unavailable: bool = False
    bold: bool = False
    span: int = 1
    delta: float | None = None  # shown in parentheses (ablation drops)


@dataclass
class Row:
    """Stub texts (one per stub column; a single text spans them all) and the data cells."""

    stub: list[str]
    cells: list[Cell]


MIDRULE = "midrule"  # between groups of rows
CMIDRULE = "cmidrule"  # between blocks inside a group (under the data and the last stub column)


@dataclass
class Table:
    name: str
    caption: str
    label: str
    stub_heads: list[str]
    heads: list[list[tuple[str, int]]]  # header rows over the data columns: (text, span)
    body: list[Row | str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def width(self) -> int:
        return sum(span for _, span in self.heads[-1])

    def column_names(self) -> list[str]:
        """One name per data column: its header texts top to bottom."""
        names = [[] for _ in range(self.width)]
        for head in self.heads:
            column = 0
            for text, span in head:
                for index in range(column, column + span):
                    names[index].append(text)
                column += span
        return [" ".join(part for part in parts if part) for parts in names]


def _number(value: float) -> str:
    return f"{value:.2f}"


def cell_text(cell: Cell, style: str) -> str:
    """A cell as LaTeX (``latex``), markdown (``markdown``) or plain text (``csv``)."""
    if cell.unavailable:
        return "n/a"
    if cell.value is None:
        return "" if style == "csv" else "--"
    text = _number(cell.value)
    if cell.bold and style == "latex":
        text = rf"\textbf{{{text}}}"
    elif cell.bold and style == "markdown":
        text = f"**{text}**"
    if cell.partial:
        text += DAGGER if style == "latex" else "\u2020"
    if cell.delta is not None:
        delta = f"({cell.delta:+.2f})"
        text += rf" {{\scriptsize {delta}}}" if style == "latex" else f" {delta}"
    return text


def _stub_rows(table: Table) -> list[list[str]]:
    """Stub texts with a repeat of the row above blanked (the row label reads as a group label)."""
    shown, previous = [], None
    for row in table.body:
        if isinstance(row, str):
            previous = None if row == MIDRULE else previous
            continue
        stub = row.stub + [""] * (len(table.stub_heads) - len(row.stub))
        blanked = list(stub)
        if previous is not None and len(row.stub) > 1:
            for index in range(len(stub) - 1):
                if stub[: index + 1] != previous[: index + 1]:
                    break
                blanked[index] = ""
        shown.append(blanked)
        previous = stub
    return shown


def _escape(text: str) -> str:
    return text.replace("%", r"\%").replace("_", r"\_").replace("&", r"\&").replace("#", r"\#")


def to_latex(table: Table) -> str:
    """A booktabs table (needs booktabs and graphicx)."""
    stubs, data = len(table.stub_heads), table.width
    lines = [
        r"\begin{table*}[t]",
        r"\centering",
        r"\scriptsize",
        r"\setlength{\tabcolsep}{2pt}",
        r"\resizebox{\textwidth}{!}{%",
        rf"\begin{{tabular}}{{@{{}}{'l' * stubs}*{{{data}}}{{c}}@{{}}}}",
        r"\toprule",
    ]
    for level, head in enumerate(table.heads):
        stub_texts = [
            rf"\textbf{{{_escape(text)}}}" if level == len(table.heads) - 1 else ""
            for text in table.stub_heads
        ]
        cells, rules, column = [], [], stubs + 1
        for text, span in head:
            cells.append(
                rf"\multicolumn{{{span}}}{{c}}{{\textbf{{{_escape(text)}}}}}"
                if span > 1
                else rf"\textbf{{{_escape(text)}}}"
            )
            if span > 1:
                rules.append(rf"\cmidrule(lr){{{column}-{column + span - 1}}}")
            column += span
        lines.append(" & ".join(stub_texts + cells) + r" \\")
        if rules:
            lines.append("".join(rules))
    lines.append(r"\midrule")
    stub_rows = iter(_stub_rows(table))
    for row in table.body:
        if row == MIDRULE:
            lines.append(r"\midrule")
        elif row == CMIDRULE:
            lines.append(rf"\cmidrule(lr){{{stubs}-{stubs + data}}}")
        else:
            stub = next(stub_rows)
            if len(row.stub) == 1 and stubs > 1:
                stub_cells = [rf"\multicolumn{{{stubs}}}{{@{{}}l}}{{{_escape(row.stub[0])}}}"]
            else:
                stub_cells = [_escape(text) for text in stub]
            cells = [
                rf"\multicolumn{{{cell.span}}}{{c}}{{{cell_text(cell, 'latex')}}}"
                if cell.span > 1
                else cell_text(cell, "latex")
                for cell in row.cells
            ]
            lines.append(" & ".join(stub_cells + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}%", "}"]
    caption = _escape(" ".join([table.caption, *table.notes])).replace("\u2020", DAGGER)
    lines += [rf"\caption{{{caption}}}", rf"\label{{{table.label}}}", r"\end{table*}"]
    return "\n".join(lines) + "\n"


def _grid(table: Table, style: str) -> list[list[str]]:
    """Header plus rows as strings, spans repeated in each column they cover."""
    stubs = (
        _stub_rows(table)
        if style == "markdown"
        else [
            row.stub + [""] * (len(table.stub_heads) - len(row.stub))
            for row in table.body
            if isinstance(row, Row)
        ]
    )
    rows = [table.stub_heads + table.column_names()]
    for stub, row in zip(stubs, (row for row in table.body if isinstance(row, Row)), strict=True):
        cells = [cell_text(cell, style) for cell in row.cells for _ in range(cell.span)]
        rows.append(stub + cells)
    return rows


def to_markdown(table: Table) -> str:
    rows = _grid(table, "markdown")
    lines = [
        f"**{table.caption}**",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---" for _ in rows[0]) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines + [""] + [f"- {note}" for note in table.notes]) + "\n"


def to_csv(table: Table) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(_grid(table, "csv"))
    return buffer.getvalue()


def mark_better(cells: Sequence[Cell]) -> None:
    """Bold the highest of ``cells`` (all of them on a tie) when at least two have a value."""
    values = [round(cell.value, 2) for cell in cells if cell.value is not None]
    if len(values) < 2:
        return
    for cell in cells:
        cell.bold = cell.value is not None and round(cell.value, 2) == max(values)


def _ordered(values: Iterable, order: Sequence) -> list:
    position = {value: index for index, value in enumerate(order)}
    return sorted(set(values), key=lambda value: (position.get(value, len(order)), value))


class ResultIndex:
    """The results on disk, looked up by configuration, with task scores and averages as cells."""

    def __init__(self, results: Iterable[TaskResult], unavailable: Iterable[dict]):
        self.results = {
            self._lookup(
                result.key.backbone,
                result.key.benchmark,
                result.key.length,
                result.key.task,
                result.key.setting,
                result.key.method,
                result.key.ratio,
            ): result
            for result in results
        }
        self.unavailable = {
            (entry["backbone"], entry["benchmark"], entry["length"], entry["task"]) for entry in unavailable
        }

    @classmethod
    def from_directory(cls, runs_dir: Path) -> tuple[ResultIndex, list[str]]:
        results, unavailable, warnings = load_results(runs_dir)
        return cls(results, unavailable), warnings

    @staticmethod
    def _lookup(backbone, benchmark, length, task, setting, method, ratio) -> tuple:
        if method == FULL_METHOD:
            setting, ratio = None, None
        return backbone, benchmark, length, task, setting, method, None if ratio is None else round(ratio, 6)

    def keys(self):
        return [result.key for result in self.results.values()]

    def backbones(self, benchmark: str) -> list[str]:
        return sorted({key.backbone for key in self.keys() if key.benchmark == benchmark})

    def lengths(self, backbone: str, benchmark: str) -> list[int]:
        return sorted(
            {key.length for key in self.keys() if (key.backbone, key.benchmark) == (backbone, benchmark)}
        )

    def ratios(self, backbone: str, benchmark: str, length: int | None = None) -> list[float]:
        """Ratios present, the tightest budget (largest ratio) first as the paper orders them."""
        return sorted(
            {
                key.ratio
                for key in self.keys()
                if (key.backbone, key.benchmark) == (backbone, benchmark)
                and key.ratio is not None
                and length in (None, key.length)
            },
            reverse=True,
        )

    def tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """Tasks with a result or an unavailable mark, in the benchmark's order."""
        found = {
            key.task
            for key in self.keys()
            if (key.backbone, key.benchmark, key.length) == (backbone, benchmark, length)
        }
        found |= {
            task for b, bench, n, task in self.unavailable if (b, bench, n) == (backbone, benchmark, length)
        }
        return _ordered(found, benchmarks.tasks(benchmark))

    def averaged_tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """The tasks an average covers: available ones (LongBench: its 16 English tasks only)."""
        tasks = [
            task
            for task in self.tasks(backbone, benchmark, length)
            if (backbone, benchmark, length, task) not in self.unavailable
        ]
        return [task for task in tasks if task in averaged_task_set(benchmark)]

    def has(self, backbone, benchmark, length, setting, method, ratio=None) -> bool:
        """Whether any result matches; None for length, setting or ratio matches any."""
        return any(
            (key.backbone, key.benchmark, key.method) == (backbone, benchmark, method)
            and length in (None, key.length)
            and setting in (None, key.setting)
            and (ratio is None or (key.ratio is not None and round(key.ratio, 6) == round(ratio, 6)))
            for key in self.keys()
        )

    def task_cell(self, backbone, benchmark, length, task, setting, method, ratio) -> Cell:
        if (backbone, benchmark, length, task) in self.unavailable:
            return Cell(unavailable=True)
        result = self.results.get(self._lookup(backbone, benchmark, length, task, setting, method, ratio))
        if result is None or not result.samples:
            return Cell()
        score = benchmarks.task_score([sample["score"] for sample in result.samples.values()])
        return Cell(score, partial=not result.complete)

    def average_cell(self, backbone, benchmark, length, setting, method, ratio) -> Cell:
        tasks = self.averaged_tasks(backbone, benchmark, length)
        cells = [self.task_cell(backbone, benchmark, length, task, setting, method, ratio) for task in tasks]
        if not cells or any(cell.value is None for cell in cells):
            return Cell()
        return Cell(
            round(sum(cell.value for cell in cells) / len(cells), 2),
            partial=any(cell.partial for cell in cells),
        )

    def coverage_notes(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """Say when an average covers fewer tasks than the benchmark's full set, and which are n/a."""
        notes = []
        full_set = averaged_task_set(benchmark)
        averaged = self.averaged_tasks(backbone, benchmark, length)
        where = f"{backbone_name(backbone)} {BENCHMARK_NAMES[benchmark]}-{length_name(benchmark, length)}"
        if len(averaged) < len(full_set):
            notes.append(
                f"{where}: averages over {len(averaged)} of {len(full_set)} tasks ({', '.join(averaged)})."
            )
        unavailable = [
            task
            for task in self.tasks(backbone, benchmark, length)
            if (backbone, benchmark, length, task) in self.unavailable
        ]
        if unavailable:
            notes.append(
                f"{where}: {', '.join(unavailable)} unavailable (data missing), excluded from averages."
            )
        return notes


def _method_blocks(
    index: ResultIndex,
    backbone: str | None,
    benchmark: str,
    length: int | None,
    setting: str,
    bases: Sequence[str],
    ratio: float | None = None,
) -> list[list[str]]:
    """Row groups of a setting: [base, base+reskv] pairs, then unpaired methods, those with any result."""
    blocks = []
    for base in bases:
        members = [base, base + RESIDUAL_SUFFIX] if base in PAIRED_BASES else [base]
        backbones = [backbone] if backbone else index.backbones(benchmark)
        if any(
            index.has(b, benchmark, length, setting, method, ratio) for b in backbones for method in members
        ):
            blocks.append(members)
    return blocks


def method_row_name(method: str) -> str:
    return "+ResKV" if method.endswith(RESIDUAL_SUFFIX) else METHOD_NAMES.get(method, method)


def _notes(table: Table, extra: Iterable[str]) -> None:
    texts = [cell_text(cell, "csv") for row in table.body if isinstance(row, Row) for cell in row.cells]
    table.notes = list(extra)
    if any(text == "" for text in texts):
        table.notes.append(MISSING_NOTE + ".")
    if any("\u2020" in text for text in texts):
        table.notes.append(PARTIAL_NOTE + ".")
    if "n/a" in texts:
        table.notes.append(UNAVAILABLE_NOTE + ".")


def averages_table(
    index: ResultIndex, benchmark: str, bases: Sequence[str] = PAIRED_BASES + UNPAIRED_METHODS
) -> Table | None:
    """tab:ruler_paper / tab:longbench_paper: averages over backbones x lengths x budgets."""
    groups = [
        (backbone, length, index.ratios(backbone, benchmark, length))
        for backbone in index.backbones(benchmark)
        for length in index.lengths(backbone, benchmark)
    ]
    groups = [(backbone, length, ratios) for backbone, length, ratios in groups if ratios]
    if not groups:
        return None
    show_length = benchmark == "ruler" or len(groups) > len({backbone for backbone, _, _ in groups})
    backbone_heads: list[tuple[str, int]] = []
    for backbone, _, ratios in groups:
        if backbone_heads and backbone_heads[-1][0] == backbone_name(backbone):
            backbone_heads[-1] = (backbone_heads[-1][0], backbone_heads[-1][1] + len(ratios))
        else:
            backbone_heads.append((backbone_name(backbone), len(ratios)))
    heads = [backbone_heads]
    if show_length:
        heads.append([(length_name(benchmark, length), len(ratios)) for _, length, ratios in groups])
    heads.append([(retained(ratio), 1) for _, _, ratios in groups for ratio in ratios])
    table = Table(
        f"{benchmark}_averages",
        f"{BENCHMARK_NAMES[benchmark]} average scores under different retained KV budgets. Bold marks "
        "the better average within each baseline--ResKV pair.",
        f"tab:{benchmark}_averages",
        ["Setting", "Method"],
        heads,
    )
    full_cells = [
        index.average_cell(backbone, benchmark, length, None, FULL_METHOD, None)
        for backbone, length, _ in groups
    ]
    for cell, (_, _, ratios) in zip(full_cells, groups, strict=True):
        cell.span = len(ratios)
    if any(index.has(backbone, benchmark, length, None, FULL_METHOD) for backbone, length, _ in groups):
        table.body.append(Row(["Full Cache"], full_cells))
    for setting in SETTING_NAMES:
        blocks = _method_blocks(index, None, benchmark, None, setting, bases)
        if not blocks:
            continue
        table.body.append(MIDRULE)
        for number, block in enumerate(blocks):
            if number:
                table.body.append(CMIDRULE)
            rows = [
                Row(
                    [SETTING_NAMES[setting], method_row_name(method)],
                    [
                        index.average_cell(backbone, benchmark, length, setting, method, ratio)
                        for backbone, length, ratios in groups
                        for ratio in ratios
                    ],
                )
                for method in block
            ]
            for column in zip(*(row.cells for row in rows), strict=True):
                mark_better(column if len(block) == 2 else ())
            table.body.extend(rows)
    _notes(
        table,
        [
            note
            for backbone, length, _ in groups
            for note in index.coverage_notes(backbone, benchmark, length)
        ],
    )
    return table


def task_table(
    index: ResultIndex,
    backbone: str,
    benchmark: str,
    length: int,
    bases: Sequence[str] = PAIRED_BASES + UNPAIRED_METHODS,
) -> Table:
    """The appendix table of one backbone and benchmark: every task plus the average."""
    tasks = index.tasks(backbone, benchmark, length)
    where = f"{BENCHMARK_NAMES[benchmark]}-{length_name(benchmark, length)}"
    table = Table(
        f"tasks_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{where} results for {backbone_name(backbone)}. Bold marks the better average within each "
        "paired setting.",
        f"tab:{benchmark}{length}_{backbone}_tasks",
        ["Budget", "Setting", "Method"],
        [[(TASK_NAMES.get(task, task), 1) for task in tasks] + [("Avg.", 1)]],
    )

    def row(stub: list[str], setting: str | None, method: str, ratio: float | None) -> Row:
        cells = [index.task_cell(backbone, benchmark, length, task, setting, method, ratio) for task in tasks]
        return Row(stub, cells + [index.average_cell(backbone, benchmark, length, setting, method, ratio)])

    if index.has(backbone, benchmark, length, None, FULL_METHOD):
        table.body.append(row(["Full Cache"], None, FULL_METHOD, None))
    for ratio in index.ratios(backbone, benchmark, length):
        for setting in SETTING_NAMES:
            blocks = _method_blocks(index, backbone, benchmark, length, setting, bases, ratio)
            for number, block in enumerate(blocks):
                table.body.append(CMIDRULE if number else MIDRULE)
                rows = [
                    row(
                        [retained(ratio), SETTING_NAMES[setting], method_row_name(method)],
                        setting,
                        method,
                        ratio,
                    )
                    for method in block
                ]
                if len(block) == 2:
                    mark_better([rows[0].cells[-1], rows[1].cells[-1]])
                table.body.extend(rows)
    _notes(table, index.coverage_notes(backbone, benchmark, length))
    return table


def _task_columns(
    index: ResultIndex, backbone: str, methods: Sequence[str], setting: str, ratio: float
) -> list[tuple[str, int, str]]:
    """(benchmark, length, task) with a result for any of ``methods``, benchmark by benchmark."""
    found = {
        (key.benchmark, key.length, key.task)
        for key in index.keys()
        if key.backbone == backbone
        and key.method in methods
        and key.setting == setting
        and key.ratio is not None
        and round(key.ratio, 6) == round(ratio, 6)
    }
    return sorted(
        found,
        key=lambda column: (
            list(benchmarks.BENCHMARKS).index(column[0]),
            column[1],
            list(benchmarks.tasks(column[0])).index(column[2]),
        ),
    )


def _column_heads(columns: Sequence[tuple[str, int, str]]) -> list[list[tuple[str, int]]]:
    groups: list[tuple[str, int]] = []
    for benchmark, length, _ in columns:
        name = f"{BENCHMARK_NAMES[benchmark]}-{length_name(benchmark, length)}"
        groups[-1:] = (
            [(name, groups[-1][1] + 1)] if groups and groups[-1][0] == name else [*groups[-1:], (name, 1)]
        )
    return [groups, [(TASK_NAMES.get(task, task), 1) for _, _, task in columns]]


def _comparison_settings(index: ResultIndex, marker_method) -> list[tuple[str, str, float]]:
    """(backbone, setting, ratio) combinations where a method selected by ``marker_method`` has results."""
    return sorted(
        {(key.backbone, key.setting, key.ratio) for key in index.keys() if marker_method(key.method)},
        key=lambda combo: (combo[0], combo[1], -combo[2]),
    )


def cam_tables(index: ResultIndex) -> list[Table]:
    """tab:snapkv_cam_reskv_tasks: SnapKV, +CaM and SnapKV+ResKV per task, wherever CaM ran."""
    methods = ("snapkv", "cam", "snapkv" + RESIDUAL_SUFFIX)
    tables = []
    for backbone, setting, ratio in _comparison_settings(index, lambda method: method == "cam"):
        columns = _task_columns(index, backbone, methods, setting, ratio)
        table = Table(
            f"cam_{backbone.replace('/', '--')}_{ratio:g}_{setting}",
            f"Task-level comparison under {backbone_name(backbone)}, {retained(ratio)} retained KV, "
            f"{SETTING_NAMES[setting]} cache construction.",
            f"tab:cam_{backbone}_{ratio:g}_{setting}",
            ["Method"],
            _column_heads(columns),
        )
        rows = [
            Row(
                [name],
                [
                    index.task_cell(backbone, benchmark, length, task, setting, method, ratio)
                    for benchmark, length, task in columns
                ],
            )
            for name, method in zip(("SnapKV", "+CaM", "+ResKV"), methods, strict=True)
        ]
        for column in zip(*(row.cells for row in rows), strict=True):
            mark_better(column)
        table.body.extend(rows)
        _notes(table, [])
        tables.append(table)
    return tables


def ablation_tables(index: ResultIndex) -> list[Table]:
    """tab:ablation_main: ResKV and its ablations per task with the change from ResKV, where ablations ran."""
    tables = []
    variant_suffixes = [suffix for _, suffix in ABLATIONS if suffix]
    for backbone, setting, ratio in _comparison_settings(
        index, lambda method: any(method.endswith(RESIDUAL_SUFFIX + suffix) for suffix in variant_suffixes)
    ):
        for base in PAIRED_BASES:
            methods = [base + RESIDUAL_SUFFIX + suffix for _, suffix in ABLATIONS]
            columns = _task_columns(index, backbone, methods[1:], setting, ratio)
            if not columns:
                continue
            table = Table(
                f"ablation_{backbone.replace('/', '--')}_{base}_{ratio:g}_{setting}",
                f"Ablation results with {METHOD_NAMES[base]} under {backbone_name(backbone)}, "
                f"{retained(ratio)} retained KV, {SETTING_NAMES[setting]} cache construction. "
                "Parentheses show the change from ResKV.",
                f"tab:ablation_{backbone}_{base}_{ratio:g}_{setting}",
                ["Method"],
                _column_heads(columns),
            )
            rows = [
                Row(
                    [name],
                    [
                        index.task_cell(backbone, benchmark, length, task, setting, method, ratio)
                        for benchmark, length, task in columns
                    ],
                )
                for (name, _), method in zip(ABLATIONS, methods, strict=True)
            ]
            for column in zip(*(row.cells for row in rows), strict=True):
                mark_better(column)
                for cell in column[1:]:
                    if cell.value is not None and column[0].value is not None:
                        cell.delta = round(cell.value - column[0].value, 2)
            table.body.extend(rows)
            _notes(table, [])
            tables.append(table)
    return tables


def all_tables(index: ResultIndex) -> list[Table]:
    tables = [
        table for table in (averages_table(index, benchmark) for benchmark in benchmarks.BENCHMARKS) if table
    ]
    for benchmark in benchmarks.BENCHMARKS:
        for backbone in index.backbones(benchmark):
            tables += [
                task_table(index, backbone, benchmark, length)
                for length in index.lengths(backbone, benchmark)
            ]
    return tables + cam_tables(index) + ablation_tables(index)


def write_tables(tables: Sequence[Table], out_dir: Path) -> list[Path]:
    """Each table as .tex, .md and .csv, plus tables.tex (inputs every .tex) and tables.md (all of them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, render in ((".tex", to_latex), (".md", to_markdown), (".csv", to_csv)):
            path = out_dir / f"{table.name}{suffix}"
            path.write_text(render(table))
            written.append(path)
    (out_dir / "tables.tex").write_text(
        "% Needs \\usepackage{booktabs,graphicx}.\n"
        + "".join(rf"\input{{{table.name}.tex}}" + "\n" for table in tables)
    )
    (out_dir / "tables.md").write_text("\n".join(to_markdown(table) for table in tables))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=Path("results"),
        help="results root (reads <dir>/runs; default: results)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: <results-dir>/tables")
    args = parser.parse_args(argv)
    index, warnings = ResultIndex.from_directory(args.results_dir / "runs")
    for warning in warnings:
        print(f"warning: {warning}")
    tables = all_tables(index)
    out_dir = args.out_dir or args.results_dir / "tables"
    write_tables(tables, out_dir)
    print(f"{len(tables)} tables written to {out_dir} (.tex, .md, .csv; tables.md has them all)")


if __name__ == "__main__":
    main()
