"""RULER's 11 synthetic tasks at 4K with the embedded tokenizer: fitting, references, determinism, splits."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter

import pytest

import benchmarks
from benchmarks.ruler import TASKS, generate_items, load_items
from benchmarks.ruler import cache as ruler_cache
from benchmarks.ruler.haystacks import essay_words, split_sentences
from benchmarks.ruler.templates import TASK_CONFIGS, TEMPLATES, single_answer, split_template
from benchmarks.ruler.words import SortedPairs, _word_file, needle_keys
from reskv.backbones import load_tokenizer

LENGTH = 4096
SAMPLES = 2
SYNTHETIC = TASKS[:11]
# How far below the limit a sample may land: upstream steps an oversize sample down by one haystack
# step (500 essay words ~ 650 SmolLM2 tokens; fwe max_len // 32 words ~ 350 tokens at 4K).
SLACK = {"niah_single_2": 700, "niah_single_3": 700, "niah_multikey_1": 700, "niah_multivalue": 700,
         "niah_multiquery": 700, "fwe": 400}  # fmt: skip
DEFAULT_SLACK = 300


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def items(tokenizer):
    return {task: generate_items(task, tokenizer, length=LENGTH, num_samples=SAMPLES) for task in SYNTHETIC}


def texts(item, tokenizer) -> tuple[str, str]:
    return tokenizer.decode(item.context_ids), tokenizer.decode(item.question_ids)


@pytest.mark.parametrize("task", SYNTHETIC)
def test_prompts_fill_the_length_without_exceeding_it(task, items):
    for item in items[task]:
        total = item.length + item.max_new_tokens
        assert total <= LENGTH
        assert total >= LENGTH - SLACK.get(task, DEFAULT_SLACK)
        assert item.metadata["length"] == total
        assert item.max_new_tokens == TEMPLATES[TASK_CONFIGS[task][0]].tokens_to_generate


@pytest.mark.parametrize("task", SYNTHETIC)
def test_items_carry_the_contract_fields(task, items, tokenizer):
    generator = TASK_CONFIGS[task][0]
    for index, item in enumerate(items[task]):
        assert (item.benchmark, item.task, item.index) == ("ruler", task, index)
        assert item.metric == TEMPLATES[generator].metric
        assert tokenizer.decode(item.prompt_ids).endswith(item.answer_prefix)
        # the whole prompt is one tokenization, never with a BOS added
        full = tokenizer.decode(item.prompt_ids)
        assert list(item.prompt_ids) == tokenizer(full, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("task", SYNTHETIC)
def test_context_ends_with_the_haystack_and_question_holds_the_rest(task, items, tokenizer):
    _, tail = split_template(TEMPLATES[TASK_CONFIGS[task][0]].template)
    tail_end = tail[-15:]  # the question's end, untouched by the single-answer rewording
    for item in items[task]:
        context, question = texts(item, tokenizer)
        assert context.startswith("<|im_start|>system\nYou are a helpful AI assistant")
        # only vt's in-context example and cwe's few-shot example repeat the question in the context
        assert context.count(tail_end) == (task in ("vt", "cwe"))
        assert tail_end in question
        assert question.endswith("<|im_end|>\n<|im_start|>assistant\n" + item.answer_prefix)
        assert len(question) < 400


@pytest.mark.parametrize("task", SYNTHETIC)
def test_references_are_in_the_context(task, items, tokenizer):
    for item in items[task]:
        context, _ = texts(item, tokenizer)
        assert item.references
        assert all(reference in context for reference in item.references)


@pytest.mark.parametrize("task", [t for t in SYNTHETIC if t.startswith("niah")])
def test_niah_needles_answer_the_question(task, items, tokenizer):
    config = TASK_CONFIGS[task][1]
    for item in items[task]:
        context, question = texts(item, tokenizer)
        keys = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
        keys = re.split(r", and |, ", keys)
        assert len(keys) == config["num_needle_q"]
        needles = re.findall(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.", context)
        answers = [value for key in keys for found_key, value in needles if found_key == key]
        assert sorted(answers) == sorted(item.references)
        assert len(item.references) == config["num_needle_q"] * config["num_needle_v"]
        assert len(item.metadata["needle_depths"]) == config["num_needle_k"] * config["num_needle_v"] or (
            config["num_needle_q"] > 1
        )


def test_single_answer_rewording_spares_the_system_prompt(items, tokenizer):
    context, question = texts(items["niah_single_1"][0], tokenizer)
    assert "You are a helpful AI assistant" in context
    assert "\nA special magic number is hidden within the following text." in context
    assert question.startswith("\nWhat is the special magic number for ")
    assert items["niah_single_1"][0].answer_prefix.endswith(" mentioned in the provided text is")
    multi_context, multi_question = texts(items["niah_multivalue"][0], tokenizer)
    assert "\nSome special magic numbers are hidden within the following text." in multi_context
    assert "What are all the special magic numbers for " in multi_question
    assert items["niah_multivalue"][0].answer_prefix.endswith(" mentioned in the provided text are")
    assert single_answer("You are") == "You is"  # what wrapping first would have done


def test_vt_references_are_the_chain_from_the_asked_value(items, tokenizer):
    for item in items["vt"]:
        context, question = texts(item, tokenizer)
        value = re.search(r"assigned the value (\d+) in the text above", question).group(1)
        sample = context[context.rindex("Memorize and track") :]  # after the in-context example
        assignments = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", sample))
        chain, sources = [], {f"{value}"}
        while True:
            nxt = [name for name, source in assignments.items() if source in sources and name not in chain]
            if not nxt:
                break
            chain += nxt
            sources = {f"VAR {name}" for name in nxt}
        assert chain == list(item.references)
        assert len(item.references) == 5 and all(len(name) == 5 for name in item.references)
        example = context[: context.rindex("Memorize and track")]
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}\n$", example)
        assert "12345" not in example  # the example's value is redrawn per sample


def test_cwe_references_are_the_most_repeated_words(items, tokenizer):
    for item in items["cwe"]:
        context, _ = texts(item, tokenizer)
        sample = context[context.rindex("<|im_start|>user") :]
        counts = Counter(re.findall(r"\d+\. (\S+)", sample))
        assert {word: counts[word] for word in item.references} == dict.fromkeys(item.references, 30)
        assert set(counts.values()) == {30, 3}
        # the few-shot example comes first, as a whole chat-wrapped prompt with its answer
        assert context.count("<|im_start|>user") == 2
        assert "most often in the list are: 1. " in context


def test_fwe_references_are_the_three_most_frequent_coded_words(items, tokenizer):
    for item in items["fwe"]:
        context, _ = texts(item, tokenizer)
        coded = context[context.index("coded words. ") + len("coded words. ") :]
        ranked = [word for word, _ in Counter(coded.split()).most_common(4)]
        assert ranked[0] == "..."
        assert ranked[1:] == list(item.references)


@pytest.mark.parametrize("task", SYNTHETIC)
def test_same_seed_gives_identical_items_and_another_seed_differs(task, items, tokenizer):
    again = generate_items(task, tokenizer, length=LENGTH, num_samples=SAMPLES)
    as_json = [json.dumps(dataclasses.asdict(item)) for item in items[task]]
    assert [json.dumps(dataclasses.asdict(item)) for item in again] == as_json
    other = generate_items(task, tokenizer, length=LENGTH, num_samples=1, seed=7)
    assert other[0].prompt_ids != items[task][0].prompt_ids


def test_first_samples_do_not_depend_on_the_sample_count(items, tokenizer):
    one = generate_items("niah_single_1", tokenizer, length=LENGTH, num_samples=1)
    assert one[0] == items["niah_single_1"][0]


def test_cache_reads_back_what_it_wrote(tmp_path, tokenizer, monkeypatch):
    options = dict(length=1024, num_samples=2, cache_dir=tmp_path, tokenizer_name="smollm2-135m")
    first = load_items("vt", tokenizer, **options)
    files = list(tmp_path.rglob("*"))
    assert [path.name for path in files if path.is_file()] == ["vt-len1024-smollm2-135m-seed42-n2.jsonl"]
    monkeypatch.setattr("benchmarks.ruler._generate", lambda *args: pytest.fail("regenerated"))
    assert load_items("vt", tokenizer, **options) == first
    assert benchmarks.load_items("ruler", "vt", tokenizer, **options) == first


def test_cache_key_without_a_name_hashes_the_vocabulary(tokenizer):
    key = ruler_cache.tokenizer_key(tokenizer, None)
    assert re.fullmatch(r"vocab-[0-9a-f]{16}", key)
    assert ruler_cache.tokenizer_key(tokenizer, None) == key
    assert ruler_cache.tokenizer_key(tokenizer, "org/model name") == "org_model_name"


def test_unknown_task_names_the_valid_ones(tokenizer):
    with pytest.raises(benchmarks.BenchmarkError, match="niah_single_1.*qa_2"):
        generate_items("niah_single_4", tokenizer, length=LENGTH, num_samples=1)
    with pytest.raises(benchmarks.BenchmarkError, match="choose one of"):
        benchmarks.load_items("ruler", "needle", tokenizer, length=LENGTH, num_samples=1)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_too_small_length_names_the_task_and_a_minimum_that_works(task, tokenizer):
    with pytest.raises(benchmarks.BenchmarkError, match=rf"RULER {task}.*at least (\d+) tokens") as error:
        generate_items(task, tokenizer, length=150, num_samples=1)
    minimum = int(re.search(r"at least (\d+) tokens", str(error.value)).group(1))
    assert minimum > 150
    if task != "fwe":  # fwe steps by max_len // 32 words: its minimum is the template's alone
        (item,) = generate_items(task, tokenizer, length=minimum + 60, num_samples=1)
        assert item.length + item.max_new_tokens <= minimum + 60


def test_bad_length_or_count_is_rejected(tokenizer):
    with pytest.raises(benchmarks.BenchmarkError, match="length"):
        generate_items("vt", tokenizer, length=0, num_samples=1)
    with pytest.raises(benchmarks.BenchmarkError, match="num_samples"):
        generate_items("vt", tokenizer, length=LENGTH, num_samples=0)


def test_command_line_shows_items_with_their_token_counts(capsys):
    from benchmarks.ruler.__main__ import main

    main(
        [
            "--task",
            "niah_single_1",
            "--length",
            "1024",
            "--num-samples",
            "2",
            "--no-cache",
            "--show-chars",
            "80",
        ]
    )
    shown = capsys.readouterr().out
    assert shown.count("=== niah_single_1 #") == 2
    counts = r"#0: \d+ prompt tokens \(context \d+, question \d+\) \+ 128 to generate = \d+ / 1024"
    assert re.search(counts, shown)
    assert "characters ...]" in shown and "references: ['" in shown


def test_punkt_english_parameters_split_like_nltk():
    assert split_sentences("Dr. Smith paid $5.50 to Mr. Jones at 5 p.m. on Jan. 3. They left.") == [
        "Dr. Smith paid $5.50 to Mr. Jones at 5 p.m. on Jan. 3.",
        "They left.",
    ]
    assert split_sentences("It works.It does not split here. But here.") == [
        "It works.It does not split here.",
        "But here.",
    ]


def test_essay_haystack_is_the_49_wheel_essays():
    words = essay_words()
    assert len(words) == 111877
    assert words[:4] == ("July", "2010What", "hard", "liquor,")


@pytest.mark.slow
def test_needle_keys_equal_upstreams_sorted_list():
    nouns, adjectives = _word_file("nounlist.txt"), _word_file("adjectivelist.txt")
    upstream = sorted({f"{adjective}-{noun}" for adjective in adjectives for noun in nouns})
    keys = needle_keys()
    assert isinstance(keys, SortedPairs) and len(keys) == len(upstream) == 6175260
    assert all(keys[i] == word for i, word in enumerate(upstream))


@pytest.mark.slow
def test_one_32k_item_per_essay_task_is_quick(tokenizer):
    start = time.perf_counter()
    (item,) = generate_items("niah_multivalue", tokenizer, length=32768, num_samples=1)
    elapsed = time.perf_counter() - start
    assert 32768 - 700 <= item.length + item.max_new_tokens <= 32768
    assert elapsed < 60, f"one 32K niah_multivalue item took {elapsed:.1f} s"
