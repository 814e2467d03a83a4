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
README.md, "Adding a method or an option", lists every step.

Each line is checked as it is declared, at import: its scorer must name a ``TokenScorer``
subclass, which is read from the modules' source (``scorer_problem``), so that a typo stops
``--help`` and every run before torch or a model loads, with the line and what is wrong.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import KW_ONLY, dataclass, fields
from pathlib import Path

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


SCORER_BASE = ("reskv.scoring", "TokenScorer")  # what every scorer class derives from


@functools.cache
def _classes(module: str) -> dict[str, list[tuple[str, str]]] | None:
    """The classes ``module`` defines at its top level, each with its bases as ``(module, name)``
    (where the module's imports say a name comes from), read from its source without importing it;
    None when there is no such module."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not (found.origin or "").endswith(".py"):
        return None
    tree = ast.parse(Path(found.origin).read_text(), found.origin)
    names, modules = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), found.parent)
            names |= {alias.asname or alias.name: (source, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name: alias.name for alias in node.names}
    classes = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = [
                names.get(base.id, (module, base.id))
                if isinstance(base, ast.Name)
                else (modules.get(ast.unparse(base.value), ""), base.attr)
                for base in node.bases
                if isinstance(base, ast.Name | ast.Attribute)
            ]
    return classes


def _derives_from_scorer(module: str, name: str, seen: frozenset = frozenset()) -> bool:
    if (module, name) == SCORER_BASE:
        return True
    bases = (_classes(module) or {}).get(name, [])
    return (module, name) not in seen and any(
        _derives_from_scorer(*base, seen | {(module, name)}) for base in bases
    )


def scorer_problem(scorer: str) -> str | None:
    """What is wrong with a scorer written ``"module:Class"``; None when it names a subclass of
    ``reskv.scoring.TokenScorer``. Nothing is imported: the registry stays torch-free."""
    module, separator, name = scorer.partition(":")
    if not (module and separator and name):
        return "write it as 'module:Class', e.g. 'baselines.snapkv:SnapKV'"
    classes = _classes(module)
    if classes is None:
        return f"no module {module} (a method's rule is its file, baselines/<name>.py for baselines.<name>)"
    if name not in classes:
        return f"module {module} defines no class {name}; its classes: {sorted(classes)}"
    if not _derives_from_scorer(module, name):
        return (
            f"{name} does not derive from reskv.scoring.TokenScorer (directly, or through a rule like SnapKV)"
        )
    return None


@dataclass(frozen=True)
class MethodSpec:
    """One method of the registry (a base method; ``name + RESIDUAL_SUFFIX`` is its +ResKV form).
    A line whose scorer names no ``TokenScorer`` is refused as it is declared (``scorer_problem``)."""

    name: str
    display: str  # as tables, figures and the README name it
    scorer: str | None  # "module:Class" of its TokenScorer; None for the full cache
    spec: str  # the section of docs/spec/baselines.md it follows: its "## " heading
    _: KW_ONLY
    pairs_with_reskv: bool = False  # whether ``name+reskv`` exists (a baseline / +ResKV pair in the tables)
    options: tuple[MethodOption, ...] = ()
    takes_seed: bool = False  # the run's seed goes to the scorer's ``seed`` (CaM's merge sampling)

    def __post_init__(self) -> None:
        problem = None if self.scorer is None else scorer_problem(self.scorer)
        if problem:
            raise ValueError(
                f"baselines/registry.py, the line of {self.name!r}: scorer {self.scorer!r}: {problem}"
            )

    def option(self, name: str) -> MethodOption | None:
        return next((option for option in self.options if option.name == name), None)

    def option_defaults(self) -> dict[str, OptionValue]:
        return {option.name: option.default for option in self.options}


# The tables' row order: the baselines with a +ResKV pair (the paper's AdaKV first), then the rest.
REGISTRY = (
    MethodSpec("full", "Full Cache", None, "Full cache"),
    MethodSpec(
        "adakv",
        "AdaKV",
        "baselines.adakv:AdaKV",
        "AdaKV (SnapKV scores, safeguard alpha = 0.2)",
        pairs_with_reskv=True,
    ),
    MethodSpec(
        "snapkv",
        "SnapKV",
        "baselines.snapkv:SnapKV",
        "SnapKV (W = 64, avg-pool kernel 5)",
        pairs_with_reskv=True,
    ),
    MethodSpec(
        "h2o",
        "H2O",
        "baselines.h2o:H2O",
        "H2O (protect last 64)",
        pairs_with_reskv=True,
        options=(
            MethodOption(
                "h2o_window_only",
                False,
                "window_only",
                "score from the protected window's queries only instead of every prefill query",
            ),
        ),
    ),
    MethodSpec("tova", "TOVA", "baselines.tova:TOVA", "TOVA (protect the last token)", pairs_with_reskv=True),
    MethodSpec(
        "streamingllm",
        "StreamingLLM",
        "baselines.streamingllm:StreamingLLM",
        "StreamingLLM (4 sinks, recent window)",
        pairs_with_reskv=True,
    ),
    MethodSpec(
        "pyramidkv",
        "PyramidKV",
        "baselines.pyramidkv:PyramidKV",
        "PyramidKV (pyramid layer budgets, beta = 20, W = 32)",
        pairs_with_reskv=True,
    ),
    MethodSpec(
        "cam", "CaM", "baselines.cam:CaM", "CaM (merging on top of SnapKV selection)", takes_seed=True
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
