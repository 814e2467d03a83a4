"""The invariants listed at the end of reskv.md, one test each, on tiny Llama and Qwen2 layers
with GQA group sizes 1 and > 1 (prefilled for real, so keys, values and queries are a model's)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import reskv.residual
from baselines import build_method, build_scorer
from reskv.compress import ResidualConfig, budget_for, compress_layer
from reskv.decode_rule import DecodeRule
from reskv.engine import Prefill
from reskv.method import Method, attended_slots
from reskv.residual import (
    build_residual,
    cluster_sums,
    first_minimum,
    flat_cluster_index,
    nearest_centers,
    row_offsets,
    sorted_cluster_sums,
)
from reskv.scoring import LayerObservation
from scripts.bench.engine import kmeans_peak_memory
from scripts.measure import random_prompt
from tests.conftest import TOKENS, interpreted, separate_attention, state_attention

PROMPT_LENGTH = 300
NO_GATE = DecodeRule(gate=False)


@pytest.fixture
def prefill(tiny) -> Prefill:
    methods = [build_method("h2o", 0.5)]  # capture H2O statistics too
    return Prefill(tiny, random_prompt(TOKENS, PROMPT_LENGTH, seed=0), PROMPT_LENGTH - 20, methods)


@pytest.fixture
def observation(prefill) -> LayerObservation:
    return prefill.prefilled("agnostic").cache.layers[1].observation(1, prefill.scaling)


def decode_queries(obs: LayerObservation, count: int = 3, seed: int = 1) -> torch.Tensor:
    """Fresh grouped queries ``[H_kv, G*count, d]`` at the prompt's scale."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(obs.queries.shape[0], count, obs.keys.shape[-1], generator=generator)
    return (queries * obs.queries.std()).reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])


def full_attention(queries: torch.Tensor, obs: LayerObservation) -> torch.Tensor:
    probs = (queries @ obs.keys.transpose(1, 2) * obs.scaling).softmax(dim=-1)
    return probs @ obs.values


def residual_output(queries, obs, kept, residual, rule=NO_GATE):
    """ResKV output with the main cache given as a kept mask over the prompt (masked, not gathered)."""
    bias = torch.zeros(kept.shape).masked_fill(~kept, float("-inf"))[:, None, :]
    return separate_attention(
        queries,
        obs.keys,
        obs.values,
        bias,
        residual.keys,
        residual.values,
        residual.log_counts,
        obs.scaling,
        rule,
        (~kept).sum(-1) / obs.seq_len,
    )


def test_1_budget_covering_the_prompt_is_the_full_cache(prefill, observation):
    """``b = floor(s (1 - rho)) < s`` for every ratio in (0, 1): only ratio 0 covers the prompt."""
    assert budget_for(observation.seq_len, 0.0) == observation.seq_len
    assert budget_for(observation.seq_len, 0.001) == observation.seq_len - 1
    method = Method("snapkv+reskv", 0.0, build_scorer("snapkv"), ResidualConfig())
    assert compress_layer(observation, method.scorer, 0.0, method.residual) is None
    compressed = prefill.generate(method, "agnostic", max_new_tokens=6)
    full = prefill.generate(build_method("full"), "agnostic", max_new_tokens=6)
    assert compressed.token_ids == full.token_ids
    assert compressed.cache_stats["compressed"] is False


@pytest.mark.parametrize("base", ["h2o", "tova", "snapkv", "adakv"])
def test_2_residual_off_everywhere_is_the_base_method(prefill, base):
    plain = build_method(base, 0.7)
    off = build_method(f"{base}+reskv", 0.7, residual=ResidualConfig(grid=(0.0,)))
    plain_cache, _ = plain.compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    off_cache, stats = off.compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    for plain_layer, off_layer in zip(plain_cache.layers, off_cache.layers, strict=True):
        assert torch.equal(plain_layer.keys, off_layer.keys)
        assert torch.equal(plain_layer.values, off_layer.values)
        assert off_layer.residual.keys.shape[1] == 0
    assert all(entries == 0 for layer in stats["residual_entries"] for entries in layer)
    for setting in ("aware", "agnostic"):
        assert prefill.generate(plain, setting, 5).token_ids == prefill.generate(off, setting, 5).token_ids


