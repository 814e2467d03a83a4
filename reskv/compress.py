"""Compression of prefilled layers: budget, main selection, residual size and entries.

The flow follows reskv.md: ``b = floor(s * (1 - ratio))`` slots per KV head; the base method's
scorer gives token scores, the protected window and the per-head split of the layer's budget;
``M = P ∪ Top_{m-|P|}(scores)``; with a residual, ``b = m + r`` and the evicted side ``E`` is
summarised by ``r`` k-means entries, ``r`` chosen per head by the validation proxy
(``reskv.proxy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.attention import padding_bias, residual_attention
from reskv.config import DecodeRule, ResidualConfig, budget_for
from reskv.proxy import ValidationProxy, observation_split
from reskv.residual import (
    ResidualEntries,
    RowGroup,
    build_residual,
    padded_groups,
    residual_size,
)
from reskv.scoring import LayerObservation, TokenScorer, stack_layers
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


def kept_positions(kept: Tensor, longest: int) -> Tensor:
    """Positions ``[H, longest]`` of each head's kept tokens in position order, padded with
    positions of evicted tokens; ``longest`` (host) is the largest number of kept tokens."""
    return torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices[:, :longest]


def kept_count(main_size: int, seq_len: int) -> int:
    """Tokens ``select_main`` keeps for a head of ``main_size`` slots (its window part included)."""
    return min(max(main_size, 0), seq_len)


def fixed_sizes(config: ResidualConfig, budgets: list[int], window: int) -> list[int]:
    """The "w/o validation" ablation: ``r = floor(fixed_ratio * b + 0.5)`` wherever ``m - |P| >= 0``."""
    sizes = [residual_size(config.fixed_ratio, budget) for budget in budgets]
    return [0 if budget - size < window else size for budget, size in zip(budgets, sizes, strict=True)]


def grid_level(grid: tuple[float, ...], size: int, budget: int) -> int:
    """The first ratio of ``grid`` (its index) whose residual size for a head of ``budget`` slots is
    ``size``, ``r = floor(ratio * b + 0.5)``: the candidate the proxy chose, since it skips a ratio
    that repeats an earlier one's ``r`` (``reskv.proxy.candidate_sizes``); -1 for none."""
    return next((level for level, ratio in enumerate(grid) if residual_size(ratio, budget) == size), -1)


def residual_choice(config: ResidualConfig, size: int, budget: int) -> float:
    """The ratio a head's residual size came from (``reskv.stats.CacheStats.residual_choice``): 0 for
    the main cache only, ``fixed_ratio`` without validation, else the grid's ratio the proxy chose."""
    if size == 0:
        return 0.0
    return config.grid[grid_level(config.grid, size, budget)] if config.validate else config.fixed_ratio


def level_groups(
    sizes: list[int],
    point_counts: list[int],
    budgets: list[int],
    grid: tuple[float, ...],
    device: torch.device,
) -> list[RowGroup]:
    """The final cache's k-means groups: the rows with entries by grid level (a head's ``r`` is
    ``floor(ratio * b_h + 0.5)`` of one level, so sizes within a level are close), each level split
    as ``padded_groups`` does; with uniform budgets a level's sizes are equal."""
    capped = [min(size, points) for size, points in zip(sizes, point_counts, strict=True)]
    levels: dict[int, list[int]] = {}
    for row, (size, budget) in enumerate(zip(sizes, budgets, strict=True)):
        if size:
            levels.setdefault(grid_level(grid, size, budget), []).append(row)
    return [group for rows in levels.values() for group in padded_groups(rows, capped, point_counts, device)]


def compress_layer(
    obs: LayerObservation,
    scorer: TokenScorer,
    ratio: float,
    residual: ResidualConfig | None = None,
    model_layers: int | None = None,
) -> CompressedLayerState | None:
    """Compress one layer (``compress_layers`` of one); ``None`` when the budget covers the prompt."""
    return compress_layers([obs], scorer, ratio, residual, model_layers)[0]


