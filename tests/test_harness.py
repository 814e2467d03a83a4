"""run.py and its runner: config validation, grid expansion, shared prefill, result files.

The end-to-end tests use the tiny random backbone (``tiny-llama``) with short RULER prompts and a
cap on answer lengths; their predictions are noise, which is all the plumbing needs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from baselines import build_method
from baselines.registry import OPTIONS, SPECS, MethodOption
from reskv.backbones import load_backbone
from reskv.compress import ResidualConfig
from reskv.engine import Prefill
from reskv.stats import SECTIONS, fields, occasional
from scripts.harness.grid import load_task_items, run_plan
from scripts.harness.plan import PlanError, build_grid, compose_plan, method_label
from scripts.harness.records import MethodLabel, SampleRecord
from scripts.harness.store import (
    SCHEMA,
    ResultFile,
    ResultKey,
    ResultStoreError,
    deterministic_view,
    load_results,
    total_timings,
)
from scripts.report.index import ResultIndex
from scripts.report.paper_tables import ABLATIONS

REPO = Path(__file__).resolve().parent.parent
TINY_RULER = ["backbone=tiny-llama", "benchmark.length=1024", "max_new_tokens=8"]


def plan_for(overrides: list[str], results_dir: Path, ruler_cache: Path | None = None):
    """The plan run.py would build for these command-line overrides."""
    extra = [f"results_dir={results_dir}"]
    if ruler_cache is not None:
        extra.append(f"benchmark.options.cache_dir={ruler_cache}")
    return compose_plan(overrides + extra)


def final_files(results_dir: Path) -> dict[str, dict]:
    runs = results_dir / "runs"
    return {
        str(path.relative_to(runs)): json.loads(path.read_text()) for path in sorted(runs.rglob("*.json"))
    }


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("method=nope", ["unknown method 'nope'", "snapkv+reskv", "adakv"]),
        ("method=[snapkv,snapkv+resk]", ["unknown method 'snapkv+resk'", "'full'"]),
        ("ratio=1.5", ["ratio 1.5", "strictly between 0 and 1"]),
        ("ratio=[0.6,0]", ["ratio 0 ", "strictly between 0 and 1"]),
        ("benchmark.tasks=[niah_single_1,nope]", ["unknown ruler task 'nope'", "niah_single_1", "fwe"]),
        ("setting=sideways", ["unknown setting 'sideways'", "aware", "agnostic"]),
        ("num_samples=0", ["num_samples 0"]),
        ("reskv.final_selection=best", ["final_selection 'best'", "base", "fit"]),
        ("reskv.validate=maybe", ["option validate takes true or false, got 'maybe'"]),
        ("reskv.alpha=high", ["option alpha takes a float, got 'high'"]),
        ("h2o_window_only=1", ["option h2o_window_only takes true or false, got 1"]),
        ("backbone.quality=sometimes", ["backbone.quality 'sometimes'", "true or false"]),
        (
            "method=['snapkv~validate=false']",
            ["'snapkv~validate=false'", "ResKV options ['validate']", "+reskv"],
        ),
        ("method=['snapkv+reskv~nope=1']", ["unknown reskv option(s) ['nope']", "validate"]),
        ("method=['snapkv+reskv~validate']", ["'validate'", "name=value"]),
        ("method=['tova~h2o_window_only=true']", ["h2o_window_only applies to h2o"]),
    ],
)
def test_bad_overrides_fail_with_the_valid_choices(override, expected, tmp_path):
    with pytest.raises(PlanError) as error:
        plan_for([override], tmp_path)
    for text in expected:
        assert text in str(error.value)


def test_cli_fails_fast_on_bad_values(tmp_path):
    for override, expected in (("method=nope", "choose from ['full'"), ("backbone=nope", "tiny-llama")):
        result = subprocess.run(
            [sys.executable, "run.py", override, f"results_dir={tmp_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode != 0
        assert expected in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()


def test_paper_command_lines_make_plans(tmp_path):
    plan = plan_for(["method=snapkv+reskv", "ratio=0.9"], tmp_path)
    assert [(entry.method, entry.ratio, entry.setting) for entry in plan.grid] == [
        ("snapkv+reskv", 0.9, "aware")
    ]
    plan = plan_for(["method=[snapkv,snapkv+reskv]", "ratio=[0.6,0.9]", "setting=[aware,agnostic]"], tmp_path)
    assert len(plan.grid) == 8
    plan = plan_for(["grid=paper_ruler", "benchmark=ruler-32k", "backbone=llama3.1-8b-instruct"], tmp_path)
    assert (plan.length, len(plan.tasks), len(plan.grid)) == (32768, 13, 1 + 9 * 4 * 2)
    plan = plan_for(["grid=paper_longbench", "backbone=qwen2.5-7b-instruct"], tmp_path)
    assert (plan.benchmark, plan.length, len(plan.tasks)) == ("longbench", 31500, 16)


def test_full_cache_is_one_grid_entry():
    grid = build_grid(["full", "snapkv"], [0.6, 0.9], ["aware", "agnostic"], ResidualConfig(), {})
    assert [(entry.method, entry.ratio, entry.setting) for entry in grid] == [
        ("full", None, None),
        ("snapkv", 0.6, "aware"),
        ("snapkv", 0.9, "aware"),
        ("snapkv", 0.6, "agnostic"),
        ("snapkv", 0.9, "agnostic"),
    ]


def test_method_labels_name_non_default_options(tmp_path):
    assert method_label("snapkv+reskv", ResidualConfig(), {}) == "snapkv+reskv"
    assert method_label("snapkv", ResidualConfig(validate=False), {"h2o_window_only": True}) == "snapkv"
    assert method_label("h2o", ResidualConfig(), {"h2o_window_only": True}) == "h2o~h2o_window_only=true"
    assert (
        method_label("snapkv+reskv", ResidualConfig(tau=0.3, grid=(0.0, 0.1)), {})
        == "snapkv+reskv~grid=0-0.1,tau=0.3"
    )
    # The ablation presets give exactly the labels the ablation table looks for.
    labels = ("", "~validate=false", "~gate=false", "~shared_softmax=false")
    for preset, (_, options), suffix in zip(
        ("none", "no_validation", "no_gate", "no_shared_softmax"), ABLATIONS, labels, strict=True
    ):
        plan = plan_for([f"ablation={preset}", "method=snapkv+reskv"], tmp_path)
        assert plan.grid[0].label == "snapkv+reskv" + suffix == str(MethodLabel("snapkv+reskv", options))


def _result_file(tmp_path: Path, config: dict | None = None, samples_total: int = 3) -> ResultFile:
    key = ResultKey("tiny-llama", "ruler", 1024, "vt", "aware", "snapkv", 0.9)
    return ResultFile(
        tmp_path,
        key,
        (0, samples_total),
        samples_total,
        config or {"seed": 42},
        lambda scores: round(100 * sum(scores) / len(scores), 2),
    )


def _record(index: int) -> dict:
    return {
        "index": index,
        "prompt_digest": "d",
        "prompt_tokens": 10,
        "generated_tokens": 2,
        "score": 1.0,
        "timings": {"decode_s": 0.1 * (index + 1)},
    }


def journal_lines(result: ResultFile) -> list[dict]:
    """A journal as it is on disk: the header, then the records, each line whole (JSON ending in a
    newline); a cut-off line left in place or a record glued onto it fails here."""
    data = result.journal_path.read_bytes()
    assert data.endswith(b"\n")
    lines = [json.loads(line) for line in data.split(b"\n")[:-1]]
    assert lines[0]["schema"] == SCHEMA and "index" not in lines[0]
    return lines


def test_result_file_survives_a_cut_line_and_refuses_duplicates(tmp_path):
    result = _result_file(tmp_path).open()
    result.append(_record(0))
    with pytest.raises(ResultStoreError, match="already"):
        result.append(_record(0))
    result.close()
    with result.journal_path.open("ab") as journal:  # what kill -9 in the middle of a write leaves
        journal.write(b'{"index": 1, "prompt_dig')
    resumed = _result_file(tmp_path).open()
    assert resumed.pending == [1, 2]
    assert [line.get("index") for line in journal_lines(resumed)] == [None, 0]  # the cut line is gone
    resumed.append(_record(1))
    assert journal_lines(resumed)[1:] == [_record(0), _record(1)]  # not glued onto the cut line
    resumed._journal.close()  # interrupted again, in the middle of the next record
    with result.journal_path.open("ab") as journal:
        journal.write(b'{"index": 2, "sco')
    resumed = _result_file(tmp_path).open()
    assert resumed.pending == [2]
    assert journal_lines(resumed)[1:] == [_record(0), _record(1)]
    resumed.append(_record(2))
    assert journal_lines(resumed)[1:] == [_record(0), _record(1), _record(2)]
    document = resumed.close()
    assert not resumed.journal_path.exists()
    assert [sample["index"] for sample in document["samples"]] == [0, 1, 2]
    assert json.loads(resumed.path.read_text()) == document
    assert document["summary"]["score"] == 100.0 and document["timings"]["decode_s"] == pytest.approx(0.6)


def test_file_totals_sum_seconds_and_tokens_never_counts():
    """A file's ``timings`` add up the declared seconds and tokens; a count (a batch's rows, the
    configurations that shared the prefills) is never summed, whether a sample files it under
    ``run`` or, as files written before that section did, under ``timings``."""
    counts = {"prefill_shared_by": 3, "decode_batch": 2}
    new = {"score": 1.0, "timings": {"prefill_s": 3.0, "decode_s": 0.5, "decode_tokens": 4}, "run": counts}
    old = {"score": 0.0, "timings": {"prefill_s": 6.0, "question_prefill_s": 3.0, "decode_s": 1.5}}
    old["timings"] |= {"decode_tokens": 6, **counts}
    # Own share of the shared prefills: 3 / 3 + (6 + 3) / 3.
    assert total_timings([new, old]) == {
        "decode_s": 2.0,
        "decode_tokens": 10,
        "prefill_s": 9.0,
        "prefill_s_own_share": 4.0,
        "question_prefill_s": 3.0,
    }


def test_result_file_refuses_another_configuration_and_a_second_writer(tmp_path):
    first = _result_file(tmp_path).open()
    with pytest.raises(ResultStoreError, match="another process"):
        _result_file(tmp_path).open()
    first.close()
    with pytest.raises(ResultStoreError, match=r"another configuration \(differs in \['seed'\]\)"):
        _result_file(tmp_path, {"seed": 7}).open()


def test_finished_file_is_skipped_and_extended_on_more_samples(tmp_path):
    result = _result_file(tmp_path, samples_total=2).open()
    for index in range(2):
        result.append(_record(index))
    result.close()
    text = result.path.read_text()
    again = _result_file(tmp_path, samples_total=2).open()
    assert again.pending == [] and again.close() is None
    assert result.path.read_text() == text and not again.journal_path.exists()
    more = _result_file(tmp_path, samples_total=3).open()
    assert more.pending == [2]
    assert journal_lines(more)[0]["sample_range"] == [0, 3]
    assert journal_lines(more)[1:] == [_record(0), _record(1)]  # the finished file's samples, carried on
    more.append(_record(2))
    assert journal_lines(more)[1:] == [_record(0), _record(1), _record(2)]
    assert [sample["index"] for sample in more.close()["samples"]] == [0, 1, 2]


def test_an_option_added_with_a_default_leaves_earlier_results_resumable(tmp_path, monkeypatch):
    """A run of H2O, interrupted; H2O then gains an option with a default: the same command resumes
    the earlier file (the identity, like the label, names only options that differ from defaults)."""
    plan = plan_for(["method=h2o", "ratio=0.9", "setting=aware"], tmp_path)
    (entry,) = plan.grid

    def result_file() -> ResultFile:
        identity = plan.identity(entry, "float32")
        return ResultFile(plan.runs_dir, entry.key(plan, "vt"), (0, 2), 2, identity, lambda scores: 0.0)

    earlier = result_file().open()
    earlier.append(_record(0))
    earlier.close()
    added = MethodOption("h2o_sinks", 0, "sinks", "attention sinks kept besides the window")
    monkeypatch.setitem(
        SPECS, "h2o", dataclasses.replace(SPECS["h2o"], options=(*SPECS["h2o"].options, added))
    )
    monkeypatch.setitem(OPTIONS, added.name, added)
    assert plan.identity(entry, "float32")["method_options"] == {}
    resumed = result_file().open()
    assert resumed.pending == [1]
    assert [line.get("index") for line in journal_lines(resumed)] == [None, 0]


def test_a_file_that_stored_every_option_resumes_and_a_differing_option_is_refused(tmp_path):
    """Files written when the identity held every option with its default resume; an option stored
    with another value than the run's is still another configuration."""
    plan = plan_for(["method=snapkv+reskv", "ratio=0.9", "setting=aware"], tmp_path)
    (entry,) = plan.grid
    identity = plan.identity(entry, "float32")
    assert identity["method_options"] == {}
    defaults = dataclasses.asdict(ResidualConfig())
    every = {name: list(value) if isinstance(value, tuple) else value for name, value in defaults.items()}
    for options, refused in ((every, False), ({**every, "tau": 0.3}, True)):
        result = _result_file(tmp_path, {**identity, "method_options": options}, samples_total=2).open()
        result.append(_record(0))
        result.close()
        resumed = _result_file(tmp_path, identity, samples_total=2)
        if refused:
            with pytest.raises(ResultStoreError, match=r"differs in \['method_options'\]"):
                resumed.open()
        else:
            assert resumed.open().pending == [1]
            resumed.close()
        result.journal_path.unlink()


