"""The method registry: every method the harness runs, declared once, without importing torch.

Each ``MethodSpec`` names a method as the command line spells it, as the tables and figures show
it, the scorer class that implements it (imported only when a method is built), whether it pairs
with ``+reskv``, the options it takes and the spec section it follows. Everything else reads it:
``run.py`` validates a configuration and prints ``--help`` from it before torch is loaded,
``baselines.build_method`` builds from it, the runner files option overrides by it
(``scripts.harness.records.MethodLabel``), the tables and figures take their rows, pairs and
display names from it, and the README's method list is checked against it
(``tests/test_registry.py``). A new baseline is its file in ``baselines/`` plus one line in
``REGISTRY``; a new option of a baseline is one ``MethodOption`` in its line, and a new ResKV
option one field of ``reskv.config.ResidualConfig`` (``RESKV_OPTIONS``): the Hydra configuration
takes its keys and defaults from these declarations (``scripts.harness.plan.option_defaults``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from reskv.config import ResidualConfig

RESIDUAL_SUFFIX = "+reskv"
FULL_METHOD = "full"
OptionValue = bool | int | float | str | tuple


def check_option(name: str, default: OptionValue, value: object) -> OptionValue:
    """``value`` as the type of the option's ``default`` (an int for a float, a list for a tuple);
    a ``ValueError`` naming the option, the value and what it takes otherwise."""
    kind = type(default)
    if type(value) is kind or (kind, type(value)) in ((float, int), (tuple, list)):
        return kind(value)
    takes = "true or false" if kind is bool else f"a {kind.__name__}"
    raise ValueError(f"option {name} takes {takes}, got {value!r}")


@dataclass(frozen=True)
class MethodOption:
    """An option of a base method: its name in labels and in the config (``h2o_window_only=true``),
    its default (whose type is the option's type) and the scorer's constructor keyword it sets."""

    name: str
    default: OptionValue
    argument: str
    help: str

    def check(self, value: object) -> OptionValue:
        return check_option(self.name, self.default, value)


@dataclass(frozen=True)
class MethodSpec:
    """One method of the registry (a base method; ``name + RESIDUAL_SUFFIX`` is its +ResKV form)."""

    name: str
    display: str  # as tables, figures and the README name it
    scorer: str | None  # "module:Class" of its TokenScorer; None for the full cache
    pairs_with_reskv: bool  # whether ``name+reskv`` exists (a baseline / +ResKV pair in the tables)
    spec: str  # the section of docs/spec/baselines.md it follows
    options: tuple[MethodOption, ...] = ()
    takes_seed: bool = False  # the run's seed goes to the scorer's ``seed`` (CaM's merge sampling)

    def option(self, name: str) -> MethodOption | None:
        return next((option for option in self.options if option.name == name), None)

    def option_defaults(self) -> dict[str, OptionValue]:
        return {option.name: option.default for option in self.options}


# The tables' row order: the baselines with a +ResKV pair (the paper's AdaKV first), then the rest.
REGISTRY = (
    MethodSpec("full", "Full Cache", None, False, "Full cache"),
    MethodSpec(
        "adakv", "AdaKV", "baselines.adakv:AdaKV", True, "AdaKV (SnapKV scores, safeguard alpha = 0.2)"
    ),
    MethodSpec("snapkv", "SnapKV", "baselines.snapkv:SnapKV", True, "SnapKV (W = 64, avg-pool kernel 5)"),
    MethodSpec(
        "h2o",
        "H2O",
        "baselines.h2o:H2O",
        True,
        "H2O (protect last 64)",
        options=(
            MethodOption(
                "h2o_window_only",
                False,
                "window_only",
                "score from the protected window's queries only instead of every prefill query",
            ),
        ),
    ),
    MethodSpec("tova", "TOVA", "baselines.tova:TOVA", True, "TOVA (protect the last token)"),
    MethodSpec(
        "streamingllm",
        "StreamingLLM",
        "baselines.streamingllm:StreamingLLM",
        True,
        "StreamingLLM (4 sinks, recent window)",
    ),
    MethodSpec(
        "pyramidkv",
        "PyramidKV",
        "baselines.pyramidkv:PyramidKV",
        True,
        "PyramidKV (pyramid layer budgets, beta = 20, W = 32)",
    ),
    MethodSpec(
        "cam", "CaM", "baselines.cam:CaM", False, "CaM (merging on top of SnapKV selection)", takes_seed=True
    ),
)
SPECS = {spec.name: spec for spec in REGISTRY}
BASE_METHODS = tuple(spec.name for spec in REGISTRY if spec.scorer is not None)
RESIDUAL_BASES = tuple(spec.name for spec in REGISTRY if spec.pairs_with_reskv)
UNPAIRED_METHODS = tuple(name for name in BASE_METHODS if name not in RESIDUAL_BASES)
METHODS = (FULL_METHOD, *BASE_METHODS, *(base + RESIDUAL_SUFFIX for base in RESIDUAL_BASES))
OPTIONS = {option.name: option for spec in REGISTRY for option in spec.options}
# What every +reskv method takes besides its base's options, by name with its default.
RESKV_OPTIONS = {spec.name: spec.default for spec in fields(ResidualConfig)}


def method_option_defaults(method: str) -> dict[str, OptionValue]:
    """Every option a method name takes, at its default: ResKV's for ``+reskv``, then its base's."""
    defaults = dict(RESKV_OPTIONS) if method.endswith(RESIDUAL_SUFFIX) else {}
    return defaults | SPECS[base_of(method)].option_defaults()


def option_default(name: str) -> OptionValue | None:
    """The default of a declared option, a base method's or ResKV's; None for a name not declared."""
    return OPTIONS[name].default if name in OPTIONS else RESKV_OPTIONS.get(name)


def base_of(method: str) -> str:
    """The base method of a method name (``snapkv+reskv`` -> ``snapkv``)."""
    return method.removesuffix(RESIDUAL_SUFFIX)
