"""ResKV's defaults (``reskv.config.ResidualConfig()``) are the paper's, as docs/spec/reskv.md states them.

Each expected value is written out here from the spec's text, beside the words that state it; the
test also finds those words in the spec, so a change on either side shows here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reskv.config import ResidualConfig

SPEC = Path(__file__).resolve().parent.parent / "docs" / "spec" / "reskv.md"

# (field, the spec's value, the spec's words that state it)
PAPER_DEFAULTS = [
    ("tau", 0.25, "with `tau = 0.25`"),
    ("alpha", 12.0, "`alpha = 12.0`"),
    ("g_min", 0.0, "`g_min = 0.0`"),
    ("beta", 1.0, "(beta = 1)"),
    ("gate", True, "w/o dynamic gate: `g = 1`"),  # the gate is on unless ablated
    ("shared_softmax", True, "w/o shared softmax: each branch normalised on its own"),
    ("grid", (0.0, 0.05, 0.10, 0.15, 0.20), "Candidate residual ratios `G = {0, 0.05, 0.10, 0.15, 0.20}`"),
    ("validate", True, "w/o validation: fixed residual ratio"),  # validated unless ablated
    ("fixed_ratio", 0.10, "fixed residual ratio (0.10 unless set)"),
    ("delta", 0.01, "with `delta = 0.01`"),
    ("kmeans_iterations", 4, "Lloyd's k-means on keys (squared Euclidean), 4 iterations"),
    ("fit_queries", 96, "Fit = the first 96"),
    ("validation_queries", 32, "validation = the last 32"),
    ("final_selection", "base", "by default the main cache is selected with the base method's own scores"),
]


@pytest.mark.parametrize(
    ("name", "value", "words"), PAPER_DEFAULTS, ids=[name for name, _, _ in PAPER_DEFAULTS]
)
def test_each_default_is_the_value_the_spec_states(name, value, words):
    spec = re.sub(r"\s+", " ", SPEC.read_text())
    assert words in spec, f"docs/spec/reskv.md no longer says {words!r}"
    default = getattr(ResidualConfig(), name)
    assert (type(default), default) == (type(value), value)
