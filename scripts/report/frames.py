"""Every result file under a results directory as tidy pandas DataFrames.

    from scripts.report.frames import configs_frame, load_frames, samples_frame
    samples, configs, warnings = load_frames("results")   # both, read once
    configs = configs_frame("results")                      # or one of them

``samples``: one row per configuration and sample. ``configs``: one row per configuration, plus
one row per task whose data is unavailable here (``status`` "unavailable", ``reason``).
``python -m scripts.report.tables`` writes both as ``<results-dir>/tables/samples.csv`` and
``results.csv``.

Columns of both frames:

- the configuration (``scripts.harness.store.ResultKey``): ``backbone``, ``benchmark``,
  ``length``, ``task``, ``setting``, ``label`` (``snapkv+reskv~validate=false``), ``ratio``;
  ``setting`` and ``ratio`` are empty for the full cache, which serves every ratio;
- the label split up (``scripts.harness.records.MethodLabel``): ``method`` (the name,
  ``snapkv+reskv``), ``base_method`` (the baseline without ``+reskv``), ``residual`` (whether
  ResKV is on), ``options`` (the non-default method options after ``~``, "" for none).

The CSV files (``write_frames``, ``layers.csv``) hold the label in a column named ``method``, as
the result files store it, and leave the name out (``base_method`` and ``residual`` give it).

``samples`` adds ``index``, ``score`` (a fraction in [0, 1], empty for a sample ``skipped``
before its prefill; ``skipped`` holds the reason) and every other scalar field of the sample
record, named by its JSON path: ``prompt_tokens``, ``prediction``, ``timings.decode_s``,
``run.prefill_shared_by``, and quality measures such as an answer log-likelihood or a KL
divergence when the runner records them. The per-layer, per-KV-head lists of ``cache_stats``
(``cache_stats.main_slots``, ``cache_stats.residual_entries``, ...) become their mean over
layers and heads. Other lists (references, token ids) are left out.

``layers_frame(results)`` (``results`` as ``scripts.harness.store.load_results`` reads them): one
row per configuration, sample and layer with the quality measures' per-layer attention error and
residual share (``layers.csv``).

``heads_frame(results)``: one row per compressing configuration, sample, layer and KV head
with its budget, main slots, chosen residual slots and residual entries.

``configs`` adds ``samples_total`` (the sample range the files cover), ``n_recorded``
(samples present, scored or skipped), ``n_samples`` (scored), ``n_skipped``, ``task_samples``
(the most samples any configuration of the task has: ``samples_total`` or recorded), ``score``
(the benchmark's task score in percent over the scored samples, ``benchmarks.task_score``),
``status`` (``complete``, or ``partial`` when it has fewer samples than ``task_samples``, the
dagger of the tables) and ``mean_<column>`` for every numeric sample column (mean over the scored
samples: ``mean_timings.decode_s``, ``mean_cache_stats.residual_entries``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import benchmarks
from benchmarks.longbench_e import BUCKETS, bucket_scores
from scripts.harness.records import MethodLabel
from scripts.harness.store import ResultKey, TaskResult, load_results

KEY_COLUMNS = ["backbone", "benchmark", "length", "task", "setting", "label", "ratio"]
TASK_COLUMNS = KEY_COLUMNS[:4]
LABEL_COLUMNS = ["method", "base_method", "residual", "options"]
# Derived from cache_stats.residual_entries: the share of (layer, KV head) pairs with entries.
RESIDUAL_HEADS = "cache_stats.residual_heads"
# The columns every frame has, even an empty one (no results yet).
SAMPLE_COLUMNS = [*KEY_COLUMNS, *LABEL_COLUMNS, "index", "score", "skipped"]
CONFIG_COLUMNS = [
    *KEY_COLUMNS,
    *LABEL_COLUMNS,
    "status",
    "score",
    "n_samples",
    "n_skipped",
    "n_recorded",
    "samples_total",
    "task_samples",
]


def configuration_columns(key: ResultKey) -> dict[str, Any]:
    """The columns of a configuration: its key's fields and its label split up (``LABEL_COLUMNS``)."""
    label = MethodLabel.parse(key.label)
    return {
        **asdict(key),
        "method": label.method,
        "base_method": label.base,
        "residual": label.residual,
        "options": label.options_text,
    }


