"""A plan before the run: a grid's configurations, what the result store already holds of it, and
its device hours per stage, read from a calibration file without torch or the model's weights.

``python run.py <overrides> dry_run=true`` prints them; ``dry_run=calibrate`` first measures this
device's rates (``scripts.harness.calibrate``). The count follows what ``scripts.harness.grid``
runs for each sample that some configuration still lacks:

- **prefill**: one prefill of the context shared by the sample's configurations (one per
  configuration with ``share_prefill=false``), plus the accumulated attention H2O's scores need
  when such a method is in the grid (``prefill_with``); one forward of the question over the whole
  context when a configuration compresses query-aware (the full cache included), and one per
  query-agnostic configuration over its compressed cache;
- **construction**: one compression per compressing configuration, of the whole prompt (aware) or
  of the context (agnostic);
- **decode**: the task's generation length in steps for every batch of rows, the configurations
  cut into batches as ``reskv.grid.decode_grid`` cuts them (``reskv.batching.decode_batches``, with
  ``decode`` and ``decode_batch`` resolved for the calibration's device, no memory limit), a row
  holding its budget (the full prompt for the full cache), the question where it is fed after
  compression, and room for its answer.

Every answer is counted at its task's whole generation length: an upper bound, since answers that
stop early decode fewer steps. Prompt lengths are nominal (``task_workload``): RULER's prompt fills
its length less the tokens to generate; LongBench's is its task's mean length in words from the
benchmark's statistics, in tokens, truncated to the plan's length.

A calibration file (``results/calibration/<device kind>.json``, schema below) holds per backbone
the points each stage's rate is fitted to, or its coefficients, and says where each came from::

    {"schema": "reskv-calibration/1", "device": "<name>", "notes": [...],
     "backbones": {"<backbone>": {
        "prefill": RATE in s,                  the context prefill, s its tokens
        "question": RATE in n,                 one forward of n question tokens
        "prefill_with": {"<label>": RATE in s, ...}, the prefill's extra time with that method
        "construction": {"<label>|<method>|base|reskv": RATE in s, ...}, s the compressed tokens
        "decode": {"eager"|"compiled": RATE in B, L}}}}   one step of B rows of L slots each

    RATE = {"terms": ["1", "s", "s2", ...], "points": [[x..., seconds], ...] or
            "coefficients": [...], "scale": 1.0, "source": "where the numbers come from"}

A construction is looked up by the configuration's label, then its method, then its kind
(``reskv`` for a ``+reskv`` method, else ``base``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from reskv import batching
from reskv.config import budget_for
from scripts.harness.devices import cpu_model
from scripts.harness.plan import GridEntry, Plan, PlanError

SCHEMA = "reskv-calibration/1"
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "results" / "calibration"
# Tokens of a sample's question segment (what follows the context: question, the template's end,
# the answer prefix): nominal, as the calibration's question forwards are.
QUESTION_TOKENS = 64
# Tokens per whitespace-separated word: English prose (the RULER essays: ~112K words, ~145K tokens,
# benchmarks.ruler.haystacks) and code (this repository's Python files with the embedded SmolLM2
# tokenizer: 2.84).
TOKENS_PER_WORD = {"prose": 1.3, "code": 2.8}
# LongBench's statistics (THUDM/LongBench, LongBench/task.md): samples and mean length in words
# (Python's split) of each English task, and which are code.
LONGBENCH_STATISTICS = {
    "narrativeqa": (200, 18409),
    "qasper": (200, 3619),
    "multifieldqa_en": (150, 4559),
    "hotpotqa": (200, 9151),
    "2wikimqa": (200, 4887),
    "musique": (200, 11214),
    "gov_report": (200, 8734),
    "qmsum": (200, 10614),
    "multi_news": (200, 2113),
    "trec": (200, 5177),
    "triviaqa": (200, 8209),
    "samsum": (200, 6258),
    "passage_count": (200, 11141),
    "passage_retrieval_en": (200, 9289),
    "lcc": (500, 1235),
    "repobench-p": (500, 4206),
}
LONGBENCH_CODE_TASKS = ("lcc", "repobench-p")
STAGES = ("prefill", "construction", "decode")


class EstimateError(PlanError):
    """A dry run that cannot be estimated as asked (no calibration for this device or backbone)."""


def check_dry_run(value: Any) -> None:
    if not isinstance(value, bool) and value != "calibrate":
        raise PlanError(f"dry_run {value!r}: choose from true, false, calibrate")


# The terms a rate may be fitted with, as functions of its variables.
TERMS: dict[str, Callable[[Mapping[str, float]], float]] = {
    "1": lambda v: 1.0,
    "s": lambda v: v["s"],
    "s2": lambda v: v["s"] ** 2,
    "n": lambda v: v["n"],
    "B": lambda v: v["B"],
    "BL": lambda v: v["B"] * v["L"],
}
# Each stage's variables: tokens (s), question tokens (n), a decode batch's rows (B) and their slots (L).
VARIABLES = {
    "prefill": ("s",),
    "question": ("n",),
    "prefill_with": ("s",),
    "construction": ("s",),
    "decode": ("B", "L"),
}


def fit(terms: Sequence[str], points: Sequence[Sequence[float]], variables: Sequence[str]) -> list[float]:
    """Coefficients of ``terms`` fitted to ``points`` (``[x..., seconds]``) by least squares of the
    relative error (each point weighted by 1 / its seconds)."""
    import numpy as np

    values = [dict(zip(variables, point[:-1], strict=True)) for point in points]
    rows = [[TERMS[term](value) for term in terms] for value in values]
    seconds = np.array([point[-1] for point in points], dtype=float)
    weights = 1.0 / seconds
    solution, *_ = np.linalg.lstsq(np.array(rows) * weights[:, None], seconds * weights, rcond=None)
    return [float(value) for value in solution]


@dataclass(frozen=True)
class Rate:
    """Seconds as a sum of terms (``TERMS``) of a stage's variables, times ``scale``."""

    terms: tuple[str, ...]
    coefficients: tuple[float, ...]
    scale: float = 1.0
    source: str = ""

    @classmethod
    def read(cls, entry: Mapping[str, Any], stage: str) -> Rate:
        terms = tuple(entry["terms"])
        unknown = [term for term in terms if term not in TERMS]
        if unknown:
            raise ValueError(f"unknown terms {unknown}; choose from {list(TERMS)}")
        if "coefficients" in entry:
            coefficients = entry["coefficients"]
        else:
            coefficients = fit(terms, entry["points"], VARIABLES[stage])
        if len(coefficients) != len(terms):
            raise ValueError(f"{len(coefficients)} coefficients for the terms {list(terms)}")
        return cls(terms, tuple(coefficients), entry.get("scale", 1.0), entry.get("source", ""))

    def seconds(self, **variables: float) -> float:
        """Never below zero (a fit's intercept may be, far from its points)."""
        value = sum(c * TERMS[term](variables) for c, term in zip(self.coefficients, self.terms, strict=True))
        return max(0.0, self.scale * value)


