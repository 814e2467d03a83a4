"""PyramidKV: SnapKV scores inside each layer, with more of the budget in lower layers than upper ones.

Reference: Zefan-Cai/KVCache-Factory ``pyramidkv/pyramidkv_utils.py`` (``PyramidKVCluster.update_kv``)
with ``init_pyramidkv``'s defaults (``window_size = 32``, ``kernel_size = 5``, ``pooling =
'avgpool'``, ``beta = 20``). Upstream, with ``C = max_capacity_prompt``, ``W = window_size``,
``L`` layers and ``q_len`` prompt tokens: ``min_num = (C - W) // beta``, ``max_num = 2 (C - W) -
min_num``; when ``max_num >= q_len - W`` then ``max_num = q_len - W`` and ``min_num = 2 (C - W) -
max_num``; layer ``l`` keeps its top ``max_num - l * steps`` prefix tokens, ``steps = (max_num -
min_num) // (L - 1)``, plus the window. Below ``q_len < 2 (C - W)`` every layer keeps ``C``.

Fixed by baselines.md (PyramidKV): ``C`` is this project's budget ``b`` (slots per KV head,
window included), so the layer budgets average ``b`` as upstream's average ``C``. Upstream floors
``steps``, which makes its layers keep on average up to ``(L - 2) / 2`` tokens more than ``C``;
here the pyramid is the exact line from ``max_num`` down to ``min_num`` (its mean is ``C - W``),
rounded to integers by largest remainder (ties to the lower layer), so the layers' budgets sum to
``L * b`` exactly. Within a layer every KV head keeps the same count; the scores are SnapKV's
(``baselines.snapkv.window_scores``: GQA group mean, as this project's SnapKV).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from baselines.snapkv import SnapKV

LAYER_NEEDED = (
    "PyramidKV's budgets depend on the layer: the compressor must call "
    "head_budgets(scores, budget, layer_idx=..., num_layers=...)"
)


def pyramid_budgets(budget: int, seq_len: int, num_layers: int, window: int, beta: int) -> list[int]:
    """Slots per KV head of each layer (window included), layer 0 first; they sum to
    ``num_layers * budget``. Uniform ``budget`` where upstream keeps ``C`` in every layer (a
    prompt shorter than ``2 (C - W)``), for a single layer, and when ``budget <= window`` (the
    shared fallback: each head keeps its last ``budget`` tokens)."""
    average = budget - window  # upstream's C - W
    if num_layers == 1 or average <= 0 or seq_len < 2 * average:
        return [budget] * num_layers
    low = average // beta
    high = 2 * average - low
    if high >= seq_len - window:
        high = seq_len - window
        low = 2 * average - high
    exact = [Fraction(high) - Fraction(layer * (high - low), num_layers - 1) for layer in range(num_layers)]
    prefix = [int(value) for value in exact]  # floors: every value is non-negative
    largest_first = sorted(range(num_layers), key=lambda layer: (-(exact[layer] - prefix[layer]), layer))
    for layer in largest_first[: num_layers * average - sum(prefix)]:
        prefix[layer] += 1
    return [count + window for count in prefix]


class PyramidKV(SnapKV):
    """SnapKV scoring with pyramid layer budgets (baselines.md, PyramidKV)."""

    budget_scope = "layer"

    def __init__(self, window: int = 32, kernel_size: int = 5, beta: int = 20):
        super().__init__(window, kernel_size)
        self.beta = beta

    def head_budgets(
        self, scores: Tensor, budget: int, *, layer_idx: int | None = None, num_layers: int | None = None
    ) -> Tensor:
        """Layer ``layer_idx``'s pyramid budget for each of its KV heads (``pyramid_budgets``)."""
        if layer_idx is None or num_layers is None:
            raise ValueError(LAYER_NEEDED)
        layer_budget = pyramid_budgets(budget, scores.shape[1], num_layers, self.window, self.beta)[layer_idx]
        return torch.full((scores.shape[0],), layer_budget, dtype=torch.long, device=scores.device)

    def host_budgets(
        self, scores: Tensor, budgets: Sequence[int], *, first_layer: int, num_layers: int | None = None
    ) -> list[list[list[int]]]:
        """The stacked layers' pyramid budgets at each of ``budgets``, on the host (no score is read)."""
        if num_layers is None:
            raise ValueError(LAYER_NEEDED)
        layers, heads, seq_len = scores.shape
        pyramids = [
            pyramid_budgets(budget, seq_len, num_layers, self.window, self.beta)[first_layer:]
            for budget in budgets
        ]
        return [[[pyramid[layer]] * heads for layer in range(layers)] for pyramid in pyramids]
