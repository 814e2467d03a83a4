"""What a user of run.py meets: help, errors, interruption, skips, progress lines, result fields.

Subprocess tests run run.py as a user would; the others run the runner in-process on the tiny
random backbone with short RULER prompts (predictions are noise, the plumbing is real).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from rich.console import Console

import benchmarks
import reskv.engine
import reskv.grid
import run
from baselines.registry import METHODS
from reskv.backbones import load_backbone
from scripts.harness.grid import GridRun, load_task_items, run_plan
from scripts.harness.plan import compose_plan
from scripts.harness.store import load_results, summarize
from scripts.machine import cpu_model
from tests.conftest import journaled_samples, start_interruptible
from tests.test_aggregate_tables import write_result

REPO = Path(__file__).resolve().parent.parent
TINY_VT = ["backbone=tiny-llama", "benchmark.length=1024", "max_new_tokens=4", "benchmark.tasks=[vt]"]
# Runs run.py as ``python run.py ARGS`` and reports, at its exit, its code and whether torch was loaded.
PROBE = """
import runpy, sys
sys.argv = ["run.py", *sys.argv[1:]]
try:
    runpy.run_path("run.py", run_name="__main__")
except SystemExit as exit:
    print("PROBE", exit.code, "torch" in sys.modules, "transformers" in sys.modules, file=sys.stderr)
"""


@pytest.fixture(scope="module")
def ruler_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ruler-cache")


@pytest.fixture(scope="module")
def backbone():
    return load_backbone("tiny-llama")


def probe(*arguments: str) -> tuple[str, tuple[str, ...]]:
    """Output of ``python run.py ARGUMENTS`` and its exit line (code, torch loaded, transformers loaded)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *arguments], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    exit_line = [line for line in result.stderr.splitlines() if line.startswith("PROBE ")]
    assert exit_line, result.stderr[-2000:]
    return result.stdout + result.stderr, tuple(exit_line[-1].split()[1:])


def plan_for(overrides: list[str], results_dir: Path, ruler_cache: Path):
    return compose_plan(
        [*overrides, f"results_dir={results_dir}", f"benchmark.options.cache_dir={ruler_cache}"]
    )


def test_help_lists_what_can_be_run():
    output, (code, *_) = probe("--help")
    assert code == "0"
    for name in (*METHODS, "aware", "agnostic", "0.6, 0.7, 0.8, 0.9", "tiny-llama", "paper_ruler", "smoke"):
        assert name in output, name
    for benchmark in benchmarks.BENCHMARKS:
        assert benchmark in output
        for task in benchmarks.tasks(benchmark):
            assert task in output
    for option in ("num_samples=", "shard.index=", "max_new_tokens=", "results_dir=", "reskv.OPTION", "tau"):
        assert option in output


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ("backbone=nope", "unknown backbone 'nope'; choose from ['gemma3-270m', 'llama3.1-8b-instruct'"),
        ("method=nope", "unknown method 'nope'; choose from ['full'"),
        ("decode=fast", "unknown decode mode 'fast'; choose from ['auto', 'eager', 'compiled']"),
        ("decode_batch=0", "decode_batch 0 must be a positive integer (1: each configuration alone) or"),
        ("decode_batch=many", "decode_batch 'many' must be a positive integer"),
        ("decode_batch=4 share_prefill=false", "use decode_batch=1 with share_prefill=false"),
        (
            "decode=compiled ablation=no_shared_softmax",
            "the no_shared_softmax ablation (reskv.shared_softmax=false)",
        ),
    ],
)
def test_bad_values_fail_cleanly_and_leave_no_log_directory(argument, expected, tmp_path):
    output, (code, *_) = probe(*argument.split(), f"results_dir={tmp_path}")
    assert code == "2"
    assert expected in output and "Traceback" not in output
    assert not (tmp_path / "logs").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("arguments", [("--help",), ("backbone=nope",), ("method=nope",), ("ratio=1.5",)])
def test_help_and_bad_values_answer_before_torch_is_imported(arguments, tmp_path):
    _, (code, torch_loaded, transformers_loaded) = probe(*arguments, f"results_dir={tmp_path}")
    assert code in ("0", "2")
    assert (torch_loaded, transformers_loaded) == ("False", "False")


