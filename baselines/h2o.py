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

from reskv.scoring import LayerObservation, TokenScorer, accumulated_attention


class H2O(TokenScorer):
    """Accumulated-attention scoring; ``window_only`` scores with the observed window queries only."""

    def __init__(self, window: int = 64, window_only: bool = False):
        self.window = window
        self.window_only = window_only
        # The full statistic needs every prefill query, which only the prefill pass sees.
        self.needs_accumulated_attention = not window_only

    def score(self, keys: Tensor, queries: Tensor, positions: range, scaling: float) -> Tensor:
        """Accumulated attention of ``queries`` over ``keys`` (the window-only variant's window, or
        the validation proxy's fit queries over the prefix before validation, reskv.md)."""
        return accumulated_attention(queries, keys, positions, scaling)

    def prompt_scores(self, obs: LayerObservation, num_layers: int = 1) -> Tensor:
        """The full statistic over every prompt query, captured during prefill; the window-only
        variant scores with its last ``window`` observed queries."""
        if self.window_only:
            return super().prompt_scores(obs, num_layers)
        if obs.accumulated is None:
            raise ValueError(
                "H2O needs the accumulated attention captured during prefill: list the method in "
                "Prefill(..., methods=[...]) so the prefill records it"
            )
        return obs.accumulated
