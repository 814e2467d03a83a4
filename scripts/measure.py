"""What every measurement shares: the machine it ran on, peak memory and random prompts.

The benchmarks and tools of ``scripts.bench`` (``gpu_check`` among them) and the runner's
provenance block (``scripts.harness.grid``) all take these from here, so two reports of one
quantity are measured the same way:

- ``machine``: the CPU's model, cores, torch threads, load average, versions and the GPU;
  ``machine_header`` prints it with the matmul rate of the moment, for tables of timings;
- ``peak_memory``: the process's peak during a block (CUDA's max allocated bytes, or on CPU the
  resident size at entry plus the block's peak allocated), what a request needs to fit;
  ``peak_allocated``: the most bytes a block itself held allocated at once beyond what it started
  with, what an algorithm adds; ``peak_site``: that peak on CPU and the module and op running then;
- ``counted_gflop``: the matmul and attention FLOPs a call performs, the floor its time is judged by;
  ``replayed_matmul_seconds``: the time its matmuls take alone at their own shapes, the floor on
  this machine;
- ``median_interval``: a median with its distribution-free 95% interval, for ratios of paired
  timings (two methods stepped in turn), which machine noise makes vary from run to run;
- ``random_prompt``: token ids drawn uniformly from a vocabulary with a fixed seed.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from scripts.machine import machine

PROC_STATUS = Path("/proc/self/status")
# A shrunken copy of each shape for the CPU run: same architecture and GQA group, tiny widths.
CPU_SHRINK = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, head_dim=16, vocab_size=512)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and its wall seconds, the device's queued work included."""
    synchronize(device)
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    synchronize(device)
    return result, time.perf_counter() - started


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def matmul_gflops(size: int = 1024, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """The fp32 matmul rate of ``device`` right now: the median of ``repeats`` products of two
    ``size``-square matrices (the first, which may select kernels, not counted). On a shared host it
    drifts by tens of percent within minutes without the load average showing it, so a header
    printed at the start and at the end of a run tells whether its rows were timed alike."""
    left, right = (torch.randn(size, size, device=device) for _ in range(2))
    synchronize = torch.cuda.synchronize if left.is_cuda else lambda: None
    torch.mm(left, right)
    seconds = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        torch.mm(left, right)
        synchronize()
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds) / 1e9


def machine_header() -> str:
    """Cores, torch threads, torch version, load average and the matmul rate of the moment: what a
    reader needs to judge timings."""
    info = machine()
    load = " ".join(f"{value:.2f}" for value in info["load_average"])
    return (
        f"{info['cpu_count']} cores, {info['torch_threads']} torch threads, torch {info['torch']}, "
        f"load average {load} (1/5/15 min), fp32 matmul {matmul_gflops():.0f} GFLOP/s (1024-square)"
    )


@dataclass
class MemoryPeak:
    """What a peak-memory block measured: ``bytes`` is set when the block ends (None if it raised),
    ``kind`` names how it was measured, for a report to print beside it."""

    bytes: int | None = None
    kind: str = ""


def peak_memory_kind(device: torch.device | str) -> str:
    """What ``peak_memory`` measures on ``device``, for a report to name."""
    return "CUDA max allocated" if torch.device(device).type == "cuda" else "RSS at entry + peak allocated"


