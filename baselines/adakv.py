"""AdaKV: SnapKV scores with the layer's budget spread over its KV heads by where the top scores fall.

Reference: FFY0/AdaKV ``adaptive_snapkv/monkeypatch/snapkv_utils.py`` (``AdaptiveSnapKVCluster``,
``update_kv_gqa``: GQA scores by the group mean, a floor of ``alpha`` times the base capacity per
head). Fixed by baselines.md (AdaKV): SnapKV scores per KV head (window 64, kernel 5), safeguard
``alpha = 0.2``, ``B = b - window``, ``c_h`` = head ``h``'s share of the layer's top ``H*B`` prefix
scores, ``cap_h = c_h (1 - alpha) + alpha B`` rounded by largest remainder (ties to the lower head
index) so that the caps sum to ``H*B`` exactly; each head keeps its top ``cap_h`` plus the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch
from torch import Tensor

from baselines.snapkv import SnapKV
from reskv.selection import score_ranks, uploaded

# alpha becomes the nearest fraction with at most this denominator (0.2 -> 1/5), so caps and
# their remainders are exact integers: no float noise decides which head gets a rounded slot.
ALPHA_DENOMINATOR = 10_000


def safeguarded_caps(prefix_scores: Tensor, per_head: int, alpha: float) -> Tensor:
    """Prefix slots ``[..., H]`` (long) per head, summing to ``H * per_head`` in each layer;
    ``prefix_scores`` is ``[..., H, n]`` (one layer, or layers stacked in front): ``safeguarded_caps_at``
    of one ``per_head``."""
    return safeguarded_caps_at(prefix_scores, [per_head], alpha)[0]


def safeguarded_caps_at(prefix_scores: Tensor, per_heads: Sequence[int], alpha: float) -> Tensor:
    """``[B, ..., H]``: for each of ``per_heads``, prefix slots per head summing to ``H * per_head`` in
    each layer of ``prefix_scores`` ``[..., H, n]``; one ranking of the scores serves them all.

    ``c_h`` counts head ``h`` among the layer's top ``H * per_head`` of its flattened scores; ties go
    to the lower head index, then the lower position (a stable sort of the head-major flattening).
    With ``per_head < n`` every cap stays within the head's ``n`` tokens: ``cap_h`` is a convex
    combination of ``c_h <= n`` and ``per_head < n``, and the extra unit only goes to a
    fractional ``cap_h < n`` (remainders sum to the number of units handed out, each below 1).
    """
    *layers, num_heads, length = prefix_scores.shape
    device = prefix_scores.device
    per_head = uploaded(per_heads, device)[:, None, None]  # [B, 1, 1]
    total = num_heads * per_head
    ranks = score_ranks(prefix_scores.reshape(-1, num_heads * length))  # [layers, H * n]
    counts = (ranks < total).reshape(len(per_heads), -1, num_heads, length).sum(dim=-1)  # [B, layers, H]
    num, den = Fraction(alpha).limit_denominator(ALPHA_DENOMINATOR).as_integer_ratio()
    scaled = counts * (den - num) + num * per_head  # den * cap_h
    caps, remainders = scaled // den, scaled % den
    # The units still missing go to the largest remainders, one each: a head gets one when its
    # remainder ranks below the number missing (no count is read back from the device).
    caps = caps + (score_ranks(remainders) < total - caps.sum(dim=-1, keepdim=True))
    return caps.reshape(len(per_heads), *layers, num_heads)


class AdaKV(SnapKV):
    """SnapKV scoring with per-head budgets (baselines.md, AdaKV); heads hold ragged lengths."""

    budget_scope = "head"

    def __init__(self, window: int = 64, kernel_size: int = 5, alpha: float = 0.2):
        super().__init__(window, kernel_size)
        self.alpha = alpha

    def head_budgets(
        self, scores: Tensor, budget: int, *, layer_idx: int | None = None, num_layers: int | None = None
    ) -> Tensor:
        """Per-head slots ``cap_h + window``, summing to ``H_kv * budget``.

        Uniform ``budget`` when there is nothing to reallocate: ``budget <= window`` (each head
        keeps its last ``budget`` tokens, the shared fallback) or ``budget - window`` covers the
        whole prefix (each head keeps everything; the selection clamps to ``s``).
        """
        seq_len = scores.shape[-1]
        window = min(self.window, seq_len)
        per_head, prefix_len = budget - window, seq_len - window
        if per_head <= 0 or per_head >= prefix_len:
            return torch.full(scores.shape[:-1], budget, dtype=torch.long, device=scores.device)
        return safeguarded_caps(scores[..., :prefix_len], per_head, self.alpha) + window

    def stacked_head_budgets(
        self, scores: Tensor, budget: int, *, first_layer: int, num_layers: int | None = None
    ) -> Tensor:
        """``head_budgets`` of every stacked layer at once (``safeguarded_caps`` per layer)."""
        return self.head_budgets(scores, budget)

    def host_budgets(
        self, scores: Tensor, budgets: Sequence[int], *, first_layer: int, num_layers: int | None = None
    ) -> list[list[list[int]]]:
        """``head_budgets`` of the stacked layers at each of ``budgets``, read once: the budgets that
        reallocate share one ranking (``safeguarded_caps_at``), the others are uniform (host)."""
        num_layers_here, num_heads, seq_len = scores.shape
        window = min(self.window, seq_len)
        prefix_len = seq_len - window
        spread = sorted({budget for budget in budgets if 0 < budget - window < prefix_len})
        caps = {}
        if spread:
            per_heads = [budget - window for budget in spread]
            found = safeguarded_caps_at(scores[..., :prefix_len], per_heads, self.alpha) + window
            caps = dict(zip(spread, found.tolist(), strict=True))
        uniform = [[[budget] * num_heads for _ in range(num_layers_here)] for budget in budgets]
        return [caps.get(budget, same) for budget, same in zip(budgets, uniform, strict=True)]
