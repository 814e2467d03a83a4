"""The engine around the core: one prefill serving many runs, settings, positions, switches, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines import METHODS, build_method
from reskv.backbones import BackboneError, load_backbone
from reskv.cache import CACHE_KWARG, CompressedLayer, ResKVCache, reskv_attention
from reskv.compress import CompressedLayerState, ResidualConfig, budget_for, compress_layer
from reskv.decode_rule import DecodeRule
from reskv.engine import Prefill, generate
from reskv.method import Method
from reskv.residual import ResidualEntries
from reskv.scoring import causal_attention_probs
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone, state_attention


@pytest.fixture
def backbone():
    return cached_tiny_backbone("tiny-qwen2", 6, 2)


@pytest.fixture
def prefill(backbone) -> Prefill:
    prompt = random_prompt(TOKENS, 260, seed=5)
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
        for layer in prefill.prefilled("agnostic").cache.layers
    ]
    first = prefill.generate(build_method("snapkv+reskv", 0.8), "agnostic", 6)
    for name in METHODS:
        prefill.generate(build_method(name, 0.7), "aware", 3)
        prefill.generate(build_method(name, 0.7), "agnostic", 3)
    context_layers = prefill.prefilled("agnostic").cache.layers
    for (keys, values, queries), layer in zip(before, context_layers, strict=True):
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
    prefill = Prefill(backbone, random_prompt(TOKENS, 90, seed=4), 70, [record_all])
    for layer in prefill.prefilled("aware").cache.layers:  # context in one pass, question in another
        keys = layer.keys[0]
        assert layer.queries.shape[1] == keys.shape[1] == 90
        probs = causal_attention_probs(layer.queries, keys, range(90), prefill.scaling)
        direct = probs.sum(dim=1).reshape(keys.shape[0], -1, 90).mean(dim=1)
        torch.testing.assert_close(layer.accumulated, direct, rtol=1e-5, atol=1e-5)


def layer_observation(prefill, layer_idx=1):
    return prefill.prefilled("agnostic").cache.layers[layer_idx].observation(layer_idx, prefill.scaling)


def test_without_validation_every_head_uses_the_fixed_ratio(prefill):
    obs = layer_observation(prefill)
    config = ResidualConfig(validate=False, fixed_ratio=0.1)
    state = compress_layer(obs, build_method("snapkv", 0.6).scorer, 0.6, config)
    budget = budget_for(obs.seq_len, 0.6)
    assert state.stats["residual_slots"] == [int(0.1 * budget + 0.5)] * obs.num_kv_heads


def test_no_shared_softmax_mixes_branches_by_gate_times_evicted_share(prefill):
    obs = layer_observation(prefill)
    method = build_method("snapkv+reskv", 0.6, residual=ResidualConfig(validate=False, shared_softmax=False))
    state = compress_layer(obs, method.scorer, 0.6, method.residual)
    assert int(state.residual.entries_per_head.min()) > 0
    queries = obs.queries[:, -2:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    rule = method.residual
    mixed = state_attention(state, queries, obs.scaling, rule)
    without_residual = dataclasses.replace(state, residual=ResidualEntries.empty(obs.num_kv_heads, obs.keys))
    main_only = state_attention(without_residual, queries, obs.scaling, rule)
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
    prompt = random_prompt(TOKENS, 100, seed=9)
    prefill = Prefill(backbone, prompt, 100, [build_method("snapkv+reskv", 0.5)])
    for name in ("snapkv", "snapkv+reskv"):
        stats = prefill.generate(build_method(name, 0.5), "aware", 2).cache_stats
        assert stats["budget"] == 50
        assert stats["main_slots"] == [[50, 50]] * 2
        assert stats["residual_entries"] == [[0, 0]] * 2


def test_a_prompt_too_short_for_any_slot_is_a_clear_error(backbone):
    prefill = Prefill(backbone, random_prompt(TOKENS, 3, seed=0), 3, [])
    with pytest.raises(ValueError, match="leaves no slot"):
        prefill.generate(build_method("snapkv", 0.9), "aware", 2)


def test_a_batch_of_prompts_is_refused_naming_its_size(backbone, prefill):
    first, second = random_prompt(TOKENS, 20, seed=1), random_prompt(TOKENS, 20, seed=2)
    with pytest.raises(ValueError, match="batch size 2"):
        Prefill(backbone, [first, second], 10, [])
    single = Prefill(backbone, torch.tensor([first]), 10, [])  # [1, s] is one sequence
    assert single.prompt_ids == first
    cache, _ = build_method("snapkv", 0.6).compress(prefill.prefilled("agnostic").cache, prefill.scaling)
    attention = backbone.model.model.layers[0].self_attn
    query = torch.zeros(2, 6, 1, 16)
    key = torch.zeros(2, 2, 1, 16)
    with pytest.raises(ValueError, match="batch size 2"):
        reskv_attention(attention, query, key, key, None, **{CACHE_KWARG: cache})
    with pytest.raises(ValueError, match="batch size 2"):
        cache.layers[0].update(key, key)


def test_min_new_tokens_masks_the_stop_ids_until_reached(prefill):
    """transformers' min_length: a stop id that would win the first step is skipped for the runner-up."""
    full = build_method("full")
    logits = prefill.prefilled("aware").last_logits
    first, runner_up = logits.topk(2).indices.tolist()
    assert prefill.generate(full, "aware", 4, stop_token_ids=[first]).token_ids == []
    forced = prefill.generate(full, "aware", 4, stop_token_ids=[first], min_new_tokens=1).token_ids
    assert forced[0] == runner_up and first not in forced[:1]
    assert prefill.generate(full, "aware", 4, min_new_tokens=4).token_ids[:1] == [first]


def test_prompt_plus_generation_past_the_backbone_positions_is_refused(backbone, monkeypatch):
    monkeypatch.setattr(backbone.model.config, "max_position_embeddings", 262)
    prompt = random_prompt(TOKENS, 260, seed=5)
    prefill = Prefill(backbone, prompt, 230, [])
    with pytest.raises(ValueError, match="260 prompt tokens \\+ 3 new tokens = 263 positions .* 262"):
        prefill.generate(build_method("full"), "aware", max_new_tokens=3)
    assert len(prefill.generate(build_method("full"), "aware", max_new_tokens=2).token_ids) <= 2
    with pytest.raises(ValueError, match="263 prompt tokens \\+ 0 new tokens"):
        Prefill(backbone, random_prompt(TOKENS, 263, seed=5), 230, [])
