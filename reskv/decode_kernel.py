"""A gated decode step's attention in two Triton launches (issue 24): the eager CUDA form of
``reskv.attention.shared_softmax_attention`` for a layer with residual entries and the gate on.

Eagerly that layer takes at least 8 aten ops (the logits, the main softmax and its max, the gate's
two ops, the in-place add, the softmax, the values' product; in half precision also casts) where a
base layer takes one SDPA call and its mask's conversion, and on a GPU each op costs the host ~23 us
whatever its size (results/gpu/README.md). Here the slots are split into chunks; a program of the
first kernel takes one KV head's query rows over one chunk and keeps two running softmaxes, one over
the main cache's slots and one over the entries' (``m``, the largest logit; ``l``, the sum of
``exp(logit - m)``; ``acc``, the values weighed by those). The second kernel merges each head's
chunks: the main part's ``l`` over its own maximum is ``1 / p_max`` (reskv.md, Eq. gate), which
gives ``log g``; the entries' part, shifted by ``log g``, and the main part are then referred to
their common maximum and normalised together. That is the shared softmax with the entries' bias
``beta * log(c_j) + log g(q)``, the same rule as the torch form up to fp rounding
(tests/test_fast_paths.py, under Triton's interpreter on CPU). Keys and values are read once, in
their own dtype, products and softmax in fp32 (IEEE, no TF32).

Not run on a GPU yet: ``scripts.bench.gpu_check --compare-paths`` decodes each +ResKV request with
it and without it (``reskv.attention.CUDA_FUSED_DECODE``). Triton is optional: without it
``available`` is false and the torch form runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reskv.config import DecodeRule

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Slots a program reads at a time, and at most how many chunks a head's slots are split into (so
# 8 KV heads make up to 128 programs, about an H100's 132 SMs). Not tuned on a GPU yet.
SLOT_TILE = 64
MAX_CHUNKS = 16
# Query rows a program holds: a decode step's query heads per KV head (4 for Llama-3.1-8B). More rows
# (a prompt's queries) would not fit a program's registers; they take the torch form.
MAX_ROWS = 64


def available() -> bool:
    """Whether Triton is installed (the kernels then run on CUDA tensors)."""
    return triton is not None


def gated_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    residual_slots: int,
    scaling: float,
    rule: DecodeRule,
) -> Tensor:
    """``shared_softmax_attention``'s output ``[H_kv, G, d]`` (in the values' dtype, as on CUDA) for one
    decoded token: ``queries`` ``[H_kv, G, d]``, ``keys``/``values`` ``[H_kv, n, d]`` holding the
    ``residual_slots`` entries first, ``bias`` ``[H_kv, 1, n]`` (fp32: ``beta * log(c_j)`` on the
    entries, 0 or ``-inf`` on the rest); ``rule.gate`` on, every row seeing at least one main slot."""
    num_heads, rows, dim = queries.shape
    num_slots = keys.shape[1]
    chunk_slots = triton.cdiv(triton.cdiv(num_slots, MAX_CHUNKS), SLOT_TILE) * SLOT_TILE
    chunks = triton.cdiv(num_slots, chunk_slots)
    row_tile = max(16, triton.next_power_of_2(rows))  # tl.dot takes tiles of at least 16
    dim_tile = max(16, triton.next_power_of_2(dim))
    queries, keys, values, bias = (tensor.contiguous() for tensor in (queries, keys, values, bias))
    partial_max = queries.new_empty(2, num_heads, chunks, row_tile, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    partial_output = queries.new_empty(2, num_heads, chunks, row_tile, dim_tile, dtype=torch.float32)
    _chunk_kernel[(num_heads, chunks)](
        queries, keys, values, bias, partial_max, partial_sum, partial_output,
        rows, num_slots, dim, residual_slots, chunk_slots, scaling,
        ROW_TILE=row_tile, SLOT_TILE=SLOT_TILE, DIM_TILE=dim_tile,
    )  # fmt: skip
    output = values.new_empty(num_heads, rows, dim)
    log_g_min = math.log(rule.g_min) if rule.g_min > 0 else -math.inf  # no clamp at g_min <= 0
    _merge_kernel[(num_heads,)](
        partial_max, partial_sum, partial_output, output,
        rows, dim, chunks, rule.alpha * rule.tau, rule.alpha, log_g_min,
        ROW_TILE=row_tile, DIM_TILE=dim_tile,
    )  # fmt: skip
    return output


if triton is not None:

    @triton.jit
    def _absorb(logits, values_tile, running_max, running_sum, running_output):
        """One tile of logits ``[R, S]`` (``-inf`` where masked) into a running softmax. A reference of
        0 stands in for a maximum still ``-inf`` (every weight then 0, no ``-inf - -inf``)."""
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - reference)
        weights = tl.exp(logits - reference[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        running_output = running_output * rescale[:, None] + tl.dot(
            weights, values_tile, input_precision="ieee"
        )
        return new_max, running_sum, running_output

    @triton.jit(do_not_specialize=["rows", "num_slots", "residual_slots", "chunk_slots"])
    def _chunk_kernel(
        queries, keys, values, bias, partial_max, partial_sum, partial_output,
        rows, num_slots, dim, residual_slots, chunk_slots, scaling,
        ROW_TILE: tl.constexpr, SLOT_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0).to(tl.int64)  # head * num_slots * dim passes 2^31 at long caches
        chunk = tl.program_id(1)
        chunks = tl.num_programs(1)
        row = tl.arange(0, ROW_TILE)
        feature = tl.arange(0, DIM_TILE)
        query_tile = tl.load(
            queries + (head * rows + row[:, None]) * dim + feature[None, :],
            mask=(row[:, None] < rows) & (feature[None, :] < dim),
            other=0.0,
        ).to(tl.float32)
        main_max = tl.full([ROW_TILE], float("-inf"), tl.float32)
        main_sum = tl.zeros([ROW_TILE], tl.float32)
        main_output = tl.zeros([ROW_TILE, DIM_TILE], tl.float32)
        entry_max = tl.full([ROW_TILE], float("-inf"), tl.float32)
        entry_sum = tl.zeros([ROW_TILE], tl.float32)
        entry_output = tl.zeros([ROW_TILE, DIM_TILE], tl.float32)
        chunk_start = chunk * chunk_slots
        chunk_end = tl.minimum(chunk_start + chunk_slots, num_slots)
        for start in range(chunk_start, chunk_end, SLOT_TILE):
            slot = start + tl.arange(0, SLOT_TILE)
            in_chunk = slot < chunk_end
            offsets = (head * num_slots + slot[:, None]) * dim + feature[None, :]
            tile_mask = in_chunk[:, None] & (feature[None, :] < dim)
            key_tile = tl.load(keys + offsets, mask=tile_mask, other=0.0).to(tl.float32)
            values_tile = tl.load(values + offsets, mask=tile_mask, other=0.0).to(tl.float32)
            slot_bias = tl.load(bias + head * num_slots + slot, mask=in_chunk, other=float("-inf"))
            logits = (
                tl.dot(query_tile, tl.trans(key_tile), input_precision="ieee") * scaling + slot_bias[None, :]
            )
            entry = (slot < residual_slots)[None, :]
            main_max, main_sum, main_output = _absorb(
                tl.where(entry, float("-inf"), logits), values_tile, main_max, main_sum, main_output
            )
            entry_max, entry_sum, entry_output = _absorb(
                tl.where(entry, logits, float("-inf")), values_tile, entry_max, entry_sum, entry_output
            )
        # partial_* [2, H, chunks, ROW_TILE(, DIM_TILE)]: the main part first, then the entries'.
        base = (head * chunks + chunk) * ROW_TILE + row
        entry_base = base + tl.num_programs(0) * chunks * ROW_TILE
        tl.store(partial_max + base, main_max)
        tl.store(partial_sum + base, main_sum)
        tl.store(partial_output + base[:, None] * DIM_TILE + feature[None, :], main_output)
        tl.store(partial_max + entry_base, entry_max)
        tl.store(partial_sum + entry_base, entry_sum)
        tl.store(partial_output + entry_base[:, None] * DIM_TILE + feature[None, :], entry_output)

    @triton.jit
    def _merged(
        partial_max, partial_sum, partial_output, base, chunk_step, chunks, feature, DIM_TILE: tl.constexpr
    ):
        """A head's running softmaxes of all chunks, referred to their common maximum (``_absorb``)."""
        merged_max = tl.load(partial_max + base)
        merged_sum = tl.load(partial_sum + base)
        merged_output = tl.load(partial_output + base[:, None] * DIM_TILE + feature[None, :])
        for chunk in range(1, chunks):
            at = base + chunk * chunk_step
            chunk_max = tl.load(partial_max + at)
            new_max = tl.maximum(merged_max, chunk_max)
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale, chunk_scale = tl.exp(merged_max - reference), tl.exp(chunk_max - reference)
            merged_sum = merged_sum * rescale + tl.load(partial_sum + at) * chunk_scale
            chunk_output = tl.load(partial_output + at[:, None] * DIM_TILE + feature[None, :])
            merged_output = merged_output * rescale[:, None] + chunk_output * chunk_scale[:, None]
            merged_max = new_max
        return merged_max, merged_sum, merged_output

    @triton.jit(do_not_specialize=["rows", "chunks"])
    def _merge_kernel(
        partial_max, partial_sum, partial_output, output,
        rows, dim, chunks, alpha_tau, alpha, log_g_min,
        ROW_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0)
        num_heads = tl.num_programs(0)
        row = tl.arange(0, ROW_TILE)
        feature = tl.arange(0, DIM_TILE)
        base = head * chunks * ROW_TILE + row
        main_max, main_sum, main_output = _merged(
            partial_max, partial_sum, partial_output, base, ROW_TILE, chunks, feature, DIM_TILE
        )
        entry_max, entry_sum, entry_output = _merged(
            partial_max, partial_sum, partial_output, base + num_heads * chunks * ROW_TILE, ROW_TILE, chunks,
            feature, DIM_TILE,
        )  # fmt: skip
        # p_max = exp(max(a) - lse_M) = 1 / sum(exp(a - max(a))) over the main slots (``gate_values``);
        # log g = logsigmoid(alpha * tau - alpha * p_max) (``log_gate``), at least log g_min.
        gate_logit = alpha_tau - alpha / main_sum
        log_gate = tl.minimum(gate_logit, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(gate_logit)))
        log_gate = tl.maximum(log_gate, log_g_min)
        entry_max = entry_max + log_gate
        shared_max = tl.maximum(main_max, entry_max)
        main_scale, entry_scale = tl.exp(main_max - shared_max), tl.exp(entry_max - shared_max)
        numerator = main_output * main_scale[:, None] + entry_output * entry_scale[:, None]
        denominator = main_sum * main_scale + entry_sum * entry_scale
        tl.store(
            output + (head * rows + row[:, None]) * dim + feature[None, :],
            numerator / denominator[:, None],
            mask=(row[:, None] < rows) & (feature[None, :] < dim),
        )
