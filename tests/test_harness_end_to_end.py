"""The CI smoke grid end to end through the command line: run, interrupt, resume, tables.

``grid=smoke`` is the tiny random backbone on two RULER tasks, two samples, SnapKV and
SnapKV+ResKV at two ratios in both settings (16 result files). Interrupted runs (``kill -9`` and
Ctrl-C) are resumed and must end with the same files as the uninterrupted run. "The same" means
equal after dropping the wall-clock ``timings`` and the ``run`` entries (``deterministic_view``) and the
``provenance`` block (package versions and git state, equal whenever the code did not change
between the two runs; developers commit concurrently here, so it is left out of the comparison).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from scripts.harness.store import deterministic_view
from scripts.report.tables import main as write_tables
from tests.conftest import journaled_samples, start_interruptible

REPO = Path(__file__).resolve().parent.parent
SMOKE_FILES = 2 * 2 * 2 * 2  # tasks x methods x ratios x settings

pytestmark = pytest.mark.slow


def smoke_command(results_dir: Path, ruler_cache: Path) -> list[str]:
    return [
        sys.executable,
        "run.py",
        "grid=smoke",
        f"results_dir={results_dir}",
        f"benchmark.options.cache_dir={ruler_cache}",
    ]


def run_smoke(results_dir: Path, ruler_cache: Path) -> str:
    result = subprocess.run(
        smoke_command(results_dir, ruler_cache), cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def samples_on_disk(results_dir: Path) -> int:
    """Samples in journals and in finished files (closed as each configuration completes)."""
    runs = results_dir / "runs"
    finished = 0
    for path in runs.rglob("*.json"):
        try:
            finished += len(json.loads(path.read_text())["samples"])
        except (json.JSONDecodeError, KeyError):  # not a result file
            continue
    return journaled_samples(runs) + finished


def interrupt_smoke(results_dir: Path, ruler_cache: Path, signal_number: int, after_records: int) -> None:
    """Start the smoke grid and send ``signal_number`` once ``after_records`` samples are on disk."""
    process = start_interruptible(
        smoke_command(results_dir, ruler_cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if (results_dir / "runs").exists() and samples_on_disk(results_dir) >= after_records:
                os.killpg(process.pid, signal_number)
                break
            time.sleep(0.02)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0, "the run finished before it could be interrupted"


def comparable_files(results_dir: Path) -> dict[str, dict]:
    runs = results_dir / "runs"
    files = {}
    for path in sorted(runs.rglob("*.json")):
        document = deterministic_view(json.loads(path.read_text()))
        assert set(document.pop("provenance")) == {"versions", "git_commit", "git_dirty", "machine"}
        files[str(path.relative_to(runs))] = document
    return files


@pytest.fixture(scope="module")
def ruler_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ruler-cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ruler_cache, worker_id) -> Path:
    """The uninterrupted smoke grid, run once per session: pytest-xdist's workers share it through a
    lock in the session's temporary directory, rather than each worker's module scope running its
    own, a large share of the suite's time budget."""
    session_dir = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        session_dir = session_dir.parent  # above the workers' own directories, inside this session's
    results_dir = session_dir / "smoke-reference"
    with FileLock(f"{results_dir}.lock"):
        if not results_dir.exists():
            output = run_smoke(results_dir, ruler_cache)
            assert "score" in output and "niah_single_1" in output
    return results_dir


def test_smoke_grid_fills_every_table_cell(reference, tmp_path):
    files = comparable_files(reference)
    assert len(files) == SMOKE_FILES
    assert not list((reference / "runs").rglob("*.jsonl"))
    assert list((reference / "logs").rglob("run.log"))
    write_tables(["--results-dir", str(reference), "--out-dir", str(tmp_path)])
    averages = (tmp_path / "ruler_averages.md").read_text().splitlines()
    assert "| Setting | Method | tiny-llama 1K 10% | tiny-llama 1K 40% |" in averages
    rows = [line for line in averages if line.startswith("| q-") or line.startswith("|  | ")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| q-Aware", "SnapKV"],
        ["| ", "+ResKV"],
        ["| q-Agnostic", "SnapKV"],
        ["| ", "+ResKV"],
    ]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[3:-1]]
        assert len(cells) == 2 and all(cell.strip("*").replace(".", "").isdigit() for cell in cells), row
    tasks = (tmp_path / "tasks_tiny-llama_ruler-1024.csv").read_text().splitlines()
    assert tasks[0] == "Budget,Setting,Method,S-1,VT,Avg."
    assert len(tasks) == 1 + 2 * 2 * 2  # header + budgets x settings x methods; no full cache: no row
    for line in tasks[1:]:
        assert all(value.replace(".", "").isdigit() for value in line.split(",")[3:]), line
    latex = (tmp_path / "ruler_averages.tex").read_text()
    assert r"\toprule" in latex and r"\bottomrule" in latex and "--" not in latex.split(r"\midrule")[1]


def test_finished_grid_is_skipped_on_rerun(reference, ruler_cache):
    before = {path: path.read_bytes() for path in (reference / "runs").rglob("*.json")}
    output = run_smoke(reference, ruler_cache)
    assert "0 generations to do" in output and output.count("already complete, skipped") == SMOKE_FILES
    assert {path: path.read_bytes() for path in (reference / "runs").rglob("*.json")} == before


def test_interrupted_grid_resumes_to_identical_files(reference, ruler_cache, tmp_path):
    """Killed (``kill -9``) after 5 samples, resumed and stopped by Ctrl-C after 11, resumed to the
    end: one chain covers both interruptions and a resumed run's own resume, with a smoke run fewer
    than a test per interruption (the suite's time, ``make test``)."""
    for signal_number, after_records in ((signal.SIGKILL, 5), (signal.SIGINT, 11)):
        interrupt_smoke(tmp_path, ruler_cache, signal_number, after_records)
        assert list((tmp_path / "runs").rglob("*.jsonl")), "an interrupted run leaves its journals"
        assert len(list((tmp_path / "runs").rglob("*.json"))) < SMOKE_FILES
    run_smoke(tmp_path, ruler_cache)
    assert comparable_files(tmp_path) == comparable_files(reference)
    assert not list((tmp_path / "runs").rglob("*.jsonl"))
