"""Result files: one JSON per (backbone, benchmark, length, task, setting, method, ratio).

Layout under ``<results_dir>/runs`` (``<ratio>`` written with ``:g``, e.g. ``0.9``)::

    <backbone>/<benchmark>-<length>/<task>/full[.samples-A-B].json
    <backbone>/<benchmark>-<length>/<task>/<setting>/<method>/<ratio>[.samples-A-B].json
    <backbone>/<benchmark>-<length>/<task>/unavailable.json

Full cache compresses nothing, so it has neither setting nor ratio: one file serves every
ratio column and both settings (it runs query-aware, the single-prefill computation). A file
covers the task's samples ``[A, B)``; the suffix is present only for a shard of the sample
range, and the aggregators merge the files of one configuration by sample index.

Crash safety: while a configuration runs, each finished sample is appended as one line to a
journal ``<file>.jsonl`` (flushed and fsynced); a line cut short by ``kill -9`` is dropped on
the next start. When every sample of the range is in, the final JSON is written to a temporary
file and renamed over the target (atomic), then the journal is deleted. The final JSON is a
pure function of the configuration and the sample records, sorted by index, so an interrupted
and resumed run ends with the same file as an uninterrupted one, except for the wall-clock
values kept under the keys named ``timings`` and how each sample was run, its ``run`` (the
configurations that shared its prefill, its decode batch; see ``deterministic_view``). A journal is locked
(``flock``) while a process writes it, so two launcher jobs never write one file.

Units (also stated in every file's ``units``): ``summary.score`` (= ``summary.score_percent``) is
the benchmark's task score in percent, 0-100; a sample's ``score`` is a fraction in [0, 1], or
None for a sample ``skipped`` before its prefill (the record says why; summaries leave it out).
A sample's ``timings`` are wall-clock seconds and the tokens decoded, its ``run`` counts such as
its decode batch (``reskv.stats`` declares both with their units); the top-level ``timings`` sums
the seconds and tokens over the scored samples, never a count.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from baselines.registry import FULL_METHOD, METHODS, method_option_defaults
from reskv.stats import TOKENS, summed, units

SCHEMA = "reskv-task-result/1"
_TOKEN_COUNTS = (
    f"({', '.join(name for name, unit in units('timings').items() if unit == TOKENS)}: a token count)"
)
UNITS = {
    "summary.score": "percent (0-100), the benchmark's task score; equal to summary.score_percent",
    "samples[].score": "fraction in [0, 1]; null for a skipped sample",
    "timings": f"seconds summed over the scored samples {_TOKEN_COUNTS}",
    "samples[].timings": f"seconds {_TOKEN_COUNTS}; the prefills are shared by run.prefill_shared_by "
    "configurations",
    "samples[].run": "never summed: " + ", ".join(f"{name} ({unit})" for name, unit in units("run").items()),
}
UNAVAILABLE_SCHEMA = "reskv-task-unavailable/1"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Packages whose versions change predictions or scores; recorded in every result file.
RECORDED_PACKAGES = (
    "torch",
    "transformers",
    "numpy",
    "tokenizers",
    "wonderwords",
    "nltk",
    "rouge",
    "fuzzywuzzy",
    "jieba",
    "hydra-core",
)


class ResultStoreError(RuntimeError):
    """A result file that cannot be resumed as asked (other configuration, other samples, damaged)."""


def damaged(path: Path, problem: str) -> ResultStoreError:
    """The error for a file that is not what this module writes (e.g. cut short by a copy)."""
    return ResultStoreError(
        f"{path} is damaged ({problem}); delete it to recompute what it held (rerun the same "
        "command), or restore an intact copy. No other file was changed."
    )


def read_json(path: Path) -> Any:
    """A result or marker file's JSON; a damaged file is a ``ResultStoreError`` naming it."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise damaged(path, f"not valid JSON: {error}") from error


class ResultFileLocked(ResultStoreError):
    """Another process is writing this result file (e.g. an overlapping launcher job)."""


