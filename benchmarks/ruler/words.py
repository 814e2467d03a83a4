"""Word lists from ``wonderwords==2.2.0`` as RULER builds them.

Upstream: ``scripts/data/synthetic/niah.py`` (needle keys: every ``adjective-noun`` pair, deduplicated
and sorted) and ``scripts/data/synthetic/common_words_extraction.py`` (nouns + adjectives + verbs,
deduplicated, sorted, then shuffled by ``random.Random(seed)``). wonderwords 3.x drops words and so
changes every sample: the version is pinned in pyproject.toml.
"""

from __future__ import annotations

import random
import warnings
from bisect import bisect_right
from collections.abc import Sequence
from contextlib import contextmanager
from functools import cache, lru_cache
from itertools import accumulate


@contextmanager
def _quiet_wonderwords():
    """wonderwords 2.2.0 reads its word lists with the deprecated ``importlib.resources.open_text``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


with _quiet_wonderwords():
    from wonderwords.random_word import _get_words_from_text_file  # the function upstream calls


@cache
def _word_file(name: str) -> tuple[str, ...]:
    with _quiet_wonderwords():
        return tuple(_get_words_from_text_file(name))


class SortedPairs(Sequence):
    """``sorted(set(f"{a}-{b}" for a in firsts for b in seconds))`` without building all its strings.

    Upstream builds the 6.2 million needle keys and sorts them (seconds of CPU) only to pick a few at
    random indexes. The pairs of one first word form a sorted run; runs whose ranges overlap
    (``blue-*`` and ``blue-eyed-*``) are merged and sorted explicitly, every other run is indexed
    arithmetically. Same length, same element at every index.
    """

    def __init__(self, firsts: Sequence[str], seconds: Sequence[str]) -> None:
        self.seconds = sorted(set(seconds))
        clusters: list[tuple[list[str], str]] = []
        for first in sorted(set(firsts), key=lambda word: f"{word}-{self.seconds[0]}"):
            low, high = f"{first}-{self.seconds[0]}", f"{first}-{self.seconds[-1]}"
            if clusters and low <= clusters[-1][1]:
                clusters[-1] = (clusters[-1][0] + [first], max(clusters[-1][1], high))
            else:
                clusters.append(([first], high))
        # a lone first word stays a string; an overlapping cluster becomes its merged sorted pairs
        self.runs = [
            members[0] if len(members) == 1 else sorted({f"{f}-{s}" for f in members for s in self.seconds})
            for members, _ in clusters
        ]
        sizes = [len(self.seconds) if isinstance(run, str) else len(run) for run in self.runs]
        self.starts = list(accumulate(sizes, initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < len(self):
            raise IndexError(index)
        number = bisect_right(self.starts, index) - 1
        run, offset = self.runs[number], index - self.starts[number]
        return f"{run}-{self.seconds[offset]}" if isinstance(run, str) else run[offset]


@lru_cache(maxsize=1)
def needle_keys() -> SortedPairs:
    """niah.py ``words``: sorted unique ``adjective-noun`` pairs."""
    return SortedPairs(_word_file("adjectivelist.txt"), _word_file("nounlist.txt"))


def common_words(seed: int) -> list[str]:
    """common_words_extraction.py ``words``: sorted unique nouns, adjectives and verbs, shuffled."""
    lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    words = sorted({word for name in lists for word in _word_file(name)})
    random.Random(seed).shuffle(words)
    return words
