"""Compression of prefilled layers: budget, main selection, residual size and entries.

The flow follows reskv.md: ``b = floor(s * (1 - ratio))`` slots per KV head; the base method's
scorer gives token scores, the protected window and the per-head split of the layer's budget;
``M = P ∪ Top_{m-|P|}(scores)``; with a residual, ``b = m + r`` and the evicted side ``E`` is
summarised by ``r`` k-means entries, ``r`` chosen per head by the validation proxy
(``reskv.proxy``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.attention import padding_bias
from reskv.config import ResidualConfig, budget_for
from reskv.proxy import ValidationProxy, observation_split
from reskv.residual import (
    ResidualEntries,
    RowGroup,
    build_residual,
    padded_groups,
    residual_size,
)
from reskv.scoring import LayerObservation, TokenScorer, stack_layers
from reskv.selection import gather_rows, select_main, token_rows


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


class SharedLayers:
    """Layers of one prompt that several compressions take in turn (a sample's grid: every ratio, with
    and without ResKV), and what each compression of them would compute alike, computed on first use
    and kept: a base scorer's scores (independent of the ratio), the layers stacked along the heads,
    and a (scorer, residual) pair's validation proxy (whose fit scores, ranking and full-attention
    outputs are independent of the ratio; ``ValidationProxy.choose`` takes the budgets). The values
    are those each compression computes alone, bit for bit; only the work is done once. Scorers are
    told apart by class and attributes (``scorer_key``)."""

    def __init__(self, observations: list[LayerObservation]):
        self.observations = observations
        self._scores: dict[Hashable, list[Tensor] | Tensor] = {}
        self._stacked: LayerObservation | None = None
        self._proxies: dict[Hashable, ValidationProxy | None] = {}

    def scores(self, scorer: TokenScorer) -> list[Tensor]:
        """``scorer.prompt_scores`` of each layer."""
        key = scorer_key(scorer)
        if key not in self._scores:
            self._scores[key] = [scorer.prompt_scores(obs) for obs in self.observations]
        return self._scores[key]

    def stacked_scores(self, scorer: TokenScorer) -> Tensor:
        """``scores`` of every layer as one ``[L * H_kv, s]`` tensor, layer-major (``stack_layers``)."""
        key = scorer_key(scorer), "stacked"
        if key not in self._scores:
            self._scores[key] = torch.cat(self.scores(scorer))
        return self._scores[key]

    def stacked(self) -> LayerObservation:
        """The layers as one observation (``stack_layers``): one copy, for ResKV's work."""
        if self._stacked is None:
            self._stacked = stack_layers(self.observations)
        return self._stacked

    def proxy(self, scorer: TokenScorer, residual: ResidualConfig) -> ValidationProxy | None:
        """The validation proxy of ``scorer`` with ``residual`` on the stacked layers, or ``None`` when
        too few queries were observed to validate on (``observation_split``)."""
        key = scorer_key(scorer), residual
        if key not in self._proxies:
            stacked = self.stacked()
            split = observation_split(stacked, residual)
            self._proxies[key] = (
                None
                if split is None
                else ValidationProxy(stacked, scorer, residual, split, len(self.observations))
            )
        return self._proxies[key]