@dataclass(frozen=True)
class ResultKey:
    """What one result file holds. ``setting`` and ``ratio`` are None for the full cache.

    ``label`` is the method label (``scripts.harness.records.MethodLabel``): the method's name,
    followed for non-default method options by ``~`` and the differing options
    (``snapkv+reskv~validate=false``). A file stores it under the key ``method``, as it always has.
    """

    backbone: str
    benchmark: str
    length: int
    task: str
    setting: str | None
    label: str
    ratio: float | None

    def __post_init__(self) -> None:
        if (self.label == FULL_METHOD) != (self.setting is None and self.ratio is None):
            raise ValueError(f"setting and ratio must be None exactly for the full cache: {self}")

    @property
    def task_dir(self) -> Path:
        """Relative directory of the task; backbone ids with '/' (hub ids, local paths) are flattened."""
        backbone = self.backbone.strip("/").replace("/", "--")
        return Path(backbone, f"{self.benchmark}-{self.length}", self.task)

    def path(self, runs_dir: Path, sample_range: tuple[int, int] | None = None) -> Path:
        """Final JSON path; ``sample_range`` names a shard of the task's samples."""
        if self.label == FULL_METHOD:
            directory, stem = runs_dir / self.task_dir, FULL_METHOD
        else:
            directory, stem = runs_dir / self.task_dir / self.setting / self.label, f"{self.ratio:g}"
        suffix = "" if sample_range is None else f".samples-{sample_range[0]}-{sample_range[1]}"
        return directory / f"{stem}{suffix}.json"

    @property
    def sort_key(self) -> tuple:
        return (
            self.backbone,
            self.benchmark,
            self.length,
            self.task,
            self.setting or "",
            self.label,
            self.ratio or 0.0,
        )

    def to_json(self) -> dict[str, Any]:
        """The key as a file stores it: the label under ``method``."""
        return {("method" if name == "label" else name): value for name, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResultKey:
        return cls(**{("label" if name == "method" else name): value for name, value in data.items()})


def prompt_digest(prompt_ids: Iterable[int]) -> str:
    """Fingerprint of a prompt, stored per sample so a resume never mixes different samples."""
    return hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()[:16]


def provenance(environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Package versions, the git commit of the code and the machine's state when a result was begun.

    ``environment`` is what the runner knows of the machine and the run (cores, load average,
    device, dtype, torch threads: the timings depend on them); the start time is added here.
    """
    machine = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(environment or {})}
    versions = {"python": platform.python_version()}
    for package in RECORDED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"versions": versions, "git_commit": commit, "git_dirty": dirty, "machine": machine}


RUN_DEPENDENT = ("timings", "run")  # the keys of what depends on how a run went, not on what it computed


def deterministic_view(data: Any) -> Any:
    """``data`` without its ``timings`` and ``run`` entries (wall-clock values, and how the samples
    were run: their decode batch and prefill sharing): what two runs of one configuration share."""
    if isinstance(data, dict):
        return {name: deterministic_view(value) for name, value in data.items() if name not in RUN_DEPENDENT}
    if isinstance(data, list):
        return [deterministic_view(value) for value in data]
    return data


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with staging.open("w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


def _read_journal(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
    """Header, sample records and the byte length of the intact part of a journal.

    A last line without its newline (or not valid JSON) is what ``kill -9`` leaves mid-write:
    it is excluded and its bytes are cut off before the journal grows again. An invalid line
    with more lines after it is damage no interrupted write leaves: a ``ResultStoreError``.
    """
    header, records, intact = None, [], 0
    with path.open("rb") as handle:
        lines = handle.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.endswith(b"\n"):
            break
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            if number < len(lines):
                raise damaged(path, f"line {number} of {len(lines)} is not valid JSON: {error}") from error
            break
        intact += len(line)
        if header is None:
            header = entry
        else:
            records.append(entry)
    return header, records, intact


def scored(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples that were generated and scored (not ``skipped``)."""
    return [sample for sample in samples if "skipped" not in sample]


def summarize(samples: list[dict[str, Any]], score) -> dict[str, Any]:
    """Score (percent) and token counts of a set of sample records; skipped samples are counted
    apart (``score`` maps sample scores, fractions, to the task score in percent)."""
    kept = scored(samples)

    def mean(name: str) -> float | None:
        return round(sum(sample[name] for sample in kept) / len(kept), 2) if kept else None

    task_score = score([sample["score"] for sample in kept]) if kept else None
    return {
        "score": task_score,
        "score_percent": task_score,
        "num_samples": len(kept),
        "num_skipped": len(samples) - len(kept),
        "prompt_tokens_mean": mean("prompt_tokens"),
        "generated_tokens_mean": mean("generated_tokens"),
    }


def prefill_shared_by(sample: dict[str, Any]) -> int | None:
    """The configurations that shared a sample's prefills: its ``run``'s count, or its ``timings``'
    in a file written before samples had a ``run`` section; None where not recorded."""
    return sample.get("run", {}).get("prefill_shared_by", sample.get("timings", {}).get("prefill_shared_by"))


def total_timings(samples: list[dict[str, Any]]) -> dict[str, float]:
    """The seconds and tokens of the scored samples summed per field (``reskv.stats.summed``; kept
    apart from the deterministic content), and ``prefill_s_own_share``: the share of the shared
    prefills that falls to this configuration (each prefill divided by the configurations it served).
    """
    totals: dict[str, float] = {}
    for sample in scored(samples):
        timings = sample.get("timings", {})
        for name in summed("timings"):
            if name in timings:
                totals[name] = totals.get(name, 0) + timings[name]
        if shared_by := prefill_shared_by(sample):
            shared = timings.get("prefill_s", 0) + timings.get("question_prefill_s", 0)
            totals["prefill_s_own_share"] = totals.get("prefill_s_own_share", 0) + shared / shared_by
    return {name: round(value, 6) for name, value in sorted(totals.items())}


def without_default_options(config: dict[str, Any]) -> dict[str, Any]:
    """A result's identity (``config``) without the method options that hold their defaults.

    The identity stores the options that differ from their defaults (as the label does), so an
    option added with a default leaves every earlier file resumable; files written when it stored
    every option, defaults included, compare equal to today's identity through this view."""
    method, options = config.get("method"), config.get("method_options")
    if method not in METHODS or not isinstance(options, dict):
        return config
    defaults = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in method_option_defaults(method).items()
    }
    kept = {name: value for name, value in options.items() if name not in defaults or value != defaults[name]}
    return {**config, "method_options": kept}


@dataclass
class ResultFile:
    """The results of one configuration over one sample range, resumable after any interruption.

    ``header`` holds ``config`` (the identity: a resume with another config is refused) and
    ``provenance``; ``sample_range`` is ``[start, stop)`` of the task's ``samples_total`` samples.
    """

    runs_dir: Path
    key: ResultKey
    sample_range: tuple[int, int]
    samples_total: int
    config: dict[str, Any]
    score: Any  # callable: list of sample scores -> task score
    environment: dict[str, Any] = field(default_factory=dict)  # recorded in a new file's provenance
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    _journal: Any = None
    _header: dict[str, Any] | None = None
    _finished_before: bool = False

    @property
    def path(self) -> Path:
        whole = self.sample_range == (0, self.samples_total)
        return self.key.path(self.runs_dir, None if whole else self.sample_range)

    @property
    def journal_path(self) -> Path:
        return self.path.with_suffix(".jsonl")

    @property
    def pending(self) -> list[int]:
        return [index for index in range(*self.sample_range) if index not in self.records]

    def open(self) -> ResultFile:
        """Lock the journal and load what an earlier run finished. Returns self.

        A damaged file is refused with nothing written: a journal this call created is removed."""
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.journal_path.exists()
        self._journal = self.journal_path.open("a+b")
        try:
            fcntl.flock(self._journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            self._journal.close()
            raise ResultFileLocked(f"{self.journal_path} is being written by another process") from error
        try:
            if self.path.exists():
                finished = read_json(self.path)
                self._adopt(finished, finished["samples"])
            header, records, intact = _read_journal(self.journal_path)
            if header is not None:
                self._adopt(header, records)
        except ResultStoreError:
            self._journal.close()
            if created:
                self.journal_path.unlink()
            raise
        self._finished_before = header is None and self.path.exists() and not self.pending
        if not self._finished_before:
            self._journal.truncate(intact)
            if header is None or header["sample_range"] != list(self.sample_range):
                self._rewrite_journal()
        return self

    def _adopt(self, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
        stored, config = without_default_options(header["config"]), without_default_options(self.config)
        if stored != config:
            differing = sorted(
                set(stored) ^ set(config)
                | {name for name in set(stored) & set(config) if stored[name] != config[name]}
            )
            raise ResultStoreError(
                f"{self.path} holds results of another configuration (differs in {differing}); "
                "use another results_dir or remove the file"
            )
        if self._header is None:
            self._header = {"provenance": header["provenance"]}
        for record in records:
            self.records.setdefault(record["index"], record)

    def _rewrite_journal(self) -> None:
        """Start the journal afresh: header (first run's provenance) plus every record kept so far."""
        if self._header is None:
            self._header = {"provenance": provenance(self.environment)}
        lines = [self._header_line(), *(self.records[index] for index in sorted(self.records))]
        self._journal.truncate(0)
        self._journal.write(b"".join(json.dumps(line, sort_keys=True).encode() + b"\n" for line in lines))
        self._sync()

    def _header_line(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "key": self.key.to_json(),
            "config": self.config,
            "provenance": self._header["provenance"],
            "sample_range": list(self.sample_range),
            "samples_total": self.samples_total,
        }

    def _sync(self) -> None:
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def append(self, record: dict[str, Any]) -> None:
        """Persist one finished sample (a journal line, flushed to disk before returning)."""
        if record["index"] in self.records:
            raise ResultStoreError(f"sample {record['index']} is already in {self.path}")
        self.records[record["index"]] = record
        self._journal.write(json.dumps(record, sort_keys=True).encode() + b"\n")
        self._sync()

    def final_document(self) -> dict[str, Any]:
        samples = [self.records[index] for index in range(*self.sample_range) if index in self.records]
        return {
            **self._header_line(),
            "complete": not self.pending,
            "units": UNITS,
            "summary": summarize(samples, self.score),
            "timings": total_timings(samples),
            "samples": samples,
        }

    def close(self) -> dict[str, Any] | None:
        """Write the final JSON when the range is complete (then drop the journal); release the lock.

        Returns the final document, or None while samples are still missing.
        """
        document = None
        if self._finished_before:
            self.journal_path.unlink(missing_ok=True)
        elif not self.pending:
            document = self.final_document()
            _write_atomically(self.path, document)
            self.journal_path.unlink(missing_ok=True)
        fcntl.flock(self._journal, fcntl.LOCK_UN)
        self._journal.close()
        return document


def write_unavailable(runs_dir: Path, key: ResultKey, reason: str) -> Path:
    """Mark a task whose data is missing here; the tables show it as unavailable, never as 0."""
    path = runs_dir / key.task_dir / "unavailable.json"
    _write_atomically(
        path,
        {
            "schema": UNAVAILABLE_SCHEMA,
            "backbone": key.backbone,
            "benchmark": key.benchmark,
            "length": key.length,
            "task": key.task,
            "reason": reason,
        },
    )
    return path


@dataclass
class TaskResult:
    """All samples of one configuration found on disk, merged over shard files and journals."""

    key: ResultKey
    samples: dict[int, dict[str, Any]]
    samples_total: int

    @property
    def complete(self) -> bool:
        return all(index in self.samples for index in range(self.samples_total))


def _result_documents(runs_dir: Path) -> Iterator[tuple[Path, dict[str, Any], list[dict[str, Any]]]]:
    for path in sorted(runs_dir.rglob("*.json")):
        if path.name.startswith("."):
            continue
        document = read_json(path)
        if document.get("schema") == SCHEMA:
            yield path, document, document["samples"]
    for path in sorted(runs_dir.rglob("*.jsonl")):
        header, records, _ = _read_journal(path)
        if header is not None and header.get("schema") == SCHEMA:
            yield path, header, records


def load_results(*runs_dirs: Path) -> tuple[list[TaskResult], list[dict[str, Any]], list[str]]:
    """Every configuration under the ``runs_dirs``, the unavailable-task markers, and warnings.

    Samples of one configuration found in several files (shards, a journal beside its final
    file, two directories) are merged by index; two different records for one index are reported
    as a warning and the first (in directory, then path order) is kept.
    """
    merged: dict[ResultKey, TaskResult] = {}
    warnings = []
    documents = (document for runs_dir in runs_dirs for document in _result_documents(runs_dir))
    for path, header, records in documents:
        key = ResultKey.from_json(header["key"])
        result = merged.setdefault(key, TaskResult(key, {}, header["samples_total"]))
        result.samples_total = max(result.samples_total, header["samples_total"])
        for record in records:
            kept = result.samples.setdefault(record["index"], record)
            if deterministic_view(kept) != deterministic_view(record):
                warnings.append(
                    f"{path}: sample {record['index']} differs from an earlier file; kept the first"
                )
    unavailable = [
        read_json(path) for runs_dir in runs_dirs for path in sorted(runs_dir.rglob("unavailable.json"))
    ]
    return sorted(merged.values(), key=lambda result: result.key.sort_key), unavailable, warnings
