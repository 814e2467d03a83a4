"""The decode rule of reskv.md, declared once, without importing torch: what a decode step reads.

``DecodeRule``'s fields are the decode-time options; ``reskv.config.ResidualConfig`` extends it
with the construction-time ones (a field there is read while the cache is built, never by a decode
step, whose layers hold the plain ``DecodeRule``: ``ResidualConfig.decode_rule``). Every form of the
attention (one row eager, a grid's rows as views and the compiled step, the Triton kernels, the reference
``joint_attention`` and the validation proxy that simulates it) reads the gate's terms from
``DecodeRule.gate_terms`` and the entries' population bias from ``DecodeRule.population_weight``,
and asks whether a row batches or compiles through ``batches``/``compiles``: a new decode-time field
changes those properties and nothing else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class GateTerms:
    """The numbers every form of the gate reads (reskv.md, Eq. gate):
    ``g(q) = max(g_min, sigmoid(alpha * (tau - p_max(q))))``, ``g = 1`` where not ``open``.

    ``alpha_tau`` and ``log_g_min`` are the same terms as the log-domain forms take them:
    ``log g = max(log g_min, logsigmoid(alpha_tau - alpha * p_max))``."""

    open: bool
    tau: float
    alpha: float
    g_min: float

    @property
    def alpha_tau(self) -> float:
        return self.alpha * self.tau

    @property
    def log_g_min(self) -> float:
        """``log g_min``, or ``-inf`` for ``g_min <= 0``, where a sigmoid never needs the clamp."""
        return math.log(self.g_min) if self.g_min > 0 else -math.inf


@dataclass(frozen=True)
class DecodeRule:
    """The decode-time rule of reskv.md: gate parameters, population weight and ablation switches."""

    tau: float = 0.25
    alpha: float = 12.0  # 1 / T_g
    g_min: float = 0.0
    beta: float = 1.0  # weight of log(count) in the residual logits
    gate: bool = True  # False: "w/o dynamic gate", g = 1
    shared_softmax: bool = True  # False: "w/o shared softmax" (this project's reading, reskv.md)

    @property
    def gate_terms(self) -> GateTerms:
        """The gate as every attention form reads it (``GateTerms``)."""
        return GateTerms(self.gate, self.tau, self.alpha, self.g_min)

    @property
    def population_weight(self) -> float:
        """``beta`` of the entries' bias ``beta * log(c_j)`` (``reskv.attention.population_bias``)."""
        return self.beta

    @property
    def batches(self) -> bool:
        """Whether a row of this rule can decode beside others, as a view of its sample's prefilled
        cache (``reskv.views``): the view form computes the shared softmax only; without it a row
        decodes alone. Whether the rows of a grid do decode as views is the device's decision
        (``reskv.batching.grid_decoding``)."""
        return self.shared_softmax

    @property
    def compiles(self) -> bool:
        """Whether ``decode=compiled`` can run this rule: the compiled step is the shared softmax's one
        graph (reskv.md, the compiled step); without it ``decode_mode`` falls back to eager."""
        return self.shared_softmax

    def decode_mode(self, requested: str) -> str:
        """The step this rule decodes with when ``requested`` (``reskv.config.DECODE_MODES``) is asked:
        ``requested``, or ``"eager"`` where the rule does not compile."""
        return requested if self.compiles else "eager"


# How a cache without residual entries is attended (a base method's, the full cache's): no gate, so
# its layers make one SDPA call, compiled as well as eager (reskv.md, "How the harness decodes").
NO_RESIDUAL_RULE = DecodeRule(gate=False)
DECODE_FIELDS = tuple(field.name for field in fields(DecodeRule))  # the decode-time options


def plain_rule(rule: DecodeRule) -> DecodeRule:
    """The ``DecodeRule`` with ``rule``'s fields (a ``ResidualConfig``'s decode part), one object per
    value. A compiled decode step guards on its layers' rule objects, their type and which are the
    same object, so two caches of equal rules would otherwise compile apart."""
    return _rule_of(tuple(getattr(rule, name) for name in DECODE_FIELDS))


@functools.cache
def _rule_of(values: tuple) -> DecodeRule:
    return DecodeRule(*values)
