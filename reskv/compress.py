"""Compression of one prefilled layer: budget, main selection, residual size and entries.

The flow follows reskv.md: ``b = floor(s * (1 - ratio))`` slots per KV head; the base method's
scorer gives token scores, the protected window and the per-head split of the layer's budget;
``M = P ∪ Top_{m-|P|}(scores)``; with a residual, ``b = m + r`` and the evicted side ``E`` is
summarised by ``r`` k-means entries, ``r`` chosen per head by the validation proxy
(``reskv.proxy``). ``build_cache`` is the one builder (select, gather, residual entries) for the
deployed cache and the proxy's candidates alike.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.attention import residual_attention
from reskv.config import DecodeRule, ResidualConfig, budget_for
from reskv.residual import ResidualEntries, build_residual, residual_sizes
from reskv.scoring import LayerObservation, TokenScorer
from reskv.selection import gather_tokens, select_main


@dataclass
class CompressedLayerState:
    """What a compressed layer holds: padded main cache, residual entries and bookkeeping."""

    main_keys: Tensor  # [H_kv, n, d], in position order, padded per head
    main_values: Tensor
    main_bias: Tensor | None  # [H_kv, 1, n]: -inf on padding, None when no head is padded
    residual: ResidualEntries
    kept: Tensor  # [H_kv, s] bool: the prompt tokens in the main cache
    stats: dict = field(default_factory=dict)

    @property
    def evicted_fraction(self) -> Tensor:
        """``|E| / s`` per KV head, for the no-shared-softmax ablation."""
        return (~self.kept).sum(dim=-1) / self.kept.shape[-1]

    def attend(self, queries: Tensor, scaling: float, rule: DecodeRule) -> Tensor:
        """Output ``[H_kv, Q, d]`` for grouped queries over this layer as compressed (nothing appended)."""
        residual = self.residual
        return residual_attention(
            queries,
            self.main_keys,
            self.main_values,
            self.main_bias,
            residual.keys,
            residual.values,
            residual.log_counts,
            scaling,
            rule,
            self.evicted_fraction,
        )


def kept_positions(kept: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of each head's kept tokens in position order ``[H, n]``, padded to the longest
    head, and which of them are real ``[H, n]``."""
    counts = kept.sum(dim=-1)
    longest = int(counts.max())
    positions = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices[:, :longest]
    return positions, torch.arange(longest, device=kept.device)[None, :] < counts[:, None]