def test_ctrl_c_ends_with_one_resume_line(tmp_path, ruler_cache):
    """SIGINT once a sample is on disk: one line saying how to resume, no traceback, exit 130."""
    command = [
        sys.executable,
        "run.py",
        *TINY_VT,
        "num_samples=20",
        "method=snapkv",
        f"results_dir={tmp_path}",
        f"benchmark.options.cache_dir={ruler_cache}",
    ]
    process = start_interruptible(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        if journaled_samples(tmp_path / "runs") > 0:
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output[-2000:]
    assert output.count(run.INTERRUPTED) == 1 and "Traceback" not in output


def test_counts_are_pluralised():
    assert [run.plural(count, "task") for count in (0, 1, 2)] == ["0 tasks", "1 task", "2 tasks"]


def test_end_table_marks_unavailable_tasks_na(tmp_path, ruler_cache, backbone):
    grid = ["num_samples=1", "method=snapkv", "ratio=[0.6,0.9,0.9995]"]
    plan = plan_for([*TINY_VT[:3], "benchmark.tasks=[vt,qa_1]", *grid], tmp_path, ruler_cache)
    for ratio in (0.6, 0.9995):  # 0.9995 leaves no KV slot: skipped
        one = plan_for([*TINY_VT, "num_samples=1", "method=snapkv", f"ratio={ratio}"], tmp_path, ruler_cache)
        run_plan(one, backbone)
    console = Console(record=True, width=200)
    console.print(run.result_table(plan, {"vt"}))
    rows = {
        line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "snapkv" in line
    }
    cells = {name: [cell.strip() for cell in line.split("│")[2:4]] for name, line in rows.items()}
    vt_06, _ = load_results(plan.runs_dir)[0]
    expected = f"{100 * vt_06.samples[0]['score']:.2f} (1)"
    assert cells == {
        "aware snapkv 0.6": [expected, "n/a"],
        "aware snapkv 0.9": ["–", "n/a"],
        "aware snapkv 0.9995": ["skipped (1)", "n/a"],
    }


def test_end_table_shows_each_reskv_pairs_difference_on_shared_samples(tmp_path, ruler_cache):
    plan = plan_for(
        [*TINY_VT, "method=[snapkv,snapkv+reskv]", "ratio=0.9", "setting=agnostic"], tmp_path, ruler_cache
    )
    base, reskv = plan.grid
    write_result(plan.runs_dir, base.key(plan, "vt"), [0, 0.5, 1, 0])
    write_result(plan.runs_dir, reskv.key(plan, "vt"), [1, 0.5, 1])  # sample 3 not run
    console = Console(record=True, width=200)
    console.print(run.result_table(plan, {"vt"}))
    rows = {
        line.split("│")[1].strip(): line.split("│")[-2].strip()
        for line in console.export_text().splitlines()
        if "snapkv" in line
    }
    # On the 3 shared samples: +100, 0, 0 points, mean 33.33. One sample differs: the sign-flip test's
    # p-value is 1 (both signs reach it), and no test can reach 0.05, so the interval is the exact
    # bound: 1 of 3 samples departing, Clopper-Pearson's upper limit Beta(0.975; 2, 2) = 0.9057 of 3
    # samples, each reaching 100 / 3 points: unresolved.
    assert rows == {
        "agnostic snapkv 0.9": "",
        "agnostic snapkv+reskv 0.9": "+33.33 [-90.57, +90.57] (n=3, p 1.000) unresolved",
    }


def budget(tokens: int, ratio: float) -> int:
    """reskv.md's budget, exact rational floor on the decimal ratio, written here independently."""
    kept = tokens * (1 - Fraction(str(ratio)))
    return kept.numerator // kept.denominator


def test_a_ratio_without_slots_is_skipped_before_the_prefill(tmp_path, ruler_cache, backbone, monkeypatch):
    ratio = 0.9995
    plan = plan_for([*TINY_VT, "num_samples=2", "method=snapkv", f"ratio={ratio}"], tmp_path, ruler_cache)
    items = load_task_items(plan, backbone.tokenizer)
    assert all(budget(item.length, ratio) == 0 for item in items["vt"])

    def no_prefill(*args, **kwargs):
        raise AssertionError("a sample without KV slots reached the prefill")

    monkeypatch.setattr(reskv.engine, "Prefill", no_prefill)
    grid = GridRun(plan, backbone, items)
    grid.open()
    grid.run()
    (result,) = load_results(plan.runs_dir)[0]
    document = json.loads(result.key.path(plan.runs_dir).read_text())
    for sample, item in zip(document["samples"], items["vt"], strict=True):
        assert sample["score"] is None and "prediction" not in sample
        assert sample["skipped"] == (
            f"ratio {ratio:g} leaves no KV slot for the {item.length} tokens the aware setting compresses "
            f"(budget floor({item.length} * (1 - {ratio:g})) = 0)"
        )
    assert document["summary"] == {
        **document["summary"],
        "score": None,
        "score_percent": None,
        "num_samples": 0,
        "num_skipped": 2,
    }
    assert not list(plan.runs_dir.rglob("*.jsonl"))


def test_a_prompt_past_the_backbones_positions_is_skipped(tmp_path, ruler_cache, monkeypatch):
    backbone = load_backbone("tiny-llama")
    plan = plan_for([*TINY_VT, "num_samples=1", "method=[full,snapkv]", "ratio=0.6"], tmp_path, ruler_cache)
    items = load_task_items(plan, backbone.tokenizer)
    (item,) = items["vt"]
    monkeypatch.setattr(backbone.model.config, "max_position_embeddings", item.length + 3)
    grid = GridRun(plan, backbone, items)
    grid.open()
    grid.run()
    results = load_results(plan.runs_dir)[0]
    assert len(results) == 2
    for result in results:
        assert result.samples[0]["skipped"] == (
            f"{item.length} prompt tokens + 4 new tokens exceed the backbone's max_position_embeddings "
            f"{item.length + 3}"
        )


def test_a_finished_configuration_is_reported_before_the_next_sample(tmp_path, ruler_cache, backbone):
    """A configuration an earlier run completed is reported at once, not after the rest of its task."""
    run_plan(plan_for([*TINY_VT, "num_samples=2", "method=snapkv"], tmp_path, ruler_cache), backbone)
    plan = plan_for([*TINY_VT, "num_samples=2", "method=[full,snapkv]"], tmp_path, ruler_cache)
    events = []
    grid = GridRun(plan, backbone, load_task_items(plan, backbone.tokenizer))
    grid.on_sample = lambda: events.append("sample")
    grid.on_finished = lambda entry, task, document: events.append((entry.method, document is None))
    grid.open()
    grid.run()
    assert events == [("snapkv", True), "sample", "sample", ("full", False)]


def test_result_files_name_units_timings_and_machine(tmp_path, ruler_cache, backbone, monkeypatch):
    passed, question_prefilled = [], []
    decode_grid = reskv.grid.decode_grid

    def spy(prefill, *args, **kwargs):  # one call per sample, for every configuration of it
        passed.append(kwargs["min_new_tokens"])
        question_prefilled.append("question_prefill_s" in prefill.timings)
        return decode_grid(prefill, *args, **kwargs)

    monkeypatch.setattr(reskv.grid, "decode_grid", spy)
    plan = plan_for([*TINY_VT, "num_samples=2", "method=[full,snapkv]", "ratio=0.6"], tmp_path, ruler_cache)
    items = load_task_items(plan, backbone.tokenizer)
    items["vt"][1] = dataclasses.replace(items["vt"][1], min_new_tokens=3)
    grid = GridRun(plan, backbone, items)
    grid.open()
    grid.run()
    assert passed == [0, 3]
    # The question's prefill happens before the first generation, so the full cache's compress_s
    # (its first, query-aware, generation) holds no prefill.
    assert all(question_prefilled)
    for path in sorted(plan.runs_dir.rglob("*.json")):
        document = json.loads(path.read_text())
        samples = document["samples"]
        assert [sample["metadata"] for sample in samples] == [item.metadata for item in items["vt"]]
        assert all(0 <= sample["score"] <= 1 for sample in samples)
        percent = round(sum(sample["score"] for sample in samples) / len(samples) * 100, 2)
        assert document["summary"]["score_percent"] == document["summary"]["score"] == percent
        assert "percent" in document["units"]["summary.score"]
        assert "fraction" in document["units"]["samples[].score"]
        timings = document["timings"]
        assert not set(timings) & {"prefill_shared_by", "decode_batch"}  # counts are never summed
        for name in ("compress_s", "decode_s", "prefill_s", "question_prefill_s"):
            assert timings[name] == pytest.approx(
                sum(sample["timings"][name] for sample in samples), abs=1e-5
            )
        run = {"decode": "eager", "batch_rows": 1, "prefill_shared_by": 2}
        assert all(sample["run"] == run for sample in samples)
        own_share = sum(
            (sample["timings"]["prefill_s"] + sample["timings"]["question_prefill_s"]) / 2
            for sample in samples
        )
        assert timings["prefill_s_own_share"] == pytest.approx(own_share, abs=1e-5)
        provenance = document["provenance"]
        assert provenance["versions"]["torch"] and provenance["versions"]["transformers"]
        machine = provenance["machine"]
        assert (machine["device"], machine["dtype"]) == ("cpu", "float32")
        assert machine["torch_threads"] >= 1 and machine["cpu_count"] == os.cpu_count()
        assert machine["cpu"] == cpu_model() and "gpu" not in machine
        assert len(machine["load_average"]) == 3 and machine["started_at"].startswith(time.strftime("%Y-"))


def test_summary_scores_are_percent_and_leave_skipped_samples_out():
    samples = [
        {"index": 0, "prompt_tokens": 10, "generated_tokens": 2, "score": 1.0},
        {"index": 1, "prompt_tokens": 20, "generated_tokens": 4, "score": 0.5},
        {"index": 2, "prompt_tokens": 30, "score": None, "skipped": "no KV slot"},
    ]
    summary = summarize(samples, functools.partial(benchmarks.task_score, "ruler"))
    assert summary == {
        "score": 75.0,
        "score_percent": 75.0,
        "num_samples": 2,
        "num_skipped": 1,
        "prompt_tokens_mean": 15.0,
        "generated_tokens_mean": 3.0,
    }
