"""The GPU path in one command: CUDA correctness against the CPU, then efficiency at 8B scale.

    python -m scripts.bench.gpu_check [--out results/gpu] [--shapes llama3.1-8b-instruct ...]
        [--lengths 4096 8192 ...] [--ratios 0.9 0.6] [--new-tokens 128] [--skip-efficiency]
        [--models llama3.1-8b-instruct-h8-kv2 ...] [--dtypes fp32 bf16 fp16] [--methods ...]
        [--efficiency-methods full snapkv ...] [--decode eager compiled] [--profile-lengths 4096 ...]
        [--skip-correctness] [--compare-paths]

Correctness: tiny random Llama and Qwen2 models (GQA groups 1 and 4) run every method at ratios
0.6 and 0.9 in both settings, once on the CPU in fp32 (the reference) and on the device in
fp32, bf16 and fp16. Per layer: the kept sets and residual sizes must equal the CPU's in fp32
(hard checks), every compressed layer's output for the observed queries must be finite and
within tolerance of the CPU's, and every head must hold no more than its budget (AdaKV: the
layer's total). Each configuration also decodes a few tokens end to end on the device.

Efficiency: randomly initialised models of the paper's backbones' shapes (memory and speed do not
depend on the weights), bf16. Per context length one prefill serves every (method, ratio);
for each it records the prefill's and the compression + decode's peak memory
(``scripts.measure.peak_memory``: CUDA's max allocated bytes, reset per phase, or on the CPU the
resident size at entry plus the phase's peak allocated; the request's peak is the larger of the
two, since the prefilled cache stays alive while a compressed copy decodes), the compression time,
and the decode rate over ``--new-tokens`` tokens. Out of memory is recorded as ``"OOM"``.

With ``--compare-paths`` each +ResKV construction is timed again on each of the construction's
alternative CUDA paths (``CONSTRUCTION_VARIANTS``): the nearest-centre kernel's products in TF32x3
(``reskv.nearest_kernel.PRODUCT_PRECISION``), the kernel off (``reskv.residual.CUDA_FUSED_NEAREST``)
and cluster sums by sort and segment sum (``reskv.residual.CUDA_SORTED_CLUSTER_SUMS``), to choose
among them on a GPU (issue 22); and each +ResKV request decodes again eagerly with the gated layers'
torch form instead of the fused decode kernel (``reskv.attention.CUDA_FUSED_DECODE``, issue 24).
``--torch-paths`` runs everything with both Triton kernels off (``KERNEL_SWITCHES``), should one fail
to compile on the device.

Without CUDA the same command runs everything at tiny sizes on the CPU (what the test suite
does), so the script cannot rot. Writes ``<out>/gpu_check.json`` and ``<out>/efficiency.{png,pdf}``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch
from torch._dynamo.utils import counters

import reskv.attention
import reskv.decode_kernel
import reskv.nearest_kernel
import reskv.residual
from baselines import METHODS, build_method
from reskv.backbones import PAPER_SHAPES, Backbone, random_backbone
from reskv.compress import compress_layer
from reskv.config import DECODE_MODES, SETTINGS
from reskv.engine import Prefill
from reskv.method import Method
from scripts.measure import (
    MemoryPeak,
    counted_gflop,
    machine,
    matmul_gflops,
    peak_memory,
    peak_memory_kind,
    random_prompt,
    top2_gap_at,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (shape, query heads, KV heads) by name: both architectures, GQA group sizes 1 and 4.
TINY_MODELS = {
    f"{shape}-h{heads}-kv{kv_heads}": (shape, heads, kv_heads)
    for shape, heads, kv_heads in (
        ("llama3.1-8b-instruct", 4, 4),
        ("llama3.1-8b-instruct", 8, 2),
        ("qwen2.5-7b-instruct", 4, 4),
        ("qwen2.5-7b-instruct", 8, 2),
    )
}
CHECK_RATIOS = (0.6, 0.9)
CHECK_PROMPT, CHECK_QUESTION, CHECK_DECODE = 1024, 32, 4
# Scores closer than this, relative to the layer's largest score, are a tie to fp32 rounding.
TIE_TOLERANCE = 1e-5
# Relative error of a compressed layer's output against the CPU fp32 one (same kept set), per
# device dtype: a few units of the format's rounding (bf16 keeps 8 bits of mantissa, fp16 11).
OUTPUT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.05, "fp16": 0.03}
# The construction's paths ``--compare-paths`` times each +ResKV construction on besides the
# default (row key: the switch patched for that timing).
TORCH_NEAREST = (reskv.residual, "CUDA_FUSED_NEAREST", False)
CONSTRUCTION_VARIANTS = {
    "construct_s_tf32x3_nearest": (reskv.nearest_kernel, "PRODUCT_PRECISION", "tf32x3"),
    "construct_s_torch_nearest": TORCH_NEAREST,
    "construct_s_sorted_sums": (reskv.residual, "CUDA_SORTED_CLUSTER_SUMS", True),
}
# The decode path ``--compare-paths`` decodes each +ResKV request again on: the gated layers' torch form.
TORCH_DECODE = (reskv.attention, "CUDA_FUSED_DECODE", False)
# ``--torch-paths``: every Triton kernel off for a run, should one fail to compile on the device's
# Triton (the kernels were tested under Triton 3.9's interpreter on CPU, the GPU image has 3.6).
KERNEL_SWITCHES = (TORCH_NEAREST, TORCH_DECODE)
EFFICIENCY_METHODS = ("full", "snapkv", "snapkv+reskv", "adakv", "adakv+reskv")
GPU_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
CPU_LENGTHS = (256, 512)
# A short request run once per backbone before the rows, not recorded: the first call's kernel
# selection, allocator growth and the compiled step's compilation stay out of the timings.
WARM_UP_LENGTH = {"cuda": 1024, "cpu": 128}
FLOOR_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
# A shrunken copy of each shape for the CPU run: same architecture and GQA group, tiny widths.
CPU_SHRINK = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, head_dim=16, vocab_size=512)


def tiny_model(shape: str, heads: int, kv_heads: int) -> Backbone:
    """A small random model of ``shape``'s architecture in fp32 on the CPU (fixed seed)."""
    torch.manual_seed(0)
    return random_backbone(
        shape,
        torch.float32,
        "cpu",
        num_hidden_layers=2,
        hidden_size=heads * 16,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        vocab_size=512,
    )


