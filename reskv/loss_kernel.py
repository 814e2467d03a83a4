"""A validation proxy's errors in one Triton kernel: each candidate row's simulated decode over its
entries, ``M'`` read by index and the exact tokens under their causal mask, against the full
attention's output (reskv.md, "Validation proxy"; ``reskv.proxy.ValidationProxy.block_errors``).

``block_errors``' torch path gathers ``M'`` into fp32 buffers joined with the entries and the exact
tokens (``[rows, r + m' + s - β, d]``, keys and values), adds two bias terms, and runs
``reskv.attention.joint_attention`` over them: about 45 ops a pass on a GPU's host, and the joined
buffers and logits are most of the fp32 a construction writes. Here a program takes one row and a
tile of its validation queries (grouped, query head major, as ``grouped`` lays them out), and in one
launch for all rows:

1. runs an online softmax over the row's own main slots (``main_rows``: rows of the layer's storage,
   ``reskv.selection.token_rows``; its first ``main_counts`` slots, the rest padding) and then its exact
   tokens ``β .. s-1`` (query ``(g, v)`` sees those at or before its own position), the keys and
   values read in their dtype, nothing gathered;
2. from the main part's mass ``l`` (relative to its maximum), the gate ``g = max(g_min,
   sigmoid(alpha (tau - 1 / l)))`` (``reskv.attention.gate_values``; 1 where not open);
3. runs a second online softmax over its own entries (its first ``entry_counts`` slots), logits plus
   ``beta log c_j`` (``-inf`` on empty clusters, ``reskv.attention.population_bias``) plus ``log g``;
4. merges the two parts under one normalisation, as ``joint_attention``'s shared softmax does, and
   writes each query's squared distance to the full output, ``[rows, G |validation|]``.

Each row reads only its own slots, so rows of several candidate sets laid out together (padded to
the widest) cost what each costs alone: a grid's ratios take one launch. The rule is
``joint_attention``'s shared softmax; the ablation without it keeps the torch path. Only
the order of the arithmetic differs: the softmaxes are online (rescaled tile by tile), the products
run in ``product_precision``'s form, and the gate's sigmoid and log are Triton's. So losses differ
from the torch path's in their last bits, and a choice between two candidates whose losses are that
close may go another way. CPU keeps the torch path. Tested on CPU under ``TRITON_INTERPRET=1``
(tests/test_loss_kernel.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reskv.decode_rule import DecodeRule
from reskv.nearest_kernel import triton
from reskv.residual import ResidualEntries
from reskv.selection import row_stride, storage_rows

if triton is not None:
    import triton.language as tl

# Queries and slots a program holds at once, and its warps: tiles ptxas keeps in registers on sm_90 at
# head dims 64 and 128 in each product form (``python -m scripts.bench.kernel_resources``: 32 queries,
# or 64 slots, spill in TF32x3); not tuned.
QUERY_TILE = 16
SLOT_TILE = 32
NUM_WARPS = 8


def product_precision(dtype: torch.dtype) -> str:
    """The products' form (``tl.dot``'s ``input_precision``) for a cache in ``dtype``: "tf32x3" (three
    TF32 products, fp32-like accuracy on the tensor cores) for half-precision keys and values; "ieee"
    (fp32 on the CUDA cores) for fp32 ones, whose TF32x3 tiles spill at head dim 128."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