def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``) in bytes."""
    line = next(line for line in PROC_STATUS.read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


@contextlib.contextmanager
def peak_memory(device: torch.device | str) -> Iterator[MemoryPeak]:
    """``with peak_memory(device) as peak: ...``: the process's peak memory during the block.

    On CUDA the allocator's max allocated bytes (``torch.cuda.max_memory_allocated``, reset at
    entry); on CPU, which keeps no allocator statistics, the resident set size at entry plus the
    block's ``peak_allocated`` (torch's allocations). Not the kernel's peak RSS (``VmHWM``): CI's
    sandbox ignores its reset (two blocks, only one of them allocating, read the same peak), and
    where it is reset a freed heap can serve a block without raising it (under pytest-xdist even a
    block allocating a large tensor). Both count the model weights and whatever else the process holds.
    """
    device = torch.device(device)
    peak = MemoryPeak(kind=peak_memory_kind(device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        peak.bytes = torch.cuda.max_memory_allocated(device)
        return
    resident = proc_status_bytes("VmRSS")
    with peak_allocated(device) as allocated:
        yield peak
    peak.bytes = resident + allocated.bytes


@contextlib.contextmanager
def peak_allocated(device: torch.device | str) -> Iterator[MemoryPeak]:
    """``with peak_allocated(device) as peak: ...``: the most bytes the block held allocated at
    once beyond what was allocated when it began (its transient memory, inputs excluded).

    On CUDA from the allocator's statistics; on CPU from the profiler's allocation and free
    events (``profile_memory=True``), summed in time order.
    """
    device, peak = torch.device(device), MemoryPeak(kind="peak allocated")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        yield peak
        peak.bytes = torch.cuda.max_memory_allocated(device) - baseline
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
        yield peak
    peak.bytes = allocation_peak(profile.profiler.kineto_results.events())[1]


def allocation_peak(events) -> tuple[int, int]:
    """The time (ns) and bytes of the most a CPU profile's allocation and free events (``[memory]``,
    in time order) held at once beyond its start: ``(0, 0)`` where nothing was allocated."""
    allocations = sorted((event.start_ns(), event.nbytes()) for event in events if event.name() == "[memory]")
    held = list(itertools.accumulate(nbytes for _, nbytes in allocations))
    if not held or max(held) <= 0:
        return 0, 0
    top = max(range(len(held)), key=held.__getitem__)
    return allocations[top][0], held[top]


@dataclass
class PeakSite:
    """Where a block's peak allocation happened (``peak_site``): its bytes beyond the block's start,
    the modules running then (outermost first) and the innermost aten op."""

    bytes: int = 0
    modules: list[str] = field(default_factory=list)
    op: str = ""


@contextlib.contextmanager
def peak_site(model: torch.nn.Module) -> Iterator[PeakSite]:
    """``with peak_site(model) as site: ...``: on CPU, ``peak_allocated``'s peak and what ran at
    that moment: every submodule of ``model`` is marked in the profile while its forward runs (hooks
    removed at exit), and the marks and aten ops whose span holds the peak's allocation are read back."""
    site = PeakSite()
    open_marks: dict[int, list[record_function]] = {}

    def enter(name: str):
        def hook(module, args):
            mark = record_function(f"module:{name}")
            mark.__enter__()
            open_marks.setdefault(id(module), []).append(mark)

        return hook

    def leave(module, args, output):
        open_marks[id(module)].pop().__exit__(None, None, None)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or "model")))
        handles.append(module.register_forward_hook(leave))
    activities = [torch.profiler.ProfilerActivity.CPU]
    try:
        with torch.profiler.profile(activities=activities, profile_memory=True) as profile:
            yield site
    finally:
        for handle in handles:
            handle.remove()
    events = list(profile.profiler.kineto_results.events())
    moment, site.bytes = allocation_peak(events)
    running = sorted(
        (event.start_ns(), event.name())
        for event in events
        if event.name() != "[memory]" and event.start_ns() <= moment <= event.start_ns() + event.duration_ns()
    )
    site.modules = [name.removeprefix("module:") for _, name in running if name.startswith("module:")]
    site.op = next((name for _, name in reversed(running) if name.startswith("aten::")), "")


def causal_sdpa_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    """FLOPs of PyTorch's CPU flash attention (not in torch's FLOP registry) from the shapes of its
    arguments: ``q k^T`` and ``p v`` for every query head, each reading its group's key and value head,
    halved for a causal prompt, whose masked upper triangle the kernel skips. Torch's own formula
    (``flop_counter.sdpa_flop_count``) is the same, but torch 2.11's (the GPU image's) refuses fewer
    key heads than query heads, which every grouped-query model here has (2.13's accepts them)."""
    batch, query_heads, query_length, head_dim = query
    key_length, value_dim = key[2], value[3]
    flops = 2 * batch * query_heads * query_length * key_length * (head_dim + value_dim)
    return flops // 2 if is_causal else flops


