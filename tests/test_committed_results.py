"""The committed reproductions (results/ruler4k on SmolLM2-135M; results/gemma-ruler4k and
results/gemma-ruler16384 on Gemma 3 270M): their result files load unchanged, resume under their
Makefile commands, and `make tables` regenerates their committed tables byte for byte, as `make
tables-combined` does their view together, results/combined (the on-disk JSON format and every table
rule held still)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts.harness.plan import compose_plan
from scripts.harness.store import SCHEMA, ResultFile, ResultKey, load_results, without_default_options
from scripts.report import tables

RESULTS = Path(__file__).resolve().parent.parent / "results"
# The three commands of `make reproduce-ruler4k` (Makefile), as plans: what each would run.
PAPER_GRID = [
    "method=[full,snapkv,snapkv+reskv,adakv,adakv+reskv]",
    "ratio=[0.6,0.7,0.8,0.9]",
    "setting=[aware,agnostic]",
]
REPRODUCE = [
    PAPER_GRID,
    ["method=[tova,tova+reskv,h2o,h2o+reskv,cam]", "ratio=0.9", "setting=[aware,agnostic]"],
    [
        "ratio=0.9",
        "setting=agnostic",
        "method=['snapkv+reskv~validate=false','snapkv+reskv~gate=false',"
        "'snapkv+reskv~shared_softmax=false','snapkv+reskv~final_selection=fit']",
    ],
]


@dataclass(frozen=True)
class Reproduction:
    """A committed reproduction as its Makefile target runs it: backbone, RULER length, commands, and
    the configurations it holds (every command's, on the 11 tasks available offline)."""

    backbone: str
    length: int
    commands: list
    configurations: int


REPRODUCTIONS = {
    "ruler4k": Reproduction("smollm2-135m", 4096, REPRODUCE, 517),
    "gemma-ruler4k": Reproduction("gemma3-270m", 4096, REPRODUCE, 517),
    "gemma-ruler16384": Reproduction("gemma3-270m", 16384, [PAPER_GRID], 11 * 33),
}
reproductions = pytest.mark.parametrize("name", sorted(REPRODUCTIONS))


def assert_same_files(committed_dir: Path, regenerated_dir: Path) -> None:
    """The same file names in both directories, and every file byte for byte."""
    committed = {path.name: path.read_bytes() for path in committed_dir.iterdir()}
    regenerated = {path.name: path.read_bytes() for path in regenerated_dir.iterdir()}
    assert sorted(regenerated) == sorted(committed)
    changed = [name for name in committed if regenerated[name] != committed[name]]
    assert changed == []


@reproductions
def test_committed_result_files_load_without_warnings(name):
    results, unavailable, warnings = load_results(RESULTS / name / "runs")
    assert warnings == []
    # results/README.md: the configurations on the 11 tasks available offline; qa_1 and qa_2 marked.
    assert len(results) == REPRODUCTIONS[name].configurations
    assert {(result.key.backbone, result.key.length) for result in results} == {
        (REPRODUCTIONS[name].backbone, REPRODUCTIONS[name].length)
    }
    assert len({result.key.task for result in results}) == 11
    assert sorted(mark["task"] for mark in unavailable) == ["qa_1", "qa_2"]


@pytest.mark.slow
@reproductions
def test_make_tables_regenerates_the_committed_tables_byte_for_byte(name, tmp_path):
    committed_dir = RESULTS / name
    tables.main(["--results-dir", str(committed_dir), "--out-dir", str(tmp_path)])
    assert_same_files(committed_dir / "tables", tmp_path)


@pytest.mark.slow
def test_make_tables_combined_regenerates_the_committed_view_byte_for_byte(tmp_path):
    """results/combined (`make tables-combined`): the reproductions read as one, averages and claims."""
    tables.main(
        [
            "--results-dir",
            *(str(RESULTS / name) for name in REPRODUCTIONS),
            "--out-dir",
            str(tmp_path),
            "--summary",
        ]
    )
    assert_same_files(RESULTS / "combined", tmp_path)


@reproductions
def test_every_committed_result_file_resumes_under_the_reproduction_command(name, tmp_path):
    """Its Makefile target finds nothing to run in a committed reproduction: each committed file (its
    identity written with every option at its default) is the configuration today's plan gives, and
    opens complete."""
    committed_dir, reproduction = RESULTS / name, REPRODUCTIONS[name]
    entries = {}
    for overrides in reproduction.commands:
        common = [
            f"backbone={reproduction.backbone}",
            "benchmark=ruler",
            f"benchmark.length={reproduction.length}",
            "benchmark.tasks=all",
        ]
        plan = compose_plan([*common, *overrides, f"results_dir={tmp_path}"])
        entries |= {entry.key(plan, task): (plan, entry) for task in plan.tasks for entry in plan.grid}
    documents = {path: json.loads(path.read_text()) for path in (committed_dir / "runs").rglob("*.json")}
    documents = {path: document for path, document in documents.items() if document.get("schema") == SCHEMA}
    assert len(documents) == reproduction.configurations
    for path, document in documents.items():
        plan, entry = entries[ResultKey.from_json(document["key"])]
        identity = plan.identity(entry, document["provenance"]["machine"]["dtype"])
        assert without_default_options(document["config"]) == identity, path
    by_label = {document["key"]["method"]: document for document in documents.values()}
    for label in ("full", "snapkv+reskv", "h2o", "snapkv+reskv~gate=false"):  # opened for real, on copies
        if label not in by_label:  # not among the reproduction's commands
            continue
        document = by_label[label]
        plan, entry = entries[ResultKey.from_json(document["key"])]
        key = entry.key(plan, document["key"]["task"])
        key.path(plan.runs_dir).parent.mkdir(parents=True)
        key.path(plan.runs_dir).write_text(json.dumps(document))
        samples = document["samples_total"]  # the rounds committed
        result = ResultFile(
            plan.runs_dir, key, (0, samples), samples, plan.identity(entry, "float32"), lambda scores: 0.0
        ).open()
        assert result.pending == [] and result.close() is None
