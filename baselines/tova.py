"""TOVA: keep the tokens the last query attends to most, one selection per layer.

Reference: schwartz-lab-NLP/TOVA ``src/tova_cache.py`` (``TOVACache.reduce``: mean of the last
query's attention over the heads, one top-k shared by every head). Fixed by baselines.md (TOVA):
protect only the last token; fp32 softmax of the last query over all keys averaged over *all*
query heads of the layer, so its KV heads share one selection; selection happens once after
prefill, not again during decoding.
"""

from __future__ import annotations

from torch import Tensor

from reskv.scoring import TokenScorer, mean_attention


def last_query_scores(
    queries: Tensor, positions: range, keys: Tensor, scaling: float, num_layers: int = 1
) -> Tensor:
    """Attention ``[H_kv, s]`` of the last of ``queries``, averaged over all query heads of a layer;
    the same row for every KV head of the layer, so the shared per-head selection picks one token
    set for it. ``num_layers`` layers may be stacked along the heads (``reskv.scoring.stack_layers``)."""
    probs = mean_attention(queries[:, -1:], keys, positions[-1:], scaling)  # [L*H, s]
    per_layer = probs.reshape(num_layers, -1, probs.shape[-1]).mean(dim=1)  # [L, s]
    return per_layer.repeat_interleave(keys.shape[0] // num_layers, dim=0)


class TOVA(TokenScorer):
    """TOVA scoring with the last token protected (baselines.md, TOVA)."""

    window = 1

    def score(self, keys: Tensor, queries: Tensor, positions: range, scaling: float) -> Tensor:
        """The last of ``queries`` (the prompt's last query, or the proxy's last fit query)."""
        return last_query_scores(queries, positions, keys, scaling)

    def stacked_score(
        self, keys: Tensor, queries: Tensor, positions: range, scaling: float, num_layers: int
    ) -> Tensor:
        return last_query_scores(queries, positions, keys, scaling, num_layers)
