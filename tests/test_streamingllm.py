"""StreamingLLM keeps what kvpress's StreamingLLMPress keeps: the 4 sinks and the newest tokens."""

from __future__ import annotations

import pytest
import torch

from baselines import build_method
from baselines.streamingllm import StreamingLLM
from reskv.compress import compress_layer
from reskv.config import ResidualConfig, budget_for
from reskv.scoring import LayerObservation


def observation(seq_len: int, kv_heads: int = 2, group: int = 2, observed: int = 128) -> LayerObservation:
    generator = torch.Generator().manual_seed(3)
    return LayerObservation(
        layer_idx=0,
        keys=torch.randn(kv_heads, seq_len, 8, generator=generator),
        values=torch.randn(kv_heads, seq_len, 8, generator=generator),
        queries=torch.randn(kv_heads * group, min(seq_len, observed), 8, generator=generator),
        accumulated=None,
        scaling=8**-0.5,
    )


def kvpress_kept(seq_len: int, ratio: float, n_sink: int = 4) -> set[int]:
    """kvpress ``StreamingLLMPress.score``: every token scores 1 but the ``n_pruned`` right after
    the sinks (0); the press keeps the rest. ``int(q_len * (1 - ratio))`` is this project's budget."""
    n_pruned = seq_len - budget_for(seq_len, ratio)
    return set(range(seq_len)) - set(range(n_sink, n_sink + n_pruned))


@pytest.mark.parametrize(("seq_len", "ratio"), [(300, 0.9), (300, 0.6), (57, 0.5), (1000, 0.99)])
def test_every_head_keeps_the_four_sinks_and_the_newest_tokens(seq_len, ratio):
    state = compress_layer(observation(seq_len), StreamingLLM(), ratio)
    expected = kvpress_kept(seq_len, ratio)
    for head in state.kept:
        assert set(torch.nonzero(head).flatten().tolist()) == expected


def test_with_reskv_the_main_cache_is_sinks_and_recent_tokens_and_the_rest_goes_residual():
    state = compress_layer(observation(600), StreamingLLM(), 0.8, ResidualConfig(validate=False))
    budget = budget_for(600, 0.8)
    residual = ResidualConfig().fixed_ratio * budget
    for head, entries in zip(state.kept, state.residual.entries_per_head, strict=True):
        kept = torch.nonzero(head).flatten().tolist()
        main = len(kept)
        assert kept == [0, 1, 2, 3, *range(600 - (main - 4), 600)]
        assert main == budget - round(residual) and 0 < entries <= round(residual)


def test_streamingllm_reads_no_attention_and_needs_no_observation_window():
    method = build_method("streamingllm+reskv", 0.9)
    scores = method.scorer.prompt_scores(observation(100))
    assert torch.equal(scores[0, :4], torch.full((4,), 100.0))
    assert torch.equal(scores[1, 4:], torch.arange(4, 100, dtype=torch.float32))
    assert method.scorer.window == 0
