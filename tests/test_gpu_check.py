"""The GPU check's CPU form (what a machine without CUDA runs) and its pass/fail rules."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import reskv.attention
import reskv.decode_kernel
import reskv.nearest_kernel
import reskv.residual
from baselines import build_method
from baselines.registry import METHODS
from reskv.backbones import random_backbone
from reskv.compress import compress_layer
from reskv.engine import Prefill
from reskv.proxy import ValidationProxy
from scripts.bench.dispatch_counts import count_dispatch
from scripts.bench.gpu_check import cli, correctness, efficiency, report
from scripts.bench.gpu_check.efficiency import CONSTRUCTION_VARIANTS
from scripts.measure import CPU_SHRINK, random_prompt
from tests.conftest import state_attention


def layer(
    kept: list[bool], residual: list[int], output: float, slots: list[int], budget: int, scores=None
) -> dict:
    return {
        "kept": torch.tensor([kept]),
        "scores": torch.tensor([scores or [1.0] * len(kept)]),
        "residual_slots": residual,
        "output": torch.full((1, 2, 4), output),
        "slots": slots,
        "budget": budget,
    }


def test_compare_layers_takes_the_output_error_only_where_the_caches_agree():
    expected = [layer([True, False], [1], 1.0, [2], 2), layer([True, True], [0], 1.0, [2], 2)]
    got = [layer([True, False], [1], 1.5, [2], 2), layer([False, True], [0], 9.0, [2], 2)]
    row = correctness.compare_layers("uniform", got, expected)
    assert row["layers_with_equal_caches"] == 1
    assert row["kept_agreement"] == pytest.approx((1.0 + 0.5) / 2)
    assert row["max_output_error"] == pytest.approx(0.5)  # |1.5 - 1| / 1 on the agreeing layer only
    assert row["finite"] and row["budget_ok"]


@pytest.mark.parametrize(("scores", "tie"), [([0.5, 0.3, 0.3], True), ([0.5, 0.3, 0.2], False)])
def test_a_kept_set_flip_between_tokens_of_equal_score_is_a_near_tie(scores, tie):
    expected = [layer([True, True, False], [0], 1.0, [2], 2, scores)]
    got = [layer([True, False, True], [0], 1.0, [2], 2, scores)]  # tokens 1 and 2 swapped
    row = correctness.compare_layers("uniform", got, expected)
    assert row["layers_with_equal_caches"] == 0 and row["layers_with_near_tie_flips"] == int(tie)
    assert correctness.passed({**row, "dtype": "fp32"}) is tie


def test_layer_outputs_are_the_decode_steps_each_observed_query_as_one_step():
    """The correctness check compares what a decode step computes: each of the last observed queries
    attended alone over the compressed layer, equal to the spec's form (``joint_attention``) of that
    query over the state's main part and entries."""
    model = correctness.tiny_model(*correctness.TINY_MODELS["llama3.1-8b-instruct-h8-kv2"])
    method = build_method("snapkv+reskv", 0.6)
    prefill = Prefill(model, random_prompt(range(1, 512), 1024, seed=1), 992, [method])
    results = correctness.layer_results(prefill, "snapkv+reskv", 0.6, "agnostic")
    assert any(sum(layer["residual_slots"]) for layer in results)
    for observation, layer in zip(prefill.observations("agnostic"), results, strict=True):
        state = compress_layer(observation, method.scorer, 0.6, method.residual, len(results))
        queries = observation.queries[:, -correctness.CHECK_QUERIES :]  # [H, n, d]
        grouped = queries.transpose(0, 1).reshape(
            queries.shape[1], observation.num_kv_heads, -1, queries.shape[-1]
        )
        expected = torch.stack(
            [state_attention(state, step, observation.scaling, method.decode_rule) for step in grouped]
        )  # [n, H_kv, G, d]
        torch.testing.assert_close(
            layer["output"], expected.reshape(layer["output"].shape), rtol=1e-5, atol=1e-6
        )


def test_budget_rule_per_head_and_adakv_per_layer():
    uneven = layer([True], [0], 1.0, [5, 3], 4)
    assert not correctness.budget_ok("uniform", uneven)  # one head above b = 4
    assert correctness.budget_ok("head", uneven)  # 8 <= 2 * 4 for the layer
    assert not correctness.budget_ok("head", layer([True], [0], 1.0, [5, 4], 4))


