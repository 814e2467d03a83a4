"""The invariants listed at the end of reskv.md, one test each, on tiny Llama and Qwen2 layers
with GQA group sizes 1 and > 1 (prefilled for real, so keys, values and queries are a model's)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from baselines import build_method, build_scorer
from reskv.attention import DecodeRule, residual_attention
from reskv.compress import ResidualConfig, budget_for, compress_layer
from reskv.engine import Prefill
from reskv.residual import build_residual
from reskv.scoring import LayerObservation
from tests.conftest import random_prompt

PROMPT_LENGTH = 300
NO_GATE = DecodeRule(gate=False)


@pytest.fixture
def prefill(tiny) -> Prefill:
    methods = [build_method("h2o", 0.5)]  # capture H2O statistics too
    return Prefill(tiny, random_prompt(PROMPT_LENGTH), PROMPT_LENGTH - 20, methods)


@pytest.fixture
def observation(prefill) -> LayerObservation:
    return prefill._context.cache.layers[1].observation(1, prefill.scaling)


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
    return residual_attention(
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
    tiny_ratio = 1e-17  # floor(s * (1 - 1e-17)) == s in float64
    assert budget_for(observation.seq_len, tiny_ratio) == observation.seq_len
    method = build_method("snapkv+reskv", tiny_ratio)
    assert compress_layer(observation, method.scorer, tiny_ratio, method.residual) is None
    compressed = prefill.generate(method, "agnostic", max_new_tokens=6)
    full = prefill.generate(build_method("full"), "agnostic", max_new_tokens=6)
    assert compressed.token_ids == full.token_ids
    assert compressed.cache_stats["compressed"] is False


@pytest.mark.parametrize("base", ["h2o", "tova", "snapkv", "adakv"])
def test_2_residual_off_everywhere_is_the_base_method(prefill, base):
    plain = build_method(base, 0.7)
    off = build_method(f"{base}+reskv", 0.7, residual=ResidualConfig(grid=(0.0,)))
    plain_cache, _ = plain.compress(prefill._context.cache, prefill.scaling)
    off_cache, stats = off.compress(prefill._context.cache, prefill.scaling)
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


def test_5_shared_softmax_equals_the_lse_merge(observation):
    """One softmax over [main ; residual] logits, written per query head with its own gate."""
    obs = observation
    method = build_method("snapkv+reskv", 0.8, residual=ResidualConfig(validate=False, fixed_ratio=0.2))
    state = compress_layer(obs, method.scorer, 0.8, method.residual)
    rule = method.residual
    queries = decode_queries(obs, count=4)
    merged = state.attend(queries, obs.scaling, rule)
    for kv_head in range(obs.num_kv_heads):
        for row in range(queries.shape[1]):  # every query head of the group, every query
            query = queries[kv_head, row]
            main_logits = state.main_keys[kv_head] @ query * obs.scaling
            peak = main_logits.softmax(dim=-1).max()
            gate = max(rule.g_min, torch.sigmoid(rule.alpha * (rule.tau - peak)).item())
            residual_logits = (
                state.residual.keys[kv_head] @ query * obs.scaling
                + state.residual.log_counts[kv_head]
                + math.log(gate)
            )
            weights = torch.cat([main_logits, residual_logits]).softmax(dim=-1)
            expected = weights @ torch.cat([state.main_values[kv_head], state.residual.values[kv_head]])
            torch.testing.assert_close(merged[kv_head, row], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio", [0.6, 0.9])
@pytest.mark.parametrize(
    "name",
    ["h2o", "tova", "snapkv", "adakv", "cam", "h2o+reskv", "tova+reskv", "snapkv+reskv", "adakv+reskv"],
)
def test_6_slots_never_exceed_the_budget(prefill, name, ratio):
    method = build_method(name, ratio)
    cache, stats = method.compress(prefill._context.cache, prefill.scaling)
    budget = budget_for(prefill.context_length, ratio)
    assert stats["budget"] == budget
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
        if name.startswith("adakv"):  # uneven heads, exact layer total
            assert sum(allocated) == budget * len(allocated)
        else:
            assert allocated == [budget] * len(allocated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_7_no_nan_or_inf(observation, dtype):
    obs = dataclasses.replace(
        observation,
        keys=observation.keys.to(dtype),
        values=observation.values.to(dtype),
        queries=observation.queries.to(dtype),
    )
    method = build_method("snapkv+reskv", 0.9, residual=ResidualConfig(validate=False, fixed_ratio=0.2))
    state = compress_layer(obs, method.scorer, 0.9, method.residual)
    queries = decode_queries(obs).to(dtype)
    closed_gate = DecodeRule(alpha=1e6, g_min=0.0)  # gate exactly 0 unless the main peak is below tau
    for rule in (method.residual, closed_gate):
        output = state.attend(queries, obs.scaling, rule)
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
    assert torch.isfinite(residual_output(queries.float(), observation, kept, capped)).all()


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
    first, first_stats = method.compress(prefill._context.cache, prefill.scaling)
    second, second_stats = method.compress(prefill._context.cache, prefill.scaling)
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
