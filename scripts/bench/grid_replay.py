"""The committed reproduction's sample 0 rerun as a GPU runs a grid, against its committed records.

    python -m scripts.bench.grid_replay [--results-dir results/ruler4k] [--tasks vt ...] [--out DIR]
                                        [--decode eager]

A GPU's ``decode=auto decode_batch=auto`` decodes each sample's configurations in one batch, as views
of its prefilled cache (``reskv.views``), with the compiled step and the constructions of a sample
sharing what they compute alike; the committed results were decoded one configuration at a time,
eagerly. This reruns sample 0 of every task of the committed run (``--results-dir``), the three
``run.py`` invocations of the Makefile's ``reproduce-ruler4k`` (``REPRODUCTION``), the GPU's way on
this CPU (``AS_ON_A_GPU``: 64 rows exceed every grid here, and a CPU has no memory limit; the step
``--decode`` says), with the quality measures on or off as the committed records have them, into
``--out`` (resumable; default a temporary directory). Each configuration's sample-0 record is then
compared with the committed one:

- its tokens: where they differ, the first differing step and the top-2 logit gap of the committed
  decode there (``top2_gap_at``, via ``grid_saving.batched_differences``). A row of a batch sums its
  attention in another order than alone, so a near tie may go the other way; nothing else may;
- every ``cache_stats`` field the committed record has, and the score: the construction is bit for
  bit the one alone, so these must not differ unless the tokens do (the score). Where a field
  differs, the configuration is also constructed alone here (``alone_here_equal``): fp32 near ties
  in a construction can go another way on another CPU, so a field that differs from the committed
  record but equals the lone construction on this machine is the machine's, not the batch's;
- the quality measures: their largest absolute difference per measure, reported (each row's are its
  own cache's, as alone: a difference is the machine's or the construction's).

The summary is printed and written to ``--report`` (default ``<results-dir>/replay/grid_replay.json``).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from reskv.backbones import load_backbone
from reskv.engine import Prefill
from scripts.bench.grid_saving import batched_differences, timed_run
from scripts.harness.grid import GridRun, load_task_items
from scripts.harness.plan import compose_plan
from scripts.harness.store import load_results
from scripts.machine import load_average, machine
from scripts.measure import machine_header

SAMPLE = 0
# The three invocations of one round of the Makefile's reproduce-ruler4k (tasks and model added).
REPRODUCTION = (
    (
        "method=[full,snapkv,snapkv+reskv,adakv,adakv+reskv]",
        "ratio=[0.6,0.7,0.8,0.9]",
        "setting=[aware,agnostic]",
    ),
    ("method=[tova,tova+reskv,h2o,h2o+reskv,cam]", "ratio=0.9", "setting=[aware,agnostic]"),
    (
        "ratio=0.9",
        "setting=agnostic",
        "method=['snapkv+reskv~validate=false','snapkv+reskv~gate=false',"
        "'snapkv+reskv~shared_softmax=false','snapkv+reskv~final_selection=fit']",
    ),
)
AS_ON_A_GPU = ("decode_batch=64", f"num_samples={SAMPLE + 1}")
# The decode step, compiled as on a GPU by default; ``--decode eager`` keeps the batch of views and the
# shared constructions but not the compiled step, whose graph of the embedded model's 30 layers of
# views takes this CPU over ten minutes to compile.
DECODES = ("compiled", "eager")


def first_samples(runs_dir: Path, tasks: Sequence[str] | None = None) -> dict:
    """Sample ``SAMPLE``'s record of every configuration under ``runs_dir`` (of ``tasks``, if given)."""
    return {
        result.key: result.samples[SAMPLE]
        for result in load_results(runs_dir)[0]
        if SAMPLE in result.samples and (tasks is None or result.key.task in tasks)
    }


def reproduction_invocations(committed: dict, tasks: Sequence[str]) -> list[list[str]]:
    """``REPRODUCTION`` on the committed run's backbone, benchmark and length, for ``tasks``."""
    key = next(iter(committed))
    common = [
        f"backbone={key.backbone}",
        f"benchmark={key.benchmark}",
        f"benchmark.length={key.length}",
        f"benchmark.tasks=[{','.join(tasks)}]",
    ]
    return [[*common, *invocation] for invocation in REPRODUCTION]


def max_abs_difference(committed, replayed) -> float:
    """The largest absolute difference of two measures (numbers, or lists of them; None equals None)."""
    if isinstance(committed, list):
        return max((max_abs_difference(a, b) for a, b in zip(committed, replayed, strict=True)), default=0.0)
    if committed is None or replayed is None:
        return 0.0 if committed is replayed else math.inf
    return abs(committed - replayed)


def compare(committed: dict, replayed: dict) -> dict:
    """What differs between two records of one configuration's sample besides its tokens: the
    ``cache_stats`` fields of the committed record that the rerun's does not equal, the two scores if
    they differ, and each quality measure's absolute difference."""
    if committed["prompt_digest"] != replayed["prompt_digest"]:
        raise ValueError(
            f"the rerun's prompt {replayed['prompt_digest']} is not the committed one "
            f"{committed['prompt_digest']}: other benchmark data or tokenizer"
        )
    stats = [
        name for name, value in committed["cache_stats"].items() if replayed["cache_stats"].get(name) != value
    ]
    quality = committed.get("quality") or {}
    return {
        "cache_stats_differ": stats,
        "scores": None
        if committed["score"] == replayed["score"]
        else [committed["score"], replayed["score"]],
        "quality": {
            name: max_abs_difference(value, replayed["quality"][name]) for name, value in quality.items()
        },
    }