@pytest.mark.parametrize(
    ("change", "dtype", "expected"),
    [
        ({}, "fp32", True),
        ({"layers_with_equal_caches": 1}, "fp32", False),  # fp32 must keep identical caches
        ({"layers_with_equal_caches": 1, "layers_with_near_tie_flips": 1}, "fp32", True),
        ({"layers_with_equal_caches": 1}, "bf16", True),  # low precision may flip near ties
        ({"finite": False}, "bf16", False),
        ({"budget_ok": False}, "fp16", False),
        ({"max_output_error": 0.2}, "bf16", False),
    ],
)
def test_pass_rule(change, dtype, expected):
    row = {
        "dtype": dtype,
        "layers": 2,
        "layers_with_equal_caches": 2,
        "layers_with_near_tie_flips": 0,
        "finite": True,
        "budget_ok": True,
        "max_output_error": 0.0,
        **change,
    }
    assert correctness.passed(row) is expected


# The CPU run splits the check's sweeps over two tiny models: every method (GQA group 4, fp32),
# and every dtype (the other architecture, GQA group 1) for a plain and a ResKV-composed cache.
METHOD_SWEEP_MODEL, DTYPE_SWEEP_MODEL = "llama3.1-8b-instruct-h8-kv2", "qwen2.5-7b-instruct-h4-kv4"
DTYPE_SWEEP_METHODS = ("snapkv", "snapkv+reskv")


def report_of(out: Path, *arguments: str) -> dict:
    assert cli.main(["--out", str(out), *arguments]) == 0
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_cpu_run_of_every_method_writes_a_passing_report_and_the_figure(tmp_path):
    written = report_of(tmp_path, "--models", METHOD_SWEEP_MODEL, "--dtypes", "fp32", "--methods", *METHODS)
    assert written["machine"]["cuda_available"] is False and written["machine"]["attention_path"] == "sdpa"
    assert written["machine"]["nearest_centers"] == "torch (baddbmm + argmin)"
    checked = written["correctness"]
    # Every compressing method x 2 ratios x 2 settings.
    assert len(checked) == (len(METHODS) - 1) * 2 * 2 and written["correctness_passed"]
    assert {row["method"] for row in checked} == set(METHODS) - {"full"}
    assert sum(row["residual_heads"] for row in checked if "+reskv" in row["method"]) > 0
    measured = [row for row in written["efficiency"] if row.get("status") == "ok"]
    # 2 shapes x 2 lengths x (full + 4 methods x 2 ratios).
    assert len(measured) == 2 * 2 * 9
    full = {(row["shape"], row["length"]): row for row in measured if row["method"] == "full"}
    for row in measured:
        if row["method"] != "full":
            full_bytes = full[row["shape"], row["length"]]["cache_bytes_after_decode"]
            assert row["cache_bytes_after_decode"] < full_bytes
    assert (tmp_path / "efficiency.png").stat().st_size > 0 and (tmp_path / "efficiency.pdf").exists()


@pytest.mark.slow
def test_cpu_run_in_every_dtype_passes(tmp_path):
    arguments = ["--models", DTYPE_SWEEP_MODEL, "--methods", *DTYPE_SWEEP_METHODS, "--skip-efficiency"]
    written = report_of(tmp_path, *arguments)
    rows = written["correctness"]
    # 3 dtypes x 2 methods x 2 ratios x 2 settings, against the CPU fp32 reference.
    assert len(rows) == 3 * 2 * 2 * 2 and written["correctness_passed"]
    assert {row["dtype"] for row in rows} == set(correctness.DTYPES)


def test_torch_paths_turns_every_kernel_off_for_the_run_only(monkeypatch, tmp_path):
    """``--torch-paths`` (a kernel that fails to compile on the device's Triton): the run sees both
    kernels' switches off, and both are on again after it."""
    seen = []
    monkeypatch.setattr(
        cli,
        "run",
        lambda args: seen.append((reskv.residual.CUDA_FUSED_NEAREST, reskv.attention.CUDA_FUSED_DECODE)) or 0,
    )
    assert cli.main(["--out", str(tmp_path), "--torch-paths"]) == 0
    assert cli.main(["--out", str(tmp_path)]) == 0
    assert seen == [(False, False), (True, True)]
    assert reskv.residual.CUDA_FUSED_NEAREST and reskv.attention.CUDA_FUSED_DECODE