@pytest.fixture(scope="module")
def ruler_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ruler-cache")


def test_grid_and_one_configuration_at_a_time_predict_the_same(tmp_path, ruler_cache):
    """One shared prefill for the whole grid gives each configuration what its own prefill gives."""
    backbone = load_backbone("tiny-llama")
    grid_overrides = [
        *TINY_RULER,
        "benchmark.tasks=[vt]",
        "num_samples=1",
        "method=[full,snapkv,snapkv+reskv]",
        "ratio=[0.6,0.9]",
        "setting=[aware,agnostic]",
    ]
    grid_plan = plan_for(grid_overrides, tmp_path / "grid", ruler_cache)
    run_plan(grid_plan, backbone)
    grid_files = final_files(tmp_path / "grid")
    assert len(grid_files) == 9
    for method, ratio, setting in (
        ("snapkv+reskv", 0.9, "agnostic"),
        ("snapkv", 0.6, "aware"),
        ("full", 0.6, "aware"),
    ):
        single = plan_for(
            [
                *TINY_RULER,
                "benchmark.tasks=[vt]",
                "num_samples=1",
                f"method={method}",
                f"ratio={ratio}",
                f"setting={setting}",
                "share_prefill=false",
            ],
            tmp_path / "single",
            ruler_cache,
        )
        run_plan(single, backbone)
    single_files = final_files(tmp_path / "single")
    assert len(single_files) == 3
    for name, document in single_files.items():
        grid_samples = grid_files[name]["samples"]
        for sample, grid_sample in zip(document["samples"], grid_samples, strict=True):
            assert sample["prediction_token_ids"] == grid_sample["prediction_token_ids"]
            assert deterministic_view(sample) == deterministic_view(grid_sample)


