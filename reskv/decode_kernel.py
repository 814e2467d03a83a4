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

A grid's step over views of one prefilled cache (``reskv.views``) has its own kernel here,
``view_partials``: split-K over a pool of slots (the shared prefilled slots, or every row's entries
laid end to end) for every row's queries at once, each row masked to the slots it keeps (or to its
segment of the pool), a chunk's running softmax written per query row; the chunks are merged and
combined with the rows' appended slots and gates in torch (``reskv.views.view_attention``). The keys
and values are read once for all the rows of a program's tile, only at the slots some row of it sees
(a tile of CaM's rows reads its adjusted values at their kept slots alone), in their own dtype (bf16
products are exact in fp32, the accumulation's order is the only difference), the weights cast to the
values' dtype for their product as the torch form casts them on CUDA.

Not run on a GPU yet: ``scripts.bench.gpu_check --compare-paths`` decodes each +ResKV request with
it and without it (``reskv.attention.CUDA_FUSED_DECODE``), and ``scripts.bench.gpu_check.first``'s
``views`` stage checks ``view_partials`` against float64 at the layer. Triton is optional: without it
``available`` is false and the torch forms run.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reskv.decode_rule import GateTerms
from reskv.views import LOWEST

if TYPE_CHECKING:
    from reskv.views import EntryPool, Partial, SharedSlots

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Slots a program reads at a time; about how many chunks a head's slots are split into (the entries'
# and the main slots' apart, so at most 2 more: 8 KV heads make 128-144 programs, about an H100's
# 132 SMs); warps per program. Not timed on a GPU yet, but sized so that ptxas keeps every tile in
# registers on sm_90 at head dims 64 and 128 in fp32, bf16 and fp16 (``python -m
# scripts.bench.kernel_resources``; 64-slot tiles with 4 warps spill at head dim 128). One stage: the
# slots' loads are not software-pipelined, since with 2 or 3 stages a bf16 cache's buffered tiles spilled
# at head dim 128; programs resident side by side hide the loads' latency instead.
SLOT_TILE = 32
MAX_CHUNKS = 16
NUM_WARPS = 8
NUM_STAGES = 1
# No contraction of a multiply and an add into one FMA outside the products: the softmax's updates
# round as torch's elementwise ops do, whatever Triton's default (on up to 3.9, off from 3.10).
FP_FUSION = False
# Query rows a program holds: a decode step's query heads per KV head (4 for Llama-3.1-8B, 7 for
# Qwen2.5-7B, padded to a tile of 16). More rows (a prompt's queries, or groups of 32 or 64 query
# heads, whose tiles spill at head dim 128) take the torch form.
MAX_ROWS = 16
# The view kernel's query rows a program holds (rows of one batch's configurations times their query
# heads, all reading one values tensor), the slots it reads at a time, its warps: not timed on a GPU
# yet, but sized so that ptxas keeps every tile in registers on sm_90 at head dims 64 and 128 in bf16
# and fp16 (``python -m scripts.bench.kernel_resources``; FlashAttention's 64 x 64 tiles spill up to
# 1 KB a thread there, and 4 warps spilled at head dim 64). In fp32 every tile tried spills (5-9 KB a
# thread), so fp32 caches take the torch form (``VIEW_DTYPES``). The values tensors one launch reads:
# the shared values and up to two adjusted ones (CaM's, query-aware and query-agnostic); more take the
# torch form.
VIEW_ROW_TILE = 32
VIEW_SLOT_TILE = 32
VIEW_NUM_WARPS = 8
VIEW_DTYPES = (torch.bfloat16, torch.float16)
VIEW_SOURCES = 3


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
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    output = values.new_empty(num_heads, rows, dim)
    _merge_kernel[(num_heads,)](
        partial_max, partial_sum, partial_output, output,
        rows, dim, chunks, entry_chunks, gate.alpha_tau, gate.alpha, gate.log_g_min,
        ROW_TILE=row_tile, DIM_TILE=dim_tile, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return output


def views_fit(queries: Tensor, sources: int) -> bool:
    """Whether ``view_partials`` takes a step of these grouped queries ``[B, H_kv, Q, d]`` (one decoded
    token: ``Q`` query heads a KV head within a program's rows, in one of ``VIEW_DTYPES``) reading
    ``sources`` values tensors."""
    return queries.dtype in VIEW_DTYPES and queries.shape[2] <= VIEW_ROW_TILE and sources <= VIEW_SOURCES


@functools.lru_cache(maxsize=64)
def row_tiles(runs: tuple[tuple[int, int], ...], group: int, row_tile: int, device: torch.device) -> Tensor:
    """``[3, T]`` int32 on ``device``: each program tile's first query row, its number of rows and the
    values tensor it reads, for rows ``[first, last)`` of each run reading the run's values (``runs``
    in order), ``group`` query rows a row: no tile mixes two runs. Cached: a grid's layers share it."""
    tiles = []
    for source, (first, last) in enumerate(runs):
        for start in range(first * group, last * group, row_tile):
            tiles.append((start, min(row_tile, last * group - start), source))
    return torch.tensor(tiles, dtype=torch.int32).T.contiguous().to(device)


def view_partials(
    queries: Tensor, shared: SharedSlots, entries: EntryPool | None, scaling: float
) -> tuple[Partial, Partial | None]:
    """The shared slots' and the entry pool's partial softmaxes (``reskv.views.shared_partial``,
    ``entry_partial``), ``[H_kv, B, Q, ...]`` in fp32, for one decoded token's grouped queries
    ``queries`` ``[B, H_kv, Q, d]`` (``views_fit``)."""
    batch, _, group, _ = queries.shape
    queries = queries.contiguous()
    runs = tuple((first, last) for first, last, _ in shared.sources)
    tiles = row_tiles(runs, group, VIEW_ROW_TILE, queries.device)
    values = [source for _, _, source in shared.sources]
    values += [values[0]] * (VIEW_SOURCES - len(values))
    hidden = shared.hidden.view(torch.uint8)
    shared_part = pool_partials(queries, shared.keys, values, tiles, scaling, hidden=hidden)
    if entries is None:
        return shared_part, None
    tiles = row_tiles(((0, batch),), group, VIEW_ROW_TILE, queries.device)
    pool_values = [entries.values] * VIEW_SOURCES
    window = (entries.first, entries.last)
    return shared_part, pool_partials(
        queries, entries.keys, pool_values, tiles, scaling, bias=entries.bias, window=window
    )


def pool_partials(
    queries: Tensor,
    keys: Tensor,
    values: list[Tensor],
    tiles: Tensor,
    scaling: float,
    hidden: Tensor | None = None,
    bias: Tensor | None = None,
    window: tuple[Tensor, Tensor] | None = None,
) -> Partial:
    """One pool's partial softmax ``[H_kv, B, Q, ...]``: ``_pool_kernel`` over chunks of the pool's
    slots, then the chunks merged (each referred to the largest maximum)."""
    batch, heads, group, dim = queries.shape
    slots = keys.shape[1]
    chunk_slots = max(
        VIEW_SLOT_TILE, triton.cdiv(triton.cdiv(slots, MAX_CHUNKS), VIEW_SLOT_TILE) * VIEW_SLOT_TILE
    )
    chunks = triton.cdiv(slots, chunk_slots)
    rows = batch * group
    partial_max = queries.new_empty(heads, chunks, rows, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    partial_output = queries.new_empty(heads, chunks, rows, dim, dtype=torch.float32)
    first, last = window if window is not None else (tiles, tiles)  # unread without a window
    precision = "ieee" if queries.dtype == torch.float32 else None  # bf16 and fp16: their own products
    _pool_kernel[(tiles.shape[1], heads, chunks)](
        queries, keys, values[0], values[1], values[2],
        hidden if hidden is not None else keys, bias if bias is not None else keys, first, last,
        tiles[0], tiles[1], tiles[2], partial_max, partial_sum, partial_output,
        heads, group, slots, dim, rows, chunk_slots, scaling,
        HAS_HIDDEN=hidden is not None, HAS_BIAS=bias is not None, HAS_WINDOW=window is not None,
        ROW_TILE=VIEW_ROW_TILE, SLOT_TILE=VIEW_SLOT_TILE, DIM_TILE=max(16, triton.next_power_of_2(dim)),
        PRECISION=precision, num_warps=VIEW_NUM_WARPS, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    maximum = partial_max.amax(dim=1)
    scale = (partial_max - maximum.clamp(min=LOWEST)[:, None]).exp_()
    total = (partial_sum * scale).sum(dim=1)
    output = (partial_output * scale[..., None]).sum(dim=1)
    shape = (heads, batch, group)
    return maximum.view(*shape, 1), total.view(*shape, 1), output.view(*shape, dim)


if triton is not None:

    @triton.jit
    def _empty_softmax(ROW_TILE: tl.constexpr, DIM_TILE: tl.constexpr):
        """A running softmax of ``ROW_TILE`` rows before any slot: maximum ``-inf``, sum and weighted
        values 0."""
        maximum = tl.full([ROW_TILE], float("-inf"), tl.float32)
        return maximum, tl.zeros([ROW_TILE], tl.float32), tl.zeros([ROW_TILE, DIM_TILE], tl.float32)

    @triton.jit
    def _running_softmax(
        running_max, running_sum, running_output, logits, values_tile, PRECISION: tl.constexpr
    ):
        """One tile of ``logits`` ``[ROW_TILE, SLOT_TILE]`` and its values into a running softmax; a
        reference of 0 stands in for a maximum still -inf (every weight then 0, no -inf - -inf). The
        weights are cast to the values' dtype for their product (nothing for fp32 values)."""
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - reference)
        weights = tl.exp(logits - reference[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        running_output = running_output * rescale[:, None] + tl.dot(
            weights.to(values_tile.dtype), values_tile, input_precision=PRECISION
        )
        return new_max, running_sum, running_output

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
        running_max, running_sum, running_output = _empty_softmax(ROW_TILE, DIM_TILE)
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
            values_tile = tl.load(values + offsets, mask=tile_mask, other=0.0).to(tl.float32)
            running_max, running_sum, running_output = _running_softmax(
                running_max, running_sum, running_output, logits, values_tile, "ieee"
            )
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

    @triton.jit(do_not_specialize=["heads", "group", "slots", "rows", "chunk_slots"])
    def _pool_kernel(
        queries, keys, values_0, values_1, values_2, hidden, bias, first, last,
        tile_first, tile_rows, tile_source, partial_max, partial_sum, partial_output,
        heads, group, slots, dim, rows, chunk_slots, scaling,
        HAS_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr,
        ROW_TILE: tl.constexpr, SLOT_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One tile of query rows (consecutive rows of one values tensor) of one KV head over one chunk
        of a pool's slots: the running softmax of each row over the slots it sees (not ``hidden``, the
        pool's bias, its window), written for the chunk."""
        tile = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)  # head * slots * dim passes 2^31 at long caches
        chunk = tl.program_id(2)
        first_row = tl.load(tile_first + tile)
        local = tl.arange(0, ROW_TILE)
        valid = local < tl.load(tile_rows + tile)
        source = tl.load(tile_source + tile)
        row = first_row + local  # a query row: configuration row * group + query head of the group
        batch_row = (row // group).to(tl.int64)
        feature = tl.arange(0, DIM_TILE)
        features = feature[None, :] < dim
        query_tile = tl.load(
            queries + ((batch_row * heads + head) * group + row % group)[:, None] * dim + feature[None, :],
            mask=valid[:, None] & features,
            other=0.0,
        )
        chunk_start = chunk * chunk_slots
        chunk_end = tl.minimum(chunk_start + chunk_slots, slots)
        if HAS_WINDOW:  # only the slots some row of the tile sees
            low = tl.load(first + batch_row, mask=valid, other=slots)
            high = tl.load(last + batch_row, mask=valid, other=0)
            chunk_start = tl.maximum(chunk_start, tl.min(low, axis=0).to(tl.int32))
            chunk_end = tl.minimum(chunk_end, tl.max(high, axis=0).to(tl.int32))
        running_max, running_sum, running_output = _empty_softmax(ROW_TILE, DIM_TILE)
        for start in range(chunk_start, chunk_end, SLOT_TILE):
            slot = start + tl.arange(0, SLOT_TILE)
            in_chunk = slot < chunk_end
            seen = valid[:, None] & in_chunk[None, :]
            if HAS_HIDDEN:
                hidden_tile = tl.load(
                    hidden + (batch_row * heads + head)[:, None] * slots + slot[None, :], mask=seen, other=1
                )
                seen = seen & (hidden_tile == 0)
            if HAS_WINDOW:
                seen = seen & (slot[None, :] >= low[:, None]) & (slot[None, :] < high[:, None])
            # Keys and values are loaded only at the slots some row of the tile sees: a tile of CaM's
            # rows reads its adjusted values at their kept slots alone. An unread slot's weight is 0
            # in every row, so the loaded 0 in its place changes no sum.
            offsets = (head * slots + slot[:, None]) * dim + feature[None, :]
            tile_mask = (tl.max(seen.to(tl.int32), axis=0) > 0)[:, None] & features
            key_tile = tl.load(keys + offsets, mask=tile_mask, other=0.0)
            logits = tl.dot(query_tile, tl.trans(key_tile), input_precision=PRECISION) * scaling
            if HAS_BIAS:
                logits += tl.load(bias + head * slots + slot, mask=in_chunk, other=0.0)[None, :]
            logits = tl.where(seen, logits, float("-inf"))
            if source == 0:
                values_tile = tl.load(values_0 + offsets, mask=tile_mask, other=0.0)
            elif source == 1:
                values_tile = tl.load(values_1 + offsets, mask=tile_mask, other=0.0)
            else:
                values_tile = tl.load(values_2 + offsets, mask=tile_mask, other=0.0)
            running_max, running_sum, running_output = _running_softmax(
                running_max, running_sum, running_output, logits, values_tile, PRECISION
            )
        # partial_* [H, chunks, rows(, dim)]
        out = (head * tl.num_programs(2) + chunk) * rows + row
        tl.store(partial_max + out, running_max, mask=valid)
        tl.store(partial_sum + out, running_sum, mask=valid)
        output_mask = valid[:, None] & features
        tl.store(partial_output + out[:, None] * dim + feature[None, :], running_output, mask=output_mask)
