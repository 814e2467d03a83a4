"""Attention over an exact main cache plus residual entries (paper Eqs. residual_logit-reskv, gate).

All tensors are grouped by KV head: queries ``[H_kv, Q, d]`` where ``Q = G * q`` stacks the
query heads of a GQA group, so the group shares main and residual entries while every query
head keeps its own logits and gate. Everything is computed in fp32 whatever the cache dtype.
Residual entries sit in the first slots of one key/value tensor with the main cache after them,
so a decode step's logits are one matmul (``CompressedLayer`` appends new tokens at the end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reskv.decode_rule import DecodeRule, GateTerms

# On CUDA with Triton, a gated layer's decode step (one token: one bias row for all its queries) is
# ``reskv.decode_kernel``'s two launches instead of the 8 ops below (a GPU's host pays per op); off,
# the torch form.
CUDA_FUSED_DECODE = True


def additive_mask(visible: Tensor) -> Tensor:
    """0 where ``visible``, ``-inf`` elsewhere (fp32): two ops (a ``torch.where`` of two scalars
    launches three on CUDA, filling a tensor for each scalar)."""
    return torch.full(visible.shape, float("-inf"), device=visible.device).masked_fill_(visible, 0.0)


def gate_values(main_mass: Tensor, gate: GateTerms) -> Tensor:
    """``g(q) = max(g_min, sigmoid(alpha * (tau - p_max(q))))`` (reskv.md, Eq. gate; 1 where the gate is
    not open) with ``p_max = exp(max(a) - lse_M)``, which is ``1 / main_mass`` for
    ``main_mass = sum_p exp(a_p - max(a))``. The argument is computed as ``(p_max - tau) * -alpha``,
    in place: ``alpha * (tau - p_max)`` to the bit (negation is exact)."""
    if not gate.open:
        return torch.ones_like(main_mass)
    # A sigmoid is never below a g_min <= 0, so that clamp is skipped.
    values = main_mass.reciprocal().sub_(gate.tau).mul_(-gate.alpha).sigmoid_()
    return values.clamp_(min=gate.g_min) if gate.g_min > 0 else values


def log_gate(p_max: Tensor, gate: GateTerms) -> Tensor:
    """``log g(q)`` (``gate_values``; the gate open) from ``p_max`` in two ops: the argument as
    ``alpha_tau - alpha * p_max`` (one ``rsub``: ``gate_values``' two ops give it to the last bit, this
    to fp rounding), then ``logsigmoid``, one op where ``log(sigmoid)`` takes two. ``RowGates.log_gate``
    is the same expression over stacked rows."""
    logit = torch.rsub(p_max, gate.alpha_tau, alpha=gate.alpha)
    log_gate = torch.nn.functional.logsigmoid(logit)
    return log_gate.clamp_(min=gate.log_g_min) if gate.g_min > 0 else log_gate


def population_bias(log_counts: Tensor, rule: DecodeRule) -> Tensor:
    """``beta * log(c_j)`` (``rule.population_weight``) on used slots, ``-inf`` on unused ones whatever
    ``beta`` is (reskv.md, invariant 10): validity is read from the slot, never from ``beta * -inf``
    (NaN when beta = 0). ``beta = 1`` (the default) is ``log_counts`` itself, whose unused slots are
    already ``-inf``: no op."""
    beta = rule.population_weight
    if beta == 1.0:
        return log_counts
    used = torch.isfinite(log_counts)
    return torch.where(used, beta * log_counts.masked_fill(~used, 0.0), float("-inf"))


def joint_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor | tuple[Tensor, ...],
    residual_slots: int,
    scaling: float,
    rule: DecodeRule,
    evicted_fraction: Tensor | None = None,
    with_residual_share: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """ResKV attention output ``[H_kv, Q, d]`` (fp32) over residual entries and main cache held
    together, and the residual share (below) or None.

    ``keys``/``values`` ``[H_kv, r + n, d]`` hold the ``r = residual_slots`` entries first, then
    the main cache; ``bias`` (broadcastable to ``[H_kv, Q, r + n]``) is additive: ``beta * log(c_j)``
    on the entries (``-inf`` on unused ones, ``population_bias``), 0 or ``-inf`` on main slots
    (padding, causality); every query must see at least one main slot. One matmul gives every logit.
    A tuple of terms is added term by term, where each logit gets at most one nonzero term (the
    proxy's per-row and per-query terms, whose broadcast sum would be as large as the logits).

    The shared softmax (reskv.md) is computed with one normalisation over both parts: the main
    part's weights ``exp(a - max(a))`` give its mass, from which the gate reads ``p_max = 1 / mass``,
    and its unnormalised output; the entries' logits carry ``log g(q)``; both parts are then
    referred to the larger of the two maxima (no weight above 1, whatever the entries' logits) and
    ``output = (main weights @ V_M + entry weights @ V_R) / (main mass + entry mass)``. This is the
    two-branch LSE merge's value in about half its tensor ops, which is what a decode step costs on
    CPU and in kernel launches on GPU. A closed gate gives every entry weight 0 and leaves the main
    maximum the reference (scale ``exp(0) = 1``), so the output is bit for bit the
    main-only one. ``keys``/``values`` are read in fp32, which copies nothing when the cache is
    fp32. ``evicted_fraction`` (``[H_kv]``, ``|E| / s``) is needed only by the no-shared-softmax
    ablation.

    With ``with_residual_share`` the second value is ``[H_kv, Q]``: the softmax mass the residual entries
    received (without the shared softmax, the gate-weighted mixing weight of the residual branch),
    0 where there is no residual (``reskv.quality``).
    """
    # bmm and in-place ops: at decode sizes a step's cost is per tensor op and allocation, and
    # matmul's broadcasting wrapper alone costs as much as a small op.
    values = values.float()
    logits = torch.bmm(queries.float(), keys.float().transpose(1, 2)).mul_(scaling)
    for term in bias if isinstance(bias, tuple) else (bias,):
        logits.add_(term)
    main_logits, residual_logits = logits[..., residual_slots:], logits[..., :residual_slots]
    main_values, residual_values = values[:, residual_slots:], values[:, :residual_slots]
    main_max = main_logits.amax(dim=-1, keepdim=True)
    main_weights = main_logits.sub_(main_max).exp_()
    main_mass = main_weights.sum(dim=-1, keepdim=True)
    main_output = torch.bmm(main_weights, main_values)
    if residual_slots == 0:
        output = main_output.div_(main_mass)
        return output, torch.zeros_like(main_mass[..., 0]) if with_residual_share else None
    gate = gate_values(main_mass, rule.gate_terms)
    if rule.shared_softmax:
        residual_logits.add_(gate.log_())
        shared_max = torch.maximum(main_max, residual_logits.amax(dim=-1, keepdim=True))
        main_scale = main_max.sub_(shared_max).exp_()
        residual_weights = residual_logits.sub_(shared_max).exp_()
        residual_mass = residual_weights.sum(dim=-1, keepdim=True)
        total_mass = main_mass.mul_(main_scale).add_(residual_mass)
        residual_output = torch.bmm(residual_weights, residual_values)
        output = main_output.mul_(main_scale).add_(residual_output).div_(total_mass)
        residual_share = residual_mass / total_mass if with_residual_share else None
    else:
        # Each branch normalised on its own, mixed as a post-hoc correction weighted by the gate
        # and the evicted share of the prompt: w = g(q) * |E| / s (this project's reading).
        residual_max = residual_logits.amax(dim=-1, keepdim=True)
        residual_weights = torch.exp(residual_logits - residual_max.nan_to_num(neginf=0.0))
        # A row with entries has mass >= 1 (its largest weight is exp(0)); one without has 0,
        # and its output stays 0 instead of 0 / 0.
        residual_mass = residual_weights.sum(dim=-1, keepdim=True).clamp(min=1.0)
        residual_output = (residual_weights @ residual_values) / residual_mass
        residual_share = torch.where(
            torch.isfinite(residual_max), gate * evicted_fraction[:, None, None], torch.zeros_like(gate)
        )
        output = (1 - residual_share) * (main_output / main_mass) + residual_share * residual_output
    return output, residual_share[..., 0] if with_residual_share else None


def fp32_logits(queries: Tensor, keys: Tensor, bias: Tensor, scaling: float) -> Tensor:
    """``queries @ keys^T * scaling + bias`` in fp32 (``[H_kv, Q, n]``), reading the keys in their own dtype
    on CUDA (``out_dtype``: fp32 accumulation and output, no fp32 copy of the cache). An fp32 cache is
    read as it is; a half-precision cache on CPU (``scripts.bench.gpu_check``'s CPU run only) is copied."""
    if keys.dtype != torch.float32 and keys.is_cuda:
        return torch.bmm(queries, keys.transpose(1, 2), out_dtype=torch.float32).mul_(scaling).add_(bias)
    return torch.baddbmm(bias, queries.float(), keys.float().transpose(1, 2), alpha=scaling)


def softmax_values(logits: Tensor, values: Tensor) -> Tensor:
    """``softmax(logits) @ values`` for fp32 ``logits``: the weights in the values' dtype on CUDA (the
    cache read as it is, fp32 accumulation), the values in fp32 on CPU, where a half-precision batched
    matmul is several times slower than their fp32 copy and product: the output is then fp32, and the
    caller casts it as it does every attention output."""
    weights = logits.softmax(dim=-1)
    product = torch.bmm if values.dim() == 3 else torch.matmul  # bmm: no broadcasting wrapper
    if values.is_cuda:
        return product(weights.to(values.dtype), values)
    return product(weights, values.float())


def shared_softmax_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    residual_slots: int,
    scaling: float,
    rule: DecodeRule,
) -> Tensor:
    """``joint_attention``'s shared-softmax output ``[H_kv, Q, d]``, reading keys and values once each
    in the cache's dtype, so a decode step reads the cache no more than a base method's SDPA call does
    (``fp32_logits`` and ``softmax_values`` copy a half-precision cache on CPU only).

    The gate multiplies every entry's softmax weight by ``g(q)``: that is ``log g(q)`` added to the
    entries' logits, so one softmax over ``[entries ; main]`` with the entries' bias ``beta * log(c_j)
    + log g(q)`` is the shared softmax (reskv.md, Eqs. reskv and gate). ``g`` needs the main part's
    ``p_max``, its largest softmax probability, first. So with entries and the gate on, the fp32
    logits are computed once (``fp32_logits``), ``p_max`` is read from their main part, ``log g`` is
    added to the entries' logits in place, and one fp32 softmax weighs the values
    (``softmax_values``); on CUDA, for one decoded token, ``reskv.decode_kernel`` does all that in
    two launches (``CUDA_FUSED_DECODE``). A layer without entries or without the gate (a base
    method) is one SDPA call with its bias. An SDPA call after a separate pass over the main logits
    would read the main keys twice, that pass alone costing on CPU about what a base step's attention
    costs; this form adds less (``scripts.bench.engine``'s "Decode attention" table times it against a
    base step). Equal to ``joint_attention`` up to fp rounding (tests/test_fast_paths.py);
    ``joint_attention`` stays the reference, used where the residual share is measured and by the
    no-shared-softmax ablation.
    """
    gate = rule.gate_terms
    if not (residual_slots and gate.open):
        mask = bias.to(queries.dtype)[:, None]  # SDPA takes a float mask in the queries' dtype
        return torch.nn.functional.scaled_dot_product_attention(
            queries[:, None], keys[:, None], values[:, None], attn_mask=mask, scale=scaling
        )[:, 0]
    if queries.is_cuda and CUDA_FUSED_DECODE and bias.shape[1] == 1:
        from reskv import decode_kernel  # imports Triton (slow to import), which the CPU never runs

        if decode_kernel.available() and queries.shape[1] <= decode_kernel.MAX_ROWS:
            return decode_kernel.gated_attention(queries, keys, values, bias, residual_slots, scaling, gate)
    logits = fp32_logits(queries, keys, bias, scaling)
    p_max = logits[..., residual_slots:].softmax(dim=-1).amax(dim=-1, keepdim=True)
    logits[..., :residual_slots].add_(log_gate(p_max, gate))
    return softmax_values(logits, values)


@dataclass
class RowGates:
    """The gates of stacked rows (``stacked_shared_softmax_attention``): each row's ``GateTerms`` as
    ``[B, 1, 1, 1]`` tensors, so that one expression computes every row's ``log g(q)`` as ``log_gate``
    computes one. A row whose gate is not open adds nothing (``open`` is false there); a row without
    entries adds its ``log g`` nowhere. ``gated`` says on the host whether any row has a gate: one
    bool, not one per row, so that a compiled step's graph depends on no row's rule but through the
    device."""

    gated: bool
    open: Tensor
    alpha_tau: Tensor
    negated_alpha: Tensor
    log_g_min: Tensor  # -inf where g_min <= 0: no clamp

    @classmethod
    def of(cls, rules: list[DecodeRule], device: torch.device) -> RowGates:
        gates = [rule.gate_terms for rule in rules]

        def column(values: list[float]) -> Tensor:
            return torch.tensor(values, device=device)[:, None, None, None]

        return cls(
            any(gate.open for gate in gates),
            column([gate.open for gate in gates]).bool(),
            column([gate.alpha_tau for gate in gates]),
            column([-gate.alpha for gate in gates]),
            column([gate.log_g_min for gate in gates]),
        )

    @property
    def columns(self) -> tuple[Tensor, ...]:
        """Its per-row tensors (``[B, 1, 1, 1]``), the batch a dynamic dimension of the compiled step."""
        return self.open, self.alpha_tau, self.negated_alpha, self.log_g_min

    def log_gate(self, p_max: Tensor) -> Tensor:
        """``log g(q)`` of every row (0 where the gate is not open): ``log_gate``'s expression, its
        ``rsub`` written as ``addcmul``, the same bits on CPU (``rsub``'s ``alpha`` cannot be a tensor,
        and torch 2.13's inductor drops it where it is a symbolic float: reskv.md, the compiled step)."""
        log_gate = torch.nn.functional.logsigmoid(torch.addcmul(self.alpha_tau, p_max, self.negated_alpha))
        return torch.where(self.open, torch.maximum(log_gate, self.log_g_min), 0.0)


def stacked_shared_softmax_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    entries: Tensor,
    gates: RowGates,
    scaling: float,
) -> Tensor:
    """``shared_softmax_attention`` for ``B`` stacked rows, each its own cache and rule: ``[B, H_kv, Q, d]``.

    ``keys``/``values`` ``[B, H_kv, n, d]`` hold each row's ``[entries ; main]`` at the start of its
    slots, padded with ``-inf`` bias to the longest row; ``entries`` ``[B, 1, 1, n]`` marks each row's
    entry slots, since their number differs by row. The rule and its form are the same: with any
    row's gate open, the fp32 logits once, each row's main ``p_max`` (its entries masked), ``log g(q)``
    added to its entries' logits in place (0 where its gate is closed), one softmax weighing the
    values; with none open, one SDPA call with the bias."""
    if not gates.gated:
        return torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=bias.to(queries.dtype), scale=scaling
        )
    rows = queries.shape[:2]
    logits = fp32_logits(queries.flatten(0, 1), keys.flatten(0, 1), bias.flatten(0, 1), scaling).unflatten(
        0, rows
    )
    p_max = logits.masked_fill(entries, float("-inf")).softmax(dim=-1).amax(dim=-1, keepdim=True)
    logits.addcmul_(entries, gates.log_gate(p_max))  # + log g on the entries (1 * x and 0 * x are exact)
    return softmax_values(logits, values)


