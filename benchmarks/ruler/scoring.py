"""RULER's per-sample metrics.

Upstream (NVIDIA/RULER, see ``templates.UPSTREAM_COMMIT``): the prediction cleaning is
``postprocess_pred`` in ``scripts/eval/evaluate.py``; the metrics are ``string_match_all`` and
``string_match_part`` in ``scripts/eval/synthetic/constants.py``. Upstream writes them over a whole
task (mean x 100, rounded); here they score one sample in [0, 1] and ``task_score`` makes the
task score in upstream's order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """Strip, turn every control character into a newline, strip again (evaluate.py)."""
    return _CONTROL_CHARS.sub("\n", prediction.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[float]:
    """1.0 for each reference contained in the prediction, case-insensitively."""
    lowered = prediction.lower()
    return [1.0 if reference.lower() in lowered else 0.0 for reference in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the references found in the prediction (partial credit)."""
    return sum(_found(prediction, references)) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any reference is found in the prediction."""
    return max(_found(prediction, references))


def task_score(sample_scores: Sequence[float]) -> float:
    """``round(sum / n * 100, 2)``: the order of ``string_match_all`` / ``string_match_part``
    (``scripts/eval/synthetic/constants.py``), which can differ from ``round(100 * sum / n, 2)``."""
    return round(sum(sample_scores) / len(sample_scores) * 100, 2)


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
