"""The plan before a run (``dry_run=true``): its estimate, its reading of the result store and the
calibration that feeds it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reskv.batching import ModelShape
from scripts.harness.dry_run import calibrate, cost, rates, workload
from scripts.harness.plan import compose_plan
from scripts.harness.store import ResultFile

# A toy calibration: prefill 1 ms a context token, a question forward 0.5 s, a base method's
# construction 0.1 ms a compressed token and a +ResKV one 0.2 ms, a decode step of B rows of L
# slots 10 ms + 1 us per row slot.
TOY_RATES = {
    "schema": rates.SCHEMA,
    "device": "toy",
    "device_type": "cpu",
    "backbones": {
        "tiny-llama": {
            "prefill": {"terms": ["s"], "coefficients": [1e-3]},
            "question": {"terms": ["1"], "coefficients": [0.5]},
            "construction": {
                "base": {"terms": ["s"], "coefficients": [1e-4]},
                "reskv": {"terms": ["s"], "coefficients": [2e-4]},
            },
            "decode": {"eager": {"terms": ["1", "BL"], "coefficients": [0.01, 1e-6]}},
        }
    },
}
# 2 RULER tasks x 3 samples x 5 configurations (full; SnapKV and SnapKV+ResKV at 0.75, both settings).
REPO = Path(__file__).resolve().parent.parent
# ``python run.py ARGS``, then whether torch was imported.
DRY_RUN = """
import runpy, sys
sys.argv = ["run.py", *sys.argv[1:]]
try:
    runpy.run_path("run.py", run_name="__main__")
finally:
    print("torch imported:", "torch" in sys.modules)
"""
TINY = ["backbone=tiny-llama", "num_samples=3", "ratio=0.75", "setting=[aware,agnostic]", "decode_batch=2"]
TOY_GRID = [*TINY, "benchmark.length=1024", "method=[full,snapkv,snapkv+reskv]"]


def toy_rates(tmp_path: Path) -> rates.Rates:
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(TOY_RATES))
    return rates.read_rates(path, "tiny-llama")


def test_the_estimate_counts_what_the_grid_runner_runs(tmp_path):
    """By hand, per sample: one context prefill (s - 64 question tokens), one question forward for
    the query-aware side (full + 2 aware) and one per agnostic configuration (2), 4 constructions
    (aware compress s tokens, agnostic s - 64), and 3 decode batches of views of answer-length steps,
    2 rows a batch in the grid's order (the full cache and SnapKV aware; SnapKV agnostic and
    SnapKV+ResKV aware; SnapKV+ResKV agnostic alone). A batch of views reads the prompt's slots once,
    each row's entries (at most 0.2 of its budget, rounded half up) and each row's question and answer
    slots; a row alone its budget floor(tokens * 0.25), the question's 64 slots and the answer."""
    plan = compose_plan([*TOY_GRID, "benchmark.tasks=[vt,niah_single_1]", f"results_dir={tmp_path}"])
    # vt: 30 answer tokens, prompt 1024 - 30 = 994, context 930.
    vt_prefill = 930e-3 + 0.5 + 2 * 0.5
    vt_construction = 1e-4 * 994 + 1e-4 * 930 + 2e-4 * 994 + 2e-4 * 930
    appended, entries = 64 + 30, 50  # SnapKV+ResKV aware: b = 248, r = floor(49.6 + 0.5)
    batches = [994 + 2 * appended, 994 + entries + 2 * appended]  # the rows' slots a step reads, B x L
    alone = 930 // 4 + 64 + 30  # SnapKV+ResKV agnostic: 326 slots
    vt_decode = 30 * ((0.01 + 1e-6 * batches[0]) + (0.01 + 1e-6 * batches[1]) + (0.01 + 1e-6 * alone))
    # niah_single_1: 128 answer tokens, prompt 896, context 832.
    niah_prefill = 832e-3 + 0.5 + 2 * 0.5
    niah_construction = 1e-4 * 896 + 1e-4 * 832 + 2e-4 * 896 + 2e-4 * 832
    appended, entries = 64 + 128, 45  # b = 224, r = floor(44.8 + 0.5)
    batches = [896 + 2 * appended, 896 + entries + 2 * appended]
    alone = 832 // 4 + 64 + 128  # 400 slots
    niah_decode = 128 * ((0.01 + 1e-6 * batches[0]) + (0.01 + 1e-6 * batches[1]) + (0.01 + 1e-6 * alone))
    expected = {
        "prefill": 3 * (vt_prefill + niah_prefill),  # 14.286 s
        "construction": 3 * (vt_construction + niah_construction),  # 3.2868 s
        "decode": 3 * (vt_decode + niah_decode),  # 15.62052 s
    }
    assert expected["prefill"] + expected["construction"] + expected["decode"] == pytest.approx(33.19332)
    tasks = workload.task_plans(plan)
    assert [(task.task, task.range_size) for task in tasks] == [("vt", 3), ("niah_single_1", 3)]
    estimates = cost.estimate(plan, tasks, toy_rates(tmp_path))
    for stage, seconds in expected.items():
        whole = sum(getattr(task_whole, stage) for _, task_whole in estimates.values())
        to_do = sum(getattr(task_to_do, stage) for task_to_do, _ in estimates.values())
        assert whole == pytest.approx(seconds, rel=1e-12) and to_do == pytest.approx(seconds, rel=1e-12)