def moved(backbone: Backbone, device: str, dtype: torch.dtype) -> Backbone:
    """The same weights on ``device`` in ``dtype`` (the original model is left as it is)."""
    model = type(backbone.model)(backbone.model.config).to(device, dtype)
    model.load_state_dict(backbone.model.state_dict())
    model.eval().requires_grad_(False)
    return dataclasses.replace(backbone, model=model)


def layer_results(prefill: Prefill, method_name: str, ratio: float, setting: str) -> list[dict]:
    """Per compressed layer: kept mask, residual sizes, slots and the output for the observed queries."""
    method = build_method(method_name, ratio)
    results = []
    observations = prefill.observations(setting)
    for observation in observations:
        state = compress_layer(observation, method.scorer, ratio, method.residual, len(observations))
        if state is None:
            continue
        queries = observation.queries.reshape(observation.num_kv_heads, -1, observation.queries.shape[-1])
        rule = method.decode_rule
        scores = method.scorer.prompt_scores(observation)
        allotted = method.scorer.head_budgets(
            scores, state.stats["budget"], layer_idx=observation.layer_idx, num_layers=len(observations)
        )
        results.append(
            {
                "kept": state.kept.cpu(),
                "residual_slots": state.stats["residual_slots"],
                "slots": (state.kept.sum(-1) + state.residual.entries_per_head).tolist(),
                "budget": state.stats["budget"],
                "layer_budget": int(allotted.max()),
                "output": state.attend(queries, observation.scaling, rule).float().cpu(),
                "scores": scores.float().cpu(),
            }
        )
    return results


def budget_ok(method_name: str, layer: dict) -> bool:
    """No head holds more than ``b`` slots; AdaKV: the layer holds at most ``H_kv * b``; PyramidKV: no
    head holds more than its layer's pyramid budget (the layers' budgets average ``b``)."""
    slots, budget = layer["slots"], layer["budget"]
    if method_name.startswith("pyramidkv"):
        return max(slots) <= layer["layer_budget"]
    if method_name.startswith("adakv"):
        return sum(slots) <= len(slots) * budget
    return max(slots) <= budget


def check_model(
    model_name: str, device: str, dtypes: Sequence[str], methods: Sequence[str] = METHODS
) -> list[dict]:
    """Rows of the correctness report for one tiny model (``TINY_MODELS``): every method, ratio,
    setting and dtype."""
    reference_model = tiny_model(*TINY_MODELS[model_name])
    prompt = random_prompt(range(1, 512), CHECK_PROMPT, seed=1)
    context_length = CHECK_PROMPT - CHECK_QUESTION
    all_methods = [build_method(name, 0.9) for name in methods]
    reference = Prefill(reference_model, prompt, context_length, all_methods)
    rows = []
    for dtype_name in dtypes:
        backbone = moved(reference_model, device, DTYPES[dtype_name])
        prefill = Prefill(backbone, prompt, context_length, all_methods)
        for method_name in methods:
            if method_name == "full":
                continue
            for ratio in CHECK_RATIOS:
                for setting in SETTINGS:
                    expected = layer_results(reference, method_name, ratio, setting)
                    got = layer_results(prefill, method_name, ratio, setting)
                    generation = prefill.generate(build_method(method_name, ratio), setting, CHECK_DECODE)
                    row = {
                        "model": model_name,
                        "dtype": dtype_name,
                        "method": method_name,
                        "ratio": ratio,
                        "setting": setting,
                        **compare_layers(method_name, got, expected),
                        "decoded_tokens": len(generation.token_ids),
                    }
                    row["passed"] = passed(row)
                    rows.append(row)
    return rows


