"""The op and sync counter (scripts.bench.dispatch_counts) on hand-counted code, and the
construction's host-device syncs: a fixed number per layer batch, however many layers (issue 22)."""

from __future__ import annotations

import pytest
import torch

from scripts.bench.construction_counts import count_compression, synthetic_prefilled_cache
from scripts.bench.dispatch_counts import count_dispatch


def test_counter_counts_launching_ops_and_syncs_by_hand():
    a = torch.randn(3, 4)
    with count_dispatch() as counts:
        b = a + 1  # 1 op
        c = b[1:].t()  # views: no op
        total = c.sum()  # 1 op
        total.item()  # 1 op (the copy to the host) and 1 sync
        torch.empty(5)  # an allocation launches nothing
        b.tolist()  # 1 sync, dispatching nothing on CPU
    assert (counts.ops, counts.syncs) == (3, 2)
    assert counts.syncs_by_op == {"_local_scalar_dense": 1, "tolist": 1}


def test_counter_counts_a_read_under_inference_mode():
    """Under ``inference_mode`` (the engine's) ``int()`` dispatches ``aten.item``, not
    ``_local_scalar_dense``: still one sync."""
    with torch.inference_mode(), count_dispatch() as counts:
        int(torch.ones(1).sum())
    assert counts.syncs == 1


@pytest.mark.parametrize("layers", [2, 5])
@pytest.mark.parametrize("base", ["snapkv", "adakv", "tova", "h2o"])
def test_compression_syncs_do_not_grow_with_layers(base, layers):
    """A base method reads its heads' budgets once; with ResKV the chosen sizes and the surviving
    entries once more each, for all layers together."""
    cache = synthetic_prefilled_cache(600, num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=16)
    assert count_compression(cache, base, 0.5, 16)[1] == 1
    assert count_compression(cache, base + "+reskv", 0.5, 16)[1] == 3