@pytest.mark.parametrize("switch", [True, False])
def test_quality_measures_are_recorded_when_the_backbone_switch_is_on(tmp_path, ruler_cache, switch):
    overrides = [*TINY_RULER, "benchmark.tasks=[vt]", "num_samples=1", "method=snapkv", "ratio=0.6"]
    plan = plan_for([*overrides, f"backbone.quality={str(switch).lower()}"], tmp_path, ruler_cache)
    assert plan.quality is switch
    run_plan(plan, load_backbone("tiny-llama"))
    (document,) = final_files(tmp_path).values()
    (sample,) = document["samples"]
    assert ("quality" in sample) is switch
    assert ("quality_s" in sample["timings"]) is switch
    if switch:
        assert sample["quality"]["kl"] > 0
        assert len(sample["quality"]["attention_error_by_layer"]) == 2  # tiny-llama's layers


def test_a_generated_record_holds_exactly_the_declared_fields(tmp_path, ruler_cache):
    """The sections of the sample records a run writes hold the fields ``reskv.stats`` declares and
    no other: an undeclared field, or a count filed among the timings, fails here. The occasional
    ones (a batch split for memory, a compiled batch decoded eagerly) are written when they happen
    (tests/test_grid_decode.py)."""
    overrides = [*TINY_RULER, "benchmark.tasks=[vt]", "num_samples=1", "method=[full,snapkv,snapkv+reskv]"]
    overrides += ["ratio=0.6", "setting=[aware,agnostic]", "decode_batch=2", "backbone.quality=true"]
    plan = plan_for(overrides, tmp_path, ruler_cache)
    backbone = load_backbone("tiny-llama")
    run_plan(plan, backbone)
    found = {section: set() for section in SECTIONS}
    for document in final_files(tmp_path).values():
        for sample in document["samples"]:
            for section in SECTIONS:  # every generated sample has every section here
                found[section] |= set(sample[section])
    # The runner keeps the full cache; a prefill that compresses as it runs times its whole prompt.
    item = load_task_items(plan, backbone.tokenizer)["vt"][0]
    method = build_method("snapkv", 0.6)
    prefill = Prefill(backbone, item.prompt_ids, item.context_length, [method], retain="compressed")
    found["timings"] |= set(prefill.generate(method, "aware", max_new_tokens=1).timings) | set(
        prefill.timings
    )
    assert found == {section: set(fields(section)) - set(occasional(section)) for section in SECTIONS}
    assert set(occasional("run")) == {"out_of_memory_splits", "compile_fallback"}


