"""The committed reproductions (results/ruler4k on SmolLM2-135M, results/gemma-ruler4k on Gemma 3
270M): their result files load unchanged, resume under their Makefile commands, and `make tables`
regenerates their committed tables byte for byte (the on-disk JSON format and every table rule held
still)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.harness.plan import compose_plan
from scripts.harness.store import SCHEMA, ResultFile, ResultKey, load_results, without_default_options
from scripts.report import tables

RESULTS = Path(__file__).resolve().parent.parent / "results"
# Each reproduction's directory and the backbone of its Makefile target (reproduce-ruler4k,
# reproduce-gemma-ruler4k).
REPRODUCTIONS = {"ruler4k": "smollm2-135m", "gemma-ruler4k": "gemma3-270m"}
reproductions = pytest.mark.parametrize("reproduction", sorted(REPRODUCTIONS))


@reproductions
def test_committed_result_files_load_without_warnings(reproduction):
    results, unavailable, warnings = load_results(RESULTS / reproduction / "runs")
    assert warnings == []
    # results/README.md: 517 configurations on the 11 tasks available offline; qa_1 and qa_2 marked.
    assert len(results) == 517
    assert {result.key.backbone for result in results} == {REPRODUCTIONS[reproduction]}
    assert len({result.key.task for result in results}) == 11
    assert sorted(mark["task"] for mark in unavailable) == ["qa_1", "qa_2"]


@pytest.mark.slow
@reproductions
def test_make_tables_regenerates_the_committed_tables_byte_for_byte(reproduction, tmp_path):
    committed_dir = RESULTS / reproduction
    tables.main(["--results-dir", str(committed_dir), "--out-dir", str(tmp_path)])
    committed = {path.name: path.read_bytes() for path in (committed_dir / "tables").iterdir()}
    regenerated = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    assert sorted(regenerated) == sorted(committed)
    changed = [name for name in committed if regenerated[name] != committed[name]]
    assert changed == []


# The three commands of `make reproduce-ruler4k` (Makefile; `reproduce-gemma-ruler4k` the same on its
# backbone), as plans: what each would run.
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


@reproductions
def test_every_committed_result_file_resumes_under_the_reproduction_command(reproduction, tmp_path):
    """`make reproduce-ruler4k` (and the Gemma one) finds nothing to run: each committed file (its
    identity written with every option at its default) is the configuration today's plan gives, and
    opens complete."""
    committed_dir, backbone = RESULTS / reproduction, REPRODUCTIONS[reproduction]
    entries = {}
    for overrides in REPRODUCE:
        common = [f"backbone={backbone}", "benchmark=ruler", "benchmark.length=4096", "benchmark.tasks=all"]
        plan = compose_plan([*common, *overrides, f"results_dir={tmp_path}"])
        entries |= {entry.key(plan, task): (plan, entry) for task in plan.tasks for entry in plan.grid}
    documents = {path: json.loads(path.read_text()) for path in (committed_dir / "runs").rglob("*.json")}
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
        samples = document["samples_total"]  # the rounds committed
        result = ResultFile(
            plan.runs_dir, key, (0, samples), samples, plan.identity(entry, "float32"), lambda scores: 0.0
        ).open()
        assert result.pending == [] and result.close() is None