def errors(
    queries: Tensor,
    full_output: Tensor,
    keys: Tensor,
    values: Tensor,
    heads: Tensor,
    main_rows: Tensor,
    main_counts: Tensor,
    residual: ResidualEntries,
    entry_counts: Tensor,
    boundary: int,
    validation_count: int,
    scaling: float,
    rule: DecodeRule,
    precision: str | None = None,
) -> Tensor:
    """``||ô_r(q) - o_S(q)||²`` ``[rows, G |validation|]`` fp32 (``ValidationProxy.caches_errors``).

    ``queries`` and ``full_output`` ``[H, G |validation|, d]`` (``grouped``), row ``i`` reading head
    ``heads[i]``'s; ``keys``/``values`` ``[H, s, d]`` the layer's (``main_rows`` index their storage,
    the exact tokens are ``boundary .. s-1`` of the row's head), of which a row reads its first
    ``main_counts[i]``; ``residual`` ``[rows, r]``, of which a row reads its first ``entry_counts[i]``
    (the slots past hold no entry). ``rule``'s shared softmax only; ``precision``:
    ``product_precision``'s for the keys when None."""
    if not rule.shared_softmax:
        raise ValueError(
            "the loss kernel computes the shared softmax only; the ablation takes the torch path"
        )
    num_rows, num_queries, dim = heads.shape[0], queries.shape[1], keys.shape[-1]
    found = torch.empty(num_rows, num_queries, device=keys.device)
    gate = rule.gate_terms
    entry_keys, entry_values, log_counts = residual.fields()
    _errors_kernel[(num_rows, triton.cdiv(num_queries, QUERY_TILE))](
        queries=queries,
        full_output=full_output,
        key_rows=storage_rows(keys),
        value_rows=storage_rows(values),
        heads=heads,
        main_rows=main_rows,
        main_counts=main_counts,
        entry_keys=entry_keys,
        entry_values=entry_values,
        log_counts=log_counts,
        entry_counts=entry_counts,
        found=found,
        queries_head=queries.stride(0),
        queries_query=queries.stride(1),
        full_head=full_output.stride(0),
        full_query=full_output.stride(1),
        main_rows_stride=main_rows.stride(0),
        entry_keys_row=entry_keys.stride(0),
        entry_keys_slot=entry_keys.stride(1),
        entry_values_row=entry_values.stride(0),
        entry_values_slot=entry_values.stride(1),
        log_counts_row=log_counts.stride(0),
        row_stride=row_stride(keys),
        num_queries=num_queries,
        boundary=boundary,
        exact_count=keys.shape[1] - boundary,
        validation_count=validation_count,
        dim=dim,
        scaling=scaling,
        tau=gate.tau,
        alpha=gate.alpha,
        g_min=gate.g_min,
        population_weight=rule.population_weight,
        GATE_OPEN=gate.open,
        CLAMP_GATE=gate.open and gate.g_min > 0,
        UNIT_POPULATION_WEIGHT=rule.population_weight == 1.0,
        QUERY_TILE=QUERY_TILE,
        SLOT_TILE=SLOT_TILE,
        DIM_TILE=max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        PRECISION=precision or product_precision(keys.dtype),
        num_warps=NUM_WARPS,
    )
    return found