def compress_layers(
    observations: list[LayerObservation],
    scorer: TokenScorer,
    ratio: float,
    residual: ResidualConfig | None = None,
    model_layers: int | None = None,
) -> list[CompressedLayerState | None]:
    """Compress layers of one prompt; ``None`` for each when the budget covers the prompt (the cache
    stays full, bit for bit). ``model_layers`` is the model's layer count, for scorers whose budgets
    depend on the layer (PyramidKV).

    Each layer is scored, selected and gathered on its own, as the base method does. What ResKV
    adds runs once for all the layers given, stacked along the heads (``stack_layers``): the
    validation proxy and the k-means of the final entries. Every shape is planned from host
    integers, so the device is read three times, whatever the number of layers (issue 22): the
    heads' budgets, the chosen residual sizes, and the entries that survived (empty clusters).
    """
    seq_len, num_layers = observations[0].seq_len, len(observations)
    budget = budget_for(seq_len, ratio)
    if seq_len <= budget:
        return [None] * num_layers
    if budget < 1:
        raise ValueError(
            f"ratio {ratio} leaves no slot for a {seq_len}-token prompt: "
            f"budget_for({seq_len}, {ratio}) = {budget}"
        )
    scores = [scorer.prompt_scores(obs) for obs in observations]
    window = scorer.window
    budgets = torch.stack(
        [
            scorer.head_budgets(layer_scores, budget, layer_idx=obs.layer_idx, num_layers=model_layers)
            for obs, layer_scores in zip(observations, scores, strict=True)
        ]
    ).tolist()
    num_heads = len(budgets[0])
    sizes = [[0] * num_heads for _ in observations]
    stacked = stack_layers(observations) if residual is not None else None
    if residual is not None and not residual.validate:
        sizes = [fixed_sizes(residual, layer_budgets, min(window, seq_len)) for layer_budgets in budgets]
    elif residual is not None and (split := observation_split(stacked, residual)) is not None:
        proxy = ValidationProxy(stacked, scorer, residual, split, num_layers)
        sizes = proxy.choose(sum(budgets, [])).reshape(num_layers, num_heads).tolist()
        if residual.final_selection == "fit":
            fit_scores, window = proxy.fit_selection()
            scores = list(fit_scores.split(num_heads))
    main_sizes = [
        [b - r for b, r in zip(layer_budgets, layer_sizes, strict=True)]
        for layer_budgets, layer_sizes in zip(budgets, sizes, strict=True)
    ]
    main_counts = [[kept_count(size, seq_len) for size in layer_sizes] for layer_sizes in main_sizes]
    kept = [
        select_main(layer_scores, window, torch.tensor(layer_sizes))
        for layer_scores, layer_sizes in zip(scores, main_sizes, strict=True)
    ]
    if residual is not None and any(map(any, sizes)):
        entries, entry_counts = final_entries(stacked, kept, scores, sizes, main_counts, budgets, residual)
    else:
        entries = [ResidualEntries.empty(num_heads, obs.keys) for obs in observations]
        entry_counts = [[0] * num_heads for _ in observations]
    # Every layer's padding from one bias over all rows, each layer's a view of it: one op where a
    # bias per layer took five per layer (issue 22's op count).
    all_bias = padding_bias(sum(main_counts, []), kept[0].device)
    states = []
    for layer, obs in enumerate(observations):
        counts, layer_kept = main_counts[layer], kept[layer]
        positions = kept_positions(layer_kept, max(counts))
        main_bias = None
        if all_bias is not None and min(counts) < max(counts):
            main_bias = all_bias[layer * num_heads : (layer + 1) * num_heads, :, : max(counts)]
        main_values = scorer.adjust_values(obs, layer_kept)
        state = CompressedLayerState(
            gather_tokens(obs.keys, positions),
            gather_tokens(main_values, positions),
            main_bias,
            entries[layer],
            layer_kept,
        )
        state.stats = {
            "budget": budget,
            "main_slots": counts,
            "residual_entries": entry_counts[layer],
            "residual_slots": sizes[layer],
        }
        if residual is not None:
            state.stats["residual_choice"] = [
                residual_choice(residual, size, head_budget)
                for size, head_budget in zip(sizes[layer], budgets[layer], strict=True)
            ]
        states.append(state)
    return states


def final_entries(
    stacked: LayerObservation,
    kept: list[Tensor],
    scores: list[Tensor],
    sizes: list[list[int]],
    main_counts: list[list[int]],
    budgets: list[list[int]],
    config: ResidualConfig,
) -> tuple[list[ResidualEntries], list[list[int]]]:
    """The deployed entries of every layer's heads (k-means of ``E = S \\ M``, reskv.md), clustered
    for all layers at once, and the entries kept per layer and head (empty clusters dropped).

    A layer's entries are as wide as its largest ``min(r, |E|)``, the layout a layer compressed
    alone has, so that decode reads the same buffers."""
    num_heads, seq_len = len(sizes[0]), stacked.seq_len
    flat_sizes = sum(sizes, [])
    point_counts = [seq_len - count for count in sum(main_counts, [])]
    groups = level_groups(flat_sizes, point_counts, sum(budgets, []), config.grid, stacked.keys.device)
    entries = build_residual(
        stacked.keys,
        stacked.values,
        ~torch.cat(kept),
        torch.cat(scores),
        torch.tensor(flat_sizes, device=stacked.keys.device),
        config.kmeans_iterations,
        groups,
    )
    per_layer = []
    for layer in range(len(sizes)):
        rows = slice(layer * num_heads, (layer + 1) * num_heads)
        width = max(min(r, e) for r, e in zip(flat_sizes[rows], point_counts[rows], strict=True))
        per_layer.append(
            ResidualEntries(
                entries.keys[rows, :width], entries.values[rows, :width], entries.log_counts[rows, :width]
            )
        )
    return per_layer, entries.entries_per_head.reshape(len(sizes), num_heads).tolist()
