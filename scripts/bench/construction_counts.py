"""Ops and syncs of one whole-prompt compression at Llama-3.1-8B's attention shape.

    python -m scripts.bench.construction_counts --lengths 4096 32768   # 32K: a host with more than 24 GB

``Prefill.compressed`` runs ``Method.compress`` over a prefilled cache; here the cache is filled with
random keys, values and observed queries of the shape the 8B model's prefill leaves (32 layers,
32 query heads, 8 KV heads, head dim 128, bf16), so no model forward is needed and 32K tokens fit a
CPU. The counts do not depend on the weights, only on the shapes the data decides (budgets, chosen
residual sizes). The work is laid out as on an 80 GB GPU (``gpu_layout``: the k-means' distance
block, k-means groups padded as on CUDA, ``argmin``, layers stacked), so the launches
counted are a GPU's: the CPU's 4 MiB blocks, FLOP-saving groups, vectorised argmin and one-layer
batches would add thousands that a GPU never makes. A second table
models those launches per Lloyd step at 131K tokens, where counting for real would take hours of CPU.
The counts are the torch path's: on CUDA with Triton the nearest centres are one kernel per Lloyd
step and group (``reskv.nearest_kernel``) where the torch path launches a product and an ``argmin``
per distance block.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

import reskv.method
import reskv.proxy
import reskv.residual
from baselines import build_method
from reskv.cache import ObservedLayer, ResKVCache
from reskv.config import DEVICE_MEMORY_SHARE, ResidualConfig, budget_for, residual_size
from reskv.method import LAYER_BATCH_BYTES
from reskv.residual import DISTANCE_CHUNK_BYTES
from scripts.bench.dispatch_counts import count_dispatch, count_parser

LLAMA_ATTENTION = dict(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
COUNTED_METHODS = ("snapkv", "snapkv+reskv", "adakv", "adakv+reskv", "tova", "tova+reskv", "h2o", "h2o+reskv")
OBSERVED_QUERIES = 128
H100_BLOCK_BYTES = (80 << 30) // DEVICE_MEMORY_SHARE
PADS_WITHIN = reskv.residual.pads_within


def synthetic_prefilled_cache(
    seq_len: int, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 0
) -> ResKVCache:
    """A prefilled cache of random bf16 keys and values with clustered structure (keys drawn around
    64 centres per head, as real keys cluster), the last 128 queries observed, and H2O's column sums."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        centres = torch.randn(num_kv_heads, 64, head_dim, generator=generator) * 2
        member = torch.randint(0, 64, (num_kv_heads, seq_len), generator=generator)
        keys = centres.gather(1, member[..., None].expand(-1, -1, head_dim))
        keys = keys + torch.randn(num_kv_heads, seq_len, head_dim, generator=generator)
        layer = ObservedLayer()
        layer.keys = keys.to(torch.bfloat16)[None]
        layer.values = torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator).to(torch.bfloat16)
        layer.is_initialized, layer.device = True, layer.keys.device
        layer.queries = torch.randn(num_heads, OBSERVED_QUERIES, head_dim, generator=generator).to(
            torch.bfloat16
        )
        layer.accumulated = torch.rand(num_kv_heads, seq_len, generator=generator) * 10
        layers.append(layer)
    return ResKVCache(layers)


def pads_within_on_cuda(padded: int, own: int, device: torch.device) -> bool:
    """``reskv.residual.pads_within`` as on CUDA, whatever ``device``."""
    return PADS_WITHIN(padded, own, torch.device("cuda"))


def skips_padding_on_cuda(keys: torch.Tensor) -> bool:
    """``reskv.residual.nearest_skips_padding`` as on a GPU with Triton: bf16 keys take the kernel."""
    return keys.dtype == torch.bfloat16


