"""The aggregators on hand-written result files: every cell, bold mark and average is known exactly.

The files are written here as JSON by hand (not by the runner), with the fields the aggregators
read; per-sample scores are chosen so every task score and average has an exact two-decimal value.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from scripts.harness.store import SCHEMA, UNAVAILABLE_SCHEMA, ResultKey
from scripts.report.index import ResultIndex
from scripts.report.render import Cell, mark_better, to_csv, to_latex, to_markdown
from scripts.report.tables import all_tables, main

BACKBONE = "llama3.1-8b-instruct"

# (setting, method, ratio): {task: per-sample scores}; samples_total is 4 for every task.
RUNS = {
    (None, "full", None): {"niah_single_1": [1, 1, 1, 0], "vt": [1, 1, 0.5, 0.5]},  # 75, 75 -> 75
    ("aware", "snapkv", 0.9): {"niah_single_1": [1, 0, 0, 0], "vt": [1, 0.5, 0, 0]},  # 25, 37.5 -> 31.25
    ("aware", "snapkv+reskv", 0.9): {"niah_single_1": [1, 1, 0, 0], "vt": [1, 0, 0, 0]},  # 50, 25 -> 37.5
    ("aware", "snapkv", 0.6): {"niah_single_1": [1, 1, 1, 1], "vt": [1, 1, 1, 0]},  # 100, 75 -> 87.5
    ("aware", "snapkv+reskv", 0.6): {"niah_single_1": [1, 1, 1, 1]},  # vt missing -> average missing
    ("aware", "adakv", 0.9): {"niah_single_1": [1, 1], "vt": [0, 0, 0, 0]},  # partial: 100+, 0 -> 50+
    ("agnostic", "snapkv", 0.9): {"niah_single_1": [0.5, 0, 0, 0], "vt": [0, 0, 0, 0]},  # 12.5, 0 -> 6.25
    ("agnostic", "snapkv+reskv", 0.9): {"niah_single_1": [0.5, 0, 0, 0], "vt": [0, 0, 0, 0]},  # tie 6.25
    ("agnostic", "cam", 0.9): {"niah_single_1": [0.5, 0.5, 0, 0], "vt": [0, 0, 0, 0]},  # 25, 0 -> 12.5
    ("agnostic", "snapkv+reskv~validate=false", 0.9): {"niah_single_1": [0, 0, 0, 0]},  # 0 (-12.50)
    ("agnostic", "snapkv+reskv~gate=false", 0.9): {"niah_single_1": [0.5, 0.5, 0, 0]},  # 25 (+12.50)
}


def write_result(runs_dir: Path, key: ResultKey, scores: list[float], samples_total: int = 4) -> None:
    samples = [
        {"index": index, "score": score, "prediction": f"answer {index}"}
        for index, score in enumerate(scores)
    ]
    path = key.path(runs_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"schema": SCHEMA, "key": key.to_json(), "samples_total": samples_total, "samples": samples}
        )
    )


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    runs_dir = root / "runs"
    for (setting, method, ratio), tasks in RUNS.items():
        for task, scores in tasks.items():
            write_result(runs_dir, ResultKey(BACKBONE, "ruler", 4096, task, setting, method, ratio), scores)
    marker = runs_dir / BACKBONE / "ruler-4096" / "qa_1" / "unavailable.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(
        json.dumps(
            {
                "schema": UNAVAILABLE_SCHEMA,
                "backbone": BACKBONE,
                "benchmark": "ruler",
                "length": 4096,
                "task": "qa_1",
                "reason": "SQuAD not found",
            }
        )
    )
    return root


@pytest.fixture(scope="module")
def tables(results_dir) -> dict:
    index, warnings = ResultIndex.from_directory(results_dir / "runs")
    assert warnings == []
    return {table.name: table for table in all_tables(index)}


def body_lines(latex: str) -> list[str]:
    return latex[latex.index(r"\midrule") : latex.index(r"\bottomrule")].splitlines()


def test_table_set(tables):
    assert sorted(tables) == [
        "ablation_llama3.1-8b-instruct_snapkv_0.9_agnostic",
        "cam_llama3.1-8b-instruct_0.9_agnostic",
        "ruler_averages",
        "tasks_llama3.1-8b-instruct_ruler-4096",
        # The ablation runs are cells of the paper's tab:ablation_main; its averages cover 2 of 13 tasks,
        # so they are compared in the claims only (tests/test_verdict.py).
        "verdict_cells_llama3.1-8b-instruct",
        "verdict_claims_llama3.1-8b-instruct",
        "verdict_pairs_llama3.1-8b-instruct",
    ]


def test_the_verdict_compares_no_average_over_fewer_tasks_than_the_papers(tables):
    # The averages here cover 2 of RULER's 13 tasks: none is held against the paper's numbers; the
    # ablation runs are task cells of tab:ablation_main, and are.
    for name in ("verdict_cells_llama3.1-8b-instruct", "verdict_pairs_llama3.1-8b-instruct"):
        rows = [row for row in tables[name].body if not isinstance(row, str)]
        assert {row.stub[0] for row in rows} == {"tab:ablation_main"}


def test_ruler_averages_latex(tables):
    latex = to_latex(tables["ruler_averages"])
    assert r"\multicolumn{2}{c}{\textbf{LLaMA-3.1-8B}}" in latex
    assert r"\textbf{Setting} & \textbf{Method} & \textbf{10\%} & \textbf{40\%} \\" in latex
    assert body_lines(latex) == [
        r"\midrule",
        r"\multicolumn{2}{@{}l}{Full Cache} & \multicolumn{2}{c}{75.00} \\",
        r"\midrule",
        r"q-Aware & AdaKV & 50.00$^\dagger$ & -- \\",
        r" & +ResKV & -- & -- \\",
        r"\cmidrule(lr){2-4}",
        r" & SnapKV & 31.25 & 87.50 \\",
        r" & +ResKV & \textbf{37.50} & -- \\",
        r"\midrule",
        r"q-Agnostic & SnapKV & 6.25 & -- \\",  # a tie: neither is bold
        r" & +ResKV & 6.25 & -- \\",
        r"\cmidrule(lr){2-4}",
        r" & CaM & 12.50 & -- \\",
    ]
    # Averages cover the two tasks that ran; qa_1 is unavailable and named in the caption.
    assert "averages over 2 of 13 tasks (niah\\_single\\_1, vt)" in latex
    assert "qa\\_1 unavailable (data missing), excluded from averages" in latex
    assert r"--: not run" in latex and r"$^\dagger$: partial" in latex
    assert "n = 2 to 4 samples per task." in latex  # AdaKV's S-1 has 2 of 4


def test_task_table_latex(tables):
    latex = to_latex(tables["tasks_llama3.1-8b-instruct_ruler-4096"])
    stub_heads = r"\textbf{Budget} & \textbf{Setting} & \textbf{Method}"
    assert stub_heads + r" & \textbf{S-1} & \textbf{VT} & \textbf{QA-1} & \textbf{Avg.} \\" in latex
    lines = body_lines(latex)
    assert r"\multicolumn{3}{@{}l}{Full Cache} & 75.00 & 75.00 & n/a & 75.00 \\" in lines
    assert r" &  & SnapKV & 25.00 & 37.50 & n/a & 31.25 \\" in lines
    assert r" &  & +ResKV & 50.00 & 25.00 & n/a & \textbf{37.50} \\" in lines
    assert r"10\% & q-Aware & AdaKV & 100.00$^\dagger$ & 0.00 & n/a & 50.00$^\dagger$ \\" in lines
    assert r"40\% & q-Aware & SnapKV & 100.00 & 75.00 & n/a & 87.50 \\" in lines
    assert r" &  & +ResKV & 100.00 & -- & n/a & -- \\" in lines
    # Only (budget, setting) groups with results: 40% has q-Aware SnapKV rows and nothing more.
    forty = lines.index(r"40\% & q-Aware & SnapKV & 100.00 & 75.00 & n/a & 87.50 \\")
    assert lines[forty + 1 :] == [r" &  & +ResKV & 100.00 & -- & n/a & -- \\"]
    assert r"10\% & q-Agnostic & SnapKV & 12.50 & 0.00 & n/a & 6.25 \\" in lines  # tied with +ResKV


def test_cam_table(tables):
    table = tables["cam_llama3.1-8b-instruct_0.9_agnostic"]
    lines = body_lines(to_latex(table))
    assert lines[1:] == [
        r"SnapKV & 12.50 & 0.00 \\",  # VT: a three-way tie, nothing bold
        r"+CaM & \textbf{25.00} & 0.00 \\",
        r"+ResKV & 12.50 & 0.00 \\",
    ]
    assert r"\multicolumn{2}{c}{\textbf{RULER-4K}}" in to_latex(table)


def test_ablation_table(tables):
    lines = body_lines(to_latex(tables["ablation_llama3.1-8b-instruct_snapkv_0.9_agnostic"]))
    assert lines[1:] == [
        r"ResKV & 12.50 \\",
        r"w/o validation & 0.00 {\scriptsize (-12.50)} \\",
        r"w/o dynamic gate & \textbf{25.00} {\scriptsize (+12.50)} \\",
        r"w/o shared softmax & -- \\",
    ]


def test_tables_name_a_label_from_its_frame_columns(results_dir):
    """Row names from the configurations' ``base_method``, ``residual`` and ``options`` columns: the
    registry's display names, ``+ResKV`` under its baseline, options in brackets (the method then named
    in full); a registry method without results (a row shown as --) named by the registry."""
    index, _ = ResultIndex.from_directory(results_dir / "runs")
    names = {
        label: (index.method_name(label), index.method_name(label, under_baseline=True))
        for label in ("snapkv", "snapkv+reskv", "cam", "snapkv+reskv~validate=false", "adakv+reskv")
    }
    assert names == {
        "snapkv": ("SnapKV", "SnapKV"),
        "snapkv+reskv": ("SnapKV+ResKV", "+ResKV"),
        "cam": ("CaM", "CaM"),
        "snapkv+reskv~validate=false": ("SnapKV+ResKV (validate=false)", "SnapKV+ResKV (validate=false)"),
        "adakv+reskv": ("AdaKV+ResKV", "+ResKV"),
    }


def test_markdown_and_csv(tables):
    table = tables["ruler_averages"]
    markdown = to_markdown(table)
    assert "| Setting | Method | LLaMA-3.1-8B 4K 10% | LLaMA-3.1-8B 4K 40% |" in markdown
    assert "| Full Cache |  | 75.00 | 75.00 |" in markdown
    assert "|  | +ResKV | **37.50** | -- |" in markdown
    rows = list(csv.reader(to_csv(table).splitlines()))
    assert rows[0] == ["Setting", "Method", "LLaMA-3.1-8B 4K 10%", "LLaMA-3.1-8B 4K 40%"]
    assert ["q-Aware", "AdaKV", "50.00\u2020", ""] in rows
    assert ["q-Aware", "+ResKV", "37.50", ""] in rows


def test_cli_writes_every_format(results_dir, tmp_path):
    main(["--results-dir", str(results_dir), "--out-dir", str(tmp_path)])
    for name in ("ruler_averages", "tasks_llama3.1-8b-instruct_ruler-4096"):
        for suffix in (".tex", ".md", ".csv"):
            assert (tmp_path / f"{name}{suffix}").is_file()
    assert r"\input{ruler_averages.tex}" in (tmp_path / "tables.tex").read_text()
    # The results as data beside the tables: one row per configuration (and the unavailable task).
    results = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(results) == sum(len(tasks) for tasks in RUNS.values()) + 1
    adakv = [row for row in results if row["method"] == "adakv" and row["task"] == "niah_single_1"]
    assert [(row["score"], row["n_samples"], row["status"]) for row in adakv] == [("100.0", "2", "partial")]

    # Each score's 95% interval (scripts.report.statistics): Wilson's for k of n answered, in points.
    def wilson(k: int, n: int) -> tuple[str, str]:
        z2 = 1.959963984540054**2
        centre, half = (k + z2 / 2) / (n + z2), math.sqrt(z2) * math.sqrt(k * (n - k) / n + z2 / 4) / (n + z2)
        return str(round(100 * (centre - half), 2)), str(round(100 * (centre + half), 2))

    assert (adakv[0]["score_low"], adakv[0]["score_high"]) == wilson(2, 2) == ("34.24", "100.0")
    (snapkv,) = [
        row
        for row in results
        if (row["method"], row["task"], row["setting"], row["ratio"])
        == ("snapkv", "niah_single_1", "aware", "0.9")
    ]
    assert (snapkv["score"], snapkv["score_low"], snapkv["score_high"]) == ("25.0", *wilson(1, 4))
    samples = list(csv.DictReader((tmp_path / "samples.csv").open()))
    assert len(samples) == sum(len(scores) for tasks in RUNS.values() for scores in tasks.values())


def test_show_n_puts_each_cells_sample_count_in_markdown_and_csv(tables):
    table = tables["ruler_averages"]
    assert "| q-Aware | AdaKV | 50.00\u2020 (n=2-4) | -- |" in to_markdown(table, show_n=True)
    assert ["q-Agnostic", "SnapKV", "6.25 (n=4)", ""] in list(
        csv.reader(to_csv(table, show_n=True).splitlines())
    )
    assert "(n=" not in to_latex(table) and "(n=" not in to_markdown(table)


def test_bold_marks_only_a_strict_winner():
    cells = [Cell(50.0), Cell(50.0), Cell(20.0)]
    mark_better(cells)
    assert [cell.bold for cell in cells] == [False, False, False]
    equal_when_shown = [Cell(50.004), Cell(49.996)]  # both print as 50.00
    mark_better(equal_when_shown)
    assert [cell.bold for cell in equal_when_shown] == [False, False]
    winner = [Cell(None), Cell(60.0), Cell(50.0)]
    mark_better(winner)
    assert [cell.bold for cell in winner] == [False, True, False]
    alone = [Cell(70.0), Cell(None)]
    mark_better(alone)
    assert [cell.bold for cell in alone] == [False, False]


def test_pair_with_mixed_sample_counts_is_compared_on_shared_samples(tmp_path):
    """TOVA ran 3 samples, its +ResKV and the full cache 2 (each a complete file of its run).

    On all its samples TOVA would lead (1/3 = 33.33 against 25.00); on the 2 samples both have it
    scores 0.00, so +ResKV is the winner, and every cell has fewer samples than the task has (3).
    """
    runs_dir = tmp_path / "runs"
    for setting, method, ratio, scores in (
        (None, "full", None, [1, 1]),
        ("aware", "tova", 0.7, [0, 0, 1]),
        ("aware", "tova+reskv", 0.7, [0, 0.5]),
    ):
        key = ResultKey("smollm2-135m", "ruler", 4096, "niah_single_1", setting, method, ratio)
        write_result(runs_dir, key, scores, samples_total=len(scores))
    tables = {table.name: table for table in all_tables(ResultIndex.from_directory(runs_dir)[0])}
    averages = to_latex(tables["ruler_averages"])
    assert body_lines(averages) == [
        r"\midrule",
        r"\multicolumn{2}{@{}l}{Full Cache} & 100.00$^\dagger$ \\",
        r"\midrule",
        r"q-Aware & TOVA & 0.00$^\dagger$ \\",
        r" & +ResKV & \textbf{25.00}$^\dagger$ \\",
    ]
    assert r"$^\dagger$: partial" in averages and "n = 2 samples per task." in averages
    task_lines = body_lines(to_latex(tables["tasks_smollm2-135m_ruler-4096"]))
    assert r"30\% & q-Aware & TOVA & 0.00$^\dagger$ & 0.00$^\dagger$ \\" in task_lines
    assert r" &  & +ResKV & 25.00$^\dagger$ & \textbf{25.00}$^\dagger$ \\" in task_lines
    assert "| q-Aware | TOVA | 0.00\u2020 (n=2) |" in to_markdown(tables["ruler_averages"], show_n=True)


def test_cli_reads_several_results_roots_as_one(results_dir, tmp_path):
    """Two roots, the fixture's files split between them by setting, give the tables of one root
    holding them all, file for file."""
    split = tmp_path / "split"
    for path in (results_dir / "runs").rglob("*.json"):
        relative = path.relative_to(results_dir / "runs")
        part = "agnostic" if "agnostic" in relative.parts else "rest"
        target = split / part / "runs" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    main(["--results-dir", str(results_dir), "--out-dir", str(tmp_path / "one")])
    main(["--results-dir", str(split / "rest"), str(split / "agnostic"), "--out-dir", str(tmp_path / "two")])
    one = {path.name: path.read_bytes() for path in (tmp_path / "one").iterdir()}
    two = {path.name: path.read_bytes() for path in (tmp_path / "two").iterdir()}
    assert len(one) > 20 and one == two


def test_cli_summary_writes_the_averages_and_the_claims_only(results_dir, tmp_path):
    main(["--results-dir", str(results_dir), "--out-dir", str(tmp_path), "--summary"])
    names = {"ruler_averages", f"verdict_claims_{BACKBONE}"}
    expected = {f"{name}{suffix}" for name in names for suffix in (".tex", ".md", ".csv")}
    assert {path.name for path in tmp_path.iterdir()} == expected | {"tables.md", "tables.tex"}


def test_cli_names_a_missing_root_and_asks_for_an_out_dir_with_several(results_dir, tmp_path, capsys):
    for argv, message in (
        ([str(tmp_path / "nowhere")], f"--results-dir {tmp_path / 'nowhere'}: no such directory"),
        (
            [str(results_dir), str(tmp_path)],
            f"--out-dir is needed with several --results-dir ({results_dir}, ",
        ),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(["--results-dir", *argv])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_cli_on_a_results_directory_without_results(tmp_path, capsys):
    main(["--results-dir", str(tmp_path), "--out-dir", str(tmp_path / "tables")])
    assert "0 tables written" in capsys.readouterr().out
    assert (tmp_path / "tables" / "results.csv").read_text().startswith("backbone,benchmark,length,task")
