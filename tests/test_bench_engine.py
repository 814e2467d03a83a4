"""The engine benchmark's FLOP accounting (scripts.bench.engine) against hand-counted operations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scripts.bench.engine import counted_gflop


def test_counted_flops_of_a_matmul_and_of_causal_and_full_attention():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    # [3, 5] @ [5, 7]: 3 * 7 outputs, 5 multiply-adds each.
    assert counted_gflop(torch.matmul, a, b) * 1e9 == 2 * 3 * 7 * 5
    query, key, value = (torch.randn(1, 2, 8, 4) for _ in range(3))
    # Per head q k^T and p v over 8 x 8 positions, head dim 4: 2 * (2 * 8 * 8 * 4) = 1024.
    full = 2 * 1024
    assert counted_gflop(F.scaled_dot_product_attention, query, key, value) * 1e9 == full
    # The causal kernel skips the masked half.
    causal = counted_gflop(F.scaled_dot_product_attention, query, key, value, None, 0.0, True)
    assert causal * 1e9 == full // 2
