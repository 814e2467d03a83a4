"""Causal attention's sums without writing its probabilities, in Triton: each key's column sum
(H2O's accumulated attention, ``reskv.scoring.accumulated_attention``; SnapKV's window means,
``reskv.scoring.mean_attention``) and each query's output (the validation proxy's full outputs,
``reskv.scoring.attention_outputs``).

The torch path computes fp32 logits of the queries over every visible key, a softmax over them, and
their sum over the queries or their product with the values: at 32K on the 8B shape those passes
over ``H x s^2 / 2`` fp32 probabilities took most of an H2O prefill on an H200
(results/gpu/README.md), and a construction's window, fit and validation queries write ``H x n x s``
of them three times each (results/README.md). Here:

1. ``_log_sum_exp_kernel``: a program takes a tile of one head's queries and runs over the keys each
   may see a tile at a time with a running maximum and sum (FlashAttention's online softmax),
   writing each query's ``lse = log sum_k exp(s_qk)``; with ``OUTPUTS`` it also accumulates the
   values under the same rescaling and writes each query's output, ``sum_k exp(s_qk) v_k / sum``;
2. ``_column_sums_kernel``: a program takes a tile of one head's keys and runs over the queries that
   see them, summing ``exp(s_qk - lse_q)`` over the queries: each key's column sum, in fp32.

The logits ``s_qk = <q, k> * scaling`` are fp32 dot products on the tensor cores of bf16 or fp16
queries and keys (every product exact in fp32, as in the torch path's fp32 matmul of the same
values), and the outputs' products of fp32 weights and half-precision values are TF32x3's (fp32-like
on the tensor cores). So each probability is the torch path's within fp32 rounding (``exp(s - lse)``
in place of ``exp(s - max) / sum``), and each sum adds the same terms in another order.

Triton is optional: without it (a CPU install) ``available`` is false and the torch path runs. On
CUDA only half-precision inputs take the kernels (``reskv.scoring.fused_attention_sums``): on fp32
ones their IEEE products spill registers (``python -m scripts.bench.kernel_resources``). Tested on
CPU under ``TRITON_INTERPRET=1`` (tests/test_baselines.py, tests/test_proxy.py) on fp32 inputs with
IEEE products, the same code but the products' precision: the interpreter multiplies bf16 operands
wrongly.
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
# timed on a GPU yet. The outputs' query tile is ``tl.dot``'s smallest: the proxy's 32 validation
# queries a head, and an fp32 accumulator of a tile's outputs beside the logits in registers. Their key
# tile is half the sums': with 64 keys ptxas spilled at head dim 128 in bf16 and fp16, compiled as a
# launch specializes the kernel (``python -m scripts.bench.kernel_resources``).
QUERY_TILE = 64
OUTPUT_QUERY_TILE = 16
KEY_TILE = 64
OUTPUT_KEY_TILE = 32
NUM_WARPS = 4


def available() -> bool:
    """Whether Triton is installed (the kernels then run on CUDA tensors)."""
    return triton is not None


def _launch_shape(queries: Tensor, keys: Tensor, first_position: int, scaling: float) -> dict:
    """The kernels' shape arguments for ``queries`` ``[H, n, d]`` at positions ``first_position ..
    first_position + n - 1`` over ``keys`` ``[H_kv, s, d]``, ``s = first_position + n``."""
    heads, num_queries, dim = queries.shape
    kv_heads, num_keys, _ = keys.shape
    if num_keys != first_position + num_queries:
        raise ValueError(
            f"{num_keys} keys for {num_queries} queries from position {first_position}: the last query "
            "must see the last key"
        )
    return {
        "num_queries": num_queries,
        "num_keys": num_keys,
        "first_position": first_position,
        "dim": dim,
        "group": heads // kv_heads,
        "scaling": scaling,
    }


def _contiguous_rows(tensor: Tensor) -> Tensor:
    """``tensor`` ``[heads, rows, d]`` itself where each head's rows are contiguous (a prefix of a
    longer cache's keys, or a slice of the observed queries: the kernels take the heads' stride), else
    a contiguous copy."""
    if tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]:
        return tensor
    return tensor.contiguous()


def _constants(queries: Tensor, query_tile: int, key_tile: int) -> dict:
    return {
        "QUERY_TILE": query_tile,
        "KEY_TILE": key_tile,
        "DIM_TILE": max(16, triton.next_power_of_2(queries.shape[-1])),  # tl.dot takes tiles of at least 16
        "IEEE": queries.dtype == torch.float32,
        "num_warps": NUM_WARPS,
    }


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
    shape = _launch_shape(queries, keys, first_position, scaling)
    queries, keys = _contiguous_rows(queries), _contiguous_rows(keys)
    constants = _constants(queries, query_tile, key_tile)
    heads, num_queries = queries.shape[:2]
    log_sum_exp = torch.empty(heads, num_queries, dtype=torch.float32, device=queries.device)
    strides = {"queries_head": queries.stride(0), "keys_head": keys.stride(0)}
    # Without OUTPUTS the kernel reads no values and writes no outputs: the keys and the sums stand in.
    _log_sum_exp_kernel[(heads, triton.cdiv(num_queries, query_tile))](
        queries=queries, keys=keys, values=keys, log_sum_exp=log_sum_exp, outputs=log_sum_exp,
        values_head=keys.stride(0), OUTPUTS=False, **strides, **shape, **constants,
    )  # fmt: skip
    sums = torch.empty(heads, keys.shape[1], dtype=torch.float32, device=queries.device)
    _column_sums_kernel[(heads, triton.cdiv(keys.shape[1], key_tile))](
        queries=queries, keys=keys, log_sum_exp=log_sum_exp, sums=sums, **strides, **shape, **constants
    )
    return sums


def outputs(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    first_position: int,
    scaling: float,
    query_tile: int = OUTPUT_QUERY_TILE,
    key_tile: int = OUTPUT_KEY_TILE,
) -> Tensor:
    """``[H, n, d]`` fp32: each query's causal attention output over ``keys`` and ``values``
    ``[H_kv, s, d]``, as ``column_sums`` takes them. One launch; tiles of at least 16."""
    shape = _launch_shape(queries, keys, first_position, scaling)
    queries, keys, values = (_contiguous_rows(tensor) for tensor in (queries, keys, values))
    heads, num_queries, dim = queries.shape
    found = torch.empty(heads, num_queries, dim, dtype=torch.float32, device=queries.device)
    # With OUTPUTS the kernel writes no log-sum-exp: the outputs stand in.
    _log_sum_exp_kernel[(heads, triton.cdiv(num_queries, query_tile))](
        queries=queries, keys=keys, values=values, log_sum_exp=found, outputs=found,
        queries_head=queries.stride(0), keys_head=keys.stride(0), values_head=values.stride(0),
        OUTPUTS=True, **shape, **_constants(queries, query_tile, key_tile),
    )  # fmt: skip
    return found


if triton is not None:

    @triton.jit
    def _rows(tensor, head_stride, head, rows, num_rows, feature, dim):
        """Rows ``rows`` of head ``head`` of ``tensor`` ``[heads, num_rows, dim]`` (rows contiguous, heads
        ``head_stride`` apart), zero past its ends."""
        return tl.load(
            tensor + head * head_stride + rows[:, None] * dim + feature[None, :],
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

    @triton.jit
    def _weighted(weights, value_tile, IEEE: tl.constexpr):
        """``weights @ value_tile`` in fp32: IEEE products, or TF32x3's (fp32-like on the tensor cores)
        where the values are half precision, exact in TF32."""
        if IEEE:
            return tl.dot(weights, value_tile, input_precision="ieee")
        return tl.dot(weights, value_tile, input_precision="tf32x3")

    @triton.jit(do_not_specialize=["num_queries", "num_keys", "first_position"])
    def _log_sum_exp_kernel(
        queries,
        keys,
        values,
        log_sum_exp,
        outputs,
        queries_head,
        keys_head,
        values_head,
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
        OUTPUTS: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)  # head times a head's stride passes 2^31 at long prompts
        query = tl.program_id(1) * QUERY_TILE + tl.arange(0, QUERY_TILE)
        feature = tl.arange(0, DIM_TILE)
        query_tile = _rows(queries, queries_head, head, query, num_queries, feature, dim)
        position = first_position + query
        largest = tl.full([QUERY_TILE], float("-inf"), tl.float32)
        total = tl.zeros([QUERY_TILE], tl.float32)
        output = tl.zeros([QUERY_TILE, DIM_TILE], tl.float32)
        key_head = head // group
        last_key = tl.minimum(first_position + (tl.program_id(1) + 1) * QUERY_TILE, num_keys)
        for start in range(0, last_key, KEY_TILE):
            key = start + tl.arange(0, KEY_TILE)
            key_tile = _rows(keys, keys_head, key_head, key, num_keys, feature, dim)
            logits = _logits(query_tile, key_tile, scaling, IEEE)
            logits = tl.where(key[None, :] <= position[:, None], logits, float("-inf"))
            new_largest = tl.maximum(largest, tl.max(logits, axis=1))
            # A row that has seen no key yet keeps -inf; exp(-inf - -inf) would be NaN.
            safe = tl.where(new_largest == float("-inf"), 0.0, new_largest)
            rescale = tl.exp(largest - safe)
            weights = tl.exp(logits - safe[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            if OUTPUTS:
                value_tile = _rows(values, values_head, key_head, key, num_keys, feature, dim).to(tl.float32)
                output = output * rescale[:, None] + _weighted(weights, value_tile, IEEE)
            largest = new_largest
        if OUTPUTS:
            tl.store(
                outputs + (head * num_queries + query[:, None]) * dim + feature[None, :],
                output / total[:, None],
                mask=(query[:, None] < num_queries) & (feature[None, :] < dim),
            )
        else:
            tl.store(
                log_sum_exp + head * num_queries + query, largest + tl.log(total), mask=query < num_queries
            )

    @triton.jit(do_not_specialize=["num_queries", "num_keys", "first_position"])
    def _column_sums_kernel(
        queries,
        keys,
        log_sum_exp,
        sums,
        queries_head,
        keys_head,
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
        key_tile = _rows(keys, keys_head, head // group, key, num_keys, feature, dim)
        column = tl.zeros([KEY_TILE], tl.float32)
        # Queries before the tile's first key see none of it.
        first_query = tl.maximum(tl.program_id(1) * KEY_TILE - first_position, 0)
        for start in range(first_query // QUERY_TILE * QUERY_TILE, num_queries, QUERY_TILE):
            query = start + tl.arange(0, QUERY_TILE)
            query_tile = _rows(queries, queries_head, head, query, num_queries, feature, dim)
            lse = tl.load(log_sum_exp + head * num_queries + query, mask=query < num_queries, other=0.0)
            logits = _logits(query_tile, key_tile, scaling, IEEE)
            seen = (key[None, :] <= first_position + query[:, None]) & (query[:, None] < num_queries)
            column += tl.sum(tl.where(seen, tl.exp(logits - lse[:, None]), 0.0), axis=0)
        tl.store(sums + head * num_keys + key, column, mask=key < num_keys)
