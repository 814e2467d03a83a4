"""The GPU check's efficiency part: randomly initialised models of the paper's backbones' shapes (memory
and speed do not depend on the weights), bf16. Per context length one prefill serves every (method,
ratio); for each it records the prefill's and the compression + decode's peak memory
(``scripts.measure.peak_memory``: CUDA's max allocated bytes, reset per phase, or on the CPU the
resident size at entry plus the phase's peak allocated; the request's peak is the larger of the two,
since the prefilled cache stays alive while a compressed copy decodes), the compression time, and the
decode rate over the new tokens. Out of memory is recorded as ``"OOM"``.

With ``compare_paths`` each +ResKV construction is timed again on each of the construction's
alternative CUDA paths (``CONSTRUCTION_VARIANTS``): the nearest-centre kernel's bf16x3 products with
TF32 operands (``reskv.nearest_kernel.SPLIT_OPERANDS``), the kernel off
(``reskv.residual.CUDA_FUSED_NEAREST``) and cluster sums by sort and segment sum
(``reskv.residual.CUDA_SORTED_CLUSTER_SUMS``); and each +ResKV
request decodes again eagerly with the gated layers' torch form instead of the fused decode kernel
(``reskv.attention.CUDA_FUSED_DECODE``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Sequence
from unittest import mock

import torch
from torch._dynamo.utils import counters

import reskv.attention
import reskv.nearest_kernel
import reskv.proxy
import reskv.residual
import reskv.scoring
from baselines import build_method
from reskv.backbones import Backbone
from reskv.engine import Prefill
from reskv.method import Method
from scripts.measure import (
    MemoryPeak,
    counted_gflop,
    peak_memory,
    random_prompt,
    release_memory,
    synchronize,
    timed,
    top2_gap_at,
)

# The construction's paths ``--compare-paths`` times each +ResKV construction on besides the
# default (row key: the switch patched for that timing).
TORCH_NEAREST = (reskv.residual, "CUDA_FUSED_NEAREST", False)
CONSTRUCTION_VARIANTS = {
    "construct_s_tf32_operands_nearest": (reskv.nearest_kernel, "SPLIT_OPERANDS", "tf32"),
    "construct_s_torch_nearest": TORCH_NEAREST,
    "construct_s_sorted_sums": (reskv.residual, "CUDA_SORTED_CLUSTER_SUMS", True),
}
# The decode path ``--compare-paths`` decodes each +ResKV request again on: the gated layers' torch form.
TORCH_DECODE = (reskv.attention, "CUDA_FUSED_DECODE", False)
# ``--torch-paths``: every Triton kernel off for a run, should one fail to compile on the device's
# Triton (the kernels are tested under Triton's interpreter on CPU, whose version may differ from the
# GPU image's).
# Attention's sums (H2O's column sums, SnapKV's window means, the proxy's full outputs) by their torch
# path (``reskv.scoring.CUDA_FUSED_ATTENTION_SUMS``; the kernels are off by default until a GPU has
# checked them, and this switch keeps them off).
TORCH_ATTENTION_SUMS = (reskv.scoring, "CUDA_FUSED_ATTENTION_SUMS", False)
# The k-means' Lloyd steps by their torch path (``reskv.residual.CUDA_FUSED_LLOYD``; the kernel is off
# by default until a GPU has checked and timed it, and this switch keeps it off).
TORCH_LLOYD = (reskv.residual, "CUDA_FUSED_LLOYD", False)
# The validation proxies' errors by their torch path (``reskv.proxy.CUDA_FUSED_LOSSES``; likewise).
TORCH_LOSSES = (reskv.proxy, "CUDA_FUSED_LOSSES", False)
KERNEL_SWITCHES = (TORCH_NEAREST, TORCH_DECODE, TORCH_ATTENTION_SUMS, TORCH_LLOYD, TORCH_LOSSES)
EFFICIENCY_METHODS = ("full", "snapkv", "snapkv+reskv", "adakv", "adakv+reskv")
GPU_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
CPU_LENGTHS = (256, 512)
# A short request run once per backbone before the rows, not recorded: the first call's kernel
# selection, allocator growth and the compiled step's compilation stay out of the timings.
WARM_UP_LENGTH = {"cuda": 1024, "cpu": 128}


# The CUDA runtime calls by which the host waits for the device or copies to or from it.
HOST_WAITS = frozenset(
    (
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpyAsync",
        "cudaMemcpy",
    )
)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


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
    construction or a compiled decode. Records the profiled wall seconds, the
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
        # The host's waits on the device and its copies (a copy from pageable host memory waits too).
        "host_calls": dict(Counter(event.name for event in profiler.events() if event.name in HOST_WAITS)),
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
    repeats: int = 1,
) -> dict:
    """``method``'s decode with ``decode="compiled"``: a first run compiles (or re-records the CUDA
    graphs of) the step for this cache's shapes, then ``repeats`` runs are timed. Records their
    median rate and every run's (``decode_rates``), the first run's seconds, whether the timed runs
    repeat the first's tokens (a replayed graph reads what the recorded one did) and whether they
    equal the eager decode's; where they do not, the
    first step that differs and the eager logits' top-2 gap there (``top2_gap_at``: a near tie that
    half-precision kernels order differently, or a wrong step); and the compiler's counters: the
    graphs compiled so far in this process and the CUDA graphs skipped (which would leave the step
    launch-bound). With ``profile_on`` (the device) a third run is profiled (``device_profile``): its
    kernels say where a compiled step's time goes (+ResKV's 32K rate, results/gpu/README.md)."""
    first = source.generate(method, "aware", max_new_tokens=new_tokens, decode="compiled")
    timed_runs = [
        source.generate(method, "aware", max_new_tokens=new_tokens, decode="compiled") for _ in range(repeats)
    ]
    differing = [step for step, (a, b) in enumerate(zip(first.token_ids, eager_ids, strict=True)) if a != b]
    rates = decode_rates(timed_runs)
    row = {
        "compiled_tokens_per_s": statistics.median(rates),
        "compiled_tokens_per_s_runs": rates,
        "compiled_first_run_s": first.timings["decode_s"],
        "compiled_repeats_itself": all(run.token_ids == first.token_ids for run in timed_runs),
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


def decode_rates(generations) -> list[float]:
    """Decoded tokens a second of each generation."""
    return [
        generation.timings["decode_tokens"] / generation.timings["decode_s"] for generation in generations
    ]


def efficiency_rows(
    backbone: Backbone,
    lengths: Sequence[int],
    ratios: Sequence[float],
    new_tokens: int,
    decode_modes: Sequence[str] = ("eager",),
    method_names: Sequence[str] = EFFICIENCY_METHODS,
    profile_lengths: Sequence[int] = (),
    compare_paths: bool = False,
    decode_repeats: int = 1,
) -> list[dict]:
    """One row per (length, method, ratio), each a request as the paper's efficiency figure measures it.
    Each decode rate is the median of ``decode_repeats`` runs (every run's in ``..._runs``).

    Per length, first one ``Prefill`` that keeps the full cache: the full method's request (that
    prefill and its decode), and every compressed method's construction after it
    (``Prefill.compressed``: ``construct_s`` and its matmul ``construct_gflop``). Once it is
    freed, each compressed method's own request: a ``Prefill(..., retain="compressed")``, which
    compresses every layer inside the forward and frees it (the paper's memory behaviour),
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
        again = [
            source.generate(method, "aware", max_new_tokens=new_tokens) for _ in range(decode_repeats - 1)
        ]
        rates = decode_rates([generation, *again])
        row |= {
            "status": "ok",
            "decode_tokens_per_s": statistics.median(rates),
            "decode_tokens_per_s_runs": rates,
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
            row |= compiled_decode(
                source, method, new_tokens, generation.token_ids, profile_on, decode_repeats
            )
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
