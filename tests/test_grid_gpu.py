"""The grid's GPU bench in its CPU form (what a machine without CUDA runs): one sample's paper grid
against one full-cache request, per stage, with the floor beside it."""

from __future__ import annotations

import itertools
import json

import pytest

from scripts.bench import grid_gpu
from scripts.measure import random_prompt


@pytest.mark.slow
def test_the_bench_times_the_grid_against_a_request_and_writes_its_report(tmp_path):
    assert grid_gpu.main(["--out", str(tmp_path), "--lengths", "192", "--decode-batch", "64"]) == 0
    (row,) = json.loads((tmp_path / "grid_gpu.json").read_text())["rows"]
    assert (row["length"], row["rows"], row["decode"]) == (192, 73, "eager")
    # configs/grid/paper_ruler.yaml's 73 rows in batches of at most 64 (--decode-batch 64); an eager
    # grid compiles no graph, falls back nowhere, splits nothing.
    assert sum(row["batches"]) == 73 and max(row["batches"]) <= 64
    assert row["compiler"]["graphs_compiled"] == 0
    assert row["compile_fallbacks"] == 0 and row["out_of_memory_splits"] == 0
    assert row["construct_gflop"] > 0 and row["floor_s"] > row["prefill_s"]
    for name in ("full_eager", "full_compiled", "floor"):
        assert row[f"grid_over_{name}"] == pytest.approx(row["grid_s"] / row[f"{name}_s"])
    assert row["grid_s"] > row["construct_s"] > 0 and row["decode_s"] > 0


def test_a_sample_reports_its_stage_seconds_after_each_configuration():
    """``progress`` hears of every configuration as it is decoded (the grid decodes a batch's rows
    together, so several arrive at once), and its last report holds the sample's stage seconds."""
    backbone = grid_gpu.bench_backbone("cpu")
    prompt = random_prompt(range(1, backbone.model.config.vocab_size), 160, seed=1)
    reports = []
    row = grid_gpu.grid_sample(
        backbone, prompt, new_tokens=2, decode_batch=64, count_flops=False, progress=reports.append
    )
    assert [report["configurations"] for report in reports] == list(range(1, 74))
    assert all(later["elapsed_s"] >= earlier["elapsed_s"] for earlier, later in itertools.pairwise(reports))
    stages = ("configurations", "prefill_s", "construct_s", "question_s", "decode_s", "decode_tokens")
    assert {stage: reports[-1][stage] for stage in stages} == {stage: row[stage] for stage in stages}
