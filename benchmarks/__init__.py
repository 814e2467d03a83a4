"""Benchmarks: prompts and metrics, nothing of compression.

Each benchmark module exposes ``TASKS`` and ``load_items(...) -> list[Item]``; this module is
the single entry point the harness uses, so it never needs a benchmark's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module

from benchmarks.item import Item

BENCHMARKS = ("ruler", "longbench")


class TaskUnavailable(RuntimeError):
    """A task whose source data is not present here (e.g. RULER qa_1/qa_2 offline)."""


class BenchmarkError(ValueError):
    """Bad benchmark input: unknown benchmark or task, a length too small, missing data."""


def _module(benchmark: str):
    if benchmark not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {benchmark!r}; choose one of {list(BENCHMARKS)}")
    return import_module(f"benchmarks.{benchmark}")


def tasks(benchmark: str) -> tuple[str, ...]:
    return tuple(_module(benchmark).TASKS)


def load_items(benchmark: str, task: str, tokenizer, **options) -> list[Item]:
    """Items of one task. Options are the benchmark's own (``ruler.load_items``, ``longbench.load_items``)."""
    module = _module(benchmark)
    if task not in module.TASKS:
        raise BenchmarkError(f"unknown {benchmark} task {task!r}; choose one of {list(module.TASKS)}")
    return module.load_items(task, tokenizer, **options)


def score_item(item: Item, prediction: str) -> float:
    """Score in [0, 1] of one prediction, with the benchmark's own post-processing."""
    return _module(item.benchmark).score_item(item, prediction)


def task_score(sample_scores: Sequence[float]) -> float:
    """Task score as both upstreams report it: ``round(100 * mean, 2)``."""
    return round(100 * sum(sample_scores) / len(sample_scores), 2)
