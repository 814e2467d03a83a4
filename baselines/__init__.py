"""Methods built by name from the registry (``baselines.registry``), alone or composed with ResKV.

``build_method("snapkv+reskv", 0.9)`` gives SnapKV's scores and allocation with part of each
head's budget spent on residual entries; ``cam`` is SnapKV selection plus CaM value merging;
``full`` keeps the whole cache.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from baselines.registry import (
    BASE_METHODS,
    FULL_METHOD,
    METHODS,
    RESIDUAL_BASES,
    RESIDUAL_SUFFIX,
    SPECS,
    OptionValue,
    base_of,
)
from reskv.config import ResidualConfig

if TYPE_CHECKING:
    from reskv.method import Method
    from reskv.scoring import TokenScorer

__all__ = ["BASE_METHODS", "METHODS", "RESIDUAL_BASES", "RESIDUAL_SUFFIX", "build_method", "build_scorer"]


def build_scorer(base: str, seed: int = 42, options: Mapping[str, OptionValue] | None = None) -> TokenScorer:
    """A fresh scorer for a base method name; ``options`` by their registry names (defaults when
    left out), ``seed`` for a method that samples (CaM).

    The scorer's module (and torch) is imported here, not at the top: the runner reads the
    registry before it loads torch, and importing ``baselines.registry`` runs this package first.
    """
    spec = SPECS[base]
    given = dict(options or {})
    unknown = sorted(set(given) - set(spec.option_defaults()))
    if unknown:
        raise ValueError(f"{base} takes no option(s) {unknown}; its options: {list(spec.option_defaults())}")
    arguments = {
        option.argument: option.check(given.get(option.name, option.default)) for option in spec.options
    }
    if spec.takes_seed:
        arguments["seed"] = seed
    module, _, name = spec.scorer.partition(":")
    return getattr(importlib.import_module(module), name)(**arguments)


def build_method(
    name: str,
    ratio: float | None = None,
    *,
    residual: ResidualConfig | None = None,
    seed: int = 42,
    options: Mapping[str, OptionValue] | None = None,
) -> Method:
    """A method by command-line name at a compression ratio in (0, 1).

    ``residual`` sets ResKV's hyper-parameters and ablations for ``+reskv`` names (paper defaults
    when omitted); it is an error on a name without ``+reskv``. ``options`` are the base method's
    registry options (``{"h2o_window_only": True}``).
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list(METHODS)}")
    if name == FULL_METHOD:
        from reskv.method import Method

        return Method(FULL_METHOD)
    if ratio is None or not 0 < ratio < 1:
        raise ValueError(f"compression ratio {ratio!r} for {name!r} must lie strictly between 0 and 1")
    with_residual = name.endswith(RESIDUAL_SUFFIX)
    if residual is not None and not with_residual:
        raise ValueError(
            f"residual settings given for {name!r}; use one of "
            f"{[b + RESIDUAL_SUFFIX for b in RESIDUAL_BASES]}"
        )
    from reskv.method import Method

    scorer = build_scorer(base_of(name), seed, options)
    return Method(name, ratio, scorer, (residual or ResidualConfig()) if with_residual else None)
