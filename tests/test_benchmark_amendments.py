"""The benchmark amendments of ``docs/spec/benchmarks.md``, checked against upstream.

Expectations are written from upstream's code by hand: ``THUDM/LongBench`` ``LongBench/pred.py`` (chat
template rule, samsum generation, the LongBench-E task list), ``LongBench/eval.py`` (``scorer``,
``scorer_e``, ``all_classes`` of the last line); ``NVIDIA/RULER`` ``scripts/data/template.py`` (model
templates), ``scripts/data/synthetic/niah.py`` (single-answer rewording of the wrapped template),
``scripts/eval/synthetic/constants.py`` (rounding order).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import benchmarks
from benchmarks import BenchmarkError, TaskUnavailable, longbench, longbench_e
from benchmarks.item import Item
from benchmarks.ruler import TASKS as RULER_TASKS
from benchmarks.ruler import generate_items
from benchmarks.ruler.prompt import PromptFormat
from benchmarks.ruler.templates import RULER_TEMPLATES, TEMPLATES, single_answer
from reskv.backbones import load_tokenizer

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "benchmark"
# pred.py: the tasks chat models run without build_chat.
UPSTREAM_UNTEMPLATED = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
# The paper: "except for code-completion tasks, where the native completion format is kept".
PAPER_UNTEMPLATED = {"lcc", "repobench-p"}
# pred.py's datasets when --e is given, in its order.
LONGBENCH_E_TASKS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def sample(task: str, number: int, *, length: int = 50, all_classes=None, answers=("yes",)) -> dict:
    """A sample in the official jsonl field layout."""
    return {
        "input": f"Question {number}?",
        "context": f"Context of sample {number}.",
        "answers": list(answers),
        "length": length,
        "dataset": task,
        "language": "en",
        "all_classes": all_classes,
        "_id": f"{task}-{number}",
    }


def write_jsonl(path: Path, samples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in samples), encoding="utf-8")


@pytest.fixture
def no_hub(monkeypatch):
    def unreachable():
        raise OSError("hub unreachable (test)")

    monkeypatch.setattr(longbench, "_hub_data_zip", unreachable)
    monkeypatch.delenv(longbench.DATA_ENV, raising=False)


def is_chat_templated(tokenizer, item: Item) -> bool:
    return tokenizer.decode(item.prompt_ids).startswith("<|im_start|>system\n")


# 1. LongBench chat-template rule ---------------------------------------------------------------


@pytest.mark.parametrize("template_rule", ["paper", "upstream"])
def test_longbench_chat_template_rule_per_task(tokenizer, tmp_path, template_rule):
    for task in longbench.TASKS:
        write_jsonl(tmp_path / "data" / f"{task}.jsonl", [sample(task, 0)])
    untemplated = {"paper": PAPER_UNTEMPLATED, "upstream": UPSTREAM_UNTEMPLATED}[template_rule]
    for task in longbench.TASKS:
        (item,) = longbench.load_items(
            task, tokenizer, length=4096, data_dir=tmp_path, template_rule=template_rule
        )
        prompt = longbench.DATASET2PROMPT[task].format(**sample(task, 0))
        if task in untemplated:
            expected = tokenizer(prompt)["input_ids"]
        else:
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            expected = tokenizer(chat, add_special_tokens=False)["input_ids"]
        assert item.prompt_ids == tuple(expected), (task, template_rule)
        assert is_chat_templated(tokenizer, item) == (task not in untemplated)


def test_longbench_default_rule_is_the_papers(tokenizer, tmp_path):
    write_jsonl(tmp_path / "data" / "samsum.jsonl", [sample("samsum", 0)])
    default = longbench.load_items("samsum", tokenizer, length=4096, data_dir=tmp_path)
    paper = longbench.load_items("samsum", tokenizer, length=4096, data_dir=tmp_path, template_rule="paper")
    assert default == paper and is_chat_templated(tokenizer, default[0])


def test_bad_template_rule_names_the_choices(tokenizer, tmp_path):
    write_jsonl(tmp_path / "data" / "trec.jsonl", [sample("trec", 0)])
    with pytest.raises(BenchmarkError) as error:
        benchmarks.load_items(
            "longbench", "trec", tokenizer, length=4096, data_dir=tmp_path, template_rule="pred"
        )
    message = str(error.value)
    assert "'pred'" in message and "'paper'" in message and "'upstream'" in message
    assert "benchmark.options.template_rule" in message


def test_configs_record_the_template_rules_explicitly():
    for name in ("longbench", "longbench-e"):
        config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
        assert config["name"] == name and name in benchmarks.BENCHMARKS
        assert config["options"]["template_rule"] == "paper"
    assert yaml.safe_load((CONFIGS / "ruler.yaml").read_text())["options"]["template"] == "model"


# 2. RULER's own model templates -----------------------------------------------------------------

META_LLAMA3_BEFORE = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
META_LLAMA3_AFTER = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_ruler_templates_are_upstreams_strings():
    assert RULER_TEMPLATES["base"] == "{task_template}"
    assert RULER_TEMPLATES["meta-llama3"] == META_LLAMA3_BEFORE + "{task_template}" + META_LLAMA3_AFTER
    assert RULER_TEMPLATES["lwm-chat"] == "You are a helpful assistant. USER: {task_template} ASSISTANT: "
    assert RULER_TEMPLATES["chatglm-chat"] == "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n "
    assert len(RULER_TEMPLATES) == 11
    assert all(template.count("{task_template}") == 1 for template in RULER_TEMPLATES.values())


def test_meta_llama3_template_wraps_the_task_without_a_system_block(tokenizer):
    (item,) = generate_items("niah_single_1", tokenizer, length=1024, num_samples=1, template="meta-llama3")
    text = tokenizer.decode(item.prompt_ids)
    question = tokenizer.decode(item.question_ids)
    key = question.split("for ")[1].split(" mentioned")[0]
    assert text.startswith(META_LLAMA3_BEFORE + "A special magic number is hidden within the following text.")
    assert "You are a helpful AI assistant" not in text and "<|im_start|>" not in text
    assert question.startswith("\nWhat is the special magic number for ")
    assert question == (
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
        f"{META_LLAMA3_AFTER} The special magic number for {key} mentioned in the provided text is"
    )


class BosAddingTokenizer:
    """The embedded tokenizer, but adding a BOS id (0) with ``add_special_tokens=True`` as Llama's does."""

    BOS = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, text, add_special_tokens=True, **kwargs):
        encoded = self.tokenizer(text, add_special_tokens=False, **kwargs)
        if add_special_tokens:
            encoded["input_ids"] = [self.BOS, *encoded["input_ids"]]
            if "offset_mapping" in encoded:
                encoded["offset_mapping"] = [(0, 0), *encoded["offset_mapping"]]
        return encoded


