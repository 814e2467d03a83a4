"""A damaged result or journal file (a copy cut short, a byte flipped) stops the run, the tables and
the figures with a message that names the file and says what to do, and nothing is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.harness.store import ResultFile, ResultKey, ResultStoreError, load_results
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parent.parent
KEY = ResultKey("tiny-llama", "ruler", 1024, "vt", "aware", "snapkv", 0.9)


def result_file(runs: Path) -> ResultFile:
    return ResultFile(runs, KEY, (0, 2), 2, {"seed": 42}, lambda scores: 100 * sum(scores) / len(scores))


def record(index: int) -> dict:
    return {"index": index, "prompt_digest": "d", "prompt_tokens": 10, "generated_tokens": 2, "score": 1.0}


def finished_file(runs: Path) -> Path:
    result = result_file(runs).open()
    for index in range(2):
        result.append(record(index))
    result.close()
    return result.path


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


def test_a_truncated_final_file_is_named_and_left_as_it_is(tmp_path):
    path = finished_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-40])  # an interrupted copy
    before = snapshot(tmp_path)
    with pytest.raises(
        ResultStoreError, match=rf"{path} is damaged \(not valid JSON.*delete it to recompute"
    ):
        result_file(tmp_path).open()
    assert snapshot(tmp_path) == before  # no journal created, nothing rewritten
    with pytest.raises(ResultStoreError, match=rf"{path} is damaged"):
        load_results(tmp_path)


def test_a_damaged_journal_line_before_the_last_is_refused_not_cut(tmp_path):
    result = result_file(tmp_path).open()
    result.append(record(0))
    result._journal.close()  # a run that stopped with its journal in place
    lines = result.journal_path.read_bytes().splitlines(keepends=True)
    result.journal_path.write_bytes(lines[0][:-9] + b"\n" + lines[1])  # the header line damaged
    before = snapshot(tmp_path)
    with pytest.raises(ResultStoreError, match=r"\.jsonl is damaged \(line 1 of 2 is not valid JSON"):
        result_file(tmp_path).open()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", [["-m", "scripts.report.tables"], ["-m", "scripts.report.figures"]])
def test_tables_and_figures_stop_with_the_file_and_the_remedy(tmp_path, command):
    path = finished_file(tmp_path / "runs")
    path.write_text(path.read_text()[:100])
    done = subprocess.run(
        [sys.executable, *command, "--results-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert f"{path} is damaged" in done.stderr and "delete it to recompute" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_py_stops_on_a_damaged_file_and_changes_no_other_file(tmp_path):
    command = [*TINY_RUN, "method=[snapkv,tova]", "ratio=0.9", f"results_dir={tmp_path}"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    damaged = next((tmp_path / "runs").rglob("snapkv/0.9.json"))
    damaged.write_bytes(damaged.read_bytes()[:-1000])
    before = snapshot(tmp_path / "runs")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2
    assert f"run.py: error: {damaged} is damaged" in done.stderr and "Traceback" not in done.stderr
    assert snapshot(tmp_path / "runs") == before
