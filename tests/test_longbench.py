"""LongBench v1 items: data layout, exact prompts, middle truncation, chat template, split, scoring."""

from __future__ import annotations

import json
import zipfile

import pytest

import benchmarks
from benchmarks import BenchmarkError, longbench
from benchmarks.item import Item
from reskv.backbones import load_tokenizer

# Upstream LongBench/config/dataset2prompt.json, written out literally.
HOTPOTQA_TEMPLATE = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
TREC_TEMPLATE = (
    "Please determine the type of the question below. Here are some examples of questions."
    "\n\n{context}\n{input}"
)
GENERATION_PROMPT = "<|im_end|>\n<|im_start|>assistant\n"
TREC_CLASSES = ["Entity", "Abbreviation", "Description", "Human"]


def sample(task: str, number: int, context: str, question: str, answers: list[str], all_classes=None) -> dict:
    """A sample in the official jsonl field layout."""
    return {
        "input": question,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": task,
        "language": "zh" if task in {"multifieldqa_zh", "dureader", "vcsum", "lsht"} else "en",
        "all_classes": all_classes,
        "_id": f"{task}-{number}",
    }


SHORT_CONTEXT = "Passage 1:\nParis is the capital of France."
LONG_CONTEXT = " ".join(f"Sentence {i} of the passages says nothing." for i in range(60))
FIXTURE = {
    "hotpotqa": [
        sample("hotpotqa", 0, SHORT_CONTEXT, "What is the capital of France?", ["Paris"]),
        sample("hotpotqa", 1, LONG_CONTEXT, "Which sentence says something?", ["none", "no sentence"]),
    ],
    "trec": [
        sample(
            "trec",
            0,
            "Question: Who wrote Hamlet?\nType: Human",
            "Question: What is a dog?\nType:",
            ["Entity"],
            all_classes=TREC_CLASSES,
        )
    ],
    "samsum": [
        sample(
            "samsum", 0, "Dialogue: A: hi\nSummary: A greets.", "Dialogue: B: bye\nSummary:", ["B leaves."]
        )
    ],
    "lcc": [sample("lcc", 0, "def f(x):\n    return x\n" * 20, "", ["y = f(1)"])],
    "multifieldqa_zh": [sample("multifieldqa_zh", 0, "北京是中国的首都。", "中国的首都是哪里？", ["北京"])],
}


def write_jsonl(path, samples):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in samples), encoding="utf-8"
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture
def data_dir(tmp_path):
    for task, samples in FIXTURE.items():
        write_jsonl(tmp_path / "data" / f"{task}.jsonl", samples)
    return tmp_path


@pytest.fixture
def no_hub(monkeypatch):
    def unavailable():
        raise OSError("hub unreachable (test)")

    monkeypatch.setattr(longbench, "_hub_data_zip", unavailable)


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def one_item(task, tokenizer, data_dir, length=4096, number=0, **options) -> Item:
    return longbench.load_items(task, tokenizer, length=length, data_dir=data_dir, **options)[number]


def test_task_lists_follow_the_spec():
    assert longbench.ENGLISH_TASKS == longbench.TASKS[:16]
    assert longbench.TASKS[16:] == ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
    assert longbench.ENGLISH_TASKS[-3:] == ("passage_retrieval_en", "lcc", "repobench-p")
    assert set(longbench.TASKS) == set(longbench.DATASET2PROMPT) == set(longbench.DATASET2MAXLEN)
    assert set(longbench.TASK_METRICS) == set(longbench.TASKS)
    assert set(longbench.TASK_METRICS.values()) <= set(benchmarks.metrics.METRICS)
    assert longbench.FIRST_LINE_TASKS == {"trec", "triviaqa", "samsum", "lsht"}
    assert longbench.NO_CHAT_TEMPLATE_TASKS["upstream"] == longbench.FIRST_LINE_TASKS | {"lcc", "repobench-p"}
    assert longbench.NO_CHAT_TEMPLATE_TASKS["paper"] == {"lcc", "repobench-p"}


