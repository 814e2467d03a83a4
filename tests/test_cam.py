"""CaM (baselines.md, CaM) against a plain loop in KVCache-Factory's form.

``plain_cam`` is written from the spec, step by step as ``CAMKVCluster.update_kv`` runs it: for
``i = start .. s-65`` in order, ``p_i`` from the window attention, a draw, and an in-place add of
the (already merged) ``V[i] / 64`` to the next 64 positions. The code under test solves the same
recurrence 64 positions at a time with triangular solves.
"""

from __future__ import annotations

import math

import pytest
import torch

from baselines.cam import LAYER_SEED_STRIDE, CaM, merge_probabilities, merge_values
from baselines.snapkv import SnapKV, window_attention
from reskv.compress import compress_layer
from reskv.scoring import LayerObservation, stack_layers

D = 4
SCALING = 1 / math.sqrt(D)


def plain_cam(values, attention, uniforms, merge_window: int = 64) -> torch.Tensor:
    """The spec's loop in float64; ``p_i`` in fp32 like the attention it divides."""
    merged = values.double().clone()
    heads, seq_len, _ = values.shape
    start = math.ceil(seq_len / 10)  # exact for these lengths
    for i in range(start, seq_len - merge_window):
        for head in range(heads):
            row = attention[head]
            candidates = torch.cat([row[:start], row[i : i + merge_window]])
            probability = float(row[i] / candidates.max())
            probability = 0.0 if math.isnan(probability) else min(probability, 1.0)
            if float(uniforms[head, i]) < probability:
                merged[head, i + 1 : i + merge_window + 1] += merged[head, i] / merge_window
    return merged


def observation(seq_len: int, kv_heads: int = 2, group: int = 2, seed: int = 0, layer_idx: int = 0):
    """Random keys/values and the last 64 queries (the window attention's queries)."""
    gen = torch.Generator().manual_seed(seed)
    return LayerObservation(
        layer_idx=layer_idx,
        keys=torch.randn(kv_heads, seq_len, D, generator=gen),
        values=torch.randn(kv_heads, seq_len, D, generator=gen),
        queries=torch.randn(kv_heads * group, min(seq_len, 64), D, generator=gen),
        accumulated=None,
        scaling=SCALING,
    )


def attention_of(obs: LayerObservation) -> torch.Tensor:
    return window_attention(obs.queries, obs.query_positions, obs.keys, SCALING)


def uniforms_of(obs: LayerObservation, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * LAYER_SEED_STRIDE + obs.layer_idx)
    return torch.rand(obs.keys.shape[:2], generator=generator)


# ---- the merge against the loop ----------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [73, 100, 128, 200, 257, 333])
@pytest.mark.parametrize("draws", ["seeded", "all-merge"])
def test_merge_matches_plain_loop(seq_len, draws):
    """Float64: equal to the loop up to summation order (the solve adds in another order)."""
    gen = torch.Generator().manual_seed(seq_len)
    values = torch.randn(3, seq_len, 5, generator=gen, dtype=torch.float64)
    attention = torch.rand(3, seq_len, generator=gen)
    attention[:, : math.ceil(seq_len / 10)] *= 0.3  # low sinks: the window's edges decide p
    uniforms = torch.rand(3, seq_len, generator=gen) if draws == "seeded" else torch.zeros(3, seq_len)
    merged = merge_values(values, attention, uniforms)
    expected = plain_cam(values, attention, uniforms)
    assert not torch.equal(expected, values)  # merges happened
    assert merged.dtype == torch.float64
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-13)


def test_merge_across_inverse_chunks_matches_plain_loop():
    """s = 4700: 67 blocks of 64 from start = 470 on, more than one chunk of block inverses."""
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(1, 4700, 2, generator=gen, dtype=torch.float64)
    attention = torch.rand(1, 4700, generator=gen)
    uniforms = torch.rand(1, 4700, generator=gen)
    merged = merge_values(values, attention, uniforms)
    torch.testing.assert_close(merged, plain_cam(values, attention, uniforms), rtol=0, atol=1e-12)
    assert not torch.equal(merged[:, 4400:], values[:, 4400:])  # merges reach the last chunk


