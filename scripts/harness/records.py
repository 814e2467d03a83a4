"""What a result file holds: the method label codec and the typed sample record (torch-free).

A method label is the method name plus the options that differ from their defaults, after
``~``: ``snapkv+reskv~validate=false``, ``snapkv+reskv~alpha=8,tau=0.3``,
``h2o~h2o_window_only=true``. Result paths, the tables and the frames all name configurations
by it; ``MethodLabel`` is its one writer and reader.

A sample record is one line of a result file's journal and one entry of its ``samples``. Its
generated part carries the sections the engine measures (``reskv.engine.Generation``), declared
with it in ``reskv.stats``: ``cache_stats``, ``timings``, ``run`` and, when the plan records them,
``quality``; the frames name their columns through ``field_column`` so that a renamed field fails
at import rather than leaving an empty column. The JSON written is the format the committed
results use (``docs/spec/platform.md``); files written before the ``run`` section held its counts
in ``timings``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from baselines.registry import RESIDUAL_SUFFIX, SPECS, base_of, option_default
from reskv.stats import CacheStats, Quality, Run, Timings, fields

OPTIONS_SEPARATOR = "~"
# ``run`` fields under the names files written before held them: a batch's rows were ``decode_batch``,
# the option's name, which is the cap, not the rows.
RUN_RENAMED = {"decode_batch": "batch_rows"}
RESKV_DISPLAY = "+ResKV"  # a +reskv method's display name: its base's plus this


# A number as ``option_text`` writes it (``12``, ``-0.5``, ``1e-05``, ``inf``); in a grid the numbers
# are joined by ``-``, which a number holds only as its sign or in its exponent.
NUMBER = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?|inf)")
# What a label's own syntax and its directory use: a string holding one cannot be written.
RESERVED = ",=~/"


def option_text(value: Any) -> str:
    """An option value as a label writes it: ``true``, ``0.3``, ``1e-05``, a grid as ``0-0.05-0.1``.

    A float is written short (``:g``) where that reads back as the same float, in full (``repr``)
    otherwise; a ``ValueError`` for a value no label can hold (a string with one of ``,=~/``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list) and all(
        isinstance(part, int | float) and not isinstance(part, bool) for part in value
    ):
        return "-".join(option_text(part) for part in value)
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    if isinstance(value, int) or (isinstance(value, str) and not set(value) & set(RESERVED)):
        return str(value)
    raise ValueError(
        f"option value {value!r} cannot be written in a method label: it takes true/false, numbers, "
        f"a list of numbers, or text without any of {RESERVED!r}"
    )


def _number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


def _grid_parts(text: str) -> list[str] | None:
    """The numbers of a grid as ``option_text`` writes it (``0-0.05-0.1``, ``0-1e-05``, ``""`` for
    none); None when ``text`` is not one."""
    parts, position = [], 0
    while position < len(text):
        match = NUMBER.match(text, position)
        if match is None:
            return None
        parts.append(match.group())
        position = match.end()
        if position < len(text):
            if text[position] != "-" or position + 1 == len(text):
                return None
            position += 1
    return parts


def option_value(text: str, default: Any = None) -> Any:
    """An option value as written in a label (``option_text``'s inverse), read as the type of the
    option's ``default``; an option not declared (no ``default``) is read by its look. Text that is
    not of the option's type comes back as read by its look, for the plan to refuse by name."""
    parts = _grid_parts(text)
    if isinstance(default, str):
        return text
    if isinstance(default, tuple) and parts is not None:
        as_float = bool(default) and all(isinstance(part, float) for part in default)
        return tuple(float(part) if as_float else _number(part) for part in parts)
    if isinstance(default, float) and NUMBER.fullmatch(text):
        return float(text)
    if text in ("true", "false"):
        return text == "true"
    if NUMBER.fullmatch(text):
        return _number(text)
    return tuple(map(_number, parts)) if parts is not None and len(parts) > 1 else text


