"""What run.py runs: a run configuration validated into a plan and its grid of configurations.

A plan is one backbone, one benchmark at one length, some tasks, and a grid of (method, ratio,
setting) configurations, each with the method options it runs with (a method list entry may
override them in the label syntax, ``scripts.harness.records.MethodLabel``). Everything that can
be wrong in a plan is checked here, before the model loads; ``scripts.harness.grid`` runs it.

The method options' config keys and defaults come from their declarations in the registry
(``option_defaults``); configs/ names the node that holds them and sets none of them itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

import benchmarks
from baselines.registry import (
    FULL_METHOD,
    METHODS,
    OPTIONS,
    REGISTRY,
    RESIDUAL_SUFFIX,
    RESKV_OPTIONS,
    SPECS,
    OptionValue,
    base_of,
    check_option,
    method_option_defaults,
)
from benchmarks.item import Item
from reskv.batching import check_decode_batch
from reskv.config import AUTO, COMPILED_WITHOUT_SHARED_SOFTMAX, DECODE_CHOICES, SETTINGS, ResidualConfig
from scripts.harness.records import MethodLabel
from scripts.harness.store import ResultKey

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
OPTIONS_NODE = "method_options"  # configs/config.yaml's defaults list names it


class PlanError(ValueError):
    """A bad run configuration; the message names the bad value and the valid choices."""


def as_list(value: Any) -> list:
    """A config value that may be one item or a list of them, as a list."""
    if value is None:
        return []
    if isinstance(value, str | int | float | bool):
        return [value]
    return list(value)


def option_defaults() -> dict[str, Any]:
    """Every method option at its default, as the configuration holds them: each base method's
    registered options as top-level keys, ResKV's under ``reskv`` (``baselines.registry``)."""
    return {**{name: option.default for name, option in OPTIONS.items()}, "reskv": dict(RESKV_OPTIONS)}


# At import, not in run.py's main block: the processes of a multirun launcher (joblib, submitit)
# compose their configuration again, and they import this module but never run run.py's block.
ConfigStore.instance().store(name=OPTIONS_NODE, node=option_defaults())


def residual_config(options: Mapping[str, Any]) -> ResidualConfig:
    """ResidualConfig from ResKV option values by name, each of its default's type (a list for
    the grid), with a clear error."""
    unknown = sorted(set(options) - set(RESKV_OPTIONS))
    if unknown:
        raise PlanError(f"unknown reskv option(s) {unknown}; valid options: {list(RESKV_OPTIONS)}")
    try:
        values = {name: check_option(name, RESKV_OPTIONS[name], value) for name, value in options.items()}
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
        chosen.update({name: getattr(residual, name) for name in RESKV_OPTIONS})
    for option in SPECS[base_of(method)].options:
        chosen[option.name] = options.get(option.name, option.default)
    return chosen


def non_default_options(
    method: str, residual: ResidualConfig, options: Mapping[str, OptionValue]
) -> dict[str, OptionValue]:
    """``method_options`` that differ from their defaults: what a label names and a result's identity
    stores, so that an option added with a default changes neither for earlier configurations."""
    defaults = method_option_defaults(method)
    return {
        name: value
        for name, value in method_options(method, residual, options).items()
        if value != defaults[name]
    }


def method_label(method: str, residual: ResidualConfig, options: Mapping[str, OptionValue]) -> str:
    """Method name plus its non-default options: what the result paths and the tables call it.

    Ablations and hyper-parameter changes thus never overwrite the default method's results:
    ``snapkv+reskv~validate=false``, ``snapkv+reskv~alpha=8,tau=0.3``, ``h2o~h2o_window_only=true``.
    """
    return str(MethodLabel(method, non_default_options(method, residual, options)))


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
    decode: str = "eager"  # reskv.config.DECODE_CHOICES ("auto": by device, reskv.batching.grid_decoding)
    decode_batch: int | str = 1  # most configurations of a sample decoded together (reskv.grid), or "auto"
    grid: tuple[GridEntry, ...] = field(default=())
    quality: bool = False  # record reskv.quality's measures with every sample (backbone.quality)
    jobs_per_gpu: int = 1  # a sweep's jobs that may share one GPU (scripts.harness.devices)

    @property
    def runs_dir(self) -> Path:
        return self.results_dir / "runs"

    def shard_range(self, total: int) -> tuple[int, int]:
        """This job's contiguous block of a task's ``total`` samples."""
        start = self.shard_index * total // self.shard_count
        return start, (self.shard_index + 1) * total // self.shard_count

    def identity(self, entry: GridEntry, dtype: str) -> dict[str, Any]:
        """What a result file must agree on to be resumed (stored as its ``config``). Its method
        options are those that differ from their defaults, as in the label; a file that stored
        every option (as files written earlier did) is compared without its defaults
        (``scripts.harness.store.without_default_options``)."""
        options = non_default_options(entry.method, entry.residual, dict(entry.options))
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
        current = {name: getattr(residual, name) for name in RESKV_OPTIONS}
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
    _choose("decode mode", [config["decode"]], DECODE_CHOICES)
    try:
        decode_batch = check_decode_batch(config["decode_batch"])
    except ValueError as error:
        raise PlanError(str(error)) from error
    if decode_batch != AUTO and decode_batch > 1 and not config["share_prefill"]:
        raise PlanError(
            f"decode_batch {decode_batch} batches the configurations of one shared prefill; "
            "use decode_batch=1 with share_prefill=false"
        )
    jobs_per_gpu = config.get("jobs_per_gpu", 1)
    if isinstance(jobs_per_gpu, bool) or not isinstance(jobs_per_gpu, int) or jobs_per_gpu < 1:
        raise PlanError(f"jobs_per_gpu {jobs_per_gpu!r} must be a positive integer (1: a GPU for each job)")
    quality = backbone.get("quality", False)
    if not isinstance(quality, bool):
        raise PlanError(f"backbone.quality {quality!r} must be true or false (record the quality measures)")
    residual = residual_config(config["reskv"])
    if config["decode"] == "compiled" and not residual.compiles:
        raise PlanError(COMPILED_WITHOUT_SHARED_SOFTMAX)
    try:  # each registered base-method option is a top-level config key (option_defaults)
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
        decode=config["decode"],
        decode_batch=decode_batch,
        grid=build_grid(methods, ratios, settings, residual, options),
        quality=quality,
        jobs_per_gpu=jobs_per_gpu,
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
