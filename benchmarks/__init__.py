"""Benchmarks: prompts and metrics, nothing of compression.

Each benchmark module exposes ``TASKS``, ``TASK_SETS`` (named task lists), ``load_items(...) ->
list[Item]``, ``score_item`` and ``task_score``; this module is the single entry point the harness
uses, so it never needs a benchmark's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module

from benchmarks.item import Item

# Benchmark name -> its module under ``benchmarks``.
_MODULES = {"ruler": "ruler", "longbench": "longbench", "longbench-e": "longbench_e"}
BENCHMARKS = tuple(_MODULES)


class TaskUnavailable(RuntimeError):
    """A task whose source data is not present here (RULER qa_1/qa_2, LongBench without its data)."""


class BenchmarkError(ValueError):
    """Bad benchmark input: unknown benchmark or task, a length too small, missing data."""


def _module(benchmark: str):
    if benchmark not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {benchmark!r}; choose one of {list(BENCHMARKS)}")
    return import_module(f"benchmarks.{_MODULES[benchmark]}")


def tasks(benchmark: str) -> tuple[str, ...]:
    return tuple(_module(benchmark).TASKS)


def task_sets(benchmark: str) -> dict[str, tuple[str, ...]]:
    """Named task lists of the benchmark (``all`` for every benchmark; LongBench also ``english``)."""
    return dict(_module(benchmark).TASK_SETS)


def load_items(benchmark: str, task: str, tokenizer, **options) -> list[Item]:
    """Items of one task. Options are the benchmark's own (``ruler.load_items``, ``longbench.load_items``)."""
    module = _module(benchmark)
    if task not in module.TASKS:
        raise BenchmarkError(f"unknown {benchmark} task {task!r}; choose one of {list(module.TASKS)}")
    return module.load_items(task, tokenizer, **options)


def score_item(item: Item, prediction: str) -> float:
    """Score in [0, 1] of one prediction, with the benchmark's own post-processing."""
    return _module(item.benchmark).score_item(item, prediction)


def task_score(benchmark: str, sample_scores: Sequence[float]) -> float:
    """Task score (0-100, 2 decimals) of the sample scores, in the benchmark's own rounding order."""
    if not sample_scores:
        raise BenchmarkError(f"no sample scores to make a {benchmark} task score from")
    return _module(benchmark).task_score(sample_scores)


def score_buckets(items: Sequence[Item], sample_scores: Sequence[float]) -> dict[str, float | None]:
    """Per-length-bucket task scores of one task's samples (LongBench-E's ``scorer_e``)."""
    if len(items) != len(sample_scores):
        raise BenchmarkError(f"{len(items)} items but {len(sample_scores)} sample scores")
    if not items:
        raise BenchmarkError("no items to make bucket scores from")
    benchmark = items[0].benchmark
    module = _module(benchmark)
    if not hasattr(module, "score_buckets"):
        raise BenchmarkError(f"{benchmark} has no length buckets; only longbench-e does")
    return module.score_buckets(items, sample_scores)
