"""Every registered method, and its +ResKV, from `run.py` to the JSON, `make tables` and `make figures`.

One grid on the tiny random backbone (one RULER sample, two ratios, both settings, the quality
measures on) runs every method through the real command line; then the tables and the figures
are made from its results directory, and each method must show up wherever it belongs: a result
file per configuration, its row in the averages, task and quality tables (the +ResKV row under its
baseline), its pair in the pair summary, its curve in every budget figure and the per-layer figure.
"""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest

from baselines.registry import FULL_METHOD, METHODS, RESIDUAL_BASES, RESIDUAL_SUFFIX, SPECS
from scripts.harness.records import MethodLabel
from scripts.harness.store import load_results
from scripts.report import figures, tables
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parent.parent
RATIOS = (0.6, 0.9)
SETTINGS = ("aware", "agnostic")


def table_rows(path: Path) -> list[list[str]]:
    with path.open() as handle:
        return list(csv.reader(handle))[1:]


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    """The grid's results directory, the table files and the figures' legend entries by file name."""
    results = tmp_path_factory.mktemp("walk")
    subprocess.run(
        [
            *TINY_RUN,
            f"method=[{','.join(METHODS)}]",
            f"ratio=[{','.join(map(str, RATIOS))}]",
            f"setting=[{','.join(SETTINGS)}]",
            f"results_dir={results}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    tables.main(["--results-dir", str(results)])
    legends: dict[str, list[str]] = {}
    save = figures.save

    def recording_save(figure, out_dir, name):
        legends[name] = [
            text.get_text()
            for axis in figure.axes
            if axis.get_legend()
            for text in axis.get_legend().get_texts()
        ]
        return save(figure, out_dir, name)

    figures.save = recording_save
    try:
        figures.main(["--results-dir", str(results)])
    finally:
        figures.save = save
    return results, legends


def expected_method_cells(method: str) -> list[str]:
    """How the tables name the method's row: a +ResKV row directly under its baseline's."""
    if method.endswith(RESIDUAL_SUFFIX):
        return [SPECS[method.removesuffix(RESIDUAL_SUFFIX)].display, "+ResKV"]
    return [SPECS[method].display]


def rows_follow(cells: list[str], expected: list[str]) -> bool:
    return any(cells[index : index + len(expected)] == expected for index in range(len(cells)))


@pytest.mark.parametrize("method", METHODS)
def test_method_reaches_the_json_every_table_and_every_figure(walked, method):
    results_dir, legends = walked
    found, _, warnings = load_results(results_dir / "runs")
    assert warnings == []
    configurations = {
        (result.key.setting, result.key.ratio) for result in found if result.key.label == method
    }
    out = results_dir / "tables"
    if method == FULL_METHOD:
        assert configurations == {(None, None)}
        for name in ("ruler_averages", "tasks_tiny-llama_ruler-1024", "quality_tiny-llama_ruler-1024"):
            assert [row[0] for row in table_rows(out / f"{name}.csv")].count("Full Cache") == 1, name
        assert all("Full Cache" in legends[f"budget_tiny-llama_ruler-1024_{setting}"] for setting in SETTINGS)
        return
    assert configurations == {(setting, ratio) for setting in SETTINGS for ratio in RATIOS}

    for setting_name in ("q-Aware", "q-Agnostic"):
        averages = [row[1] for row in table_rows(out / "ruler_averages.csv") if row[0] == setting_name]
        assert rows_follow(averages, expected_method_cells(method)), (setting_name, averages)
        for budget in ("40%", "10%"):
            task_rows = table_rows(out / "tasks_tiny-llama_ruler-1024.csv")
            methods = [row[2] for row in task_rows if row[:2] == [budget, setting_name]]
            assert rows_follow(methods, expected_method_cells(method)), (budget, setting_name, methods)
            quality = [
                row[2]
                for row in table_rows(out / "quality_tiny-llama_ruler-1024.csv")
                if row[:2] == [budget, setting_name]
            ]
            assert rows_follow(quality, expected_method_cells(method)), (budget, setting_name, quality)
    base = method.removesuffix(RESIDUAL_SUFFIX)
    if base in RESIDUAL_BASES:
        summary = {row[0] for row in table_rows(out / "pairs_summary_tiny-llama_ruler-1024.csv")}
        assert SPECS[base].display in summary

    name = MethodLabel(method).display()
    for setting in SETTINGS:
        assert name in legends[f"budget_tiny-llama_ruler-1024_{setting}"]
        layer_labels = legends[f"layers_tiny-llama_ruler-1024_{setting}"]
        assert name in layer_labels
        if method.endswith(RESIDUAL_SUFFIX):
            assert all(f"{name} {ratio:g}" in layer_labels for ratio in RATIOS)
