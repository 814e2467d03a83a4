"""The stacked, host-planned construction against a plain per-head loop written here from
reskv.md: kept sets, residual sizes and entries equal bit for bit on CPU fp32.

The plain loop takes each layer and KV head alone: the base method's scores and budgets, the
residual size the construction chose (checked apart: the same sizes whether layers are compressed
one by one or stacked, and against the float64 reference of tests/test_proxy.py there), then
``M = P ∪ Top_{m-|P|}`` by a Python sort with ties toward the lower position, the evicted tokens
in score order, and Lloyd's k-means on them with the arithmetic reskv.md names (squared distance as
``||c||² - 2<p, c>`` in fp32, the first ``r`` evicted keys as centres, 4 steps, empty clusters
dropped).
"""

from __future__ import annotations

import math

import pytest
import torch

import reskv.compress
import reskv.residual
from baselines import build_method, build_scorer
from reskv.compress import compress_layer, compress_layers
from reskv.config import ResidualConfig, budget_for
from reskv.engine import Prefill
from reskv.residual import build_residual
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone

PROMPT_LENGTH = 300


@pytest.fixture(scope="module", params=["aware", "agnostic"])
def observations(request):
    """Every layer of a tiny GQA model (6 query heads, 2 KV heads) after a prompt whose question is its
    last 20 tokens: the whole prompt (query-aware) or the context (query-agnostic)."""
    prefill = Prefill(
        cached_tiny_backbone("tiny-qwen2", 6, 2),
        random_prompt(TOKENS, PROMPT_LENGTH, seed=5),
        PROMPT_LENGTH - 20,
        [build_method("h2o", 0.5)],
    )
    return prefill.observations(request.param)


def plain_order(scores: list[float], positions: list[int]) -> list[int]:
    """``positions`` by descending score, ties toward the lower position."""
    return sorted(positions, key=lambda position: (-scores[position], position))


def plain_kept(scores: list[float], seq_len: int, window: int, main_size: int) -> list[int]:
    """``M = P ∪ Top_{m-|P|}``; a head whose ``m`` is below the window keeps its last ``m`` tokens."""
    window = min(window, seq_len)
    main_size = min(max(main_size, 0), seq_len)
    recent = list(range(seq_len - min(window, main_size), seq_len))
    top = plain_order(scores, list(range(seq_len - window)))[: max(main_size - window, 0)]
    return sorted(top + recent)


def plain_entries(keys, values, points: list[int], size: int, iterations: int = 4):
    """Lloyd's k-means of one head's evicted ``points`` (score order) into ``min(size, |E|)`` entries:
    mean keys, mean values and log-counts of the non-empty clusters, in centre order."""
    size = min(size, len(points))
    point_keys, point_values = keys[points].float(), values[points].float()
    centers = point_keys[:size]
    for _ in range(iterations):
        norms = (centers * centers).sum(-1)
        distances = torch.baddbmm(norms[None, None], point_keys[None], centers.T[None], alpha=-2)[0]
        nearest = distances.argmin(-1)
        sums = torch.zeros(size, keys.shape[-1]).index_add_(0, nearest, point_keys)
        counts = torch.zeros(size).index_add_(0, nearest, torch.ones(len(points)))
        centers = torch.where(counts[:, None] > 0, sums / counts.clamp(min=1)[:, None], centers)
    value_sums = torch.zeros(size, keys.shape[-1]).index_add_(0, nearest, point_values)
    used = counts > 0
    return sums[used] / counts[used, None], value_sums[used] / counts[used, None], counts[used].log()