def joint_bias(
    residual_log_counts: Tensor, main_bias: Tensor | None, main_slots: int, rule: DecodeRule
) -> Tensor:
    """``[H_kv, 1 or Q, r + n]``: ``population_bias`` on the entries, then ``main_bias`` (0 when None;
    broadcastable to ``[H_kv, Q, n]``)."""
    population = population_bias(residual_log_counts, rule)[:, None, :]
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
    rule: DecodeRule,
    spare_slots: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``[entries ; main]`` keys and values (in the main cache's dtype) and their ``joint_bias``:
    the layout ``joint_attention`` reads, followed by ``spare_slots`` zero-filled slots with bias
    ``-inf`` for tokens appended later (so the cache a decode step extends is built by one copy, not
    two)."""
    spare = main_keys.new_zeros(main_keys.shape[0], spare_slots, main_keys.shape[-1])
    keys = torch.cat([residual_keys.to(main_keys.dtype), main_keys, spare], dim=1)
    values = torch.cat(
        [residual_values.to(main_values.dtype), main_values, spare.to(main_values.dtype)], dim=1
    )
    bias = joint_bias(residual_log_counts, main_bias, main_keys.shape[1], rule)
    return keys, values, torch.nn.functional.pad(bias, (0, spare_slots), value=float("-inf"))
