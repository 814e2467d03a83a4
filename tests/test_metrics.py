"""LongBench metrics on hand-computed cases, upstream's edge cases and quirks included."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.metrics import (
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)


def rouge_f(precision: float, recall: float) -> float:
    """The ``rouge`` package's F, with its 1e-8 in the denominator."""
    return 2 * precision * recall / (precision + recall + 1e-8)


def test_normalize_answer_lowercases_drops_punctuation_then_articles_and_collapses_spaces():
    assert normalize_answer("  The Quick,  brown FOX! ") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    # Punctuation goes first, so "a.b" becomes the word "ab", not the article "a".
    assert normalize_answer("a.b") == "ab"


def test_normalize_zh_answer_drops_chinese_punctuation_and_all_spaces():
    assert normalize_zh_answer("北京， 是 首都。ABC") == "北京是首都abc"


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("The Cat sat.", "a cat", 2 / 3),  # tokens {cat, sat} vs {cat}: p=1/2, r=1
        ("cat cat dog", "cat", 0.5),  # bag of tokens: one shared cat, p=1/3, r=1
        ("Paris", "paris!", 1.0),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
    ],
)
def test_qa_f1_score(prediction, reference, expected):
    assert qa_f1_score(prediction, reference) == pytest.approx(expected)


def test_qa_f1_zh_score_uses_jieba_words_and_ignores_punctuation_words():
    # jieba: 我 / 爱 / 北京 / 天安门 vs 北京: p=1/4, r=1.
    assert qa_f1_zh_score("我爱北京天安门", "北京") == pytest.approx(0.4)
    assert qa_f1_zh_score("北京。", "北京") == 1.0


def test_rouge_score_is_rouge_l_f():
    # LCS "a" of hypothesis "a b c" and reference "a": p=1/3, r=1.
    assert rouge_score("a b c", "a") == pytest.approx(rouge_f(1 / 3, 1.0), abs=1e-15)
    assert rouge_score("x y", "z") == 0.0


@pytest.mark.parametrize("prediction", ["", "...", "   "])
def test_rouge_score_is_zero_when_the_package_raises_on_an_empty_prediction(prediction):
    assert rouge_score(prediction, "the reference summary") == 0.0


def test_rouge_score_is_zero_on_the_recursion_error_of_long_texts():
    # The package back-tracks the LCS recursively, one frame per word: a 1000-word match
    # exceeds Python's default recursion limit, and upstream scores that 0.
    text = " ".join(f"w{i % 7}" for i in range(1000))
    assert rouge_score(text, text) == 0.0


def test_rouge_zh_score_compares_jieba_words():
    # Words 北京 / 天安门 vs 我 / 爱 / 北京 / 天安门: LCS 2, p=1, r=1/2. Without the cut each
    # side would be one "word" and share nothing.
    assert rouge_zh_score("北京天安门", "我爱北京天安门") == pytest.approx(rouge_f(1.0, 0.5), abs=1e-15)
    assert rouge_zh_score("", "我爱北京天安门") == 0.0


TREC_LIKE = ["Entity", "Abbreviation", "Description", "Human"]


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("Entity", "Entity", 1.0),
        ("Entity or Human", "Entity", 0.5),
        ("Human", "Entity", 0.0),
        ("no class at all", "Entity", 0.0),
    ],
)
def test_classification_score(prediction, reference, expected):
    assert classification_score(prediction, reference, all_classes=TREC_LIKE) == expected


def test_classification_score_keeps_upstreams_remove_while_iterating_quirk():
    # Matches A, AB, ABC, X. Upstream removes A (a proper substring of the true class ABC) from
    # the list it is iterating, so AB is skipped and survives: 1/3, where a clean filter gives 1/2.
    all_classes = ["A", "AB", "ABC", "X"]
    assert classification_score("ABC X", "ABC", all_classes=all_classes) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("Paragraph 3", 1.0),
        ("Paragraph 3, or maybe Paragraph 13", 0.5),
        ("Paragraph 30", 0.0),
        ("Paragraph 03", 0.0),  # numbers compare as strings
        ("I do not know", 0.0),
    ],
)
def test_retrieval_score_counts_the_share_of_numbers_naming_the_paragraph(prediction, expected):
    assert retrieval_score(prediction, "Paragraph 3") == expected


def test_retrieval_zh_score():
    assert retrieval_zh_score("段落5，不是段落2", "段落5") == 0.5
    assert retrieval_zh_score("段落5", "段落5") == 1.0


def test_retrieval_score_needs_a_paragraph_number_in_the_reference():
    with pytest.raises(ValueError, match="names no paragraph"):
        retrieval_score("Paragraph 1", "no paragraph here")


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("4", 1.0),
        ("There are 4 unique paragraphs out of 12.", 0.5),
        ("4, 4, 7", 2 / 3),
        ("", 0.0),
        ("40", 0.0),
    ],
)
def test_count_score_with_several_numbers(prediction, expected):
    assert count_score(prediction, "4") == pytest.approx(expected)


def test_code_sim_score_skips_fences_and_comment_lines():
    prediction = "```python\n# set up\n// not python\nx = foo(1)\ny = 2\n```"
    assert code_sim_score(prediction, "x = foo(1)") == 1.0


def test_code_sim_score_strips_leading_newlines_but_not_empty_lines_after_them():
    assert code_sim_score("\n\nx = 1", "x = 1") == 1.0
    # The empty line after "# c" is the first code line: an empty prediction scores 0.
    assert code_sim_score("# c\n\nx = 1", "x = 1") == 0.0


def test_code_sim_score_without_a_code_line_is_zero():
    assert code_sim_score("# only a comment\n`x`", "x = 1") == 0.0


def test_code_sim_score_is_fuzz_ratio_over_100():
    # difflib: "abcd" vs "abce" share "abc", ratio 2*3/8 = 0.75.
    assert code_sim_score("abcd", "abce") == 0.75
    # "kitten"/"sitting": 2*4/13 = 0.615..., which fuzz rounds to 62.
    assert code_sim_score("kitten", "sitting") == 0.62


def test_python_levenshtein_is_absent_so_fuzzywuzzy_uses_difflib():
    assert importlib.util.find_spec("Levenshtein") is None


def test_metrics_registry_names_every_metric_with_upstreams_signature():
    assert set(METRICS) == {
        "qa_f1_score",
        "qa_f1_zh_score",
        "rouge_score",
        "rouge_zh_score",
        "classification_score",
        "retrieval_score",
        "retrieval_zh_score",
        "count_score",
        "code_sim_score",
    }
    for name, metric in METRICS.items():
        assert metric.__name__ == name
        reference = {"retrieval_score": "Paragraph 1", "retrieval_zh_score": "段落1"}.get(name, "1")
        assert 0.0 <= metric("1", reference, all_classes=["1"]) <= 1.0