def assert_equals_plain_loop(observations, states, scorer, ratio, sizes):
    seq_len = observations[0].seq_len
    budget = budget_for(seq_len, ratio)
    for obs, state, layer_sizes in zip(observations, states, sizes, strict=True):
        scores = scorer.prompt_scores(obs)
        budgets = scorer.head_budgets(scores, budget).tolist()
        for head in range(obs.num_kv_heads):
            head_scores = scores[head].tolist()
            kept = plain_kept(head_scores, seq_len, scorer.window, budgets[head] - layer_sizes[head])
            assert state.kept[head].nonzero().flatten().tolist() == kept
            assert torch.equal(state.main_keys[head, : len(kept)], obs.keys[head, kept])
            evicted = plain_order(head_scores, sorted(set(range(seq_len)) - set(kept)))
            used = torch.isfinite(state.residual.log_counts[head])
            if layer_sizes[head] == 0:
                assert not used.any()
                continue
            keys, values, log_counts = plain_entries(
                obs.keys[head], obs.values[head], evicted, layer_sizes[head]
            )
            assert torch.equal(state.residual.keys[head, used], keys)
            assert torch.equal(state.residual.values[head, used], values)
            assert torch.equal(state.residual.log_counts[head, used], log_counts)


@pytest.mark.parametrize("ratio", [0.5, 0.6, 0.9])
@pytest.mark.parametrize("base", ["snapkv", "adakv", "tova", "h2o"])
def test_stacked_construction_equals_the_plain_per_head_loop(observations, base, ratio):
    """All layers compressed together give each head the kept set and entries of the plain loop,
    and the residual sizes each layer gets when compressed alone. At ratio 0.9 the 300-token prompt
    leaves ``b = 30`` slots, below SnapKV's 64-token window: the fallback keeps the last ``b``
    tokens and no candidate is admissible."""
    scorer, config = build_scorer(base), ResidualConfig()
    states = compress_layers(observations, scorer, ratio, config)
    alone = [compress_layer(obs, scorer, ratio, config).stats["residual_slots"] for obs in observations]
    sizes = [state.stats["residual_slots"] for state in states]
    assert sizes == alone
    if ratio < 0.9:
        assert max(map(max, sizes)) > 0  # entries are there to compare
    assert_equals_plain_loop(observations, states, scorer, ratio, sizes)


@pytest.mark.parametrize("tolerance", [1.0, math.inf], ids=["equal-sizes-only", "one-group-per-level"])
def test_how_ragged_rows_are_grouped_changes_no_bit(observations, tolerance, monkeypatch):
    """AdaKV's ragged heads clustered one group per size (tolerance 1) or all rows of a grid level
    padded into one group give the plain loop's entries alike."""
    monkeypatch.setattr(reskv.residual, "CPU_PADDING_TOLERANCE", tolerance)
    scorer, config = build_scorer("adakv"), ResidualConfig()
    states = compress_layers(observations, scorer, 0.5, config)
    sizes = [state.stats["residual_slots"] for state in states]
    assert any(len(set(layer_sizes)) > 1 for layer_sizes in sizes)
    assert_equals_plain_loop(observations, states, scorer, 0.5, sizes)


def test_ragged_adakv_budgets_are_planned_per_head(observations):
    """AdaKV's heads hold different budgets, so their main caches and entries are ragged."""
    states = compress_layers(observations, build_scorer("adakv"), 0.5, ResidualConfig())
    assert any(len(set(state.stats["main_slots"])) > 1 for state in states)
    assert any(len(set(state.stats["residual_slots"])) > 1 for state in states)


def test_fixed_sizes_without_validation_equal_the_plain_loop(observations):
    config = ResidualConfig(validate=False)
    scorer, ratio = build_scorer("snapkv"), 0.6
    states = compress_layers(observations, scorer, ratio, config)
    budget = budget_for(observations[0].seq_len, ratio)
    expected = math.floor(config.fixed_ratio * budget + 0.5)
    assert all(state.stats["residual_slots"] == [expected] * 2 for state in states)
    assert_equals_plain_loop(observations, states, scorer, ratio, [[expected] * 2] * len(observations))


def test_cam_merges_values_of_the_plain_kept_set(observations):
    """CaM (no residual): its main cache holds the merged values of SnapKV's kept set, layer by layer."""
    cam, snap = build_scorer("cam"), build_scorer("snapkv")
    for obs, state in zip(observations, compress_layers(observations, cam, 0.7), strict=True):
        kept = state.kept
        assert torch.equal(kept, compress_layer(obs, snap, 0.7).kept)
        merged = cam.adjust_values(obs)
        for head in range(obs.num_kv_heads):
            positions = kept[head].nonzero().flatten()
            assert torch.equal(state.main_values[head, : len(positions)], merged[head, positions])


