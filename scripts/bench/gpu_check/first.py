"""The first GPU call of the grid, prepared to fit a short device window: ``make gpu-first`` or

    python -m scripts.bench.gpu_check.first --out DIR [--stages kernels grid decode efficiency]
        [--budget-s 420]

Its stages run in the order of what has never been measured on a GPU, each writing ``DIR/<stage>.json``
as it ends (a call cut short keeps what was done), and a stage is skipped, saying so, when the
budget left is below what it needs (``STAGE_SECONDS``):

1. ``kernels``: each Triton kernel against its torch path at the 8B shape (4K tokens, SnapKV+ResKV at
   0.9): the fused nearest-centre kernel must give the torch path's residual sizes in every head, the
   fused decode kernel an attention output no further from float64 than the torch form's
   (``decode_check``), the attention-sums kernels column sums and outputs no further from float64
   than the torch path's (``attention_sums_check``), the Lloyd and loss kernels the torch path's
   residual sizes in every head (``construction_check``); a mismatch or an error switches the kernel
   off for the rest of the call (``KERNEL_SWITCHES``) and the report says so, and the kernels off by
   default (``OFF_BY_DEFAULT``: the attention sums, the Lloyd steps, the proxy's losses) are switched
   on for the rest of the call where they pass;
2. ``nearest``: the nearest-centre step's forms (the torch path, the kernel's IEEE, TF32x3 and
   bf16x3 products) on one layer's k-means at the longest length's shape, TFLOP/s and choices
   against float64's, then a +ResKV construction with each; the fastest that keeps the torch path's
   slots stays on for the rest of the call;
3. ``tiles``: the same for the nearest-centre kernel's tiles (``NEAREST_TILES``: the points and
   centres a program takes, its warps; the Lloyd steps' too), in the form the call has on, the
   launchers' own the reference;
4. ``constructions``: at the longest length, each compressed configuration of the paper grid built
   alone from the shared prefill (within ``Prefill.sharing_construction``, in the grid's order, as
   the grid builds them), its seconds saved as it ends, until the stage's share of the budget
   (``CONSTRUCTION_SHARE``) is spent: where a sample's construction time goes, by method, setting
   and ratio;
5. ``profile``: at the longest length, the prefill with and without H2O's accumulated attention;
   SnapKV+ResKV query-aware at ratios 0.6 and 0.9, each built alone (and without each kernel off by
   default that the kernels stage switched on, ``OFF_BY_DEFAULT``) and as the grid builds it, then
   profiled: kernels, launches, the host's waits and copies;
6. ``grid``: one sample of the paper RULER grid (configs/grid/paper_ruler.yaml, 73 configurations)
   at 32K and at 4K against one full-cache request, warm against warm (a short grid first compiles
   the step's graphs, the request is timed on its second run), then a second 32K sample in the same
   process (the allocator as a run leaves it): wall seconds, stages, batches, graphs compiled, CUDA
   graphs recorded, fallbacks, peak memory, and the dry run's batches and seconds for that sample
   from the committed H100 calibration beside them;
7. ``decode``: the compiled decode rate of one row and of a batch of the grid's compressed rows, as
   the grid decodes them, each the median of 3 runs with every run's rate;
8. ``efficiency``: the efficiency rows at one length, eager, with ``--compare-paths``' variants
   (``scripts.bench.gpu_check.efficiency``);
9. ``views``: the paper grid's rows as views of one prefilled cache (``reskv.views``): the view
   kernel's attention against float64 at the layer beside the torch form's (``view_check``; switched
   off for the rest of the call where it fails), then one eager decode step of all 73 rows at the
   longest length, with the kernel and with the torch form, in ms and GB/s against the card's
   bandwidth floor (``view_step``: the rows built from the plan on random keys and values, no
   construction); the grid end to end with the view form is the ``grid`` stage's.

``--grid-decode eager`` decodes the grid stage's samples eagerly (no graph compiled: ~84 s a graph on
an H200), for a call that measures the constructions rather than the compiled step.

Without CUDA the same stages run on a shrunken copy of the 8B shape at short lengths, skipping only
what needs CUDA (the kernels' compilation, peak memory), and the GPU command is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import torch

from baselines import build_method
from reskv import attention, nearest_kernel, residual, scoring
from reskv import views as views_module
from reskv.attention import RowGates
from reskv.backbones import Backbone
from reskv.batching import FP32_BYTES, ModelShape, ViewRow, values_order, view_step_slots
from reskv.cache import CompressedLayer, ObservedLayer
from reskv.compress import kept_positions
from reskv.config import SETTINGS, ResidualConfig
from reskv.decode_rule import DecodeRule
from reskv.decoding import forward
from reskv.engine import Prefill
from reskv.grid import decode_grid, model_shape, values_key
from reskv.views import RowView, ViewLayer, view_cache
from scripts.bench.gpu_check.efficiency import (
    TORCH_ATTENTION_SUMS,
    TORCH_DECODE,
    TORCH_LLOYD,
    TORCH_LOSSES,
    TORCH_NEAREST,
    device_profile,
    efficiency_rows,
)
from scripts.bench.gpu_check.report import check_machine
from scripts.bench.grid_counts import QUESTION_TOKENS
from scripts.bench.grid_gpu import (
    WARM_UP_LENGTH,
    bench_backbone,
    full_request,
    grid_sample,
    paper_ruler_requests,
)
from scripts.bench.kernel_resources import NEAREST_TILES, tile_switches
from scripts.harness.dry_run import cost, rates
from scripts.harness.dry_run.workload import Workload
from scripts.harness.plan import compose_plan
from scripts.measure import random_prompt, release_memory, timed

STAGES = ("kernels", "nearest", "tiles", "constructions", "profile", "grid", "decode", "efficiency", "views")
# Seconds the late stages need on an H100 (results/gpu/README.md, the prepared call, says how they
# are estimated): each starts only with this much of the budget left; those at 0 always run.
STAGE_SECONDS = {
    "kernels": 0,
    "nearest": 0,
    "tiles": 0,
    "constructions": 0,
    "profile": 0,
    "grid": 0,
    "decode": 40,
    "efficiency": 45,
    "views": 40,
}
# The construction's kernels off by default (report key: the switch to its torch path): the kernels
# stage checks each against its torch path (``construction_check``), and the profile stage times
# SnapKV+ResKV without each it switched on.
CONSTRUCTION_KERNELS = {"lloyd_steps": TORCH_LLOYD, "proxy_losses": TORCH_LOSSES}
# The kernels off by default until a GPU has checked them (report key: the switch to the torch path):
# the kernels stage switches each on for the rest of the call where its check passes.
OFF_BY_DEFAULT = {"attention_sums": TORCH_ATTENTION_SUMS} | CONSTRUCTION_KERNELS
# The nearest-centre step's forms the nearest stage compares: switches (module, flag, value) each sets.
NEAREST_FORMS = {
    "torch": [(residual, "CUDA_FUSED_NEAREST", False)],
    "ieee": [(nearest_kernel, "BF16_SPLIT", False), (nearest_kernel, "PRODUCT_PRECISION", "ieee")],
    "tf32x3": [(nearest_kernel, "BF16_SPLIT", False), (nearest_kernel, "PRODUCT_PRECISION", "tf32x3")],
    "bf16x3": [(nearest_kernel, "BF16_SPLIT", True), (nearest_kernel, "SPLIT_OPERANDS", "bf16")],
    "bf16x3_tf32_operands": [
        (nearest_kernel, "BF16_SPLIT", True),
        (nearest_kernel, "SPLIT_OPERANDS", "tf32"),
    ],
}
NEAREST_REPEATS = 3
# Evicted tokens per centre in the nearest stage's k-means (a residual of ~6% of the evicted tokens).
NEAREST_POINTS_PER_CENTER = 16
# The ratios the profile stage times, in the grid's order: its dearest and cheapest +ResKV constructions.
PROFILE_RATIOS = (0.6, 0.9)
# The share of the call's budget left that the constructions stage may take (it stops after the
# construction that crosses it), the rest kept for the grid.
CONSTRUCTION_SHARE = 0.5
LENGTHS = {"cuda": (32768, 4096), "cpu": (320, 192)}  # the length never measured first
NEW_TOKENS = {"cuda": 32, "cpu": 4}
KERNEL_LENGTH = {"cuda": 4096, "cpu": 192}
# How the grid decodes: as a run would on CUDA (compiled, as few batches as the memory allows); on a
# CPU the same compiled batched path, which a CPU run would not take (``grid_decoding``'s auto).
GRID_DECODING = {"cuda": ("auto", "auto"), "cpu": ("compiled", 64)}
# The fused decode kernel's cases (``decode_check``): main slots, residual entries and padded slots of
# a layer at ratio 0.9 of a 4K and of a 32K prompt.
DECODE_CASES = ((3600, 40, 64), (29000, 300, 100))
# The kernel sums in another order than the torch form: its error against float64 may exceed the
# torch form's by this factor (plus a unit of the dtype's rounding); a wrong mask, gate or entry
# bias is orders of magnitude beyond it in fp32.
DECODE_ERROR_FACTOR = 8
DECODE_REPEATS = 3
# The view kernel's cases (``view_check``): shared slots and rows, at a 4K and a 32K prompt on CUDA.
VIEW_CASES = {"cuda": ((4096, 16), (32768, 16)), "cpu": ((192, 6),)}
VIEW_STEPS = 8
# The cards' memory bandwidth (their data sheets), for a step's floor.
HBM_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}
TORCH_VIEWS = (views_module, "CUDA_FUSED_VIEWS", False)
H100_CALIBRATION = rates.CALIBRATION_DIR / "nvidia-h100-80gb-hbm3.json"
# The device call's command (results/gpu/README.md, top: the wheels it installs, what to carry).
GPU_COMMAND = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && "
    "export PYTHONPATH=/tmp/site:. || exit; set -o pipefail; TORCH_LOGS=recompiles python3 -m "
    "scripts.bench.gpu_check.first --out $OUT --stages kernels tiles views constructions profile grid "
    "--grid-decode eager --budget-s 420 2>&1 | tee $OUT/log"
)


def prompt_of(backbone: Backbone, length: int, seed: int) -> list[int]:
    return random_prompt(range(1, backbone.model.config.vocab_size), length, seed=seed)


def kernels(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """Each Triton kernel against its torch path (module docstring, stage 1)."""
    if device != "cuda":
        return {"skipped": "needs CUDA: the Triton kernels compile for a GPU"}
    method = build_method("snapkv+reskv", 0.9)
    prompt = prompt_of(backbone, KERNEL_LENGTH[device], seed=7)
    prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, [method])
    checks = {
        "nearest_centers": (functools.partial(construction_check, TORCH_NEAREST), TORCH_NEAREST),
        "gated_decode_attention": (decode_check, TORCH_DECODE),
        "attention_sums": (attention_sums_check, TORCH_ATTENTION_SUMS),
    }
    checks |= {
        name: (functools.partial(construction_check, switch), switch)
        for name, switch in CONSTRUCTION_KERNELS.items()
    }
    report = checked(checks, prefill, method)
    for name, (module, flag, _) in OFF_BY_DEFAULT.items():
        if report[name]["passed"]:  # off by default until checked: on for the rest of the call
            mock.patch.object(module, flag, True).start()
            report[name]["switched_on"] = True
    return report


def failure(error: Exception) -> dict:
    """What a check or a variant that raised reports (a kernel's compilation or launch failing)."""
    return {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}


@contextlib.contextmanager
def switched(switches: Sequence[tuple]):
    """Each of ``switches`` (module, flag, value) set for the block."""
    with contextlib.ExitStack() as stack:
        for switch in switches:
            stack.enter_context(mock.patch.object(*switch))
        yield


def checked(checks: dict, *arguments) -> dict:
    """Each check ``(check, switch)`` of ``checks`` run on ``arguments``: its report, and where it did
    not pass (a mismatch, or an error such as the kernel's compilation failing) its kernel switched
    off for the rest of the process (``switch``: module, flag, the torch path's value)."""
    report = {}
    for name, (check, switch) in checks.items():
        try:
            report[name] = check(*arguments)
        except Exception as error:  # a compile error of the kernel: the torch path from here on
            report[name] = {"passed": False} | failure(error)
        if not report[name]["passed"]:
            mock.patch.object(*switch).start()  # off for the rest of the call
            report[name]["switched_off"] = True
    return report


def construction_check(switch: tuple, prefill: Prefill, method) -> dict:
    """A construction kernel (``switch``: module, flag, its torch path's value) against its torch
    path: the residual sizes and attended slots of every head with the kernel and without it; where
    they are the same, the largest difference of the entries' keys and values over the largest of the
    torch path's, and of their log-counts (a kernel may sum in another order: bf16 roundings of the
    means may differ by a unit, a near tie move a point or a choice)."""
    module, flag, _ = switch
    with mock.patch.object(module, flag, True):
        kernel_cache, _ = prefill.compressed(method, "aware")
    with mock.patch.object(*switch):
        torch_cache, _ = prefill.compressed(method, "aware")
    same = kernel_cache.slots() == torch_cache.slots()
    report = {"passed": same, "same_slots_every_head": same, "heads": sum(map(len, kernel_cache.slots()))}
    pairs = [
        (kernel.residual, plain.residual)
        for kernel, plain in zip(kernel_cache.layers, torch_cache.layers, strict=True)
        if isinstance(plain, CompressedLayer) and plain.residual.keys.numel()
    ]
    if same and pairs:
        for name in ("keys", "values"):
            largest = max(float(getattr(plain, name).abs().max()) for _, plain in pairs)
            difference = max(
                float((getattr(kernel, name) - getattr(plain, name)).abs().max()) for kernel, plain in pairs
            )
            report[f"entry_{name}_relative_difference"] = difference / largest
        report["log_counts_difference"] = max(
            float(
                torch.where(torch.isfinite(plain.log_counts), kernel.log_counts - plain.log_counts, 0)
                .abs()
                .max()
            )
            for kernel, plain in pairs
        )
    return report


def decode_check(prefill: Prefill, method) -> dict:
    """The fused decode kernel's attention output and the torch form's, each against float64 on the
    same inputs: ``DECODE_CASES`` at the backbone's heads (random queries, keys and values, entries
    with counts, padded slots), the method's rule, in fp32 and in the backbone's dtype. It passes
    where, in every case, the kernel's relative error is within ``DECODE_ERROR_FACTOR`` times the
    torch form's plus one unit of the dtype's rounding. A model's logits are no yardstick for a
    kernel: a random bf16 model amplifies last-bit differences along its layers (results/gpu/README.md)."""
    shape, rule = model_shape(prefill.backbone), method.decode_rule
    generator = torch.Generator().manual_seed(0)
    cases = []
    for dtype in sorted({torch.float32, prefill.backbone.model.dtype}, key=str):
        for main, entries, padded in DECODE_CASES:
            inputs = decode_inputs(shape, main, entries, padded, rule, generator)
            reference = shared_softmax_float64(*inputs, entries, rule)
            device_inputs = [tensor.to(prefill.backbone.device) for tensor in inputs]
            queries, keys, values = (tensor.to(dtype) for tensor in device_inputs[:3])
            arguments = (queries, keys, values, device_inputs[3], entries, shape.head_dim**-0.5, rule)
            kernel = attention.shared_softmax_attention(*arguments)
            with mock.patch.object(*TORCH_DECODE):
                torch_form = attention.shared_softmax_attention(*arguments)
            errors = [relative_error(output, reference) for output in (kernel, torch_form)]
            bound = DECODE_ERROR_FACTOR * errors[1] + torch.finfo(dtype).eps
            cases.append(
                {"dtype": str(dtype), "main": main, "entries": entries, "padded": padded,
                 "kernel_error": errors[0], "torch_error": errors[1], "passed": errors[0] <= bound}
            )  # fmt: skip
    return {"passed": all(case["passed"] for case in cases), "cases": cases}


def attention_sums_check(prefill: Prefill, method) -> dict:
    """Attention's sums by the kernel (``CUDA_FUSED_ATTENTION_SUMS``) and by the torch path, each
    against float64, over random queries, keys and values of the backbone's heads and dtype at the
    prompt's length: H2O's column sums (``scoring.accumulated_attention``, whose kernel SnapKV's window
    means share) of a whole prefill's queries and of its last ``QUESTION_TOKENS`` (a question's
    forward), and the validation proxy's full outputs (``scoring.attention_outputs``) of its last
    ``ResidualConfig``'s validation queries. It passes where the kernel's relative error is within
    ``DECODE_ERROR_FACTOR`` times the torch path's plus fp32's rounding."""
    shape, backbone = model_shape(prefill.backbone), prefill.backbone
    length, scaling = len(prefill.prompt_ids), backbone.scaling
    generator = torch.Generator(device=backbone.device).manual_seed(0)
    queries, keys, values = (
        torch.randn(heads, length, shape.head_dim, generator=generator, device=backbone.device).to(
            backbone.model.dtype
        )
        for heads in (shape.query_heads, shape.kv_heads, shape.kv_heads)
    )
    validation = ResidualConfig().validation_queries
    cases = []
    for sums, first in [
        ("column_sums", 0),
        ("column_sums", length - QUESTION_TOKENS),
        ("outputs", length - validation),
    ]:
        positions = range(first, length)
        if sums == "column_sums":
            arguments = (queries[:, first:], keys, positions, scaling)
            computed = functools.partial(scoring.accumulated_attention, *arguments)
            reference = column_sums_float64(*arguments)
        else:
            arguments = (queries[:, first:], keys, values, positions, scaling)
            computed = functools.partial(scoring.attention_outputs, *arguments)
            reference = outputs_float64(*arguments)
        with mock.patch.object(scoring, "CUDA_FUSED_ATTENTION_SUMS", True):
            kernel = computed()
        errors = [relative_error(found, reference) for found in (kernel, computed())]
        passed = errors[0] <= DECODE_ERROR_FACTOR * errors[1] + torch.finfo(torch.float32).eps
        cases.append(
            {"sums": sums, "queries": length - first, "kernel_error": errors[0], "torch_error": errors[1],
             "passed": passed}
        )  # fmt: skip
    return {"passed": all(case["passed"] for case in cases), "cases": cases}


def causal_probabilities_float64(
    queries: torch.Tensor, keys: torch.Tensor, positions: range, scaling: float
) -> torch.Tensor:
    """``[H, n, s]`` float64 causal softmax attention of ``queries`` at ``positions`` over ``keys``
    (query head ``h`` reading KV head ``h // G``), on the device."""
    group = queries.shape[0] // keys.shape[0]
    logits = queries.double() @ keys.double().repeat_interleave(group, dim=0).transpose(1, 2) * scaling
    query_positions = torch.arange(positions[0], positions[-1] + 1, device=keys.device)
    future = torch.arange(keys.shape[1], device=keys.device)[None, :] > query_positions[:, None]
    return logits.masked_fill_(future, -math.inf).softmax(dim=-1)


def column_sums_float64(
    queries: torch.Tensor, keys: torch.Tensor, positions: range, scaling: float
) -> torch.Tensor:
    """``accumulated_attention`` in float64 on the device, ``scoring.QUERY_CHUNK`` queries at a time."""
    total = torch.zeros(queries.shape[0], keys.shape[1], dtype=torch.float64, device=keys.device)
    for start in range(0, queries.shape[1], scoring.QUERY_CHUNK):
        chunk = slice(start, start + scoring.QUERY_CHUNK)
        total += causal_probabilities_float64(queries[:, chunk], keys, positions[chunk], scaling).sum(dim=1)
    return scoring.group_mean(total, keys.shape[0])


def outputs_float64(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: range, scaling: float
) -> torch.Tensor:
    """``attention_outputs`` ``[H_kv, G n, d]`` in float64 on the device."""
    probs = causal_probabilities_float64(queries, keys, positions, scaling)
    grouped_values = values.double().repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
    return (probs @ grouped_values).view(keys.shape[0], -1, values.shape[-1])


def decode_inputs(
    shape: ModelShape, main: int, entries: int, padded: int, rule: DecodeRule, generator: torch.Generator
) -> list[torch.Tensor]:
    """One decoded token's queries ``[H_kv, G, d]``, keys and values ``[H_kv, n, d]`` (``entries``
    first, then ``main`` slots, then ``padded`` zero slots) and the fp32 bias ``[H_kv, 1, n]``
    (``beta * log(c_j)`` on the entries, ``-inf`` on the padded slots), in fp32 on the CPU."""
    heads, group, slots = shape.kv_heads, shape.query_heads // shape.kv_heads, entries + main + padded
    queries = torch.randn(heads, group, shape.head_dim, generator=generator) * 4
    keys, values = (torch.randn(heads, slots, shape.head_dim, generator=generator) for _ in range(2))
    keys[:, entries + main :], values[:, entries + main :] = 0, 0
    counts = torch.randint(1, 60, (heads, entries), generator=generator).float()
    bias = torch.zeros(heads, 1, slots)
    bias[:, 0, :entries] = rule.beta * counts.log()
    bias[:, 0, entries + main :] = -math.inf
    return [queries, keys, values, bias]


def shared_softmax_float64(queries, keys, values, bias, entries: int, rule: DecodeRule) -> torch.Tensor:
    """reskv.md's shared softmax with the gate (Eqs. reskv and gate) in float64 on the CPU: the main
    slots' largest probability gives ``log g``, added to the entries' logits, one softmax."""
    logits = queries.double() @ keys.double().transpose(1, 2) * queries.shape[-1] ** -0.5 + bias.double()
    p_max = logits[..., entries:].softmax(dim=-1).amax(dim=-1, keepdim=True)
    logits[..., :entries] += attention.log_gate(p_max, rule.gate_terms)
    return logits.softmax(dim=-1) @ values.double()


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest absolute difference over the reference's largest magnitude, on the host (either may
    sit on the device)."""
    reference = reference.cpu()
    return ((output.cpu().double() - reference).abs().max() / reference.abs().max()).item()


def constructions(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """Each compressed configuration of the paper grid built alone (module docstring, stage 4),
    ``save``d after each."""
    length = LENGTHS[device][0]
    prompt = prompt_of(backbone, length, seed=42)
    requests = [(method, setting) for method, setting in paper_ruler_requests() if method.scorer is not None]
    deadline = time.perf_counter() + CONSTRUCTION_SHARE * seconds_left()
    report: dict = {"length": length, "rows": []}
    prefill = prefilled(backbone, prompt, [method for method, _ in requests])
    with prefill.sharing_construction():
        for method, setting in requests:
            if time.perf_counter() > deadline:
                report["stopped"] = f"the stage's budget spent after {len(report['rows'])} of {len(requests)}"
                break
            (cache, _), seconds = timed(backbone.device, prefill.compressed, method, setting)
            del cache
            report["rows"].append(
                {"method": method.name, "ratio": method.ratio, "setting": setting, "s": seconds}
            )
            save(report)
    report["construct_s"] = sum(row["s"] for row in report["rows"])
    return report


def prefilled(backbone: Backbone, prompt: list[int], methods: Sequence) -> Prefill:
    """The query-aware prefill of ``prompt`` for ``methods`` (H2O's accumulate attention during it)."""
    prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, methods)
    prefill.prefilled("aware")
    return prefill


