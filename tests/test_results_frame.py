"""The results DataFrames on hand-written result files: every expected value is computed here by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scripts.harness.store import SCHEMA, UNAVAILABLE_SCHEMA, ResultKey
from scripts.report.frames import configs_frame, load_frames, samples_frame, write_frames

BACKBONE = "tiny-llama"


def sample(index: int, score: float | None, **fields) -> dict:
    return {"index": index, "score": score, "prediction": f"answer {index}", "references": ["x"], **fields}


def write(runs: Path, key: ResultKey, samples: list[dict], samples_total: int) -> None:
    path = key.path(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"schema": SCHEMA, "key": key.to_json(), "samples_total": samples_total, "samples": samples}
    path.write_text(json.dumps(document))


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("results")
    runs = root / "runs"
    reskv = ResultKey(BACKBONE, "ruler", 1024, "vt", "aware", "snapkv+reskv~validate=false", 0.9)
    write(
        runs,
        reskv,
        [
            sample(
                0,
                1.0,
                cache_stats={
                    "budget": 10,
                    "main_slots": [[8, 6], [10, 4]],
                    "residual_entries": [[2, 4], [0, 6]],
                },
                timings={"decode_s": 0.5, "prefill_shared_by": 3},
                answer_logprob=-1.5,
                prompt_tokens=100,
                quality={"kl": 0.25},
            ),
            sample(
                1,
                0.5,
                timings={"decode_s": 1.5, "prefill_shared_by": 3},
                answer_logprob=-0.5,
                prompt_tokens=200,
            ),
            sample(2, None, skipped="prompt past max positions", prompt_tokens=900),
        ],
        samples_total=3,
    )
    write(runs, ResultKey(BACKBONE, "ruler", 1024, "vt", None, "full", None), [sample(0, 1.0)], 3)
    write(
        runs,
        ResultKey(BACKBONE, "ruler", 1024, "niah_single_1", "agnostic", "tova", 0.6),
        [sample(0, 1.0), sample(1, 0.0), sample(2, 1.0)],
        samples_total=3,
    )
    write(
        runs,
        ResultKey(BACKBONE, "ruler", 1024, "niah_single_1", "agnostic", "tova+reskv", 0.6),
        [sample(0, 1.0), sample(1, 1.0)],
        samples_total=2,
    )
    marker = runs / BACKBONE / "ruler-1024" / "qa_1" / "unavailable.json"
    marker.parent.mkdir(parents=True)
    unavailable = {"benchmark": "ruler", "length": 1024, "task": "qa_1", "reason": "SQuAD not found"}
    marker.write_text(json.dumps({"schema": UNAVAILABLE_SCHEMA, "backbone": BACKBONE, **unavailable}))
    return root


@pytest.fixture(scope="module")
def frames(results_dir):
    samples, configs, warnings = load_frames(results_dir)
    assert warnings == []
    return samples, configs


def test_samples_frame_has_one_row_per_configuration_and_sample(frames):
    samples, _ = frames
    assert len(samples) == 3 + 1 + 3 + 2
    rows = samples[samples["label"] == "snapkv+reskv~validate=false"].set_index("index")
    assert rows.loc[0, ["method", "base_method", "residual", "options"]].tolist() == [
        "snapkv+reskv",
        "snapkv",
        True,
        "validate=false",
    ]
    assert rows["score"].tolist()[:2] == [1.0, 0.5] and math.isnan(rows.loc[2, "score"])
    assert rows.loc[2, "skipped"] == "prompt past max positions" and rows.loc[0, "skipped"] is None
    # Nested fields by JSON path; the per-layer/head cache statistics as their mean.
    assert rows.loc[0, "timings.decode_s"] == 0.5 and rows.loc[1, "timings.decode_s"] == 1.5
    assert rows.loc[0, "cache_stats.main_slots"] == (8 + 6 + 10 + 4) / 4
    assert rows.loc[0, "cache_stats.residual_entries"] == (2 + 4 + 0 + 6) / 4
    assert rows.loc[0, "cache_stats.budget"] == 10
    # Quality measures the runner may add (top level or nested) come through as columns.
    assert rows.loc[0, "answer_logprob"] == -1.5 and rows.loc[0, "quality.kl"] == 0.25
    assert math.isnan(rows.loc[1, "quality.kl"])
    # Lists other than cache statistics (references, token ids) are not columns.
    assert "references" not in samples.columns
    full = samples[samples["label"] == "full"].iloc[0]
    assert full["setting"] is None and math.isnan(full["ratio"])
    assert full[["method", "base_method", "residual", "options"]].tolist() == ["full", "full", False, ""]


def test_configs_frame_counts_scores_and_status(frames):
    _, configs = frames
    by_method = configs.set_index("label")
    reskv = by_method.loc["snapkv+reskv~validate=false"]
    # Task score over the two scored samples: (1.0 + 0.5) / 2 * 100; the skipped one is counted apart.
    assert reskv["score"] == 75.0
    assert (reskv["n_samples"], reskv["n_skipped"], reskv["n_recorded"], reskv["samples_total"]) == (
        2,
        1,
        3,
        3,
    )
    assert reskv["mean_timings.decode_s"] == (0.5 + 1.5) / 2
    assert reskv["mean_answer_logprob"] == (-1.5 + -0.5) / 2
    assert reskv["mean_prompt_tokens"] == (100 + 200) / 2  # means over the scored samples only
    assert reskv["status"] == "complete"
    # The full cache ran 1 of vt's 3 samples: partial.
    assert (by_method.loc["full", "n_recorded"], by_method.loc["full", "status"]) == (1, "partial")
    # TOVA ran 3 samples, its +ResKV pair 2 (a complete file of 2): the pair is partial next to it.
    assert by_method.loc["tova", "task_samples"] == 3 and by_method.loc["tova", "status"] == "complete"
    assert by_method.loc["tova", "score"] == round(2 / 3 * 100, 2)
    assert by_method.loc["tova+reskv", "status"] == "partial"
    unavailable = configs[configs["status"] == "unavailable"]
    assert unavailable[["task", "reason"]].values.tolist() == [["qa_1", "SQuAD not found"]]
    assert unavailable[["label", "method"]].isna().all().all()


def test_single_frame_loaders_equal_load_frames(results_dir, frames):
    samples, configs = frames
    assert samples_frame(results_dir).equals(samples)
    assert configs_frame(results_dir).equals(configs)


def test_frames_written_as_csv(frames, tmp_path):
    samples, configs = frames
    paths = write_frames(samples, configs, tmp_path)
    assert [path.name for path in paths] == ["samples.csv", "results.csv"]
    header, *rows = (tmp_path / "results.csv").read_text().splitlines()
    assert header.startswith(
        "backbone,benchmark,length,task,setting,method,ratio,base_method,residual,options"
    )
    assert len(rows) == 4 + 1  # four configurations and the unavailable task
    assert len((tmp_path / "samples.csv").read_text().splitlines()) == 1 + 9


def test_empty_results_directory_gives_empty_frames(tmp_path):
    samples, configs, warnings = load_frames(tmp_path)
    assert samples.empty and configs.empty and warnings == []
    assert {"method", "score", "index"} <= set(samples.columns)
    assert {"method", "score", "status", "n_samples"} <= set(configs.columns)


def test_longbench_e_configurations_get_scorer_e_bucket_scores(tmp_path):
    runs = tmp_path / "runs"
    key = ResultKey(BACKBONE, "longbench-e", 8192, "qasper", "aware", "snapkv", 0.9)
    # lengths 3999 / 4000 / 7999 / 8000 / 12000: buckets 0-4k, 4-8k, 4-8k, 8k+, 8k+ (scorer_e's bounds).
    lengths_scores = [(3999, 0.5), (4000, 1.0), (7999, 0.0), (8000, 0.25), (12000, 1.0)]
    write(runs, key, [sample(i, s, metadata={"length": n}) for i, (n, s) in enumerate(lengths_scores)], 5)
    other = ResultKey(BACKBONE, "ruler", 1024, "vt", "aware", "snapkv", 0.9)
    write(runs, other, [sample(0, 1.0)], 1)
    configs = configs_frame(tmp_path).set_index("benchmark")
    assert configs.loc["longbench-e", "score_0-4k"] == 50.0
    assert configs.loc["longbench-e", "score_4-8k"] == 50.0  # mean(1.0, 0.0)
    assert configs.loc["longbench-e", "score_8k+"] == 62.5  # mean(0.25, 1.0)
    assert math.isnan(configs.loc["ruler", "score_0-4k"])