def test_more_entries_than_evicted_tokens_and_empty_clusters_equal_the_plain_loop():
    """``r > |E|`` caps at ``|E|``: head 1's 6 evicted tokens are its centres, two of them one key,
    so that centre ends empty and is dropped (5 entries)."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 40, 8, generator=generator)
    keys[:, 10] = keys[:, 11]  # the two best-scored evicted keys of each head are one key
    values = torch.randn(2, 40, 8, generator=generator)
    scores = torch.rand(2, 40, generator=generator)
    scores[:, 10], scores[:, 11] = 2.0, 1.9
    evicted = torch.zeros(2, 40, dtype=torch.bool)
    evicted[0, 5:30] = True  # 25 points
    evicted[1, 8:14] = True  # 6 points, fewer than r
    sizes = torch.tensor([7, 9])
    entries = build_residual(keys, values, evicted, scores, sizes, iterations=4)
    for head in range(2):
        points = plain_order(scores[head].tolist(), evicted[head].nonzero().flatten().tolist())
        expected_keys, expected_values, log_counts = plain_entries(
            keys[head], values[head], points, int(sizes[head])
        )
        used = torch.isfinite(entries.log_counts[head])
        assert int(used.sum()) == len(log_counts) == (5 if head == 1 else len(log_counts))
        assert torch.equal(entries.keys[head, used], expected_keys)
        assert torch.equal(entries.values[head, used], expected_values)
        assert torch.equal(entries.log_counts[head, used], log_counts)


@pytest.mark.parametrize(("sizes", "seed"), [((7, 8), 3), ((6, 8), 3), ((7, 9), 4)])
def test_rows_of_a_few_centres_beside_wider_ones_equal_the_plain_loop(sizes, seed):
    """On CPU MKL computes a product of fewer than ``CPU_NARROWEST_PADDED_WIDTH`` columns in column
    blocks whose sums round differently at another width, so a row of 7 centres padded to its
    group's 8 could give a point another of two tied centres than its own k-means gives. Every
    point here ties: each head's keys come in identical pairs, so most centres have a twin. (With
    these seeds and sizes, padding rows together picks two tied centres differently.)"""
    generator = torch.Generator().manual_seed(seed)
    twins = torch.randn(2, 40, 64, generator=generator) * 3
    keys = torch.cat([twins, twins], dim=1)  # key p and key p + 40 are one key
    values = torch.randn(2, 80, 64, generator=generator)
    scores = torch.rand(2, 80, generator=generator)
    evicted = torch.ones(2, 80, dtype=torch.bool)
    entries = build_residual(keys, values, evicted, scores, torch.tensor(sizes), iterations=4)
    for head in range(2):
        points = plain_order(scores[head].tolist(), list(range(80)))
        expected_keys, expected_values, log_counts = plain_entries(
            keys[head], values[head], points, sizes[head]
        )
        used = torch.isfinite(entries.log_counts[head])
        assert torch.equal(entries.keys[head, used], expected_keys)
        assert torch.equal(entries.values[head, used], expected_values)
        assert torch.equal(entries.log_counts[head, used], log_counts)


def test_padded_groups_keep_rows_of_a_few_centres_with_their_own_size_on_cpu():
    """Sizes 20 and 18 pad together (2 x 20 x 100 slots for 3,800 distances: within 1.25); 11, 10 and 9
    are below ``CPU_NARROWEST_PADDED_WIDTH``, so each size is a group of its own on CPU. On CUDA rows
    this small pad far less than ``CUDA_PADDING_SLACK``: one group."""
    sizes, points = [10, 20, 9, 11, 18, 10], [100] * 6
    cpu = reskv.residual.padded_groups(list(range(6)), sizes, points, torch.device("cpu"))
    assert [group.rows for group in cpu] == [[1, 4], [3], [0, 5], [2]]
    assert [(group.max_size, group.equal_sizes) for group in cpu] == [
        (20, False),
        (11, True),
        (10, True),
        (9, True),
    ]
    cuda = reskv.residual.padded_groups(list(range(6)), sizes, points, torch.device("cuda"))
    assert [group.rows for group in cuda] == [[1, 4, 3, 0, 5, 2]]


@pytest.mark.parametrize(("narrow", "groups"), [(100, [[0, 1]]), (99, [[0], [1]])])
def test_padded_groups_on_cuda_pad_at_most_the_slack(narrow, groups):
    """On CUDA a group pads at most ``CUDA_PADDING_SLACK`` (2e7) points x centres: rows of 600 and 100
    centres over 40,000 points each pad 2 x 600 x 40,000 - (600 + 100) x 40,000 = 2e7, one group; 600
    and 99 pad 2.004e7, two."""
    found = reskv.residual.padded_groups([0, 1], [600, narrow], [40_000] * 2, torch.device("cuda"))
    assert [group.rows for group in found] == groups


@pytest.mark.parametrize(
    ("fewest", "capacity", "groups"),
    [
        (600_000, 3_000_000, [[1, 0, 2]]),
        (599_999, 3_000_000, [[1, 0], [2]]),
        (600_000, 2_999_999, [[1, 0], [2]]),
    ],
)
def test_padded_groups_where_the_kernel_skips_padding_pad_points_within_the_slack_and_capacity(
    fewest, capacity, groups
):
    """Where the nearest-centre kernel skips each row's padding (a ``point_capacity`` given), centres
    pad freely and points up to ``CUDA_PADDED_POINTS_SLACK`` (400,000), a group holding at most the
    capacity: sizes 100, 600 and 5 over 1,000,000, 1,000,000 and 600,000 points, taken largest size
    first, hold 3 x 1,000,000 points and pad 400,000, one group, though their padded distances
    (600 x 3e6 - 7.03e8) are far beyond ``CUDA_PADDING_SLACK``, where each row goes alone; with
    599,999 points the third pads 400,001, and within 2,999,999 points the three do not fit."""
    sizes, points = [100, 600, 5], [1_000_000, 1_000_000, fewest]
    found = reskv.residual.padded_groups([0, 1, 2], sizes, points, torch.device("cuda"), capacity)
    assert [group.rows for group in found] == groups
    padded = reskv.residual.padded_groups([0, 1, 2], sizes, points, torch.device("cuda"))
    assert [group.rows for group in padded] == [[1], [0], [2]]


def test_levels_group_apart_unless_the_kernel_skips_padding(monkeypatch):
    """``level_row_groups``: two levels of sizes 20 and 5 over 100 points each are split apart without
    the kernel (CPU, or CUDA without it) and clustered together with it, within its capacity
    (``padding_free_capacity``: every row's points and the distance block's worth)."""
    keys = torch.zeros(4, 100, 8)
    levels, sizes, points = [[0, 1], [2, 3]], [20, 20, 5, 5], [100] * 4
    apart = reskv.residual.level_row_groups(levels, sizes, points, keys)
    assert [group.rows for group in apart] == [[0, 1], [2, 3]]
    monkeypatch.setattr(reskv.residual, "nearest_skips_padding", lambda keys: True)
    assert reskv.residual.padding_free_capacity(keys) == 4 * 100 + (4 << 20) // (4 * 8)
    together = reskv.residual.level_row_groups(levels, sizes, points, keys)
    assert [(group.rows, group.max_size, group.equal_sizes) for group in together] == [
        ([0, 1, 2, 3], 20, False)
    ]


def test_rows_the_lloyd_kernel_clusters_group_by_its_scratch(monkeypatch):
    """Where ``reskv.lloyd_kernel`` clusters (``fused_lloyd_form``), levels group together while what a
    group holds (rows x largest size x the bytes of a centre) fits the capacity's points of d fp32,
    whatever their padding: keys [4, 100, 8] give (4 x 100 + 4 MiB / 32) x 8 = 1,051,776 fp32
    (4,207,104 bytes). A centre holds, in bf16x3, its cluster's key and value sums and count (2 x 8 + 1
    fp32), itself and its norm (8 + 1 fp32) and its split (3 x 8 bf16): 152 bytes, 7,600 a row of size
    50. So such rows group 553 at a time, here 1,000 rows of two levels (sizes 50 and 3, points 100 and
    3,000, 997 padded points each) as 553 and 447, largest size first."""
    keys = torch.zeros(4, 100, 8)
    monkeypatch.setattr(reskv.residual, "fused_lloyd_form", lambda keys: "bf16x3")
    levels = [list(range(500)), list(range(500, 1000))]
    sizes, points = [50] * 500 + [3] * 500, [100] * 500 + [3_000] * 500
    found = reskv.residual.level_row_groups(levels, sizes, points, keys)
    assert [len(group.rows) for group in found] == [553, 447]
    assert found[0].rows == list(range(500)) + list(range(500, 553))
    assert [(group.max_size, group.max_points, group.equal_sizes) for group in found] == [
        (50, 3_000, False),
        (3, 3_000, True),
    ]


def test_final_levels_of_stacked_configurations_group_as_each_alone(monkeypatch):
    """``reskv.compress.level_groups`` of two configurations of 2 rows each, stacked (a grid's ratios'
    final caches clustered at once): on CPU a level is a (configuration, grid level), so each
    configuration's rows group as alone, though both have a row at grid level 0.1 (budgets 150 and 160:
    r = 15 and 16, within the CPU's padding tolerance of each other, which one level's rows would
    share); where the kernel skips padding every row with entries joins one group."""
    keys = torch.zeros(2, 100, 8)
    grid = (0.0, 0.1, 0.2)
    # by hand: r = floor(0.1 b + 0.5) at b = 150, 160 is 15, 16; at 0.2 and b = 150, 30
    sizes, budgets, points = [15, 30, 16, 0], [150, 150, 160, 160], [60, 70, 60, 60]
    found = reskv.compress.level_groups(sizes, points, budgets, grid, keys, rows_each=2)
    assert [group.rows for group in found] == [[0], [1], [2]]
    monkeypatch.setattr(reskv.residual, "nearest_skips_padding", lambda keys: True)
    together = reskv.compress.level_groups(sizes, points, budgets, grid, keys, rows_each=2)
    assert [group.rows for group in together] == [[1, 2, 0]]


def test_nested_families_are_one_heads_rows_whose_centres_and_points_end_alike():
    """``reskv.residual.nested_families`` by hand: rows (head, offset, size, count) whose ``offset +
    size`` and ``offset + count`` agree within a head, by increasing size; a head of its own, or ends of
    their own, leave a row in none."""
    heads = [0, 0, 1, 0, 1, 0, 1]
    offsets = [10, 5, 5, 0, 8, 10, 5]
    sizes = [5, 10, 10, 15, 7, 6, 10]
    counts = [80, 85, 85, 90, 82, 80, 84]  # ends (15, 90) but rows 5 (16, 90) and 6 (15, 89)
    found = reskv.residual.nested_families(list(range(7)), heads, offsets, sizes, counts)
    assert found == [[0, 1, 3], [4, 2]]


def test_the_lloyd_kernels_groups_keep_a_family_whole(monkeypatch):
    """``scratch_groups`` with a family: 552 rows of size 50 and a family of sizes 10, 30 and 50 over the
    capacity of ``test_rows_the_lloyd_kernel_clusters_group_by_its_scratch`` (553 rows of size 50 a
    group). Alone, the family's largest would join the first group and the two others the second;
    with it, the family goes whole to the second, largest first."""
    keys = torch.zeros(4, 100, 8)
    monkeypatch.setattr(reskv.residual, "fused_lloyd_form", lambda keys: "bf16x3")
    sizes, points = [50] * 552 + [10, 30, 50], [100] * 555
    rows = list(range(555))
    apart = reskv.residual.scratch_groups(rows, sizes, points, keys)
    assert [group.rows for group in apart] == [[*range(552), 554], [553, 552]]
    together = reskv.residual.scratch_groups(rows, sizes, points, keys, [[552, 553, 554]])
    assert [group.rows for group in together] == [list(range(552)), [554, 553, 552]]
    assert [group.max_size for group in together] == [50, 50]