def test_spec_data_is_upstreams_verbatim():
    assert longbench.DATASET2PROMPT["hotpotqa"] == HOTPOTQA_TEMPLATE
    assert longbench.DATASET2PROMPT["trec"] == TREC_TEMPLATE
    assert (
        "Answer the question asconcisely as you can" in longbench.DATASET2PROMPT["narrativeqa"]
    )  # typo kept
    assert (
        longbench.DATASET2PROMPT["lcc"]
        == "Please complete the code given below. \n{context}Next line of code:\n"
    )
    assert [longbench.DATASET2MAXLEN[task] for task in ("hotpotqa", "gov_report", "trec", "lcc")] == [
        32,
        512,
        64,
        64,
    ]


def test_format_prompt_matches_format_and_locates_the_context_end():
    for task, samples in FIXTURE.items():
        for item in samples:
            prompt, context_end = longbench.format_prompt(task, item)
            assert prompt == longbench.DATASET2PROMPT[task].format(**item)
            assert prompt[:context_end].endswith(item["context"])


def test_templated_task_prompt_is_the_exact_upstream_text_in_the_chat_template(tokenizer, data_dir):
    item = one_item("hotpotqa", tokenizer, data_dir)
    raw = FIXTURE["hotpotqa"][0]
    expected = chat(tokenizer, HOTPOTQA_TEMPLATE.format(context=raw["context"], input=raw["input"]))
    assert item.prompt_ids == tuple(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(item.prompt_ids).startswith("<|im_start|>system\n")
    context, question = tokenizer.decode(item.context_ids), tokenizer.decode(item.question_ids)
    assert context.endswith("The following are given passages.\n" + SHORT_CONTEXT)
    assert question == (
        "\n\nAnswer the question based on the given passages. Only give me the answer and do not output "
        "any other words.\n\nQuestion: What is the capital of France?\nAnswer:" + GENERATION_PROMPT
    )


@pytest.mark.parametrize(
    ("task", "template_rule"),
    [("trec", "upstream"), ("samsum", "upstream"), ("lcc", "upstream"), ("lcc", "paper")],
)
def test_few_shot_and_code_tasks_skip_the_chat_template(tokenizer, data_dir, task, template_rule):
    item = one_item(task, tokenizer, data_dir, template_rule=template_rule)
    prompt = longbench.DATASET2PROMPT[task].format(**FIXTURE[task][0])
    assert item.prompt_ids == tuple(tokenizer(prompt)["input_ids"])
    assert "<|im_start|>" not in tokenizer.decode(item.prompt_ids)
    assert tokenizer.decode(item.context_ids).endswith(FIXTURE[task][0]["context"])


def test_trec_prompt_text_under_the_upstream_rule(tokenizer, data_dir):
    item = one_item("trec", tokenizer, data_dir, template_rule="upstream")
    assert tokenizer.decode(item.prompt_ids) == TREC_TEMPLATE.format(
        context="Question: Who wrote Hamlet?\nType: Human", input="Question: What is a dog?\nType:"
    )
    assert tokenizer.decode(item.question_ids) == "\nQuestion: What is a dog?\nType:"


def test_chinese_task_is_templated_and_split_at_the_context_end(tokenizer, data_dir):
    item = one_item("multifieldqa_zh", tokenizer, data_dir)
    assert tokenizer.decode(item.context_ids).endswith("北京是中国的首都。")
    assert tokenizer.decode(item.question_ids).endswith(
        "问题：中国的首都是哪里？\n回答：" + GENERATION_PROMPT
    )
    assert item.metric == "qa_f1_zh_score"


def test_item_fields(tokenizer, data_dir):
    items = longbench.load_items("hotpotqa", tokenizer, length=4096, data_dir=data_dir)
    assert [item.index for item in items] == [0, 1]
    second = items[1]
    assert second.benchmark == "longbench" and second.task == "hotpotqa"
    assert second.references == ("none", "no sentence")
    assert second.max_new_tokens == 32 and second.metric == "qa_f1_score"
    assert second.answer_prefix == "" and second.stop_token_ids == ()
    assert second.metadata == {
        "all_classes": None,
        "length": FIXTURE["hotpotqa"][1]["length"],
        "_id": "hotpotqa-1",
    }
    assert one_item("trec", tokenizer, data_dir).metadata["all_classes"] == TREC_CLASSES


def test_samsum_stops_at_the_newline_token(tokenizer, data_dir):
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert one_item("samsum", tokenizer, data_dir).stop_token_ids == (newline,)
    assert newline == 198


def test_num_samples_takes_the_first_in_file_order(tokenizer, data_dir):
    items = longbench.load_items("hotpotqa", tokenizer, length=4096, num_samples=1, data_dir=data_dir)
    assert [item.metadata["_id"] for item in items] == ["hotpotqa-0"]


def test_middle_truncation_keeps_half_the_length_of_head_and_tail_tokens(tokenizer):
    prompt, context_end = longbench.format_prompt("hotpotqa", FIXTURE["hotpotqa"][1])
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 200
    truncated, _ = longbench.truncate_middle(tokenizer, prompt, context_end, 200)
    assert truncated == tokenizer.decode(ids[:100]) + tokenizer.decode(ids[-100:])
    assert longbench.truncate_middle(tokenizer, prompt, context_end, len(ids)) == (prompt, context_end)


def test_truncation_comes_before_the_template_and_keeps_the_question_whole(tokenizer, data_dir):
    item = one_item("hotpotqa", tokenizer, data_dir, length=200, number=1)
    ids = tokenizer(longbench.format_prompt("hotpotqa", FIXTURE["hotpotqa"][1])[0])["input_ids"]
    expected = chat(tokenizer, tokenizer.decode(ids[:100]) + tokenizer.decode(ids[-100:]))
    assert item.prompt_ids == tuple(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert tokenizer.decode(item.question_ids).startswith(
        "\n\nAnswer the question based on the given passages."
    )
    assert tokenizer.decode(item.context_ids).endswith("says nothing.")


def test_truncation_reaching_into_the_question_splits_at_the_cut(tokenizer, data_dir):
    # 40 tokens keep 20 each side: the tail half lies inside the question, so the context
    # segment is the head half and the question segment the tail half.
    item = one_item("hotpotqa", tokenizer, data_dir, length=40, number=1)
    ids = tokenizer(longbench.format_prompt("hotpotqa", FIXTURE["hotpotqa"][1])[0])["input_ids"]
    head, tail = tokenizer.decode(ids[:20]), tokenizer.decode(ids[-20:])
    assert tokenizer.decode(item.context_ids) == chat(tokenizer, head + tail).split(head)[0] + head
    assert tokenizer.decode(item.question_ids) == tail + GENERATION_PROMPT


class TrimmingTemplate:
    """A tokenizer stand-in whose chat template trims the message, as Llama 3's does."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<user>{messages[0]['content'].strip()}</user><assistant>"


def test_chat_wrap_finds_the_question_when_the_template_trims_the_message():
    prompt = "  Context text.\n\nQuestion: why?\nAnswer: "
    text, boundary = longbench.chat_wrap(TrimmingTemplate(), prompt, prompt.index("\n\nQuestion"))
    assert text[:boundary] == "<user>Context text."
    assert text[boundary:] == "\n\nQuestion: why?\nAnswer:</user><assistant>"


class ShoutingTemplate:
    """A chat template that rewrites the message, so the question cannot be found in it."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<user>{messages[0]['content'].upper()}</user>"


def test_chat_wrap_refuses_a_template_that_rewrites_the_message():
    with pytest.raises(BenchmarkError, match="rewrites the message"):
        longbench.chat_wrap(ShoutingTemplate(), "Context.\n\nQuestion: why?", len("Context."))


def test_score_item_keeps_the_first_line_for_few_shot_tasks(tokenizer, data_dir):
    trec = one_item("trec", tokenizer, data_dir)
    assert longbench.score_item(trec, "\nEntity\nHuman") == 1.0
    assert longbench.score_item(trec, "Human\nEntity") == 0.0
    hotpotqa = one_item("hotpotqa", tokenizer, data_dir)
    # Not a first-line task: both lines count, tokens {paris, london} vs {paris}.
    assert longbench.score_item(hotpotqa, "Paris\nLondon") == pytest.approx(2 / 3)


@pytest.mark.parametrize("task", ["trec", "triviaqa", "samsum", "lsht"])
def test_first_line_rule_covers_exactly_upstreams_four_tasks(task):
    item = Item(
        "longbench", task, 0, (1, 2), 1, "", ("Paris",), 32, "qa_f1_score", metadata={"all_classes": None}
    )
    assert longbench.score_item(item, "\n\nParis\nLondon") == 1.0


def test_score_item_is_the_max_over_references(tokenizer, data_dir):
    item = one_item("hotpotqa", tokenizer, data_dir, number=1)
    assert longbench.score_item(item, "no sentence") == 1.0
    assert isinstance(longbench.score_item(item, "nothing"), float)


def test_data_from_the_env_var_and_a_flat_directory(tokenizer, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "trec.jsonl", FIXTURE["trec"])
    monkeypatch.setenv(longbench.DATA_ENV, str(tmp_path))
    assert len(longbench.load_items("trec", tokenizer, length=4096)) == 1


def test_data_from_the_hub_archive(tokenizer, tmp_path, monkeypatch):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.writestr("data/trec.jsonl", json.dumps(FIXTURE["trec"][0]) + "\n")
    monkeypatch.setattr(longbench, "_hub_data_zip", lambda: archive)
    monkeypatch.delenv(longbench.DATA_ENV, raising=False)
    assert longbench.load_items("trec", tokenizer, length=4096)[0].metadata["_id"] == "trec-0"


def test_missing_data_is_unavailable_with_the_way_to_get_it(tokenizer, tmp_path, no_hub):
    missing = tmp_path / "nowhere"
    with pytest.raises(benchmarks.TaskUnavailable) as error:
        longbench.load_items("qasper", tokenizer, length=4096, data_dir=missing)
    message = str(error.value)
    assert str(missing / "data" / "qasper.jsonl") in message
    assert longbench.DATA_ZIP_URL in message and f"{longbench.DATA_ENV}=DIR" in message
    assert "benchmark.options.data_dir=DIR" in message
    assert "hub unreachable (test)" in message


def test_missing_fields_are_reported(tokenizer, tmp_path):
    write_jsonl(tmp_path / "data" / "trec.jsonl", [{"input": "x", "context": "y"}])
    with pytest.raises(BenchmarkError, match="lacks the LongBench fields"):
        longbench.load_items("trec", tokenizer, length=4096, data_dir=tmp_path)


def test_unknown_task_and_bad_length_are_benchmark_errors(tokenizer, data_dir):
    with pytest.raises(BenchmarkError, match="unknown longbench task"):
        benchmarks.load_items("longbench", "narrative_qa", tokenizer, length=4096, data_dir=data_dir)
    with pytest.raises(BenchmarkError, match="too small"):
        benchmarks.load_items("longbench", "trec", tokenizer, length=1, data_dir=data_dir)


def test_entry_point_dispatches_to_longbench(tokenizer, data_dir):
    items = benchmarks.load_items("longbench", "trec", tokenizer, length=4096, data_dir=data_dir)
    assert benchmarks.tasks("longbench") == longbench.TASKS
    assert benchmarks.score_item(items[0], "Entity") == 1.0