def test_ruler_template_prompts_are_tokenized_with_special_tokens_as_upstream_inference(tokenizer):
    # scripts/pred: the HF wrapper and the vLLM server tokenize the prompt with the tokenizer's
    # default special tokens; the backbone's chat template writes its own, so none are added there.
    bos_adding = BosAddingTokenizer(tokenizer)
    (ruler,) = generate_items("niah_single_1", bos_adding, length=1024, num_samples=1, template="meta-llama3")
    (model,) = generate_items("niah_single_1", bos_adding, length=1024, num_samples=1)
    assert ruler.prompt_ids[0] == BosAddingTokenizer.BOS
    assert ruler.prompt_ids[1:] == tuple(tokenizer(tokenizer.decode(ruler.prompt_ids[1:]))["input_ids"])
    assert BosAddingTokenizer.BOS not in model.prompt_ids


def test_ruler_template_rewording_covers_the_wrapper_as_upstream_does(tokenizer):
    single = generate_items("niah_single_1", tokenizer, length=1024, num_samples=1, template="lwm-chat")[0]
    multi = generate_items("niah_multivalue", tokenizer, length=1024, num_samples=1, template="lwm-chat")[0]
    assert tokenizer.decode(single.prompt_ids).startswith("You is a helpful assistant. USER: A special magic")
    assert tokenizer.decode(multi.prompt_ids).startswith(
        "You are a helpful assistant. USER: Some special magic"
    )
    # with the backbone's own template the system prompt is never reworded
    model = generate_items("niah_single_1", tokenizer, length=1024, num_samples=1)[0]
    assert "You are a helpful AI assistant" in tokenizer.decode(model.prompt_ids)


@pytest.mark.parametrize("name", list(RULER_TEMPLATES))
def test_rewording_the_parts_equals_rewording_upstreams_whole_template(tokenizer, name):
    niah = TEMPLATES["niah"]
    # prepare.py then niah.py: the whole model template with the answer prefix, reworded at once
    upstream = single_answer(RULER_TEMPLATES[name].format(task_template=niah.template) + niah.answer_prefix)
    fmt = PromptFormat(tokenizer, name).for_single_answer()
    assert fmt.chat(single_answer(niah.template)) + single_answer(niah.answer_prefix) == upstream


def test_bad_ruler_template_names_the_choices(tokenizer):
    with pytest.raises(BenchmarkError) as error:
        benchmarks.load_items("ruler", "vt", tokenizer, length=1024, num_samples=1, template="llama3")
    message = str(error.value)
    assert "'llama3'" in message and "'model'" in message and "'meta-llama3'" in message
    assert "benchmark.options.template" in message