def nearest_forms(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """The nearest-centre step's forms (``NEAREST_FORMS``) compared (``nearest_variants``), the torch
    path the reference: the fastest kernel form that keeps its slots stays on for the rest of the call."""
    return nearest_variants(backbone, device, save, NEAREST_FORMS)


def nearest_tiles(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """The nearest-centre kernel's tiles (``NEAREST_TILES``, the launchers' own first and the
    reference), in the form the call has on (bf16x3 for a bf16 model's keys), compared
    (``nearest_variants``): on the layer, the scan's; in the construction, the Lloyd steps' too where
    the kernels stage switched their kernel on. The fastest that keeps the reference's slots stays on
    for the rest of the call."""
    return nearest_variants(
        backbone, device, save, {tile_name(tiles): tile_switches(tiles) for tiles in NEAREST_TILES}
    )


def tile_name(tiles: tuple[int, int, int]) -> str:
    points, centers, warps = tiles
    return f"{points}x{centers}, {warps} warps"


def nearest_variants(
    backbone: Backbone, device: str, save: Callable[[dict], None], variants: dict[str, list[tuple]]
) -> dict:
    """The nearest-centre step under each of ``variants`` (name: the switches, module, flag and value,
    it sets; the first the reference): (1) alone on one layer's k-means at the longest length's shape
    at ratio 0.6 (bf16-valued points, centres near them as means are): TFLOP/s of the products (median
    of ``NEAREST_REPEATS``, after a compiling run), and its choices against the float64 distances'
    (agreement, and the largest gap of a choice to the nearest); (2) SnapKV+ResKV query-aware at
    ratio 0.6 built under it: seconds, and whether it keeps the reference's slots in every head. The
    fastest that keeps them stays on for the rest of the call (the report's ``chosen``). A variant
    that raises (tiles the card cannot launch) is reported with its error and left out; the
    reference's error ends the stage."""
    shape = model_shape(backbone)
    length = LENGTHS[device][0]
    generator = torch.Generator(device=backbone.device).manual_seed(0)
    rows, evicted = shape.kv_heads, int(0.6 * length)
    centers_count = max(8, evicted // NEAREST_POINTS_PER_CENTER)
    points = torch.randn(rows, evicted, shape.head_dim, generator=generator, device=backbone.device)
    points = (points * 4).bfloat16().float()
    centers = points[:, :centers_count] + 0.05 * torch.randn(
        rows, centers_count, shape.head_dim, generator=generator, device=backbone.device
    )
    exact = (centers.double() ** 2).sum(-1)[:, None, :] - 2 * points.double() @ centers.double().transpose(
        1, 2
    )
    best, best_index = exact.min(-1)
    flop = 2 * rows * evicted * centers_count * shape.head_dim
    reference_name = next(iter(variants))
    report: dict = {
        "rows": rows,
        "points": evicted,
        "centers": centers_count,
        "dim": shape.head_dim,
        "reference": reference_name,
        "variants": {},
    }
    block = residual.distance_block_bytes(points.device)
    for name, switches in variants.items():
        try:
            with switched(switches):
                run = functools.partial(residual.nearest_centers, points, centers, block, None, True)
                choice = run()  # compiles the kernel
                seconds = statistics.median(timed(backbone.device, run)[1] for _ in range(NEAREST_REPEATS))
        except Exception as error:  # e.g. tiles the card cannot launch: the other variants still run
            if name == reference_name:
                raise
            report["variants"][name] = failure(error)
            continue
        gap = exact.gather(2, choice[..., None])[..., 0] - best
        report["variants"][name] = {
            "s": seconds,
            "tflop_per_s": flop / seconds / 1e12,
            "same_as_float64": (choice == best_index).float().mean().item(),
            "largest_gap": gap.max().item(),
            "largest_gap_relative": (gap.max() / exact.abs().max()).item(),
        }
        save(report)
    del points, centers, exact, best, best_index
    release_memory(backbone.device)
    method = build_method("snapkv+reskv", 0.6)
    prefill = prefilled(backbone, prompt_of(backbone, length, seed=42), [method])
    reference = None
    for name, switches in variants.items():
        if "error" in report["variants"][name]:
            continue
        try:
            with switched(switches):
                prefill.compressed(method, "aware")  # compiles what the layer did not; warms the rest
                (cache, _), seconds = timed(backbone.device, prefill.compressed, method, "aware")
        except Exception as error:
            if name == reference_name:
                raise
            report["variants"][name] |= failure(error)
            continue
        slots = cache.slots()
        reference = slots if reference is None else reference
        report["variants"][name] |= {"construct_s": seconds, "same_slots_as_reference": slots == reference}
        save(report)
    keeping = [name for name, row in report["variants"].items() if row.get("same_slots_as_reference")]
    fastest = min(keeping, key=lambda name: report["variants"][name]["construct_s"])
    for switch in variants[fastest]:
        mock.patch.object(*switch).start()  # for the rest of the call
    report["chosen"] = fastest
    return report


def profile(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """Why a +ResKV construction of the grid costs what it does at the longest length: the
    query-aware prefill with and without H2O's accumulated attention (by the torch path and by the
    column-sum kernel), then SnapKV+ResKV
    query-aware at ``PROFILE_RATIOS``, each timed alone, then as the grid builds it (within
    ``Prefill.sharing_construction``, after SnapKV computed the scores and stacked the layers: the
    first also builds the validation proxy the others share), then profiled again with everything
    shared in place (``device_profile``: kernels, launches, the host's waits and copies)."""
    length = LENGTHS[device][0]
    prompt = prompt_of(backbone, length, seed=42)
    methods = [build_method("snapkv+reskv", ratio) for ratio in PROFILE_RATIOS]
    report: dict = {"length": length, "prefill_s": {}, "method": "snapkv+reskv", "setting": "aware"}
    report |= {"alone_s": {}, "shared_s": {}}
    h2o = [build_method("h2o", 0.9)]
    prefills = (("h2o_sums", h2o, False), ("h2o_sums_kernel", h2o, True), ("plain", methods, False))
    for name, prefilled_for, fused in prefills:
        release_memory(backbone.device)
        with mock.patch.object(scoring, "CUDA_FUSED_ATTENTION_SUMS", fused):
            prefill, report["prefill_s"][name] = timed(
                backbone.device, prefilled, backbone, prompt, prefilled_for
            )
        save(report)
    switched_on = {name: switch for name, switch in OFF_BY_DEFAULT.items() if getattr(*switch[:2])}
    report["construction_kernels_on"] = sorted(switched_on)
    for method in methods:
        report["alone_s"][method.ratio] = timed(backbone.device, prefill.compressed, method, "aware")[1]
        for name, switch in switched_on.items():  # each kernel's torch path beside it
            with mock.patch.object(*switch):
                seconds = timed(backbone.device, prefill.compressed, method, "aware")[1]
            report.setdefault("alone_s_without", {}).setdefault(name, {})[method.ratio] = seconds
        save(report)
    with prefill.sharing_construction():
        prefill.compressed(build_method("snapkv", 0.9), "aware")  # the scores and stacked layers
        for method in methods:
            report["shared_s"][method.ratio] = timed(backbone.device, prefill.compressed, method, "aware")[1]
            save(report)
        report["profiles"] = {}
        for method in methods:
            report["profiles"][method.ratio] = device_profile(
                backbone.device, prefill.compressed, method, "aware", top=20
            )
            save(report)
    return report


def grid(
    backbone: Backbone,
    device: str,
    save: Callable[[dict], None],
    seconds_left: Callable[[], float],
    decode: str | None = None,
) -> dict:
    """The paper grid against one full-cache request per length, a second sample at the first (the
    longest) where the call's budget still holds it beside the late stages, decoded as a run would
    (``GRID_DECODING``) or as ``decode`` says; ``save``d after each
    sample, and after each configuration its sample's stage seconds so far (``in_progress``)."""
    new_tokens, lengths = NEW_TOKENS[device], LENGTHS[device]
    started = time.perf_counter()
    sample = functools.partial(grid_sample, backbone, new_tokens=new_tokens, count_flops=False)
    decoding = dict(zip(("decode", "decode_batch"), GRID_DECODING[device], strict=True))
    if decode is not None:
        decoding["decode"] = decode
    warm_up = sample(prompt_of(backbone, WARM_UP_LENGTH[device], 1), **decoding)
    report = {"warm_up": {"length": WARM_UP_LENGTH[device], "s": time.perf_counter() - started, **warm_up}}
    report["samples"] = []
    for length, seed in [(length, 42) for length in lengths] + [(lengths[0], 43)]:
        if seed == 43 and device == "cuda":  # the late stages' time kept
            needed = report["samples"][-1]["s"] + STAGE_SECONDS["decode"] + STAGE_SECONDS["efficiency"]
            if seconds_left() < needed:
                report["second_sample"] = (
                    f"skipped: {seconds_left():.0f}s left, it and the late stages need {needed:.0f}s"
                )
                break
        sample_started = time.perf_counter()
        release_memory(backbone.device)
        prompt = prompt_of(backbone, length, seed)
        row = {"length": length, "seed": seed, "rows": len(paper_ruler_requests())}
        if seed == 42:
            row["full_eager_s"] = full_request(backbone, prompt, new_tokens, "eager")
            if decoding["decode"] != "eager":  # compiling its graph is ~84 s on an H200
                row["full_compiled_s"] = full_request_as_the_grid(backbone, prompt, new_tokens)
        in_progress = functools.partial(progress_saved, save, report, {"length": length, "seed": seed})
        row |= sample(prompt, progress=in_progress, **decoding)
        row["decode_tokens_per_s_of_a_row"] = row["decode_tokens"] / row["decode_s"]
        if seed == 42:
            row["grid_over_full_eager"] = row["grid_s"] / row["full_eager_s"]
            if "full_compiled_s" in row:
                row["grid_over_full_compiled"] = row["grid_s"] / row["full_compiled_s"]
        row["dry_run"] = dry_run_estimate(length, new_tokens)
        row["s"] = time.perf_counter() - sample_started
        report["samples"].append(row)
        save(report)
    return report


def progress_saved(save: Callable[[dict], None], report: dict, sample: dict, stages: dict) -> None:
    """``report`` saved with the sample under way and its stage seconds so far (``in_progress``)."""
    save(report | {"in_progress": sample | stages})


def full_request_as_the_grid(backbone: Backbone, prompt: list[int], new_tokens: int) -> float:
    """Seconds of one full-cache request decoded compiled as the grid decodes a row alone (a stacked
    cache, beside its copy: the graph the grid's full-cache row compiled), on its second run."""
    full = build_method("full")

    def request():
        prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, [full])
        generations = decode_grid(
            prefill, [(full, "aware")], new_tokens, min_new_tokens=new_tokens, decode="compiled"
        )
        return list(generations)

    request()  # untimed: records this cache's CUDA graphs
    return timed(backbone.device, request)[1]


def dry_run_estimate(length: int, new_tokens: int) -> dict:
    """The dry run's batches and seconds of one paper-grid sample of ``length`` tokens on the
    committed H100 calibration (``scripts.harness.dry_run``), every answer ``new_tokens`` long."""
    plan = compose_plan(
        [
            "grid=paper_ruler",
            "backbone=llama3.1-8b-instruct",
            f"benchmark.length={length}",
            "decode_batch=auto",
        ]
        + ["results_dir=/nonexistent"]
    )
    h100 = rates.read_rates(H100_CALIBRATION, plan.backbone)
    load = Workload(1, length, QUESTION_TOKENS, new_tokens, "bench")
    stages = cost.sample_seconds(plan, load, plan.grid, h100)
    batches = cost.decode_batches(plan, plan.grid, load, h100)
    return {
        "device": h100.device,
        "batches": sorted((len(batch) for batch in batches), reverse=True),
        "prefill_s": stages.prefill,
        "construction_s": stages.construction,
        "decode_s": stages.decode,
        "total_s": stages.total,
    }


def decode(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """The compiled decode rate of one row (beside its copy, as the grid decodes a row alone) and of a
    batch of the grid's rows, at the shortest length."""
    new_tokens = 4 * NEW_TOKENS[device]
    prompt = prompt_of(backbone, min(LENGTHS[device]), seed=42)
    compressed = [
        (method, setting) for method, setting in paper_ruler_requests() if method.scorer is not None
    ]
    report = {}
    for name, requests in (("one_row", compressed[:1]), ("batch", compressed[:8])):
        prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, [method for method, _ in requests])
        rates_per_run = []
        for _ in range(DECODE_REPEATS + 1):  # the first run records this cache's CUDA graphs
            generations = [
                g
                for _, g in decode_grid(
                    prefill, requests, new_tokens, min_new_tokens=new_tokens, decode="compiled"
                )
            ]
            seconds = sum(g.timings["decode_s"] for g in generations)
            rates_per_run.append(sum(g.timings["decode_tokens"] for g in generations) / seconds)
        timed = rates_per_run[1:]
        report[name] = {
            "rows": len(requests),
            "batches": sorted({g.run["batch_rows"] for g in generations}),
            "tokens_per_s": statistics.median(timed),
            "tokens_per_s_runs": timed,
            "first_run_tokens_per_s": rates_per_run[0],
            "length": min(LENGTHS[device]),
        }
    return report


def efficiency(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """The efficiency rows at one length, eager, with the alternative paths (``--compare-paths``)."""
    rows = efficiency_rows(
        backbone,
        [min(LENGTHS[device])],
        [0.9],
        NEW_TOKENS[device],
        method_names=("snapkv", "snapkv+reskv"),
        compare_paths=device == "cuda",
    )
    return {"rows": rows}


def views(
    backbone: Backbone, device: str, save: Callable[[dict], None], seconds_left: Callable[[], float]
) -> dict:
    """The paper grid's rows as views of one prefilled cache (module docstring, stage 9): the view
    kernel's check on CUDA (switched off for the rest of the call where it fails), then one eager
    step of every row at the longest length, with the kernel (on CUDA) and with the torch form."""
    report: dict = {}
    if device == "cuda":
        report["kernel"] = checked({"view_partials": (view_check, TORCH_VIEWS)}, backbone)["view_partials"]
        save(report)
    forms = {
        "kernel": (views_module, "CUDA_FUSED_VIEWS", views_module.CUDA_FUSED_VIEWS),
        "torch": TORCH_VIEWS,
    }
    if device != "cuda" or not report["kernel"]["passed"]:
        forms = {"torch": TORCH_VIEWS}
    report["steps"] = {}
    for name, switch in forms.items():
        with mock.patch.object(*switch):
            appended = QUESTION_TOKENS + NEW_TOKENS[device]
            report["steps"][name] = view_step(backbone, LENGTHS[device][0], appended)
        save(report)
    return report


def view_check(backbone: Backbone) -> dict:
    """The view form's attention (``reskv.views.view_attention`` of its parts) with the kernel
    (``CUDA_FUSED_VIEWS``) and with the torch form, each against float64 on the same inputs:
    ``VIEW_CASES`` at the backbone's heads (random queries, keys and values; rows keeping random
    slots, three values tensors, entries with counts, appended slots; the default rule), in fp32 and in
    the backbone's dtype (in fp32 both sides take the torch form: ``decode_kernel.VIEW_DTYPES``). It
    passes where, in every case, the kernel's relative error is within ``DECODE_ERROR_FACTOR`` times
    the torch form's plus one unit of the dtype's rounding."""
    shape, rule = model_shape(backbone), DecodeRule()
    generator = torch.Generator().manual_seed(0)
    cases = []
    for dtype in sorted({torch.float32, backbone.model.dtype}, key=str):
        for slots, rows in VIEW_CASES[backbone.device.type]:
            layer, queries = view_inputs(shape, slots, rows, rule, generator)
            reference = views_float64(layer, queries, rule)
            layer, queries = layer_on(layer, backbone.device, dtype), queries.to(backbone.device, dtype)
            kernel = view_layer_output(layer, queries)
            with mock.patch.object(*TORCH_VIEWS):
                torch_form = view_layer_output(layer, queries)
            errors = [relative_error(output, reference) for output in (kernel, torch_form)]
            bound = DECODE_ERROR_FACTOR * errors[1] + torch.finfo(dtype).eps
            cases.append(
                {"dtype": str(dtype), "slots": slots, "rows": rows,
                 "kernel_error": errors[0], "torch_error": errors[1], "passed": errors[0] <= bound}
            )  # fmt: skip
    return {"passed": all(case["passed"] for case in cases), "cases": cases}


def view_inputs(
    shape: ModelShape, slots: int, rows: int, rule: DecodeRule, generator: torch.Generator
) -> tuple[ViewLayer, torch.Tensor]:
    """A layer of ``rows`` views of ``slots`` random shared slots (fp32, on the CPU): each row keeping
    about half the slots, the last two thirds of the rows reading two other values tensors, each row 0
    to 40 entries with counts of 1 to 59, 4 appended slots written; and one decoded token's grouped
    queries ``[rows, H_kv, G, d]``."""
    heads, group, dim = shape.kv_heads, shape.query_heads // shape.kv_heads, shape.head_dim
    keys, values = (torch.randn(heads, slots, dim, generator=generator) for _ in range(2))
    adjusted = [torch.randn(heads, slots, dim, generator=generator) for _ in range(2)]
    views = []
    for row in range(rows):
        keep = torch.rand(heads, slots, generator=generator) < 0.5
        keep[:, -1] = True  # every row sees a main slot
        width = int(torch.randint(0, 41, (), generator=generator))
        entries = None
        if width:
            counts = torch.randint(1, 60, (heads, width), generator=generator).float()
            bias = attention.population_bias(counts.log(), rule)
            entries = (*(torch.randn(heads, width, dim, generator=generator) for _ in range(2)), bias)
        source = min(2, 3 * row // rows)
        key, kept_values = None, None
        if source:
            key = "adjusted", source
            kept_values = adjusted[source - 1].gather(
                1, kept_positions(keep, int(keep.sum(-1).max()))[..., None].expand(-1, -1, dim)
            )
        views.append(RowView(slots, keep, entries, rule, key, kept_values))
    gates = RowGates.of([rule] * rows, torch.device("cpu"))
    layer = ViewLayer(views, keys, values, gates, slots, 4)
    appended = (rows, heads, 4, dim)
    layer._keys.copy_(torch.randn(appended, generator=generator))
    layer._values.copy_(torch.randn(appended, generator=generator))
    layer._bias.zero_()
    queries = torch.randn(rows, heads, group, dim, generator=generator) * 4
    return layer, queries


def layer_on(layer: ViewLayer, device: torch.device, dtype: torch.dtype) -> ViewLayer:
    """``layer`` with its keys and values tensors in ``dtype`` on ``device``, its masks and biases on
    ``device``."""
    moved = copy.copy(layer)
    shared, entries = layer.shared, layer.entries

    def kv(tensor):
        return tensor.to(device, dtype)

    sources = [(first, last, kv(values)) for first, last, values in shared.sources]
    moved.shared = dataclasses.replace(
        shared, keys=kv(shared.keys), hidden=shared.hidden.to(device), sources=sources,
        values=[kv(values) for values in shared.values], row_source=shared.row_source.to(device),
    )  # fmt: skip
    moved.entries = dataclasses.replace(
        entries, keys=kv(entries.keys), values=kv(entries.values), bias=entries.bias.to(device),
        outside=entries.outside.to(device), first=entries.first.to(device), last=entries.last.to(device),
    )  # fmt: skip
    moved._keys, moved._values, moved._bias = kv(layer._keys), kv(layer._values), layer._bias.to(device)
    moved.gates = RowGates(layer.gates.gated, *(column.to(device) for column in layer.gates.columns))
    return moved


def view_layer_output(layer: ViewLayer, queries: torch.Tensor) -> torch.Tensor:
    """``layer``'s attention output ``[rows, H_kv, G, d]`` (fp32) for one decoded token's grouped
    ``queries``, as ``ViewLayer.attend`` computes it."""
    scaling = queries.shape[-1] ** -0.5
    shared, entries = layer.pool_partials(queries, scaling)
    appended = views_module.appended_partial(queries, layer._keys, layer._values, layer._bias, scaling)
    return views_module.view_attention(shared, entries, appended, layer.gates)


def views_float64(layer: ViewLayer, queries: torch.Tensor, rule: DecodeRule) -> torch.Tensor:
    """reskv.md's shared softmax of each row of ``layer`` (on the CPU) in float64, one row at a time
    from its own slots: its entries with their bias and ``log g``, the shared slots it keeps with the
    values it reads, its appended slots; the gate from the main slots' largest probability."""
    scaling = queries.shape[-1] ** -0.5
    shared, entries = layer.shared, layer.entries
    outputs = []
    for row in range(queries.shape[0]):
        values = next(values for first, last, values in shared.sources if first <= row < last)
        segment = slice(int(entries.first[row]), int(entries.last[row]))
        keys = torch.cat([entries.keys[:, segment], shared.keys, layer._keys[row]], 1).double()
        row_values = torch.cat([entries.values[:, segment], values, layer._values[row]], 1).double()
        appended = torch.ones(keys.shape[0], layer.capacity, dtype=torch.bool)  # every one written
        main = torch.cat([~shared.hidden[row], appended], 1)
        logits = queries[row].double() @ keys.transpose(1, 2) * scaling
        entry_count = segment.stop - segment.start
        logits[..., :entry_count] += entries.bias[:, None, segment].double()
        logits[..., entry_count:] += torch.where(main, 0.0, -math.inf)[:, None, :].double()
        p_max = logits[..., entry_count:].softmax(dim=-1).amax(dim=-1, keepdim=True)
        if rule.gate_terms.open:
            logits[..., :entry_count] += attention.log_gate(p_max, rule.gate_terms)
        outputs.append(logits.softmax(dim=-1) @ row_values)
    return torch.stack(outputs)


def view_step(backbone: Backbone, length: int, appended: int) -> dict:
    """One eager decode step of the paper grid's 73 rows as views of a prefilled cache of ``length``
    random keys and values (no construction: each row keeps its budget less its largest planned entries
    of random slots per head and holds those entries, CaM's rows read one adjusted values tensor per
    setting and keep nested sets, ``appended`` slots free for the question and the answer): the median
    of ``VIEW_STEPS`` steps after one, in ms, the bytes a step reads (the weights; the shared slots,
    entries and appended slots, ``reskv.batching.view_step_slots``; the keep masks and the entries'
    bias) and their rate against the card's bandwidth (``HBM_BYTES_PER_S``)."""
    shape, device, dtype = model_shape(backbone), backbone.device, backbone.model.dtype
    generator = torch.Generator(device=device).manual_seed(0)

    def random(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    requests, context = paper_ruler_requests(), length - QUESTION_TOKENS
    shared = []
    for _ in range(shape.layers):  # the 8B shape: every layer full attention
        layer = ObservedLayer()
        layer.keys, layer.values = (random(1, shape.kv_heads, length, shape.head_dim) for _ in range(2))
        shared.append(layer)
    adjusted = {setting: [random(*layer.values.shape[1:]) for layer in shared] for setting in SETTINGS}
    rows, planned, rankings = [], [], {}
    for method, setting in requests:
        seen = length if setting == "aware" else context
        residual = method.residual
        shares = () if residual is None else (*residual.grid, residual.fixed_ratio)
        key = values_key(method, setting)
        plan = ViewRow.planned(seen, None if method.scorer is None else method.ratio, shares, key)
        planned.append(plan)
        kept = seen if plan.kept_slots is None else plan.kept_slots
        views_of_row = []
        for index in range(shape.layers):
            if key is None or (key, index) not in rankings:
                scores = torch.rand(shape.kv_heads, seen, generator=generator, device=device)
            if key is not None:  # CaM's rows keep the top of one ranking of a setting: nested sets
                scores = rankings.setdefault((key, index), scores)
            keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(kept).indices, True)
            entries = None
            if plan.entry_slots:
                width = (shape.kv_heads, plan.entry_slots)
                entries = (
                    random(*width, shape.head_dim),
                    random(*width, shape.head_dim),
                    random(*width).float(),
                )
            values = None
            if key is not None:
                positions = kept_positions(keep, kept)[..., None].expand(-1, -1, shape.head_dim)
                values = adjusted[setting][index].gather(1, positions)
            views_of_row.append(RowView(seen, keep, entries, method.decode_rule, key, values))
        rows.append(views_of_row)
    order = values_order([plan.values_key for plan in planned])
    rules = [requests[row][0].decode_rule for row in order]
    cache = view_cache(shared, [rows[row] for row in order], rules, length, appended)
    del rows
    tokens = torch.ones(len(requests), 1, dtype=torch.long, device=device)
    seconds = [timed(device, forward, backbone, tokens, cache)[1] for _ in range(VIEW_STEPS + 1)][1:]
    step_s = statistics.median(seconds)
    heads = shape.layers * shape.kv_heads
    read = (
        view_step_slots(planned, length, appended) * heads * shape.kv_slot_bytes
        + len(requests) * length * heads  # the keep masks
        + sum(plan.entry_slots for plan in planned) * heads * FP32_BYTES  # the entries' bias
    )
    weights = sum(parameter.numel() * parameter.element_size() for parameter in backbone.model.parameters())
    report = {
        "rows": len(requests),
        "length": length,
        "step_ms": 1e3 * step_s,
        "step_ms_runs": [1e3 * second for second in seconds],
        "kv_read_gb": read / 1e9,
        "weights_gb": weights / 1e9,
        "gb_per_s": (read + weights) / step_s / 1e9,
    }
    bandwidth = HBM_BYTES_PER_S.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if bandwidth is not None:
        report["floor_ms"] = 1e3 * (read + weights) / bandwidth
        report["over_floor"] = step_s / (report["floor_ms"] / 1e3)
    return report


# A stage: (backbone, device, save its report so far, seconds left of the call's budget) -> its report.
STAGE_RUNS: dict[str, Callable[[Backbone, str, Callable[[dict], None], Callable[[], float]], dict]] = {
    "kernels": kernels,
    "nearest": nearest_forms,
    "tiles": nearest_tiles,
    "constructions": constructions,
    "profile": profile,
    "grid": grid,
    "decode": decode,
    "efficiency": efficiency,
    "views": views,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu/first"))
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds of this call; a stage starts only with its need left",
    )
    parser.add_argument(
        "--grid-decode",
        choices=("compiled", "eager"),
        help="how the grid stage decodes (default: as a run on the device would)",
    )
    args = parser.parse_args(argv)
    runs = STAGE_RUNS | {"grid": functools.partial(grid, decode=args.grid_decode)}
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "machine.json").write_text(json.dumps(check_machine(device), indent=1) + "\n")
    backbone = bench_backbone(device)
    print(f"{device}: backbone ready in {time.perf_counter() - started:.1f}s", flush=True)
    for stage in args.stages:
        left = args.budget_s - (time.perf_counter() - started)
        if device == "cuda" and left < STAGE_SECONDS[stage]:
            result = {"skipped": f"budget: {left:.0f}s left, the stage needs about {STAGE_SECONDS[stage]}s"}
        else:
            stage_started = time.perf_counter()
            try:
                result = runs[stage](
                    backbone,
                    device,
                    functools.partial(write, args.out / f"{stage}.json"),
                    lambda: args.budget_s - (time.perf_counter() - started),
                )
            except Exception as error:  # the next stages still run; the report keeps the error
                result = {"error": repr(error), "traceback": traceback.format_exc()[-4000:]}
            result["seconds"] = time.perf_counter() - stage_started
        write(args.out / f"{stage}.json", result)
        print(f"{stage}: {summary(stage, result)}", flush=True)
    print(f"done in {time.perf_counter() - started:.1f}s; reports in {args.out}")
    if device != "cuda":
        print(f"On a GPU (results/gpu/README.md, top): {GPU_COMMAND}")
    return 0


def write(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1) + "\n")


def summary(stage: str, result: dict) -> str:
    """One line of a stage's outcome."""
    if "skipped" in result or "error" in result:
        return result.get("skipped") or result["error"]
    seconds = f"{result['seconds']:.1f}s"
    if stage == "kernels":
        return f"{seconds}; " + ", ".join(
            f"{name} {'passed' if check['passed'] else 'OFF'}"
            for name, check in result.items()
            if isinstance(check, dict)
        )
    if stage == "constructions":
        return f"{seconds}; {len(result['rows'])} constructions in {result['construct_s']:.1f}s" + (
            f" ({result['stopped']})" if "stopped" in result else ""
        )
    if stage in ("nearest", "tiles"):
        return f"{seconds}; chosen {result['chosen']}; " + "; ".join(
            f"{name} failed: {row['error']}"
            if "error" in row
            else f"{name} {row['tflop_per_s']:.1f} TFLOP/s, float64's {row['same_as_float64']:.4f}, "
            f"construct {row['construct_s']:.2f}s, same slots {row['same_slots_as_reference']}"
            for name, row in result["variants"].items()
        )
    if stage == "profile":
        return (
            f"{seconds}; prefill {result['prefill_s']}; alone {result['alone_s']}; "
            f"alone without each kernel {result.get('alone_s_without', '-')}; "
            f"shared {result['shared_s']}; "
            + "; ".join(
                f"{ratio}: busy {row['device_busy_s']:.2f}s of {row['profiled_s']:.2f}s, "
                f"host {row['host_calls']}"
                for ratio, row in result["profiles"].items()
            )
        )
    if stage == "grid":
        return f"{seconds}; " + "; ".join(
            f"{row['length']} (seed {row['seed']}): grid {row['grid_s']:.1f}s, batches {row['batches']}, "
            f"graphs {row['compiler']['graphs_compiled']}, dry run {row['dry_run']['total_s']:.1f}s"
            for row in result["samples"]
        )
    if stage == "decode":
        return f"{seconds}; " + ", ".join(
            f"{name} {row['tokens_per_s']:.1f} tok/s" for name, row in result.items() if isinstance(row, dict)
        )
    if stage == "views":
        kernel = result.get("kernel")
        checked_kernel = "" if kernel is None else f"kernel {'passed' if kernel['passed'] else 'OFF'}; "
        return f"{seconds}; {checked_kernel}" + ", ".join(
            f"{name} step {row['step_ms']:.1f} ms ({row['gb_per_s']:.0f} GB/s"
            + (f", {row['over_floor']:.1f}x the floor)" if "over_floor" in row else ")")
            for name, row in result["steps"].items()
        )
    return f"{seconds}; {len(result['rows'])} rows"


if __name__ == "__main__":
    raise SystemExit(main())