def near_tie(got: dict, expected: dict) -> bool:
    """Whether every token that one cache keeps and the other evicts has a reference score equal,
    to fp32 rounding, to all the others that swapped: a tie broken differently, not a different rule."""
    swapped = got["kept"] != expected["kept"]
    scores = expected["scores"][swapped]
    return bool((scores.max() - scores.min()) <= TIE_TOLERANCE * expected["scores"].abs().max())


def compare_layers(method_name: str, got: list[dict], expected: list[dict]) -> dict:
    """One configuration's per-layer results on the device against the CPU fp32 reference.

    The output error is taken over the layers whose kept sets and residual sizes equal the
    reference's: where low precision flips a near-tied score, the two caches hold different
    tokens and their outputs are not comparable (the agreement of the kept sets says how often).
    """
    same_kept = [torch.equal(g["kept"], e["kept"]) for g, e in zip(got, expected, strict=True)]
    same_sizes = [g["residual_slots"] == e["residual_slots"] for g, e in zip(got, expected, strict=True)]
    same_cache = [kept and sizes for kept, sizes in zip(same_kept, same_sizes, strict=True)]
    errors = [
        float((g["output"] - e["output"]).norm() / e["output"].norm().clamp(min=1e-30))
        for g, e, same in zip(got, expected, same_cache, strict=True)
        if same
    ]
    return {
        "layers": len(got),
        "layers_with_equal_caches": sum(same_cache),
        "layers_with_near_tie_flips": sum(
            sizes and not kept and near_tie(g, e)
            for g, e, kept, sizes in zip(got, expected, same_kept, same_sizes, strict=True)
        ),
        "layers_with_equal_residual_sizes": sum(same_sizes),
        "kept_agreement": sum(
            float((g["kept"] == e["kept"]).float().mean()) for g, e in zip(got, expected, strict=True)
        )
        / max(1, len(got)),
        "residual_heads": sum(sum(size > 0 for size in g["residual_slots"]) for g in got),
        "finite": all(bool(torch.isfinite(g["output"]).all()) for g in got),
        "budget_ok": all(budget_ok(method_name, g) for g in got),
        "max_output_error": max(errors, default=0.0),
    }