def test_ruler_template_items_are_cached_apart(tokenizer, tmp_path):
    options = dict(length=1024, num_samples=1, cache_dir=tmp_path, tokenizer_name="smollm2-135m")
    model = benchmarks.load_items("ruler", "niah_single_1", tokenizer, **options)
    llama = benchmarks.load_items("ruler", "niah_single_1", tokenizer, template="meta-llama3", **options)
    assert model != llama
    names = sorted(path.name for path in tmp_path.rglob("*.jsonl"))
    assert names == [
        "niah_single_1-len1024-smollm2-135m-seed42-n1-tpl_meta-llama3.jsonl",
        "niah_single_1-len1024-smollm2-135m-seed42-n1.jsonl",
    ]
    assert (
        benchmarks.load_items("ruler", "niah_single_1", tokenizer, template="meta-llama3", **options) == llama
    )


# 3. samsum's first token ----------------------------------------------------------------------


def test_samsum_alone_needs_one_new_token(tokenizer, tmp_path):
    for task in ("samsum", "trec", "hotpotqa"):
        write_jsonl(tmp_path / "data" / f"{task}.jsonl", [sample(task, 0)])
    for rule in ("paper", "upstream"):
        items = {
            task: longbench.load_items(task, tokenizer, length=4096, data_dir=tmp_path, template_rule=rule)[0]
            for task in ("samsum", "trec", "hotpotqa")
        }
        assert items["samsum"].min_new_tokens == 1
        assert items["samsum"].stop_token_ids == (tokenizer.encode("\n", add_special_tokens=False)[-1],)
        assert items["trec"].min_new_tokens == 0 and items["hotpotqa"].min_new_tokens == 0
    ruler_item = generate_items("vt", tokenizer, length=1024, num_samples=1)[0]
    assert ruler_item.min_new_tokens == 0


def test_item_refuses_a_minimum_beyond_the_maximum():
    with pytest.raises(ValueError, match="min_new_tokens 9 outside"):
        Item("longbench", "samsum", 0, (1, 2), 1, "", ("x",), 8, "rouge_score", min_new_tokens=9)
    with pytest.raises(ValueError, match="min_new_tokens -1 outside"):
        Item("longbench", "samsum", 0, (1, 2), 1, "", ("x",), 8, "rouge_score", min_new_tokens=-1)


# 4. all_classes of the task file's last line ---------------------------------------------------


def test_all_classes_come_from_the_last_line_of_the_file(tokenizer, tmp_path):
    lines = [
        sample("trec", 0, all_classes=["Human"], answers=["Human"]),
        sample("trec", 1, all_classes=["Human"], answers=["Human"]),
        sample("trec", 2, all_classes=["Human", "Location"], answers=["Location"]),
    ]
    write_jsonl(tmp_path / "data" / "trec.jsonl", lines)
    # Only the first sample is asked for: the classes still come from the file's last line.
    (item,) = longbench.load_items("trec", tokenizer, length=4096, num_samples=1, data_dir=tmp_path)
    assert item.metadata["all_classes"] == ["Human", "Location"]
    # classification_score: both class names are in the prediction and "Human" is right -> 1/2.
    # With the sample's own classes ["Human"] it would be 1.
    assert benchmarks.score_item(item, "Human Location") == 0.5


# 5. Rounding per benchmark --------------------------------------------------------------------


def differing_rounding_case() -> list[float]:
    """Three sample scores (as a ROUGE or F1 score may be) whose task score differs between the orders."""
    for k in range(100_000):
        scores = [k / 100_000, 0.5, 1.0]
        total = 0.0
        for score in scores:
            total += score
        if round(total / 3 * 100, 2) != round(100 * total / 3, 2):
            return scores
    raise AssertionError("no differing case in the search grid")


def test_each_benchmark_rounds_in_its_upstream_order():
    scores = differing_rounding_case()
    total = scores[0] + scores[1] + scores[2]
    ruler = round(total / 3 * 100, 2)  # scripts/eval/synthetic/constants.py
    longbench_score = round(100 * total / 3, 2)  # LongBench/eval.py scorer
    assert ruler != longbench_score
    assert benchmarks.task_score("ruler", scores) == ruler
    assert benchmarks.task_score("longbench", scores) == longbench_score
    assert benchmarks.task_score("longbench-e", scores) == longbench_score


def test_task_score_needs_a_known_benchmark_and_scores():
    with pytest.raises(BenchmarkError, match="unknown benchmark 'ruler4k'"):
        benchmarks.task_score("ruler4k", [1.0])
    with pytest.raises(BenchmarkError, match="no sample scores"):
        benchmarks.task_score("ruler", [])


# 6. LongBench-E ---------------------------------------------------------------------------------


def test_longbench_e_tasks_are_pred_py_s_thirteen():
    assert longbench_e.TASKS == LONGBENCH_E_TASKS
    assert benchmarks.tasks("longbench-e") == LONGBENCH_E_TASKS
    assert set(LONGBENCH_E_TASKS) <= set(longbench.ENGLISH_TASKS)


