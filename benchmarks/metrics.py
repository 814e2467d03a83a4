"""LongBench v1 metrics, rule for rule as upstream ``THUDM/LongBench`` ``LongBench/metrics.py`` scores.

Every metric takes ``(prediction, ground_truth, **kwargs)`` and returns one sample's score against
one reference; ``benchmarks.longbench.score_item`` takes the max over references. Upstream's quirks
are kept on purpose, since published numbers include them. Score-changing pins: ``rouge==1.0.1``,
``jieba==0.42.1`` and ``fuzzywuzzy==0.18.0`` *without* python-Levenshtein (difflib ratios).
"""

from __future__ import annotations

import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import jieba
from rouge import Rouge

with warnings.catch_warnings():
    # fuzzywuzzy warns that it falls back to difflib's SequenceMatcher: that fallback is what
    # upstream's published scores used, so it is wanted here.
    warnings.simplefilter("ignore", UserWarning)
    from fuzzywuzzy import fuzz

# Upstream's ``normalize_zh_answer`` list of Chinese (and a few typographic) punctuation marks.
_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝"
    "～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


def normalize_answer(text: str) -> str:
    """SQuAD normalisation (``metrics.py``): lowercase, drop punctuation, then articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation (``metrics.py``): lowercase, drop English and Chinese punctuation and spaces."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION).split())


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (``metrics.py`` ``f1_score``); 0 when nothing is shared."""
    shared = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(prediction_tokens)
    recall = shared / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def _jieba_words(text: str) -> list[str]:
    return list(jieba.cut(text, cut_all=False))


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 after SQuAD normalisation, tokens split on white space."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 over jieba words, each normalised, empty ones dropped (punctuation-only words vanish)."""

    def words(text: str) -> list[str]:
        return [word for word in map(normalize_zh_answer, _jieba_words(text)) if word]

    return _token_f1(words(prediction), words(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the ``rouge`` package; 0 whenever it raises.

    It raises on a prediction with no sentence (empty, or only dots) and with ``RecursionError``
    on long texts (its LCS back-tracking recurses per word); upstream scores all of these 0.
    """
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F over jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/(number of class names matched) when the true class is among the matches, else 0.

    A class name matches when it is a substring of the prediction; matched names that are proper
    substrings of the true class are then dropped. Upstream drops them with ``list.remove`` while
    iterating over that same list, so the match right after each dropped one is never examined
    and stays in; reproduced deliberately because it changes scores.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_of_numbers_equal(prediction: str, target: str) -> float:
    """Fraction of the digit runs in the prediction that equal ``target`` as strings (0 when none)."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def _paragraph_number(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"reference {ground_truth!r} names no paragraph (pattern {pattern!r})")
    return found[0]


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to the reference's ``Paragraph N``."""
    return _share_of_numbers_equal(prediction, _paragraph_number(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to the reference's ``段落N``."""
    return _share_of_numbers_equal(prediction, _paragraph_number(ground_truth, r"段落(\d+)"))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction equal to the reference count."""
    return _share_of_numbers_equal(prediction, str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """``fuzz.ratio / 100`` between the reference and the first predicted line that is code.

    Lines holding a backtick, ``#`` or ``//`` (markdown fences, comments) are skipped; with no
    such line the prediction is the empty string, which ``fuzz.ratio`` scores 0.
    """
    lines = prediction.lstrip("\n").split("\n")
    code_line = next((line for line in lines if not any(mark in line for mark in ("`", "#", "//"))), "")
    return fuzz.ratio(code_line, ground_truth) / 100


Metric = Callable[..., float]

METRICS: dict[str, Metric] = {
    metric.__name__: metric
    for metric in (
        qa_f1_score,
        qa_f1_zh_score,
        rouge_score,
        rouge_zh_score,
        classification_score,
        retrieval_score,
        retrieval_zh_score,
        count_score,
        code_sim_score,
    )
}