def additive_mask(visible: Tensor) -> Tensor:
    """0 where ``visible``, ``-inf`` elsewhere (fp32)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def build_cache(
    keys: Tensor,
    values: Tensor,
    scores: Tensor,
    window: int,
    main_sizes: Tensor,
    residual_sizes: Tensor,
    iterations: int,
    merge: Callable[[Tensor], Tensor] | None = None,
) -> CompressedLayerState:
    """The one cache builder, for the deployed cache and the validation proxy's candidates alike:
    select ``M = P ∪ Top_{m-|P|}(scores)``, gather it in position order, summarise ``E = S \\ M``
    into residual entries (reskv.md, Main cache and Residual entries).

    ``keys``/``values`` ``[H, s, d]``; ``scores`` ``[H, s]``; ``main_sizes`` and ``residual_sizes``
    ``[H]``. ``merge(kept)`` gives the values the main cache holds (CaM merges evicted values into
    retained ones); residual entries always summarise the original values.
    """
    kept = select_main(scores, window, main_sizes)
    positions, real = kept_positions(kept)
    main_bias = None if bool(real.all()) else additive_mask(real)[:, None, :]
    main_values = values if merge is None else merge(kept)
    entries = build_residual(keys, values, ~kept, scores, residual_sizes, iterations)
    return CompressedLayerState(
        gather_tokens(keys, positions), gather_tokens(main_values, positions), main_bias, entries, kept
    )


def fixed_sizes(config: ResidualConfig, budgets: Tensor, window: int) -> Tensor:
    """The "w/o validation" ablation: ``r = floor(fixed_ratio * b + 0.5)`` wherever ``m - |P| >= 0``."""
    sizes = residual_sizes(config.fixed_ratio, budgets)
    return sizes.masked_fill(budgets - sizes < window, 0)


def compress_layer(
    obs: LayerObservation, scorer: TokenScorer, ratio: float, residual: ResidualConfig | None = None
) -> CompressedLayerState | None:
    """Compress one layer; ``None`` when the budget covers the prompt (the cache stays full, bit for bit)."""
    from reskv.proxy import ValidationProxy, observation_split  # the proxy builds with build_cache

    seq_len = obs.seq_len
    budget = budget_for(seq_len, ratio)
    if seq_len <= budget:
        return None
    if budget < 1:
        raise ValueError(
            f"ratio {ratio} leaves no slot for a {seq_len}-token prompt: "
            f"budget_for({seq_len}, {ratio}) = {budget}"
        )
    scores, window = scorer.prompt_scores(obs), scorer.window
    budgets = scorer.head_budgets(scores, budget)
    sizes = torch.zeros_like(budgets)
    if residual is not None and not residual.validate:
        sizes = fixed_sizes(residual, budgets, min(window, seq_len))
    elif residual is not None and (split := observation_split(obs, residual)) is not None:
        proxy = ValidationProxy(obs, scorer, residual, split)
        sizes = proxy.choose(budgets)
        if residual.final_selection == "fit":
            scores, window = proxy.fit_selection()
    iterations = residual.kmeans_iterations if residual is not None else 0  # no residual: sizes are 0
    state = build_cache(
        obs.keys,
        obs.values,
        scores,
        window,
        budgets - sizes,
        sizes,
        iterations,
        merge=lambda kept: scorer.adjust_values(obs, kept),
    )
    state.stats = {
        "budget": budget,
        "main_slots": state.kept.sum(dim=-1).tolist(),
        "residual_entries": state.residual.entries_per_head.tolist(),
        "residual_slots": sizes.tolist(),
    }
    return state


def kmeans_peak_memory(
    seq_len: int = 32768,
    ratio: float = 0.6,
    residual_ratio: float = 0.2,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> dict:
    """Peak transient memory and time of one layer's residual clustering on random tensors.

    Defaults: a Llama-3.1-8B-shaped layer (8 KV heads, head dim 128) at 32K tokens, ratio 0.6,
    and the largest residual the grid allows (``r = 0.2 b``), every head evicting ``s - b`` tokens.
    The peak is the high-water mark of memory allocated inside ``build_residual`` beyond its
    inputs: ``torch.cuda.max_memory_allocated`` on CUDA, the profiler's allocation events on CPU.
    Returns ``{"peak_bytes", "seconds", "points", "entries"}`` (points and entries per head).
    """
    generator = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(num_kv_heads, seq_len, head_dim, generator=generator, device=device).to(dtype)
    values = torch.randn(num_kv_heads, seq_len, head_dim, generator=generator, device=device).to(dtype)
    scores = torch.rand(num_kv_heads, seq_len, generator=generator, device=device)
    budget = budget_for(seq_len, ratio)
    evicted = scores.argsort(dim=-1).argsort(dim=-1) < seq_len - budget  # the lowest-scored s - b tokens
    sizes = residual_sizes(residual_ratio, torch.full((num_kv_heads,), budget, device=device))

    def run() -> tuple[ResidualEntries, float]:
        start = time.perf_counter()
        entries = build_residual(keys, values, evicted, scores, sizes, iterations=4)
        if device != "cpu":
            torch.cuda.synchronize()
        return entries, time.perf_counter() - start

    if device == "cpu":
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
            entries, seconds = run()
        allocations = sorted(
            (event.start_ns(), event.nbytes())
            for event in prof.profiler.kineto_results.events()
            if event.name() == "[memory]"
        )
        peak = max(itertools.accumulate(nbytes for _, nbytes in allocations), default=0)
    else:
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        entries, seconds = run()
        peak = torch.cuda.max_memory_allocated(device) - baseline
    return {
        "peak_bytes": int(peak),
        "seconds": seconds,
        "points": seq_len - budget,
        "entries": int(entries.entries_per_head.max()),
    }