def grouped_evicted_side(obs: LayerObservation, groups: int, members: int):
    """Make the first ``groups * members`` tokens groups of identical keys (values stay distinct);
    return the modified observation, the kept mask (everything else) and scores whose top
    evicted tokens are one per group."""
    keys = obs.keys.clone()
    evicted = torch.zeros(obs.num_kv_heads, obs.seq_len, dtype=torch.bool)
    evicted[:, : groups * members] = True
    for group in range(groups):
        start = group * members
        keys[:, start : start + members] = keys[:, start : start + 1]
    scores = torch.zeros(obs.num_kv_heads, obs.seq_len)
    scores[:, : groups * members : members] = 1.0  # the first member of each group ranks first
    return dataclasses.replace(obs, keys=keys), ~evicted, scores


def test_3_identical_member_keys_reconstruct_full_attention(observation):
    groups, members = 6, 5
    obs, kept, scores = grouped_evicted_side(observation, groups, members)
    sizes = torch.full((obs.num_kv_heads,), groups)
    residual = build_residual(obs.keys, obs.values, ~kept, scores, sizes, iterations=4)
    assert torch.equal(residual.log_counts, torch.full_like(residual.log_counts, math.log(members)))
    queries = decode_queries(obs)
    torch.testing.assert_close(
        residual_output(queries, obs, kept, residual), full_attention(queries, obs), rtol=1e-5, atol=1e-6
    )


def test_3_duplicate_top_scored_centre_ends_empty_and_is_dropped(observation):
    """``r = groups + 1`` with two top-scored copies of group 0's key: the second centre ties with
    the first on every point, loses (lower index wins), ends empty and is dropped; the remaining
    entries still reconstruct full attention exactly."""
    groups, members = 4, 3
    obs, kept, scores = grouped_evicted_side(observation, groups, members)
    scores[:, 1] = 1.0
    sizes = torch.full((obs.num_kv_heads,), groups + 1)
    residual = build_residual(obs.keys, obs.values, ~kept, scores, sizes, iterations=4)
    assert residual.entries_per_head.tolist() == [groups] * obs.num_kv_heads
    assert torch.isinf(residual.log_counts[:, 1]).all()
    queries = decode_queries(obs)
    torch.testing.assert_close(
        residual_output(queries, obs, kept, residual), full_attention(queries, obs), rtol=1e-5, atol=1e-6
    )


def test_4_singleton_clusters_are_exact_attention_over_main_and_residual(observation):
    obs = observation
    kept = torch.ones(obs.num_kv_heads, obs.seq_len, dtype=torch.bool)
    kept[:, 10:40] = False  # |E| = 30, r = |E|: every evicted token is its own entry
    scores = torch.rand(obs.num_kv_heads, obs.seq_len, generator=torch.Generator().manual_seed(3))
    residual = build_residual(obs.keys, obs.values, ~kept, scores, torch.full((obs.num_kv_heads,), 30), 4)
    assert torch.equal(residual.log_counts, torch.zeros_like(residual.log_counts))
    queries = decode_queries(obs)
    torch.testing.assert_close(
        residual_output(queries, obs, kept, residual), full_attention(queries, obs), rtol=1e-5, atol=1e-6
    )


def with_dtype(obs: LayerObservation, dtype: torch.dtype) -> LayerObservation:
    return dataclasses.replace(
        obs, keys=obs.keys.to(dtype), values=obs.values.to(dtype), queries=obs.queries.to(dtype)
    )