@contextlib.contextmanager
def gpu_layout():
    """Construction laid out on CPU as on an 80 GB GPU: 2.5 GiB distance blocks and blocks of the
    proxy's losses (``reskv.proxy.loss_block_bytes``), k-means groups padded as on CUDA
    (``reskv.residual.pads_within``, and ``nearest_skips_padding`` for bf16 keys, whose nearest centres
    a GPU's kernel finds), distances at the centres' own width, ``argmin`` for the nearest centre
    (``reskv.residual``) and every layer of a 4 GiB batch stacked (``reskv.method``)."""
    with contextlib.ExitStack() as stack:
        for module, name, value in (
            (reskv.residual, "DISTANCE_CHUNK_BYTES", H100_BLOCK_BYTES),
            (reskv.proxy, "loss_block_bytes", lambda device: H100_BLOCK_BYTES),
            (reskv.residual, "pads_within", pads_within_on_cuda),
            (reskv.residual, "nearest_skips_padding", skips_padding_on_cuda),
            (reskv.residual, "CPU_NARROWEST_PADDED_WIDTH", 0),
            (reskv.residual, "CPU_DISTANCE_WIDTH_MULTIPLE", 1),
            (reskv.residual, "CPU_VECTORISED_ARGMIN", False),
            (reskv.method, "CPU_LAYER_BATCH_BYTES", LAYER_BATCH_BYTES),
        ):
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def count_compression(cache: ResKVCache, name: str, ratio: float, head_dim: int) -> tuple[int, int]:
    """Ops and syncs of ``name``'s compression of ``cache`` at ``ratio`` (its layers' compressed states;
    a cache assembled from them is the decode's), laid out as on an 80 GB GPU (``gpu_layout``)."""
    method = build_method(name, ratio)
    with gpu_layout(), torch.no_grad(), count_dispatch() as counts:
        method.compressed_layers(cache, head_dim**-0.5)
    return counts.ops, counts.syncs


def distance_launches(seq_len: int, ratio: float, block_bytes: int) -> list[tuple[str, int, int]]:
    """A model of the k-means distance launches per Lloyd step and layer batch at the 8B shape, for a
    SnapKV plan (uniform budgets, every candidate admissible, the final cache at the grid's largest
    ``r``): ``(group, fp32 bytes of its [rows, E, r] distances, launches = ceil(bytes / block))``."""
    heads, head_dim = LLAMA_ATTENTION["num_kv_heads"], LLAMA_ATTENTION["head_dim"]
    budget, config = budget_for(seq_len, ratio), ResidualConfig()
    layer_bytes = 2 * heads * seq_len * head_dim * 2  # bf16 keys and values
    rows = heads * min(LLAMA_ATTENTION["num_layers"], max(1, LAYER_BATCH_BYTES // layer_bytes))
    groups = []
    for level in config.grid[1:]:
        size = residual_size(level, budget)
        points = seq_len - (budget - size)  # |E'| = β - m' with m' = b - r - |validation|
        groups.append((f"candidates r = {size}", rows * points * size * 4))
    size = residual_size(config.grid[-1], budget)
    groups.append((f"final r = {size}", rows * (seq_len - budget + size) * size * 4))
    return [(name, nbytes, -(-nbytes // block_bytes)) for name, nbytes in groups]


def counts_table(lengths: list[int], ratio: float, methods: list[str]) -> Table:
    table = Table(
        title=f"Compression ops and host-device syncs per prompt, 8B attention shape, ratio {ratio}"
    )
    for column in ("prompt tokens", "method", "ops", "syncs", "ops / base"):
        table.add_column(column, justify="right")
    for length in lengths:
        cache = synthetic_prefilled_cache(length, **LLAMA_ATTENTION)
        base_ops = {}
        for name in methods:
            ops, syncs = count_compression(cache, name, ratio, LLAMA_ATTENTION["head_dim"])
            base = name.removesuffix("+reskv")
            base_ops.setdefault(base, ops)
            table.add_row(str(length), name, f"{ops:,}", str(syncs), f"{ops / base_ops[base]:.2f}")
        del cache
    return table


def launches_table(seq_len: int, ratio: float) -> Table:
    title = f"Model: k-means distance launches per Lloyd step and layer batch, {seq_len} tokens"
    table = Table(title=f"{title}, ratio {ratio}")
    gpu_column = f"launches, {H100_BLOCK_BYTES / 2**30:g} GiB (80 GB GPU)"
    # reskv.nearest_kernel (CUDA with Triton) writes no distances: one launch per group, any size.
    fused_column = "launches, fused kernel"
    for column in ("group", "distances GiB", "launches, 4 MiB (CPU)", gpu_column, fused_column):
        table.add_column(column, justify="right")
    cpu = distance_launches(seq_len, ratio, DISTANCE_CHUNK_BYTES)
    gpu = distance_launches(seq_len, ratio, H100_BLOCK_BYTES)
    for (name, nbytes, cpu_launches), (_, _, gpu_launches) in zip(cpu, gpu, strict=True):
        table.add_row(name, f"{nbytes / 2**30:.1f}", f"{cpu_launches:,}", str(gpu_launches), "1")
    return table


def main() -> None:
    args = count_parser(__doc__, COUNTED_METHODS).parse_args()
    console = Console(width=200)
    console.print(counts_table(args.lengths, args.ratio, args.methods))
    console.print(launches_table(131072, args.ratio))


if __name__ == "__main__":
    main()