def _scalar_fields(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(JSON path, value) of every scalar in a sample record; cache_stats lists as their mean."""
    for name, value in record.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            yield from _scalar_fields(value, f"{path}.")
        elif isinstance(value, list):
            if prefix == "cache_stats.":
                numbers = np.asarray(value, dtype=float)
                yield path, float(numbers.mean()) if numbers.size else np.nan
                if name == "residual_entries":
                    yield RESIDUAL_HEADS, float((numbers > 0).mean()) if numbers.size else np.nan
        else:
            yield path, value


def _sample_rows(result: TaskResult) -> Iterator[dict[str, Any]]:
    configuration = configuration_columns(result.key)
    for index in sorted(result.samples):
        fields = dict(_scalar_fields(result.samples[index]))
        yield {**configuration, "index": index, "score": None, "skipped": None} | fields


def _task_score(group: pd.DataFrame) -> float:
    scores = group["score"].dropna()
    return benchmarks.task_score(group.name[1], scores.tolist()) if len(scores) else np.nan


def _bucket_scores(group: pd.DataFrame) -> pd.Series:
    """LongBench-E's ``scorer_e`` per length bucket (``score_0-4k`` ...), from the scored samples'
    ``length`` (``benchmarks.longbench_e``); other benchmarks have no buckets."""
    scored = group[group["score"].notna()]
    buckets = dict.fromkeys(BUCKETS)
    if group.name[1] == "longbench-e" and not scored.empty:
        buckets = bucket_scores(scored["metadata.length"].tolist(), scored["score"].tolist())
    return pd.Series({f"score_{name}": value for name, value in buckets.items()}, dtype=float)


def _configs(samples: pd.DataFrame, results: list[TaskResult]) -> pd.DataFrame:
    """One row per configuration: sample counts, task score, status and per-sample means."""
    totals = pd.DataFrame(
        [{**asdict(result.key), "samples_total": result.samples_total} for result in results],
        columns=[*KEY_COLUMNS, "samples_total"],
    )
    if samples.empty:
        return pd.DataFrame(columns=CONFIG_COLUMNS)
    groups = samples.groupby(KEY_COLUMNS, dropna=False, sort=False)
    scored = samples[samples["score"].notna()]
    numeric = [
        column
        for column in samples.select_dtypes("number").columns
        if column not in ("length", "ratio", "index", "score")
    ]
    means = scored.groupby(KEY_COLUMNS, dropna=False, sort=False)[numeric].mean().add_prefix("mean_")
    configs = pd.concat(
        [
            groups[LABEL_COLUMNS].first(),
            groups.size().rename("n_recorded"),
            groups["score"].count().rename("n_samples"),
            groups.apply(_task_score, include_groups=False).rename("score"),
            groups.apply(_bucket_scores, include_groups=False),
            means,
        ],
        axis=1,
    ).reset_index()
    configs["n_skipped"] = configs["n_recorded"] - configs["n_samples"]
    configs = configs.merge(totals, on=KEY_COLUMNS, how="left")
    most = configs[["samples_total", "n_recorded"]].max(axis=1)
    configs["task_samples"] = most.groupby([configs[column] for column in TASK_COLUMNS]).transform("max")
    configs["status"] = np.where(configs["n_recorded"] < configs["task_samples"], "partial", "complete")
    buckets = [
        column for column in configs.columns if column.startswith("score_") and configs[column].notna().any()
    ]
    return configs[CONFIG_COLUMNS + buckets + list(means.columns)]


def load_frames(results_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The samples and configurations frames of ``<results_dir>/runs``, and load warnings."""
    return frames_from_runs(Path(results_dir) / "runs")


def samples_frame(results_dir: str | Path) -> pd.DataFrame:
    """One row per configuration and sample of ``<results_dir>/runs``."""
    return load_frames(results_dir)[0]


def configs_frame(results_dir: str | Path) -> pd.DataFrame:
    """One row per configuration (and per unavailable task) of ``<results_dir>/runs``."""
    return load_frames(results_dir)[1]


def frames_from_runs(runs_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``load_frames`` of the runs directory itself."""
    results, unavailable, warnings = load_results(runs_dir)
    return (*frames_from_results(results, unavailable), warnings)


def frames_from_results(
    results: list[TaskResult], unavailable: list[dict[str, Any]]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The samples and configurations frames of results already read (``load_results``)."""
    rows = [row for result in results for row in _sample_rows(result)]
    samples = pd.DataFrame(rows or None, columns=None if rows else SAMPLE_COLUMNS)
    samples["score"] = samples["score"].astype(float)
    configs = _configs(samples, results)
    missing = pd.DataFrame(
        [
            {
                **{column: entry[column] for column in TASK_COLUMNS},
                "status": "unavailable",
                "reason": entry["reason"],
            }
            for entry in unavailable
        ],
        columns=[*TASK_COLUMNS, "status", "reason"],
    )
    configs = pd.concat([configs, missing], ignore_index=True) if len(missing) else configs
    counts = ["n_samples", "n_skipped", "n_recorded", "samples_total", "task_samples"]
    configs[counts] = configs[counts].astype("Int64")  # integers, empty on unavailable rows
    return samples, configs


LAYER_MEASURES = ("attention_error", "residual_share")  # reskv.quality's per-layer lists
HEAD_STATS = ("main_slots", "residual_slots", "residual_entries")  # cache_stats per layer and KV head


def _expanded_frame(results: list[TaskResult], expand, columns: list[str]) -> pd.DataFrame:
    """Rows ``expand(record)`` yields for every sample record (dicts of ``columns``), each with its
    configuration and sample index in front."""
    rows = [
        {**configuration_columns(result.key), "index": index, **row}
        for result in results
        for index, record in sorted(result.samples.items())
        for row in expand(record)
    ]
    return pd.DataFrame(rows, columns=[*KEY_COLUMNS, *LABEL_COLUMNS, "index", *columns])


def _layer_rows(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    quality = record.get("quality") or {}
    columns = [quality.get(f"{name}_by_layer") for name in LAYER_MEASURES]
    if any(column is None for column in columns):
        return
    for layer, values in enumerate(zip(*columns, strict=True)):
        yield {"layer": layer, **dict(zip(LAYER_MEASURES, values, strict=True))}


def layers_frame(results: list[TaskResult]) -> pd.DataFrame:
    """One row per configuration, sample and layer with the quality measures' per-layer values
    (``attention_error``, ``residual_share``; ``reskv.quality``), for samples that carry them;
    ``results`` as ``scripts.harness.store.load_results`` reads them."""
    return _expanded_frame(results, _layer_rows, ["layer", *LAYER_MEASURES])


def _head_rows(record: dict[str, Any]) -> Iterator[dict[str, Any]]:
    stats = record.get("cache_stats") or {}
    if not stats.get("compressed"):
        return
    # Empty for a method without ResKV, and in files written before the choice was recorded.
    choices = stats.get("residual_choice") or [[np.nan] * len(layer) for layer in stats["main_slots"]]
    for layer, per_head in enumerate(zip(*(stats[name] for name in HEAD_STATS), choices, strict=True)):
        for head, (*values, choice) in enumerate(zip(*per_head, strict=True)):
            yield {
                "layer": layer,
                "head": head,
                "budget": stats["budget"],
                **dict(zip(HEAD_STATS, values, strict=True)),
                "residual_choice": choice,
            }


def heads_frame(results: list[TaskResult]) -> pd.DataFrame:
    """One row per compressing configuration, sample, layer and KV head: its ``budget``,
    ``main_slots``, the ``residual_slots`` the proxy chose, the ``residual_entries`` built and
    the grid ratio ``r`` came from (``residual_choice``, empty where not recorded); ``results`` as
    ``scripts.harness.store.load_results`` reads them."""
    return _expanded_frame(results, _head_rows, ["layer", "head", "budget", *HEAD_STATS, "residual_choice"])


def as_written(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame as its CSV file holds it: the label in the column ``method`` (as result files store
    it), the name left out."""
    return frame.drop(columns="method").rename(columns={"label": "method"})


def write_frames(samples: pd.DataFrame, configs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """``samples.csv`` and ``results.csv`` (the configurations) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "samples.csv", out_dir / "results.csv"]
    for frame, path in zip((samples, configs), paths, strict=True):
        as_written(frame).to_csv(path, index=False)
    return paths