def test_the_machine_block_names_each_kernel_with_the_tiles_its_launcher_uses(monkeypatch):
    """Where CUDA runs the kernels, the report says which tiles and warps its timings are of (the
    launchers' constants, set here to values no kernel ships with)."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(report, "machine", lambda: {"cuda_available": True})
    monkeypatch.setattr(report, "matmul_gflops", lambda *args, **kwargs: 1.0)
    for module, name, value in [
        (reskv.nearest_kernel, "POINT_TILE", 128),
        (reskv.nearest_kernel, "CENTER_TILE", 16),
        (reskv.nearest_kernel, "NUM_WARPS", 2),
        (reskv.decode_kernel, "SLOT_TILE", 48),
        (reskv.decode_kernel, "NUM_WARPS", 1),
    ]:
        monkeypatch.setattr(module, name, value)
    info = report.check_machine("cpu")
    kernel = f"Triton {triton.__version__} kernel"
    assert info["nearest_centers"] == f"{kernel}, bf16 points bf16x3, others torch, 128 x 16 tiles, 2 warps"
    assert info["gated_decode_attention"] == f"{kernel}, 2 launches, 48-slot tiles, 1 warps"


def test_efficiency_rows_measure_the_named_methods_and_the_full_cache():
    torch.manual_seed(0)
    backbone = random_backbone("llama3.1-8b-instruct", torch.float32, "cpu", **CPU_SHRINK)
    rows = efficiency.efficiency_rows(backbone, [96], [0.9], 2, method_names=("snapkv+reskv",))
    assert [(row["method"], row["ratio"], row["status"]) for row in rows] == [
        ("full", None, "ok"),
        ("snapkv+reskv", 0.9, "ok"),
    ]
    # The construction was timed on the full prefill; the request itself compressed inside its own.
    assert rows[1]["construct_s"] > 0 and rows[1]["construct_gflop"] > 0 and rows[1]["prefill_s"] > 0


def test_a_decode_rate_is_the_median_of_its_repeated_runs_each_kept():
    torch.manual_seed(0)
    backbone = random_backbone("llama3.1-8b-instruct", torch.float32, "cpu", **CPU_SHRINK)
    rows = efficiency.efficiency_rows(backbone, [96], [0.9], 2, method_names=("snapkv",), decode_repeats=3)
    for row in rows:
        runs = row["decode_tokens_per_s_runs"]
        assert len(runs) == 3 and row["decode_tokens_per_s"] == sorted(runs)[1]


def test_compare_paths_times_each_reskv_construction_again_on_each_path(monkeypatch):
    """``--compare-paths``: a +ResKV construction (not its base's) is timed again with the kernel's
    split products on TF32 operands, with ``CUDA_FUSED_NEAREST`` off and with
    ``CUDA_SORTED_CLUSTER_SUMS`` on, one switch at a time, its request decodes again with
    ``CUDA_FUSED_DECODE`` off, and the summary prints those times and rates beside the default's."""
    constructions = []
    compressed = Prefill.compressed

    def recorded(self, method, setting):
        switches = (
            reskv.nearest_kernel.SPLIT_OPERANDS,
            reskv.residual.CUDA_FUSED_NEAREST,
            reskv.residual.CUDA_SORTED_CLUSTER_SUMS,
        )
        constructions.append((method.name, switches))
        return compressed(self, method, setting)

    decodes = []
    generate = Prefill.generate

    def recorded_generate(self, method, *args, **kwargs):
        decodes.append((method.name, reskv.attention.CUDA_FUSED_DECODE))
        return generate(self, method, *args, **kwargs)

    monkeypatch.setattr(Prefill, "compressed", recorded)
    monkeypatch.setattr(Prefill, "generate", recorded_generate)
    torch.manual_seed(0)
    backbone = random_backbone("llama3.1-8b-instruct", torch.float32, "cpu", **CPU_SHRINK)
    methods = ("snapkv", "snapkv+reskv")
    rows = efficiency.efficiency_rows(backbone, [96], [0.9], 2, method_names=methods, compare_paths=True)
    # One construction on each path, +ResKV's (its base has no residual to compare).
    default = ("bf16", True, False)
    assert [(name, switches) for name, switches in constructions if switches != default] == [
        ("snapkv+reskv", ("tf32", True, False)),
        ("snapkv+reskv", ("bf16", False, False)),
        ("snapkv+reskv", ("bf16", True, True)),
    ]
    assert constructions[-1][1] == default  # every switch restored
    assert "construct_s_torch_nearest" not in rows[1] and "torch_attention_same_tokens" not in rows[1]
    # Each +ResKV request decodes again with the torch attention (the same tokens on CPU, where both
    # forms are the torch one), and the summary prints its rate.
    assert [name for name, fused in decodes if not fused] == ["snapkv+reskv"]
    assert rows[2]["torch_attention_same_tokens"] and rows[2]["decode_tokens_per_s_torch_attention"] > 0
    assert reskv.attention.CUDA_FUSED_DECODE  # restored
    tf32_operands, torch_path, sorted_sums = (
        rows[2][key] - rows[1]["construct_s"] for key in efficiency.CONSTRUCTION_VARIANTS
    )
    assert all(rows[2][key.replace("construct_s_", "same_sizes_")] for key in CONSTRUCTION_VARIANTS)
    lines = report.summary({"machine": {"fp32_matmul_gflops": 1.0}, "efficiency": rows})
    expected = f"(other paths: tf32 operands nearest {tf32_operands:.3f}s, torch nearest {torch_path:.3f}s, "
    assert expected + f"sorted sums {sorted_sums:.3f}s);" in lines[1]
    torch_form = rows[2]["decode_tokens_per_s_torch_attention"] / rows[1]["decode_tokens_per_s"]
    assert f"(torch attention {torch_form:.3f})" in lines[1]


def test_compare_paths_marks_a_path_that_chose_other_residual_sizes(monkeypatch):
    """A path whose proxy keeps no entries (a stand-in for a near tie gone the other way) is marked."""
    no_entries = (
        ValidationProxy,
        "choose_each",
        lambda self, budget_sets: torch.zeros(len(budget_sets), len(budget_sets[0]), dtype=torch.long),
    )
    monkeypatch.setattr(efficiency, "CONSTRUCTION_VARIANTS", {"construct_s_no_entries": no_entries})
    torch.manual_seed(0)
    backbone = random_backbone("llama3.1-8b-instruct", torch.float32, "cpu", **CPU_SHRINK)
    methods = ("snapkv", "snapkv+reskv")
    rows = efficiency.efficiency_rows(backbone, [256], [0.6], 2, method_names=methods, compare_paths=True)
    assert rows[2]["residual_heads"] > 0 and rows[2]["same_sizes_no_entries"] is False
    lines = report.summary({"machine": {"fp32_matmul_gflops": 1.0}, "efficiency": rows})
    assert " (other sizes));" in lines[1]


def test_the_figure_draws_only_the_panels_some_row_measured():
    eager = {"request_peak_bytes": 1, "cache_bytes_after_decode": 1, "decode_tokens_per_s": 1.0}
    assert [panel[0] for panel in report.drawn_panels([eager, {"status": "OOM"}])] == [
        "request_peak_bytes",
        "cache_bytes_after_decode",
        "decode_tokens_per_s",
    ]
    compiled = {**eager, "compiled_tokens_per_s": 2.0}
    assert report.drawn_panels([eager, compiled]) == list(report.PANELS)


def test_a_construction_profile_counts_the_calls_the_dispatch_counter_counts():
    torch.manual_seed(0)
    backbone = random_backbone("llama3.1-8b-instruct", torch.float32, "cpu", **CPU_SHRINK)
    method = build_method("snapkv+reskv", 0.9)
    prefill = Prefill(backbone, random_prompt(range(1, 512), 96, seed=42), 96, [method])
    profile = efficiency.device_profile(torch.device("cpu"), prefill.compressed, method, "aware", top=1000)
    with count_dispatch() as counts:
        prefill.compressed(method, "aware")
    calls = {op["op"]: op["calls"] for op in profile["top"]}
    # Leaf ops (no composite above them): the profiler's calls are the dispatch counter's ops.
    for name in ("bmm", "sort"):
        assert calls[f"aten::{name}"] == counts.by_op[name] > 0
    assert profile["device_launches"] == 0 and profile["device_busy_s"] == 0.0  # no CUDA on this machine
    assert profile["top_kernels"] == []
    hosts = [op["self_host_s"] for op in profile["top"]]
    assert hosts == sorted(hosts, reverse=True)


def test_kernel_totals_sum_each_kernels_launches_and_durations_largest_first():
    def launch(name: str, microseconds: int):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: microseconds))

    events = [
        launch("gemm", 30),
        launch("softmax", 5),
        launch("gemm", 50),
        launch("copy", 60),
        launch("softmax", 4),
    ]
    assert efficiency.kernel_totals(events, top=2) == [
        {"kernel": "gemm", "launches": 2, "device_s": pytest.approx(80e-6)},
        {"kernel": "copy", "launches": 1, "device_s": pytest.approx(60e-6)},
    ]


