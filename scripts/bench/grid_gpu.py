"""One sample of the paper's RULER grid against one full-cache request of the same sample, per stage.

    python -m scripts.bench.grid_gpu [--lengths 4096 32768] [--new-tokens 32] [--out results/gpu]

At the Llama-3.1-8B shape (random weights, bf16; on a CPU a shrunken copy at short lengths, so the
script runs everywhere), per prompt length:

- the unit: one full-cache request of the sample (its prefill, then ``generate``), eager, then with
  the compiled step (timed on its second run, the first compiling or recording its CUDA graphs);
- the grid as the runner serves it on this device (``--decode``, ``--decode-batch``: auto): one
  prefill and the question's, the 73 configurations of ``configs/grid/paper_ruler.yaml``
  (``paper_ruler_requests``) constructed sharing what they can, then decoded in the batches
  ``reskv.batching`` cuts (``reskv.grid.decode_grid``), every answer ``--new-tokens`` long (no stop
  token, so the time does not depend on the random weights). Its wall time is taken with the device
  synchronised at both ends; the split into stages is each stage's host-side time as the records
  hold it (on a GPU the device may still run one stage's work while the host issues the next's); on
  CUDA the same run's peak memory (allocated bytes, weights included); the graphs the compiled step
  compiled and the CUDA graphs recorded meanwhile (torch's counters), the batches' rows and any
  fallback;
- the floor beside it: the prefills, the constructions' fp32 matmul FLOPs at this device's fp32
  matmul rate, and the grid's batched decode.

The grid runs once untimed first at a short length (kernels chosen, the batched steps compiled).
Writes ``<out>/grid_gpu.json`` and prints one line per length: the grid over the eager request, over
the compiled one, and over the floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from baselines import build_method
from baselines.registry import RESIDUAL_SUFFIX
from reskv.backbones import Backbone, random_backbone
from reskv.batching import check_decode_batch, grid_decoding
from reskv.config import AUTO, DECODE_CHOICES
from reskv.engine import Generation, Prefill
from reskv.grid import decode_grid
from reskv.method import Method
from scripts.bench.grid_counts import QUESTION_TOKENS
from scripts.harness.plan import compose_plan
from scripts.machine import machine
from scripts.measure import (
    CPU_SHRINK,
    counted_gflop,
    matmul_gflops,
    peak_memory,
    random_prompt,
    release_memory,
    timed,
)

SHAPE = "llama3.1-8b-instruct"
GPU_LENGTHS, CPU_LENGTHS = (4096, 32768), (256,)
WARM_UP_LENGTH = {"cuda": 1024, "cpu": 128}
FLOOR_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}


def bench_backbone(device: str) -> Backbone:
    """The 8B shape with random weights, bf16 on CUDA; shrunken, fp32, on a CPU. No stop token."""
    torch.manual_seed(0)
    if device == "cuda":
        backbone = random_backbone(SHAPE, torch.bfloat16, device)
    else:
        backbone = random_backbone(SHAPE, torch.float32, device, **CPU_SHRINK)
    return dataclasses.replace(backbone, stop_token_ids=())


def full_request(backbone: Backbone, prompt: list[int], new_tokens: int, decode: str) -> float:
    """Seconds of one full-cache request (prefill and decode), the device synchronised at both ends, on
    its second run."""
    full = build_method("full")

    def request():
        prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, [full])
        return prefill.generate(full, "aware", new_tokens, min_new_tokens=new_tokens, decode=decode)

    request()  # untimed: the compiled step compiles, or records this cache's CUDA graphs
    return timed(backbone.device, request)[1]


@functools.cache
def paper_ruler_requests() -> list[tuple[Method, str]]:
    """The 73 configurations of configs/grid/paper_ruler.yaml as the runner builds them."""
    plan = compose_plan(["grid=paper_ruler", f"backbone={SHAPE}", "results_dir=/nonexistent"])
    return [
        (
            build_method(
                entry.method,
                entry.ratio,
                residual=entry.residual if entry.method.endswith(RESIDUAL_SUFFIX) else None,
                seed=plan.seed,
                options=dict(entry.options),
            ),
            entry.setting or "aware",
        )
        for entry in plan.grid
    ]


def compiler_counts() -> dict[str, int]:
    """torch's counters of what the compiled step cost so far in this process: graphs compiled, and
    the inductor's CUDA-graph counts (recordings, skips)."""
    inductor = {name: count for name, count in counters["inductor"].items() if "cudagraph" in name}
    return {"graphs_compiled": counters["stats"]["unique_graphs"], **inductor}