@dataclass(frozen=True)
class Rates:
    """One backbone's rates on one device, from a calibration file."""

    device: str
    device_type: str  # "cuda" or "cpu": what decode=auto and decode_batch=auto resolve to there
    path: Path
    prefill: Rate
    question: Rate
    prefill_with: dict[str, Rate]
    construction: dict[str, Rate]
    decode: dict[str, Rate]
    notes: tuple[str, ...] = ()

    def construction_rate(self, entry: GridEntry) -> tuple[Rate, str]:
        """The rate a configuration's construction takes and the key it was found under."""
        kind = "reskv" if entry.method.endswith(RESIDUAL_SUFFIX) else "base"
        for key in (entry.label, entry.method, kind):
            if key in self.construction:
                return self.construction[key], key
        raise EstimateError(
            f"{self.path} has no construction rate for {entry.label!r} (nor {entry.method!r} or "
            f"{kind!r}; it has {sorted(self.construction)}): calibrate with a grid holding it"
        )

    def decoding(self, plan: Plan) -> tuple[str, int | None]:
        """The plan's decode mode and most rows a batch holds on this device (``grid_decoding``)."""
        return batching.grid_decoding(plan.decode, plan.decode_batch, self.device_type)

    def decode_rate(self, mode: str) -> Rate:
        if mode not in self.decode:
            raise EstimateError(
                f"{self.path} has no decode={mode} rate (it has {sorted(self.decode)}): run the dry run "
                f"with dry_run=calibrate decode={mode} on this device, or choose another decode mode"
            )
        return self.decode[mode]


