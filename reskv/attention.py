"""Attention over an exact main cache plus residual entries (paper Eqs. residual_logit-reskv, gate).

All tensors are grouped by KV head: queries ``[H_kv, Q, d]`` where ``Q = G * q`` stacks the
query heads of a GQA group, so the group shares main and residual entries while every query
head keeps its own logits and gate. Everything is computed in fp32 whatever the cache dtype.
Residual entries sit in the first slots of one key/value tensor with the main cache after them,
so a decode step's logits are one matmul (``CompressedLayer`` appends new tokens at the end).
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


def joint_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    residual_slots: int,
    scaling: float,
    rule: DecodeRule,
    evicted_fraction: Tensor | None = None,
    with_residual_share: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """ResKV attention output ``[H_kv, Q, d]`` (fp32) over residual entries and main cache held together.

    ``keys``/``values`` ``[H_kv, r + n, d]`` hold the ``r = residual_slots`` entries first, then
    the main cache; ``bias`` (broadcastable to ``[H_kv, Q, r + n]``) is additive: ``beta * log(c_j)``
    on the entries (``-inf`` on unused ones, ``population_bias``), 0 or ``-inf`` on main slots
    (padding, causality). One matmul gives every logit; the gate reads the main part's max and
    log-sum-exp. The shared softmax (reskv.md) is computed in its two-branch form on the two
    slices: main output and log-sum-exp, residual output and log-sum-exp (``log g(q)`` added),
    merged with ``w = sigmoid(lse_M - lse_R)``; it equals one softmax over all logits, and a closed
    gate gives exactly the main-only output. ``keys``/``values`` are read in fp32, which copies
    nothing when the cache is fp32. ``evicted_fraction`` (``[H_kv]``, ``|E| / s``) is
    needed only by the no-shared-softmax ablation.

    ``with_residual_share`` also returns ``1 - w`` ``[H_kv, Q]``: the softmax mass the residual
    entries received (without the shared softmax, the gate-weighted mixing weight of the residual
    branch), 0 where there is no residual (``reskv.quality``).
    """
    values = values.float()
    logits = torch.matmul(queries.float(), keys.float().transpose(1, 2)).mul_(scaling).add_(bias)
    main_logits, residual_logits = logits[..., residual_slots:], logits[..., :residual_slots]
    main_lse = torch.logsumexp(main_logits, dim=-1)
    main_output = _softmax_output(main_logits, main_lse, values[:, residual_slots:])
    if residual_slots == 0:
        return (main_output, torch.zeros_like(main_lse)) if with_residual_share else main_output
    gate = gate_values(main_logits.amax(dim=-1), main_lse, rule)
    if rule.shared_softmax:
        residual_logits.add_(torch.log(gate)[..., None])
    residual_lse = torch.logsumexp(residual_logits, dim=-1)
    residual_output = _softmax_output(residual_logits, residual_lse, values[:, :residual_slots])
    if rule.shared_softmax:
        main_weight = torch.sigmoid(main_lse - residual_lse)
    else:
        # Each branch normalised on its own, mixed as a post-hoc correction weighted by the gate
        # and the evicted share of the prompt: w = g(q) * |E| / s (this project's reading).
        has_residual = torch.isfinite(residual_lse)
        main_weight = torch.where(has_residual, 1 - gate * evicted_fraction[:, None], torch.ones_like(gate))
    output = main_weight[..., None] * main_output + (1 - main_weight[..., None]) * residual_output
    return (output, 1 - main_weight) if with_residual_share else output


def joint_bias(residual_log_counts: Tensor, main_bias: Tensor | None, main_slots: int, beta: float) -> Tensor:
    """``[H_kv, 1 or Q, r + n]``: ``population_bias`` on the entries, then ``main_bias`` (0 when None;
    broadcastable to ``[H_kv, Q, n]``)."""
    population = population_bias(residual_log_counts, beta)[:, None, :]
    if main_bias is None:
        main_bias = population.new_zeros(population.shape[0], 1, main_slots)
    heads, rows = max(population.shape[0], main_bias.shape[0]), max(population.shape[1], main_bias.shape[1])
    return torch.cat([population.expand(heads, rows, -1), main_bias.expand(heads, rows, -1)], dim=-1)


def joint_buffers(
    residual_keys: Tensor,
    residual_values: Tensor,
    residual_log_counts: Tensor,
    main_keys: Tensor,
    main_values: Tensor,
    main_bias: Tensor | None,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``[entries ; main]`` keys and values (in the main cache's dtype) and their ``joint_bias``:
    the layout ``joint_attention`` reads."""
    keys = torch.cat([residual_keys.to(main_keys.dtype), main_keys], dim=1)
    values = torch.cat([residual_values.to(main_values.dtype), main_values], dim=1)
    return keys, values, joint_bias(residual_log_counts, main_bias, main_keys.shape[1], beta)


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
    """``joint_attention`` over main cache and residual entries given apart: ``main_bias`` (0 or
    ``-inf``, broadcastable to ``[H_kv, Q, n]``) carries padding and causality, ``residual_log_counts``
    ``[H_kv, r]`` is ``-inf`` on unused slots, which then receive no softmax mass."""
    keys, values, bias = joint_buffers(
        residual_keys, residual_values, residual_log_counts, main_keys, main_values, main_bias, rule.beta
    )
    return joint_attention(
        queries, keys, values, bias, residual_keys.shape[1], scaling, rule, evicted_fraction
    )