def grid_sample(
    backbone: Backbone,
    prompt: list[int],
    new_tokens: int,
    decode: str = AUTO,
    decode_batch: int | str = AUTO,
    count_flops: bool = True,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """One sample's grid as the runner serves it with ``decode`` and ``decode_batch`` on this device:
    wall seconds, stage seconds, batches, what the compiler did meanwhile; with ``count_flops`` the
    constructions' matmul GFLOP (one more pass of them). ``progress`` is given the stage seconds so
    far after each configuration decoded, so that a sample cut short still says where its time went."""
    requests = paper_ruler_requests()
    decode, max_rows = grid_decoding(decode, decode_batch, backbone.device.type)
    before = compiler_counts()
    started = time.perf_counter()

    def grid():
        prefill = Prefill(backbone, prompt, len(prompt) - QUESTION_TOKENS, [method for method, _ in requests])
        prefill.prefilled("aware")
        generations = decode_grid(
            prefill, requests, new_tokens, min_new_tokens=new_tokens, decode=decode, max_rows=max_rows
        )
        decoded = []
        for _, generation in generations:
            decoded.append(generation)
            if progress is not None:
                progress({"elapsed_s": time.perf_counter() - started} | stage_seconds(prefill, decoded))
        return prefill, decoded

    if backbone.device.type == "cuda":  # the allocator's statistics; a CPU's profiler would slow the run
        with peak_memory(backbone.device) as peak:
            (prefill, generations), seconds = timed(backbone.device, grid)
    else:
        (prefill, generations), seconds = timed(backbone.device, grid)
    after = compiler_counts()
    rows_by_size = Counter(generation.run["batch_rows"] for generation in generations)
    runs = [generation.run for generation in generations]
    return {
        "decode": decode,
        "grid_s": seconds,
        **stage_seconds(prefill, generations),
        "batches": [
            size for size, rows in sorted(rows_by_size.items(), reverse=True) for _ in range(rows // size)
        ],
        "peak_bytes": peak.bytes if backbone.device.type == "cuda" else None,
        "compiler": {name: after[name] - before.get(name, 0) for name in after},
        "compile_fallbacks": sum("compile_fallback" in run for run in runs),
        "out_of_memory_splits": sum(run.get("out_of_memory_splits", 0) for run in runs),
        "construct_gflop": construction_gflop(prefill, requests) if count_flops else None,
    }


def stage_seconds(prefill: Prefill, generations: Sequence[Generation]) -> dict:
    """The seconds of a sample's stages over ``generations`` (decoded so far), and their tokens."""
    timings = [generation.timings for generation in generations]
    return {
        "configurations": len(generations),
        "prefill_s": prefill.timings["prefill_s"] + prefill.timings.get("question_prefill_s", 0.0),
        "construct_s": sum(timing.get("compress_s", 0.0) for timing in timings),
        "question_s": sum(timing.get("question_s", 0.0) for timing in timings),
        "decode_s": sum(timing["decode_s"] for timing in timings),
        "decode_tokens": sum(timing["decode_tokens"] for timing in timings),
    }


def construction_gflop(prefill: Prefill, requests) -> float:
    """The matmul GFLOP of the grid's constructions (shared as the grid shares them), counted on one
    more pass."""

    def constructions():
        with prefill.sharing_construction():
            for method, setting in requests:
                prefill.compressed_layers(method, setting)

    return counted_gflop(constructions)


def grid_rows(
    backbone: Backbone,
    lengths: Sequence[int],
    new_tokens: int,
    decode: str = AUTO,
    decode_batch: int | str = AUTO,
) -> list[dict]:
    """One row per length: the full-cache request (eager and compiled), the grid (``grid_sample``),
    their ratios and the floor (``fp32 GFLOP/s`` measured here)."""
    device = backbone.device
    gflops = matmul_gflops(FLOOR_MATMUL_SIZE[device.type], device=device)
    warm_up = random_prompt(range(1, backbone.model.config.vocab_size), WARM_UP_LENGTH[device.type], seed=1)
    grid_sample(backbone, warm_up, new_tokens, decode, decode_batch)
    rows = []
    for length in lengths:
        release_memory(device)
        prompt = random_prompt(range(1, backbone.model.config.vocab_size), length, seed=42)
        row = {
            "shape": backbone.name,
            "length": length,
            "new_tokens": new_tokens,
            "rows": len(paper_ruler_requests()),
        }
        row["full_eager_s"] = full_request(backbone, prompt, new_tokens, "eager")
        row["full_compiled_s"] = full_request(backbone, prompt, new_tokens, "compiled")
        row |= grid_sample(backbone, prompt, new_tokens, decode, decode_batch)
        floor = row["prefill_s"] + row["construct_gflop"] / gflops + row["decode_s"]
        row |= {
            "fp32_matmul_gflops": gflops,
            "floor_s": floor,
            "grid_over_full_eager": row["grid_s"] / row["full_eager_s"],
            "grid_over_full_compiled": row["grid_s"] / row["full_compiled_s"],
            "grid_over_floor": row["grid_s"] / floor,
        }
        rows.append(row)
    return rows


def summary(rows: Sequence[dict]) -> list[str]:
    """One line per length: the grid against the request (eager, compiled) and the floor."""
    return [
        f"{row['shape']} {row['length']}: grid {row['grid_s']:.2f}s ({row['decode']}, batches "
        f"{row['batches']}) = {row['grid_over_full_eager']:.2f} x the eager request "
        f"({row['full_eager_s']:.2f}s), {row['grid_over_full_compiled']:.2f} x the compiled one "
        f"({row['full_compiled_s']:.2f}s), {row['grid_over_floor']:.2f} x the floor {row['floor_s']:.2f}s "
        f"(prefill {row['prefill_s']:.2f} + construction FLOPs {row['construct_gflop']:.0f} GFLOP at "
        f"{row['fp32_matmul_gflops']:.0f} GFLOP/s + decode {row['decode_s']:.2f}); stages "
        f"construct {row['construct_s']:.2f}s, question {row['question_s']:.2f}s, decode "
        f"{row['decode_s']:.2f}s; peak {(row['peak_bytes'] or 0) / 2**30:.2f} GiB"
        for row in rows
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, default=None, help="every answer's length (32 on CUDA)")
    parser.add_argument("--decode", default=AUTO, choices=DECODE_CHOICES)
    parser.add_argument(
        "--decode-batch",
        default=AUTO,
        type=lambda text: check_decode_batch(text if text == AUTO else int(text)),
        help="N or auto",
    )
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = args.lengths or (GPU_LENGTHS if device == "cuda" else CPU_LENGTHS)
    new_tokens = args.new_tokens or (32 if device == "cuda" else 4)
    rows = grid_rows(bench_backbone(device), lengths, new_tokens, args.decode, args.decode_batch)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "grid_gpu.json"
    path.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    for line in summary(rows):
        print(line)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