def scorer_key(scorer: TokenScorer) -> Hashable:
    """What decides a scorer's scores: its class and its attributes (window, kernel, seed, ...)."""
    return type(scorer), tuple(sorted(vars(scorer).items()))


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
    layers: list[LayerObservation] | SharedLayers,
    scorer: TokenScorer,
    ratio: float,
    residual: ResidualConfig | None = None,
    model_layers: int | None = None,
) -> list[CompressedLayerState | None]:
    """Compress layers of one prompt; ``None`` for each when the budget covers the prompt (the cache
    stays full, bit for bit). ``model_layers`` is the model's layer count, for scorers whose budgets
    depend on the layer (PyramidKV). ``layers`` given as ``SharedLayers`` share with the other
    compressions of the same layers what does not depend on the ratio.

    Each layer is scored on its own, as the base method does; the heads' budgets are then allotted
    for the layers together (``TokenScorer.stacked_head_budgets``), every head selected as a row of
    one stack (each row as alone), and each layer's kept tokens gathered from its own keys and
    values. What ResKV adds runs once for all the layers given, stacked along the heads
    (``stack_layers``): the validation proxy and the k-means of the final entries. Every shape is
    planned from host integers, so the device is read three times, whatever the number of layers:
    the heads' budgets, the chosen residual sizes, and the entries that survived (empty clusters).
    """
    shared = layers if isinstance(layers, SharedLayers) else SharedLayers(layers)
    observations = shared.observations
    seq_len, num_layers = observations[0].seq_len, len(observations)
    budget = budget_for(seq_len, ratio)
    if seq_len <= budget:
        return [None] * num_layers
    if budget < 1:
        raise ValueError(
            f"ratio {ratio} leaves no slot for a {seq_len}-token prompt: "
            f"budget_for({seq_len}, {ratio}) = {budget}"
        )
    window, num_heads = scorer.window, observations[0].num_kv_heads
    all_scores = shared.stacked_scores(scorer)  # [L * H_kv, s], layer-major
    budgets = scorer.stacked_head_budgets(
        all_scores.unflatten(0, (num_layers, num_heads)),
        budget,
        first_layer=observations[0].layer_idx,
        num_layers=model_layers,
    ).tolist()
    sizes = [[0] * num_heads for _ in observations]
    stacked = shared.stacked() if residual is not None else None
    proxy = None
    if residual is not None and not residual.validate:
        sizes = [fixed_sizes(residual, layer_budgets, min(window, seq_len)) for layer_budgets in budgets]
    elif residual is not None and (proxy := shared.proxy(scorer, residual)) is not None:
        sizes = proxy.choose(sum(budgets, [])).reshape(num_layers, num_heads).tolist()
    if residual is not None and proxy is not None and residual.final_selection == "fit":
        all_scores, window = proxy.fit_selection()
    main_sizes = [head - size for head, size in zip(sum(budgets, []), sum(sizes, []), strict=True)]
    main_counts = [kept_count(size, seq_len) for size in main_sizes]
    # Selected, positioned and indexed for all layers at once (each row is one head's, as alone), then
    # gathered per layer from its own keys and values.
    device = all_scores.device
    all_kept = select_main(all_scores, window, torch.tensor(main_sizes))  # [L * H_kv, s]
    if residual is not None and any(map(any, sizes)):
        entries, entry_counts = final_entries(
            stacked, all_kept, all_scores, sizes, main_counts, budgets, residual
        )
    else:
        entries = [ResidualEntries.empty(num_heads, obs.keys) for obs in observations]
        entry_counts = [[0] * num_heads for _ in observations]
    # Every layer's padding from one bias over all rows, each layer's a view of it.
    all_bias = padding_bias(main_counts, device)
    heads = torch.arange(num_layers * num_heads, device=device) % num_heads
    all_rows = token_rows(heads, kept_positions(all_kept, max(main_counts)), seq_len)
    states = []
    for layer, obs in enumerate(observations):
        rows = slice(layer * num_heads, (layer + 1) * num_heads)
        counts, layer_kept = main_counts[rows], all_kept[rows]
        main_bias = None
        if all_bias is not None and min(counts) < max(counts):
            main_bias = all_bias[rows, :, : max(counts)]
        main_values = scorer.adjust_values(obs, layer_kept)
        layer_rows = all_rows[rows, : max(counts)]
        state = CompressedLayerState(
            gather_rows(obs.keys, layer_rows),
            gather_rows(main_values, layer_rows),
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
    kept: Tensor,
    scores: Tensor,
    sizes: list[list[int]],
    main_counts: list[int],
    budgets: list[list[int]],
    config: ResidualConfig,
) -> tuple[list[ResidualEntries], list[list[int]]]:
    """The deployed entries of every layer's heads (k-means of ``E = S \\ M``, reskv.md; ``kept`` and
    ``scores`` ``[L * H_kv, s]``, ``main_counts`` per row), clustered for all layers at once, and the
    entries kept per layer and head (empty clusters dropped).

    A layer's entries are as wide as its largest ``min(r, |E|)``, the layout a layer compressed
    alone has, so that decode reads the same buffers."""
    num_heads, seq_len = len(sizes[0]), stacked.seq_len
    flat_sizes = sum(sizes, [])
    point_counts = [seq_len - count for count in main_counts]
    groups = level_groups(flat_sizes, point_counts, sum(budgets, []), config.grid, stacked.keys.device)
    entries = build_residual(
        stacked.keys,
        stacked.values,
        ~kept,
        scores,
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