E_LENGTHS = [100, 3999, 4000, 7999, 8000, 20000]


@pytest.fixture
def e_data(tmp_path):
    samples = [sample("hotpotqa", number, length=length) for number, length in enumerate(E_LENGTHS)]
    write_jsonl(tmp_path / "data" / "hotpotqa_e.jsonl", samples)
    write_jsonl(tmp_path / "data" / "hotpotqa.jsonl", [sample("hotpotqa", 99)])
    return tmp_path


def test_longbench_e_reads_the_e_file_with_longbench_prompts(tokenizer, e_data):
    items = benchmarks.load_items("longbench-e", "hotpotqa", tokenizer, length=4096, data_dir=e_data)
    assert [item.metadata["_id"] for item in items] == [f"hotpotqa-{n}" for n in range(len(E_LENGTHS))]
    assert {item.benchmark for item in items} == {"longbench-e"}
    write_jsonl(e_data / "plain" / "data" / "hotpotqa.jsonl", [sample("hotpotqa", 0)])
    plain = longbench.load_items("hotpotqa", tokenizer, length=4096, data_dir=e_data / "plain")[0]
    assert items[0].prompt_ids == plain.prompt_ids and items[0].max_new_tokens == plain.max_new_tokens
    assert benchmarks.score_item(items[0], "yes") == 1.0


def test_score_buckets_split_at_4000_and_8000(tokenizer, e_data):
    items = benchmarks.load_items("longbench-e", "hotpotqa", tokenizer, length=4096, data_dir=e_data)
    scores = [1.0, 0.0, 0.5, 0.25, 1.0, 0.5]
    # lengths 100, 3999 -> 0-4k; 4000, 7999 -> 4-8k; 8000, 20000 -> 8k+
    assert benchmarks.score_buckets(items, scores) == {"0-4k": 50.0, "4-8k": 37.5, "8k+": 75.0}
    assert benchmarks.score_buckets(items[:2], scores[:2]) == {"0-4k": 50.0, "4-8k": None, "8k+": None}


def test_score_buckets_round_with_numpy_as_scorer_e_does(tokenizer, e_data):
    items = benchmarks.load_items("longbench-e", "hotpotqa", tokenizer, length=4096, data_dir=e_data)[:1]
    candidates = [k / 100000 for k in range(40000, 60000)]
    score = next(s for s in candidates if round(100 * np.mean([s]), 2) != round(100 * s, 2))
    assert benchmarks.score_buckets(items, [score])["0-4k"] == round(100 * np.mean([score]), 2)


def test_score_buckets_refuse_other_benchmarks_and_mismatched_lengths(tokenizer, e_data):
    ruler_item = generate_items("vt", tokenizer, length=1024, num_samples=1)[0]
    with pytest.raises(BenchmarkError, match="only longbench-e"):
        benchmarks.score_buckets([ruler_item], [1.0])
    items = benchmarks.load_items("longbench-e", "hotpotqa", tokenizer, length=4096, data_dir=e_data)
    with pytest.raises(BenchmarkError, match="6 items but 2 sample scores"):
        benchmarks.score_buckets(items, [1.0, 0.0])


def test_unknown_longbench_e_task_names_the_choices(tokenizer, e_data):
    with pytest.raises(BenchmarkError, match="unknown longbench-e task 'narrativeqa'.*qasper"):
        longbench_e.load_items("narrativeqa", tokenizer, length=4096, data_dir=e_data)


# 7. Missing LongBench data ----------------------------------------------------------------------


def test_missing_longbench_e_data_is_unavailable_with_the_command_line_key(tokenizer, tmp_path, no_hub):
    with pytest.raises(TaskUnavailable) as error:
        benchmarks.load_items("longbench-e", "qasper", tokenizer, length=4096)
    message = str(error.value)
    assert "qasper_e.jsonl" in message and "benchmark.options.data_dir=DIR" in message
    assert f"{longbench.DATA_ENV}=DIR" in message and "hub unreachable (test)" in message
    assert " data_dir=DIR" not in message  # only the full command-line key


# 8. Task sets per benchmark ----------------------------------------------------------------------


def test_named_task_sets_belong_to_their_benchmark(tokenizer):
    assert benchmarks.task_sets("ruler") == {"all": RULER_TASKS}
    assert benchmarks.task_sets("longbench") == {"all": longbench.TASKS, "english": longbench.ENGLISH_TASKS}
    assert benchmarks.task_sets("longbench-e") == {"all": LONGBENCH_E_TASKS}
    with pytest.raises(BenchmarkError) as error:
        benchmarks.load_items("ruler", "english", tokenizer, length=1024, num_samples=1)
    message = str(error.value)
    assert "unknown ruler task 'english'" in message
    assert message.endswith(f"choose one of {list(RULER_TASKS)}")