def passed(row: dict) -> bool:
    """Hard checks: finite outputs, budgets, outputs within tolerance where the caches agree; in
    fp32 also every layer's kept set and residual sizes equal, except kept sets that differ only by
    tokens whose reference scores tie to fp32 rounding (low precision may flip any near tie)."""
    ok = row["finite"] and row["budget_ok"] and row["max_output_error"] <= OUTPUT_TOLERANCE[row["dtype"]]
    if row["dtype"] == "fp32":
        ok = ok and row["layers_with_equal_caches"] + row["layers_with_near_tie_flips"] == row["layers"]
    return ok


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def timed(device: torch.device, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and its wall seconds, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    synchronize(device)
    return result, time.perf_counter() - started


def kernel_totals(events, top: int) -> list[dict]:
    """The ``top`` device kernels of profiler ``events`` by summed duration: name, launches, seconds.
    A replayed CUDA graph runs kernels without the aten calls that issued them when it was recorded,
    so a compiled step is read from its kernels, not its operators."""
    totals: dict[str, list] = {}
    for event in events:
        total = totals.setdefault(event.name, [0, 0.0])
        total[0] += 1
        total[1] += event.time_range.elapsed_us() * 1e-6
    ranked = sorted(totals.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [
        {"kernel": name, "launches": launches, "device_s": seconds} for name, (launches, seconds) in ranked
    ]


def device_profile(device: torch.device, fn, *args, top: int = 12, **kwargs) -> dict:
    """Where the wall time of ``fn(*args, **kwargs)`` goes, run once under ``torch.profiler``: a
    construction (issue 22) or a compiled decode (issue 24). Records the profiled wall seconds, the
    device's busy seconds (its kernels' and copies' durations summed: one stream, so they do not
    overlap), the number of device launches, the host's aten calls, the ``top`` operators by self
    device time (by self host time without CUDA) and the ``top`` kernels (``kernel_totals``; none
    without CUDA). A busy time far below the wall time says the host, not the GPU, sets the pace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        _, seconds = timed(device, fn, *args, **kwargs)
    launches = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    operators = [entry for entry in profiler.key_averages() if entry.key.startswith("aten::")]
    rank = "self_device_time_total" if cuda else "self_cpu_time_total"
    operators.sort(key=lambda entry: getattr(entry, rank), reverse=True)
    return {
        "profiled_s": seconds,
        "device_busy_s": sum(event.time_range.elapsed_us() for event in launches) * 1e-6,
        "device_launches": len(launches),
        "aten_calls": sum(entry.count for entry in operators),
        "top": [
            {
                "op": entry.key,
                "calls": entry.count,
                "self_device_s": entry.self_device_time_total * 1e-6,
                "self_host_s": entry.self_cpu_time_total * 1e-6,
            }
            for entry in operators[:top]
        ],
        "top_kernels": kernel_totals(launches, top),
    }


def compiled_decode(
    source: Prefill,
    method: Method,
    new_tokens: int,
    eager_ids: list[int],
    profile_on: torch.device | None = None,
) -> dict:
    """``method``'s decode with ``decode="compiled"``, run twice: the first run compiles (or re-records
    the CUDA graphs of) the step for this cache's shapes, the second is timed. Records the rate, the
    first run's seconds, whether the second run repeats the first's tokens (a replayed graph reads
    what the recorded one did) and whether they equal the eager decode's; where they do not, the
    first step that differs and the eager logits' top-2 gap there (``top2_gap_at``: a near tie that
    half-precision kernels order differently, or a wrong step); and the compiler's counters: the
    graphs compiled so far in this process and the CUDA graphs skipped (which would leave the step
    launch-bound). With ``profile_on`` (the device) a third run is profiled (``device_profile``): its
    kernels say where a compiled step's time goes (+ResKV's 32K rate, results/gpu/README.md)."""
    first = source.generate(method, "aware", max_new_tokens=new_tokens, decode="compiled")
    second = source.generate(method, "aware", max_new_tokens=new_tokens, decode="compiled")
    differing = [step for step, (a, b) in enumerate(zip(first.token_ids, eager_ids, strict=True)) if a != b]
    row = {
        "compiled_tokens_per_s": second.timings["decode_tokens"] / second.timings["decode_s"],
        "compiled_first_run_s": first.timings["decode_s"],
        "compiled_repeats_itself": first.token_ids == second.token_ids,
        "compiled_same_tokens": first.token_ids == eager_ids,
        "compiled_first_difference": differing[0] if differing else None,
        "eager_top2_gap_there": (
            top2_gap_at(source, method, "aware", eager_ids, differing[0]) if differing else None
        ),
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }
    if profile_on is not None:
        row["compiled_profile"] = device_profile(
            profile_on, source.generate, method, "aware", max_new_tokens=new_tokens, decode="compiled"
        )
    return row


def efficiency_rows(
    backbone: Backbone,
    lengths: Sequence[int],
    ratios: Sequence[float],
    new_tokens: int,
    decode_modes: Sequence[str] = ("eager",),
    method_names: Sequence[str] = EFFICIENCY_METHODS,
    profile_lengths: Sequence[int] = (),
    compare_paths: bool = False,
) -> list[dict]:
    """One row per (length, method, ratio), each a request as the paper's efficiency figure measures it.

    Per length, first one ``Prefill`` that keeps the full cache: the full method's request (that
    prefill and its decode), and every compressed method's construction after it
    (``Prefill.compressed``: ``construct_s`` and its matmul ``construct_gflop``, issue 22). Once it is
    freed, each compressed method's own request: a ``Prefill(..., retain="compressed")``, which
    compresses every layer inside the forward and frees it (the paper's memory behaviour, issue 24),
    then its decode. With "compiled" in ``decode_modes`` each request also decodes with the compiled
    step (``compiled_decode``), after its peak memory is taken. An out-of-memory request is marked
    ``"OOM"``: a full prefill that does not fit leaves the compressed requests to run. At the
    ``profile_lengths`` each construction, and each compiled decode, is also profiled
    (``device_profile``). With ``compare_paths`` each +ResKV construction is timed again on each of
    ``CONSTRUCTION_VARIANTS``, noting whether it chose the same residual sizes, and each +ResKV
    request decodes again with ``TORCH_DECODE``, noting whether its tokens are the same."""
    device = backbone.device
    unstoppable = dataclasses.replace(backbone, stop_token_ids=())
    config = backbone.model.config
    item_bytes = torch.finfo(backbone.model.dtype).bits // 8
    compressing = [(name, ratio) for ratio in ratios for name in method_names if name != "full"]
    methods = {(name, ratio): build_method(name, ratio) for name, ratio in [("full", None), *compressing]}
    rows = []

    def measured(row: dict, source: Prefill, method: Method, peak: MemoryPeak, generation) -> dict:
        slots = sum(sum(layer) for layer in generation.cache_stats["slots"])
        row |= {
            "status": "ok",
            "decode_tokens_per_s": generation.timings["decode_tokens"] / generation.timings["decode_s"],
            "cache_bytes_after_decode": 2 * slots * config.head_dim * item_bytes,
            "request_peak_bytes": peak.bytes,
            "residual_heads": sum(
                sum(size > 0 for size in layer) for layer in generation.cache_stats.get("residual_slots", [])
            ),
        }
        if compare_paths and row["method"].endswith("+reskv"):
            with mock.patch.object(*TORCH_DECODE):
                other = source.generate(method, "aware", max_new_tokens=new_tokens)
            row["decode_tokens_per_s_torch_attention"] = (
                other.timings["decode_tokens"] / other.timings["decode_s"]
            )
            row["torch_attention_same_tokens"] = other.token_ids == generation.token_ids
        if "compiled" in decode_modes:
            profile_on = device if row["length"] in profile_lengths else None
            row |= compiled_decode(source, method, new_tokens, generation.token_ids, profile_on)
        return row

    for length in lengths:
        # The longest setting is the backbone's whole window: prompt plus answer fill its positions.
        length = min(length, config.max_position_embeddings - new_tokens)
        prompt = random_prompt(range(1, config.vocab_size), length, seed=42)
        full_row = {"shape": backbone.name, "length": length, "method": "full", "ratio": None}
        constructions = {}
        release_memory(device)
        try:
            with peak_memory(device) as peak:
                prefill, prefill_s = timed(device, Prefill, unstoppable, prompt, length)
                generation = prefill.generate(methods["full", None], "aware", max_new_tokens=new_tokens)
                synchronize(device)
        except RuntimeError as error:
            if not is_out_of_memory(error):
                raise
            rows.append({**full_row, "status": "OOM"})
            prefill = None
        if prefill is not None:
            full_row["prefill_s"] = prefill_s
            rows.append(measured(full_row, prefill, methods["full", None], peak, generation))
            for name, ratio in compressing:
                # Counting FLOPs runs the construction once more: kernels are chosen before it is timed.
                gflop = counted_gflop(prefill.compressed, methods[name, ratio], "aware")
                (_, stats), seconds = timed(device, prefill.compressed, methods[name, ratio], "aware")
                constructions[name, ratio] = {"construct_s": seconds, "construct_gflop": gflop}
                if compare_paths and name.endswith("+reskv"):
                    for key, switch in CONSTRUCTION_VARIANTS.items():
                        with mock.patch.object(*switch):
                            (_, other), seconds = timed(
                                device, prefill.compressed, methods[name, ratio], "aware"
                            )
                        constructions[name, ratio][key] = seconds
                        # Whether that path chose the same residual sizes (a near tie may go either way).
                        same = other["residual_slots"] == stats["residual_slots"]
                        constructions[name, ratio][key.replace("construct_s_", "same_sizes_")] = same
                if length in profile_lengths:
                    constructions[name, ratio]["construct_profile"] = device_profile(
                        device, prefill.compressed, methods[name, ratio], "aware"
                    )
            del prefill, generation
        for name, ratio in compressing:
            row = {"shape": backbone.name, "length": length, "method": name, "ratio": ratio}
            row |= constructions.get((name, ratio), {})
            release_memory(device)
            try:
                with peak_memory(device) as peak:
                    source = Prefill(unstoppable, prompt, length, [methods[name, ratio]], retain="compressed")
                    generation = source.generate(methods[name, ratio], "aware", max_new_tokens=new_tokens)
                    synchronize(device)
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                rows.append({**row, "status": "OOM"})
                continue
            # Its prefill compresses every layer as it runs: the forward's time includes compression.
            row["prefill_s"] = source.timings["prompt_prefill_s"]
            rows.append(measured(row, source, methods[name, ratio], peak, generation))
            del source, generation
    return rows


def check_machine(device: str) -> dict:
    """What ran the check (``scripts.measure.machine``), the date, the peak memory's kind, the
    attention path of exact layers and how the k-means finds nearest centres."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine(),
        "flash_attn_importable": importlib.util.find_spec("flash_attn") is not None,
        "memory_kind": peak_memory_kind(device),
        # The rate a construction's fp32 matmul FLOPs are judged by (``summary``).
        "fp32_matmul_gflops": matmul_gflops(FLOOR_MATMUL_SIZE[device], device=device),
    }
    # Exact layers of half-precision CUDA runs use FlashAttention-2 when it imports (reskv.cache).
    info["attention_path"] = (
        "flash_attention_2 (half precision), sdpa (fp32)"
        if info["cuda_available"] and info["flash_attn_importable"]
        else "sdpa"
    )
    # reskv.residual.nearest_centers, and reskv.attention.shared_softmax_attention for a gated layer's
    # decode step: each a Triton kernel on CUDA where it imports and its switch is on, else torch.
    nearest, decode = reskv.nearest_kernel, reskv.decode_kernel
    info["nearest_centers"] = kernel_path(
        info["cuda_available"] and reskv.residual.CUDA_FUSED_NEAREST,
        nearest,
        f"{nearest.PRODUCT_PRECISION} products, {nearest.POINT_TILE} x {nearest.CENTER_TILE} tiles, "
        f"{nearest.NUM_WARPS} warps",
        "torch (baddbmm + argmin)",
    )
    info["gated_decode_attention"] = kernel_path(
        info["cuda_available"] and reskv.attention.CUDA_FUSED_DECODE,
        decode,
        f"2 launches, {decode.SLOT_TILE}-slot tiles, {decode.NUM_WARPS} warps",
        "torch (logits, gate, softmax, values' product)",
    )
    return info