def constructed_alone(backbone, item, method, setting: str) -> dict:
    """The construction statistics of ``method`` in ``setting`` on ``item`` built alone, with its own
    prefill, here."""
    prefill = Prefill(backbone, item.prompt_ids, item.context_length, [method])
    return prefill.compressed_layers(method, setting)[1]


def replay(
    committed_dir: Path, invocations: Sequence[Sequence[str]], out: Path, decode: str = "compiled"
) -> dict:
    """Rerun ``invocations`` (``run.py`` overrides) the GPU's way into ``out``, with the ``decode`` step,
    and compare their sample-0 records with ``committed_dir``'s (module docstring); returns the report."""
    as_run = (f"decode={decode}", *AS_ON_A_GPU)
    if out.resolve() == committed_dir.resolve():
        raise ValueError(f"--out {out} is the committed results directory: the rerun would only resume it")
    committed = first_samples(committed_dir / "runs")
    quality = all("quality" in record for record in committed.values())
    plans = [
        compose_plan([*invocation, *as_run, f"backbone.quality={str(quality).lower()}", f"results_dir={out}"])
        for invocation in invocations
    ]
    backbone = load_backbone(plans[0].backbone, plans[0].dtype, plans[0].device)
    items = load_task_items(plans[0], backbone.tokenizer)
    plan_methods = [GridRun(plan, backbone, items).methods for plan in plans]  # by (label, ratio)
    planned = {
        entry.key(plan, task): (methods[entry.label, entry.ratio], task, entry)
        for plan, methods in zip(plans, plan_methods, strict=True)
        for task in items
        for entry in plan.grid
    }
    missing = sorted(str(key) for key in planned if key not in committed)
    if missing:
        raise ValueError(f"configurations without a committed sample {SAMPLE}: {missing}")

    loads, start = {"start": load_average()}, time.perf_counter()
    seconds = [
        timed_run(plan, backbone, items, f"invocation {number}") for number, plan in enumerate(plans, 1)
    ]
    replayed = first_samples(out / "runs", list(items))
    loads["end"] = load_average()
    alone = {key: [committed[key]["prediction_token_ids"]] for key in planned}
    batched = {key: [replayed[key]["prediction_token_ids"]] for key in planned}
    tokens = {  # by configuration: the first differing step and the committed decode's top-2 gap there
        found["configuration"]: found
        for plan in plans
        for found in batched_differences(plan, backbone, items, alone, batched)
    }
    differing, quality_difference = [], collections.defaultdict(float)
    for key, (method, task, entry) in planned.items():
        configuration = f"{task} {entry.describe()}"
        found = compare(committed[key], replayed[key])
        for name, value in found.pop("quality").items():
            quality_difference[name] = max(quality_difference[name], value)
        if found["cache_stats_differ"]:
            alone_here = constructed_alone(backbone, items[task][SAMPLE], method, entry.setting or "aware")
            found["alone_here_equal"] = all(
                alone_here[name] == replayed[key]["cache_stats"][name]
                for name in found["cache_stats_differ"]
                if name in alone_here
            )
        if configuration in tokens or any(found.values()):
            token = tokens.get(configuration, {})
            differing.append(
                {
                    "configuration": configuration,
                    "step": token.get("step"),
                    "top2_gap": token.get("top2_gap"),
                    **found,
                }
            )
    return {
        "committed": str(committed_dir),
        "tasks": list(items),
        "invocations": [list(invocation) for invocation in invocations],
        "as_on_a_gpu": list(as_run),
        "quality": quality,
        "machine": machine(),
        "load_average": loads,
        "seconds": {"invocations": seconds, "total": round(time.perf_counter() - start, 1)},
        "decoded": dict(collections.Counter(decoded_as(replayed[key]) for key in planned)),
        "configurations": len(planned),
        "equal": len(planned) - len(differing),
        "differing": differing,
        "quality_max_abs_difference": dict(quality_difference),
    }


def decoded_as(record: dict) -> str:
    """How a rerun record was decoded: its step and the rows of its batch."""
    run = record["run"]
    return f"{run['decode']}, batch of {run['batch_rows']}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", type=Path, default=Path("results/ruler4k"))
    parser.add_argument("--tasks", nargs="+", help="default: every task of the committed run")
    parser.add_argument("--out", type=Path, help="the rerun's results directory (default: temporary)")
    parser.add_argument(
        "--decode", choices=DECODES, default="compiled", help="the decode step (default compiled)"
    )
    parser.add_argument("--report", type=Path, help="default: <results-dir>/replay/grid_replay.json")
    args = parser.parse_args(argv)
    committed = first_samples(args.results_dir / "runs")
    if not committed:
        raise SystemExit(f"no result with a sample {SAMPLE} under {args.results_dir / 'runs'}")
    tasks = args.tasks or sorted({key.task for key in committed})
    print(machine_header())
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        report = replay(args.results_dir, reproduction_invocations(committed, tasks), out, args.decode)
    path = args.report or args.results_dir / "replay" / "grid_replay.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['equal']} of {report['configurations']} configurations equal in tokens, cache statistics "
        f"and score; {report['seconds']['total']} s, load average {report['load_average']}"
    )
    print(f"decoded: {report['decoded']}")
    for difference in report["differing"]:
        print(f"  {difference}")
    print(f"quality measures, max abs difference: {report['quality_max_abs_difference']}")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
