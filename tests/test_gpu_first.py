"""The prepared first GPU call (``scripts.bench.gpu_check.first``) in its CPU form: its stages, the
kernels switched off where their check fails, and the dry run's figures beside the grid's."""

from __future__ import annotations

import json
import types
from pathlib import Path
from unittest import mock

import pytest
import yaml

import reskv.attention
import reskv.residual
import reskv.scoring
import reskv.views
from baselines import build_method
from reskv import nearest_kernel
from reskv.engine import Prefill
from scripts.bench.gpu_check import first
from scripts.bench.gpu_check.efficiency import TORCH_LLOYD, TORCH_LOSSES, TORCH_NEAREST
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone


@pytest.fixture
def kernel_flags():
    flags = types.SimpleNamespace(PASSING=True, MISMATCHING=True, FAILING=True)
    yield flags
    mock.patch.stopall()


def test_a_kernel_whose_check_mismatches_or_raises_is_switched_off_for_the_rest_of_the_process(kernel_flags):
    def raises(*arguments):
        raise RuntimeError("faked: triton compilation failed")

    checks = {
        "passing": (lambda *arguments: {"passed": True}, (kernel_flags, "PASSING", False)),
        "mismatching": (
            lambda *arguments: {"passed": False, "same_slots_every_head": False},
            (kernel_flags, "MISMATCHING", False),
        ),
        "failing": (raises, (kernel_flags, "FAILING", False)),
    }
    report = first.checked(checks, "prefill", "method")
    assert report["passing"] == {"passed": True}
    assert report["mismatching"]["switched_off"] and not report["mismatching"]["passed"]
    assert report["failing"]["error"] == "RuntimeError('faked: triton compilation failed')"
    assert report["failing"]["switched_off"]
    assert (kernel_flags.PASSING, kernel_flags.MISMATCHING, kernel_flags.FAILING) == (True, False, False)


def test_the_dry_runs_estimate_beside_a_32k_grid_sample_plans_the_73_rows_on_the_h100():
    """The committed H100 calibration, 32K tokens, 32-token answers: the 73 rows in one batch of views
    within the memory rule, and the estimate's stages adding up."""
    estimate = first.dry_run_estimate(32768, 32)
    assert estimate["device"] == "NVIDIA H100 80GB HBM3"
    assert estimate["batches"] == [73]
    stages = estimate["prefill_s"] + estimate["construction_s"] + estimate["decode_s"]
    assert estimate["total_s"] == pytest.approx(stages) and estimate["decode_s"] > 0


@pytest.mark.slow
def test_the_cpu_form_runs_every_stage_but_what_needs_cuda_and_prints_the_gpu_command(tmp_path, capsys):
    assert first.main(["--out", str(tmp_path), "--stages", "kernels", "decode"]) == 0
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert kernels["skipped"].startswith("needs CUDA")
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert decode["one_row"]["rows"] == 1 and decode["batch"]["rows"] == 8
    for name in ("one_row", "batch"):
        assert len(decode[name]["tokens_per_s_runs"]) == first.DECODE_REPEATS
        assert decode[name]["tokens_per_s"] > 0
    assert json.loads((tmp_path / "machine.json").read_text())["cpu_count"] >= 1
    assert first.GPU_COMMAND in capsys.readouterr().out


def test_the_gpu_command_the_cpu_form_prints_is_the_one_results_gpu_readme_says_to_type():
    readme = (first.H100_CALIBRATION.parents[1] / "gpu" / "README.md").read_text()
    top = readme[: readme.index("\n## ", readme.index("## The GPU check of the grid"))]
    assert first.GPU_COMMAND in top and "make gpu-first" in top


