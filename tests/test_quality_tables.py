"""The quality tables (scripts.report.quality_tables) on hand-written result files: every count and mean is
worked out by hand in the comments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.harness.store import SCHEMA, ResultKey, load_results
from scripts.report import figures
from scripts.report.figures import layer_figures
from scripts.report.frames import heads_frame, layers_frame
from scripts.report.index import ResultIndex
from scripts.report.quality_tables import proxy_table
from scripts.report.render import to_markdown
from scripts.report.tables import all_tables

BACKBONE = "smollm2-135m"
# method: {task: [(score, answer_log_prob_gap, kl, attention_error) per sample]}
SAMPLES = {
    "snapkv": {
        "niah_single_1": [(0, -2.0, 0.5, 0.10), (1, -1.0, 0.2, 0.05)],
        "vt": [(0, -4.0, 1.0, 0.20), (0, -4.0, 1.0, 0.20)],
    },
    "snapkv+reskv": {
        "niah_single_1": [(1, -3.0, 0.4, 0.08), (1, 0.5, 0.25, 0.05)],
        "vt": [(0, -2.0, 0.9, 0.10)],  # sample 1 missing: the pair is compared on vt sample 0 only
    },
}
RESIDUAL_ENTRIES = {"snapkv": [[0, 0], [0, 0]], "snapkv+reskv": [[2, 0], [1, 1]]}  # 3 of 4 heads
RESIDUAL_SLOTS = {"snapkv": [[0, 0], [0, 0]], "snapkv+reskv": [[4, 0], [2, 2]]}  # mean 2 of budget 40


def sample(index: int, method: str, values: tuple) -> dict:
    score, gap, kl, error = values
    return {
        "index": index,
        "score": score,
        "cache_stats": {
            "compressed": True,
            "budget": 40,
            "main_slots": [[36, 40], [38, 38]],
            "residual_entries": RESIDUAL_ENTRIES[method],
            "residual_slots": RESIDUAL_SLOTS[method],
        },
        "quality": {
            "answer_log_prob_gap": gap,
            "kl": kl,
            "attention_error": error,
            "residual_share": 0.1 if method.endswith("+reskv") else 0.0,
            "attention_error_by_layer": [error, 2 * error],
            "residual_share_by_layer": [0.2, 0.0] if method.endswith("+reskv") else [0.0, 0.0],
        },
    }


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    runs_dir = root / "runs"
    for method, tasks in SAMPLES.items():
        for task, values in tasks.items():
            key = ResultKey(BACKBONE, "ruler", 4096, task, "aware", method, 0.9)
            path = key.path(runs_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            samples = [sample(index, method, value) for index, value in enumerate(values)]
            path.write_text(
                json.dumps({"schema": SCHEMA, "key": key.to_json(), "samples_total": 2, "samples": samples})
            )
    return root


@pytest.fixture(scope="module")
def tables(results_dir) -> dict:
    index, warnings = ResultIndex.from_directory(results_dir / "runs")
    assert warnings == []
    return {table.name: to_markdown(table) for table in all_tables(index)}


def row(markdown: str, start: str) -> list[str]:
    (line,) = [line for line in markdown.splitlines() if line.startswith(start)]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_pairs_count_samples_closer_to_full_and_tasks_scored_higher(tables):
    pairs = tables["pairs_smollm2-135m_ruler-4096"]
    # Score by task on shared samples: S-1 0.5 -> 1.0 (won), VT 0 -> 0 (tie): 1/2.
    # Three shared samples: |gap| 3>2, 0.5<1, 2<4 -> 2/3; KL .4<.5, .25>.2, .9<1 -> 2/3;
    # attention error .08<.10, .05=.05 (tie), .10<.20 -> 2/3.
    # Means: |gap| 7/3 -> 5.5/3 (-21.4%), KL 1.7/3 -> 1.55/3 (-8.8%), error .35/3 -> .23/3 (-34.3%).
    counts, changes = ["1/2", "2/3", "2/3", "2/3"], ["-21.4", "-8.8", "-34.3"]
    # Score difference: S-1 +100, 0 points (samples 0, 1), VT 0 (sample 0): (50 + 0) / 2 = 25. One
    # prompt differs, too few for any test: the exact bound, 1 of the 3 prompts departing, Clopper-
    # Pearson's upper limit Beta(0.975; 2, 2) = 0.9057 of 3 prompts, each reaching as far as VT's one
    # prompt does (its task's half of the range, 50 points): 136 points, past the range: [-100, 100].
    difference = ["25.00", "[-100.00, 100.00]"]
    assert row(pairs, "| 10% | q-Aware | SnapKV") == [
        "10%",
        "q-Aware",
        "SnapKV",
        *counts,
        *changes,
        *difference,
    ]


def test_pair_summary_counts_configurations_and_mean_differences(tables):
    summary = tables["pairs_summary_smollm2-135m_ruler-4096"]
    # Per task means: S-1 score .5 -> 1, |gap| 1.5 -> 1.25, KL .35 -> .325, error .075 -> .065;
    # VT 0 -> 0, |gap| 4 -> 2, KL 1 -> .9, error .2 -> .1. Differences: score (50 + 0) / 2 = 25 points,
    # gap (0.25 + 2) / 2 = 1.125, KL (-.025 - .1) / 2 = -.0625, error (-.01 - .1) / 2 = -.055.
    won, lost = ["1/2", "2/2", "2/2", "2/2"], ["0/2"] * 4  # VT ties on score
    # Paired: the mean score difference's interval as in the pairs table (VT's one configuration adds
    # 0); won 1 of the 1 configuration decided, the sign test's interval [0.025, 1] (0.025^1).
    paired = ["[-100.00, 100.00]", "1.00", "[0.03, 1.00]"]
    expected = [*won, *lost, "25.00", "1.1250", "-0.0625", "-0.0550", *paired]
    assert row(summary, "| SnapKV | q-Aware")[2:] == expected
    assert row(summary, "|  | both")[2:] == expected


def test_quality_table_means_over_shared_samples_and_residual_footprint(tables):
    quality = tables["quality_smollm2-135m_ruler-4096"]
    # SnapKV on the three shared samples: gap (-2 - 1 - 4) / 3, KL (.5 + .2 + 1) / 3,
    # error (.1 + .05 + .2) / 3.
    snapkv = row(quality, "| 10% | q-Aware | SnapKV")
    assert snapkv[4:11] == ["-2.333", "0.5667", "0.1167", "0.000", "0.0", "0.0", "3"]
    # +ResKV: gap (-3 + .5 - 2) / 3 = -1.5, KL (.4 + .25 + .9) / 3, error (.08 + .05 + .1) / 3; entries
    # in 3 of 4 (layer, head) pairs, r / b = 2 / 40.
    reskv = row(quality, "|  |  | +ResKV")
    assert reskv[4:11] == ["-1.500", "0.5167", "0.0767", "0.100", "75.0", "5.0", "3"]


def test_layers_frame_and_figure_hold_every_sample_layer(results_dir, tmp_path):
    layers = layers_frame(load_results(results_dir / "runs")[0])
    assert len(layers) == 7 * 2  # 7 samples with measures, 2 layers each
    reskv_vt = layers[(layers["label"] == "snapkv+reskv") & (layers["task"] == "vt")]
    assert reskv_vt["attention_error"].tolist() == [0.10, 0.20]  # [error, 2 * error]
    assert reskv_vt["residual_share"].tolist() == [0.2, 0.0]
    paths = layer_figures(layers, tmp_path)
    assert sorted(path.name for path in paths) == [
        "layers_smollm2-135m_ruler-4096_aware.pdf",
        "layers_smollm2-135m_ruler-4096_aware.png",
    ]


def test_proxy_table_counts_heads_per_grid_value(results_dir):
    heads = heads_frame(load_results(results_dir / "runs")[0])
    assert len(heads) == 7 * 4  # 7 samples x 2 layers x 2 KV heads
    table = to_markdown(proxy_table(("smollm2-135m", "ruler", 4096), heads))
    # Per sample r = [[4, 0], [2, 2]] of b = 40: r / b = 0.1, 0, 0.05, 0.05 -> 25% main only, 50% at
    # 0.05, 25% at 0.1; entries [[2, 0], [1, 1]]: 4 of 8 slots; 3 samples x 4 heads.
    assert row(table, "| 10% | q-Aware | SnapKV+ResKV")[3:] == [
        "25.0", "50.0", "25.0", "0.0", "0.0", "0.500", "12"
    ]  # fmt: skip


def test_the_layers_figure_draws_and_names_every_label_ablations_included(tmp_path, monkeypatch):
    """Panel (a) names every label at the tightest budget, panel (b) every +ResKV label (an
    ablation with its options) at every budget."""
    runs_dir = tmp_path / "runs"
    for label, ratio in (
        ("snapkv", 0.9),
        ("snapkv+reskv", 0.9),
        ("snapkv+reskv", 0.6),
        ("snapkv+reskv~gate=false", 0.9),
    ):
        key = ResultKey(BACKBONE, "ruler", 4096, "vt", "agnostic", label, ratio)
        key.path(runs_dir).parent.mkdir(parents=True, exist_ok=True)
        method = label.partition("~")[0]
        document = {"schema": SCHEMA, "key": key.to_json(), "samples_total": 1}
        document["samples"] = [sample(0, method, (0, -1.0, 0.5, 0.1))]
        key.path(runs_dir).write_text(json.dumps(document))
    legends, styles = {}, {}

    def recording_save(figure, out_dir, name):
        legends[name] = [[text.get_text() for text in axis.get_legend().get_texts()] for axis in figure.axes]
        styles[name] = [
            {line.get_label(): (line.get_color(), line.get_linestyle()) for line in axis.get_lines()}
            for axis in figure.axes
        ]
        return []

    monkeypatch.setattr(figures, "save", recording_save)
    figures.layer_figures(layers_frame(load_results(runs_dir)[0]), tmp_path)
    errors, shares = legends["layers_smollm2-135m_ruler-4096_agnostic"]
    assert errors == ["SnapKV", "SnapKV+ResKV", "SnapKV+ResKV (gate=false)"]
    assert shares == ["SnapKV+ResKV 0.6", "SnapKV+ResKV 0.9", "SnapKV+ResKV (gate=false) 0.9"]
    # A label keeps its colour across the panels, a ratio its line style; no two lines look alike.
    errors, shares = styles["layers_smollm2-135m_ruler-4096_agnostic"]
    for panel in (errors, shares):
        assert len(set(panel.values())) == len(panel)
    assert shares["SnapKV+ResKV 0.6"][0] == shares["SnapKV+ResKV 0.9"][0] == errors["SnapKV+ResKV"][0]
    assert shares["SnapKV+ResKV 0.6"][1] != shares["SnapKV+ResKV 0.9"][1]
    assert shares["SnapKV+ResKV (gate=false) 0.9"][0] == errors["SnapKV+ResKV (gate=false)"][0]


def test_proxy_table_bins_heads_by_the_recorded_choice_of_the_runs_grid(tmp_path):
    """A run with another grid: each head counts under the ratio the compressor recorded (0.3 here),
    where the default grid nearest to r / b would say 0.2."""
    key = ResultKey(BACKBONE, "ruler", 4096, "vt", "aware", "snapkv+reskv~grid=0-0.3", 0.9)
    record = sample(0, "snapkv+reskv", (1, -1.0, 0.5, 0.1))
    record["cache_stats"] |= {
        "residual_slots": [[12, 0], [12, 12]],  # floor(0.3 * 40 + 0.5) = 12
        "residual_entries": [[12, 0], [11, 12]],
        "residual_choice": [[0.3, 0.0], [0.3, 0.3]],
    }
    key.path(tmp_path).parent.mkdir(parents=True)
    key.path(tmp_path).write_text(
        json.dumps({"schema": SCHEMA, "key": key.to_json(), "samples_total": 1, "samples": [record]})
    )
    table = proxy_table((BACKBONE, "ruler", 4096), heads_frame(load_results(tmp_path)[0]))
    markdown = to_markdown(table)
    assert table.heads[-1][:7] == [
        ("r = 0", 1),
        ("0.05", 1),
        ("0.1", 1),
        ("0.15", 1),
        ("0.2", 1),
        ("0.3", 1),
        ("Entries / r", 1),
    ]
    # 1 of 4 heads main only, 3 at 0.3; entries 35 of 36 slots.
    assert row(markdown, "| 10% | q-Aware | SnapKV+ResKV (grid=0-0.3)")[3:] == [
        "25.0", "0.0", "0.0", "0.0", "0.0", "75.0", "0.972", "4"
    ]  # fmt: skip