class CannedSource:
    """A ``Prefill`` stand-in whose compiled decodes return fixed tokens and whose eager logits after
    ``n`` fed tokens are ``logits[n]``."""

    prompt_ids, context_length = [7, 8], 2

    def __init__(self, first: list[int], second: list[int], logits: list[list[float]], third=()):
        self.runs, self.logits = [first, second, *third], logits

    def generate(self, method, setting, max_new_tokens, decode):
        assert decode == "compiled"
        return SimpleNamespace(token_ids=self.runs.pop(0), timings={"decode_tokens": 3, "decode_s": 0.5})

    def compressed(self, method, setting):
        return None, {}

    def next_logits(self, token_ids, cache, every_position):
        return torch.tensor([self.logits[len(token_ids)]])


def test_compiled_decode_reports_its_first_difference_from_eager_and_the_eager_gap_there():
    logits = [[0.0, 1.0, 3.0], [2.0, 1.75, 0.0], [0.0, 0.0, 1.0]]
    row = efficiency.compiled_decode(CannedSource([2, 1, 2], [2, 1, 2], logits), None, 3, [2, 0, 2])
    assert row["compiled_tokens_per_s"] == 6.0 and row["compiled_repeats_itself"]
    # Step 1 differs (1 against eager's 0): eager's logits after one token, top two 2.0 and 1.75.
    assert not row["compiled_same_tokens"] and row["compiled_first_difference"] == 1
    assert row["eager_top2_gap_there"] == 0.25
    row = efficiency.compiled_decode(CannedSource([2, 0, 2], [2, 0, 1], logits), None, 3, [2, 0, 2])
    assert row["compiled_same_tokens"] and not row["compiled_repeats_itself"]
    assert row["compiled_first_difference"] is None and row["eager_top2_gap_there"] is None
    assert "compiled_profile" not in row