def test_the_kernel_checks_run_their_comparison_where_both_paths_are_the_torch_one(kernel_flags):
    """On a CPU both sides of each check take the torch path (the switches only act on CUDA): the
    comparisons themselves run, and find the same slots and the same logits."""
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    method = build_method("snapkv+reskv", 0.9)
    prefill = Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270, [method])
    nearest = first.construction_check(TORCH_NEAREST, prefill, method)
    assert nearest["passed"] and nearest["heads"] == 2 * 2
    decode = first.decode_check(prefill, method)
    assert decode["passed"] and len(decode["cases"]) == len(first.DECODE_CASES)  # fp32 only here
    for case in decode["cases"]:
        assert case["kernel_error"] == case["torch_error"] < 1e-5
    sums = first.attention_sums_check(prefill, method)
    assert sums["passed"] and [(case["sums"], case["queries"]) for case in sums["cases"]] == [
        ("column_sums", 300),
        ("column_sums", first.QUESTION_TOKENS),
        ("outputs", 32),
    ]
    for case in sums["cases"]:
        assert case["kernel_error"] == case["torch_error"] < 1e-5
    for switch in (TORCH_LLOYD, TORCH_LOSSES):
        fused = first.construction_check(switch, prefill, build_method("snapkv+reskv", 0.5))  # 0.9: none
        assert fused["passed"] and fused["heads"] == 2 * 2
        assert fused["entry_keys_relative_difference"] == fused["entry_values_relative_difference"] == 0
        assert fused["log_counts_difference"] == 0


@pytest.mark.parametrize(
    ("module", "function", "switch", "check", "method_name"),
    [
        (reskv.attention, "shared_softmax_attention", "CUDA_FUSED_DECODE", "decode_check", "snapkv+reskv"),
        (reskv.scoring, "accumulated_attention", "CUDA_FUSED_ATTENTION_SUMS", "attention_sums_check", "h2o"),
        (reskv.scoring, "attention_outputs", "CUDA_FUSED_ATTENTION_SUMS", "attention_sums_check", "h2o"),
    ],
)
def test_a_kernel_check_fails_a_kernel_off_by_a_fraction_of_a_percent(
    module, function, switch, check, method_name, monkeypatch
):
    """A "kernel" (the path taken while its switch is on: the decode step's attention, H2O's column
    sums, the proxy's full outputs) whose output is 0.1% off the torch path's fails the float64
    comparison in fp32; an exact one passes."""
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    method = build_method(method_name, 0.9)
    prefill = Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270, [method])
    exact = getattr(module, function)

    def kernel_off_by(factor):
        def output(*arguments):
            result = exact(*arguments)
            return result * factor if getattr(module, switch) else result

        return output

    monkeypatch.setattr(module, function, kernel_off_by(1.001))
    assert not getattr(first, check)(prefill, method)["passed"]
    monkeypatch.setattr(module, function, kernel_off_by(1.0))
    assert getattr(first, check)(prefill, method)["passed"]


def test_the_cpu_form_of_the_construction_stages(tmp_path, kernel_flags, monkeypatch):
    """``nearest``, ``tiles``, ``constructions`` and ``profile`` on the shrunken 8B shape: every
    compressed configuration of configs/grid/paper_ruler.yaml built once, each nearest-centre form and
    tile choosing a centre no further than float64's nearest but by fp32 rounding (on a CPU every one
    is the torch path) and keeping the same slots, the fastest tiles left on (the seconds faked: the
    larger a program's tiles, the faster), the prefill timed with and without H2O's sums, and both
    ratios timed alone, shared and profiled."""

    def tile_priced(device, function, *arguments):
        return function(*arguments), 1 / (nearest_kernel.POINT_TILE * nearest_kernel.CENTER_TILE)

    monkeypatch.setattr(first, "timed", tile_priced)
    grid = yaml.safe_load((Path(first.__file__).parents[3] / "configs/grid/paper_ruler.yaml").read_text())
    expected = {
        (method, ratio, setting)
        for method in grid["method"]
        if method != "full"
        for ratio in grid["ratio"]
        for setting in grid["setting"]
    }
    launchers = (nearest_kernel.POINT_TILE, nearest_kernel.CENTER_TILE, nearest_kernel.NUM_WARPS)
    stages = ["nearest", "tiles", "constructions", "profile"]
    assert first.main(["--out", str(tmp_path), "--stages", *stages]) == 0
    rows = json.loads((tmp_path / "constructions.json").read_text())["rows"]
    assert len(rows) == len(expected) == 72
    assert {(row["method"], row["ratio"], row["setting"]) for row in rows} == expected
    nearest = json.loads((tmp_path / "nearest.json").read_text())
    assert list(nearest["variants"]) == list(first.NEAREST_FORMS) and nearest["reference"] == "torch"
    tiles = json.loads((tmp_path / "tiles.json").read_text())
    names = {first.tile_name(tile): tile for tile in first.NEAREST_TILES}
    assert list(tiles["variants"]) == list(names) and tiles["reference"] == first.tile_name(launchers)
    for report in (nearest, tiles):
        for variant in report["variants"].values():
            assert variant["largest_gap_relative"] <= 1e-6 and variant["same_slots_as_reference"]
    assert nearest["chosen"] == "torch"  # every form priced alike: the first
    largest = max(first.NEAREST_TILES, key=lambda tile: tile[0] * tile[1])
    assert names[tiles["chosen"]] == largest != launchers
    assert (nearest_kernel.POINT_TILE, nearest_kernel.CENTER_TILE, nearest_kernel.NUM_WARPS) == largest
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert set(profile["prefill_s"]) == {"plain", "h2o_sums", "h2o_sums_kernel"}
    ratios = {str(ratio) for ratio in first.PROFILE_RATIOS}
    assert set(profile["alone_s"]) == set(profile["shared_s"]) == set(profile["profiles"]) == ratios


