"""The committed results/ruler4k: its result files load unchanged and `make tables` regenerates
its committed tables byte for byte (the on-disk JSON format and every table rule held still)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.harness.store import load_results
from scripts.report import tables

COMMITTED = Path(__file__).resolve().parent.parent / "results" / "ruler4k"


def test_committed_result_files_load_without_warnings():
    results, unavailable, warnings = load_results(COMMITTED / "runs")
    assert warnings == []
    # results/README.md: 517 configurations on the 11 tasks available offline; qa_1 and qa_2 marked.
    assert len(results) == 517
    assert len({result.key.task for result in results}) == 11
    assert sorted(mark["task"] for mark in unavailable) == ["qa_1", "qa_2"]


@pytest.mark.slow
def test_make_tables_regenerates_the_committed_tables_byte_for_byte(tmp_path):
    tables.main(["--results-dir", str(COMMITTED), "--out-dir", str(tmp_path)])
    committed = {path.name: path.read_bytes() for path in (COMMITTED / "tables").iterdir()}
    regenerated = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(regenerated) == sorted(committed)
    changed = [name for name in committed if regenerated[name] != committed[name]]
    assert changed == []
