"""CaM (baselines.md, CaM), moved out of test_baselines.py."""

from __future__ import annotations

import pytest
import torch
from test_baselines import SCALING, kept_by, make_obs

from baselines.cam import LAYER_SEED_STRIDE, CaM, merge_evicted
from baselines.snapkv import SnapKV, window_attention
from reskv.scoring import LayerObservation


def plain_merge(values, scores, kept, uniforms, merge_targets: int) -> torch.Tensor:
    """Token by token in position order; draw for (head, i) is ``uniforms[h, i]``, as CaM documents."""
    merged = values.double().clone()
    heads, seq_len = kept.shape
    for head in range(heads):
        for i in range(seq_len):
            if kept[head, i]:
                continue
            targets = [t for t in range(i + 1, seq_len) if kept[head, t]][:merge_targets]
            if not targets:
                continue
            mean = sum(float(scores[head, t]) for t in targets) / len(targets)
            own = float(scores[head, i])
            ratio = (0.0 if own == 0 else 1.0) if mean == 0 else min(max(own / mean, 0.0), 1.0)
            if float(uniforms[head, i]) < ratio:
                for t in targets:
                    merged[head, t] += values[head, i].double() / len(targets)
    return merged


def cam_uniforms(obs: LayerObservation, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * LAYER_SEED_STRIDE + obs.layer_idx)
    return torch.rand(obs.keys.shape[:2], generator=generator)


@pytest.mark.parametrize(("group", "merge_targets"), [(1, 32), (2, 3)])
def test_cam_matches_plain_merge_loop(group, merge_targets):
    obs, _ = make_obs(40, 2, group, 8, seed=19 + group, layer_idx=3)
    scorer = CaM(window=4, merge_targets=merge_targets, seed=7)
    kept = kept_by(scorer, obs, 12)
    assert torch.equal(kept, kept_by(SnapKV(window=4), obs, 12))  # selection is SnapKV's
    scores = window_attention(obs.queries[:, -4:], obs.query_positions[-4:], obs.keys, SCALING)
    expected = plain_merge(obs.values, scores, kept, cam_uniforms(obs, 7), merge_targets)
    assert torch.allclose(scorer.adjust_values(obs, kept).double(), expected, atol=1e-6)


def test_cam_tokens_without_retained_successors_are_not_merged():
    values = torch.arange(1.0, 9.0).reshape(1, 8, 1)
    kept = torch.tensor([[False, True, False, True, False, False, False, False]])
    scores = torch.ones(1, 8)  # p = 1: every token with targets merges
    merged = merge_evicted(values, scores, kept, torch.zeros(1, 8), merge_targets=32)
    # token 0 -> {1, 3} (half each), token 2 -> {3}; tokens 4..7 have no retained successor
    assert merged.flatten().tolist() == [1.0, 2.5, 3.0, 4.0 + 0.5 + 3.0, 5.0, 6.0, 7.0, 8.0]


def test_cam_changes_values_only_and_is_seeded():
    obs, _ = make_obs(40, 2, 2, 8, seed=23, layer_idx=1)
    keys, values = obs.keys.clone(), obs.values.clone()
    kept = kept_by(CaM(window=4), obs, 10)
    scores = window_attention(obs.queries[:, -4:], obs.query_positions[-4:], obs.keys, SCALING)
    ratio = scores[~kept] / scores[kept].mean()
    assert ((ratio > 0.05) & (ratio < 0.95)).sum() >= 4  # draws actually decide something
    first = CaM(window=4, seed=1).adjust_values(obs, kept)
    assert torch.equal(obs.keys, keys) and torch.equal(obs.values, values)
    assert first is not obs.values and first.dtype == values.dtype
    assert torch.equal(first[~kept], values[~kept])  # merges only ever land on retained tokens
    assert not torch.equal(first, values)
    assert torch.equal(first, CaM(window=4, seed=1).adjust_values(obs, kept))
    assert not torch.equal(first, CaM(window=4, seed=2).adjust_values(obs, kept))


def test_cam_keeps_low_precision_dtype():
    obs, _ = make_obs(20, 1, 1, 8, seed=29)
    obs.values = obs.values.to(torch.bfloat16)
    kept = kept_by(CaM(window=4), obs, 8)
    assert CaM(window=4).adjust_values(obs, kept).dtype == torch.bfloat16