def counted_gflop(fn, *args) -> float:
    """GFLOP of the matmuls and attention ``fn(*args)`` performs (elementwise work is not counted)."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: causal_sdpa_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn(*args)
    return counter.get_total_flops() / 1e9


MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}


@dataclass(frozen=True)
class MatmulCall:
    """One matmul as dispatched: the op and, per positional argument, a tensor's ``(sizes, strides,
    dtype)`` or the scalar itself; keyword arguments as they were."""

    op: Any
    arguments: tuple
    keywords: dict

    def operands(self) -> list:
        """Fresh random tensors laid out as the recorded ones (an expanded bias keeps its zero
        strides), the scalars as recorded."""
        return [
            _strided_random(*argument) if isinstance(argument, tuple) else argument
            for argument in self.arguments
        ]


def _strided_random(sizes: torch.Size, strides: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    extent = (
        1 + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True)) if all(sizes) else 0
    )
    return torch.randn(extent, dtype=dtype).as_strided(sizes, strides)


class _MatmulRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[MatmulCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMUL_OPS:
            arguments = tuple(
                (arg.shape, arg.stride(), arg.dtype) if isinstance(arg, torch.Tensor) else arg for arg in args
            )
            self.calls.append(MatmulCall(func, arguments, dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def recorded_matmuls(fn, *args) -> list[MatmulCall]:
    """The matmuls (``mm``, ``bmm``, ``baddbmm``) ``fn(*args)`` dispatches, in order."""
    recorder = _MatmulRecorder()
    with recorder:
        fn(*args)
    return recorder.calls


def replayed_matmul_seconds(fn, *args, repeats: int = 3) -> float:
    """Seconds the matmuls of ``fn(*args)`` take replayed alone (CPU), one after another on fresh
    operands of their sizes, strides and dtypes, each the fastest of ``repeats`` runs into its
    warm-up's output (no allocation, no page faults; the fastest, since a floor is what the machine
    can do and a shared machine's matmul rate moves within one bench): the time ``fn`` cannot go
    below while it issues these products as it does, at this machine's rate for each of their shapes,
    where ``counted_gflop`` holds them to another computation's rate (a K=64 product of a few hundred
    rows by thousands of columns runs well below the prefill's projections' rate;
    scripts/bench/engine.py prints both)."""
    seconds = 0.0
    for call in recorded_matmuls(fn, *args):
        operands = call.operands()
        result = call.op(*operands, **call.keywords)  # warms up, and is the output written below
        into, runs = call.op.overloadpacket.out, []
        for _ in range(repeats):
            start = time.perf_counter()
            into(*operands, **call.keywords, out=result)
            runs.append(time.perf_counter() - start)
        seconds += min(runs)
    return seconds


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and an interval holding the true median with at least ``confidence``,
    whatever the distribution: the ``k``-th smallest and largest values, ``k`` the largest rank with
    ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2`` (the sign test's interval; Conover,
    *Practical Nonparametric Statistics*, 3.2). Too few values for any such ``k`` (``n < 6`` at 95%)
    give ``(-inf, inf)``."""
    ordered, n = sorted(values), len(values)
    tail, below, k = (1 - confidence) / 2, 0, 0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    low, high = (ordered[k - 1], ordered[n - k]) if k else (-math.inf, math.inf)
    return statistics.median(ordered), low, high


def random_prompt(vocabulary: Sequence[int], length: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``vocabulary`` with a fixed seed.

    For a range ``range(low, high)`` the ids equal ``torch.randint(low, high, ...)``'s under the
    same seed (both take ``low + draw % (high - low)``)."""
    ids = torch.tensor(list(vocabulary))
    generator = torch.Generator().manual_seed(seed)
    return ids[torch.randint(len(ids), (length,), generator=generator)].tolist()


def top2_gap_at(prefill, method, setting: str, token_ids: list[int], step: int) -> float:
    """The top-2 logit gap of ``method``'s eager decode of ``prefill`` at ``step`` (after
    ``token_ids[:step]``): how near a tie a choice was that another decode (batched, compiled) made
    differently."""
    cache, _ = prefill.compressed(method, setting)
    fed = list(prefill.prompt_ids[prefill.context_length :]) if setting == "agnostic" else []
    logits = prefill.next_logits(fed + token_ids[:step], cache, every_position=True)[-1]
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])
