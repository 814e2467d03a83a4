"""What a grid run saves: one shared prefill, and its configurations decoded together.

    python -m scripts.bench.grid_saving [run.py overrides ...]   # on top of DEFAULT_OVERRIDES

Runs the same plan three times in this process into scratch result directories (``MODES``):
with ``share_prefill=false`` (a new prefill and decode per configuration, what running the
configurations one at a time costs, minus process start-up), with one prefill per sample and each
configuration decoded alone (``decode_batch=1``), and with one prefill per sample and its
configurations decoded together (``decode_batch=N``, ``BATCH_OVERRIDE``). Reports the
wall-clock times, the speed-ups over the first, the seconds per phase, and how the predictions
compare: the first two must be identical; the batched run's may differ at near ties only, so for
every configuration whose tokens differ it prints the top-2 logit gap of its decode alone at the
first differing step. The report goes to ``<results_dir>/runs/_bench/grid_saving.json``.

Default overrides: the embedded backbone on one RULER-4K sample, the paper's RULER grid of
SnapKV, AdaKV and each +ResKV at its four ratios in both settings plus the full cache (33
configurations), at the benchmark's own answer lengths, decoded 16 at a time (two ratios' rows; 8
and 33 at a time were slower, `results/README.md`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from benchmarks.item import Item
from reskv.backbones import load_backbone
from reskv.engine import Prefill
from scripts.harness.grid import GridRun, load_task_items
from scripts.harness.plan import compose_plan
from scripts.harness.store import load_results, prefill_shared_by
from scripts.machine import load_average, machine
from scripts.measure import machine_header, top2_gap_at

WARM_UP_CONTEXT = 300  # tokens: longer than every observation window, so every method compresses
DEFAULT_OVERRIDES = (
    "benchmark.tasks=[niah_single_1]",
    "num_samples=1",
    "method=[full,snapkv,snapkv+reskv,adakv,adakv+reskv]",
    "ratio=[0.6,0.7,0.8,0.9]",
    "setting=[aware,agnostic]",
    "decode_batch=16",
)
# The three runs: overrides on top of the plan's. The plan's own decode_batch serves the last.
MODES = {
    "prefill_per_configuration": ("share_prefill=false", "decode_batch=1"),
    "shared_prefill": ("share_prefill=true", "decode_batch=1"),
    "shared_prefill_batched_decode": ("share_prefill=true",),
}


def predictions(runs_dir: Path) -> dict:
    results = load_results(runs_dir)[0]
    return {
        result.key: [sample["prediction_token_ids"] for _, sample in sorted(result.samples.items())]
        for result in results
    }


def time_breakdown(runs_dir: Path) -> dict[str, float]:
    """Seconds per phase summed over samples; a shared context prefill is counted once (the
    query-aware question forward is left out: it is shared too, but recorded on some records only)."""
    totals: dict[str, float] = {}
    for result in load_results(runs_dir)[0]:
        for sample in result.samples.values():
            timings = sample["timings"]
            totals["prefill_s"] = totals.get("prefill_s", 0) + timings["prefill_s"] / prefill_shared_by(
                sample
            )
            for phase in ("compress_s", "question_s", "decode_s", "quality_s"):
                totals[phase] = totals.get(phase, 0) + timings.get(phase, 0)
    return {phase: round(value, 2) for phase, value in totals.items()}


def warm_up_items(items: dict[str, list[Item]]) -> dict[str, list[Item]]:
    """The first sample shortened to its first WARM_UP_CONTEXT context tokens plus its question:
    every kernel of the grid runs once, at a fraction of the cost of a real sample."""
    task, (item, *_) = next(iter(items.items()))
    context = min(item.context_length, WARM_UP_CONTEXT)
    prompt = item.prompt_ids[:context] + item.question_ids
    return {task: [dataclasses.replace(item, prompt_ids=prompt, context_length=context)]}


def timed_run(plan, backbone, items, label: str) -> float:
    """Seconds to run a plan's pending generations (result files opened before the clock starts)."""
    grid = GridRun(plan, backbone, items)
    with tqdm(total=grid.open(), desc=label, unit="gen") as progress:
        grid.on_sample = progress.update
        start = time.perf_counter()
        grid.run()
    return round(time.perf_counter() - start, 3)


