"""What one shared prefill saves: a grid run against a fresh prefill per configuration.

    python -m scripts.bench.grid_saving [run.py overrides ...]   # on top of DEFAULT_OVERRIDES

Runs the same plan twice in this process into scratch result directories: once as run.py does
(each sample prefilled once for the whole grid) and once with ``share_prefill=false`` (a new
prefill for every configuration, what running the configurations one at a time costs, minus
process start-up). Reports both wall-clock times, their ratio, and checks that the two runs
predicted the same tokens. The report goes to ``<results_dir>/runs/_bench/grid_saving.json``.

Default overrides: the embedded backbone on one RULER-4K sample, every base method and
SnapKV+ResKV at ratio 0.9 in both settings plus the full cache (13 configurations), answers
capped at 16 tokens so decoding does not drown the prefill being measured.
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
from scripts.harness.grid import GridRun, load_task_items
from scripts.harness.plan import compose_plan
from scripts.harness.store import load_results

WARM_UP_CONTEXT = 300  # tokens: longer than every observation window, so every method compresses
DEFAULT_OVERRIDES = (
    "benchmark.tasks=[niah_single_1]",
    "num_samples=1",
    "method=[full,h2o,tova,snapkv,adakv,cam,snapkv+reskv]",
    "ratio=0.9",
    "setting=[aware,agnostic]",
    "max_new_tokens=16",
)


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
            totals["prefill_s"] = (
                totals.get("prefill_s", 0) + timings["prefill_s"] / timings["prefill_shared_by"]
            )
            for phase in ("compress_s", "question_s", "decode_s"):
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


def measure(overrides: Sequence[str]) -> dict:
    """Time the plan with and without a shared prefill; both runs must predict the same tokens.

    Model loading and benchmark item generation happen once, before either timed run, and an
    untimed warm-up on a short sample comes first (first calls of many torch kernels are slow).
    """
    plan = compose_plan(list(overrides))
    backbone = load_backbone(plan.backbone, plan.dtype, plan.device)
    items = load_task_items(plan, backbone.tokenizer)
    seconds, outputs, phases = {}, {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        timed_run(
            compose_plan([*overrides, f"results_dir={scratch}/warm-up"]),
            backbone,
            warm_up_items(items),
            "warm-up",
        )
        for shared in (True, False):
            mode = "shared_prefill" if shared else "prefill_per_configuration"
            variant = compose_plan(
                [*overrides, f"share_prefill={str(shared).lower()}", f"results_dir={scratch}/{mode}"]
            )
            seconds[mode] = timed_run(variant, backbone, items, mode)
            outputs[mode] = predictions(variant.runs_dir)
            phases[mode] = time_breakdown(variant.runs_dir)
    if outputs["shared_prefill"] != outputs["prefill_per_configuration"]:
        raise AssertionError("shared and per-configuration prefill predicted different tokens")
    return {
        "overrides": list(overrides),
        "backbone": plan.backbone,
        "benchmark": f"{plan.benchmark}-{plan.length}",
        "tasks": list(plan.tasks),
        "samples": sum(len(task_items) for task_items in items.values()),
        "configurations": len(plan.grid),
        "seconds": seconds,
        "phases": phases,
        "speedup": round(seconds["prefill_per_configuration"] / seconds["shared_prefill"], 3),
        "identical_predictions": True,
    }


def main(argv: Sequence[str] | None = None) -> None:
    given = list(sys.argv[1:] if argv is None else argv)
    # Command-line overrides replace the defaults of the same key and add to the others.
    overrides = list(
        {override.split("=", 1)[0]: override for override in [*DEFAULT_OVERRIDES, *given]}.values()
    )
    report = measure(overrides)
    out = compose_plan(overrides).runs_dir / "_bench" / "grid_saving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['configurations']} configurations on {report['backbone']} {report['benchmark']}: "
        f"shared prefill {report['seconds']['shared_prefill']:.1f} s, a prefill per configuration "
        f"{report['seconds']['prefill_per_configuration']:.1f} s -> {report['speedup']:.2f}x faster "
        f"(identical predictions); written to {out}"
    )


if __name__ == "__main__":
    main()
