"""A calibration file: this device's rates per backbone, their fit and where the file lies
(``scripts.harness.dry_run``'s module docstring gives the schema)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselines.registry import RESIDUAL_SUFFIX
from reskv import batching
from reskv.batching import ModelShape
from scripts.harness.plan import GridEntry, Plan, PlanError
from scripts.machine import device_name

SCHEMA = "reskv-calibration/1"
CALIBRATION_DIR = Path(__file__).resolve().parents[3] / "results" / "calibration"


# Tokens of a sample's question segment (what follows the context: question, the template's end,
# the answer prefix): nominal, as the calibration's question forwards are.
class EstimateError(PlanError):
    """A dry run that cannot be estimated as asked (no calibration for this device or backbone)."""


# The terms a rate may be fitted with, as functions of its variables.
TERMS: dict[str, Callable[[Mapping[str, float]], float]] = {
    "1": lambda v: 1.0,
    "s": lambda v: v["s"],
    "s2": lambda v: v["s"] ** 2,
    "n": lambda v: v["n"],
    "B": lambda v: v["B"],
    "BL": lambda v: v["B"] * v["L"],
}
# Each stage's variables: tokens (s), question tokens (n), a decode batch's rows (B) and their slots (L).
VARIABLES = {
    "prefill": ("s",),
    "question": ("n",),
    "prefill_with": ("s",),
    "construction": ("s",),
    "decode": ("B", "L"),
}


def fit(terms: Sequence[str], points: Sequence[Sequence[float]], variables: Sequence[str]) -> list[float]:
    """Coefficients of ``terms`` fitted to ``points`` (``[x..., seconds]``) by least squares of the
    relative error (each point weighted by 1 / its seconds)."""
    import numpy as np

    values = [dict(zip(variables, point[:-1], strict=True)) for point in points]
    rows = [[TERMS[term](value) for term in terms] for value in values]
    seconds = np.array([point[-1] for point in points], dtype=float)
    weights = 1.0 / seconds
    solution, *_ = np.linalg.lstsq(np.array(rows) * weights[:, None], seconds * weights, rcond=None)
    return [float(value) for value in solution]


@dataclass(frozen=True)
class Rate:
    """Seconds as a sum of terms (``TERMS``) of a stage's variables, times ``scale``; a construction's
    measured at compression ratio ``ratio`` (``scripts.harness.dry_run.cost.construction_seconds``
    scales its ``s2`` term to another ratio's k-means)."""

    terms: tuple[str, ...]
    coefficients: tuple[float, ...]
    scale: float = 1.0
    source: str = ""
    ratio: float | None = None

    @classmethod
    def read(cls, entry: Mapping[str, Any], stage: str) -> Rate:
        terms = tuple(entry["terms"])
        unknown = [term for term in terms if term not in TERMS]
        if unknown:
            raise ValueError(f"unknown terms {unknown}; choose from {list(TERMS)}")
        if "coefficients" in entry:
            coefficients = entry["coefficients"]
        else:
            coefficients = fit(terms, entry["points"], VARIABLES[stage])
        if len(coefficients) != len(terms):
            raise ValueError(f"{len(coefficients)} coefficients for the terms {list(terms)}")
        return cls(
            terms, tuple(coefficients), entry.get("scale", 1.0), entry.get("source", ""), entry.get("ratio")
        )

    def term_seconds(self, **variables: float) -> dict[str, float]:
        """Each term's seconds (scaled), unclamped."""
        return {
            term: self.scale * c * TERMS[term](variables)
            for c, term in zip(self.coefficients, self.terms, strict=True)
        }

    def seconds(self, **variables: float) -> float:
        """Never below zero (a fit's intercept may be, far from its points)."""
        return max(0.0, sum(self.term_seconds(**variables).values()))


@dataclass(frozen=True)
class Rates:
    """One backbone's rates on one device, from a calibration file."""

    device: str
    device_type: str  # "cuda" or "cpu": what decode=auto and decode_batch=auto resolve to there
    path: Path
    prefill: Rate
    question: Rate
    prefill_with: dict[str, Rate]
    construction: dict[str, Rate]
    decode: dict[str, Rate]
    notes: tuple[str, ...] = ()
    memory_bytes: int | None = None  # the device's memory, for the grid's memory rule (None: no limit)
    weights_bytes: int | None = None  # the backbone's weights on the device
    shape: ModelShape | None = None  # the backbone's attention sizes (``reskv.batching.ModelShape``)

    def construction_rate(self, entry: GridEntry) -> tuple[Rate, str]:
        """The rate a configuration's construction takes and the key it was found under."""
        kind = "reskv" if entry.method.endswith(RESIDUAL_SUFFIX) else "base"
        for key in (entry.label, entry.method, kind):
            if key in self.construction:
                return self.construction[key], key
        raise EstimateError(
            f"{self.path} has no construction rate for {entry.label!r} (nor {entry.method!r} or "
            f"{kind!r}; it has {sorted(self.construction)}): calibrate with a grid holding it"
        )

    def decoding(self, plan: Plan) -> tuple[str, int | None]:
        """The plan's decode mode and most rows a batch holds on this device (``grid_decoding``)."""
        return batching.grid_decoding(plan.decode, plan.decode_batch, self.device_type)

    def decode_rate(self, mode: str) -> Rate:
        if mode not in self.decode:
            raise EstimateError(
                f"{self.path} has no decode={mode} rate (it has {sorted(self.decode)}): run the dry run "
                f"with dry_run=calibrate decode={mode} on this device, or choose another decode mode"
            )
        return self.decode[mode]


def read_rates(path: Path, backbone: str) -> Rates:
    """The rates of ``backbone`` in the calibration file ``path``; a clear error when absent."""
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise EstimateError(f"cannot read the calibration file {path}: {error}") from error
    if document.get("schema") != SCHEMA or backbone not in document.get("backbones", {}):
        held = sorted(document.get("backbones", {}))
        raise EstimateError(
            f"{path} has no {SCHEMA} rates for backbone {backbone!r} (it has {held}); measure them "
            "on this device with dry_run=calibrate"
        )
    entry = document["backbones"][backbone]

    def keyed(stage: str) -> Iterable[tuple[str, Any]]:
        return entry.get(stage, {}).items()

    try:
        return Rates(
            device=document["device"],
            device_type=document["device_type"],
            path=path,
            prefill=Rate.read(entry["prefill"], "prefill"),
            question=Rate.read(entry["question"], "question"),
            prefill_with={label: Rate.read(rate, "prefill_with") for label, rate in keyed("prefill_with")},
            construction={key: Rate.read(rate, "construction") for key, rate in keyed("construction")},
            decode={mode: Rate.read(rate, "decode") for mode, rate in keyed("decode")},
            notes=tuple(document.get("notes", ())),
            memory_bytes=document.get("memory_bytes"),
            weights_bytes=entry.get("weights_bytes"),
            shape=ModelShape(**entry["shape"]) if "shape" in entry else None,
        )
    except (KeyError, ValueError, TypeError) as error:
        raise EstimateError(f"{path}: the rates of {backbone!r} are not a calibration ({error!r})") from error


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def calibration_path(choice: str | None, device: str) -> Path:
    """The calibration file a dry run reads: ``choice`` as a path or a device kind (a file of
    ``CALIBRATION_DIR``), or this device's kind when None."""
    if choice is not None and Path(choice).suffix == ".json":
        return Path(choice)
    kind = slug(choice if choice is not None else device_name(device))
    return CALIBRATION_DIR / f"{kind}.json"