def test_merge_equals_plain_loop_bit_for_bit_when_arithmetic_is_exact():
    """Integer values divisible by 64^3 and cascades at most 3 deep: every partial sum is an exact
    integer, so any summation order gives the loop's bits. Blocks 0..4 of 64, sources in 3 of them,
    chains 20 -> 21 -> 22 and 100 -> 101 -> 150 (150 - 101 < 64: a cascade across blocks)."""
    gen = torch.Generator().manual_seed(5)
    seq_len = 300  # start 30: sources from 30 on
    values = torch.randint(-8, 9, (2, seq_len, 3), generator=gen).double() * 64**3
    attention = torch.rand(2, seq_len, generator=gen) + 0.01  # every p_i > 0
    uniforms = torch.ones(2, seq_len)
    uniforms[0, [30, 31, 32, 100, 101, 150]] = 0.0  # merge for sure
    uniforms[1, [64, 127, 190, 235]] = 0.0  # the last source of the range is s - 65 = 235
    merged = merge_values(values, attention, uniforms)
    expected = plain_cam(values, attention, uniforms)
    assert not torch.equal(expected, values)
    assert torch.equal(merged, expected)


@pytest.mark.parametrize("seq_len", [1, 30, 64, 72])
def test_prompts_without_a_source_position_are_unchanged(seq_len):
    """``start = ceil(0.1 s) > s - 65``: the range is empty even with every draw merging."""
    gen = torch.Generator().manual_seed(seq_len)
    values = torch.randn(2, seq_len, 3, generator=gen, dtype=torch.float64)
    merged = merge_values(values, torch.ones(2, seq_len), torch.zeros(2, seq_len))
    assert torch.equal(merged, values) and torch.equal(
        plain_cam(values, torch.ones(2, seq_len), torch.zeros(2, seq_len)), values
    )


def test_one_source_position_at_seq_len_73():
    """``s = 73``: start 8 = s - 65, so only position 8 merges, into 9..72, by exactly ``V[8] / 64``."""
    values = torch.arange(73.0, dtype=torch.float64).reshape(1, 73, 1)
    merged = merge_values(values, torch.ones(1, 73), torch.zeros(1, 73))
    expected = values.clone()
    expected[0, 9:] += 8.0 / 64
    assert torch.equal(merged, expected)


def test_no_draw_merges_leaves_values_bit_for_bit():
    values = torch.randn(2, 200, 3, dtype=torch.float64)
    assert torch.equal(merge_values(values, torch.rand(2, 200), torch.ones(2, 200)), values)


def test_cascade_carries_a_merged_value_onwards():
    """Sources 20 and 21 (s = 200, start 20): 21 passes on its own value plus 20's share."""
    values = torch.zeros(1, 200, 1, dtype=torch.float64)
    values[0, 20, 0] = 64.0 * 64
    values[0, 21, 0] = 64.0
    uniforms = torch.ones(1, 200)
    uniforms[0, [20, 21]] = 0.0
    merged = merge_values(values, torch.ones(1, 200), uniforms).flatten()
    assert merged[21] == 64 + 64  # 20 -> 21
    assert merged[22] == 64 + (64 + 64) / 64  # 20 -> 22 and the merged 21 -> 22
    assert merged[84] == 64 + 2  # 20's window is 21..84; 21's reaches 85
    assert merged[85] == 2 and merged[86] == 0


# ---- the probabilities -------------------------------------------------------------------------


def test_probabilities_by_hand():
    """``s = 80``: start 8, sources 8..15. Sinks max 0.2; ``a_8 = 0.3`` is its own window's max
    (p = 1); windows of 9..15 reach position 72 (0.4): p = 0.1 / 0.4; ``a_12 = 0``: p = 0."""
    attention = torch.full((1, 80), 0.1)
    attention[0, 3] = 0.2
    attention[0, 8] = 0.3
    attention[0, 72] = 0.4
    attention[0, 12] = 0.0
    expected = torch.zeros(1, 80)
    expected[0, 8] = 1.0
    expected[0, 9:16] = 0.25
    expected[0, 12] = 0.0
    assert torch.equal(merge_probabilities(attention, 64), expected)