def plain_kmeans_work(tokens: int, ratio: float) -> int:
    """Points x centres a Lloyd step of a +ResKV construction computes per head, from reskv.md with the
    paper's grid (0, 0.05, 0.1, 0.15, 0.2), 32 validation queries and a 64-token window: each candidate
    ``r = floor(g b + 0.5) > 0`` that leaves ``b - r - 32 >= 64`` clusters the ``(s - 32) - (b - r - 32)``
    prefix tokens it evicts, then the final cache its largest ``r`` over ``s - b + r`` tokens."""
    budget = tokens * round((1 - ratio) * 10) // 10
    sizes = []
    for share in (0.05, 0.10, 0.15, 0.20):
        size = int(share * budget + 0.5)
        if size and size not in sizes and budget - size - 32 >= 64:
            sizes.append(size)
    largest = max(sizes, default=0)
    return sum((tokens - budget + size) * size for size in sizes) + (tokens - budget + largest) * largest


def test_a_methods_ratios_share_their_construction_and_each_ratio_pays_its_own_kmeans(tmp_path):
    """SnapKV+ResKV at 0.6 and 0.9, query-aware, 4,066 tokens (vt at 4K): a rate of 1e-4 s a token
    (independent of the ratio: counted once for the method) and 1e-7 s a token squared (its k-means),
    measured at 0.9, so that 0.6 pays its k-means work over 0.9's: 2.9x, by hand from reskv.md."""
    toy = json.loads(json.dumps(TOY_RATES))
    reskv_rate = {"terms": ["s", "s2"], "coefficients": [1e-4, 1e-7], "ratio": 0.9}
    toy["backbones"]["tiny-llama"]["construction"]["reskv"] = reskv_rate
    (tmp_path / "toy.json").write_text(json.dumps(toy))
    read = rates.read_rates(tmp_path / "toy.json", "tiny-llama")
    grid = [*TINY[:2], "ratio=[0.6,0.9]", "setting=aware", "benchmark.length=4096", "method=snapkv+reskv"]
    plan = compose_plan([*grid, "benchmark.tasks=[vt]", f"results_dir={tmp_path}"])
    (task,) = workload.task_plans(plan)
    tokens = 4096 - 30
    scale = plain_kmeans_work(tokens, 0.6) / plain_kmeans_work(tokens, 0.9)
    assert 2.8 < scale < 3.0
    expected = 1e-4 * tokens + 1e-7 * tokens**2 * (1 + scale)
    seconds = cost.sample_seconds(plan, task.workload, plan.grid, read)
    assert seconds.construction == pytest.approx(expected, rel=1e-12)
    alone = [cost.sample_seconds(plan, task.workload, [entry], read).construction for entry in plan.grid]
    assert sum(alone) == pytest.approx(expected + 1e-4 * tokens, rel=1e-12)  # each pays the shared part