if triton is not None:

    @triton.jit
    def softmax_start(QUERY_TILE: tl.constexpr, DIM_TILE: tl.constexpr):
        """A running softmax before its first slot: maximum ``-inf``, mass 0, output 0."""
        maximum = tl.full([QUERY_TILE], float("-inf"), tl.float32)
        return maximum, tl.zeros([QUERY_TILE], tl.float32), tl.zeros([QUERY_TILE, DIM_TILE], tl.float32)

    @triton.jit
    def online_step(
        query_tile,
        key_tile,
        value_tile,
        bias,
        scaling,
        running_max,
        mass,
        output,
        PRECISION: tl.constexpr,
    ):
        """One tile of slots folded into a running softmax: its logits ``q k^T scaling + bias``
        (``-inf`` hides a slot), the maximum, mass (relative to it) and unnormalised output rescaled
        to the new maximum; a query that has seen only hidden slots keeps maximum ``-inf`` and 0."""
        logits = tl.dot(query_tile, tl.trans(key_tile), input_precision=PRECISION) * scaling + bias
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp(logits - reference[:, None])
        scale = tl.exp(running_max - reference)
        mass = mass * scale + tl.sum(weights, axis=1)
        output = output * scale[:, None] + tl.dot(weights, value_tile, input_precision=PRECISION)
        return new_max, mass, output

    @triton.jit(
        do_not_specialize=[
            "row_stride", "boundary", "exact_count", "main_rows_stride", "entry_keys_row", "entry_keys_slot",
            "entry_values_row", "entry_values_slot", "log_counts_row",
        ]
    )  # fmt: skip
    def _errors_kernel(
        queries,
        full_output,
        key_rows,
        value_rows,
        heads,
        main_rows,
        main_counts,
        entry_keys,
        entry_values,
        log_counts,
        entry_counts,
        found,
        queries_head,
        queries_query,
        full_head,
        full_query,
        main_rows_stride,
        entry_keys_row,
        entry_keys_slot,
        entry_values_row,
        entry_values_slot,
        log_counts_row,
        row_stride,
        num_queries,
        boundary,
        exact_count,
        validation_count,
        dim,
        scaling,
        tau,
        alpha,
        g_min,
        population_weight,
        GATE_OPEN: tl.constexpr,
        CLAMP_GATE: tl.constexpr,
        UNIT_POPULATION_WEIGHT: tl.constexpr,
        QUERY_TILE: tl.constexpr,
        SLOT_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.load(heads + row)
        query = tl.program_id(1) * QUERY_TILE + tl.arange(0, QUERY_TILE)
        feature = tl.arange(0, DIM_TILE)
        in_tile = query < num_queries
        features = feature[None, :] < dim
        query_tile = tl.load(
            queries + head * queries_head + query[:, None] * queries_query + feature[None, :],
            mask=in_tile[:, None] & features,
            other=0.0,
        ).to(tl.float32)
        slot = tl.arange(0, SLOT_TILE)
        main_max, main_mass, main_output = softmax_start(QUERY_TILE, DIM_TILE)
        # The row's own M', by index.
        main_slots = tl.load(main_counts + row).to(tl.int32)
        for start in range(0, main_slots, SLOT_TILE):
            columns = start + slot
            used = columns < main_slots
            token = tl.load(main_rows + row * main_rows_stride + columns, mask=used, other=0)
            at = token[:, None] * dim + feature[None, :]
            key_tile = tl.load(key_rows + at, mask=used[:, None] & features, other=0.0).to(tl.float32)
            value_tile = tl.load(value_rows + at, mask=used[:, None] & features, other=0.0).to(tl.float32)
            bias = tl.where(used, 0.0, float("-inf"))
            main_max, main_mass, main_output = online_step(
                query_tile, key_tile, value_tile, bias[None, :], scaling, main_max, main_mass, main_output,
                PRECISION,
            )  # fmt: skip
        # The exact tokens β .. s-1: query (g, v) at position β + exact_count - |validation| + v.
        seen = exact_count - validation_count + query % validation_count
        for start in range(0, exact_count, SLOT_TILE):
            columns = start + slot
            used = columns < exact_count
            at = (head * row_stride + boundary + columns)[:, None] * dim + feature[None, :]
            key_tile = tl.load(key_rows + at, mask=used[:, None] & features, other=0.0).to(tl.float32)
            value_tile = tl.load(value_rows + at, mask=used[:, None] & features, other=0.0).to(tl.float32)
            bias = tl.where(used[None, :] & (columns[None, :] <= seen[:, None]), 0.0, float("-inf"))
            main_max, main_mass, main_output = online_step(
                query_tile, key_tile, value_tile, bias, scaling, main_max, main_mass, main_output, PRECISION
            )
        log_gate = tl.zeros([QUERY_TILE], tl.float32)
        if GATE_OPEN:  # reskv.attention.gate_values: p_max = 1 / mass
            gate = tl.sigmoid((1.0 / main_mass - tau) * -alpha)
            if CLAMP_GATE:
                gate = tl.maximum(gate, g_min)
            log_gate = tl.log(gate)
        entry_max, entry_mass, entry_output = softmax_start(QUERY_TILE, DIM_TILE)
        entry_slots = tl.load(entry_counts + row).to(tl.int32)
        for start in range(0, entry_slots, SLOT_TILE):
            columns = start + slot
            used = columns < entry_slots
            tile_mask = used[:, None] & features
            key_tile = tl.load(
                entry_keys + row * entry_keys_row + columns[:, None] * entry_keys_slot + feature[None, :],
                mask=tile_mask,
                other=0.0,
            ).to(tl.float32)
            value_tile = tl.load(
                entry_values
                + row * entry_values_row
                + columns[:, None] * entry_values_slot
                + feature[None, :],
                mask=tile_mask,
                other=0.0,
            ).to(tl.float32)
            population = tl.load(log_counts + row * log_counts_row + columns, mask=used, other=float("-inf"))
            if not UNIT_POPULATION_WEIGHT:  # reskv.attention.population_bias: -inf stays -inf
                population = tl.where(
                    population > float("-inf"), population_weight * population, float("-inf")
                )
            entry_max, entry_mass, entry_output = online_step(
                query_tile, key_tile, value_tile, population[None, :] + log_gate[:, None], scaling,
                entry_max, entry_mass, entry_output, PRECISION,
            )  # fmt: skip
        # One normalisation over both parts (reskv.attention.joint_attention, shared softmax).
        shared_max = tl.maximum(main_max, entry_max)
        main_scale = tl.exp(main_max - shared_max)
        entry_scale = tl.where(entry_max == float("-inf"), 0.0, tl.exp(entry_max - shared_max))
        total = main_mass * main_scale + entry_mass * entry_scale
        output = (main_output * main_scale[:, None] + entry_output * entry_scale[:, None]) / total[:, None]
        full = tl.load(
            full_output + head * full_head + query[:, None] * full_query + feature[None, :],
            mask=in_tile[:, None] & features,
            other=0.0,
        )
        difference = tl.where(in_tile[:, None] & features, output - full, 0.0)
        tl.store(found + row * num_queries + query, tl.sum(difference * difference, axis=1), mask=in_tile)
