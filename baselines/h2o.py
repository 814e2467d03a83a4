"""H2O: keep the heavy hitters, the tokens with the most accumulated attention, plus the last ``window``.

Reference: FMInference/H2O ``h2o_hf/utils_real_drop/modify_llama.py`` (``_update_hh_score``).
Fixed by baselines.md (H2O): protect the last 64 tokens; the score is the column sum of causal
fp32 softmax attention over all prefill queries, group-meaned, with no pooling and no
normalisation by how many queries see a token; computed in query chunks during prefill
(``obs.accumulated``, see ``reskv.scoring.accumulated_attention``); a config switch selects
the window-only variant (the sums over the last ``window`` queries only).
"""

from __future__ import annotations

from torch import Tensor

from baselines.snapkv import observation_queries
from reskv.scoring import LayerObservation, TokenScorer, accumulated_attention


class H2O(TokenScorer):
    """Accumulated-attention scoring; ``window_only`` scores with the observed window queries only."""

    name = "h2o"

    def __init__(self, window: int = 64, window_only: bool = False):
        self.window = window
        self.window_only = window_only
        # The full statistic needs every prefill query, which only the prefill pass sees.
        self.needs_accumulated_attention = not window_only

    def score(self, obs: LayerObservation) -> Tensor:
        if self.window_only:
            queries, positions = observation_queries(obs, self.window)
            return accumulated_attention(queries, obs.keys, positions, obs.scaling)
        if obs.accumulated is None:
            raise ValueError(
                "H2O needs the accumulated attention captured during prefill: list the method in "
                "Prefill(..., methods=[...]) so the prefill records it"
            )
        return obs.accumulated

    def fit_score(self, obs: LayerObservation, fit_queries: Tensor, fit_positions: Tensor) -> Tensor:
        """reskv.md (validation proxy): the accumulated attention of the fit queries."""
        return accumulated_attention(fit_queries, obs.keys, fit_positions, obs.scaling)
