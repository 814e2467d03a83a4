"""Ops and syncs of one whole-prompt compression at Llama-3.1-8B's attention shape (issue 22).

    python -m scripts.construction_counts --lengths 4096 32768

``Prefill.compressed`` runs ``Method.compress`` over a prefilled cache; here the cache is filled with
random keys, values and observed queries of the shape the 8B model's prefill leaves (32 layers,
32 query heads, 8 KV heads, head dim 128, bf16), so no model forward is needed and 32K tokens fit a
CPU. The counts do not depend on the weights, only on the shapes the data decides (budgets, chosen
residual sizes). The k-means distance block is set to what a CUDA device of ``--gpu-gib`` GiB uses
(``reskv.residual.distance_block_bytes``), so the chunk launches counted are the GPU's; the CPU's
4 MiB block would add thousands of chunk launches that a GPU never makes.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from baselines import build_method
from reskv.cache import ObservedLayer, ResKVCache
from reskv.config import budget_for
from scripts.dispatch_counts import count_dispatch

LLAMA_ATTENTION = dict(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
COUNTED_METHODS = ("snapkv", "snapkv+reskv", "adakv", "adakv+reskv", "tova", "tova+reskv", "h2o", "h2o+reskv")
OBSERVED_QUERIES = 128


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
        layer.is_initialized = True
        layer.queries = torch.randn(num_heads, OBSERVED_QUERIES, head_dim, generator=generator).to(
            torch.bfloat16
        )
        layer.accumulated = torch.rand(num_kv_heads, seq_len, generator=generator) * 10
        layers.append(layer)
    return ResKVCache(layers)


def count_compression(cache: ResKVCache, name: str, ratio: float, head_dim: int) -> tuple[int, int]:
    """Ops and syncs of ``name``'s compression of ``cache`` at ``ratio``."""
    method = build_method(name, ratio)
    with torch.inference_mode(), count_dispatch() as counts:
        method.compress(cache, head_dim**-0.5)
    return counts.ops, counts.syncs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--methods", nargs="+", default=list(COUNTED_METHODS))
    args = parser.parse_args()
    console = Console(width=200)
    table = Table(
        title=f"Compression ops and syncs per prompt, Llama-3.1-8B attention shape, ratio {args.ratio}"
    )
    for column in ("prompt tokens", "method", "ops", "syncs", "ops / base"):
        table.add_column(column, justify="right")
    for length in args.lengths:
        cache = synthetic_prefilled_cache(length, **LLAMA_ATTENTION)
        base_ops = {}
        for name in args.methods:
            ops, syncs = count_compression(cache, name, args.ratio, LLAMA_ATTENTION["head_dim"])
            base = name.removesuffix("+reskv")
            base_ops.setdefault(base, ops)
            table.add_row(str(length), name, f"{ops:,}", str(syncs), f"{ops / base_ops[base]:.2f}")
            console.print(f"{length} {name}: {ops} ops, {syncs} syncs (b = {budget_for(length, args.ratio)})")
    console.print(table)


if __name__ == "__main__":
    main()