@dataclass(frozen=True)
class MethodLabel:
    """A method name and the options it runs with that differ from their defaults."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> MethodLabel:
        """``snapkv+reskv~validate=false,tau=0.3``; a ``ValueError`` for an option without ``=``."""
        method, _, written = text.partition(OPTIONS_SEPARATOR)
        options = {}
        for part in written.split(",") if written else ():
            name, separator, value = part.partition("=")
            if not separator:
                raise ValueError(f"method option {part!r} of {text!r} must be written name=value")
            options[name] = option_value(value, option_default(name))
        return cls(method, options)

    def __str__(self) -> str:
        if not self.options:
            return self.method
        written = ",".join(f"{name}={option_text(self.options[name])}" for name in sorted(self.options))
        return self.method + OPTIONS_SEPARATOR + written

    @property
    def base(self) -> str:
        """The baseline without ``+reskv``."""
        return base_of(self.method)

    @property
    def residual(self) -> bool:
        return self.method.endswith(RESIDUAL_SUFFIX)

    @property
    def options_text(self) -> str:
        """The part after ``~`` ("" without options)."""
        return str(self).partition(OPTIONS_SEPARATOR)[2]

    def display(self, under_baseline: bool = False) -> str:
        """How tables and figures name the label (``display_name`` of its parts)."""
        return display_name(self.base, self.residual, self.options_text, under_baseline)


def display_name(base: str, residual: bool, options: str = "", under_baseline: bool = False) -> str:
    """How tables and figures name a label from its parts (a ``MethodLabel``'s, or the results frames'
    ``base_method``, ``residual`` and ``options`` columns): ``SnapKV``, ``SnapKV+ResKV``, ``+ResKV`` in
    the row under its baseline's (``under_baseline``; a label with options names its method in full),
    options in brackets: ``SnapKV+ResKV (validate=false)``. The names are the registry's."""
    name = SPECS[base].display if base in SPECS else base
    if residual:
        name = RESKV_DISPLAY if under_baseline and not options else name + RESKV_DISPLAY
    return f"{name} ({options})" if options else name


def field_column(section: str, name: str) -> str:
    """The frame column of a section field (``quality.kl``); a ``KeyError`` for a field the
    section does not declare (``reskv.stats``)."""
    if name not in fields(section):
        raise KeyError(f"{section} has no field {name!r}; its fields: {list(fields(section))}")
    return f"{section}.{name}"


@dataclass(frozen=True)
class SampleRecord:
    """One sample of a configuration: its prompt, and either its generation or why it was skipped.

    ``score`` is a fraction in [0, 1], None for a skipped sample (summaries leave it out).
    """

    index: int
    prompt_digest: str
    prompt_tokens: int
    context_tokens: int
    max_new_tokens: int
    references: list[str]
    metric: str
    metadata: dict[str, Any]  # e.g. LongBench's sample length (LongBench-E buckets), RULER depths
    score: float | None = None
    prediction: str | None = None
    prediction_token_ids: list[int] = field(default_factory=list)
    cache_stats: CacheStats = field(default_factory=dict)
    timings: Timings = field(default_factory=dict)
    run: Run = field(default_factory=dict)
    quality: Quality | None = None
    skipped: str | None = None

    @property
    def question_tokens(self) -> int:
        return self.prompt_tokens - self.context_tokens

    def to_json(self) -> dict[str, Any]:
        """The record as the journal and the result file store it (key order included)."""
        prompt = {
            "index": self.index,
            "prompt_digest": self.prompt_digest,
            "prompt_tokens": self.prompt_tokens,
            "context_tokens": self.context_tokens,
            "question_tokens": self.question_tokens,
            "max_new_tokens": self.max_new_tokens,
            "references": list(self.references),
            "metric": self.metric,
            "metadata": self.metadata,
        }
        if self.skipped is not None:
            return {**prompt, "score": None, "skipped": self.skipped}
        quality = {} if self.quality is None else {"quality": self.quality}
        run = {"run": self.run} if self.run else {}
        return {
            **prompt,
            "prediction": self.prediction,
            "prediction_token_ids": list(self.prediction_token_ids),
            "generated_tokens": len(self.prediction_token_ids),
            "score": self.score,
            "cache_stats": self.cache_stats,
            "timings": self.timings,
            **run,
            **quality,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SampleRecord:
        return cls(
            index=data["index"],
            prompt_digest=data["prompt_digest"],
            prompt_tokens=data["prompt_tokens"],
            context_tokens=data["context_tokens"],
            max_new_tokens=data["max_new_tokens"],
            references=data["references"],
            metric=data["metric"],
            metadata=data["metadata"],
            score=data["score"],
            prediction=data.get("prediction"),
            prediction_token_ids=data.get("prediction_token_ids", []),
            cache_stats=data.get("cache_stats", {}),
            timings=data.get("timings", {}),
            run={RUN_RENAMED.get(name, name): value for name, value in data.get("run", {}).items()},
            quality=data.get("quality"),
            skipped=data.get("skipped"),
        )
