"""The dry run's printout (``python run.py <overrides> dry_run=true``): the plan, what the result store
holds of it and, with a calibration, its device hours per stage."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselines.registry import FULL_METHOD
from scripts.harness.dry_run.cost import (
    CONSTRUCTION_MODEL,
    NOT_COUNTED,
    STAGES,
    Stages,
    decode_batches,
    estimate,
    sample_seconds,
)
from scripts.harness.dry_run.rates import EstimateError, Rates
from scripts.harness.dry_run.workload import TaskPlan, task_plans
from scripts.harness.plan import Plan


def grid_summary(plan: Plan) -> str:
    """The grid's configurations in one line: methods, ratios and settings."""
    methods = list(dict.fromkeys(entry.label for entry in plan.grid))
    ratios = sorted({entry.ratio for entry in plan.grid if entry.ratio is not None})
    settings = [setting for setting in ("aware", "agnostic") if any(e.setting == setting for e in plan.grid)]
    compressing = [label for label in methods if label != FULL_METHOD]
    parts = [FULL_METHOD] if FULL_METHOD in methods else []
    if compressing:
        parts.append(
            f"{', '.join(compressing)} at ratios {', '.join(f'{ratio:g}' for ratio in ratios)}, "
            f"{' and '.join(settings)}"
        )
    return "; ".join(parts)


def shown(path: Path) -> Path:
    """``path`` relative to the working directory where it lies under it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def hours(seconds: float) -> str:
    value = seconds / 3600
    return f"{value:,.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value:.4f}"


def decoding(plan: Plan, tasks: Sequence[TaskPlan], rates: Rates | None) -> str:
    """What ``decode`` and ``decode_batch`` resolve to on the calibration's device, and the decode
    batches of a sample of the first task."""
    if rates is None:
        return ""
    mode, max_rows = rates.decoding(plan)
    batches = (
        len(decode_batches(plan, plan.grid, tasks[0].workload, rates))
        if tasks and plan.share_prefill and tasks[0].workload.prompt_tokens > 0
        else None
    )
    rows = "no row cap" if max_rows is None else f"at most {max_rows} row" + "s" * (max_rows > 1)
    return f" ({mode}, {rows}: {batches or len(plan.grid)} decode batches a sample)"


@dataclass
class DryRun:
    """What the printout's sections read: the plan, its tasks with the store's state, and with a
    calibration its rates and each task's seconds (else ``problem`` says why there are none)."""

    plan: Plan
    tasks: list[TaskPlan]
    rates: Rates | None
    estimates: dict[str, tuple[Stages, Stages]]
    problem: str = ""
    unresolved: Sequence[Any] = ()  # scripts.report.verdict.RoundsNeeded of the results so far


def report(plan: Plan, rates: Rates | None, problem: str = "", unresolved: Sequence[Any] = ()):
    """The dry run's printout: its ``SECTIONS`` in order, each a list of rich renderables.
    ``unresolved``: the verdict's claims whose direction the results so far leave open
    (``scripts.report.verdict.rounds_needed``, which run.py reads: the reports sit above the harness)."""
    from rich.console import Group

    tasks = task_plans(plan)
    try:
        estimates = estimate(plan, tasks, rates) if rates is not None else {}
    except EstimateError as error:  # a rate the grid needs is missing: the listing still helps
        rates, estimates, problem = None, {}, str(error)
    dry_run = DryRun(plan, tasks, rates, estimates, problem, unresolved)
    return Group(*(part for section in SECTIONS for part in section(dry_run)))


def header(dry_run: DryRun) -> list[Any]:
    """The plan in a few lines: backbone, benchmark, grid, decoding and the store's state."""
    from rich.text import Text

    plan, tasks = dry_run.plan, dry_run.tasks
    statuses = Counter(task.status(entry) for task in tasks for entry in plan.grid)
    shared = "shared by a sample's configurations" if plan.share_prefill else "one per configuration"
    return [
        Text(
            f"{plan.backbone} · {plan.benchmark}-{plan.length} · {len(tasks)} tasks x {len(plan.grid)} "
            f"configurations · shard {plan.shard_index} of {plan.shard_count}\n"
            f"configurations: {grid_summary(plan)}\n"
            f"decode={plan.decode}, decode_batch={plan.decode_batch}{decoding(plan, tasks, dry_run.rates)}, "
            f"prefill {shared}\n"
            f"result files under {shown(plan.runs_dir)}: {statuses['done']} done, "
            f"{statuses['partial']} partial, {statuses['to do']} to do"
        )
    ]


