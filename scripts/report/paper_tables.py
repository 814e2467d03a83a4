"""The paper's tables: averages (tab:ruler_paper, tab:longbench_paper), every task per backbone,
SnapKV against +CaM and +ResKV, and the ablations; ``scripts.report.tables`` lists them and their rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

import benchmarks
from baselines.registry import FULL_METHOD, RESIDUAL_BASES, RESIDUAL_SUFFIX, SPECS, UNPAIRED_METHODS
from scripts.harness.records import MethodLabel
from scripts.report.index import ResultIndex
from scripts.report.names import (
    BENCHMARK_NAMES,
    SETTING_NAMES,
    TASK_NAMES,
    backbone_name,
    benchmark_name,
    length_name,
    retained,
)
from scripts.report.render import CMIDRULE, MIDRULE, Row, Table, add_notes, mark_better

# Row blocks: the baselines with a +ResKV pair, then the methods without one (registry order).
TABLE_BASES = RESIDUAL_BASES + UNPAIRED_METHODS
# Ablation rows of tab:ablation_main: the ResKV option each ablation switch turns off.
ABLATIONS = (
    ("ResKV", {}),
    ("w/o validation", {"validate": False}),
    ("w/o dynamic gate", {"gate": False}),
    ("w/o shared softmax", {"shared_softmax": False}),
)
# The ablations' options as the frames' ``options`` column writes them (the method is no part of it).
ABLATION_OPTIONS = {MethodLabel("", options).options_text for _, options in ABLATIONS if options}


def method_blocks(
    index: ResultIndex,
    backbone: str | None,
    benchmark: str,
    length: int | None,
    setting: str,
    bases: Sequence[str] = TABLE_BASES,
    ratio: float | None = None,
) -> list[list[str]]:
    """Row groups of a setting: [base, base+reskv] pairs, then unpaired methods, those with any result
    (labels without options: the methods as the paper runs them)."""
    blocks = []
    for base in bases:
        members = [base, base + RESIDUAL_SUFFIX] if base in RESIDUAL_BASES else [base]
        backbones = [backbone] if backbone else index.backbones(benchmark)
        if any(
            index.has(b, benchmark, length, setting, label, ratio) for b in backbones for label in members
        ):
            blocks.append(members)
    return blocks


def row_name(label: str) -> str:
    """A label's row name in a block (``MethodLabel.display``: ``+ResKV`` under its baseline)."""
    return MethodLabel.parse(label).display(under_baseline=True)


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
    heads.append(
        [
            (retained(ratio, index.cache_share(backbone, benchmark, length, ratio)), 1)
            for backbone, length, ratios in groups
            for ratio in ratios
        ]
    )
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
                Row([SETTING_NAMES[setting], row_name(label)], [column[label] for column in columns])
                for label in block
            ]
    coverage = [
        note for backbone, length, _ in groups for note in index.coverage_notes(backbone, benchmark, length)
    ]
    add_notes(table, coverage)
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
                stub + [row_name(label)] if len(stub) > 1 else stub,
                [compared[label][task] for task in tasks]
                + [index.average(backbone, benchmark, length, compared[label])],
            )
            for label in block
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
                budget = retained(ratio, index.cache_share(backbone, benchmark, length, ratio))
                table.body += block_rows([budget, SETTING_NAMES[setting]], setting, ratio, block)
    add_notes(table, index.coverage_notes(backbone, benchmark, length))
    return table


def _task_columns(
    index: ResultIndex, backbone: str, labels: Sequence[str], setting: str, ratio: float
) -> list[tuple[str, int, str]]:
    """(benchmark, length, task) with a result for any of the method ``labels``, benchmark by benchmark."""
    found = index.matching(backbone=backbone, setting=setting, ratio=ratio)
    found = found[found["label"].isin(labels)]
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


def _comparison_settings(index: ResultIndex, marks) -> list[tuple[str, str, float]]:
    """(backbone, setting, ratio) combinations with results of the configurations ``marks`` selects
    (a function of the configurations frame giving a boolean column)."""
    marked = index.configs[marks(index.configs)]
    combos = set(marked[["backbone", "setting", "ratio"]].itertuples(index=False, name=None))
    return sorted(combos, key=lambda combo: (combo[0], combo[1], -combo[2]))


def _task_rows(index, backbone, setting, ratio, columns, names, labels) -> list[Row]:
    """One row per method label over task columns of several benchmarks, compared per task."""
    compared = {
        (benchmark, length): index.compare(backbone, benchmark, length, setting, ratio, labels)
        for benchmark, length, _ in columns
    }
    rows = [
        Row([name], [compared[benchmark, length][label][task] for benchmark, length, task in columns])
        for name, label in zip(names, labels, strict=True)
    ]
    for column in zip(*(row.cells for row in rows), strict=True):
        mark_better(column)
    return rows


def cam_tables(index: ResultIndex) -> list[Table]:
    """tab:snapkv_cam_reskv_tasks: SnapKV, +CaM and SnapKV+ResKV per task, wherever CaM ran."""
    labels = ("snapkv", "cam", "snapkv" + RESIDUAL_SUFFIX)
    tables = []
    for backbone, setting, ratio in _comparison_settings(index, lambda configs: configs["label"] == "cam"):
        columns = _task_columns(index, backbone, labels, setting, ratio)
        table = Table(
            f"cam_{backbone.replace('/', '--')}_{ratio:g}_{setting}",
            f"Task-level comparison under {backbone_name(backbone)}, {retained(ratio)} retained KV, "
            f"{SETTING_NAMES[setting]} cache construction.",
            f"tab:cam_{backbone}_{ratio:g}_{setting}",
            ["Method"],
            _column_heads(columns),
        )
        table.body += _task_rows(
            index, backbone, setting, ratio, columns, ("SnapKV", "+CaM", "+ResKV"), labels
        )
        add_notes(table, [])
        tables.append(table)
    return tables


def ablation_tables(index: ResultIndex) -> list[Table]:
    """tab:ablation_main: ResKV and its ablations per task with the change from ResKV, where ablations ran."""
    tables = []

    def ablations(configs: pd.DataFrame) -> pd.Series:
        return configs["residual"].astype(bool) & configs["options"].isin(ABLATION_OPTIONS)

    for backbone, setting, ratio in _comparison_settings(index, ablations):
        for base in RESIDUAL_BASES:
            labels = [str(MethodLabel(base + RESIDUAL_SUFFIX, options)) for _, options in ABLATIONS]
            columns = _task_columns(index, backbone, labels[1:], setting, ratio)
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
                index, backbone, setting, ratio, columns, [name for name, _ in ABLATIONS], labels
            )
            for column in zip(*(row.cells for row in rows), strict=True):
                for cell in column[1:]:
                    if cell.value is not None and column[0].value is not None:
                        cell.delta = round(cell.value - column[0].value, 2)
            table.body += rows
            add_notes(table, [])
            tables.append(table)
    return tables