def test_a_method_with_options_in_the_grid_equals_its_own_ablation_run(tmp_path, ruler_cache):
    """``method=[..., 'snapkv+reskv~validate=false']`` shares the grid's prefill and files exactly
    what ``ablation=no_validation`` run alone files (same label, identity and samples)."""
    common = [*TINY_RULER, "benchmark.tasks=[vt]", "num_samples=1", "ratio=0.9", "setting=agnostic"]
    combined = plan_for(
        [*common, "method=[snapkv+reskv,'snapkv+reskv~validate=false',h2o,'h2o~h2o_window_only=true']"],
        tmp_path / "combined",
        ruler_cache,
    )
    labels = [entry.label for entry in combined.grid]
    assert labels == ["snapkv+reskv", "snapkv+reskv~validate=false", "h2o", "h2o~h2o_window_only=true"]
    alone = plan_for(
        [*common, "method=snapkv+reskv", "ablation=no_validation"], tmp_path / "alone", ruler_cache
    )
    assert combined.identity(combined.grid[1], "float32") == alone.identity(alone.grid[0], "float32")
    backbone = load_backbone("tiny-llama")
    run_plan(combined, backbone)
    run_plan(alone, backbone)
    combined_files, alone_files = final_files(tmp_path / "combined"), final_files(tmp_path / "alone")
    (name,) = alone_files
    assert "snapkv+reskv~validate=false" in name
    for sample, other in zip(combined_files[name]["samples"], alone_files[name]["samples"], strict=True):
        assert deterministic_view(sample) == deterministic_view(other)


