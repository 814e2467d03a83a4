"""The method registry: base scoring rules by name, alone or composed with ResKV (baselines.md).

``build_method("snapkv+reskv", 0.9)`` gives SnapKV's scores and allocation with part of each
head's budget spent on residual entries; ``cam`` is SnapKV selection plus CaM value merging;
``full`` keeps the whole cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baselines.names import BASE_METHODS, METHODS, RESIDUAL_BASES, RESIDUAL_SUFFIX
from reskv.config import ResidualConfig

if TYPE_CHECKING:
    from reskv.engine import Method

__all__ = ["BASE_METHODS", "METHODS", "RESIDUAL_BASES", "RESIDUAL_SUFFIX", "build_method", "build_scorer"]


def build_scorer(base: str, seed: int = 42, h2o_window_only: bool = False):
    """A fresh scorer for a base method name (``seed`` is CaM's merge sampling seed).

    The rules (and torch) are imported here, not at the top: the runner reads the names in
    ``baselines.names`` before it loads torch, and importing that module runs this package first.
    """
    from baselines.adakv import AdaKV
    from baselines.cam import CaM
    from baselines.h2o import H2O
    from baselines.snapkv import SnapKV
    from baselines.tova import TOVA

    return {
        "h2o": lambda: H2O(window_only=h2o_window_only),
        "tova": TOVA,
        "snapkv": SnapKV,
        "adakv": AdaKV,
        "cam": lambda: CaM(seed=seed),
    }[base]()


def build_method(
    name: str,
    ratio: float | None = None,
    *,
    residual: ResidualConfig | None = None,
    seed: int = 42,
    h2o_window_only: bool = False,
) -> Method:
    """A method by command-line name at a compression ratio in (0, 1).

    ``residual`` sets ResKV's hyper-parameters and ablations for ``+reskv`` names (paper defaults
    when omitted); it is an error on a name without ``+reskv``.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {list(METHODS)}")
    if name == "full":
        from reskv.engine import Method

        return Method("full")
    if ratio is None or not 0 < ratio < 1:
        raise ValueError(f"compression ratio {ratio!r} for {name!r} must lie strictly between 0 and 1")
    base = name.removesuffix(RESIDUAL_SUFFIX)
    with_residual = name.endswith(RESIDUAL_SUFFIX)
    if residual is not None and not with_residual:
        raise ValueError(
            f"residual settings given for {name!r}; use one of "
            f"{[b + RESIDUAL_SUFFIX for b in RESIDUAL_BASES]}"
        )
    from reskv.engine import Method

    scorer = build_scorer(base, seed, h2o_window_only)
    return Method(name, ratio, scorer, (residual or ResidualConfig()) if with_residual else None)
