"""The GPU check's command line: the checks the arguments ask for, the report written and summarised
(``python -m scripts.bench.gpu_check``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch

import scripts.bench.gpu_check as gpu_check
from baselines import METHODS
from reskv.backbones import PAPER_SHAPES, random_backbone
from reskv.config import DECODE_MODES
from scripts.bench.gpu_check.correctness import DTYPES, TINY_MODELS, check_model
from scripts.bench.gpu_check.efficiency import (
    CPU_LENGTHS,
    EFFICIENCY_METHODS,
    GPU_LENGTHS,
    KERNEL_SWITCHES,
    WARM_UP_LENGTH,
    efficiency_rows,
)
from scripts.bench.gpu_check.report import check_machine, merged, plot, summary
from scripts.bench.grid_gpu import GPU_LENGTHS as GRID_LENGTHS
from scripts.bench.grid_gpu import grid_rows
from scripts.bench.grid_gpu import summary as grid_summary
from scripts.measure import CPU_SHRINK, release_memory

GRID_NEW_TOKENS = 32  # every answer of the grid bench this long: its time does not depend on the weights


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=gpu_check.__doc__.split("\n")[0])
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
    parser.add_argument(
        "--decode-repeats",
        type=int,
        default=None,
        help="decode runs timed per request and mode, their median reported and their spread drawn "
        "(default: 3 with CUDA, 1 without)",
    )
    parser.add_argument(
        "--grid-lengths",
        nargs="+",
        type=int,
        default=None,
        help="lengths of one sample's paper grid against one full-cache request (scripts.bench.grid_gpu; "
        "default: 4096 32768 with CUDA, none without)",
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
    report = {"machine": check_machine(device), "correctness": [], "efficiency": [], "grid": []}

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
        repeats = args.decode_repeats or (3 if cuda else 1)
        grid_lengths = args.grid_lengths or (GRID_LENGTHS if cuda else ())
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
                decode_repeats=repeats,
            )
            measure(backbone, [WARM_UP_LENGTH[device]], args.ratios[:1])
            print(f"warm-up {shape}: {time.perf_counter() - started:.1f}s", flush=True)
            for length in lengths:
                started = time.perf_counter()
                rows = measure(backbone, [length], args.ratios, profile_lengths=profile_lengths)
                report["efficiency"] += rows
                print(f"efficiency {shape} {length}: {time.perf_counter() - started:.1f}s", flush=True)
                save()
            if grid_lengths:
                started = time.perf_counter()
                unstoppable = dataclasses.replace(backbone, stop_token_ids=())
                report["grid"] += grid_rows(unstoppable, grid_lengths, GRID_NEW_TOKENS)
                print(f"grid {shape} {grid_lengths}: {time.perf_counter() - started:.1f}s", flush=True)
                save()
            del backbone
            release_memory(torch.device(device))
    save()
    for line in summary(report) + grid_summary(report.get("grid", [])):
        print(line)
    for figure in plot(report, args.out):
        print("wrote", figure)
    print("wrote", path)
    return 0 if report.get("correctness_passed", True) else 1
