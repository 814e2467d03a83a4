"""RULER specification data and metrics, checked against literal strings taken from upstream.

Expected strings are copied by hand from NVIDIA/RULER @ c3f5e3b: ``scripts/data/synthetic/constants.py``,
``scripts/data/synthetic/niah.py``, ``variable_tracking.py``, ``qa.py``, ``scripts/synthetic.yaml`` and
``scripts/eval/synthetic/constants.py`` / ``scripts/eval/evaluate.py``.
"""

from __future__ import annotations

import pytest

import benchmarks
from benchmarks.item import Item
from benchmarks.ruler import TASKS, UPSTREAM_COMMIT, score_item
from benchmarks.ruler.scoring import postprocess_pred, string_match_all, string_match_part
from benchmarks.ruler.templates import (
    DOCUMENT_PROMPT,
    NEEDLE,
    NOISE,
    TASK_CONFIGS,
    TEMPLATES,
    single_answer,
)

UPSTREAM_TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128,
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
        30,
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
        "list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120,
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50,
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
        "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32,
    ),
}


def test_upstream_commit_is_pinned():
    assert UPSTREAM_COMMIT == "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"


def test_task_names_and_order():
    assert TASKS == (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
    )  # fmt: skip
    assert benchmarks.tasks("ruler") == TASKS


@pytest.mark.parametrize("generator", sorted(UPSTREAM_TEMPLATES))
def test_templates_answer_prefixes_and_generation_lengths_are_upstreams(generator):
    template, answer_prefix, tokens = UPSTREAM_TEMPLATES[generator]
    spec = TEMPLATES[generator]
    assert (spec.template, spec.answer_prefix, spec.tokens_to_generate) == (template, answer_prefix, tokens)
    assert spec.metric == ("string_match_part" if generator == "qa" else "string_match_all")


def test_needle_noise_and_document_strings():
    assert NEEDLE == "One of the special magic {type_needle_v} for {key} is: {value}."
    assert NOISE == (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    )
    assert DOCUMENT_PROMPT == "Document {i}:\n{document}"


# scripts/synthetic.yaml, in this order:
NIAH_FIELDS = (
    "type_haystack",
    "type_needle_k",
    "type_needle_v",
    "num_needle_k",
    "num_needle_v",
    "num_needle_q",
)
UPSTREAM_NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}


def test_task_configs_follow_synthetic_yaml():
    for task, values in UPSTREAM_NIAH.items():
        assert TASK_CONFIGS[task] == ("niah", dict(zip(NIAH_FIELDS, values, strict=True)))
    assert TASK_CONFIGS["vt"] == ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4))
    assert TASK_CONFIGS["cwe"] == ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10))
    assert TASK_CONFIGS["fwe"] == ("freq_words_extraction", dict(alpha=2.0))
    assert [TASK_CONFIGS[t][1]["dataset"] for t in ("qa_1", "qa_2")] == ["squad", "hotpotqa"]


def test_single_answer_rewording():
    template, answer_prefix, _ = UPSTREAM_TEMPLATES["niah"]
    assert single_answer(template) == (
        "A special magic {type_needle_v} is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat is the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?"
    )
    assert single_answer(answer_prefix) == (
        " The special magic {type_needle_v} for {query} mentioned in the provided text is"
    )


def test_prediction_cleaning():
    assert postprocess_pred("  \x00 7374122\tand\x1f 42 \n") == "7374122\nand\n 42"
    assert postprocess_pred("\n\n") == ""


def test_string_match_all_gives_partial_credit_case_insensitively():
    references = ["1234567", "Blue-Sky", "9999999"]
    assert string_match_all("the numbers are 1234567 and blue-sky.", references) == pytest.approx(2 / 3)
    assert string_match_all("BLUE-SKY 9999999 1234567", references) == 1.0
    assert string_match_all("nothing here", references) == 0.0


def test_string_match_part_takes_the_best_reference():
    assert string_match_part("It was in PARIS, France.", ["paris", "London"]) == 1.0
    assert string_match_part("Rome", ["paris", "London"]) == 0.0


def _item(metric: str, references: tuple[str, ...]) -> Item:
    return Item(
        benchmark="ruler",
        task="niah_multivalue",
        index=0,
        prompt_ids=(1, 2),
        context_length=1,
        answer_prefix="",
        references=references,
        max_new_tokens=8,
        metric=metric,
    )


def test_score_item_cleans_then_scores_and_task_score_averages():
    item = _item("string_match_all", ("111", "222", "333", "444"))
    scores = [score_item(item, " 111\x00222 "), score_item(item, "111 222 333 444"), score_item(item, "")]
    assert scores == [0.5, 1.0, 0.0]
    assert benchmarks.score_item(item, "444") == 0.25
    assert benchmarks.task_score("ruler", scores) == 50.0
    part = _item("string_match_part", ("Denver Broncos", "Broncos"))
    assert score_item(part, "the broncos") == 1.0