def test_the_cpu_form_of_the_views_stage_times_a_step_of_the_73_rows(tmp_path):
    """``views`` on the shrunken 8B shape: no kernel check without CUDA, one eager step of the paper
    grid's 73 rows as views with the torch form, its bytes from the plan; no floor without a card."""
    assert first.main(["--out", str(tmp_path), "--stages", "views"]) == 0
    report = json.loads((tmp_path / "views.json").read_text())
    assert "kernel" not in report and set(report["steps"]) == {"torch"}
    step = report["steps"]["torch"]
    assert (step["rows"], step["length"]) == (73, first.LENGTHS["cpu"][0])
    assert len(step["step_ms_runs"]) == first.VIEW_STEPS and step["step_ms"] > 0
    assert step["kv_read_gb"] > 0 and step["gb_per_s"] > 0 and "floor_ms" not in step


def test_the_view_check_passes_where_both_forms_are_the_torch_one_and_fails_one_off_by_a_fraction(
    monkeypatch,
):
    """On a CPU both sides of ``view_check`` take the torch form (its switch acts on CUDA only): each
    within fp32 rounding of float64; a "kernel" (the form run while ``CUDA_FUSED_VIEWS`` is on) 0.1%
    off fails."""
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    check = first.view_check(backbone)
    assert check["passed"] and len(check["cases"]) == len(first.VIEW_CASES["cpu"])
    for case in check["cases"]:
        assert case["kernel_error"] == case["torch_error"] < 1e-5
    exact = reskv.views.view_attention

    def off(*arguments):
        result = exact(*arguments)
        return result * 1.001 if reskv.views.CUDA_FUSED_VIEWS else result

    monkeypatch.setattr(reskv.views, "view_attention", off)
    assert not first.view_check(backbone)["passed"]


def test_a_variant_that_raises_is_reported_and_left_out_and_the_others_still_compared(kernel_flags):
    """``nearest_variants`` on the shrunken 8B shape: a variant whose nearest-centre step raises (as
    tiles a card cannot launch would) keeps its error and is never chosen; the reference and a variant
    equal to it are timed and compared."""

    def raises(*arguments):
        raise RuntimeError("faked: out of resources")

    variants = {"reference": [], "raising": [(reskv.residual, "nearest_centers", raises)], "same": []}
    backbone = first.bench_backbone("cpu")
    report = first.nearest_variants(backbone, "cpu", lambda report: None, variants)
    assert report["variants"]["raising"]["error"] == "RuntimeError('faked: out of resources')"
    assert "construct_s" not in report["variants"]["raising"]
    for name in ("reference", "same"):
        assert report["variants"][name]["same_slots_as_reference"]
    assert report["chosen"] in ("reference", "same")
    assert first.summary("tiles", report | {"seconds": 1.0}).count("failed: RuntimeError") == 1
