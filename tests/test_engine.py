"""The engine around the core: one prefill serving many runs, settings, positions, switches, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines import METHODS, build_method
from reskv.attention import DecodeRule
from reskv.backbones import BackboneError, load_backbone
from reskv.cache import CompressedLayer, ResKVCache
from reskv.compress import CompressedLayerState, ResidualConfig, budget_for, compress_layer
from reskv.proxy import ValidationProxy, observation_split
from reskv.engine import Method, Prefill, generate
from reskv.residual import ResidualEntries
from reskv.scoring import causal_attention_probs
from reskv.selection import select_main
from tests.conftest import cached_tiny_backbone, random_prompt


@pytest.fixture
def backbone():
    return cached_tiny_backbone("tiny-qwen2", 6, 2)


@pytest.fixture
def prefill(backbone) -> Prefill:
    prompt = random_prompt(260, seed=5)
    return Prefill(backbone, prompt, 230, [build_method(name, 0.6) for name in METHODS])


class KeepEverything(Method):
    """A compressed cache that keeps every token: must behave exactly like the full cache."""

    def compress(self, cache, scaling):
        layers = []
        for layer_idx, layer in enumerate(cache.layers):
            obs = layer.observation(layer_idx, scaling)
            state = CompressedLayerState(
                obs.keys,
                obs.values,
                None,
                ResidualEntries.empty(obs.num_kv_heads, obs.keys),
                torch.ones(obs.keys.shape[:2], dtype=torch.bool),
            )
            layers.append(CompressedLayer(state, obs.seq_len, ResidualConfig()))
        return ResKVCache(layers), {}


@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_compressed_cache_keeping_everything_decodes_like_the_full_cache(prefill, setting):
    """Positions continue at the uncompressed length and suffix tokens see each other causally."""
    full = prefill.generate(build_method("full"), setting, max_new_tokens=8)
    kept = prefill.generate(KeepEverything("keep"), setting, max_new_tokens=8)
    assert kept.token_ids == full.token_ids


def test_full_cache_gives_the_same_answer_in_both_settings(prefill):
    full = build_method("full")
    assert prefill.generate(full, "aware", 8).token_ids == prefill.generate(full, "agnostic", 8).token_ids


def test_one_prefill_serves_many_runs_without_changing(prefill):
    before = [
        (layer.keys.clone(), layer.values.clone(), layer.queries.clone())
        for layer in prefill._context.cache.layers
    ]
    first = prefill.generate(build_method("snapkv+reskv", 0.8), "agnostic", 6)
    for name in METHODS:
        prefill.generate(build_method(name, 0.7), "aware", 3)
        prefill.generate(build_method(name, 0.7), "agnostic", 3)
    for (keys, values, queries), layer in zip(before, prefill._context.cache.layers, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        assert torch.equal(queries, layer.queries)
    assert prefill.generate(build_method("snapkv+reskv", 0.8), "agnostic", 6).token_ids == first.token_ids


def test_a_separate_prefill_gives_the_same_generation(backbone, prefill):
    """Grid mode changes cost only: a prefill made for one method answers identically."""
    method = build_method("tova+reskv", 0.9)
    alone = Prefill(backbone, prefill.prompt_ids, prefill.context_length, [method])
    for setting in ("aware", "agnostic"):
        assert alone.generate(method, setting, 6).token_ids == prefill.generate(method, setting, 6).token_ids


def test_agnostic_compresses_the_context_and_aware_the_whole_prompt(prefill):
    method = build_method("snapkv", 0.6)
    aware = prefill.generate(method, "aware", 2).cache_stats
    agnostic = prefill.generate(method, "agnostic", 2).cache_stats
    assert aware["compressed_tokens"] == 260 and aware["budget"] == budget_for(260, 0.6)
    assert agnostic["compressed_tokens"] == 230 and agnostic["budget"] == budget_for(230, 0.6)


def test_h2o_statistics_captured_in_chunks_equal_the_direct_column_sums(backbone, monkeypatch):
    """Record every prompt query (observation window >= s) so the direct sum can be recomputed."""
    monkeypatch.setattr("reskv.scoring.QUERY_CHUNK", 16)
    record_all = build_method("h2o+reskv", 0.5, residual=ResidualConfig(fit_queries=400))
    prefill = Prefill(backbone, random_prompt(90, seed=4), 70, [record_all])
    for layer in prefill._prompt_state().cache.layers:  # context in one pass, question in another
        keys = layer.keys[0]
        assert layer.queries.shape[1] == keys.shape[1] == 90
        probs = causal_attention_probs(layer.queries, keys, torch.arange(90), prefill.scaling)
        direct = probs.sum(dim=1).reshape(keys.shape[0], -1, 90).mean(dim=1)
        torch.testing.assert_close(layer.accumulated, direct, rtol=1e-5, atol=1e-5)


def layer_observation(prefill, layer_idx=1):
    return prefill._context.cache.layers[layer_idx].observation(layer_idx, prefill.scaling)


def test_validation_proxy_keeps_the_best_candidate_only_when_it_beats_main_only(prefill):
    obs = layer_observation(prefill)
    method = build_method("snapkv+reskv", 0.7)
    proxy = ValidationProxy(obs, method.scorer, method.residual, observation_split(obs, method.residual))
    budgets = torch.full((obs.num_kv_heads,), budget_for(obs.seq_len, 0.7))
    chosen = proxy.choose(budgets)
    candidates = torch.stack(
        [torch.floor(ratio * budgets.double() + 0.5).long() for ratio in method.residual.grid]
    )
    losses = proxy.losses(budgets, candidates)
    window = method.scorer.window
    for head in range(obs.num_kv_heads):
        sizes = candidates[:, head].tolist()
        # reskv.md: skip r == 0, a repeated r, or m - |P| < 0.
        allowed = [
            c
            for c in range(1, len(sizes))
            if sizes[c] > 0 and sizes[c] not in sizes[:c] and budgets[head] - sizes[c] >= window
        ]
        assert allowed, "the test needs at least one candidate"
        best = min(allowed, key=lambda c: (losses[c, head].item(), c))
        improves = losses[best, head] < (1 - method.residual.delta) * losses[0, head]
        assert chosen[head] == (sizes[best] if improves else 0)


def test_validation_split_is_96_fit_and_32_validation_queries(prefill):
    fit, validation = observation_split(layer_observation(prefill), ResidualConfig())
    assert (fit.start, fit.stop, validation.start, validation.stop) == (0, 96, 96, 128)


def test_short_prompt_falls_back_to_a_proportional_split(backbone):
    short = Prefill(backbone, random_prompt(40, seed=2), 40, [build_method("snapkv+reskv", 0.5)])
    fit, validation = observation_split(layer_observation(short), ResidualConfig())
    assert (fit.stop - fit.start, validation.stop - validation.start) == (30, 10)
    generation = short.generate(build_method("snapkv+reskv", 0.5), "aware", 3)
    assert len(generation.token_ids) <= 3


def test_without_validation_every_head_uses_the_fixed_ratio(prefill):
    obs = layer_observation(prefill)
    config = ResidualConfig(validate=False, fixed_ratio=0.1)
    state = compress_layer(obs, build_method("snapkv", 0.6).scorer, 0.6, config)
    budget = budget_for(obs.seq_len, 0.6)
    assert state.stats["residual_slots"] == [int(0.1 * budget + 0.5)] * obs.num_kv_heads


def test_fit_selection_switch_changes_only_the_main_selection_rule(prefill):
    obs = layer_observation(prefill)
    base = build_method("snapkv+reskv", 0.8)
    fit = dataclasses.replace(base.residual, final_selection="fit")
    base_state = compress_layer(obs, base.scorer, 0.8, base.residual)
    fit_state = compress_layer(obs, base.scorer, 0.8, fit)
    assert base_state.stats["residual_slots"] == fit_state.stats["residual_slots"]
    sizes = torch.tensor(base_state.stats["residual_slots"])
    budgets = torch.full_like(sizes, budget_for(obs.seq_len, 0.8))
    proxy = ValidationProxy(obs, base.scorer, base.residual, observation_split(obs, base.residual))
    expected = select_main(proxy.fit_scores, base.scorer.window, budgets - sizes)
    assert fit_state.stats["main_slots"] == expected.sum(-1).tolist()


def test_no_shared_softmax_mixes_branches_by_gate_times_evicted_share(prefill):
    obs = layer_observation(prefill)
    method = build_method("snapkv+reskv", 0.6, residual=ResidualConfig(validate=False, shared_softmax=False))
    state = compress_layer(obs, method.scorer, 0.6, method.residual)
    assert int(state.residual.entries_per_head.min()) > 0
    queries = obs.queries[:, -2:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    rule = method.residual
    mixed = state.attend(queries, obs.scaling, rule)
    without_residual = dataclasses.replace(state, residual=ResidualEntries.empty(obs.num_kv_heads, obs.keys))
    main_only = without_residual.attend(queries, obs.scaling, rule)
    logits = queries.float() @ state.residual.keys.float().transpose(1, 2) * obs.scaling
    residual_probs = (logits + state.residual.log_counts[:, None, :]).softmax(dim=-1)
    residual_only = residual_probs @ state.residual.values.float()
    main_logits = queries.float() @ state.main_keys.float().transpose(1, 2) * obs.scaling
    peak = main_logits.softmax(-1).amax(-1)
    gate = torch.sigmoid(DecodeRule().alpha * (DecodeRule().tau - peak))
    weight = (gate * state.evicted_fraction[:, None])[..., None]
    torch.testing.assert_close(mixed, (1 - weight) * main_only + weight * residual_only, rtol=1e-5, atol=1e-6)


def test_text_api_answers_a_context_question_pair(backbone):
    method = build_method("snapkv+reskv", 0.6)
    context = "The quick brown fox jumps over the lazy dog. " * 20
    aware = generate(backbone, method, context, "\nWhat does the fox do?", "aware", max_new_tokens=4)
    agnostic = generate(backbone, method, context, "\nWhat does the fox do?", "agnostic", max_new_tokens=4)
    assert aware.cache_stats["prompt_tokens"] == agnostic.cache_stats["prompt_tokens"]
    assert agnostic.cache_stats["compressed_tokens"] < aware.cache_stats["compressed_tokens"]
    assert isinstance(aware.text, str) and len(aware.token_ids) <= 4


@pytest.mark.parametrize(
    "name, ratio, message",
    [
        ("snapkv+resk", 0.5, r"unknown method 'snapkv\+resk'; choose one of .*'snapkv\+reskv'"),
        ("snapkv", 1.0, "must lie strictly between 0 and 1"),
        ("tova", 0.0, "must lie strictly between 0 and 1"),
        ("adakv", -0.2, "must lie strictly between 0 and 1"),
    ],
)
def test_bad_method_or_ratio_is_a_clear_error(name, ratio, message):
    with pytest.raises(ValueError, match=message):
        build_method(name, ratio)


def test_residual_settings_on_a_plain_method_are_rejected():
    with pytest.raises(ValueError, match="snapkv\\+reskv"):
        build_method("snapkv", 0.5, residual=ResidualConfig())


def test_bad_residual_config_names_the_choices():
    with pytest.raises(ValueError, match="choose one of"):
        ResidualConfig(final_selection="validated")


def test_bad_setting_and_unknown_backbone_are_clear_errors(prefill):
    with pytest.raises(ValueError, match="choose one of \\['aware', 'agnostic'\\]"):
        prefill.generate(build_method("full"), "query-aware", 2)
    with pytest.raises(BackboneError, match="choose one of"):
        load_backbone("smollm3")


def test_budget_below_the_protected_window_keeps_the_most_recent_tokens(backbone):
    """Documented fallback: with b < 64 SnapKV keeps the last b tokens; +ResKV has no room for entries."""
    prompt = random_prompt(100, seed=9)
    prefill = Prefill(backbone, prompt, 100, [build_method("snapkv+reskv", 0.5)])
    for name in ("snapkv", "snapkv+reskv"):
        stats = prefill.generate(build_method(name, 0.5), "aware", 2).cache_stats
        assert stats["budget"] == 50
        assert stats["main_slots"] == [[50, 50]] * 2
        assert stats["residual_entries"] == [[0, 0]] * 2


def test_a_prompt_too_short_for_any_slot_is_a_clear_error(backbone):
    prefill = Prefill(backbone, random_prompt(3), 3, [])
    with pytest.raises(ValueError, match="leaves no slot"):
        prefill.generate(build_method("snapkv", 0.9), "aware", 2)
