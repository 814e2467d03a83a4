"""A sample's device seconds per stage, counted as ``scripts.harness.grid`` runs it: its prefills, its
constructions and its decode batches, the batches cut by the grid's own rule (``reskv.batching``).

A construction rate is measured on one configuration alone at one ratio (``Rate.ratio``); the grid
constructs a method's ratios in one setting as one program sharing what does not depend on the ratio
(``reskv.compress.SharedLayers``: scores, budgets, merged values, the validation proxy), and a
+ResKV configuration's k-means, the most of its work, grows with its ratio's budget (the residual
sizes) and evicted tokens. So a construction's rate is split (``construction_seconds``): its
``s2`` term, the k-means, counted per configuration and, for +ResKV, scaled from the rate's ratio to
the configuration's by their k-means work (``kmeans_work``); its other terms once per method and
setting, whatever its ratios."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from reskv import batching
from reskv.config import DEFAULT_OBSERVATION_WINDOW, ResidualConfig, budget_for, candidate_sizes
from scripts.harness.dry_run.rates import Rates
from scripts.harness.dry_run.workload import TaskPlan, Workload
from scripts.harness.plan import GridEntry, Plan

STAGES = ("prefill", "construction", "decode")


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
    return not entry.method.endswith(RESIDUAL_SUFFIX) or entry.residual.batches


def compressed_tokens(entry: GridEntry, workload: Workload) -> int:
    """What a configuration compresses: the whole prompt (aware), the context (agnostic)."""
    if entry.setting == "agnostic":
        return workload.prompt_tokens - workload.question_tokens
    return workload.prompt_tokens


def row_slots(entry: GridEntry, workload: Workload) -> int:
    """A configuration's slots as a row decoding alone holds them (and as the calibration's decode
    points count a row): its budget (the prompt for the full cache), the question's slots, and room for
    its answer."""
    compressed = compressed_tokens(entry, workload)
    kept = compressed if entry.ratio is None else min(compressed, budget_for(compressed, entry.ratio))
    return kept + workload.question_tokens + workload.answer_tokens


def view_row(entry: GridEntry, workload: Workload) -> batching.ViewRow:
    """A configuration's row in a batch of views as the grid plans it (``reskv.batching.ViewRow``): its
    entries at most its residual's largest share of its budget. Its values are counted as the shared
    ones: which methods adjust values (CaM) is a property of their scorer's code, which the dry run does
    not import."""
    residual = entry.residual if entry.method.endswith(RESIDUAL_SUFFIX) else None
    shares = () if residual is None else (*residual.grid, residual.fixed_ratio)
    return batching.ViewRow.planned(compressed_tokens(entry, workload), entry.ratio, shares)


def device_memory(plan: Plan, workload: Workload, rates: Rates) -> batching.DeviceMemory | None:
    """The calibration device's memory when a sample's grid is cut into batches: its weights and the
    prefilled caches (the context's, and the whole prompt's when a configuration is query-aware)
    held; None where the calibration file does not give the device's memory, the weights or the
    model's shape (no limit)."""
    if rates.memory_bytes is None or rates.weights_bytes is None or rates.shape is None:
        return None
    shape, context = rates.shape, workload.prompt_tokens - workload.question_tokens
    prefilled = context + (workload.prompt_tokens if any(e.setting != "agnostic" for e in plan.grid) else 0)
    cache = prefilled * shape.layers * shape.kv_heads * shape.kv_slot_bytes
    return batching.DeviceMemory.holding(rates.memory_bytes, rates.weights_bytes + cache)


def observed_queries(entries: Sequence[GridEntry]) -> int:
    """Queries a layer keeps for the scorers and the validation proxy (``reskv.engine.Prefill``)."""
    windows = [e.residual.observation_window for e in entries if e.method.endswith(RESIDUAL_SUFFIX)]
    return max([DEFAULT_OBSERVATION_WINDOW, *windows])


def decode_batches(
    plan: Plan, entries: Sequence[GridEntry], workload: Workload, rates: Rates
) -> list[list[GridEntry]]:
    """A sample's configurations cut into decode batches by the grid's own rule
    (``reskv.batching.view_batches``: the row cap and the memory the calibration's device gives a
    batch of views of the prefilled cache), a configuration that does not batch alone."""
    _, max_rows = rates.decoding(plan)
    viewed = [entry for entry in entries if stacks(entry)]
    rows = [view_row(entry, workload) for entry in viewed]
    limit = None
    if rates.shape is not None:
        settings = len({entry.setting for entry in viewed if entry.ratio is not None})
        memory = device_memory(plan, workload, rates)
        limit = batching.sample_memory_limit(
            rates.shape, memory, workload.prompt_tokens, settings, observed_queries(viewed)
        )
    appended = workload.question_tokens + workload.answer_tokens
    batches = batching.view_batches(rows, rates.shape, limit, workload.prompt_tokens, appended, max_rows)
    return [[viewed[row] for row in batch] for batch in batches] + [[e] for e in entries if not stacks(e)]


