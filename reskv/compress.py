"""Compression of prefilled layers: budget, main selection, residual size and entries.

The flow follows reskv.md: ``b = floor(s * (1 - ratio))`` slots per KV head; the base method's
scorer gives token scores, the protected window and the per-head split of the layer's budget;
``M = P ∪ Top_{m-|P|}(scores)``; with a residual, ``b = m + r`` and the evicted side ``E`` is
summarised by ``r`` k-means entries, ``r`` chosen per head by the validation proxy
(``reskv.proxy``).

A sample's grid constructs its configurations of one setting as one program planned on the host
(``SharedLayers.plan``): every shape comes from host integers, uploaded without the host waiting for
the device (``reskv.selection.uploaded``), and the device is read three times for all of them: the
heads' budgets of the rules that spread them by their scores (AdaKV), the residual sizes every
validation proxy chose, and the entries that survived their k-means (empty clusters). What
configurations compute alike is computed once (``SharedLayers``), and each configuration is what
it is compressed alone, bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.attention import additive_mask
from reskv.config import ResidualConfig, budget_for, residual_size
from reskv.proxy import ValidationProxy, joined, observation_split
from reskv.residual import ResidualEntries, RowGroup, build_residual, level_row_groups
from reskv.scoring import LayerObservation, TokenScorer, stack_layers
from reskv.selection import (
    gather_rows,
    prefix_ranks,
    row_stride,
    select_main,
    token_rows,
    uploaded,
)


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


def kept_slots(kept: Tensor, longest: int) -> tuple[Tensor, Tensor]:
    """Positions ``[H, longest]`` of each head's kept tokens in position order, padded with
    positions of evicted tokens, and where they are kept ``[H, longest]`` (false on the padding);
    ``longest`` (host) is the largest number of kept tokens. One op: a stable sort of the booleans,
    kept first."""
    found = torch.sort(kept, dim=-1, descending=True, stable=True)
    return found.indices[:, :longest], found.values[:, :longest]


def kept_positions(kept: Tensor, longest: int) -> Tensor:
    """``kept_slots``' positions."""
    return kept_slots(kept, longest)[0]


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
    that repeats an earlier one's ``r`` (``reskv.config.candidate_sizes``); -1 for none."""
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
    keys: Tensor,
    rows_each: int,
) -> list[RowGroup]:
    """The final caches' k-means groups, of configurations of ``rows_each`` rows each, stacked: the
    rows with entries by configuration and grid level (a head's ``r`` is ``floor(ratio * b_h + 0.5)``
    of one level, so sizes within a level are close), grouped as ``reskv.residual.level_row_groups``
    does (points read from ``keys``); with uniform budgets a level's sizes are equal."""
    capped = [min(size, points) for size, points in zip(sizes, point_counts, strict=True)]
    levels: dict[tuple[int, int], list[int]] = {}
    for row, (size, budget) in enumerate(zip(sizes, budgets, strict=True)):
        if size:
            levels.setdefault((row // rows_each, grid_level(grid, size, budget)), []).append(row)
    return level_row_groups(list(levels.values()), capped, point_counts, keys)


def scorer_key(scorer: TokenScorer) -> Hashable:
    """What decides a scorer's budgets and values: its class and its attributes (window, kernel, seed,
    ...); its scores are decided by less (``TokenScorer.scores_key``)."""
    return type(scorer), tuple(sorted(vars(scorer).items()))


@dataclass(frozen=True)
class Family:
    """Configurations constructed together: one base rule with one residual (or none) at several
    ratios, a sample's grid's."""

    scorer: TokenScorer
    residual: ResidualConfig | None
    ratios: tuple[float, ...]

    @property
    def key(self) -> Hashable:
        return scorer_key(self.scorer), self.residual


@dataclass
class Construction:
    """One configuration's construction of a batch of layers before its main cache is gathered: what
    ``SharedLayers`` keeps of it for the configuration to take (``SharedLayers.states``), host integers
    and the device's kept tokens and entries."""

    budget: int
    budgets: list[list[int]]  # [L][H_kv]: each head's slots
    sizes: list[list[int]]  # [L][H_kv]: each head's residual size
    kept: Tensor  # [L * H_kv, s] bool, layer-major
    entries: list[ResidualEntries]  # per layer
    entry_counts: list[list[int]]  # [L][H_kv]: entries kept (empty clusters dropped)

    def main_counts(self, seq_len: int) -> list[int]:
        """Tokens each head keeps, layer-major."""
        return [
            kept_count(budget - size, seq_len)
            for budget, size in zip(sum(self.budgets, []), sum(self.sizes, []), strict=True)
        ]


class SharedLayers:
    """Layers of one prompt that several compressions take in turn (a sample's grid: every ratio, with
    and without ResKV), and what compressions of them compute alike, computed on first use and kept:
    a rule's scores (independent of the ratio, and shared by the rules that score alike:
    ``TokenScorer.scores_key``) and their ranking, a rule's head budgets, the layers stacked along the
    heads, a merging rule's values, and the validation proxy of the rules that score alike with one
    residual (its fit scores, ranking and full-attention outputs are independent of the ratio and of
    the budgets' spread; ``ValidationProxy.choose`` takes the budgets). The families ``plan`` names are
    constructed together on first use (``construct``), each configuration kept for its compression to
    take. The values are those each compression computes alone, bit for bit; only the work is done
    once. Layers whose keys and values are the first tokens of other ``SharedLayers``' (a context's, of
    the whole prompt's) read those's stacked copy (``prefix_of``)."""

    def __init__(self, observations: list[LayerObservation], prefix_of: SharedLayers | None = None):
        self.observations = observations
        self.prefix_of = prefix_of  # the same layers after a longer prompt starting with this one
        self.families: dict[Hashable, Family] = {}
        self._scores: dict[Hashable, Tensor] = {}
        self._ranks: dict[Hashable, Tensor] = {}
        self._budgets: dict[Hashable, list[list[int]]] = {}
        self._stacked: LayerObservation | None = None
        self._heads: Tensor | None = None
        self._values: dict[Hashable, Tensor] = {}
        self._proxies: dict[Hashable, ValidationProxy | None] = {}
        self._constructions: dict[Hashable, Construction] = {}

    @property
    def num_kv_heads(self) -> int:
        return self.observations[0].num_kv_heads

    def plan(self, families: Iterable[Family]) -> None:
        """Construct ``families`` together the first time one of their configurations is asked for."""
        self.families |= {family.key: family for family in families}

    def stacked_scores(self, scorer: TokenScorer) -> Tensor:
        """``scorer.prompt_scores`` of every layer as one ``[L * H_kv, s]`` tensor, layer-major
        (``stack_layers``): of the stacked copy where one was made, else layer by layer."""
        key = scorer.scores_key()
        if key not in self._scores:
            if self._stacked is not None or len(self.observations) == 1:
                self._scores[key] = scorer.prompt_scores(self.stacked(), len(self.observations))
            else:
                self._scores[key] = torch.cat([scorer.prompt_scores(obs) for obs in self.observations])
        return self._scores[key]

    def ranks(self, scorer: TokenScorer) -> Tensor:
        """``prefix_ranks`` of ``stacked_scores`` for the rule's window: what ``select_main`` ranks."""
        key = scorer.scores_key()
        if key not in self._ranks:
            self._ranks[key] = prefix_ranks(self.stacked_scores(scorer), scorer.window)
        return self._ranks[key]

    def head_budgets(self, scorer: TokenScorer, budgets: Sequence[int], model_layers: int | None) -> None:
        """Read ``scorer``'s head budgets at each of ``budgets`` (``TokenScorer.host_budgets``: once for
        them all), for ``budgets_of``."""
        missing = [budget for budget in budgets if (scorer_key(scorer), budget) not in self._budgets]
        if missing:
            layers, heads = len(self.observations), self.num_kv_heads
            found = scorer.host_budgets(
                self.stacked_scores(scorer).unflatten(0, (layers, heads)),
                missing,
                first_layer=self.observations[0].layer_idx,
                num_layers=model_layers,
            )
            self._budgets |= {
                (scorer_key(scorer), budget): got for budget, got in zip(missing, found, strict=True)
            }

    def budgets_of(self, scorer: TokenScorer, budget: int, model_layers: int | None) -> list[list[int]]:
        """``scorer``'s slots per layer and head ``[L][H_kv]`` for a layer budget of ``budget``."""
        self.head_budgets(scorer, [budget], model_layers)
        return self._budgets[scorer_key(scorer), budget]

    def stacked(self) -> LayerObservation:
        """The layers as one observation (``stack_layers``): one copy, for ResKV's work and the grid's
        gathers; none where they are a prefix of other layers' (``prefix_of``), whose copy they view."""
        if self._stacked is None:
            longer = None if self.prefix_of is None else self.prefix_of.stacked()
            self._stacked = stack_layers(self.observations, longer)
        return self._stacked

    def stacked_heads(self) -> Tensor:
        """``[L * H_kv]``: each stacked row's number, the head ``token_rows`` reads it from (one arange
        for every configuration's gathers)."""
        if self._heads is None:
            self._heads = torch.arange(
                len(self.observations) * self.num_kv_heads, device=self.stacked().keys.device
            )
        return self._heads

    def values(self, scorer: TokenScorer) -> Tensor:
        """The stacked values the main caches take their kept tokens' from (``TokenScorer.adjust_values``
        of the stacked layers: a merging rule's, computed once for all its ratios)."""
        key = scorer_key(scorer)
        if key not in self._values:
            self._values[key] = scorer.adjust_values(self.stacked(), len(self.observations))
        return self._values[key]

    def proxy(self, scorer: TokenScorer, residual: ResidualConfig) -> ValidationProxy | None:
        """The validation proxy of ``scorer``'s scores with ``residual`` on the stacked layers, or ``None``
        when too few queries were observed to validate on (``observation_split``)."""
        key = scorer.scores_key(), residual
        if key not in self._proxies:
            stacked = self.stacked()
            split = observation_split(stacked, residual)
            self._proxies[key] = (
                None
                if split is None
                else ValidationProxy(stacked, scorer, residual, split, len(self.observations))
            )
        return self._proxies[key]

    def construction(
        self, scorer: TokenScorer, residual: ResidualConfig | None, ratio: float, model_layers: int | None
    ) -> Construction:
        """The construction of ``scorer`` with ``residual`` at ``ratio``: with those of every family
        ``plan`` named and not constructed yet when one of theirs, else alone."""
        family = Family(scorer, residual, (ratio,))
        key = family.key, ratio
        if key not in self._constructions:
            planned = self.families.get(family.key)
            families = [family]
            if planned is not None and ratio in planned.ratios:
                families = [
                    other
                    for other in self.families.values()
                    if any((other.key, r) not in self._constructions for r in other.ratios)
                ]
            self._constructions |= construct(self, families, model_layers)
        return self._constructions[key]

    def states(
        self, construction: Construction, scorer: TokenScorer, residual: ResidualConfig | None
    ) -> list[CompressedLayerState]:
        """Each layer's compressed state of ``construction`` (of ``scorer`` with ``residual``): its kept
        tokens gathered, for every layer at once from the stacked copy where one was made (a grid's,
        or ResKV's), else layer by layer."""
        observations, num_heads = self.observations, self.num_kv_heads
        seq_len = observations[0].seq_len
        counts = construction.main_counts(seq_len)
        positions, in_use = kept_slots(construction.kept, max(counts))
        if self._stacked is not None or len(observations) == 1:
            stacked = self.stacked()
            heads, values = self.stacked_heads(), self.values(scorer)
            rows = token_rows(heads, positions, stacked.keys)
            if row_stride(values) != row_stride(stacked.keys):  # merged values: a tensor of their own
                rows_of_values = token_rows(heads, positions, values)
            else:
                rows_of_values = rows
            all_keys, all_values = gather_rows(stacked.keys, rows), gather_rows(values, rows_of_values)
            main = [slice(layer * num_heads, (layer + 1) * num_heads) for layer in range(len(observations))]
            gathered = [(all_keys[rows_of], all_values[rows_of]) for rows_of in main]
        else:  # every layer's keys and values are laid out alike: one index serves all
            heads = torch.arange(len(counts), device=positions.device) % num_heads
            rows = token_rows(heads, positions, observations[0].keys)
            gathered = []
            for layer, obs in enumerate(observations):
                layer_rows = rows[layer * num_heads : (layer + 1) * num_heads]
                values = scorer.adjust_values(obs)
                gathered.append((gather_rows(obs.keys, layer_rows), gather_rows(values, layer_rows)))
        # Every layer's padding from one bias over all rows, each layer's a view of it.
        all_bias = None if min(counts) == max(counts) else additive_mask(in_use)[:, None, :]
        states = []
        for layer, (keys, values) in enumerate(gathered):
            rows = slice(layer * num_heads, (layer + 1) * num_heads)
            layer_counts, longest = counts[rows], max(counts[rows])
            main_bias = None
            if all_bias is not None and min(layer_counts) < longest:
                main_bias = all_bias[rows, :, :longest]
            state = CompressedLayerState(
                keys[:, :longest],
                values[:, :longest],
                main_bias,
                construction.entries[layer],
                construction.kept[rows],
            )
            state.stats = {
                "budget": construction.budget,
                "main_slots": layer_counts,
                "residual_entries": construction.entry_counts[layer],
                "residual_slots": construction.sizes[layer],
            }
            if residual is not None:
                state.stats["residual_choice"] = [
                    residual_choice(residual, size, budget)
                    for size, budget in zip(
                        construction.sizes[layer], construction.budgets[layer], strict=True
                    )
                ]
            states.append(state)
        return states


def construct(
    shared: SharedLayers, families: list[Family], model_layers: int | None
) -> dict[Hashable, Construction]:
    """Every configuration of ``families`` that compresses ``shared``'s layers (its budget below the
    prompt), by ``(Family.key, ratio)``: their head budgets read at most once per base rule, the
    residual sizes every validation proxy chose read back together, then the main selections and the
    final entries, whose survivors are read back together (the module docstring's three reads)."""
    observations = shared.observations
    seq_len, num_heads = observations[0].seq_len, shared.num_kv_heads
    wanted = [
        (family, ratio, budget)
        for family in families
        for ratio in family.ratios
        if 1 <= (budget := budget_for(seq_len, ratio)) < seq_len
    ]
    if len(wanted) > 1 or any(family.residual is not None for family, _, _ in wanted):
        shared.stacked()  # a grid's, or ResKV's: the scores and the gathers read one stacked copy
    rules = {scorer_key(family.scorer): family.scorer for family, _, _ in wanted}
    for key, scorer in rules.items():
        shared.head_budgets(
            scorer, sorted({budget for f, _, budget in wanted if f.key[0] == key}), model_layers
        )
    sizes, asked = {}, {}
    for family, ratio, budget in wanted:
        scorer, residual, key = family.scorer, family.residual, (family.key, ratio)
        budgets = shared.budgets_of(scorer, budget, model_layers)
        sizes[key] = [[0] * num_heads for _ in observations]
        if residual is not None and not residual.validate:
            window = min(scorer.window, seq_len)
            sizes[key] = [fixed_sizes(residual, layer_budgets, window) for layer_budgets in budgets]
        elif residual is not None and (proxy := shared.proxy(scorer, residual)) is not None:
            asked.setdefault(id(proxy), (proxy, {}))[1][key] = sum(budgets, [])
    chosen = [  # each proxy's configurations chosen for together
        (list(budget_sets), proxy.choose_each(list(budget_sets.values())))
        for proxy, budget_sets in asked.values()
    ]
    sizes |= read_together(chosen, num_heads)
    built, deployed = {}, defaultdict(dict)
    for family in families:  # every ratio's main selection from one pass over the family's scores
        ratios = [(ratio, budget) for f, ratio, budget in wanted if f is family]
        if not ratios:
            continue
        scorer, residual = family.scorer, family.residual
        all_scores, window, ranks = None, scorer.window, None
        if residual is not None and residual.final_selection == "fit" and residual.validate:
            proxy = shared.proxy(scorer, residual)
            if proxy is not None:
                all_scores, window = proxy.fit_selection()
        if all_scores is None:
            all_scores, ranks = shared.stacked_scores(scorer), shared.ranks(scorer)
        every_budgets = [shared.budgets_of(scorer, budget, model_layers) for _, budget in ratios]
        main_sizes = [
            [
                head - size
                for head, size in zip(sum(budgets, []), sum(sizes[family.key, ratio], []), strict=True)
            ]
            for (ratio, _), budgets in zip(ratios, every_budgets, strict=True)
        ]
        every_kept = select_main(all_scores, window, uploaded(main_sizes, all_scores.device), ranks)
        for (ratio, budget), budgets, kept, ratio_main_sizes in zip(
            ratios, every_budgets, every_kept, main_sizes, strict=True
        ):
            key = family.key, ratio
            layer_sizes = sizes[key]
            if residual is not None and any(map(any, layer_sizes)):
                deployed[residual][key] = Deployed(kept, all_scores, layer_sizes, ratio_main_sizes, budgets)
                entries = []  # final_entries' below
            else:
                # Zero slots hold nothing to write into, so the layers share one set: a set per layer
                # launched 3 ops each, most of a base rule's planned construction (results/README.md).
                entries = [ResidualEntries.empty(num_heads, observations[0].keys)] * len(observations)
            none = [[0] * num_heads for _ in observations]
            built[key] = Construction(budget, budgets, layer_sizes, kept, entries, none)
    surviving = []
    for residual, of_residual in deployed.items():  # one k-means for every configuration of a residual
        every_entries, entry_counts = final_entries(shared.stacked(), list(of_residual.values()), residual)
        for key, entries in zip(of_residual, every_entries, strict=True):
            built[key].entries = entries
        surviving.append((list(of_residual), entry_counts))
    for key, entry_counts in read_together(surviving, num_heads).items():
        built[key].entry_counts = entry_counts
    return built


def read_together(
    found: list[tuple[list[Hashable], Tensor]], num_heads: int
) -> dict[Hashable, list[list[int]]]:
    """``found``'s tensors, each of its keys' ``[L * H_kv]`` values one key after another, as host
    integers ``[L][H_kv]`` by key, all read back from the device at once (nothing read when there are
    none)."""
    if not found:
        return {}
    keys = [key for of_tensor, _ in found for key in of_tensor]
    values = joined([tensor.reshape(-1) for _, tensor in found]).tolist()
    rows = [values[start : start + num_heads] for start in range(0, len(values), num_heads)]
    layers = len(rows) // len(keys)
    return {key: rows[number * layers : (number + 1) * layers] for number, key in enumerate(keys)}


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
    compressions of the same layers what does not depend on the ratio, and are constructed with the
    families it plans (``SharedLayers.construction``).

    The layers are scored together where they are stacked (a grid's, ResKV's: ``stack_layers``; each
    head's scores as its layer alone gives them), else each on its own; the heads' budgets are then
    allotted for the layers together (``TokenScorer.host_budgets``), every head selected as a row of
    one stack (each row as alone), and each layer's kept tokens gathered from its keys and values.
    What ResKV adds runs once for all the layers given, stacked along the heads: the validation proxy
    and the k-means of the final entries. Every shape is planned from host integers (``construct``).
    """
    shared = layers if isinstance(layers, SharedLayers) else SharedLayers(layers)
    seq_len = shared.observations[0].seq_len
    budget = budget_for(seq_len, ratio)
    if seq_len <= budget:
        return [None] * len(shared.observations)
    if budget < 1:
        raise ValueError(
            f"ratio {ratio} leaves no slot for a {seq_len}-token prompt: "
            f"budget_for({seq_len}, {ratio}) = {budget}"
        )
    return shared.states(shared.construction(scorer, residual, ratio, model_layers), scorer, residual)


@dataclass
class Deployed:
    """A configuration's deployed main selection, what its final entries summarise the rest of:
    kept tokens and the scores that ranked them ``[L * H_kv, s]``, and host ints ``[L][H_kv]`` (its
    residual sizes and heads' budgets) and ``[L * H_kv]`` (its main sizes)."""

    kept: Tensor
    scores: Tensor
    sizes: list[list[int]]
    main_sizes: list[int]
    budgets: list[list[int]]


def final_entries(
    stacked: LayerObservation, configurations: list[Deployed], config: ResidualConfig
) -> tuple[list[list[ResidualEntries]], Tensor]:
    """Each configuration's deployed entries of every layer's heads (k-means of ``E = S \\ M``,
    reskv.md), and the entries kept per head ``[configurations * L * H_kv]`` on the device, one
    configuration after another (empty clusters dropped): clustered at once, every configuration's rows
    stacked after the last's, grouped as ``level_groups`` groups them by (configuration, grid level).

    A layer's entries are as wide as its largest ``min(r, |E|)``, the layout a layer compressed
    alone has, so that decode reads the same buffers."""
    num_heads, seq_len = len(configurations[0].sizes[0]), stacked.seq_len
    flat_sizes = [size for deployed in configurations for size in sum(deployed.sizes, [])]
    point_counts = [
        seq_len - kept_count(size, seq_len) for deployed in configurations for size in deployed.main_sizes
    ]
    budgets = [budget for deployed in configurations for budget in sum(deployed.budgets, [])]
    rows_each = len(configurations[0].main_sizes)
    groups = level_groups(flat_sizes, point_counts, budgets, config.grid, stacked.keys, rows_each)
    entries = build_residual(
        stacked.keys,
        stacked.values,
        ~torch.cat([deployed.kept for deployed in configurations]),
        torch.cat([deployed.scores for deployed in configurations]),
        uploaded(flat_sizes, stacked.keys.device),
        config.kmeans_iterations,
        groups,
    )
    capped = [min(r, e) for r, e in zip(flat_sizes, point_counts, strict=True)]
    found = []
    for number in range(len(configurations)):
        first = number * rows_each
        # Each configuration's entries a copy at its own width where several were stacked (a view
        # would keep every configuration's, padded to the widest, alive as long as any one's), so a
        # construction holds what it holds alone, and the stacked entries are a transient.
        width = max(capped[first : first + rows_each])
        own = entries
        if len(configurations) > 1:
            own = ResidualEntries(
                *(part[first : first + rows_each, :width].clone() for part in entries.fields())
            )
        per_layer = []
        for layer in range(rows_each // num_heads):
            rows = slice(layer * num_heads, (layer + 1) * num_heads)
            layer_width = max(capped[first + rows.start : first + rows.stop])
            per_layer.append(ResidualEntries(*(part[rows, :layer_width] for part in own.fields())))
        found.append(per_layer)
    return found, entries.entries_per_head