def write_result(plan, task: str, entry, indices: list[int], total: int) -> None:
    """A result file of ``entry`` holding ``indices`` of ``total`` samples (closed: final if complete)."""
    result = ResultFile(
        plan.runs_dir, entry.key(plan, task), (0, total), total, plan.identity(entry, "float32"), len
    ).open()
    for index in indices:
        result.append(
            {"index": index, "prompt_digest": "d", "prompt_tokens": 10, "generated_tokens": 2, "score": 1.0}
        )
    result.close()


def test_a_ruler_round_more_or_fewer_is_counted_from_the_plan_not_the_store(tmp_path):
    """Rounds (make reproduce-ruler4k) raise num_samples over a store written with fewer: over full's
    3 complete samples, num_samples=4 leaves sample 3 to run for every configuration and full
    partial, as the run would; num_samples=2 finds full done and the others to do over 2 samples."""
    three = compose_plan([*TOY_GRID, "benchmark.tasks=[vt]", f"results_dir={tmp_path}"])
    write_result(three, "vt", three.grid[0], [0, 1, 2], 3)
    more = compose_plan([*TOY_GRID, "num_samples=4", "benchmark.tasks=[vt]", f"results_dir={tmp_path}"])
    (task,) = workload.task_plans(more)
    assert task.sample_range == (0, 4)
    assert [task.status(entry) for entry in more.grid] == ["partial", "to do", "to do", "to do", "to do"]
    assert task.pending(more.grid) == {tuple(more.grid[1:]): 3, tuple(more.grid): 1}
    fewer = compose_plan([*TOY_GRID, "num_samples=2", "benchmark.tasks=[vt]", f"results_dir={tmp_path}"])
    (task,) = workload.task_plans(fewer)
    assert task.sample_range == (0, 2)
    assert [task.status(entry) for entry in fewer.grid] == ["done", "to do", "to do", "to do", "to do"]


