"""Ops and host-device syncs of one decoded token at Llama-3.1-8B's attention shape.

    python -m scripts.bench.decode_counts --lengths 4096

A 32-layer Llama with the 8B model's attention (32 query heads, 8 KV heads, head dim 128) but tiny
hidden and MLP widths decodes one token over a cache compressed from random keys and values
(``scripts.bench.construction_counts.synthetic_prefilled_cache``): the ops a decode step issues depend on
the layers and the attention path, not on the widths. Every method decodes through the cache
``Prefill.generate`` decodes (``reskv.decoding.static_cache``), eagerly, then through the compiled step
(``decode="compiled"``, ``reskv.decoding.compiled_next_logits``), whose launches are the kernels in the
code inductor generates for it (``scripts.bench.dispatch_counts.compiled_kernels``; the CPU's C++
kernels here, where a GPU compiles Triton ones, fused by the same scheduler). Compiling the 32 layers
takes minutes on CPU (``--skip-compiled`` leaves it out). The count does not depend on the prompt's
length (static shapes, no loop over data), so 4K stands for every length; 32K needs more than 24 GB
of host memory for the synthetic cache and its compressed copies.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from baselines import build_method
from reskv.backbones import random_backbone
from reskv.cache import CACHE_KWARG
from reskv.decoding import compiled_next_logits, static_cache
from scripts.bench.construction_counts import LLAMA_ATTENTION, synthetic_prefilled_cache
from scripts.bench.dispatch_counts import compiled_kernels, count_dispatch, count_parser

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


def count_decode_step(
    backbone, cache, name: str, ratio: float, compiled: bool
) -> tuple[int, int, int | None]:
    """Ops and syncs of the second token ``name``'s cache of ``cache`` decodes eagerly (the first warms
    up), and the kernels the third launches through the compiled step (``None`` unless ``compiled``)."""
    compressed, _ = build_method(name, ratio).compress(cache, LLAMA_ATTENTION["head_dim"] ** -0.5)
    compressed = static_cache(compressed, 3)
    compressed.reserve(3)
    arguments = {backbone.cache_argument: compressed, CACHE_KWARG: compressed}
    kernels = None
    with torch.inference_mode():
        backbone.model(input_ids=torch.tensor([[5]]), use_cache=True, logits_to_keep=1, **arguments)
        with count_dispatch() as counts:
            backbone.model(input_ids=torch.tensor([[6]]), use_cache=True, logits_to_keep=1, **arguments)
        if compiled:
            kernels = compiled_kernels(compiled_next_logits, backbone, [7], compressed).total()
    return counts.ops, counts.syncs, kernels


def decode_counts_table(lengths: list[int], ratio: float, methods: list[str], compiled: bool = True) -> Table:
    table = Table(title=f"Decode ops and host-device syncs per token, 8B attention shape, ratio {ratio}")
    columns = ["prompt tokens", "method", "ops", "syncs", "ops / base", "ops / full"]
    if compiled:
        columns += ["compiled kernels", "kernels / base", "kernels / full"]
    for column in columns:
        table.add_column(column, justify="right")
    backbone = narrow_llama_8b_attention()
    for length in lengths:
        cache = synthetic_prefilled_cache(length, **LLAMA_ATTENTION)
        counted = {}
        for name in methods:
            ops, syncs, kernels = counted[name] = count_decode_step(backbone, cache, name, ratio, compiled)
            base = counted.get(name.removesuffix("+reskv"), counted[name])
            full = counted.get("full", counted[name])
            row = [str(length), name, f"{ops:,}", str(syncs), f"{ops / base[0]:.2f}", f"{ops / full[0]:.2f}"]
            if compiled:
                row += [f"{kernels:,}", f"{kernels / base[2]:.2f}", f"{kernels / full[2]:.2f}"]
            table.add_row(*row)
        del cache
    return table


def main() -> None:
    parser = count_parser(__doc__, DECODE_COUNTED_METHODS)
    parser.add_argument("--skip-compiled", action="store_true", help="count the eager step only")
    args = parser.parse_args()
    table = decode_counts_table(args.lengths, args.ratio, args.methods, compiled=not args.skip_compiled)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