def batched_differences(plan, backbone, items, alone: dict, batched: dict) -> list[dict]:
    """Every configuration and sample whose batched tokens differ from its tokens decoded alone, with
    the first differing step and the top-2 logit gap there (``top2_gap_at``)."""
    methods = GridRun(plan, backbone, items).methods
    differences = []
    for task, task_items in items.items():
        for entry in plan.grid:
            key = entry.key(plan, task)
            for index, (own, together) in enumerate(zip(alone[key], batched[key], strict=True)):
                if own == together:
                    continue
                step = next(
                    (i for i, (a, b) in enumerate(zip(own, together, strict=False)) if a != b),
                    min(len(own), len(together)),
                )
                item = task_items[index]
                prefill = Prefill(backbone, item.prompt_ids, item.context_length)
                gap = top2_gap_at(
                    prefill, methods[entry.label, entry.ratio], entry.setting or "aware", own, step
                )
                differences.append(
                    {
                        "configuration": f"{task} {entry.describe()}",
                        "sample": index,
                        "step": step,
                        "top2_gap": gap,
                    }
                )
    return differences


def measure(overrides: Sequence[str]) -> dict:
    """Time the plan in each of ``MODES``; the first two must predict the same tokens, and every
    difference of the batched run is reported with its near-tie gap.

    Model loading and benchmark item generation happen once, before the timed runs, and an
    untimed warm-up on a short sample comes first (first calls of many torch kernels are slow).
    """
    plan = compose_plan(list(overrides))
    backbone = load_backbone(plan.backbone, plan.dtype, plan.device)
    items = load_task_items(plan, backbone.tokenizer)
    seconds, outputs, phases = {}, {}, {}
    loads = {"start": load_average()}
    with tempfile.TemporaryDirectory() as scratch:
        timed_run(
            compose_plan([*overrides, f"results_dir={scratch}/warm-up"]),
            backbone,
            warm_up_items(items),
            "warm-up",
        )
        for mode, mode_overrides in MODES.items():
            variant = compose_plan([*overrides, *mode_overrides, f"results_dir={scratch}/{mode}"])
            seconds[mode] = timed_run(variant, backbone, items, mode)
            outputs[mode] = predictions(variant.runs_dir)
            phases[mode] = time_breakdown(variant.runs_dir)
            loads[mode] = load_average()
    if outputs["shared_prefill"] != outputs["prefill_per_configuration"]:
        raise AssertionError("shared and per-configuration prefill predicted different tokens")
    reference = seconds["prefill_per_configuration"]
    return {
        "overrides": list(overrides),
        "backbone": plan.backbone,
        "benchmark": f"{plan.benchmark}-{plan.length}",
        "tasks": list(plan.tasks),
        "samples": sum(len(task_items) for task_items in items.values()),
        "configurations": len(plan.grid),
        "decode_batch": plan.decode_batch,
        "machine": machine(),
        "load_average_after": loads,
        "seconds": seconds,
        "phases": phases,
        "speedup": {mode: round(reference / seconds[mode], 3) for mode in MODES},
        "batched_differences": batched_differences(
            plan, backbone, items, outputs["shared_prefill"], outputs["shared_prefill_batched_decode"]
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    given = list(sys.argv[1:] if argv is None else argv)
    # Command-line overrides replace the defaults of the same key and add to the others.
    overrides = list(
        {override.split("=", 1)[0]: override for override in [*DEFAULT_OVERRIDES, *given]}.values()
    )
    print(machine_header())
    report = measure(overrides)
    out = compose_plan(overrides).runs_dir / "_bench" / "grid_saving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['configurations']} configurations on {report['backbone']} {report['benchmark']}:")
    for mode in MODES:
        print(
            f"  {mode:<30} {report['seconds'][mode]:8.1f} s  {report['speedup'][mode]:6.2f}x  "
            f"phases {report['phases'][mode]}  load after {report['load_average_after'][mode]}"
        )
    differences = report["batched_differences"]
    print(
        f"batched decode (decode_batch={report['decode_batch']}): "
        f"{len(differences)} configuration-samples predicted other tokens than decoded alone"
    )
    for difference in differences:
        print(f"  {difference}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
