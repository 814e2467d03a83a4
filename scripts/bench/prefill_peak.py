"""Where a request's prefill peaks in memory, and the floor that puts under a compressed request's
peak as a share of the full cache's.

    python -m scripts.bench.prefill_peak [--tokens 2048] [--layers 2] [--at 131008]

Llama-3.1-8B's shape with ``--layers`` layers (random weights, fp32 on the CPU, a 512-token
vocabulary so that the embedding stays small), one ``--tokens``-token prompt: the prefill of the full
cache, and SnapKV and SnapKV+ResKV at ratio 0.9 compressing inside it (``retain="compressed"``).
Per request, the peak allocated bytes beyond the start, per prompt token, and the modules and aten
op running at that moment (``scripts.measure.peak_site``).

Each peaks in the last layer's MLP, at the product ``act(gate(x)) * up(x)``: three ``[s, I]``
intermediates are alive there beside the residual stream ``[s, H]``, whatever the cache holds. So
at the real 32-layer model in bf16 and ``--at`` tokens, any request's peak is at least weights +
``(3 I + H) s`` bf16 bytes + its cache, and a compressed request's peak over the full cache's is at
least ``(W + A + C) / (W + A + F)`` for that lower bound ``A``: the last line prints it, for the
cache of SnapKV at 0.9 (``C``) and the full one (``F``).
"""

from __future__ import annotations

import argparse

import torch

from baselines import build_method
from reskv.backbones import random_backbone
from reskv.config import budget_for
from reskv.engine import Prefill
from scripts.measure import peak_site, random_prompt

SHAPE = "llama3.1-8b-instruct"
RATIO = 0.9


def request_peaks(tokens: int, layers: int) -> list[tuple[str, object]]:
    """``(method, PeakSite)`` of the full cache's prefill and of SnapKV's and SnapKV+ResKV's
    compressing prefills, fp32 on the CPU."""
    torch.manual_seed(0)
    backbone = random_backbone(SHAPE, torch.float32, "cpu", num_hidden_layers=layers, vocab_size=512)
    prompt = random_prompt(range(1, 512), tokens, seed=42)
    peaks = []
    for name in ("full", "snapkv", "snapkv+reskv"):
        with peak_site(backbone.model) as site:
            if name == "full":
                Prefill(backbone, prompt, tokens)
            else:
                method = build_method(name, RATIO)
                Prefill(backbone, prompt, tokens, [method], retain="compressed").compressed(method)
        peaks.append((name, site))
    return peaks


def compressed_peak_floor(tokens: int) -> dict:
    """The lower bound on a compressed request's peak over the full cache's (module docstring) at
    ``tokens`` for the 32-layer bf16 model: its weights, the MLP product's activations, SnapKV's
    cache at ``RATIO`` and the full cache, in bytes, and the bound."""
    model = random_backbone(SHAPE, torch.bfloat16, "meta").model  # shapes only, no memory
    config = model.config
    weights = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    activations = 2 * (3 * config.intermediate_size + config.hidden_size) * tokens
    per_slot = 2 * 2 * config.num_key_value_heads * config.head_dim * config.num_hidden_layers
    compressed, full = per_slot * budget_for(tokens, RATIO), per_slot * tokens
    return {
        "weights": weights,
        "activations": activations,
        "compressed_cache": compressed,
        "full_cache": full,
        "bound": (weights + activations + compressed) / (weights + activations + full),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--at", type=int, default=131008)
    args = parser.parse_args(argv)
    print(f"{SHAPE} shape, {args.layers} layers, fp32, CPU, {args.tokens} prompt tokens, ratio {RATIO}")
    for name, site in request_peaks(args.tokens, args.layers):
        where = " > ".join(site.modules[-2:])
        per_token = site.bytes / args.tokens / 1024
        print(f"{name}: peak {site.bytes / 2**20:.0f} MiB beyond the start, {per_token:.1f} KiB per token,")
        print(f"  at {where} ({site.op})")
    floor = compressed_peak_floor(args.at)
    gib = {key: value / 2**30 for key, value in floor.items() if key != "bound"}
    print(
        f"at {args.at} tokens, the whole model, bf16: weights {gib['weights']:.2f} GiB + MLP product >= "
        f"{gib['activations']:.2f} GiB; cache SnapKV {gib['compressed_cache']:.2f} GiB, full "
        f"{gib['full_cache']:.2f} GiB: a compressed request's peak >= {floor['bound']:.3f} x the full cache's"
    )


if __name__ == "__main__":
    main()