# b = 140 of the 280-token context, r = 28: main 112 >= the 64-token window, so entries exist.
WITH_ENTRIES = dict(ratio=0.5, residual=ResidualConfig(validate=False, fixed_ratio=0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_5_shared_softmax_equals_the_lse_merge(observation, dtype):
    """One softmax over [main ; residual] logits in float64, per query head with its own gate,
    against ``joint_attention``'s single normalisation (invariants 5 and 11; the LSE-merge form is
    pinned in ``test_fast_paths``)."""
    obs = with_dtype(observation, dtype)
    rule = WITH_ENTRIES["residual"]
    state = compress_layer(obs, build_scorer("snapkv"), WITH_ENTRIES["ratio"], rule)
    assert int(state.residual.entries_per_head.min()) > 0
    queries = decode_queries(obs, count=4).to(dtype)
    merged = state_attention(state, queries, obs.scaling, rule)
    for kv_head in range(obs.num_kv_heads):
        for row in range(queries.shape[1]):  # every query head of the group, every query
            query = queries[kv_head, row].double()
            main_logits = state.main_keys[kv_head].double() @ query * obs.scaling
            peak = main_logits.softmax(dim=-1).max()
            gate = max(rule.g_min, torch.sigmoid(rule.alpha * (rule.tau - peak)).item())
            residual_logits = (
                state.residual.keys[kv_head].double() @ query * obs.scaling
                + state.residual.log_counts[kv_head].double()
                + math.log(gate)
            )
            weights = torch.cat([main_logits, residual_logits]).softmax(dim=-1)
            values = torch.cat([state.main_values[kv_head], state.residual.values[kv_head]]).double()
            torch.testing.assert_close(merged[kv_head, row].double(), weights @ values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.6, 0.9])
@pytest.mark.parametrize(
    "name",
    ["h2o", "tova", "snapkv", "adakv", "cam", "h2o+reskv", "tova+reskv", "snapkv+reskv", "adakv+reskv"],
)
def test_6_slots_never_exceed_the_budget(prefill, name, ratio):
    check_budget(prefill, build_method(name, ratio), ratio)


@pytest.mark.parametrize("base", ["h2o", "tova", "snapkv", "adakv"])
def test_6_slots_never_exceed_the_budget_with_entries(prefill, base):
    method = build_method(f"{base}+reskv", WITH_ENTRIES["ratio"], residual=WITH_ENTRIES["residual"])
    stats = check_budget(prefill, method, WITH_ENTRIES["ratio"])
    assert min(min(layer) for layer in stats["residual_entries"]) > 0


def check_budget(prefill, method, ratio) -> dict:
    """Per layer and head: attended = main + used entries <= main + reserved = b (AdaKV: H_kv b)."""
    layers = method.compressed_layers(prefill.prefilled("agnostic").cache, prefill.scaling)
    cache, stats = method.assemble(layers, prefill.context_length)
    budget = budget_for(prefill.context_length, ratio)
    assert stats["budget"] == budget
    assert attended_slots(layers) == cache.slots()  # the host's counts are what the device holds
    for slots, main, entries, reserved in zip(
        cache.slots(), stats["main_slots"], stats["residual_entries"], stats["residual_slots"], strict=True
    ):
        assert slots == [
            m + e for m, e in zip(main, entries, strict=True)
        ]  # attended slots: main + used entries
        assert all(
            e <= r for e, r in zip(entries, reserved, strict=True)
        )  # dropped clusters leave slots unused
        allocated = [m + r for m, r in zip(main, reserved, strict=True)]
        if method.scorer.budget_scope == "head":  # uneven heads, exact layer total
            assert sum(allocated) == budget * len(allocated)
        else:
            assert (method.scorer.budget_scope, allocated) == ("uniform", [budget] * len(allocated))
    return stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_7_no_nan_or_inf(observation, dtype):
    obs = with_dtype(observation, dtype)
    state = compress_layer(obs, build_scorer("snapkv"), WITH_ENTRIES["ratio"], WITH_ENTRIES["residual"])
    assert int(state.residual.entries_per_head.min()) > 0  # invariant 11
    queries = decode_queries(obs).to(dtype)
    closed_gate = DecodeRule(alpha=1e6, g_min=0.0)  # gate exactly 0 unless the main peak is below tau
    for rule in (WITH_ENTRIES["residual"], closed_gate):
        output = state_attention(state, queries, obs.scaling, rule)
        assert torch.isfinite(output).all()
    # Empty evicted side, and r larger than |E|.
    everything = torch.ones(obs.num_kv_heads, obs.seq_len, dtype=torch.bool)
    none = build_residual(
        obs.keys, obs.values, ~everything, torch.rand(everything.shape), torch.full((obs.num_kv_heads,), 5), 4
    )
    assert none.keys.shape[1] == 0
    kept = everything.clone()
    kept[:, :3] = False
    capped = build_residual(
        obs.keys, obs.values, ~kept, torch.rand(kept.shape), torch.full((obs.num_kv_heads,), 10), 4
    )
    assert capped.entries_per_head.tolist() == [3] * obs.num_kv_heads
    assert torch.isfinite(
        residual_output(queries.float(), with_dtype(obs, torch.float32), kept, capped)
    ).all()


def test_7_closed_gate_gives_exactly_the_main_only_output(observation):
    obs = observation
    kept = torch.ones(obs.num_kv_heads, obs.seq_len, dtype=torch.bool)
    kept[:, :50] = False
    residual = build_residual(
        obs.keys, obs.values, ~kept, torch.rand(kept.shape), torch.full((obs.num_kv_heads,), 8), 4
    )
    closed = DecodeRule(tau=-1.0, alpha=1e6, g_min=0.0)  # sigmoid(-huge) == 0: log g = -inf
    empty = dataclasses.replace(
        residual,
        keys=residual.keys[:, :0],
        values=residual.values[:, :0],
        log_counts=residual.log_counts[:, :0],
    )
    queries = decode_queries(obs)
    assert torch.equal(
        residual_output(queries, obs, kept, residual, closed),
        residual_output(queries, obs, kept, empty, closed),
    )


def test_8_deterministic_bit_for_bit(prefill):
    method = build_method("adakv+reskv", 0.8)
    first, first_stats = method.compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    second, second_stats = method.compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    assert first_stats == second_stats
    for a, b in zip(first.layers, second.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.residual.keys, b.residual.keys)
        assert torch.equal(a.residual.log_counts, b.residual.log_counts)
    assert (
        prefill.generate(method, "agnostic", 6).token_ids == prefill.generate(method, "agnostic", 6).token_ids
    )


def test_scorers_are_shared_across_heads_as_gqa_requires(observation):
    """Scores live at KV-head granularity (reskv.md, GQA): one row per KV head."""
    for base in ("h2o", "tova", "snapkv", "adakv", "cam"):
        assert build_scorer(base).prompt_scores(observation).shape == (
            observation.num_kv_heads,
            observation.seq_len,
        )


@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0])
def test_10_unused_slots_get_no_mass_whatever_beta(observation, beta):
    """Head 0 gets 5 slots over 4 groups of identical keys with a duplicate top-scored centre (it
    ends empty, as in invariant 3), the other heads 2 slots (3 padded): the output equals a float64
    softmax over the used slots only."""
    obs, kept, scores = grouped_evicted_side(observation, groups=4, members=3)
    scores[:, 1] = 1.0
    sizes = torch.tensor([5] + [2] * (obs.num_kv_heads - 1))
    residual = build_residual(obs.keys, obs.values, ~kept, scores, sizes, 4)
    assert residual.entries_per_head.tolist() == [4] + [2] * (obs.num_kv_heads - 1)
    assert int((~torch.isfinite(residual.log_counts)).sum(-1).min()) > 0  # unused slots in every head
    rule = DecodeRule(beta=beta)
    queries = decode_queries(obs)
    output = residual_output(queries, obs, kept, residual, rule)
    assert torch.isfinite(output).all()
    for head in range(obs.num_kv_heads):
        used = torch.isfinite(residual.log_counts[head])
        main_keys, main_values = obs.keys[head, kept[head]].double(), obs.values[head, kept[head]].double()
        for row in range(queries.shape[1]):
            query = queries[head, row].double()
            main_logits = main_keys @ query * obs.scaling
            peak = float(main_logits.softmax(-1).max())
            gate = 1 / (1 + math.exp(-rule.alpha * (rule.tau - peak)))
            residual_logits = (
                residual.keys[head, used].double() @ query * obs.scaling
                + beta * residual.log_counts[head, used].double()
                + math.log(gate)
            )
            weights = torch.cat([main_logits, residual_logits]).softmax(-1)
            expected = weights @ torch.cat([main_values, residual.values[head, used].double()])
            torch.testing.assert_close(output[head, row].double(), expected, rtol=1e-5, atol=1e-6)


