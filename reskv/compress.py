"""Compression of one prefilled layer: budget, main selection, residual size and entries.

The flow follows reskv.md: ``b = floor(s * (1 - ratio))`` slots per KV head; the base method's
scorer gives token scores, the protected window and the per-head split of the layer's budget;
``M = P ∪ Top_{m-|P|}(scores)``; with a residual, ``b = m + r`` and the evicted side ``E`` is
summarised by ``r`` k-means entries, ``r`` chosen per head by the validation proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import Tensor

from reskv.attention import DecodeRule, residual_attention
from reskv.residual import ResidualEntries, build_residual
from reskv.scoring import LayerObservation, TokenScorer, causal_attention_probs
from reskv.selection import gather_tokens, select_main

FINAL_SELECTIONS = ("base", "fit")


@dataclass(frozen=True)
class ResidualConfig:
    """ResKV hyper-parameters and ablation switches (defaults: the paper's, reskv.md)."""

    grid: tuple[float, ...] = (0.0, 0.05, 0.10, 0.15, 0.20)
    validate: bool = True  # False: "w/o validation", every head uses fixed_ratio
    fixed_ratio: float = 0.10
    gate: bool = True
    shared_softmax: bool = True
    tau: float = 0.25
    alpha: float = 12.0
    g_min: float = 0.0
    beta: float = 1.0
    delta: float = 0.01
    kmeans_iterations: int = 4
    fit_queries: int = 96
    validation_queries: int = 32
    # "base": the final main cache is selected with the base method's own scores, so a head
    # that falls back to r = 0 equals the plain baseline (this project's reading of "rebuild
    # (M, S) with the chosen r"). "fit": the literal alternative, the validated cache itself.
    final_selection: str = "base"

    def __post_init__(self) -> None:
        if self.final_selection not in FINAL_SELECTIONS:
            raise ValueError(f"final_selection {self.final_selection!r}: choose one of {FINAL_SELECTIONS}")
        if any(not 0 <= ratio < 1 for ratio in self.grid):
            raise ValueError(f"residual grid {self.grid}: every ratio must lie in [0, 1)")
        if min(self.fit_queries, self.validation_queries) < 1:
            raise ValueError("fit_queries and validation_queries must be at least 1")

    @property
    def observation_window(self) -> int:
        return self.fit_queries + self.validation_queries

    @property
    def decode_rule(self) -> DecodeRule:
        return DecodeRule(self.tau, self.alpha, self.g_min, self.beta, self.gate, self.shared_softmax)


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


def budget_for(seq_len: int, ratio: float) -> int:
    """Retained slots per KV head: ``b = floor(s * (1 - ratio))`` computed exactly on the decimal
    value of ``ratio`` (reskv.md, Budget): ``s = 4000, ratio = 0.9`` gives 400, where floating
    point gives 399."""
    exact = Fraction(str(ratio))
    if not 0 <= exact < 1:
        raise ValueError(f"compression ratio {ratio!r} must lie in [0, 1)")
    kept_num, den = (1 - exact).as_integer_ratio()
    return seq_len * kept_num // den


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


def observation_split(obs: LayerObservation, config: ResidualConfig) -> tuple[slice, slice] | None:
    """Fit and validation query ranges inside the observed queries.

    The paper's 96 + 32 when at least 128 queries were observed; a shorter prompt splits what
    it has 3:1 (documented fallback); fewer than 2 queries leave nothing to validate on.
    """
    observed = obs.queries.shape[1]
    if observed < 2:
        return None
    if observed >= config.observation_window:
        validation = config.validation_queries
        fit = config.fit_queries
    else:
        validation = max(1, observed // 4)
        fit = observed - validation
    start = observed - fit - validation
    return slice(start, start + fit), slice(observed - validation, observed)


def grouped(queries: Tensor, num_kv_heads: int) -> Tensor:
    """``[H, n, d] -> [H_kv, G*n, d]``: query heads stacked per KV group."""
    return queries.reshape(num_kv_heads, -1, queries.shape[-1])


def candidate_sizes(config: ResidualConfig, budgets: Tensor, window: int) -> list[Tensor]:
    """Residual sizes per candidate ratio and head, 0 where the candidate is skipped (reskv.md).

    ``r = floor(ratio * b + 0.5)``; skipped when ``r`` is 0, repeats an earlier candidate's ``r``
    for that head, or leaves ``m - |P| < 0``.
    """
    seen: list[Tensor] = []
    sizes = []
    for ratio in config.grid:
        size = torch.floor(ratio * budgets.double() + 0.5).long()
        skip = (size == 0) | (budgets - size < window)
        for earlier in seen:
            skip |= size == earlier
        seen.append(size)
        sizes.append(size.masked_fill(skip, 0))
    return sizes


class ValidationProxy:
    """Per-head residual size chosen on held-out observation queries (Eqs. valloss, valproxy)."""

    def __init__(self, obs: LayerObservation, scorer: TokenScorer, config: ResidualConfig, split):
        fit, validation = split
        self.obs, self.scorer, self.config = obs, scorer, config
        positions = obs.query_positions
        self.fit_scores = scorer.fit_score(obs, obs.queries[:, fit], positions[fit])
        self.validation_queries = grouped(obs.queries[:, validation], obs.num_kv_heads)
        validation_positions = positions[validation]
        # Full attention o_S over all s tokens, causal (the validation queries lie in the prompt).
        probs = causal_attention_probs(
            obs.queries[:, validation], obs.keys, validation_positions, obs.scaling
        )
        self.full_output = grouped(probs, obs.num_kv_heads) @ obs.values.float()
        self.query_positions = validation_positions.repeat(obs.group_size)  # matches the grouped order

    def losses(self, budgets: Tensor, sizes: Tensor) -> Tensor:
        """``L_r`` ``[C, H_kv]`` for ``C`` candidate size rows ``[C, H_kv]``: the mean over validation
        queries and group heads of ``||ô_r - o_S||²``.

        Candidates are stacked along the head dimension so one batched k-means and one attention
        evaluate them all.
        """
        obs = self.obs
        num_candidates = sizes.shape[0]
        stacked_sizes = sizes.reshape(-1)
        fit_scores = self.fit_scores.repeat(num_candidates, 1)
        kept = select_main(fit_scores, self.scorer.window, budgets.repeat(num_candidates) - stacked_sizes)
        residual = build_residual(
            obs.keys, obs.values, ~kept, fit_scores, stacked_sizes, self.config.kmeans_iterations
        )
        positions, real = kept_positions(kept)
        visible = real[:, None, :] & (positions[:, None, :] <= self.query_positions[None, :, None])
        output = residual_attention(
            self.validation_queries.repeat(num_candidates, 1, 1),
            gather_tokens(obs.keys, positions),
            gather_tokens(obs.values, positions),
            additive_mask(visible),
            residual.keys,
            residual.values,
            residual.log_counts,
            obs.scaling,
            self.config.decode_rule,
            (~kept).sum(-1) / obs.seq_len,
        )
        errors = ((output - self.full_output.repeat(num_candidates, 1, 1)) ** 2).sum(dim=-1).mean(dim=-1)
        return errors.reshape(num_candidates, -1)

    def choose(self, budgets: Tensor) -> Tensor:
        """``r* = argmin_{r>0} L_r`` (the first candidate on ties), kept only where
        ``L_{r*} < (1 - delta) * L_0``, else 0."""
        window = min(self.scorer.window, self.obs.seq_len)
        sizes = torch.stack([torch.zeros_like(budgets), *candidate_sizes(self.config, budgets, window)])
        losses = torch.cat(
            [self.losses(budgets, chunk) for chunk in sizes.split(self._candidates_per_batch(sizes))]
        )
        main_only_loss = losses[0]
        candidate_losses = losses[1:].masked_fill(sizes[1:] == 0, float("inf"))
        best = candidate_losses.argmin(dim=0)
        best_loss = candidate_losses.gather(0, best[None])[0]
        best_size = sizes[1:].gather(0, best[None])[0]
        accepted = best_loss < (1 - self.config.delta) * main_only_loss
        return best_size.masked_fill(~accepted, 0)

    def _candidates_per_batch(self, sizes: Tensor) -> int:
        """Candidates evaluated together, bounding the k-means distance matrix at ~64M floats."""
        per_candidate = self.obs.num_kv_heads * self.obs.seq_len * max(1, int(sizes.max()))
        return max(1, (1 << 26) // per_candidate)


def fixed_sizes(config: ResidualConfig, budgets: Tensor, window: int) -> Tensor:
    """The "w/o validation" ablation: ``r = floor(fixed_ratio * b + 0.5)`` wherever ``m - |P| >= 0``."""
    sizes = torch.floor(config.fixed_ratio * budgets.double() + 0.5).long()
    return sizes.masked_fill(budgets - sizes < window, 0)


def compress_layer(
    obs: LayerObservation, scorer: TokenScorer, ratio: float, residual: ResidualConfig | None = None
) -> CompressedLayerState | None:
    """Compress one layer; ``None`` when the budget covers the prompt (the cache stays full, bit for bit)."""
    seq_len = obs.seq_len
    budget = budget_for(seq_len, ratio)
    if seq_len <= budget:
        return None
    if budget < 1:
        raise ValueError(f"ratio {ratio} leaves no slot for a {seq_len}-token prompt (budget {budget})")
    scores = scorer.score(obs)
    budgets = scorer.head_budgets(scores, budget)
    sizes, selection_scores = torch.zeros_like(budgets), scores
    if residual is not None and not residual.validate:
        sizes = fixed_sizes(residual, budgets, min(scorer.window, seq_len))
    elif residual is not None and (split := observation_split(obs, residual)) is not None:
        proxy = ValidationProxy(obs, scorer, residual, split)
        sizes = proxy.choose(budgets)
        if residual.final_selection == "fit":
            selection_scores = proxy.fit_scores
    kept = select_main(selection_scores, scorer.window, budgets - sizes)
    values = scorer.adjust_values(obs, kept)
    positions, real = kept_positions(kept)
    main_bias = None if bool(real.all()) else additive_mask(real)[:, None, :]
    main_keys, main_values = gather_tokens(obs.keys, positions), gather_tokens(values, positions)
    entries = (
        build_residual(obs.keys, obs.values, ~kept, selection_scores, sizes, residual.kmeans_iterations)
        if residual is not None
        else ResidualEntries.empty(obs.num_kv_heads, obs.keys)
    )
    stats = {
        "budget": budget,
        "main_slots": kept.sum(dim=-1).tolist(),
        "residual_entries": entries.entries_per_head.tolist(),
        "residual_slots": sizes.tolist(),
    }
    return CompressedLayerState(main_keys, main_values, main_bias, entries, kept, stats)