def test_a_profiled_compiled_decode_profiles_a_third_run_after_the_timed_one():
    source = CannedSource([2, 1, 2], [2, 1, 2], [[0.0, 1.0, 3.0]], third=[[2, 2, 2]])
    row = efficiency.compiled_decode(source, None, 3, [2, 1, 2], profile_on=torch.device("cpu"))
    assert source.runs == []  # all three runs taken
    assert row["compiled_repeats_itself"] and row["compiled_same_tokens"]  # from the first two alone
    assert row["compiled_profile"]["profiled_s"] > 0 and row["compiled_profile"]["top_kernels"] == []


def test_the_summary_prints_a_line_per_profile_with_its_top_kernels():
    profile = {
        "profiled_s": 0.5,
        "device_busy_s": 0.25,
        "device_launches": 7,
        "aten_calls": 9,
        "top": [{"op": "aten::bmm", "calls": 2, "self_device_s": 0.002, "self_host_s": 0.001}],
        "top_kernels": [{"kernel": "gemm_kernel", "launches": 2, "device_s": 0.0015}],
    }
    rows = [
        {
            "shape": "s",
            "length": 4,
            "method": "full",
            "ratio": None,
            "status": "ok",
            "compiled_profile": profile,
        },
        {
            "shape": "s",
            "length": 4,
            "method": "snapkv",
            "ratio": 0.9,
            "status": "OOM",
            "construct_profile": profile,
        },
    ]
    lines = report.summary({"machine": {"fp32_matmul_gflops": 1.0}, "efficiency": rows})
    shared = (
        " 0.500s profiled, device busy 0.250s in 7 launches, 9 aten calls; top (device/host ms):"
        " aten::bmm x2 2.0/1.0; top kernels (ms): gemm_kernel x2 1.5"
    )
    assert lines[1:] == [
        "profile of the compiled decode, s 4 full:" + shared,
        "profile of the construction, s 4 snapkv 0.9:" + shared,
    ]