def test_budget_is_exact_on_the_decimal_ratio():
    assert budget_for(4000, 0.9) == 400
    assert math.floor(4000 * (1 - 0.9)) == 399  # what floating point gives
    float_misses = 0
    for hundredths in range(50, 100, 5):
        ratio = hundredths / 100  # 0.5, 0.55, ... 0.95 as the float a config holds
        for seq_len in range(1, 5001):
            expected = seq_len * (100 - hundredths) // 100  # integer arithmetic on the digits
            assert budget_for(seq_len, ratio) == expected, (seq_len, ratio)
            float_misses += math.floor(seq_len * (1 - ratio)) != expected
    assert float_misses > 0  # the sweep covers lengths where floating point is wrong


def plain_first_minimum(row: list[float]) -> int:
    """The first index holding the row's smallest value."""
    smallest = min(row)
    return next(index for index, value in enumerate(row) if value == smallest)


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 7, 5), (3, 40, 300)])
def test_first_minimum_is_the_first_index_of_each_rows_smallest_distance(shape):
    """Ties go to the lower index (the plain loop's first occurrence) and ``+inf`` centres (a padded
    row's) never win: small integers times a scale make ties in most rows."""
    generator = torch.Generator().manual_seed(sum(shape))
    distances = torch.randint(-3, 4, shape, generator=generator).float() * 0.37
    if shape[-1] > 2:
        distances[0, :, -2:] = float("inf")
    expected = [[plain_first_minimum(row) for row in block] for block in distances.tolist()]
    assert torch.equal(first_minimum(distances.clone()).long(), torch.tensor(expected))
    if shape[-1] > 2:
        assert any(row.count(min(row)) > 1 for block in distances.tolist() for row in block)


