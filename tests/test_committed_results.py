"""The committed results/ruler4k: its result files load unchanged and `make tables` regenerates
its committed tables byte for byte (the on-disk JSON format and every table rule held still)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.harness.plan import compose_plan
from scripts.harness.store import SCHEMA, ResultFile, ResultKey, load_results, without_default_options
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


# The three commands of `make reproduce-ruler4k` (Makefile), as plans: what each would run.
REPRODUCE = [
    [
        "method=[full,snapkv,snapkv+reskv,adakv,adakv+reskv]",
        "ratio=[0.6,0.7,0.8,0.9]",
        "setting=[aware,agnostic]",
    ],
    ["method=[tova,tova+reskv,h2o,h2o+reskv,cam]", "ratio=0.9", "setting=[aware,agnostic]"],
    [
        "ratio=0.9",
        "setting=agnostic",
        "method=['snapkv+reskv~validate=false','snapkv+reskv~gate=false',"
        "'snapkv+reskv~shared_softmax=false','snapkv+reskv~final_selection=fit']",
    ],
]


def test_every_committed_result_file_resumes_under_the_reproduction_command(tmp_path):
    """`make reproduce-ruler4k` finds nothing to run: each committed file (its identity written with
    every option at its default) is the configuration today's plan gives, and opens complete."""
    entries = {}
    for overrides in REPRODUCE:
        common = ["backbone=smollm2-135m", "benchmark=ruler", "benchmark.length=4096", "benchmark.tasks=all"]
        plan = compose_plan([*common, *overrides, f"results_dir={tmp_path}"])
        entries |= {entry.key(plan, task): (plan, entry) for task in plan.tasks for entry in plan.grid}
    documents = {path: json.loads(path.read_text()) for path in (COMMITTED / "runs").rglob("*.json")}
    documents = {path: document for path, document in documents.items() if document.get("schema") == SCHEMA}
    assert len(documents) == 517
    for path, document in documents.items():
        plan, entry = entries[ResultKey.from_json(document["key"])]
        identity = plan.identity(entry, document["provenance"]["machine"]["dtype"])
        assert without_default_options(document["config"]) == identity, path
    for label in ("full", "snapkv+reskv", "h2o", "snapkv+reskv~gate=false"):  # opened for real, on copies
        document = next(doc for doc in documents.values() if doc["key"]["method"] == label)
        plan, entry = entries[ResultKey.from_json(document["key"])]
        key = entry.key(plan, document["key"]["task"])
        key.path(plan.runs_dir).parent.mkdir(parents=True)
        key.path(plan.runs_dir).write_text(json.dumps(document))
        result = ResultFile(
            plan.runs_dir, key, (0, 10), 10, plan.identity(entry, "float32"), lambda scores: 0.0
        ).open()
        assert result.pending == [] and result.close() is None
