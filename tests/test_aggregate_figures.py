"""Figures on synthetic data: each written as PNG and PDF; the PCA and cluster helpers are exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scripts.bench.evicted_keys import evicted_with_clusters, pca_projection
from scripts.harness.store import SCHEMA, ResultKey
from scripts.report import figures
from scripts.report.figures import all_figures, efficiency_figure, evicted_keys_figure
from scripts.report.index import ResultIndex


def write_runs(runs, configurations, task="vt") -> None:
    """Result files of (method, ratio, setting, per-sample scores) for SmolLM2 on RULER-4K."""
    for method, ratio, setting, scores in configurations:
        key = ResultKey("smollm2-135m", "ruler", 4096, task, setting, method, ratio)
        key.path(runs).parent.mkdir(parents=True, exist_ok=True)
        samples = [{"index": index, "score": score} for index, score in enumerate(scores)]
        key.path(runs).write_text(
            json.dumps({"schema": SCHEMA, "key": key.to_json(), "samples_total": 2, "samples": samples})
        )


def test_pca_projection_finds_the_main_direction():
    direction = np.array([3.0, 4.0, 0.0]) / 5
    points = np.outer(np.linspace(-2, 2, 9), direction) + np.array([1.0, 1.0, 1.0])
    projected = pca_projection(points)
    assert np.allclose(np.abs(projected[:, 0]), np.abs(np.linspace(-2, 2, 9)))
    assert np.allclose(projected[:, 1], 0)


def test_evicted_keys_are_the_rows_outside_the_main_cache_with_their_nearest_entry():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [10.0, 10.0], [11.0, 10.0], [5.0, 5.0]])
    kept = torch.tensor([False, False, False, False, True])
    evicted, clusters = evicted_with_clusters(keys, kept, torch.tensor([[10.5, 10.0], [0.5, 0.0]]))
    assert evicted.tolist() == keys[:4].tolist()
    assert clusters.tolist() == [1, 1, 0, 0]
    _, no_entries = evicted_with_clusters(keys, kept, torch.zeros(0, 2))
    assert no_entries.tolist() == [0, 0, 0, 0]


def test_every_figure_is_written_from_the_results_directory(tmp_path):
    runs = tmp_path / "runs"
    write_runs(
        runs,
        (
            ("full", None, None, [1, 1]),
            ("snapkv", 0.9, "aware", [1, 0]),
            ("snapkv", 0.6, "aware", [1, 1]),
            ("snapkv+reskv", 0.9, "aware", [1, 0.5]),
        ),
    )
    bench = runs / "_bench"
    bench.mkdir()
    rows = [
        {
            "method": method,
            "context_length": length,
            "peak_memory_bytes": None if oom else length * 2**20,
            "decode_tokens_per_s": None if oom else 1e4 / length,
        }
        for method in ("full", "snapkv", "snapkv+reskv")
        for length in (1024, 2048, 4096)
        for oom in [method == "full" and length == 4096]
    ]
    (bench / "efficiency_smollm2-135m.json").write_text(
        json.dumps({"backbone": "smollm2-135m", "memory_kind": "peak RSS", "rows": rows})
    )
    generator = np.random.default_rng(0)
    panels = [
        {
            "layer": layer,
            "head": 0,
            "projection": generator.normal(size=(40, 2)).tolist(),
            "clusters": [index % 4 for index in range(40)],
        }
        for layer in (3, 7)
    ]
    (bench / "evicted_keys_smollm2-135m.json").write_text(
        json.dumps({"backbone": "smollm2-135m", "panels": panels})
    )
    paths = all_figures(tmp_path, tmp_path / "figures")
    names = sorted(path.name for path in paths)
    assert names == sorted(
        f"{stem}.{suffix}"
        for suffix in ("png", "pdf")
        for stem in (
            "budget_smollm2-135m_ruler-4096_aware",
            "efficiency_smollm2-135m",
            "evicted_keys_smollm2-135m",
        )
    )
    assert all(path.stat().st_size > 1000 for path in paths)


@pytest.mark.parametrize("panel_count", [1, 3])
def test_evicted_keys_figure_takes_any_number_of_panels(tmp_path, panel_count):
    panels = [
        {
            "layer": 0,
            "head": head,
            "projection": np.eye(2)[[0, 0, 1, 1, 0]].tolist(),
            "clusters": [0, 0, 1, 1, 2],
        }
        for head in range(panel_count)
    ]
    assert [path.suffix for path in evicted_keys_figure(panels, "tiny-llama", tmp_path)] == [".png", ".pdf"]


# Measurements as scripts.bench.efficiency writes them, with one row: one length of one method.
ONE_ROW_MEASUREMENTS = {
    "backbone": "tiny-llama",
    "memory_kind": "CUDA max allocated",
    "rows": [
        {"method": "full", "context_length": 1024, "peak_memory_bytes": 2**30, "decode_tokens_per_s": 12.0}
    ],
}


def test_efficiency_figure_needs_no_results_directory(tmp_path):
    paths = efficiency_figure(ONE_ROW_MEASUREMENTS, tmp_path)
    assert [path.name for path in paths] == ["efficiency_tiny-llama.png", "efficiency_tiny-llama.pdf"]


def test_figures_written_at_different_times_are_the_same_bytes(tmp_path, monkeypatch):
    """`make figures` must reproduce the committed files exactly; a PDF would otherwise record the
    time it was written (matplotlib reads SOURCE_DATE_EPOCH as that time when it is set)."""
    written = {}
    for epoch in ("0", "1700000000"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        paths = efficiency_figure(ONE_ROW_MEASUREMENTS, tmp_path / epoch)
        written[epoch] = {path.name: path.read_bytes() for path in paths}
    assert set(written["0"]) == {"efficiency_tiny-llama.png", "efficiency_tiny-llama.pdf"}
    assert written["0"] == written["1700000000"]


def test_budget_figure_keeps_equal_curves_visible_and_names_tasks_and_samples(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    equal = [1, 0]  # SnapKV and +ResKV score the same at both budgets
    write_runs(
        runs,
        [(method, ratio, "aware", equal) for method in ("snapkv", "snapkv+reskv") for ratio in (0.9, 0.6)],
    )
    drawn = []
    monkeypatch.setattr(figures, "save", lambda figure, out_dir, name: drawn.append(figure) or [name])
    index, _ = ResultIndex.from_directory(runs)
    assert figures.budget_figures(index, tmp_path) == ["budget_smollm2-135m_ruler-4096_aware"]
    (axis,) = drawn[0].axes
    assert axis.get_title() == "SmolLM2-135M RULER-4K q-Aware"  # the tables' names
    snapkv, reskv = axis.get_lines()
    assert list(snapkv.get_ydata()) == list(reskv.get_ydata()) == [50.0, 50.0]
    # Equal values, yet neither curve hides the other: other markers and shifted x positions.
    assert snapkv.get_marker() != reskv.get_marker()
    assert all(a < b for a, b in zip(snapkv.get_xdata(), reskv.get_xdata(), strict=True))
    assert all(abs(x - budget) < 3 for x, budget in zip(snapkv.get_xdata(), (10, 40), strict=True))
    note = "\n".join(text.get_text() for text in drawn[0].texts)
    assert "Average over 1 of 13 tasks: VT." in note and "n = 2 samples per task." in note


def test_missing_figure_data_names_the_make_target(tmp_path, capsys):
    write_runs(tmp_path / "runs", [("snapkv", 0.9, "aware", [1, 0])])
    names = sorted(path.name for path in all_figures(tmp_path, tmp_path / "figures"))
    assert names == ["budget_smollm2-135m_ruler-4096_aware.pdf", "budget_smollm2-135m_ruler-4096_aware.png"]
    printed = capsys.readouterr().out
    bench = tmp_path / "runs" / "_bench"
    assert (
        f"efficiency figure: no efficiency_<backbone>.json under {bench}; `make bench RESULTS={tmp_path}`"
        in printed
    )
    assert f"evicted_keys figure: no evicted_keys_<backbone>.json under {bench}; `make bench" in printed
    all_figures(tmp_path / "empty", tmp_path / "figures")
    assert "budget figures: no results under" in capsys.readouterr().out