def test_the_dry_run_lists_what_the_store_holds_and_writes_nothing(tmp_path):
    """full complete, SnapKV aware one sample in its journal, the rest absent: 1 done, 1 partial,
    3 to do; sample 0 lacks 3 configurations, samples 1 and 2 lack 4; the to-do estimate leaves the
    held samples out; the dry run (torch never imported) changes no file."""
    plan = compose_plan([*TOY_GRID, "benchmark.tasks=[vt]", f"results_dir={tmp_path}"])
    full, snapkv_aware = plan.grid[0], plan.grid[1]
    assert (full.method, snapkv_aware.label, snapkv_aware.setting) == ("full", "snapkv", "aware")
    write_result(plan, "vt", full, [0, 1, 2], 3)
    write_result(plan, "vt", snapkv_aware, [0], 3)
    (task,) = workload.task_plans(plan)
    assert [task.status(entry) for entry in plan.grid] == ["done", "partial", "to do", "to do", "to do"]
    assert task.pending(plan.grid) == {tuple(plan.grid[2:]): 1, tuple(plan.grid[1:]): 2}

    toy = toy_rates(tmp_path)
    ((to_do, whole),) = cost.estimate(plan, [task], toy).values()
    fresh = cost.estimate(plan, [workload.TaskPlan("vt", task.workload, (0, 3))], toy)
    assert whole.total == fresh["vt"][0].total
    # Decode by hand (the test above's batches of views): sample 0 decodes 3 rows (SnapKV agnostic
    # beside SnapKV+ResKV aware, then SnapKV+ResKV agnostic alone), samples 1 and 2 four (the SnapKV
    # pair, then the SnapKV+ResKV pair, whose entries are 50 and 46 slots).
    appended, alone = 64 + 30, 930 // 4 + 64 + 30
    first = (0.01 + 1e-6 * (994 + 50 + 2 * appended)) + (0.01 + 1e-6 * alone)
    others = (0.01 + 1e-6 * (994 + 2 * appended)) + (0.01 + 1e-6 * (994 + 50 + 46 + 2 * appended))
    assert to_do.decode == pytest.approx(30 * (first + 2 * others))

    before = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    dry_run = subprocess.run(
        [sys.executable, "-c", DRY_RUN, *TOY_GRID, "benchmark.tasks=[vt]", f"results_dir={tmp_path}"]
        + ["dry_run=true", f"calibration={tmp_path}/toy.json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = dry_run.stdout
    assert dry_run.returncode == 0 and "torch imported: False" in output, dry_run.stderr[-2000:]
    assert "1 done, 1 partial, 3 to do" in output and "device hours on toy" in output
    assert "Not counted: compiling the decode step" in output and "No memory limit" in output
    assert f"{snapkv_aware.key(plan, 'vt').path(plan.runs_dir)}: 1 of 3" in output
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == before


def test_committed_calibrations_read(tmp_path):
    """Every committed calibration file holds valid rates for each backbone it names."""
    paths = sorted(rates.CALIBRATION_DIR.glob("*.json"))
    assert paths
    for path in paths:
        for backbone in json.loads(path.read_text())["backbones"]:
            read = rates.read_rates(path, backbone)
            assert read.prefill.seconds(s=4096) > 0 and read.decode


def test_calibrate_measures_every_stage_at_three_lengths(tmp_path, monkeypatch):
    """On the tiny backbone: the prefill, the question, each method's construction and the decode
    steps at 128, 256 and 512 tokens (one untimed pass first), filed so the dry run reads them."""
    monkeypatch.setattr(calibrate, "REPEATS", 1)
    monkeypatch.setattr(calibrate, "BATCH_ROWS", 2)
    plan = compose_plan(
        [
            *TINY,
            "benchmark.length=512",
            "benchmark.tasks=[vt]",
            "method=[full,h2o,snapkv+reskv]",
            f"results_dir={tmp_path}",
        ]
    )
    path = calibrate.calibrate(plan, "cpu", tmp_path / "cpu.json")
    document = json.loads(path.read_text())
    entry = document["backbones"]["tiny-llama"]
    assert entry["measured"]["lengths"] == [128, 256, 512]
    assert [point[0] for point in entry["prefill"]["points"]] == [64, 192, 448]
    assert sorted(entry["construction"]) == ["base", "h2o", "reskv", "snapkv+reskv"]
    assert [point[0] for point in entry["construction"]["h2o"]["points"]] == [128, 256, 512]
    assert list(entry["prefill_with"]) == ["h2o"]
    # Eager decode: the full row, one compressed row and a batch of them, at each length.
    assert [point[0] for point in entry["decode"]["eager"]["points"]] == [1, 1, 2] * 3
    read = rates.read_rates(path, "tiny-llama")
    assert cost.estimate(plan, workload.task_plans(plan), read)["vt"][1].total > 0
    assert read.shape == ModelShape(2, 2, 4, 16, 4) and read.weights_bytes > 0 and read.memory_bytes is None


def test_the_dry_run_prices_the_rounds_an_unresolved_claim_needs(tmp_path):
    """A claim of this backbone with 3 samples per task that needs 7 (observed) or 5 (paper) asks 4
    more rounds; a round is one sample of every task through the whole grid, 33.19332 s / 3 by hand
    (the test above), so 4 rounds are 44.25776 s = 0.0123 device hours. Another backbone's claim is
    not this plan's to price; none at all prints no section."""
    from rich.console import Console

    from scripts.harness.dry_run.report import report
    from scripts.report.verdict import RoundsNeeded

    plan = compose_plan([*TOY_GRID, "benchmark.tasks=[vt,niah_single_1]", f"results_dir={tmp_path}"])
    claims = [
        RoundsNeeded("tiny-llama", "RULER 10%: mean gain", "unresolved", 3, 7, 5),
        RoundsNeeded("llama3.1-8b-instruct", "RULER 20%: mean gain", "unresolved", 3, 9, 9),
    ]
    assert claims[0].rounds == 4

    def printed(unresolved) -> str:
        console = Console(width=250, record=True, file=open("/dev/null", "w"))
        console.print(report(plan, toy_rates(tmp_path), unresolved=unresolved))
        return console.export_text()

    text = printed(claims)
    (row,) = [line for line in text.splitlines() if "RULER 10%" in line]
    assert [cell.strip() for cell in row.strip("│ ").split("│")] == [
        "RULER 10%: mean gain",
        "unresolved",
        "3",
        "7",
        "5",
        "4",
        f"{4 * 33.19332 / 3 / 3600:.4f}",
    ]
    assert "RULER 20%" not in text
    assert "leave unresolved" not in printed([])
