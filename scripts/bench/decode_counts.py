"""Ops and host-device syncs of one decoded token at Llama-3.1-8B's attention shape (issue 24).

    python -m scripts.bench.decode_counts --lengths 4096

A 32-layer Llama with the 8B model's attention (32 query heads, 8 KV heads, head dim 128) but tiny
hidden and MLP widths decodes one token over a cache compressed from random keys and values
(``scripts.bench.construction_counts.synthetic_prefilled_cache``): the ops a decode step issues depend on
the layers and the attention path, not on the widths. Every method decodes through the cache
``Prefill.generate`` decodes (``reskv.engine.static_cache``), eagerly. The count does not depend on the
prompt's length (static shapes, no loop over data), so 4K stands for every length; 32K needs more than
24 GB of host memory for the synthetic cache and its compressed copies.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from baselines import build_method
from reskv.backbones import random_backbone
from reskv.cache import CACHE_KWARG
from reskv.engine import static_cache
from scripts.bench.construction_counts import LLAMA_ATTENTION, synthetic_prefilled_cache
from scripts.bench.dispatch_counts import count_arguments, count_dispatch

DECODE_COUNTED_METHODS = ("full", "snapkv", "snapkv+reskv", "adakv", "adakv+reskv")


def narrow_llama_8b_attention(num_layers: int = LLAMA_ATTENTION["num_layers"]):
    """The 8B model's attention shape on 32 layers (or ``num_layers``), with hidden and MLP widths of
    256 (random weights)."""
    torch.manual_seed(0)
    return random_backbone(
        "llama3.1-8b-instruct",
        torch.bfloat16,
        "cpu",
        num_hidden_layers=num_layers,
        num_attention_heads=LLAMA_ATTENTION["num_heads"],
        num_key_value_heads=LLAMA_ATTENTION["num_kv_heads"],
        head_dim=LLAMA_ATTENTION["head_dim"],
        hidden_size=256,
        intermediate_size=256,
        vocab_size=512,
    )


def count_decode_step(backbone, cache, name: str, ratio: float) -> tuple[int, int]:
    """Ops and syncs of the second token ``name``'s cache of ``cache`` decodes (the first warms up)."""
    compressed, _ = build_method(name, ratio).compress(cache, LLAMA_ATTENTION["head_dim"] ** -0.5)
    compressed = static_cache(compressed, 2)
    compressed.reserve(2)
    arguments = {backbone.cache_argument: compressed, CACHE_KWARG: compressed}
    with torch.inference_mode():
        backbone.model(input_ids=torch.tensor([[5]]), use_cache=True, logits_to_keep=1, **arguments)
        with count_dispatch() as counts:
            backbone.model(input_ids=torch.tensor([[6]]), use_cache=True, logits_to_keep=1, **arguments)
    return counts.ops, counts.syncs


def decode_counts_table(lengths: list[int], ratio: float, methods: list[str]) -> Table:
    table = Table(title=f"Decode ops and host-device syncs per token, 8B attention shape, ratio {ratio}")
    for column in ("prompt tokens", "method", "ops", "syncs", "ops / base", "ops / full"):
        table.add_column(column, justify="right")
    backbone = narrow_llama_8b_attention()
    for length in lengths:
        cache = synthetic_prefilled_cache(length, **LLAMA_ATTENTION)
        counted = {}
        for name in methods:
            ops, syncs = counted[name] = count_decode_step(backbone, cache, name, ratio)
            base = counted.get(name.removesuffix("+reskv"), (ops,))[0]
            full = counted.get("full", (ops,))[0]
            table.add_row(str(length), name, f"{ops:,}", str(syncs), f"{ops / base:.2f}", f"{ops / full:.2f}")
        del cache
    return table


def main() -> None:
    args = count_arguments(__doc__, DECODE_COUNTED_METHODS)
    Console(width=200).print(decode_counts_table(args.lengths, args.ratio, args.methods))


if __name__ == "__main__":
    main()