def test_distance_width_rounds_cpu_widths_from_twelve_up_to_eights():
    assert [reskv.residual.distance_width(r, torch.device("cpu")) for r in (1, 11, 12, 16, 17, 79, 395)] == [
        1,
        11,
        16,
        16,
        24,
        80,
        400,
    ]
    assert reskv.residual.distance_width(79, torch.device("cuda")) == 79


@pytest.mark.parametrize(
    ("num_centers", "second_row_centers"), [(11, 11), (12, 12), (16, 12), (59, 56), (79, 76)]
)
def test_nearest_centers_over_a_padded_width_are_the_plain_first_minimum(num_centers, second_row_centers):
    """Padding centres never win and leave the real centres' distances as computed at their own width
    (from 12 centres on: narrower rows are never padded, ``padded_groups``): each point gets the first
    of its nearest centres by the plain per-row product (as the spec's plain loop computes it) and a
    first-index scan. Every centre appears twice, so each point's minimum is a tie the lower index
    must win; the second row's last centres are its group's padding (bias ``+inf``)."""
    generator = torch.Generator().manual_seed(num_centers)
    points = torch.randn(2, 300, 64, generator=generator) * 3
    half = torch.randn(2, (num_centers + 1) // 2, 64, generator=generator) * 3
    centers = torch.cat([half, half], dim=1)[:, :num_centers]
    bias = torch.zeros(2, num_centers)
    bias[1, second_row_centers:] = float("inf")
    expected = []
    for row, real in enumerate((num_centers, second_row_centers)):
        own = centers[row, :real]
        norms = (own * own).sum(-1)
        distances = torch.baddbmm(norms[None, None], points[row][None], own.T[None], alpha=-2)[0]
        expected.append([plain_first_minimum(point) for point in distances.tolist()])
    assert torch.equal(nearest_centers(points, centers, 1 << 30, bias), torch.tensor(expected))


def integer_case(rows: int, num_points: int, num_centers: int, dim: int, seed: int) -> tuple:
    """Points and centres of small integers, so every distance is exact in fp32 whatever order the
    products sum in (the kernel's and the BLAS's alike) and equal distances are ties, not rounding.
    The centres are copies of a quarter as many distinct ones at random indices (in other tiles too
    when ``num_centers > 64``), so most points' nearest centre is tied; the last row's centres past
    three quarters are padding (``+inf``)."""
    generator = torch.Generator().manual_seed(seed)
    points = torch.randint(-3, 4, (rows, num_points, dim), generator=generator).float()
    distinct = torch.randint(-3, 4, (rows, max(2, num_centers // 4), dim), generator=generator).float()
    copies = torch.randint(0, distinct.shape[1], (rows, num_centers), generator=generator)
    centers = distinct.gather(1, copies[..., None].expand(-1, -1, dim))
    bias = torch.zeros(rows, num_centers)
    bias[-1, num_centers * 3 // 4 :] = float("inf")
    return points, centers, bias


def test_fused_nearest_kernel_gives_the_plain_loops_first_nearest_centre(tmp_path):
    """``reskv/nearest_kernel.py`` under Triton's interpreter on CPU: each point's index is the first
    of its nearest centres by exact integer distances (the spec's rule, ties to the lower index), and
    ``nearest_centers``' torch path's, in each product form (the bf16 split on TF32 operands, which the
    interpreter multiplies right). Ragged tiles (300 points, 70 centres: 64 + 6), centres repeated
    within and across tiles, padding centres, a head dim that is no power of two, fewer points and
    centres than a tile."""
    pytest.importorskip("triton")
    from reskv import nearest_kernel  # imports Triton

    cases = [integer_case(3, 300, 70, 64, 0), integer_case(2, 90, 17, 80, 1), integer_case(1, 10, 5, 16, 2)]
    inputs, expected, tied = [], [], []
    for points, centers, bias in cases:
        norms = (centers * centers).sum(-1) + bias
        inputs += [(points, centers, norms, form, "tf32") for form in nearest_kernel.PRECISIONS]
        integer_points, integer_centers = points.long(), centers.long()
        indices = []
        for row in range(points.shape[0]):
            distances = (integer_centers[row] ** 2).sum(-1) - 2 * integer_points[row] @ integer_centers[row].T
            distances = distances.double() + bias[row].double()
            indices.append([plain_first_minimum(point) for point in distances.tolist()])
            tied += [point.count(min(point)) > 1 for point in distances.tolist()]
        expected += [torch.tensor(indices)] * len(nearest_kernel.PRECISIONS)
        assert torch.equal(nearest_centers(points, centers, 1 << 30, bias), expected[-1])
    got = interpreted("reskv.nearest_kernel:nearest", inputs, tmp_path)  # each form on each case
    for fused, plain in zip(got, expected, strict=True):
        assert fused.dtype == torch.long and torch.equal(fused, plain)
    assert sum(tied) > len(tied) / 2  # most indices were decided by the tie rule


def test_fused_nearest_kernel_scans_only_each_row_s_own_points_and_centres(tmp_path):
    """Under Triton's interpreter, a group of two rows padded to 200 points and 40 centres, the second
    holding 10 points and 3 centres: given the rows' ``extents``, the second row's points take the
    nearest of its own 3 centres (by a plain loop over them) though its other 37 are nearer still
    (finite norms: scanned, they would win), its padding points in its first tile too, and those of
    the tiles wholly past its points (from point 64) index 0, no centre scanned; the first row as
    without extents. Integer values: every form's products are exact."""
    pytest.importorskip("triton")
    from reskv import nearest_kernel  # imports Triton

    generator = torch.Generator().manual_seed(4)
    points = torch.randint(-4, 5, (2, 200, 16), generator=generator).float()
    centers = torch.randint(-4, 5, (2, 40, 16), generator=generator).float()
    points[1, 10:] = 0  # the second row's padding
    centers[1, 3:] = points[1, :37]  # nearer to its points than any of its own 3
    centers[1, 0] = 4  # the largest norm of its own: the padding points do not take 0 by chance
    norms = (centers * centers).sum(-1)
    extents = (torch.tensor([200, 10]), torch.tensor([40, 3]))
    cases = [(points, centers, norms, form, "tf32", extents) for form in nearest_kernel.PRECISIONS]
    expected = torch.zeros(2, 200, dtype=torch.long)
    for row, (own_points, own_centers) in enumerate([(200, 40), (64, 3)]):
        for point in range(own_points):
            differences = points[row, point] - centers[row, :own_centers]
            expected[row, point] = plain_first_minimum((differences * differences).sum(-1).tolist())
    assert (nearest_centers(points, centers, 1 << 30)[1, :10] >= 3).all()  # the others would win
    for found in interpreted("reskv.nearest_kernel:nearest", cases, tmp_path):
        assert torch.equal(found, expected)
    assert expected[1, 10:64].ne(0).any()


def test_fused_nearest_kernels_bf16_split_keeps_fp32_centres_exact(tmp_path):
    """The kernel's ``"bf16x3"`` products under Triton's interpreter: on bf16-valued points and fp32
    centres (k-means means, not bf16 values), three bf16 products against the centres' exact split
    give each point the centre nearest by float64 distances, but at ties within fp32 rounding; one
    bf16 product of the rounded centres (the split's top part alone) does not. On the integer cases
    (the centres their own top part) it keeps the tie rule too."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(3)
    points = (torch.randn(2, 300, 64, generator=generator) * 3).bfloat16().float()
    # Centres near each other (means of overlapping clusters), where the low parts decide.
    centers = points[:, :40] + torch.randn(2, 40, 64, generator=generator) * 1e-2
    norms = (centers * centers).sum(-1)
    integer_points, integer_centers, bias = integer_case(3, 300, 70, 64, 0)
    integer_norms = (integer_centers * integer_centers).sum(-1) + bias
    # TF32 operands: the interpreter multiplies bf16 ones wrongly (reskv/nearest_kernel.py).
    cases = [
        (points, centers, norms, "bf16x3", "tf32"),
        (integer_points, integer_centers, integer_norms, "bf16x3", "tf32"),
    ]
    split, integer_split = interpreted("reskv.nearest_kernel:nearest", cases, tmp_path)
    assert torch.equal(integer_split, nearest_centers(integer_points, integer_centers, 1 << 30, bias))
    exact = (centers.double() ** 2).sum(-1)[:, None, :] - 2 * points.double() @ centers.double().transpose(
        1, 2
    )
    best = exact.amin(-1)
    gap = exact.gather(2, split[..., None])[..., 0] - best
    assert (gap <= 1e-6 * exact.abs().amax()).all()  # fp32 rounding of the distances, no more
    assert (split == exact.argmin(-1)).float().mean() > 0.99
    rounded = centers.bfloat16().float()
    one_product = (rounded * rounded).sum(-1)[:, None, :] - 2 * points @ rounded.transpose(1, 2)
    wrong_gap = exact.gather(2, one_product.argmin(-1)[..., None])[..., 0] - best
    assert (wrong_gap > 1e-6 * exact.abs().amax()).any()  # the low parts decide here


def test_sorted_cluster_sums_add_each_clusters_points_in_order_as_index_add_does():
    """CUDA's atomic-free cluster sums (``sorted_cluster_sums``) run on CPU too: each cluster's sum is
    its points added one by one in point order (a plain loop), bit for bit, as ``cluster_sums``'
    ``index_add_`` gives. Padding points are zero rows; the last cluster of each row is left empty."""
    generator = torch.Generator().manual_seed(5)
    rows, num_points, num_centers, dim = 3, 200, 17, 8
    points = torch.randn(rows, num_points, dim, generator=generator) * 10 ** torch.randn(rows, num_points, 1)
    points[1, 150:] = 0.0  # the second row's padding
    assignments = torch.randint(0, num_centers - 1, (rows, num_points), generator=generator)
    flat_index = flat_cluster_index(assignments, row_offsets(rows, num_centers, torch.device("cpu")))
    expected = torch.zeros(rows, num_centers, dim)
    for row in range(rows):
        for point in range(num_points):
            cluster = assignments[row, point]
            expected[row, cluster] = expected[row, cluster] + points[row, point]
    assert torch.equal(sorted_cluster_sums(points, flat_index, num_centers), expected)
    assert torch.equal(cluster_sums(points, flat_index, num_centers), expected)
    assert not expected[:, -1].any()


def test_kmeans_distance_chunks_give_the_unchunked_clustering(observation, monkeypatch):
    """Bit for bit: each chunk's distances are the same dot products, and argmin is per point."""
    obs = observation
    kept = torch.ones(obs.num_kv_heads, obs.seq_len, dtype=torch.bool)
    kept[:, :200] = False
    scores = torch.rand(kept.shape, generator=torch.Generator().manual_seed(7))
    sizes = torch.full((obs.num_kv_heads,), 20)
    whole = build_residual(obs.keys, obs.values, ~kept, scores, sizes, 4)
    points = obs.keys[:, :200].float()
    centers = points[:, :20]
    chunk_bytes = 4 * obs.num_kv_heads * 20 * 7  # 7 points per chunk: 29 chunks of 200 points
    assert torch.equal(
        nearest_centers(points, centers, chunk_bytes), nearest_centers(points, centers, 1 << 30)
    )
    monkeypatch.setattr(reskv.residual, "DISTANCE_CHUNK_BYTES", chunk_bytes)
    chunked = build_residual(obs.keys, obs.values, ~kept, scores, sizes, 4)
    assert int(whole.entries_per_head.min()) > 0
    assert torch.equal(chunked.keys, whole.keys) and torch.equal(chunked.values, whole.values)
    assert torch.equal(chunked.log_counts, whole.log_counts)


def test_adakv_padded_cache_equals_the_per_head_computation_after_appended_tokens(prefill):
    """Heads of uneven length are padded with masked slots; after appending tokens every head's
    output equals the unpadded float64 computation over its own main tokens and entries."""
    method = build_method("adakv+reskv", WITH_ENTRIES["ratio"], residual=WITH_ENTRIES["residual"])
    cache, stats = method.compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    layer, obs = cache.layers[1], prefill.observations("agnostic")[1]
    assert len(set(stats["main_slots"][1])) > 1 and layer.main_bias is not None  # padding exists
    assert min(stats["residual_entries"][1]) > 0
    generator = torch.Generator().manual_seed(9)
    for _ in range(3):  # three decode steps of two tokens each
        new_keys = torch.randn(1, obs.num_kv_heads, 2, obs.keys.shape[-1], generator=generator)
        new_values = torch.randn(1, obs.num_kv_heads, 2, obs.keys.shape[-1], generator=generator)
        keys, values = layer.update(new_keys, new_values)
    queries = torch.randn(1, obs.queries.shape[0], 2, obs.keys.shape[-1], generator=generator)
    output = layer.attend(None, queries, keys, values, obs.scaling)[0]  # [q, H, d]
    rule = method.residual
    group = obs.group_size
    for head in range(obs.queries.shape[0]):
        kv = head // group
        own = layer.keys[0, kv][torch.isfinite(layer.main_bias[kv, 0])].double()
        own_values = layer.values[0, kv][torch.isfinite(layer.main_bias[kv, 0])].double()
        assert own.shape[0] == stats["main_slots"][1][kv] + 6
        used = torch.isfinite(layer.residual.log_counts[kv])
        for position in range(2):
            query = queries[0, head, position].double()
            visible = own.shape[0] - 1 + position  # the two queries see the last token causally
            main_logits = own[:visible] @ query * obs.scaling
            peak = float(main_logits.softmax(-1).max())
            gate = 1 / (1 + math.exp(-rule.alpha * (rule.tau - peak)))
            residual_logits = (
                layer.residual.keys[kv, used].double() @ query * obs.scaling
                + layer.residual.log_counts[kv, used].double()
                + math.log(gate)
            )
            weights = torch.cat([main_logits, residual_logits]).softmax(-1)
            expected = weights @ torch.cat([own_values[:visible], layer.residual.values[kv, used].double()])
            torch.testing.assert_close(output[position, head].double(), expected, rtol=1e-4, atol=1e-5)


def test_kmeans_memory_is_bounded_by_the_distance_chunk(monkeypatch):
    """The measured peak sees the whole ``[H, E, r]`` distance matrix without chunking, and stays
    far below it with 1 MiB chunks (the measurement the engine benchmark reports at 32K)."""
    shape = dict(seq_len=8192, ratio=0.6, residual_ratio=0.2, num_kv_heads=2, head_dim=16)
    points, entries = 8192 - budget_for(8192, 0.6), math.floor(0.2 * budget_for(8192, 0.6) + 0.5)
    distance_bytes = 4 * 2 * points * entries
    monkeypatch.setattr(reskv.residual, "DISTANCE_CHUNK_BYTES", 1 << 40)
    whole = kmeans_peak_memory(**shape)
    assert (whole["points"], whole["entries"]) == (points, entries)
    assert whole["peak_bytes"] >= distance_bytes
    monkeypatch.setattr(reskv.residual, "DISTANCE_CHUNK_BYTES", 1 << 20)
    assert kmeans_peak_memory(**shape)["peak_bytes"] < distance_bytes / 4
