"""H2O's accumulated attention (``reskv.scoring.accumulated_attention``) in two Triton kernels, no
probability written.

The torch path computes each query chunk's fp32 logits over every visible key, a softmax over them
and their sum over the chunk's queries: at 32K on the 8B shape those passes over ``H x s^2 / 2``
fp32 probabilities took most of an H2O prefill on an H200 (results/gpu/README.md). Here the same
column sums ``sum_q softmax(q K^T * scaling)[k]`` come from the softmax's log-sum-exp:

1. ``_log_sum_exp_kernel``: a program takes a tile of one head's queries and runs over the keys each
   may see a tile at a time with a running maximum and sum (FlashAttention's online softmax),
   writing each query's ``lse = log sum_k exp(s_qk)``;
2. ``_column_sums_kernel``: a program takes a tile of one head's keys and runs over the queries that
   see them, summing ``exp(s_qk - lse_q)`` over the queries: each key's column sum, in fp32.

The logits ``s_qk = <q, k> * scaling`` are fp32 dot products on the tensor cores of bf16 or fp16
queries and keys (every product exact in fp32, as in the torch path's fp32 matmul of the same
values). So each probability is the torch path's within fp32 rounding (``exp(s - lse)`` in place of
``exp(s - max) / sum``), and each column sum adds the same terms in another order.

Triton is optional: without it (a CPU install) ``available`` is false and the torch path runs. On
CUDA only half-precision inputs take the kernels (``reskv.scoring.accumulated_attention``): on fp32
ones their IEEE products spill registers (``python -m scripts.bench.kernel_resources``). Tested on
CPU under ``TRITON_INTERPRET=1`` (tests/test_baselines.py) on fp32 inputs with IEEE products, the
same code but the products' precision: the interpreter multiplies bf16 operands wrongly.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Query and key tiles, and warps per program: FlashAttention-2's forward tiles at head dim 128; not
# timed on a GPU yet.
QUERY_TILE = 64
KEY_TILE = 64
NUM_WARPS = 4


def available() -> bool:
    """Whether Triton is installed (the kernels then run on CUDA tensors)."""
    return triton is not None


def column_sums(
    queries: Tensor,
    keys: Tensor,
    first_position: int,
    scaling: float,
    query_tile: int = QUERY_TILE,
    key_tile: int = KEY_TILE,
) -> Tensor:
    """``[H, s]`` fp32: each key's attention summed over ``queries`` ``[H, n, d]`` at positions
    ``first_position .. first_position + n - 1``, causal, over ``keys`` ``[H_kv, s, d]`` (query head
    ``h`` reads KV head ``h // G``), ``s = first_position + n``. Tiles of at least 16 (``tl.dot``'s)."""
    heads, num_queries, dim = queries.shape
    kv_heads, num_keys, _ = keys.shape
    if num_keys != first_position + num_queries:
        raise ValueError(
            f"{num_keys} keys for {num_queries} queries from position {first_position}: the last query "
            "must see the last key"
        )
    queries, keys = queries.contiguous(), keys.contiguous()
    constants = {
        "QUERY_TILE": query_tile,
        "KEY_TILE": key_tile,
        "DIM_TILE": max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        "IEEE": queries.dtype == torch.float32,
        "num_warps": NUM_WARPS,
    }
    log_sum_exp = torch.empty(heads, num_queries, dtype=torch.float32, device=queries.device)
    shape = (num_queries, num_keys, first_position, dim, heads // kv_heads, scaling)
    _log_sum_exp_kernel[(heads, triton.cdiv(num_queries, query_tile))](
        queries, keys, log_sum_exp, *shape, **constants
    )
    sums = torch.empty(heads, num_keys, dtype=torch.float32, device=queries.device)
    _column_sums_kernel[(heads, triton.cdiv(num_keys, key_tile))](
        queries, keys, log_sum_exp, sums, *shape, **constants
    )
    return sums


if triton is not None:

    @triton.jit
    def _rows(tensor, head, rows, num_rows, feature, dim):
        """Rows ``rows`` of head ``head`` of ``tensor`` ``[heads, num_rows, dim]``, zero past its ends."""
        return tl.load(
            tensor + (head * num_rows + rows[:, None]) * dim + feature[None, :],
            mask=(rows[:, None] < num_rows) & (feature[None, :] < dim),
            other=0.0,
        )

    @triton.jit
    def _logits(query_tile, key_tile, scaling, IEEE: tl.constexpr):
        """``query_tile @ key_tile.T * scaling`` in fp32: exact products of half-precision inputs on
        the tensor cores, IEEE fp32 products of fp32 ones."""
        if IEEE:
            products = tl.dot(query_tile, tl.trans(key_tile), input_precision="ieee")
        else:
            products = tl.dot(query_tile, tl.trans(key_tile))
        return products * scaling

    @triton.jit(do_not_specialize=["num_queries", "num_keys", "first_position"])
    def _log_sum_exp_kernel(
        queries,
        keys,
        log_sum_exp,
        num_queries,
        num_keys,
        first_position,
        dim,
        group,
        scaling,
        QUERY_TILE: tl.constexpr,
        KEY_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)  # head * num_keys * dim passes 2^31 at long prompts
        query = tl.program_id(1) * QUERY_TILE + tl.arange(0, QUERY_TILE)
        feature = tl.arange(0, DIM_TILE)
        query_tile = _rows(queries, head, query, num_queries, feature, dim)
        position = first_position + query
        largest = tl.full([QUERY_TILE], float("-inf"), tl.float32)
        total = tl.zeros([QUERY_TILE], tl.float32)
        key_head = head // group
        last_key = tl.minimum(first_position + (tl.program_id(1) + 1) * QUERY_TILE, num_keys)
        for start in range(0, last_key, KEY_TILE):
            key = start + tl.arange(0, KEY_TILE)
            key_tile = _rows(keys, key_head, key, num_keys, feature, dim)
            logits = _logits(query_tile, key_tile, scaling, IEEE)
            logits = tl.where(key[None, :] <= position[:, None], logits, float("-inf"))
            new_largest = tl.maximum(largest, tl.max(logits, axis=1))
            # A row that has seen no key yet keeps -inf; exp(-inf - -inf) would be NaN.
            safe = tl.where(new_largest == float("-inf"), 0.0, new_largest)
            total = total * tl.exp(largest - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
            largest = new_largest
        tl.store(log_sum_exp + head * num_queries + query, largest + tl.log(total), mask=query < num_queries)

    @triton.jit(do_not_specialize=["num_queries", "num_keys", "first_position"])
    def _column_sums_kernel(
        queries,
        keys,
        log_sum_exp,
        sums,
        num_queries,
        num_keys,
        first_position,
        dim,
        group,
        scaling,
        QUERY_TILE: tl.constexpr,
        KEY_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        key = tl.program_id(1) * KEY_TILE + tl.arange(0, KEY_TILE)
        feature = tl.arange(0, DIM_TILE)
        key_tile = _rows(keys, head // group, key, num_keys, feature, dim)
        column = tl.zeros([KEY_TILE], tl.float32)
        # Queries before the tile's first key see none of it.
        first_query = tl.maximum(tl.program_id(1) * KEY_TILE - first_position, 0)
        for start in range(first_query // QUERY_TILE * QUERY_TILE, num_queries, QUERY_TILE):
            query = start + tl.arange(0, QUERY_TILE)
            query_tile = _rows(queries, head, query, num_queries, feature, dim)
            lse = tl.load(log_sum_exp + head * num_queries + query, mask=query < num_queries, other=0.0)
            logits = _logits(query_tile, key_tile, scaling, IEEE)
            seen = (key[None, :] <= first_position + query[:, None]) & (query[:, None] < num_queries)
            column += tl.sum(tl.where(seen, tl.exp(logits - lse[:, None]), 0.0), axis=0)
        tl.store(sums + head * num_keys + key, column, mask=key < num_keys)
