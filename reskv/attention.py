"""Attention over an exact main cache plus residual entries (paper Eqs. residual_logit-reskv, gate).

All tensors are grouped by KV head: queries ``[H_kv, Q, d]`` where ``Q = G * q`` stacks the
query heads of a GQA group, so the group shares main and residual entries while every query
head keeps its own logits and gate. Everything is computed in fp32 whatever the cache dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reskv.config import DecodeRule


def gate_values(main_max: Tensor, main_lse: Tensor, rule: DecodeRule) -> Tensor:
    """``g(q) = max(g_min, sigmoid(alpha * (tau - p_max(q))))`` with ``p_max = exp(max(a) - lse_M)``."""
    if not rule.gate:
        return torch.ones_like(main_lse)
    main_peak = torch.exp(main_max - main_lse)
    return torch.sigmoid(rule.alpha * (rule.tau - main_peak)).clamp(min=rule.g_min)


def population_bias(log_counts: Tensor, beta: float) -> Tensor:
    """``beta * log(c_j)`` on used slots, ``-inf`` on unused ones whatever ``beta`` is (reskv.md,
    invariant 10): validity is read from the slot, never from ``beta * -inf`` (NaN when beta = 0)."""
    used = torch.isfinite(log_counts)
    return torch.where(used, beta * log_counts.masked_fill(~used, 0.0), float("-inf"))


def _softmax_output(logits: Tensor, lse: Tensor, values: Tensor) -> Tensor:
    """``softmax(logits) @ values`` given the row log-sum-exp; an all ``-inf`` row gives 0, not NaN."""
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(logits - finite_lse[..., None]) @ values


def residual_attention(
    queries: Tensor,
    main_keys: Tensor,
    main_values: Tensor,
    main_bias: Tensor | None,
    residual_keys: Tensor,
    residual_values: Tensor,
    residual_log_counts: Tensor,
    scaling: float,
    rule: DecodeRule,
    evicted_fraction: Tensor | None = None,
) -> Tensor:
    """ResKV attention output ``[H_kv, Q, d]`` (fp32).

    ``main_bias`` is additive (0 or ``-inf``, broadcastable to ``[H_kv, Q, n]``) and carries
    padding and causality; ``residual_log_counts`` is ``[H_kv, r]`` with ``-inf`` for unused
    slots (dropped clusters, heads with fewer entries), which then receive no softmax mass.

    Shared softmax is computed in its two-branch form: main output and log-sum-exp, residual
    output and log-sum-exp, merged with ``w = sigmoid(lse_M - lse_R)``; this equals one softmax
    over the concatenated logits and is the form a FlashAttention main branch can use.
    ``evicted_fraction`` (``[H_kv]``, ``|E| / s``) is needed only by the no-shared-softmax ablation.
    """
    queries = queries.float()
    main_logits = queries @ main_keys.float().transpose(1, 2) * scaling
    if main_bias is not None:
        main_logits = main_logits + main_bias
    main_lse = torch.logsumexp(main_logits, dim=-1)
    main_output = _softmax_output(main_logits, main_lse, main_values.float())
    if residual_keys.shape[1] == 0:
        return main_output

    gate = gate_values(main_logits.amax(dim=-1), main_lse, rule)
    residual_logits = queries @ residual_keys.float().transpose(1, 2) * scaling
    residual_logits = residual_logits + population_bias(residual_log_counts, rule.beta)[:, None, :]
    if rule.shared_softmax:
        residual_logits = residual_logits + torch.log(gate)[..., None]
    residual_lse = torch.logsumexp(residual_logits, dim=-1)
    residual_output = _softmax_output(residual_logits, residual_lse, residual_values.float())

    if rule.shared_softmax:
        main_weight = torch.sigmoid(main_lse - residual_lse)
    else:
        # Each branch normalised on its own, mixed as a post-hoc correction weighted by the
        # gate and the evicted share of the prompt: w = g(q) * |E| / s (this project's reading).
        has_residual = torch.isfinite(residual_lse)
        main_weight = torch.where(has_residual, 1 - gate * evicted_fraction[:, None], torch.ones_like(gate))
    main_weight = main_weight[..., None]
    return main_weight * main_output + (1 - main_weight) * residual_output
