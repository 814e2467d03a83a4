"""The paper's tables from the results frames (scripts.results_frame): LaTeX (booktabs), markdown, CSV.

    python -m scripts.tables [--results-dir results] [--out-dir results/tables] [--show-n]

Tables (each as ``<name>.tex``, ``<name>.md``, ``<name>.csv``; ``tables.tex`` inputs them all),
and the frames themselves as ``results.csv`` (one row per configuration), ``samples.csv`` and, where
the quality measures ran, ``layers.csv`` (per layer; the quality tables are scripts.quality_tables):

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
never as 0; rows shown side by side (a baseline and its +ResKV, the CaM and ablation rows) are
scored, task by task, on the samples all of them scored, so a pair never compares different
samples (issue 9); a cell whose samples are fewer than its task has so far (the most any
configuration of the task has) is marked partial (dagger); the notes give the samples per task
(``--show-n``: per cell in .md and .csv); a task whose data is unavailable is shown as ``n/a`` and
left out of averages; an average needs every averaged task of its row, otherwise it is missing.
Averages are the unweighted mean of the task scores shown (each the benchmark's own
``task_score``), rounded to two decimals; bold marks a strict winner of the two-decimal values
only, none on a tie. LongBench averages cover its 16 English tasks.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

import benchmarks
from baselines.registry import FULL_METHOD, RESIDUAL_BASES, RESIDUAL_SUFFIX, SPECS, UNPAIRED_METHODS
from benchmarks.longbench import ENGLISH_TASKS
from reskv.harness.records import MethodLabel
from scripts.results_frame import (
    TASK_COLUMNS,
    frames_from_results,
    frames_from_runs,
    heads_frame,
    layers_frame,
    write_frames,
)
from scripts.results_store import load_results

# Row blocks: the baselines with a +ResKV pair, then the methods without one (registry order).
TABLE_BASES = RESIDUAL_BASES + UNPAIRED_METHODS
SETTING_NAMES = {"aware": "q-Aware", "agnostic": "q-Agnostic"}
BACKBONE_NAMES = {
    "llama3.1-8b-instruct": "LLaMA-3.1-8B",
    "qwen2.5-7b-instruct": "Qwen-2.5-7B",
    "smollm2-135m": "SmolLM2-135M",
    "tiny-llama": "tiny-llama",
    "tiny-qwen2": "tiny-qwen2",
}
BENCHMARK_NAMES = {"ruler": "RULER", "longbench": "LongBench", "longbench-e": "LongBench-E"}
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
# Ablation rows of tab:ablation_main: the ResKV option each ablation switch turns off.
ABLATIONS = (
    ("ResKV", {}),
    ("w/o validation", {"validate": False}),
    ("w/o dynamic gate", {"gate": False}),
    ("w/o shared softmax", {"shared_softmax": False}),
)
DAGGER = r"$^\dagger$"
MISSING_NOTE = "--: not run"
PARTIAL_NOTE = (
    "\u2020: partial (fewer samples than the task has so far; rows compared side by side are scored "
    "on the samples they all have)"
)
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


def benchmark_name(benchmark: str, length: int) -> str:
    """A benchmark and length as tables and figures title them: ``RULER-4K``."""
    return f"{BENCHMARK_NAMES.get(benchmark, benchmark)}-{length_name(benchmark, length)}"


@dataclass
class Cell:
    """One number of a table; ``value`` None is a missing cell."""

    value: float | None = None
    partial: bool = False
    unavailable: bool = False
    bold: bool = False
    span: int = 1
    delta: float | None = None  # shown in parentheses (ablation drops)
    n: tuple[int, int] | None = None  # fewest and most scored samples per task behind the value
    digits: int = 2  # decimals shown
    count: tuple[int, int] | None = None  # shown as "k/n" instead of a value (samples closer to full)


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
    body: list[Row | str] = field(default_factory=list)  # rows and rules (MIDRULE, CMIDRULE)
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


def _number(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


def cell_text(cell: Cell, style: str, show_n: bool = False) -> str:
    """A cell as LaTeX (``latex``), markdown (``markdown``) or plain text (``csv``); ``show_n``
    appends the samples per task behind the value (markdown and csv: ``(n=2)``, ``(n=2-3)``)."""
    if cell.unavailable:
        return "n/a"
    if cell.count is not None:
        return f"{cell.count[0]}/{cell.count[1]}"
    if cell.value is None:
        return "" if style == "csv" else "--"
    text = _number(cell.value, cell.digits)
    if cell.bold and style == "latex":
        text = rf"\textbf{{{text}}}"
    elif cell.bold and style == "markdown":
        text = f"**{text}**"
    if cell.partial:
        text += DAGGER if style == "latex" else "\u2020"
    if cell.delta is not None:
        delta = f"({cell.delta:+.2f})"
        text += rf" {{\scriptsize {delta}}}" if style == "latex" else f" {delta}"
    if show_n and style != "latex" and cell.n is not None:
        low, high = cell.n
        text += f" (n={low})" if low == high else f" (n={low}-{high})"
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


def _grid(table: Table, style: str, show_n: bool = False) -> list[list[str]]:
    """Header plus rows as strings, spans repeated in each column they cover."""
    stubs = (
        _stub_rows(table)
        if style == "markdown"
        else [
            row.stub + [""] * (len(table.stub_heads) - len(row.stub))
            for row in table.body
            if not isinstance(row, str)
        ]
    )
    rows = [table.stub_heads + table.column_names()]
    for stub, row in zip(stubs, (row for row in table.body if not isinstance(row, str)), strict=True):
        cells = [cell_text(cell, style, show_n) for cell in row.cells for _ in range(cell.span)]
        rows.append(stub + cells)
    return rows


def to_markdown(table: Table, show_n: bool = False) -> str:
    rows = _grid(table, "markdown", show_n)
    lines = [
        f"**{table.caption}**",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "|".join("---" for _ in rows[0]) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines + [""] + [f"- {note}" for note in table.notes]) + "\n"


def to_csv(table: Table, show_n: bool = False) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(_grid(table, "csv", show_n))
    return buffer.getvalue()


def mark_better(cells: Sequence[Cell]) -> None:
    """Bold the highest of ``cells`` when it is a strict winner among at least two values."""
    values = [round(cell.value, 2) for cell in cells if cell.value is not None]
    if len(values) < 2 or values.count(max(values)) > 1:
        return
    for cell in cells:
        cell.bold = cell.value is not None and round(cell.value, 2) == max(values)


def _ordered(values: Iterable, order: Sequence) -> list:
    position = {value: index for index, value in enumerate(order)}
    return sorted(set(values), key=lambda value: (position.get(value, len(order)), value))


def _ratio_key(ratio: float | None) -> float:
    """A ratio as a lookup key: six decimals; 0 for the full cache, which has none."""
    return 0.0 if ratio is None or pd.isna(ratio) else round(float(ratio), 6)


class ResultIndex:
    """The results frames (scripts.results_frame) as the tables look them up: blocks of compared
    methods scored on shared samples, averages, and which configurations exist."""

    def __init__(self, samples: pd.DataFrame, configs: pd.DataFrame):
        available = configs["status"] != "unavailable"
        self.configs = configs[available].assign(
            setting=lambda frame: frame["setting"].fillna(""),
            ratio=lambda frame: frame["ratio"].map(_ratio_key),
        )
        self.unavailable = set(configs.loc[~available, TASK_COLUMNS].itertuples(index=False, name=None))
        self.task_samples = (
            self.configs.groupby(TASK_COLUMNS)["task_samples"].max().to_dict() if len(self.configs) else {}
        )
        slices = samples.assign(setting=samples["setting"].fillna(""), ratio=samples["ratio"].map(_ratio_key))
        self.samples = slices
        self.slices = dict(list(slices.groupby(["backbone", "benchmark", "length", "setting", "ratio"])))

    @classmethod
    def from_directory(cls, runs_dir: Path) -> tuple[ResultIndex, list[str]]:
        samples, configs, warnings = frames_from_runs(runs_dir)
        return cls(samples, configs), warnings

    def _configs(self, **values) -> pd.DataFrame:
        """Configurations matching ``values``; a None value matches any."""
        frame = self.configs
        for column, value in values.items():
            if value is not None:
                frame = frame[frame[column] == (_ratio_key(value) if column == "ratio" else value)]
        return frame

    def backbones(self, benchmark: str) -> list[str]:
        return sorted(set(self._configs(benchmark=benchmark)["backbone"]))

    def lengths(self, backbone: str, benchmark: str) -> list[int]:
        return sorted(set(self._configs(backbone=backbone, benchmark=benchmark)["length"]))

    def ratios(self, backbone: str, benchmark: str, length: int | None = None) -> list[float]:
        """Ratios present, the tightest budget (largest ratio) first as the paper orders them."""
        ratios = self._configs(backbone=backbone, benchmark=benchmark, length=length)["ratio"]
        return sorted(set(ratios) - {0.0}, reverse=True)

    def tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """Tasks with a result or an unavailable mark, in the benchmark's order."""
        found = set(self._configs(backbone=backbone, benchmark=benchmark, length=length)["task"])
        found |= {task for *where, task in self.unavailable if tuple(where) == (backbone, benchmark, length)}
        return _ordered(found, benchmarks.tasks(benchmark))

    def averaged_tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """The tasks an average covers: available ones (LongBench: its 16 English tasks only)."""
        return [
            task
            for task in self.tasks(backbone, benchmark, length)
            if (backbone, benchmark, length, task) not in self.unavailable
            and task in averaged_task_set(benchmark)
        ]

    def has(self, backbone, benchmark, length, setting, method, ratio=None) -> bool:
        """Whether any result matches; None for length, setting or ratio matches any."""
        return not self._configs(
            backbone=backbone, benchmark=benchmark, length=length, setting=setting, method=method, ratio=ratio
        ).empty

    def compare(self, backbone, benchmark, length, setting, ratio, methods: Sequence[str]) -> dict[str, dict]:
        """Task cells ``{method: {task: Cell}}`` of methods shown side by side (a baseline and its
        +ResKV, the CaM or ablation rows): per task, every method present is scored on the samples
        all of them scored, so a pair never compares different samples (issue 9). A cell is partial
        when the samples all of them ran are fewer than the task has so far (``task_samples``)."""
        tasks = self.tasks(backbone, benchmark, length)
        cells = {
            method: {
                task: Cell(unavailable=(backbone, benchmark, length, task) in self.unavailable)
                for task in tasks
            }
            for method in methods
        }
        rows = self.slices.get((backbone, benchmark, length, setting or "", _ratio_key(ratio)))
        if rows is None:
            return cells
        for task, group in rows[rows["method"].isin(methods)].groupby("task"):
            if (backbone, benchmark, length, task) in self.unavailable:
                continue
            present = group["method"].nunique()
            shared = group.groupby("index")["method"].nunique() == present
            scored = group[group["score"].notna()].groupby("index")["method"].nunique() == present
            partial = shared.sum() < self.task_samples[(backbone, benchmark, length, task)]
            for method, method_rows in group.groupby("method"):
                scores = method_rows.loc[method_rows["index"].isin(scored[scored].index), "score"].tolist()
                value = benchmarks.task_score(benchmark, scores) if scores else None
                cells[method][task] = Cell(value, partial=partial, n=(len(scores), len(scores)))
        return cells

    def average(self, backbone, benchmark, length, task_cells: dict[str, Cell]) -> Cell:
        """Unweighted mean of the averaged tasks' cells, missing unless every one has a value."""
        cells = [task_cells[task] for task in self.averaged_tasks(backbone, benchmark, length)]
        if not cells or any(cell.value is None for cell in cells):
            return Cell()
        return Cell(
            round(sum(cell.value for cell in cells) / len(cells), 2),
            partial=any(cell.partial for cell in cells),
            n=(min(cell.n[0] for cell in cells), max(cell.n[1] for cell in cells)),
        )

    def block_averages(self, backbone, benchmark, length, setting, ratio, methods) -> dict[str, Cell]:
        """Average cell of each method of a block, its members compared on shared samples."""
        compared = self.compare(backbone, benchmark, length, setting, ratio, methods)
        return {method: self.average(backbone, benchmark, length, compared[method]) for method in methods}

    def coverage_notes(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """Say when an average covers fewer tasks than the benchmark's full set, and which are n/a."""
        notes = []
        full_set = averaged_task_set(benchmark)
        averaged = self.averaged_tasks(backbone, benchmark, length)
        where = f"{backbone_name(backbone)} {benchmark_name(benchmark, length)}"
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


def method_blocks(
    index: ResultIndex,
    backbone: str | None,
    benchmark: str,
    length: int | None,
    setting: str,
    bases: Sequence[str] = TABLE_BASES,
    ratio: float | None = None,
) -> list[list[str]]:
    """Row groups of a setting: [base, base+reskv] pairs, then unpaired methods, those with any result."""
    blocks = []
    for base in bases:
        members = [base, base + RESIDUAL_SUFFIX] if base in RESIDUAL_BASES else [base]
        backbones = [backbone] if backbone else index.backbones(benchmark)
        if any(
            index.has(b, benchmark, length, setting, method, ratio) for b in backbones for method in members
        ):
            blocks.append(members)
    return blocks


def method_row_name(method: str) -> str:
    return "+ResKV" if method.endswith(RESIDUAL_SUFFIX) else SPECS[method].display


def samples_note(cells: Iterable[Cell]) -> str | None:
    """How many samples per task the values cover (a range when they differ)."""
    counts = [count for cell in cells if cell.value is not None for count in cell.n]
    if not counts:
        return None
    low, high = min(counts), max(counts)
    return f"n = {low} samples per task." if low == high else f"n = {low} to {high} samples per task."


def _notes(table: Table, extra: Iterable[str]) -> None:
    cells = [cell for row in table.body if not isinstance(row, str) for cell in row.cells]
    table.notes = list(extra)
    if note := samples_note(cells):
        table.notes.append(note)
    if any(cell.value is None and not cell.unavailable for cell in cells):
        table.notes.append(MISSING_NOTE + ".")
    if any(cell.partial and cell.value is not None for cell in cells):
        table.notes.append(PARTIAL_NOTE + ".")
    if any(cell.unavailable for cell in cells):
        table.notes.append(UNAVAILABLE_NOTE + ".")


def averages_table(index: ResultIndex, benchmark: str, bases: Sequence[str] = TABLE_BASES) -> Table | None:
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
    if any(index.has(backbone, benchmark, length, None, FULL_METHOD) for backbone, length, _ in groups):
        full_cells = [
            index.block_averages(backbone, benchmark, length, None, None, [FULL_METHOD])[FULL_METHOD]
            for backbone, length, _ in groups
        ]
        for cell, (_, _, ratios) in zip(full_cells, groups, strict=True):
            cell.span = len(ratios)
        table.body.append(Row(["Full Cache"], full_cells))
    for setting in SETTING_NAMES:
        blocks = method_blocks(index, None, benchmark, None, setting, bases)
        if blocks:
            table.body.append(MIDRULE)
        for number, block in enumerate(blocks):
            if number:
                table.body.append(CMIDRULE)
            columns = [
                index.block_averages(backbone, benchmark, length, setting, ratio, block)
                for backbone, length, ratios in groups
                for ratio in ratios
            ]
            for column in columns:
                mark_better(list(column.values()) if len(block) == 2 else ())
            table.body += [
                Row([SETTING_NAMES[setting], method_row_name(method)], [column[method] for column in columns])
                for method in block
            ]
    coverage = [
        note for backbone, length, _ in groups for note in index.coverage_notes(backbone, benchmark, length)
    ]
    _notes(table, coverage)
    return table


def task_table(
    index: ResultIndex,
    backbone: str,
    benchmark: str,
    length: int,
    bases: Sequence[str] = TABLE_BASES,
) -> Table:
    """The appendix table of one backbone and benchmark: every task plus the average."""
    tasks = index.tasks(backbone, benchmark, length)
    table = Table(
        f"tasks_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{benchmark_name(benchmark, length)} results for {backbone_name(backbone)}. Bold marks the better "
        "average within each paired setting.",
        f"tab:{benchmark}{length}_{backbone}_tasks",
        ["Budget", "Setting", "Method"],
        [[(TASK_NAMES.get(task, task), 1) for task in tasks] + [("Avg.", 1)]],
    )

    def block_rows(stub: list[str], setting: str | None, ratio: float | None, block: list[str]) -> list[Row]:
        compared = index.compare(backbone, benchmark, length, setting, ratio, block)
        rows = [
            Row(
                stub + [method_row_name(method)] if len(stub) > 1 else stub,
                [compared[method][task] for task in tasks]
                + [index.average(backbone, benchmark, length, compared[method])],
            )
            for method in block
        ]
        mark_better([row.cells[-1] for row in rows] if len(block) == 2 else ())
        return rows

    if index.has(backbone, benchmark, length, None, FULL_METHOD):
        table.body += block_rows(["Full Cache"], None, None, [FULL_METHOD])
    for ratio in index.ratios(backbone, benchmark, length):
        for setting in SETTING_NAMES:
            for number, block in enumerate(
                method_blocks(index, backbone, benchmark, length, setting, bases, ratio)
            ):
                table.body.append(CMIDRULE if number else MIDRULE)
                table.body += block_rows([retained(ratio), SETTING_NAMES[setting]], setting, ratio, block)
    _notes(table, index.coverage_notes(backbone, benchmark, length))
    return table


def _task_columns(
    index: ResultIndex, backbone: str, methods: Sequence[str], setting: str, ratio: float
) -> list[tuple[str, int, str]]:
    """(benchmark, length, task) with a result for any of ``methods``, benchmark by benchmark."""
    found = index._configs(backbone=backbone, setting=setting, ratio=ratio)
    found = found[found["method"].isin(methods)]
    return sorted(
        set(found[["benchmark", "length", "task"]].itertuples(index=False, name=None)),
        key=lambda column: (
            list(benchmarks.BENCHMARKS).index(column[0]),
            column[1],
            list(benchmarks.tasks(column[0])).index(column[2]),
        ),
    )


def _column_heads(columns: Sequence[tuple[str, int, str]]) -> list[list[tuple[str, int]]]:
    groups: list[tuple[str, int]] = []
    for benchmark, length, _ in columns:
        name = benchmark_name(benchmark, length)
        groups[-1:] = (
            [(name, groups[-1][1] + 1)] if groups and groups[-1][0] == name else [*groups[-1:], (name, 1)]
        )
    return [groups, [(TASK_NAMES.get(task, task), 1) for _, _, task in columns]]


def _comparison_settings(index: ResultIndex, marker_method) -> list[tuple[str, str, float]]:
    """(backbone, setting, ratio) combinations where a method selected by ``marker_method`` has results."""
    marked = index.configs[index.configs["method"].map(marker_method).astype(bool)]
    combos = set(marked[["backbone", "setting", "ratio"]].itertuples(index=False, name=None))
    return sorted(combos, key=lambda combo: (combo[0], combo[1], -combo[2]))


def _task_rows(index, backbone, setting, ratio, columns, names, methods) -> list[Row]:
    """One row per method over task columns of several benchmarks, the methods compared per task."""
    compared = {
        (benchmark, length): index.compare(backbone, benchmark, length, setting, ratio, methods)
        for benchmark, length, _ in columns
    }
    rows = [
        Row([name], [compared[benchmark, length][method][task] for benchmark, length, task in columns])
        for name, method in zip(names, methods, strict=True)
    ]
    for column in zip(*(row.cells for row in rows), strict=True):
        mark_better(column)
    return rows


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
        table.body += _task_rows(
            index, backbone, setting, ratio, columns, ("SnapKV", "+CaM", "+ResKV"), methods
        )
        _notes(table, [])
        tables.append(table)
    return tables


def ablation_tables(index: ResultIndex) -> list[Table]:
    """tab:ablation_main: ResKV and its ablations per task with the change from ResKV, where ablations ran."""
    tables = []
    switches = [options for _, options in ABLATIONS if options]

    def is_ablation(method: str) -> bool:
        label = MethodLabel.parse(method)
        return label.residual and label.options in switches

    for backbone, setting, ratio in _comparison_settings(index, is_ablation):
        for base in RESIDUAL_BASES:
            methods = [str(MethodLabel(base + RESIDUAL_SUFFIX, options)) for _, options in ABLATIONS]
            columns = _task_columns(index, backbone, methods[1:], setting, ratio)
            if not columns:
                continue
            table = Table(
                f"ablation_{backbone.replace('/', '--')}_{base}_{ratio:g}_{setting}",
                f"Ablation results with {SPECS[base].display} under {backbone_name(backbone)}, "
                f"{retained(ratio)} retained KV, {SETTING_NAMES[setting]} cache construction. "
                "Parentheses show the change from ResKV.",
                f"tab:ablation_{backbone}_{base}_{ratio:g}_{setting}",
                ["Method"],
                _column_heads(columns),
            )
            rows = _task_rows(
                index, backbone, setting, ratio, columns, [name for name, _ in ABLATIONS], methods
            )
            for column in zip(*(row.cells for row in rows), strict=True):
                for cell in column[1:]:
                    if cell.value is not None and column[0].value is not None:
                        cell.delta = round(cell.value - column[0].value, 2)
            table.body += rows
            _notes(table, [])
            tables.append(table)
    return tables


def all_tables(index: ResultIndex, heads: pd.DataFrame | None = None) -> list[Table]:
    """Every table the results support; ``heads`` (``results_frame.heads_frame``) adds the proxy's
    choices to the quality tables."""
    tables = [
        table for table in (averages_table(index, benchmark) for benchmark in benchmarks.BENCHMARKS) if table
    ]
    for benchmark in benchmarks.BENCHMARKS:
        for backbone in index.backbones(benchmark):
            tables += [
                task_table(index, backbone, benchmark, length)
                for length in index.lengths(backbone, benchmark)
            ]
    from scripts.quality_tables import quality_tables  # it builds on this module's Table and ResultIndex

    return tables + cam_tables(index) + ablation_tables(index) + quality_tables(index, heads)


def write_tables(tables: Sequence[Table], out_dir: Path, show_n: bool = False) -> list[Path]:
    """Each table as .tex, .md and .csv, plus tables.tex (inputs every .tex) and tables.md (all of them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, text in (
            (".tex", to_latex(table)),
            (".md", to_markdown(table, show_n)),
            (".csv", to_csv(table, show_n)),
        ):
            path = out_dir / f"{table.name}{suffix}"
            path.write_text(text)
            written.append(path)
    (out_dir / "tables.tex").write_text(
        "% Needs \\usepackage{booktabs,graphicx}.\n"
        + "".join(rf"\input{{{table.name}.tex}}" + "\n" for table in tables)
    )
    (out_dir / "tables.md").write_text("\n".join(to_markdown(table, show_n) for table in tables))
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
    parser.add_argument(
        "--show-n", action="store_true", help="append each cell's samples per task to the .md and .csv cells"
    )
    args = parser.parse_args(argv)
    results, unavailable, warnings = load_results(args.results_dir / "runs")  # read once, used thrice
    samples, configs = frames_from_results(results, unavailable)
    for warning in warnings:
        print(f"warning: {warning}")
    tables = all_tables(ResultIndex(samples, configs), heads_frame(results))
    out_dir = args.out_dir or args.results_dir / "tables"
    write_tables(tables, out_dir, args.show_n)
    frames = write_frames(samples, configs, out_dir)
    layers = layers_frame(results)
    if len(layers):
        layers.to_csv(out_dir / "layers.csv", index=False)
        frames.append(out_dir / "layers.csv")
    print(
        f"{len(tables)} tables written to {out_dir} (.tex, .md, .csv; tables.md has them all); "
        f"the results as data: {', '.join(path.name for path in frames)}"
    )


if __name__ == "__main__":
    main()