def task_listing(dry_run: DryRun) -> list[Any]:
    """One row per task: samples, tokens, the store's files and, with rates, its device hours to do."""
    from rich.table import Table

    plan, rates = dry_run.plan, dry_run.rates
    listing = Table(title="tasks (samples of this shard; prompt tokens nominal)")
    columns = (
        "task",
        "samples",
        "prompt tokens",
        "answer tokens",
        "files done/partial/to do",
        "samples to run",
    )
    for column in columns:
        listing.add_column(column, justify="left" if column == "task" else "right")
    if rates is not None:
        listing.add_column("device h to do", justify="right")
    for task in dry_run.tasks:
        counts = Counter(task.status(entry) for entry in plan.grid)
        workload, known = task.workload, task.workload.prompt_tokens > 0
        row = [
            task.task,
            str(task.range_size),
            f"{workload.prompt_tokens:,} ({workload.lengths})" if known else "?",
            str(workload.answer_tokens),
            f"{counts['done']}/{counts['partial']}/{counts['to do']}",
            str(sum(task.pending(plan.grid).values())),
        ]
        if rates is not None:
            row.append(hours(dry_run.estimates[task.task][0].total) if known else "?")
        listing.add_row(*row)
    return [listing]


def partial_files(dry_run: DryRun) -> list[Any]:
    """The result files that hold some of their samples, and how many."""
    from rich.text import Text

    plan, partial = dry_run.plan, []
    for task in dry_run.tasks:
        for entry in plan.grid:
            if task.status(entry) == "partial":
                path = shown(entry.key(plan, task.task).path(plan.runs_dir))
                partial.append(f"  {path}: {len(task.done[entry])} of {task.range_size}")
    return [Text("partial result files (samples held):\n" + "\n".join(partial))] if partial else []


def device_hours(dry_run: DryRun) -> list[Any]:
    """The device hours per stage and their notes, or why there is no estimate."""
    from rich.text import Text

    if dry_run.rates is None:
        return [Text(f"no estimate: {dry_run.problem}")]
    unknown = [task.task for task in dry_run.tasks if task.workload.prompt_tokens == 0]
    return stage_table(dry_run.plan, dry_run.rates, dry_run.estimates, unknown)


def stage_table(plan: Plan, rates: Rates, estimates: dict[str, tuple[Stages, Stages]], unknown: list[str]):
    """The device hours per stage and the notes that qualify them."""
    from rich.table import Table
    from rich.text import Text

    to_do, whole = Stages(), Stages()
    for task_to_do, task_whole in estimates.values():
        to_do.add(task_to_do)
        whole.add(task_whole)
    table = Table(title=f"device hours on {rates.device}")
    for column in ("stage", "to do", "whole grid", "share"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for stage in STAGES:
        share = getattr(whole, stage) / whole.total if whole.total else 0.0
        table.add_row(stage, hours(getattr(to_do, stage)), hours(getattr(whole, stage)), f"{share:.0%}")
    table.add_row("total", hours(to_do.total), hours(whole.total), "100%")
    borrowed: dict[str, list[str]] = {}
    for entry in dict.fromkeys(entry for entry in plan.grid if entry.method != FULL_METHOD):
        key = rates.construction_rate(entry)[1]
        if key != entry.label and entry.label not in borrowed.get(key, []):
            borrowed.setdefault(key, []).append(entry.label)
    notes = [
        CONSTRUCTION_MODEL,
        *NOT_COUNTED,
        f"Rates: {shown(rates.path)}" + "".join(f"\n  {note}" for note in rates.notes),
    ]
    if rates.memory_bytes is None or rates.weights_bytes is None or rates.shape is None:
        notes.append(
            "No memory limit: the calibration file lacks the device's memory, the weights or the shape."
        )
    if borrowed:
        taken = "; ".join(f"{key}'s for {', '.join(labels)}" for key, labels in borrowed.items())
        notes.append(f"Construction rates not measured per method, taken from their kind: {taken}.")
    if unknown:
        notes.append(f"Not estimated (no length statistics): {', '.join(unknown)}.")
    return [table, Text("\n".join(notes))]


def more_rounds(dry_run: DryRun) -> list[Any]:
    """The verdict's unresolved claims on this plan's backbone: the samples per task they have, the
    samples per task a paired t test needs to resolve the observed gain and the paper's, the rounds
    (one sample per task of the whole grid each) that asks for and, with rates, their device hours."""
    from rich.table import Table

    plan, rates = dry_run.plan, dry_run.rates
    claims = [claim for claim in dry_run.unresolved if claim.backbone == plan.backbone]
    if not claims:
        return []
    round_seconds = None
    if rates is not None and all(task.workload.prompt_tokens > 0 for task in dry_run.tasks):
        round_seconds = sum(
            sample_seconds(plan, task.workload, plan.grid, rates).total for task in dry_run.tasks
        )
    table = Table(title=f"claims the results under {shown(plan.results_dir)} leave unresolved")
    columns = ["claim", "direction", "samples/task", "needed: observed", "needed: paper", "more rounds"]
    for column in columns + (["device h"] if round_seconds is not None else []):
        table.add_column(column, justify="left" if column in ("claim", "direction") else "right")
    for claim in claims:
        row = [claim.claim, claim.direction, str(claim.samples)]
        row += [
            "--" if needed is None else str(needed) for needed in (claim.observed, claim.paper, claim.rounds)
        ]
        if round_seconds is not None:
            row.append("--" if claim.rounds is None else hours(claim.rounds * round_seconds))
        table.add_row(*row)
    return [table]


# The printout, section by section; a further section (a function of ``DryRun`` returning its parts)
# is one more entry here.
SECTIONS = (header, task_listing, partial_files, device_hours, more_rounds)
