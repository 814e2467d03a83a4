"""A table as data (``Table``, ``Row``, ``Cell``), its notes, and its LaTeX (booktabs), markdown and CSV
renderings; the rules the tables follow are in ``scripts.report.tables``.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DAGGER = r"$^\dagger$"
MISSING_NOTE = "--: not run"
PARTIAL_NOTE = (
    "\u2020: partial (fewer samples than the task has so far; rows compared side by side are scored "
    "on the samples they all have)"
)
UNAVAILABLE_NOTE = "n/a: task data unavailable here, excluded from averages"


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
    text: str | None = None  # shown as is instead of a value (an interval, a verdict)


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
    if cell.text is not None:
        return _escape(cell.text) if style == "latex" else cell.text
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


def samples_note(cells: Iterable[Cell]) -> str | None:
    """How many samples per task the values cover (a range when they differ)."""
    counts = [count for cell in cells if cell.value is not None for count in cell.n]
    if not counts:
        return None
    low, high = min(counts), max(counts)
    return f"n = {low} samples per task." if low == high else f"n = {low} to {high} samples per task."


def add_notes(table: Table, extra: Iterable[str]) -> None:
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
