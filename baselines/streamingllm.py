"""StreamingLLM: keep the first ``n_sink`` tokens (attention sinks) and the most recent ones.

Reference: NVIDIA kvpress ``kvpress/presses/streaming_llm_press.py`` (``StreamingLLMPress``,
``n_sink = 4``): scores are 1 everywhere but 0 on the ``n_pruned`` tokens right after the sinks,
so the press keeps the sinks and the last ``b - n_sink`` tokens. Fixed by baselines.md
(StreamingLLM): the same cache from this project's shared selection, with no protected window;
the score is the position, and the sinks score above every position, so the top ``b`` are the
sinks plus the newest ``b - n_sink``. It reads no attention, so the validation proxy's prefix
scores (+ResKV) are the same rule on the prefix. Keys are not re-rotated (kvpress's
``KeyRerotationPress`` is a separate press).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reskv.scoring import TokenScorer


class StreamingLLM(TokenScorer):
    """Sinks plus recency (baselines.md, StreamingLLM); every KV head keeps the same tokens."""

    window = 0  # recency is the score itself: the newest tokens rank first after the sinks

    def __init__(self, n_sink: int = 4):
        self.n_sink = n_sink

    def score(self, keys: Tensor, queries: Tensor, positions, scaling: float) -> Tensor:
        """Scores ``[H_kv, s]``: position ``t`` scores ``t``, the first ``n_sink`` score ``s``."""
        num_kv_heads, seq_len = keys.shape[0], keys.shape[1]
        scores = torch.arange(seq_len, dtype=torch.float32, device=keys.device)
        scores[: self.n_sink] = seq_len
        return scores.expand(num_kv_heads, seq_len).clone()