def read_rates(path: Path, backbone: str) -> Rates:
    """The rates of ``backbone`` in the calibration file ``path``; a clear error when absent."""
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise EstimateError(f"cannot read the calibration file {path}: {error}") from error
    if document.get("schema") != SCHEMA or backbone not in document.get("backbones", {}):
        held = sorted(document.get("backbones", {}))
        raise EstimateError(
            f"{path} has no {SCHEMA} rates for backbone {backbone!r} (it has {held}); measure them "
            "on this device with dry_run=calibrate"
        )
    entry = document["backbones"][backbone]

    def keyed(stage: str) -> Iterable[tuple[str, Any]]:
        return entry.get(stage, {}).items()

    try:
        return Rates(
            device=document["device"],
            device_type=document["device_type"],
            path=path,
            prefill=Rate.read(entry["prefill"], "prefill"),
            question=Rate.read(entry["question"], "question"),
            prefill_with={label: Rate.read(rate, "prefill_with") for label, rate in keyed("prefill_with")},
            construction={key: Rate.read(rate, "construction") for key, rate in keyed("construction")},
            decode={mode: Rate.read(rate, "decode") for mode, rate in keyed("decode")},
            notes=tuple(document.get("notes", ())),
        )
    except (KeyError, ValueError, TypeError) as error:
        raise EstimateError(f"{path}: the rates of {backbone!r} are not a calibration ({error!r})") from error


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_name() -> str:
    """The CPU's model name and core count: CPU rates depend on both."""
    return f"{cpu_model() or platform.machine()} {os.cpu_count()} cores"


def gpu_name(index: int) -> str | None:
    """GPU ``index``'s name as the driver gives it (torch's ``get_device_name`` too), or None."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return listed or None


def device_name(device: str) -> str:
    """The name of the device a plan's ``backbone.device`` runs on, found without torch."""
    if device == "cpu":
        return cpu_name()
    index = int(device.removeprefix("cuda:")) if device.startswith("cuda:") else 0
    return gpu_name(index) or cpu_name()


def calibration_path(choice: str | None, device: str) -> Path:
    """The calibration file a dry run reads: ``choice`` as a path or a device kind (a file of
    ``CALIBRATION_DIR``), or this device's kind when None."""
    if choice is not None and Path(choice).suffix == ".json":
        return Path(choice)
    kind = slug(choice if choice is not None else device_name(device))
    return CALIBRATION_DIR / f"{kind}.json"


@dataclass(frozen=True)
class Workload:
    """One task's samples and nominal token counts per sample."""

    samples: int | None  # before sharding; None when no count is known
    prompt_tokens: int
    question_tokens: int
    answer_tokens: int  # decode steps: the task's generation length, or the plan's cap
    lengths: str  # where the prompt length comes from


def answer_length(benchmark: str, task: str) -> int:
    """The task's generation length (``Item.max_new_tokens``), from the benchmark's own tables."""
    if benchmark == "ruler":
        from benchmarks.ruler.templates import TASK_CONFIGS, TEMPLATES

        return TEMPLATES[TASK_CONFIGS[task][0]].tokens_to_generate
    from benchmarks.longbench import DATASET2MAXLEN

    return DATASET2MAXLEN[task]


def task_workload(plan: Plan, task: str) -> Workload:
    """Nominal samples and token counts of a task (module docstring): no data, no tokenizer."""
    generated = answer_length(plan.benchmark, task)
    answer = generated if plan.max_new_tokens is None else min(generated, plan.max_new_tokens)
    if plan.benchmark == "ruler":
        return Workload(plan.num_samples, plan.length - generated, QUESTION_TOKENS, answer, "length - answer")
    if plan.benchmark == "longbench" and task in LONGBENCH_STATISTICS:
        count, words = LONGBENCH_STATISTICS[task]
        per_word = TOKENS_PER_WORD["code" if task in LONGBENCH_CODE_TASKS else "prose"]
        prompt = min(plan.length, round(words * per_word) + QUESTION_TOKENS)
        samples = count if plan.num_samples is None else min(count, plan.num_samples)
        return Workload(samples, prompt, QUESTION_TOKENS, answer, f"mean {words:,} words")
    return Workload(plan.num_samples, 0, QUESTION_TOKENS, answer, "no length statistics")


@dataclass
class Stages:
    """Seconds per stage (``STAGES``)."""

    prefill: float = 0.0
    construction: float = 0.0
    decode: float = 0.0

    @property
    def total(self) -> float:
        return self.prefill + self.construction + self.decode

    def add(self, other: Stages, times: float = 1.0) -> None:
        for stage in STAGES:
            setattr(self, stage, getattr(self, stage) + times * getattr(other, stage))


