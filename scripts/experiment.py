"""What run.py runs: a validated plan, its grid of configurations, and the shared-prefill loop.

A plan is one backbone, one benchmark at one length, some tasks, and a grid of (method, ratio,
setting) configurations. Per sample the prompt is prefilled once and every configuration that
still lacks that sample compresses a copy of the prefilled cache and decodes (``reskv.engine``).
Each configuration's samples go to its own resumable result file (``scripts.results_store``).
Everything that can be wrong in a plan is checked before the model loads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import benchmarks
from baselines.registry import (
    FULL_METHOD,
    METHODS,
    OPTIONS,
    REGISTRY,
    RESIDUAL_SUFFIX,
    SPECS,
    OptionValue,
    base_of,
)
from benchmarks.item import Item
from reskv.config import SETTINGS, ResidualConfig
from reskv.harness.records import MethodLabel, SampleRecord
from scripts.results_store import (
    ResultFile,
    ResultFileLocked,
    ResultKey,
    ResultStoreError,
    prompt_digest,
    write_unavailable,
)

if TYPE_CHECKING:
    from reskv.backbones import Backbone
    from reskv.engine import Method

log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class PlanError(ValueError):
    """A bad run configuration; the message names the bad value and the valid choices."""


def as_list(value: Any) -> list:
    """A config value that may be one item or a list of them, as a list."""
    if value is None:
        return []
    if isinstance(value, str | int | float | bool):
        return [value]
    return list(value)


def residual_config(options: Mapping[str, Any]) -> ResidualConfig:
    """ResidualConfig from the ``reskv`` config node (lists become tuples), with a clear error."""
    names = [spec.name for spec in fields(ResidualConfig)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise PlanError(f"unknown reskv option(s) {unknown}; valid options: {names}")
    values = {
        name: tuple(value) if isinstance(value, list | tuple) else value for name, value in options.items()
    }
    try:
        return ResidualConfig(**values)
    except (TypeError, ValueError) as error:
        raise PlanError(f"bad reskv options: {error}") from error


def method_options(
    method: str, residual: ResidualConfig, options: Mapping[str, OptionValue]
) -> dict[str, OptionValue]:
    """The options that change what ``method`` computes: ResKV's for ``+reskv``, then the base
    method's registry options (``options`` holds the plan's values; defaults where absent)."""
    chosen: dict[str, Any] = {}
    if method.endswith(RESIDUAL_SUFFIX):
        chosen.update({spec.name: getattr(residual, spec.name) for spec in fields(ResidualConfig)})
    for option in SPECS[base_of(method)].options:
        chosen[option.name] = options.get(option.name, option.default)
    return chosen


def method_label(method: str, residual: ResidualConfig, options: Mapping[str, OptionValue]) -> str:
    """Method name plus its non-default options: what the result paths and the tables call it.

    Ablations and hyper-parameter changes thus never overwrite the default method's results:
    ``snapkv+reskv~validate=false``, ``snapkv+reskv~alpha=8,tau=0.3``, ``h2o~h2o_window_only=true``.
    """
    defaults = method_options(method, ResidualConfig(), {})
    chosen = method_options(method, residual, options)
    return str(
        MethodLabel(method, {name: value for name, value in chosen.items() if value != defaults[name]})
    )


@dataclass(frozen=True)
class GridEntry:
    """One configuration of the grid; ``setting`` and ``ratio`` are None for the full cache.

    ``residual`` and ``options`` (the base method's registry options, as name-value pairs) are
    the options this entry runs with: the plan's, with the overrides its method list entry
    names (``snapkv+reskv~validate=false``)."""

    method: str
    ratio: float | None
    setting: str | None
    label: str
    residual: ResidualConfig = ResidualConfig()
    options: tuple[tuple[str, OptionValue], ...] = ()

    def key(self, plan: Plan, task: str) -> ResultKey:
        return ResultKey(
            plan.backbone, plan.benchmark, plan.length, task, self.setting, self.label, self.ratio
        )

    def describe(self) -> str:
        if self.method == FULL_METHOD:
            return FULL_METHOD
        return f"{self.setting} {self.label} {self.ratio:g}"


@dataclass(frozen=True)
class Plan:
    """A validated run: everything needed to load, run and file a grid."""

    backbone: str
    dtype: str
    device: str
    benchmark: str
    length: int
    tasks: tuple[str, ...]
    benchmark_options: dict[str, Any]
    num_samples: int | None
    seed: int
    methods: tuple[str, ...]
    ratios: tuple[float, ...]
    settings: tuple[str, ...]
    residual: ResidualConfig
    method_options: dict[str, OptionValue]  # every registered base-method option (baselines.registry)
    shard_index: int
    shard_count: int
    share_prefill: bool
    max_new_tokens: int | None
    results_dir: Path
    grid: tuple[GridEntry, ...] = field(default=())
    quality: bool = False  # record reskv.quality's measures with every sample (backbone.quality)

    @property
    def runs_dir(self) -> Path:
        return self.results_dir / "runs"

    def shard_range(self, total: int) -> tuple[int, int]:
        """This job's contiguous block of a task's ``total`` samples."""
        start = self.shard_index * total // self.shard_count
        return start, (self.shard_index + 1) * total // self.shard_count

    def identity(self, entry: GridEntry, dtype: str) -> dict[str, Any]:
        """What a result file must agree on to be resumed (stored as its ``config``)."""
        options = method_options(entry.method, entry.residual, dict(entry.options))
        return {
            "backbone": {"name": self.backbone, "dtype": dtype},
            "benchmark": {"name": self.benchmark, "length": self.length, "options": self.benchmark_options},
            "method": entry.method,
            "method_options": {
                name: list(value) if isinstance(value, tuple) else value for name, value in options.items()
            },
            "ratio": entry.ratio,
            "setting": entry.setting,
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
        }

    def answer_length(self, item: Item) -> int:
        if self.max_new_tokens is None:
            return item.max_new_tokens
        return min(item.max_new_tokens, self.max_new_tokens)


def _choose(kind: str, values: Iterable, choices: Sequence) -> None:
    for value in values:
        if value not in choices:
            raise PlanError(f"unknown {kind} {value!r}; choose from {list(choices)}")


def _ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise PlanError(
            f"ratio {value!r} must be a number strictly between 0 and 1 (the fraction of the "
            "prompt's KV cache evicted; the paper uses 0.6, 0.7, 0.8, 0.9)"
        )
    return float(value)


def parse_method(
    entry: str, residual: ResidualConfig, options: Mapping[str, OptionValue]
) -> tuple[str, ResidualConfig, dict[str, OptionValue]]:
    """A method list entry, a name optionally followed by option overrides in the label syntax
    (``MethodLabel``): ``snapkv+reskv~validate=false``, ``h2o~h2o_window_only=true``. Returns the
    name and the options it runs with (the plan's, overridden), so ablations can share a grid."""
    try:
        label = MethodLabel.parse(entry)
    except ValueError as error:
        raise PlanError(str(error)) from error
    _choose("method", [label.method], METHODS)
    overrides, base_options = dict(label.options), dict(options)
    for name in [name for name in overrides if name in OPTIONS]:
        owner = SPECS[label.base].option(name)
        if owner is None:
            owners = [
                f"{spec.name} and {spec.name}{RESIDUAL_SUFFIX}" for spec in REGISTRY if spec.option(name)
            ]
            raise PlanError(f"{entry!r}: {name} applies to {' and '.join(owners)} only")
        try:
            base_options[name] = owner.check(overrides.pop(name))
        except ValueError as error:
            raise PlanError(f"{entry!r}: {error}") from error
    if overrides and not label.residual:
        raise PlanError(f"{entry!r}: ResKV options {sorted(overrides)} need a {RESIDUAL_SUFFIX} method")
    if overrides:
        current = {spec.name: getattr(residual, spec.name) for spec in fields(ResidualConfig)}
        residual = residual_config({**current, **overrides})
    return label.method, residual, base_options


def build_grid(
    methods: Sequence[str],
    ratios: Sequence[float],
    settings: Sequence[str],
    residual: ResidualConfig,
    options: Mapping[str, OptionValue],
) -> tuple[GridEntry, ...]:
    """Every (method, ratio, setting); the full cache once (it compresses nothing and its two
    settings are the same computation, see ``reskv.engine``). A method may carry option overrides
    (``parse_method``)."""
    entries = []
    for entry in methods:
        method, method_residual, method_options_ = parse_method(entry, residual, options)
        label = method_label(method, method_residual, method_options_)
        # Only the options the method takes: entries differing in another method's option are equal.
        own = tuple(
            (option.name, method_options_.get(option.name, option.default))
            for option in SPECS[base_of(method)].options
        )
        if method == FULL_METHOD:
            entries.append(GridEntry(method, None, None, label, method_residual, own))
            continue
        entries.extend(
            GridEntry(method, ratio, setting, label, method_residual, own)
            for setting in settings
            for ratio in ratios
        )
    return tuple(dict.fromkeys(entries))


def make_plan(config: Mapping[str, Any]) -> Plan:
    """Validate a run configuration (the resolved Hydra config as plain containers)."""
    backbone, benchmark = config["backbone"], config["benchmark"]
    if benchmark["name"] not in benchmarks.BENCHMARKS:
        raise PlanError(f"unknown benchmark {benchmark['name']!r}; choose from {list(benchmarks.BENCHMARKS)}")
    methods = tuple(as_list(config["method"]))
    settings = tuple(as_list(config["setting"]))
    if not methods or not settings:
        raise PlanError("method and setting need at least one value each")
    _choose("setting", settings, SETTINGS)
    ratios = tuple(_ratio(value) for value in as_list(config["ratio"]))
    if not ratios and set(methods) != {FULL_METHOD}:
        raise PlanError("ratio needs at least one value for a compressing method")
    task_spec = benchmark["tasks"]
    task_sets = benchmarks.task_sets(benchmark["name"])
    available = benchmarks.tasks(benchmark["name"])
    if isinstance(task_spec, str) and task_spec in task_sets:
        tasks = tuple(task_sets[task_spec])
    else:
        tasks = tuple(as_list(task_spec))
        _choose(f"{benchmark['name']} task", tasks, [*task_sets, *available])
    if not tasks:
        raise PlanError(f"no tasks selected; choose from {list(task_sets)} or {list(available)}")
    num_samples = config["num_samples"]
    if num_samples is not None and (
        isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1
    ):
        raise PlanError(f"num_samples {num_samples!r} must be a positive integer or null (every sample)")
    length = benchmark["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise PlanError(f"benchmark.length {length!r} must be a positive number of tokens")
    shard = config["shard"]
    if not 0 <= shard["index"] < shard["count"]:
        raise PlanError(f"shard.index {shard['index']} must lie in [0, shard.count={shard['count']})")
    max_new_tokens = config["max_new_tokens"]
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise PlanError(
            f"max_new_tokens {max_new_tokens!r} must be a positive integer or null (the benchmark's own)"
        )
    quality = backbone.get("quality", False)
    if not isinstance(quality, bool):
        raise PlanError(f"backbone.quality {quality!r} must be true or false (record the quality measures)")
    residual = residual_config(config["reskv"])
    try:  # each registered base-method option is a top-level config key (configs/config.yaml)
        options = {name: option.check(config[name]) for name, option in OPTIONS.items()}
    except ValueError as error:
        raise PlanError(str(error)) from error
    return Plan(
        backbone=backbone["name"],
        dtype=backbone["dtype"],
        device=backbone["device"],
        benchmark=benchmark["name"],
        length=length,
        tasks=tasks,
        benchmark_options=dict(benchmark.get("options") or {}),
        num_samples=num_samples,
        seed=int(config["seed"]),
        methods=methods,
        ratios=ratios,
        settings=settings,
        residual=residual,
        method_options=options,
        shard_index=shard["index"],
        shard_count=shard["count"],
        share_prefill=bool(config["share_prefill"]),
        max_new_tokens=max_new_tokens,
        results_dir=Path(config["results_dir"]),
        grid=build_grid(methods, ratios, settings, residual, options),
        quality=quality,
    )


def compose_plan(overrides: Sequence[str]) -> Plan:
    """The plan ``python run.py <overrides>`` runs, for scripts and tests that run grids in-process.

    ``results_dir`` defaults to ``results`` under the current directory here (run.py's default
    needs a running Hydra application); pass ``results_dir=...`` to choose.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config = compose("config", overrides=[f"results_dir={Path('results').resolve()}", *overrides])
    return make_plan(OmegaConf.to_container(config, resolve=True))


def run_plan(plan: Plan, backbone: Backbone) -> None:
    """Run a plan in this process, without progress display (the run.py loop minus its reporting)."""
    grid = GridRun(plan, backbone, load_task_items(plan, backbone.tokenizer))
    grid.open()
    grid.run()


def load_task_items(plan: Plan, tokenizer) -> dict[str, list[Item]]:
    """Items of every task of the plan; a task whose data is missing here is marked unavailable.

    When every task of the plan is unavailable there is nothing to run: a PlanError says why.
    """
    items, reasons = {}, []
    for task in plan.tasks:
        try:
            items[task] = benchmarks.load_items(
                plan.benchmark,
                task,
                tokenizer,
                length=plan.length,
                num_samples=plan.num_samples,
                **plan.benchmark_options,
            )
        except benchmarks.TaskUnavailable as error:
            key = ResultKey(plan.backbone, plan.benchmark, plan.length, task, None, FULL_METHOD, None)
            path = write_unavailable(plan.runs_dir, key, str(error))
            reasons.append(f"{task}: {error}")
            log.warning(
                "%s/%s unavailable, excluded from averages: %s (marked in %s)",
                plan.benchmark,
                task,
                error,
                path,
            )
    if not items:
        raise PlanError(f"every requested {plan.benchmark} task is unavailable here; " + "; ".join(reasons))
    return items


def sample_prompt(index: int, item: Item, max_new_tokens: int) -> dict[str, Any]:
    """What a sample record says about its prompt, whether it was generated or skipped."""
    return {
        "index": index,
        "prompt_digest": prompt_digest(item.prompt_ids),
        "prompt_tokens": item.length,
        "context_tokens": item.context_length,
        "max_new_tokens": max_new_tokens,
        "references": list(item.references),
        "metric": item.metric,
        "metadata": item.metadata,
    }


def sample_record(
    index: int,
    item: Item,
    max_new_tokens: int,
    generation,
    score: float,
    prefill_timings: dict[str, float],
    shared_by: int,
) -> SampleRecord:
    """One generated sample's entry of a result file (``score`` a fraction in [0, 1]).

    Wall-clock values go under ``timings`` only: the shared prefills of the prompt (``prefill_s``
    for the context, ``question_prefill_s`` for the question when a query-aware configuration
    needed it) with ``prefill_shared_by`` configurations, and this configuration's own
    ``compress_s``, ``question_s`` (query-agnostic), ``decode_s`` and ``quality_s``; ``quality``
    holds ``reskv.quality``'s measures when the plan records them.
    """
    return SampleRecord(
        **sample_prompt(index, item, max_new_tokens),
        score=score,
        prediction=generation.text,
        prediction_token_ids=list(generation.token_ids),
        cache_stats=generation.cache_stats,
        timings={**prefill_timings, **generation.timings, "prefill_shared_by": shared_by},
        quality=generation.quality,
    )


def skipped_record(index: int, item: Item, max_new_tokens: int, reason: str) -> SampleRecord:
    """A sample that was not run, and why: no prediction, ``score`` None (summaries leave it out)."""
    return SampleRecord(**sample_prompt(index, item, max_new_tokens), skipped=reason)


@dataclass
class GridRun:
    """The open result files of a plan and the methods they need; ``run`` fills them.

    ``on_sample`` is called after every generation or skip (progress bars), ``on_finished`` with
    the entry, task and final document as soon as a configuration completes its sample range
    (``None`` for one that an earlier run completed).
    """

    plan: Plan
    backbone: Backbone
    items: dict[str, list[Item]]
    on_sample: Callable[[], None] = lambda: None
    on_finished: Callable[[GridEntry, str, dict[str, Any] | None], None] = lambda entry, task, document: None
    files: dict[tuple[str, GridEntry], ResultFile] = field(default_factory=dict)
    methods: dict[tuple[str, float | None], Method] = field(default_factory=dict)  # by (label, ratio)

    def __post_init__(self) -> None:
        from baselines import build_method

        plan = self.plan
        for entry in plan.grid:
            if (entry.label, entry.ratio) not in self.methods:
                residual = entry.residual if entry.method.endswith(RESIDUAL_SUFFIX) else None
                self.methods[entry.label, entry.ratio] = build_method(
                    entry.method,
                    entry.ratio,
                    residual=residual,
                    seed=plan.seed,
                    options=dict(entry.options),
                )

    @property
    def environment(self) -> dict[str, Any]:
        """Where this run's timings were taken (stored in each new result file's provenance)."""
        import torch

        model = self.backbone.model
        return {
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
        }

    def open(self) -> int:
        """Open (lock, resume) every result file; returns the number of generations still to do."""
        environment = self.environment
        task_score = functools.partial(benchmarks.task_score, self.plan.benchmark)
        for task, items in self.items.items():
            sample_range = self.plan.shard_range(len(items))
            for entry in self.plan.grid:
                result = ResultFile(
                    self.plan.runs_dir,
                    entry.key(self.plan, task),
                    sample_range,
                    len(items),
                    self.plan.identity(entry, environment["dtype"]),
                    task_score,
                    environment,
                )
                try:
                    result.open()
                except ResultFileLocked as error:
                    log.warning("skipping %s %s: %s", task, entry.describe(), error)
                    continue
                except ResultStoreError:
                    self.close()
                    raise
                self.files[task, entry] = result
                try:
                    self._check_resumed_samples(result, items)
                except ResultStoreError:
                    self.close()
                    raise
        return sum(len(result.pending) for result in self.files.values())

    def close(self) -> None:
        """Release every open result file (each writes its final JSON if complete)."""
        for result in self.files.values():
            result.close()
        self.files.clear()

    @staticmethod
    def _check_resumed_samples(result: ResultFile, items: list[Item]) -> None:
        for index, record in result.records.items():
            if index < len(items) and record["prompt_digest"] != prompt_digest(items[index].prompt_ids):
                raise ResultStoreError(
                    f"sample {index} of {result.path} was made from another prompt than the benchmark gives "
                    "now (other data, tokenizer or sample count); use another results_dir"
                )

    def run(self) -> None:
        """Every pending (task, sample, configuration); files are closed (and finished) even on error."""
        try:
            for task, items in self.items.items():
                entries = [entry for entry in self.plan.grid if (task, entry) in self.files]
                for entry in entries:
                    if not self.files[task, entry].pending:
                        self._finish(task, entry)
                for index in range(*self.plan.shard_range(len(items))):
                    pending = [
                        entry
                        for entry in entries
                        if (task, entry) in self.files and index not in self.files[task, entry].records
                    ]
                    if pending:
                        self._run_sample(task, index, items[index], pending)
        finally:
            self.close()

    def _finish(self, task: str, entry: GridEntry) -> None:
        self.on_finished(entry, task, self.files.pop((task, entry)).close())

    def _file(self, task: str, entry: GridEntry, record: SampleRecord) -> None:
        """Persist one sample record; a configuration whose range is now complete is finished at once."""
        result = self.files[task, entry]
        result.append(record.to_json())
        self.on_sample()
        if not result.pending:
            self._finish(task, entry)

    def skip_reason(self, entry: GridEntry, item: Item) -> str | None:
        """Why this configuration cannot run this sample, found before the prefill; None if it can.

        The positions must fit the backbone (prompt + answer <= max_position_embeddings), and the
        ratio must leave at least one KV slot for what the setting compresses (the whole prompt
        query-aware, the context query-agnostic; budget as in reskv.md, Budget).
        """
        from reskv.config import budget_for

        max_new_tokens = self.plan.answer_length(item)
        max_positions = self.backbone.model.config.max_position_embeddings
        if item.length + max_new_tokens > max_positions:
            return (
                f"{item.length} prompt tokens + {max_new_tokens} new tokens exceed the backbone's "
                f"max_position_embeddings {max_positions}"
            )
        if entry.ratio is None:
            return None
        compressed = item.length if entry.setting == "aware" else item.context_length
        if budget_for(compressed, entry.ratio) < 1:
            return (
                f"ratio {entry.ratio:g} leaves no KV slot for the {compressed} tokens the "
                f"{entry.setting} setting compresses (budget floor({compressed} * (1 - {entry.ratio:g})) = 0)"
            )
        return None

    def _run_sample(self, task: str, index: int, item: Item, pending: list[GridEntry]) -> None:
        from reskv.engine import Prefill

        max_new_tokens = self.plan.answer_length(item)
        runnable = []
        for entry in pending:
            reason = self.skip_reason(entry, item)
            if reason is None:
                runnable.append(entry)
            else:
                log.warning("%s sample %d %s skipped: %s", task, index, entry.describe(), reason)
                self._file(task, entry, skipped_record(index, item, max_new_tokens, reason))
        shared_by = len(runnable) if self.plan.share_prefill else 1
        answer_ids = item.answer_ids(self.backbone.tokenizer) if self.plan.quality else None
        prefill = None
        for entry in runnable:
            if prefill is None or not self.plan.share_prefill:
                served = runnable if self.plan.share_prefill else [entry]
                prefill = Prefill(
                    self.backbone,
                    item.prompt_ids,
                    item.context_length,
                    [self.methods[other.label, other.ratio] for other in served],
                )
                if any(other.setting != "agnostic" for other in served):
                    # The question's prefill now, shared, rather than inside the first query-aware
                    # generation's compress_s (where it made the full cache's compress_s non-zero).
                    prefill.observations("aware")
            generation = prefill.generate(
                self.methods[entry.label, entry.ratio],
                entry.setting or "aware",
                max_new_tokens=max_new_tokens,
                stop_token_ids=item.stop_token_ids,
                min_new_tokens=min(item.min_new_tokens, max_new_tokens),
                answer_ids=answer_ids,
            )
            score = benchmarks.score_item(item, generation.text)
            self._file(
                task,
                entry,
                sample_record(index, item, max_new_tokens, generation, score, prefill.timings, shared_by),
            )
