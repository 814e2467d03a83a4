"""LongBench-E: the 13 English tasks in their length-balanced ``_e`` files, scored per length bucket.

Upstream: ``THUDM/LongBench`` ``LongBench/pred.py --e`` (the task list; each task prompted and
generated exactly as in LongBench, from the hub config ``<task>_e``, i.e. ``data/<task>_e.jsonl`` of
``data.zip``) and ``LongBench/eval.py --e`` (``scorer_e``). Items, per-sample scores and the
whole-task score are LongBench's (``benchmarks.longbench``); ``score_buckets`` adds ``scorer_e``'s
per-bucket scores. Task names are upstream's base names (``qasper``, not ``qasper_e``); the
benchmark name ``longbench-e`` keeps their results apart from LongBench's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks import BenchmarkError
from benchmarks.item import Item
from benchmarks.longbench import items_from_file, score_item, task_score

__all__ = [
    "BUCKETS",
    "TASKS",
    "TASK_SETS",
    "bucket_scores",
    "load_items",
    "score_buckets",
    "score_item",
    "task_score",
]

# pred.py's ``datasets`` when ``args.e`` is set, in its order.
TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
TASK_SETS = {"all": TASKS}
# scorer_e: bucket name -> [low, high) bounds on the sample's ``length`` field.
BUCKETS = {"0-4k": (0, 4000), "4-8k": (4000, 8000), "8k+": (8000, float("inf"))}


def load_items(
    task: str,
    tokenizer,
    *,
    length: int,
    num_samples: int | None = None,
    data_dir: str | Path | None = None,
    template_rule: str = "paper",
    seed: int = 42,
) -> list[Item]:
    """Items of ``data/<task>_e.jsonl``, with the options of ``benchmarks.longbench.load_items``."""
    if task not in TASKS:
        raise BenchmarkError(f"unknown longbench-e task {task!r}; choose one of {list(TASKS)}")
    return items_from_file(
        "longbench-e", task, f"{task}_e", tokenizer, length, num_samples, data_dir, template_rule
    )


def bucket_of(length: int) -> str:
    """``scorer_e``'s bucket: below 4000, below 8000, the rest."""
    return next(name for name, (low, high) in BUCKETS.items() if low <= length < high)


def score_buckets(items: Sequence[Item], sample_scores: Sequence[float]) -> dict[str, float | None]:
    """``scorer_e``: ``round(100 * np.mean(bucket), 2)`` per bucket, by each sample's ``length``.

    The rounding is numpy's (``round`` of an ``np.float64``), as upstream's, which differs from
    Python's on some halves. A bucket with no sample is ``None`` (upstream's ``np.mean([])`` gives
    NaN with a warning).
    """
    return bucket_scores([item.metadata["length"] for item in items], sample_scores)


def bucket_scores(lengths: Sequence[int], sample_scores: Sequence[float]) -> dict[str, float | None]:
    """``score_buckets`` from the samples' ``length`` fields (what a result file keeps of an item)."""
    grouped: dict[str, list[float]] = {name: [] for name in BUCKETS}
    for length, score in zip(lengths, sample_scores, strict=True):
        grouped[bucket_of(length)].append(score)
    return {
        name: float(round(100 * np.mean(scores), 2)) if scores else None for name, scores in grouped.items()
    }