def kernel_path(switched_on: bool, kernel, details: str, torch_path: str) -> str:
    """What a run's path is where ``kernel`` (a Triton module of ``reskv``) could run: the kernel with
    its ``details`` when ``switched_on`` (CUDA and its switch) and Triton imports, else ``torch_path``."""
    if switched_on and kernel.available():
        return f"Triton {kernel.triton.__version__} kernel, {details}"
    return torch_path


PANELS = (
    ("request_peak_bytes", 2**-30, "peak memory (GiB)", "Peak memory per request (prefill included)"),
    ("cache_bytes_after_decode", 2**-30, "KV slots x 2 x head dim (GiB)", "KV cache after decoding"),
    ("decode_tokens_per_s", 1, "decode tokens / s", "Decode throughput (eager)"),
    ("compiled_tokens_per_s", 1, "decode tokens / s", "Decode throughput (compiled step)"),
)


def drawn_panels(rows: Sequence[dict]) -> list[tuple]:
    """The ``PANELS`` some row measured: an eager-only run has no compiled decode rate to draw."""
    return [panel for panel in PANELS if any(row.get(panel[0]) is not None for row in rows)]


def plot(report: dict, out: Path) -> list[Path]:
    """Peak memory, cache size and decode rate versus context length, one line per (shape, method,
    ratio); colour by method and ratio, line style by shape; out-of-memory marked on each panel
    (``drawn_panels``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in report["efficiency"] if "method" in row]
    if not rows:
        return []
    panels = drawn_panels(rows)
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    axes = axes[0]
    shapes = sorted({row["shape"] for row in rows})
    variants = sorted({(row["method"], row["ratio"]) for row in rows}, key=str)
    markers, styles = "osD^vP*X", ("-", "--", ":")
    for (method, ratio), colour in zip(variants, plt.cm.tab10.colors, strict=False):
        for shape in shapes:
            points = sorted(
                (r for r in rows if (r["shape"], r["method"], r["ratio"]) == (shape, method, ratio)),
                key=lambda r: r["length"],
            )
            if not points:
                continue
            ok = [p for p in points if p["status"] == "ok"]
            label = f"{shape} {method}" + ("" if ratio is None else f" {ratio:g}")
            marker = markers[variants.index((method, ratio)) % len(markers)]
            for axis, (field, scale, _, _) in zip(axes, panels, strict=True):
                measured = [p for p in ok if p.get(field) is not None]
                axis.plot(
                    [p["length"] for p in measured],
                    [p[field] * scale for p in measured],
                    marker=marker,
                    linestyle=styles[shapes.index(shape) % len(styles)],
                    color=colour,
                    label=label,
                    alpha=0.8,
                )
                for p in points:
                    if p["status"] == "OOM":
                        axis.axvline(p["length"], color="grey", linewidth=0.5)
                        axis.annotate(
                            "OOM", (p["length"], 0.95), xycoords=("data", "axes fraction"), fontsize=7
                        )
    for axis, (_, _, ylabel, title) in zip(axes, panels, strict=True):
        axis.set(xscale="log", xlabel="context length (tokens)", ylabel=ylabel, title=title)
    where = report["machine"].get("gpu", "CPU (tiny shapes)")
    figure.suptitle(f"{where}, {report['machine']['date'][:10]}, random weights", fontsize=9)
    axes[-1].legend(fontsize=6, loc="best")
    figure.tight_layout()
    paths = [out / "efficiency.png", out / "efficiency.pdf"]
    for path in paths:
        figure.savefig(path, dpi=150)
    plt.close(figure)
    return paths


def summary(report: dict) -> list[str]:
    """The issues' targets as printed lines, per (shape, length, ratio) and base method X:
    ResKV's construction (``construct_s`` of X+reskv minus X's) over the full prefill's time, and over
    its fp32 matmul FLOPs' time at the machine's fp32 matmul rate (the floor, issue 22); each
    request's peak over the full cache's, +ResKV's over X's; +ResKV's decode rate over X's, eager and
    compiled, and the compiled rates (issue 24)."""
    rows = {
        (row["shape"], row["length"], row["method"], row["ratio"]): row
        for row in report["efficiency"]
        if row.get("status") == "ok"
    }
    gflops = report["machine"]["fp32_matmul_gflops"]
    lines = [f"fp32 matmul {gflops:.0f} GFLOP/s; ratios of +ResKV to its base X unless named"]
    for shape, length, name, ratio in rows:
        reskv = rows.get((shape, length, f"{name}+reskv", ratio))
        full = rows.get((shape, length, "full", None))
        if reskv is None or "+" in name:
            continue
        base = rows[shape, length, name, ratio]
        line = f"{shape} {length} {name} {ratio:g}:"
        if "construct_s" in reskv and full is not None:
            seconds = reskv["construct_s"] - base["construct_s"]
            floor = (reskv["construct_gflop"] - base["construct_gflop"]) / gflops
            line += f" construction {seconds:.3f}s = {seconds / full['prefill_s']:.3f} x prefill"
            line += f", {seconds / floor:.1f} x fp32 FLOP floor {floor:.3f}s"
            variants = [key for key in CONSTRUCTION_VARIANTS if key in reskv]
            if variants:
                line += (
                    " (other paths: "
                    + ", ".join(
                        f"{key.removeprefix('construct_s_').replace('_', ' ')} "
                        f"{reskv[key] - base['construct_s']:.3f}s"
                        + ("" if reskv[key.replace("construct_s_", "same_sizes_")] else " (other sizes)")
                        for key in variants
                    )
                    + ")"
                )
            line += ";"
        if full is not None:
            line += f" peak / full {base['request_peak_bytes'] / full['request_peak_bytes']:.3f}"
            line += f" (X) {reskv['request_peak_bytes'] / full['request_peak_bytes']:.3f} (+ResKV);"
        line += f" peak {reskv['request_peak_bytes'] / base['request_peak_bytes']:.3f};"
        line += f" eager decode {reskv['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f}"
        if "decode_tokens_per_s_torch_attention" in reskv:
            torch_form = reskv["decode_tokens_per_s_torch_attention"] / base["decode_tokens_per_s"]
            same = "" if reskv["torch_attention_same_tokens"] else ", other tokens"
            line += f" (torch attention {torch_form:.3f}{same})"
        if "compiled_tokens_per_s" in reskv:
            line += f"; compiled decode {reskv['compiled_tokens_per_s'] / base['compiled_tokens_per_s']:.3f}"
            line += f" ({base['compiled_tokens_per_s']:.0f} / {reskv['compiled_tokens_per_s']:.0f} tok/s)"
        lines.append(line)
    for row in report["efficiency"]:
        for key, what in (("construct_profile", "construction"), ("compiled_profile", "compiled decode")):
            if key not in row:
                continue
            profile = row[key]
            ratio = "" if row["ratio"] is None else f" {row['ratio']:g}"
            line = f"profile of the {what}, {row['shape']} {row['length']} {row['method']}{ratio}:"
            line += f" {profile['profiled_s']:.3f}s profiled, device busy {profile['device_busy_s']:.3f}s"
            line += f" in {profile['device_launches']} launches, {profile['aten_calls']} aten calls;"
            line += " top (device/host ms): " + "; ".join(
                f"{op['op']} x{op['calls']} {op['self_device_s'] * 1e3:.1f}/{op['self_host_s'] * 1e3:.1f}"
                for op in profile["top"][:6]
            )
            if profile.get("top_kernels"):
                line += "; top kernels (ms): " + "; ".join(
                    f"{kernel['kernel'][:60]} x{kernel['launches']} {kernel['device_s'] * 1e3:.1f}"
                    for kernel in profile["top_kernels"][:6]
                )
            lines.append(line)
    return lines


def merged(reports: Sequence[dict]) -> dict:
    """One report from several runs on one machine: the first run's machine block (the others'
    dates listed), all correctness rows, the efficiency rows with a later run's row replacing an
    earlier one of the same (shape, length, method, ratio), correctness passed only if every run's did."""
    latest = {
        (row["shape"], row["length"], row.get("method"), row.get("ratio")): row
        for part in reports
        for row in part["efficiency"]
    }
    report = {
        "machine": {**reports[0]["machine"], "runs": [part["machine"]["date"] for part in reports]},
        "correctness": [row for part in reports for row in part["correctness"]],
        "efficiency": list(latest.values()),
    }
    verdicts = [part["correctness_passed"] for part in reports if "correctness_passed" in part]
    if verdicts:
        report["correctness_passed"] = all(verdicts)
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--shapes", nargs="+", default=list(PAPER_SHAPES), choices=list(PAPER_SHAPES))
    parser.add_argument("--lengths", nargs="+", type=int, default=None)
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.9, 0.6])
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--efficiency-methods",
        nargs="+",
        default=list(EFFICIENCY_METHODS),
        choices=list(METHODS),
        help="methods of the efficiency rows (the full cache's row is always measured)",
    )
    parser.add_argument("--models", nargs="+", default=list(TINY_MODELS), choices=list(TINY_MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--decode",
        nargs="+",
        default=None,
        choices=DECODE_MODES,
        help="decode modes each request is timed in (default: both with CUDA, eager without)",
    )
    parser.add_argument(
        "--profile-lengths",
        nargs="+",
        type=int,
        default=None,
        help="lengths whose constructions (and compiled decodes) are profiled too (default: the first "
        "with CUDA, none without)",
    )
    parser.add_argument("--skip-efficiency", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument(
        "--compare-paths",
        action="store_true",
        help="time each +ResKV construction again on each alternative CUDA path (CONSTRUCTION_VARIANTS) "
        "and decode each +ResKV request again with the torch attention (TORCH_DECODE)",
    )
    parser.add_argument(
        "--torch-paths",
        action="store_true",
        help="run with every Triton kernel off (KERNEL_SWITCHES): the torch forms they replace",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="merge these gpu_check.json reports (runs split over several calls) into --out, then plot",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as switched:
        for switch in KERNEL_SWITCHES if args.torch_paths else ():
            switched.enter_context(mock.patch.object(*switch))
        return run(args)


def run(args: argparse.Namespace) -> int:
    """``main``'s work: the checks ``args`` ask for, the report written and summarised."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    if args.merge:
        report = merged([json.loads(part.read_text()) for part in args.merge])
        path.write_text(json.dumps(report, indent=1) + "\n")
        plot(report, args.out)
        return 0 if report.get("correctness_passed", True) else 1
    report = {"machine": check_machine(device), "correctness": [], "efficiency": []}

    def save() -> None:
        path.write_text(json.dumps(report, indent=1) + "\n")

    if not args.skip_correctness:
        for name in args.models:
            started = time.perf_counter()
            report["correctness"] += check_model(name, device, args.dtypes, args.methods)
            shape, heads, kv_heads = TINY_MODELS[name]
            print(
                f"correctness {shape} h{heads} kv{kv_heads}: {time.perf_counter() - started:.1f}s", flush=True
            )
            save()
        failures = [row for row in report["correctness"] if not row["passed"]]
        report["correctness_passed"] = not failures
        for row in failures:
            print("FAILED", json.dumps(row), flush=True)
    if not args.skip_efficiency:
        lengths = args.lengths or (GPU_LENGTHS if cuda else CPU_LENGTHS)
        new_tokens = args.new_tokens or (128 if cuda else 8)
        decode_modes = args.decode or (DECODE_MODES if cuda else ("eager",))
        profile_lengths = args.profile_lengths or (lengths[:1] if cuda else ())
        for shape in args.shapes:
            torch.manual_seed(0)
            if cuda:
                backbone = random_backbone(shape, torch.bfloat16, device)
            else:
                backbone = random_backbone(shape, torch.float32, device, **CPU_SHRINK)
            started = time.perf_counter()
            measure = functools.partial(
                efficiency_rows,
                new_tokens=new_tokens,
                decode_modes=decode_modes,
                method_names=args.efficiency_methods,
                compare_paths=args.compare_paths,
            )
            measure(backbone, [WARM_UP_LENGTH[device]], args.ratios[:1])
            print(f"warm-up {shape}: {time.perf_counter() - started:.1f}s", flush=True)
            for length in lengths:
                started = time.perf_counter()
                rows = measure(backbone, [length], args.ratios, profile_lengths=profile_lengths)
                report["efficiency"] += rows
                print(f"efficiency {shape} {length}: {time.perf_counter() - started:.1f}s", flush=True)
                save()
            del backbone
            release_memory(torch.device(device))
    save()
    for line in summary(report):
        print(line)
    for figure in plot(report, args.out):
        print("wrote", figure)
    print("wrote", path)
    return 0 if report.get("correctness_passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