def test_probabilities_see_the_sinks_and_zero_attention_gives_zero():
    """A sink above the window caps p; a head with no attention at all gives 0 / 0 -> 0."""
    attention = torch.full((2, 100), 0.1)
    attention[0, 0] = 0.5
    attention[1] = 0.0
    probabilities = merge_probabilities(attention, 64)
    assert torch.allclose(probabilities[0, 10:36], torch.tensor(0.2))
    assert probabilities[0, 36:].eq(0).all() and probabilities[0, :10].eq(0).all()
    assert probabilities[1].eq(0).all()


# ---- CaM as a method ---------------------------------------------------------------------------


def test_keys_unchanged_and_selection_is_snapkvs():
    """Through the compressor: same kept set and main keys as SnapKV; main values are the merged
    values at the kept positions."""
    obs = observation(300, seed=3, layer_idx=2)
    keys, values = obs.keys.clone(), obs.values.clone()
    cam_state = compress_layer(obs, CaM(seed=9), ratio=0.7)
    snap_state = compress_layer(obs, SnapKV(), ratio=0.7)
    assert torch.equal(cam_state.kept, snap_state.kept)
    assert torch.equal(cam_state.main_keys, snap_state.main_keys)
    assert torch.equal(obs.keys, keys) and torch.equal(obs.values, values)  # inputs untouched
    merged = merge_values(values, attention_of(obs), uniforms_of(obs, 9))
    kept = torch.stack([head_values[row] for head_values, row in zip(merged, cam_state.kept, strict=True)])
    assert torch.equal(cam_state.main_values, kept)
    assert not torch.equal(cam_state.main_values, snap_state.main_values)


def test_adjust_values_is_seeded_per_run_and_layer():
    obs = observation(300, seed=4, layer_idx=1)
    probabilities = merge_probabilities(attention_of(obs), 64)
    assert ((probabilities > 0.05) & (probabilities < 0.95)).sum() >= 20  # draws decide something
    first = CaM(seed=1).adjust_values(obs)
    assert torch.equal(first, merge_values(obs.values, attention_of(obs), uniforms_of(obs, 1)))
    assert not torch.equal(first, obs.values)
    assert not torch.equal(first, CaM(seed=2).adjust_values(obs))
    obs.layer_idx = 2
    assert not torch.equal(first, CaM(seed=1).adjust_values(obs))


def test_stacked_layers_merge_as_each_layer_alone():
    """Three layers stacked along the heads (``stack_layers``, as a grid merges them once for all its
    ratios): each layer's rows are its merge alone, bit for bit, with its own layer's draws."""
    layers = [observation(300, seed=7 + layer, layer_idx=4 + layer) for layer in range(3)]
    stacked = CaM(seed=3).adjust_values(stack_layers(layers), num_layers=3)
    assert torch.equal(stacked, torch.cat([CaM(seed=3).adjust_values(obs) for obs in layers]))


def test_low_precision_values_merge_in_fp32_and_cast_once():
    obs = observation(300, seed=6)
    obs.values = obs.values.to(torch.bfloat16)
    merged = CaM(seed=1).adjust_values(obs)
    fp32 = merge_values(obs.values.float(), attention_of(obs), uniforms_of(obs, 1))
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, fp32.to(torch.bfloat16))


def test_32k_prompt_is_solved_in_window_sized_blocks(monkeypatch):
    """s = 32768 with every position merging: every triangular system is 64 x 64, at most 64 of
    them at once, and together they cover the positions from ``start`` on once."""
    systems = []
    solve = torch.linalg.solve_triangular

    def recording_solve(matrix, rhs, **kwargs):
        systems.append(tuple(matrix.shape))
        return solve(matrix, rhs, **kwargs)

    monkeypatch.setattr(torch.linalg, "solve_triangular", recording_solve)
    values = torch.randn(1, 32768, 2)
    merged = merge_values(values, torch.ones(1, 32768), torch.zeros(1, 32768))
    assert {shape[-2:] for shape in systems} == {(64, 64)} and max(shape[1] for shape in systems) == 64
    assert sum(shape[1] for shape in systems) == math.ceil((32768 - 3277) / 64)  # from start = 3277 on
    assert torch.isfinite(merged).all() and not torch.equal(merged, values)