def test_unavailable_task_is_marked_not_scored(tmp_path, ruler_cache):
    qa_missing = "benchmark.options.qa_data_dir=" + str(tmp_path)
    plan = plan_for([*TINY_RULER, "benchmark.tasks=[vt,qa_1]", qa_missing], tmp_path, ruler_cache)
    backbone = load_backbone("tiny-llama")
    assert list(load_task_items(plan, backbone.tokenizer)) == ["vt"]
    index = ResultIndex.from_directory(plan.runs_dir)[0]
    assert ("tiny-llama", "ruler", 1024, "qa_1") in index.unavailable
    # With every requested task unavailable there is nothing to run: the run stops and says why.
    only_qa = plan_for([*TINY_RULER, "benchmark.tasks=[qa_1]", qa_missing], tmp_path, ruler_cache)
    unavailable = r"every requested ruler task is unavailable here; qa_1: .*qa_data_dir="
    with pytest.raises(PlanError, match=unavailable):
        load_task_items(only_qa, backbone.tokenizer)


def test_shards_write_separate_files_that_merge_into_the_whole(tmp_path, ruler_cache):
    backbone = load_backbone("tiny-llama")
    one_config = [*TINY_RULER, "benchmark.tasks=[vt]", "num_samples=3", "method=snapkv", "ratio=0.9"]
    run_plan(plan_for(one_config, tmp_path / "whole", ruler_cache), backbone)
    for index in range(2):
        run_plan(
            plan_for(
                [*one_config, "shard.count=2", f"shard.index={index}"], tmp_path / "shards", ruler_cache
            ),
            backbone,
        )
    assert sorted(final_files(tmp_path / "shards")) == [
        "tiny-llama/ruler-1024/vt/aware/snapkv/0.9.samples-0-1.json",
        "tiny-llama/ruler-1024/vt/aware/snapkv/0.9.samples-1-3.json",
    ]
    (whole,), _, _ = load_results(tmp_path / "whole" / "runs")
    (merged,), _, warnings = load_results(tmp_path / "shards" / "runs")
    assert merged.complete and warnings == []
    assert deterministic_view(merged.samples) == deterministic_view(whole.samples)


