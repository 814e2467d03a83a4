"""ResKV's settings and the budget rule, without importing torch.

The runner validates a configuration and answers ``--help`` from these before it loads torch
(``run.py``); the engine, the compressor and the attention rule use them as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from reskv.decode_rule import DecodeRule, plain_rule

SETTINGS = ("aware", "agnostic")  # query-aware and query-agnostic compression (reskv.md)
# How a generation decodes: one eager forward per token, or one compiled graph per token
# (``reskv.decoding.compiled_step``).
DECODE_MODES = ("eager", "compiled")
# What a run asks for: a mode, or "auto", which the engine resolves by device
# (``reskv.batching.grid_decoding``): on CUDA the compiled step, every configuration of a sample in
# one batch; elsewhere eager, one at a time.
AUTO = "auto"
DECODE_CHOICES = (AUTO, *DECODE_MODES)
# Queries recorded per layer during prefill: enough for SnapKV/AdaKV/CaM (64), TOVA (1) and
# the validation proxy (96 fit + 32 validation).
DEFAULT_OBSERVATION_WINDOW = 128
# The k-means distance block on CUDA is this fraction (1 / it) of the device's memory
# (``reskv.residual.distance_block_bytes``): a block is one GEMM launch and one argmin, whose host time
# does not depend on their size (results/gpu/README.md), so 4 MiB blocks would be ~30K launches per
# layer at 131K tokens; a 32nd (2.5 GiB on an 80 GB GPU) is far fewer launches per Lloyd step and layer
# batch (``scripts.bench.construction_counts`` prints the count). A larger share (an eighth) lets one
# layer's distances outgrow the forward's own activations inside a compressing prefill, which raises
# +ResKV's peak above its base's. The memory rule sets a block aside (``reskv.batching``).
DEVICE_MEMORY_SHARE = 32
# The compiled step is one graph only through the shared softmax's masked form (reskv.md, the compiled
# step); the ablation without it slices its entries by a host count, a graph per pattern of layers,
# which passes torch._dynamo's recompile limit part-way through a grid.
COMPILED_WITHOUT_SHARED_SOFTMAX = (
    "decode=compiled runs the shared softmax's one graph; the no_shared_softmax ablation "
    "(reskv.shared_softmax=false) decodes with decode=eager"
)


FINAL_SELECTIONS = ("base", "fit")


@dataclass(frozen=True)
class ResidualConfig(DecodeRule):
    """ResKV hyper-parameters and ablation switches (defaults: the paper's, reskv.md).

    The decode-time options are the inherited ``DecodeRule`` fields (gate, ``beta``, shared softmax:
    ``reskv.decode_rule``); the fields declared here are construction-time (residual size, validation,
    final selection), read while the cache is built and never by a decode step. One flat constructor
    takes every option by name; the cache layers keep ``decode_rule``, the decode-time part.
    """

    grid: tuple[float, ...] = (0.0, 0.05, 0.10, 0.15, 0.20)
    validate: bool = True  # False: "w/o validation", every head uses fixed_ratio
    fixed_ratio: float = 0.10
    delta: float = 0.01
    kmeans_iterations: int = 4
    fit_queries: int = 96
    validation_queries: int = 32
    # "base": the final main cache is selected with the base method's own scores, so a head
    # that falls back to r = 0 equals the plain baseline (this project's reading of "rebuild
    # (M, S) with the chosen r"). "fit": the literal alternative, the validated cache itself
    # (reskv.proxy.ValidationProxy.fit_selection says how it maps to the whole prompt).
    final_selection: str = "base"

    def __post_init__(self) -> None:
        if self.final_selection not in FINAL_SELECTIONS:
            raise ValueError(f"final_selection {self.final_selection!r}: choose one of {FINAL_SELECTIONS}")
        if any(not 0 <= ratio < 1 for ratio in self.grid):
            raise ValueError(f"residual grid {self.grid}: every ratio must lie in [0, 1)")
        if min(self.fit_queries, self.validation_queries) < 1:
            raise ValueError("fit_queries and validation_queries must be at least 1")

    @property
    def decode_rule(self) -> DecodeRule:
        """The decode-time part, the plain ``DecodeRule`` a cache's layers hold (``plain_rule``)."""
        return plain_rule(self)

    @property
    def observation_window(self) -> int:
        return self.fit_queries + self.validation_queries


def budget_for(seq_len: int, ratio: float) -> int:
    """Retained slots per KV head: ``b = floor(s * (1 - ratio))`` computed exactly on the decimal
    value of ``ratio`` (reskv.md, Budget): ``s = 4000, ratio = 0.9`` gives 400, where floating
    point gives 399."""
    exact = Fraction(str(ratio))
    if not 0 <= exact < 1:
        raise ValueError(f"compression ratio {ratio!r} must lie in [0, 1)")
    kept_num, den = (1 - exact).as_integer_ratio()
    return seq_len * kept_num // den


def residual_size(ratio: float, budget: int) -> int:
    """``r = floor(ratio * b + 0.5)`` (reskv.md): a share of a head's budget ``b`` rounded half up,
    in float64 (host integers: the engine plans every shape before it launches work)."""
    return math.floor(ratio * budget + 0.5)


def candidate_sizes(
    config: ResidualConfig, budgets: list[int], window: int, validation_count: int
) -> list[list[int]]:
    """Residual sizes per candidate ratio of the grid and head, 0 where the candidate is skipped.

    ``r = floor(ratio * b + 0.5)`` with ``b`` the head's deployed budget; skipped when ``r`` is 0,
    repeats an earlier candidate's ``r`` for that head, or leaves ``m' - |P'| < 0`` with
    ``m' = b - r - validation_count`` (reskv.md). ``window`` is ``|P'|``.
    """
    sizes = []
    for ratio in config.grid:
        row = []
        for budget in budgets:
            size = residual_size(ratio, budget)
            repeated = any(residual_size(earlier, budget) == size for earlier in config.grid[: len(sizes)])
            skip = size == 0 or repeated or budget - size - validation_count < window
            row.append(0 if skip else size)
        sizes.append(row)
    return sizes
