"""A gated decode step's attention in two Triton launches: the eager CUDA form of
``reskv.attention.shared_softmax_attention`` for a layer with residual entries and the gate on.

Eagerly that layer takes at least 8 aten ops (the logits, the main softmax and its max, the gate's
two ops, the in-place add, the softmax, the values' product; in half precision also casts) where a
base layer takes one SDPA call and its mask's conversion, and on a GPU each op costs the host the
same time whatever its size (results/gpu/README.md). Here the entries and the main slots are each split
into chunks, so a chunk holds one part's slots; a program of the first kernel takes one KV head's
query rows over one chunk and keeps its running softmax (the largest logit, the sum of
``exp(logit - max)``, the values weighed by those). The second kernel merges each head's entry
chunks and main chunks apart: the main part's sum over its own maximum is ``1 / p_max`` (reskv.md,
Eq. gate), which gives ``log g``; the entries' part, shifted by ``log g``, and the main part are then
referred to their common maximum and normalised together. That is the shared softmax with the entries' bias
``beta * log(c_j) + log g(q)``, the same rule as the torch form up to fp rounding
(tests/test_fast_paths.py, under Triton's interpreter on CPU). Keys and values are read once, in
their own dtype, products and softmax in fp32 (IEEE, no TF32).

Not run on a GPU yet: ``scripts.bench.gpu_check --compare-paths`` decodes each +ResKV request with
it and without it (``reskv.attention.CUDA_FUSED_DECODE``). Triton is optional: without it
``available`` is false and the torch form runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reskv.decode_rule import GateTerms

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Slots a program reads at a time; about how many chunks a head's slots are split into (the entries'
# and the main slots' apart, so at most 2 more: 8 KV heads make 128-144 programs, about an H100's
# 132 SMs); warps per program. Not timed on a GPU yet, but sized so that ptxas keeps every tile in
# registers on sm_90 at head dims 64 and 128 in fp32, bf16 and fp16 (``python -m
# scripts.bench.kernel_resources``; 64-slot tiles with 4 warps spill at head dim 128).
SLOT_TILE = 32
MAX_CHUNKS = 16
NUM_WARPS = 8
# No contraction of a multiply and an add into one FMA outside the products: the softmax's updates
# round as torch's elementwise ops do, whatever Triton's default (on up to 3.9, off from 3.10).
FP_FUSION = False
# Query rows a program holds: a decode step's query heads per KV head (4 for Llama-3.1-8B, 7 for
# Qwen2.5-7B, padded to a tile of 16). More rows (a prompt's queries, or groups of 32 or 64 query
# heads, whose tiles spill at head dim 128) take the torch form.
MAX_ROWS = 16


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
    gate: GateTerms,
) -> Tensor:
    """``shared_softmax_attention``'s output ``[H_kv, G, d]`` (in the values' dtype, as on CUDA) for one
    decoded token: ``queries`` ``[H_kv, G, d]``, ``keys``/``values`` ``[H_kv, n, d]`` holding the
    ``residual_slots`` entries first, ``bias`` ``[H_kv, 1, n]`` (fp32: ``beta * log(c_j)`` on the
    entries, 0 or ``-inf`` on the rest); ``gate`` (``DecodeRule.gate_terms``) open, at least one entry,
    every row seeing at least one main slot."""
    num_heads, rows, dim = queries.shape
    num_slots = keys.shape[1]
    chunk_slots = triton.cdiv(triton.cdiv(num_slots, MAX_CHUNKS), SLOT_TILE) * SLOT_TILE
    # The entries' chunks first, then the main slots': a chunk holds one part's slots only.
    entry_chunks = triton.cdiv(residual_slots, chunk_slots)
    chunks = entry_chunks + triton.cdiv(num_slots - residual_slots, chunk_slots)
    row_tile = max(16, triton.next_power_of_2(rows))  # tl.dot takes tiles of at least 16
    dim_tile = max(16, triton.next_power_of_2(dim))
    queries, keys, values, bias = (tensor.contiguous() for tensor in (queries, keys, values, bias))
    partial_max = queries.new_empty(num_heads, chunks, row_tile, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    partial_output = queries.new_empty(num_heads, chunks, row_tile, dim_tile, dtype=torch.float32)
    _chunk_kernel[(num_heads, chunks)](
        queries, keys, values, bias, partial_max, partial_sum, partial_output,
        rows, num_slots, dim, residual_slots, chunk_slots, entry_chunks, scaling,
        ROW_TILE=row_tile, SLOT_TILE=SLOT_TILE, DIM_TILE=dim_tile,
        num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    output = values.new_empty(num_heads, rows, dim)
    _merge_kernel[(num_heads,)](
        partial_max, partial_sum, partial_output, output,
        rows, dim, chunks, entry_chunks, gate.alpha_tau, gate.alpha, gate.log_g_min,
        ROW_TILE=row_tile, DIM_TILE=dim_tile, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return output


if triton is not None:

    @triton.jit(do_not_specialize=["rows", "num_slots", "residual_slots", "chunk_slots", "entry_chunks"])
    def _chunk_kernel(
        queries, keys, values, bias, partial_max, partial_sum, partial_output,
        rows, num_slots, dim, residual_slots, chunk_slots, entry_chunks, scaling,
        ROW_TILE: tl.constexpr, SLOT_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0).to(tl.int64)  # head * num_slots * dim passes 2^31 at long caches
        chunk = tl.program_id(1)
        if chunk < entry_chunks:  # the entries' slots [0, residual_slots)
            chunk_start = chunk * chunk_slots
            chunk_end = tl.minimum(chunk_start + chunk_slots, residual_slots)
        else:  # the main slots [residual_slots, num_slots)
            chunk_start = residual_slots + (chunk - entry_chunks) * chunk_slots
            chunk_end = tl.minimum(chunk_start + chunk_slots, num_slots)
        row = tl.arange(0, ROW_TILE)
        feature = tl.arange(0, DIM_TILE)
        query_tile = tl.load(
            queries + (head * rows + row[:, None]) * dim + feature[None, :],
            mask=(row[:, None] < rows) & (feature[None, :] < dim),
            other=0.0,
        ).to(tl.float32)
        running_max = tl.full([ROW_TILE], float("-inf"), tl.float32)
        running_sum = tl.zeros([ROW_TILE], tl.float32)
        running_output = tl.zeros([ROW_TILE, DIM_TILE], tl.float32)
        for start in range(chunk_start, chunk_end, SLOT_TILE):
            slot = start + tl.arange(0, SLOT_TILE)
            in_chunk = slot < chunk_end
            offsets = (head * num_slots + slot[:, None]) * dim + feature[None, :]
            tile_mask = in_chunk[:, None] & (feature[None, :] < dim)
            key_tile = tl.load(keys + offsets, mask=tile_mask, other=0.0).to(tl.float32)
            slot_bias = tl.load(bias + head * num_slots + slot, mask=in_chunk, other=float("-inf"))
            logits = (
                tl.dot(query_tile, tl.trans(key_tile), input_precision="ieee") * scaling + slot_bias[None, :]
            )
            # One tile of logits into the running softmax; a reference of 0 stands in for a maximum
            # still -inf (every weight then 0, no -inf - -inf).
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(running_max - reference)
            weights = tl.exp(logits - reference[:, None])
            values_tile = tl.load(values + offsets, mask=tile_mask, other=0.0).to(tl.float32)
            running_sum = running_sum * rescale + tl.sum(weights, axis=1)
            running_output = running_output * rescale[:, None] + tl.dot(
                weights, values_tile, input_precision="ieee"
            )
            running_max = new_max
        # partial_* [H, chunks, ROW_TILE(, DIM_TILE)]
        base = (head * tl.num_programs(1) + chunk) * ROW_TILE + row
        tl.store(partial_max + base, running_max)
        tl.store(partial_sum + base, running_sum)
        tl.store(partial_output + base[:, None] * DIM_TILE + feature[None, :], running_output)

    @triton.jit
    def _merged(
        partial_max, partial_sum, partial_output, base, chunks, feature,
        ROW_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
    ):  # fmt: skip
        """The running softmaxes of ``chunks`` consecutive chunks from ``base``, referred to their common
        maximum (a reference of 0 where it is still ``-inf``, as in ``_chunk_kernel``)."""
        merged_max = tl.load(partial_max + base)
        merged_sum = tl.load(partial_sum + base)
        merged_output = tl.load(partial_output + base[:, None] * DIM_TILE + feature[None, :])
        for chunk in range(1, chunks):
            at = base + chunk * ROW_TILE
            chunk_max = tl.load(partial_max + at)
            new_max = tl.maximum(merged_max, chunk_max)
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale, chunk_scale = tl.exp(merged_max - reference), tl.exp(chunk_max - reference)
            merged_sum = merged_sum * rescale + tl.load(partial_sum + at) * chunk_scale
            chunk_output = tl.load(partial_output + at[:, None] * DIM_TILE + feature[None, :])
            merged_output = merged_output * rescale[:, None] + chunk_output * chunk_scale[:, None]
            merged_max = new_max
        return merged_max, merged_sum, merged_output

    @triton.jit(do_not_specialize=["rows", "chunks", "entry_chunks"])
    def _merge_kernel(
        partial_max, partial_sum, partial_output, output,
        rows, dim, chunks, entry_chunks, alpha_tau, alpha, log_g_min,
        ROW_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0)
        row = tl.arange(0, ROW_TILE)
        feature = tl.arange(0, DIM_TILE)
        base = head * chunks * ROW_TILE + row
        entry_max, entry_sum, entry_output = _merged(
            partial_max, partial_sum, partial_output, base, entry_chunks, feature, ROW_TILE, DIM_TILE
        )
        main_max, main_sum, main_output = _merged(
            partial_max, partial_sum, partial_output, base + entry_chunks * ROW_TILE, chunks - entry_chunks,
            feature, ROW_TILE, DIM_TILE,
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