def stacks(entry: GridEntry) -> bool:
    """Whether a configuration decodes in a batch: all but those without the shared softmax."""
    return not entry.method.endswith(RESIDUAL_SUFFIX) or entry.residual.shared_softmax


def decode_batches(
    entries: Sequence[GridEntry], workload: Workload, max_rows: int | None
) -> list[list[GridEntry]]:
    """A sample's configurations cut into decode batches as ``reskv.grid.decode_grid`` cuts them
    (``reskv.batching.decode_batches`` by their ``row_slots``, at most ``max_rows`` rows); a
    configuration that does not stack decodes alone."""
    stacked = [entry for entry in entries if stacks(entry)]
    slots = [row_slots(entry, workload) for entry in stacked]
    batches = [[stacked[row] for row in batch] for batch in batching.decode_batches(slots, 1, None, max_rows)]
    return batches + [[entry] for entry in entries if not stacks(entry)]


def compressed_tokens(entry: GridEntry, workload: Workload) -> int:
    """What a configuration compresses: the whole prompt (aware), the context (agnostic)."""
    if entry.setting == "agnostic":
        return workload.prompt_tokens - workload.question_tokens
    return workload.prompt_tokens


def row_slots(entry: GridEntry, workload: Workload) -> int:
    """A configuration's decode row: its budget (the prompt for the full cache), the question fed
    after a query-agnostic compression, and room for the answer."""
    if entry.ratio is None:
        return workload.prompt_tokens + workload.answer_tokens
    kept = budget_for(compressed_tokens(entry, workload), entry.ratio)
    question = workload.question_tokens if entry.setting == "agnostic" else 0
    return kept + question + workload.answer_tokens


def sample_seconds(plan: Plan, workload: Workload, entries: Sequence[GridEntry], rates: Rates) -> Stages:
    """Seconds per stage of one sample for the configurations ``entries`` that still lack it."""
    context = workload.prompt_tokens - workload.question_tokens
    question = rates.question.seconds(n=workload.question_tokens)
    stages = Stages()
    prefills = [list(entries)] if plan.share_prefill else [[entry] for entry in entries]
    for served in prefills:
        extras = [rates.prefill_with[entry.label] for entry in served if entry.label in rates.prefill_with]
        stages.prefill += rates.prefill.seconds(s=context)
        stages.prefill += max((extra.seconds(s=context) for extra in extras), default=0.0)
        if any(entry.setting != "agnostic" for entry in served):
            stages.prefill += question
    for entry in entries:
        if entry.setting == "agnostic":
            stages.prefill += question
        if entry.method != FULL_METHOD:
            rate = rates.construction_rate(entry)[0]
            stages.construction += rate.seconds(s=compressed_tokens(entry, workload))
    mode, max_rows = rates.decoding(plan)
    step = rates.decode_rate(mode)
    batches = decode_batches(entries, workload, max_rows) if plan.share_prefill else [[e] for e in entries]
    for batch in batches:
        slots = max(row_slots(entry, workload) for entry in batch)
        stages.decode += workload.answer_tokens * step.seconds(B=len(batch), L=slots)
    return stages


@dataclass
class TaskPlan:
    """A task of the plan: its workload, this shard's sample range and what the store holds of it."""

    task: str
    workload: Workload
    sample_range: tuple[int, int]
    done: dict[GridEntry, set[int]] = field(default_factory=dict)  # samples in the range on disk

    @property
    def range_size(self) -> int:
        return self.sample_range[1] - self.sample_range[0]

    def status(self, entry: GridEntry) -> str:
        found = len(self.done.get(entry, ()))
        return "done" if found == self.range_size else "partial" if found else "to do"

    def pending(self, entries: Sequence[GridEntry]) -> Counter[tuple[GridEntry, ...]]:
        """How many samples of the range lack exactly each set of configurations (none: left out)."""
        lacking: Counter[tuple[GridEntry, ...]] = Counter()
        for index in range(*self.sample_range):
            missing = tuple(entry for entry in entries if index not in self.done.get(entry, ()))
            if missing:
                lacking[missing] += 1
        return lacking


