"""The results frames (``scripts.report.frames``) as the tables look them up: blocks of compared
methods scored on shared samples, averages, and which configurations exist.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

import benchmarks
from scripts.harness.records import MethodLabel, display_name
from scripts.report.frames import (
    TASK_COLUMNS,
    frames_from_runs,
)
from scripts.report.names import averaged_task_set, backbone_name, benchmark_name
from scripts.report.render import Cell


def _ordered(values: Iterable, order: Sequence) -> list:
    position = {value: index for index, value in enumerate(order)}
    return sorted(set(values), key=lambda value: (position.get(value, len(order)), value))


def _ratio_key(ratio: float | None) -> float:
    """A ratio as a lookup key: six decimals; 0 for the full cache, which has none."""
    return 0.0 if ratio is None or pd.isna(ratio) else round(float(ratio), 6)


# The retained shares of a configuration (reskv.stats.CacheStats), averaged over its samples.
CACHE_SHARE, COMPRESSED_SHARE = "mean_cache_stats.retained_cache", "mean_cache_stats.retained_compressed"


class ResultIndex:
    """The results frames (scripts.report.frames) as the tables look them up: blocks of compared
    methods scored on shared samples, averages, and which configurations exist."""

    def __init__(self, samples: pd.DataFrame, configs: pd.DataFrame):
        available = configs["status"] != "unavailable"
        self.configs = configs[available].assign(
            setting=lambda frame: frame["setting"].fillna(""),
            ratio=lambda frame: frame["ratio"].map(_ratio_key),
        )
        self.unavailable = set(configs.loc[~available, TASK_COLUMNS].itertuples(index=False, name=None))
        parts = self.configs.drop_duplicates("label")[["label", "base_method", "residual", "options"]]
        self.label_parts = {
            label: (base, bool(residual), options) for label, base, residual, options in parts.values
        }
        self.task_samples = (
            self.configs.groupby(TASK_COLUMNS)["task_samples"].max().to_dict() if len(self.configs) else {}
        )
        slices = samples.assign(setting=samples["setting"].fillna(""), ratio=samples["ratio"].map(_ratio_key))
        self.samples = slices
        self.slices = dict(list(slices.groupby(["backbone", "benchmark", "length", "setting", "ratio"])))
        self._tasks: dict[tuple, list[str]] = {}  # tasks() of each backbone, benchmark and length
        self._shared: dict[tuple, dict] = {}  # shared_scores() of each block
        self._twins: dict[tuple, str] | None = None  # twins()

    def method_name(self, label: str, under_baseline: bool = False) -> str:
        """How tables and figures name ``label`` (``display_name``), read from its configurations'
        ``base_method``, ``residual`` and ``options`` columns; a registry method without results (a
        table's row shown as ``--``) is named by the registry."""
        parts = self.label_parts.get(label)
        return (
            MethodLabel(label).display(under_baseline)
            if parts is None
            else display_name(*parts, under_baseline)
        )

    @classmethod
    def from_directory(cls, runs_dir: Path) -> tuple[ResultIndex, list[str]]:
        samples, configs, warnings = frames_from_runs(runs_dir)
        return cls(samples, configs), warnings

    def matching(self, **values) -> pd.DataFrame:
        """Configurations matching ``values``; a None value matches any."""
        frame = self.configs
        for column, value in values.items():
            if value is not None:
                frame = frame[frame[column] == (_ratio_key(value) if column == "ratio" else value)]
        return frame

    def backbones(self, benchmark: str) -> list[str]:
        return sorted(set(self.matching(benchmark=benchmark)["backbone"]))

    def lengths(self, backbone: str, benchmark: str) -> list[int]:
        return sorted(set(self.matching(backbone=backbone, benchmark=benchmark)["length"]))

    def ratios(self, backbone: str, benchmark: str, length: int | None = None) -> list[float]:
        """Ratios present, the tightest budget (largest ratio) first as the paper orders them."""
        ratios = self.matching(backbone=backbone, benchmark=benchmark, length=length)["ratio"]
        return sorted(set(ratios) - {0.0}, reverse=True)

    def cache_share(self, backbone: str, benchmark: str, length: int, ratio: float) -> float | None:
        """The retained share of the whole cache at ``ratio`` (``cache_stats.retained_cache``, the mean
        over its configurations), where it differs from the compressed layers' share: a model with
        sliding-window layers (reskv.md, Hybrid attention). ``None`` elsewhere, and for records
        written before the field existed."""
        if CACHE_SHARE not in self.configs:
            return None
        found = self.matching(backbone=backbone, benchmark=benchmark, length=length, ratio=ratio)
        cache, compressed = found[CACHE_SHARE].mean(), found[COMPRESSED_SHARE].mean()
        if pd.isna(cache) or abs(cache - compressed) < 1e-9:
            return None
        return float(cache)

    def tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """Tasks with a result or an unavailable mark, in the benchmark's order."""
        if (backbone, benchmark, length) not in self._tasks:
            found = set(self.matching(backbone=backbone, benchmark=benchmark, length=length)["task"])
            found |= {
                task for *where, task in self.unavailable if tuple(where) == (backbone, benchmark, length)
            }
            self._tasks[backbone, benchmark, length] = _ordered(found, benchmarks.tasks(benchmark))
        return list(self._tasks[backbone, benchmark, length])

    def averaged_tasks(self, backbone: str, benchmark: str, length: int) -> list[str]:
        """The tasks an average covers: available ones (LongBench: its 16 English tasks only)."""
        return [
            task
            for task in self.tasks(backbone, benchmark, length)
            if (backbone, benchmark, length, task) not in self.unavailable
            and task in averaged_task_set(benchmark)
        ]

    def has(self, backbone, benchmark, length, setting, label, ratio=None) -> bool:
        """Whether any result of method label ``label`` matches; None for length, setting or ratio
        matches any."""
        return not self.matching(
            backbone=backbone, benchmark=benchmark, length=length, setting=setting, label=label, ratio=ratio
        ).empty

    def compare(self, backbone, benchmark, length, setting, ratio, labels: Sequence[str]) -> dict[str, dict]:
        """Task cells ``{label: {task: Cell}}`` of method labels shown side by side (a baseline and its
        +ResKV, the CaM or ablation rows): per task, every label present is scored on the samples
        all of them scored, so a pair never compares different samples. A cell is partial when the
        samples all of them ran are fewer than the task has so far (``task_samples``)."""
        tasks = self.tasks(backbone, benchmark, length)
        cells = {
            label: {
                task: Cell(unavailable=(backbone, benchmark, length, task) in self.unavailable)
                for task in tasks
            }
            for label in labels
        }
        for task, (shared, scores) in self.shared_scores(
            backbone, benchmark, length, setting, ratio, labels
        ).items():
            partial = shared < self.task_samples[(backbone, benchmark, length, task)]
            for label, values in scores.items():
                value = benchmarks.task_score(benchmark, values.tolist()) if len(values) else None
                cells[label][task] = Cell(value, partial=partial, n=(len(values), len(values)))
        return cells

    def shared_scores(
        self, backbone, benchmark, length, setting, ratio, labels: Sequence[str]
    ) -> dict[str, tuple[int, dict[str, pd.Series]]]:
        """Per available task with results: how many samples every label present ran (scored or
        skipped), and each label's sample scores (fractions, by sample index) on the samples all of
        them scored: what ``compare`` scores a block on, and what its intervals resample."""
        where = (backbone, benchmark, length, setting or "", _ratio_key(ratio))
        if (*where, *labels) in self._shared:
            return self._shared[(*where, *labels)]
        rows = self.slices.get(where)
        found = self._shared[(*where, *labels)] = {}
        if rows is None:
            return found
        selected = rows[rows["label"].isin(labels)]
        sample = [selected["task"], selected["index"]]
        present = selected.groupby("task")["label"].transform("nunique")  # methods with the task
        ran = selected.groupby(sample)["label"].transform("size") == present
        scored = selected["score"].notna().groupby(sample).transform("sum") == present
        shared = selected[ran].groupby("task")["index"].nunique()
        kept = dict(list(selected[scored].groupby(["task", "label"])))
        empty = pd.Series(dtype=float, name="score", index=pd.Index([], name="index"))
        for task, found_labels in selected.groupby("task")["label"].unique().items():
            if (backbone, benchmark, length, task) not in self.unavailable:
                found[task] = (
                    int(shared.get(task, 0)),
                    {
                        label: kept[(task, label)].set_index("index")["score"]
                        if (task, label) in kept
                        else empty
                        for label in sorted(found_labels)
                    },
                )
        return found

    def sample_values(
        self, backbone, benchmark, length, setting, ratio, label: str, column: str
    ) -> dict[str, pd.Series]:
        """Per task, ``label``'s per-sample ``column`` (a samples frame column, such as
        ``quality.answer_log_prob_gap``) by sample index; empty where the samples lack the column."""
        rows = self.slices.get((backbone, benchmark, length, setting or "", _ratio_key(ratio)))
        if rows is None or column not in rows.columns:
            return {}
        rows = rows[rows["label"] == label]
        return {task: group.set_index("index")[column].astype(float) for task, group in rows.groupby("task")}

    def twins(self) -> dict[tuple, str]:
        """Configurations whose outputs are identical to another's of the same backbone, benchmark,
        length, setting and budget (the same prediction and score on every task and sample: with one KV
        head, AdaKV's allocation has nothing to move and it is SnapKV), each mapped to the first label
        of its group: ``(backbone, benchmark, length, setting, ratio, label) -> label``. Configurations
        whose samples lack a prediction are never twins (there is nothing to compare)."""
        if self._twins is None:
            self._twins = {}
            if "prediction" in self.samples.columns:
                columns = ["task", "index", "prediction", "score"]
                for where, rows in self.slices.items():
                    groups: dict[tuple, list[str]] = {}
                    for label, outputs in rows.groupby("label"):  # labels in sorted order
                        if not outputs["prediction"].isna().any():
                            ordered = outputs[columns].sort_values(["task", "index"])
                            groups.setdefault(tuple(ordered.itertuples(index=False)), []).append(label)
                    for labels in groups.values():
                        if len(labels) > 1:
                            self._twins |= {(*where, label): labels[0] for label in labels}
        return self._twins

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

    def block_averages(self, backbone, benchmark, length, setting, ratio, labels) -> dict[str, Cell]:
        """Average cell of each method label of a block, its members compared on shared samples."""
        compared = self.compare(backbone, benchmark, length, setting, ratio, labels)
        return {label: self.average(backbone, benchmark, length, compared[label]) for label in labels}

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