def test_a_different_configuration_is_never_resumed(tmp_path, ruler_cache):
    backbone = load_backbone("tiny-llama")
    one_config = [*TINY_RULER, "benchmark.tasks=[vt]", "num_samples=1", "method=snapkv", "ratio=0.9"]
    run_plan(plan_for(one_config, tmp_path, ruler_cache), backbone)
    with pytest.raises(ResultStoreError, match="another configuration"):
        run_plan(plan_for([*one_config, "max_new_tokens=4"], tmp_path, ruler_cache), backbone)


def test_a_record_written_before_the_run_section_named_its_rows_batch_rows_reads_under_that_name():
    """Files written before held a batch's rows as ``run.decode_batch`` (the option's name, which is
    the cap); they load with the rows under ``batch_rows``, and a record is written back that way."""
    written = {
        "index": 0,
        "prompt_digest": "d",
        "prompt_tokens": 10,
        "context_tokens": 8,
        "max_new_tokens": 2,
        "references": ["a"],
        "metric": "m",
        "metadata": {},
        "score": 1.0,
        "run": {"decode": "compiled", "decode_batch": 4, "prefill_shared_by": 13},
    }
    record = SampleRecord.from_json(written)
    assert record.run == {"decode": "compiled", "batch_rows": 4, "prefill_shared_by": 13}
    assert record.to_json()["run"] == {"decode": "compiled", "batch_rows": 4, "prefill_shared_by": 13}
    assert "batch_rows" in fields("run") and "decode_batch" not in fields("run")