def task_plans(plan: Plan) -> list[TaskPlan]:
    """Every task of the plan with the samples the result store holds of it, read without writing:
    a task's sample count is the one its result files were written with, else the nominal one."""
    from scripts.harness.store import load_results

    held = load_results(plan.runs_dir)[0] if plan.runs_dir.exists() else []
    results = {result.key: result for result in held}
    plans = []
    for task in plan.tasks:
        workload = task_workload(plan, task)
        found = {entry: results.get(entry.key(plan, task)) for entry in plan.grid}
        totals = [result.samples_total for result in found.values() if result is not None]
        total = max(totals) if totals else workload.samples
        sample_range = plan.shard_range(total) if total is not None else (0, 0)
        done = {
            entry: {index for index in result.samples if sample_range[0] <= index < sample_range[1]}
            for entry, result in found.items()
            if result is not None
        }
        plans.append(TaskPlan(task, workload, sample_range, done))
    return plans


def estimate(plan: Plan, tasks: Iterable[TaskPlan], rates: Rates) -> dict[str, tuple[Stages, Stages]]:
    """Seconds per stage of each task: (what is still to run, the whole grid of this shard)."""
    estimates = {}
    for task in tasks:
        to_do, whole = Stages(), Stages()
        if task.workload.prompt_tokens > 0:
            for entries, count in task.pending(plan.grid).items():
                to_do.add(sample_seconds(plan, task.workload, entries, rates), count)
            whole.add(sample_seconds(plan, task.workload, plan.grid, rates), task.range_size)
        estimates[task.task] = (to_do, whole)
    return estimates


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
        len(decode_batches(plan.grid, tasks[0].workload, max_rows)) if tasks and plan.share_prefill else None
    )
    rows = "no row cap" if max_rows is None else f"at most {max_rows} row" + "s" * (max_rows > 1)
    return f" ({mode}, {rows}: {batches or len(plan.grid)} decode batches a sample)"


def report(plan: Plan, rates: Rates | None, problem: str = ""):
    """The dry run's printout: the plan, its result files and, with ``rates``, its device hours
    (else ``problem`` says why there are none)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tasks = task_plans(plan)
    statuses = Counter(task.status(entry) for task in tasks for entry in plan.grid)
    shared = "shared by a sample's configurations" if plan.share_prefill else "one per configuration"
    header = Text(
        f"{plan.backbone} · {plan.benchmark}-{plan.length} · {len(tasks)} tasks x {len(plan.grid)} "
        f"configurations · shard {plan.shard_index} of {plan.shard_count}\n"
        f"configurations: {grid_summary(plan)}\n"
        f"decode={plan.decode}, decode_batch={plan.decode_batch}{decoding(plan, tasks, rates)}, "
        f"prefill {shared}\n"
        f"result files under {shown(plan.runs_dir)}: {statuses['done']} done, {statuses['partial']} partial, "
        f"{statuses['to do']} to do"
    )
    try:
        estimates = estimate(plan, tasks, rates) if rates is not None else {}
    except EstimateError as error:  # a rate the grid needs is missing: the listing still helps
        rates, estimates, problem = None, {}, str(error)
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
    for task in tasks:
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
            row.append(hours(estimates[task.task][0].total) if known else "?")
        listing.add_row(*row)
    parts: list[Any] = [header, listing]
    partial = []
    for task in tasks:
        for entry in plan.grid:
            if task.status(entry) == "partial":
                path = shown(entry.key(plan, task.task).path(plan.runs_dir))
                partial.append(f"  {path}: {len(task.done[entry])} of {task.range_size}")
    if partial:
        parts.append(Text("partial result files (samples held):\n" + "\n".join(partial)))
    if rates is None:
        return Group(*parts, Text(f"no estimate: {problem}"))
    unknown = [task.task for task in tasks if task.workload.prompt_tokens == 0]
    return Group(*parts, *stage_table(plan, rates, estimates, unknown))


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
        "Every answer counted at its task's whole generation length (an upper bound).",
        f"Rates: {shown(rates.path)}" + "".join(f"\n  {note}" for note in rates.notes),
    ]
    if borrowed:
        taken = "; ".join(f"{key}'s for {', '.join(labels)}" for key, labels in borrowed.items())
        notes.append(f"Construction rates not measured per method, taken from their kind: {taken}.")
    if plan.quality:
        notes.append("The quality measures (backbone.quality=true) are not counted.")
    if unknown:
        notes.append(f"Not estimated (no length statistics): {', '.join(unknown)}.")
    return [table, Text("\n".join(notes))]
