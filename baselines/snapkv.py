"""SnapKV: keep the prefix tokens the last ``window`` queries attend to most, smoothed by pooling.

References: FasterDecoding/SnapKV ``snapkv/monkeypatch/snapkv_utils.py`` (``SnapKVCluster``) and
NVIDIA kvpress ``kvpress/presses/snapkv_press.py``. Fixed by baselines.md (SnapKV): window 64,
kernel 5, fp32 causal softmax of the window queries over all keys, columns ``[0, s - window)``
only, mean over the window queries, mean over the GQA group *before* pooling (kvpress pools
first; pooling is linear, so only rounding differs), ``avg_pool1d(kernel, stride 1,
padding kernel // 2)`` with PyTorch's default ``count_include_pad``. The selection itself
(top ``b - window`` prefix tokens plus the window, ties toward lower positions) is the shared
``reskv.selection.select_main``.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import Tensor

from reskv.scoring import TokenScorer, group_mean, mean_attention
from reskv.scoring import observation_queries as observation_queries  # re-exported: CaM reads it here

# Score given to the protected window. Pooled attention is a mean of probabilities, at most 1,
# so 2 ranks the window above every prefix token (kvpress pads with max + 1) while staying
# finite for any consumer that reduces whole rows; the shared selection ignores it anyway.
WINDOW_FILL = 2.0


def window_attention(queries: Tensor, positions: range, keys: Tensor, scaling: float) -> Tensor:
    """Un-pooled SnapKV statistic ``[H_kv, s]`` fp32: causal attention of ``queries`` on every key,
    averaged over the queries, then over each GQA group.

    Columns inside the window are kept (CaM's merge targets may lie there); a query gives zero
    weight to keys after it, and the mean still divides by all queries, as upstream does.
    """
    return group_mean(mean_attention(queries, keys, positions, scaling), keys.shape[0])


def window_scores(
    queries: Tensor, positions: range, keys: Tensor, scaling: float, protected: int, kernel_size: int
) -> Tensor:
    """SnapKV scores ``[H_kv, s]``: ``window_attention`` on the columns before the last
    ``protected`` tokens, average-pooled; the protected columns hold ``WINDOW_FILL``.

    ``queries`` are the method's window (deployed cache) or the validation proxy's fit queries
    (reskv.md: the fit queries act as the window, pooled, over the prefix before validation).
    """
    seq_len = keys.shape[1]
    prefix_len = seq_len - min(protected, seq_len)
    scores = torch.full((keys.shape[0], seq_len), WINDOW_FILL, dtype=torch.float32, device=keys.device)
    if prefix_len > 0:  # a prompt no longer than the window has nothing to rank
        prefix = window_attention(queries, positions, keys, scaling)[:, :prefix_len]
        scores[:, :prefix_len] = F.avg_pool1d(prefix, kernel_size, stride=1, padding=kernel_size // 2)
    return scores


class SnapKV(TokenScorer):
    """SnapKV scoring with a protected window of the last ``window`` tokens (baselines.md, SnapKV)."""

    def __init__(self, window: int = 64, kernel_size: int = 5):
        self.window = window
        self.kernel_size = kernel_size

    def score(self, keys: Tensor, queries: Tensor, positions: range, scaling: float) -> Tensor:
        return window_scores(queries, positions, keys, scaling, self.window, self.kernel_size)

    def scores_key(self) -> Hashable:
        """The scoring functions, the window and the kernel: rules built on SnapKV's scores (AdaKV, CaM:
        their other attributes spread the budget or merge values) score as it does."""
        rule = type(self)
        return (rule.score, rule.stacked_score, rule.prompt_scores), self.window, self.kernel_size
