"""``scripts.bench.grid_replay`` on the tiny random backbone: a "committed" run decoded one configuration
at a time, eagerly, each with its own prefill, then replayed compiled in one batch per sample; equal
records are reported equal, a token planted in the committed file is reported at its step, and a
statistic planted there is reported with the lone construction here equal to the replay's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reskv.backbones import load_backbone
from scripts.bench.grid_replay import replay
from scripts.harness.grid import run_plan
from scripts.harness.plan import compose_plan

pytestmark = pytest.mark.slow  # a compiled step: a compilation of tens of seconds on CPU

STEP = 3  # where the planted token goes


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[str], Path]:
    """The "committed" results directory, the invocation and the ``--out`` of one replay of it."""
    root = tmp_path_factory.mktemp("replay")
    invocation = [
        "backbone=tiny-llama",
        "benchmark.length=1024",
        "max_new_tokens=5",
        "benchmark.tasks=[vt]",
        "method=snapkv+reskv",
        "ratio=[0.6,0.9]",
        "setting=[aware,agnostic]",
        f"benchmark.options.cache_dir={root / 'ruler'}",
    ]
    alone = ["num_samples=1", "share_prefill=false", "decode=eager", "decode_batch=1"]
    plan = compose_plan([*invocation, *alone, f"results_dir={root / 'committed'}"])
    run_plan(plan, load_backbone("tiny-llama"))
    return root / "committed", invocation, root / "replayed"


def committed_file(committed: Path, setting: str, method: str, ratio: str) -> Path:
    return committed / "runs" / "tiny-llama" / "ruler-1024" / "vt" / setting / method / f"{ratio}.json"


def test_identical_records_are_reported_equal(runs):
    committed, invocation, out = runs
    report = replay(committed, [invocation], out)
    assert report["configurations"] == 4 and report["equal"] == 4 and report["differing"] == []
    # The four rows make one batch of views, decoded compiled; each row's quality measures are its own
    # cache's, as the records' decode alone computed them.
    assert report["decoded"] == {"compiled, batch of 4": 4}
    assert report["quality"] is True
    assert max(report["quality_max_abs_difference"].values()) == 0.0


def test_a_planted_token_and_a_planted_statistic_are_reported(runs):
    committed, invocation, out = runs
    planted = committed_file(committed, "agnostic", "snapkv+reskv", "0.9")
    document = json.loads(planted.read_text())
    tokens = document["samples"][0]["prediction_token_ids"]
    assert len(tokens) > STEP
    tokens[STEP] += 1
    planted.write_text(json.dumps(document))
    edited = committed_file(committed, "aware", "snapkv+reskv", "0.6")
    document = json.loads(edited.read_text())
    document["samples"][0]["cache_stats"]["budget"] += 1
    edited.write_text(json.dumps(document))

    report = replay(committed, [invocation], out)  # resumes the first test's rerun: nothing is decoded
    assert report["equal"] == 2
    token, statistic = sorted(report["differing"], key=lambda found: found["configuration"])
    assert token["configuration"] == "vt agnostic snapkv+reskv 0.9"
    assert token["step"] == STEP and token["top2_gap"] >= 0
    assert token["cache_stats_differ"] == [] and token["scores"] is None and "alone_here_equal" not in token
    assert statistic["configuration"] == "vt aware snapkv+reskv 0.6"
    assert statistic["step"] is None and statistic["cache_stats_differ"] == ["budget"]
    # The batch's construction is the one alone on this machine: the planted budget is the record's.
    assert statistic["alone_here_equal"] is True
