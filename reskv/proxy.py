"""The validation proxy: each KV head's residual size chosen by a simulated decode inside the prompt
(reskv.md, "Validation proxy (per layer, per KV head): a simulated decode"; paper Eqs. valloss,
valproxy).

The last observed queries split into fit and validation queries; ``β`` is the first validation
position. Candidate caches are built from the prefix ``S' = [0, β)`` only, by the deployed cache's
own builder (``reskv.compress.build_cache``), with the base rule applied to the fit queries as if
``β - 1`` ended the prompt. A validation query at ``t >= β`` then attends the candidate main cache
``M'``, the exact tokens ``β .. t`` and the residual entries ``R'``, as a decode step attends the
deployed cache: everything it sees precedes it, for every base method.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reskv.attention import joint_attention, joint_bias
from reskv.compress import CompressedLayerState, additive_mask, build_cache
from reskv.config import ResidualConfig
from reskv.residual import residual_sizes
from reskv.scoring import LayerObservation, TokenScorer, causal_attention_probs


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


def candidate_sizes(
    config: ResidualConfig, budgets: Tensor, window: int, validation_count: int
) -> list[Tensor]:
    """Residual sizes per candidate ratio of the grid and head, 0 where the candidate is skipped.

    ``r = floor(ratio * b + 0.5)`` with ``b`` the head's deployed budget; skipped when ``r`` is 0,
    repeats an earlier candidate's ``r`` for that head, or leaves ``m' - |P'| < 0`` with
    ``m' = b - r - validation_count`` (reskv.md). ``window`` is ``|P'|``.
    """
    seen: list[Tensor] = []
    sizes = []
    for ratio in config.grid:
        size = residual_sizes(ratio, budgets)
        skip = (size == 0) | (budgets - size - validation_count < window)
        for earlier in seen:
            skip |= size == earlier
        seen.append(size)
        sizes.append(size.masked_fill(skip, 0))
    return sizes


class ValidationProxy:
    """Per-head residual size chosen on held-out validation queries by a simulated decode.

    ``budgets`` passed to the methods are the heads' deployed budgets ``b_h`` (AdaKV: from the
    deployed scores), so a candidate plus the exact validation tokens fills the same ``b_h`` slots
    as the deployed cache.
    """

    def __init__(self, obs: LayerObservation, scorer: TokenScorer, config: ResidualConfig, split):
        fit, validation = split
        self.obs, self.scorer, self.config = obs, scorer, config
        positions = obs.query_positions
        validation_positions = positions[validation]  # the last positions of the prompt
        self.boundary = int(validation_positions[0])  # β
        self.validation_count = validation_positions.numel()
        # Copied once: every candidate gathers rows from S', and a gather from a strided slice
        # first copies all of it (four times per candidate).
        self.prefix_keys = obs.keys[:, : self.boundary].contiguous()
        self.prefix_values = obs.values[:, : self.boundary].contiguous()
        self.fit_scores = scorer.score(self.prefix_keys, obs.queries[:, fit], positions[fit], obs.scaling)
        self.prefix_window = min(scorer.window, self.boundary)  # |P'|
        validation_queries = obs.queries[:, validation]
        self.validation_queries = grouped(validation_queries, obs.num_kv_heads)
        # o_S(t): full causal attention over 0 .. t.
        probs = causal_attention_probs(validation_queries, obs.keys, validation_positions, obs.scaling)
        self.full_output = grouped(probs, obs.num_kv_heads) @ obs.values.float()
        # The exact tokens β .. s-1 follow every candidate main cache; query t sees those <= t.
        query_positions = validation_positions.repeat(obs.group_size)  # the grouped query order
        self.exact_bias = additive_mask(validation_positions[None, :] <= query_positions[:, None])

    def candidate(self, budgets: Tensor, sizes: Tensor) -> CompressedLayerState:
        """The candidate cache over ``S'`` for residual sizes ``[H_kv]``: ``m' = b - r - |validation|``."""
        main_sizes = budgets - sizes - self.validation_count
        return build_cache(
            self.prefix_keys,
            self.prefix_values,
            self.fit_scores,
            self.scorer.window,
            main_sizes,
            sizes,
            self.config.kmeans_iterations,
        )

    def errors(self, budgets: Tensor, sizes: Tensor) -> Tensor:
        """``||ô_r(q) - o_S(q)||²`` ``[H_kv, G * |validation|]`` per validation query and group head
        (grouped order: query head major), ``ô_r`` the decode rule with its gate over ``M' ∪ {β..t}``."""
        obs = self.obs
        candidate = self.candidate(budgets, sizes)
        residual = candidate.residual
        num_queries = self.validation_queries.shape[1]
        # One buffer [entries ; M' ; β .. s-1] as a decode step reads it (reskv.attention.joint_attention).
        keys = torch.cat([residual.keys, candidate.main_keys, obs.keys[:, self.boundary :]], dim=1)
        values = torch.cat([residual.values, candidate.main_values, obs.values[:, self.boundary :]], dim=1)
        padding = candidate.main_bias
        if padding is None:
            padding = torch.zeros(obs.num_kv_heads, 1, candidate.main_keys.shape[1], device=keys.device)
        main_bias = torch.cat(
            [padding.expand(-1, num_queries, -1), self.exact_bias.expand(obs.num_kv_heads, -1, -1)], dim=-1
        )
        bias = joint_bias(residual.log_counts, main_bias, main_bias.shape[-1], self.config.beta)
        output = joint_attention(
            self.validation_queries,
            keys,
            values,
            bias,
            residual.keys.shape[1],
            obs.scaling,
            self.config,
            candidate.evicted_fraction,
        )
        return ((output - self.full_output) ** 2).sum(dim=-1)

    def losses(self, budgets: Tensor, sizes: Tensor) -> Tensor:
        """``L_r`` ``[H_kv]``: the mean of ``errors`` over validation queries and group heads."""
        return self.errors(budgets, sizes).mean(dim=-1)

    def choose(self, budgets: Tensor) -> Tensor:
        """``r* = argmin_{r>0} L_r`` (the first candidate on ties), kept only where
        ``L_{r*} < (1 - delta) * L_0``, else 0; 0 where no candidate is admissible."""
        none = torch.zeros_like(budgets)
        admissible = [
            sizes
            for sizes in candidate_sizes(self.config, budgets, self.prefix_window, self.validation_count)
            if bool((sizes > 0).any())
        ]
        if not admissible:
            return none
        best_size, best_loss = none, torch.full(budgets.shape, float("inf"), device=budgets.device)
        for sizes in admissible:
            loss = self.losses(budgets, sizes).masked_fill(sizes == 0, float("inf"))
            better = loss < best_loss
            best_size, best_loss = torch.where(better, sizes, best_size), torch.where(better, loss, best_loss)
        accepted = best_loss < (1 - self.config.delta) * self.losses(budgets, none)
        return best_size.masked_fill(~accepted, 0)

    def fit_selection(self) -> tuple[Tensor, int]:
        """Scores ``[H_kv, s]`` and protected window for ``final_selection="fit"``: the deployed cache
        is the validated one, ``M' ∪ {β .. s-1}`` plus the entries of ``E' = S' \\ M'``.

        This project's mapping of the fit scores (which cover ``S'``) to the whole prompt: the
        tokens from ``β`` on are kept exact, as in the simulation, by protecting ``P' ∪ [β, s)``
        (the last ``|P'| + |validation|`` tokens, contiguous); the fit scores rank the rest. With
        ``m = b - r`` main slots this selects exactly the candidate's ``M'`` (same scores, same
        ties), and the evicted side is ``E'``, so the residual entries are the candidate's too.
        """
        padding = self.fit_scores.new_zeros(self.fit_scores.shape[0], self.validation_count)  # protected
        return torch.cat([self.fit_scores, padding], dim=1), self.prefix_window + self.validation_count