# The protected window the k-means work is modelled with: SnapKV's, AdaKV's, CaM's and H2O's (TOVA's 1
# and StreamingLLM's 0 change which candidates are admissible only where a budget is under ~100 slots).
WORK_WINDOW = 64


def kmeans_work(tokens: int, ratio: float, residual: ResidualConfig) -> int:
    """Points x centres a Lloyd step of one +ResKV construction's k-means computes per KV head at
    ``ratio`` (its FLOPs: this x 2 head dim x steps x heads): the validation proxy's candidates, each
    admissible ``r`` of the grid (``reskv.config.candidate_sizes``) over the prefix tokens it evicts,
    ``|E'| = β - m'`` with ``m' = b - r - |validation|`` and ``β = s - |validation|``, and the final
    cache at the largest admissible ``r`` over ``|E| = s - b + r`` (an upper bound: the proxy may choose
    less). Uniform budgets of ``b = floor(s (1 - ratio))``: AdaKV spreads as much work over its heads,
    computed unpadded; ``WORK_WINDOW`` protected tokens."""
    budget, validation = budget_for(tokens, ratio), residual.validation_queries
    boundary = tokens - validation
    sizes = [size for (size,) in candidate_sizes(residual, [budget], WORK_WINDOW, validation) if size]
    candidates = sum((boundary - (budget - size - validation)) * size for size in sizes)
    largest = max(sizes, default=0)
    return candidates + (tokens - budget + largest) * largest


def construction_seconds(entry: GridEntry, workload: Workload, rates: Rates) -> tuple[float, float]:
    """A configuration's construction as (seconds independent of its ratio, which its method shares
    in a setting; its own k-means seconds): the module docstring's split of its rate."""
    rate = rates.construction_rate(entry)[0]
    tokens = compressed_tokens(entry, workload)
    terms = rate.term_seconds(s=tokens)
    kmeans = terms.pop("s2", 0.0)
    if entry.method.endswith(RESIDUAL_SUFFIX) and rate.ratio is not None and rate.ratio != entry.ratio:
        measured = kmeans_work(tokens, rate.ratio, entry.residual)
        kmeans *= kmeans_work(tokens, entry.ratio, entry.residual) / measured if measured else 1.0
    return max(0.0, sum(terms.values())), max(0.0, kmeans)


# How constructions are counted, printed under the estimate.
CONSTRUCTION_MODEL = (
    "Constructions: a rate's s2 term (the k-means) per configuration, a +ResKV one scaled from the ratio "
    "it was measured at to the configuration's by their k-means work; its other terms once per method "
    "and setting of a prefill (what a grid computes once for all its ratios)."
)
# What the estimate leaves out, printed under it.
NOT_COUNTED = (
    "Every answer counted at its task's whole generation length (an upper bound).",
    "Not counted: compiling the decode step and recording its CUDA graphs (once a process, "
    "a minute or two on a GPU), a batch decoded in halves when it fails to allocate, the memory of "
    "CaM's adjusted values in a batch of views, and the quality measures' own time "
    "(backbone.quality=true).",
)


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
    for served in prefills:  # the constructions of one prefill share their ratio-independent work
        shared: dict[tuple[str | None, str], float] = {}
        for entry in served:
            if entry.method != FULL_METHOD:
                once, own = construction_seconds(entry, workload, rates)
                family = entry.setting, entry.label
                shared[family] = max(shared.get(family, 0.0), once)
                stages.construction += own
        stages.construction += sum(shared.values())
    mode, _ = rates.decoding(plan)
    step = rates.decode_rate(mode)
    batches = decode_batches(plan, entries, workload, rates) if plan.share_prefill else [[e] for e in entries]
    appended = workload.question_tokens + workload.answer_tokens
    for batch in batches:
        slots = row_slots(batch[0], workload)
        if len(batch) > 1:  # the slots a step of views reads, as many a row
            rows = [view_row(entry, workload) for entry in batch]
            slots = batching.view_step_slots(rows, workload.prompt_tokens, appended) / len(batch)
        stages.decode += workload.answer_tokens * step.seconds(B=len(batch), L=slots)
    return stages


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
