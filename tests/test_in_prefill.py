"""Compression inside the prefill (``Prefill(..., retain="compressed")``, reskv.md "Where the full cache
lives") against compress-after (``retain="full"``), on a tiny GQA model (6 query heads, 2 KV heads) in
CPU fp32, for every base method with and without +ResKV (AdaKV's heads ragged, CaM's values merged).

Compress-after is the reference: its construction equals a plain per-head loop bit for bit
(tests/test_construction_plan.py), and each layer compressed alone equals the stacked batch there.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from baselines import METHODS, RESIDUAL_SUFFIX, build_method, build_scorer
from baselines.registry import FULL_METHOD
from reskv.cache import CompressingLayer
from reskv.config import SETTINGS, ResidualConfig
from reskv.engine import Prefill
from reskv.method import Method, layer_batches
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.measure import peak_allocated, random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone

PROMPT_LENGTH, CONTEXT_LENGTH = 260, 230
RESIDUAL_NAMES = [name for name in METHODS if name.endswith(RESIDUAL_SUFFIX)]
# The proxy may choose no entry anywhere on this prompt (snapkv+reskv does): the fixed residual ratio
# of "w/o validation" makes sure there are entries to compare.
FIXED = "~validate=false"
NAMES = [name for name in METHODS if name != FULL_METHOD] + [name + FIXED for name in RESIDUAL_NAMES]
# Query-aware keys and values come from one forward instead of two: they differ in the last bits
# (reskv.md, "Where the full cache lives", gives the bound), so do gathered and averaged ones.
ROUNDING = {"rtol": 0.0, "atol": 1e-6}


@pytest.fixture(scope="module")
def backbone():
    return cached_tiny_backbone("tiny-qwen2", 6, 2)


@pytest.fixture(scope="module")
def methods() -> dict[str, Method]:
    """Every compressing method at ratio 0.6, each +ResKV one also with a fixed residual ratio, and
    SnapKV at ratio 0, whose budget covers the prompt."""
    fixed = ResidualConfig(validate=False)
    return (
        {name: build_method(name, 0.6) for name in NAMES if FIXED not in name}
        | {name + FIXED: build_method(name, 0.6, residual=fixed) for name in RESIDUAL_NAMES}
        | {"keep-all": Method("keep-all", 0.0, build_scorer("snapkv"))}
    )


@pytest.fixture(scope="module")
def after(backbone, methods) -> Prefill:
    return Prefill(
        backbone, random_prompt(TOKENS, PROMPT_LENGTH, seed=5), CONTEXT_LENGTH, list(methods.values())
    )


@pytest.fixture(scope="module")
def during(backbone, methods) -> Prefill:
    prompt = random_prompt(TOKENS, PROMPT_LENGTH, seed=5)
    return Prefill(backbone, prompt, CONTEXT_LENGTH, list(methods.values()), retain="compressed")


def states_after(prefill: Prefill, method: Method, setting: str) -> list:
    """The states compress-after builds from the kept full cache, in ``Method.compress``'s batches."""
    observations = prefill.observations(setting)
    batches = layer_batches(observations)
    return [state for batch in batches for state in method.compress_batch(batch, len(observations))]


def states_during(prefill: Prefill, method: Method, setting: str) -> list:
    """The states the in-prefill forward of ``setting`` stored for ``method``, layer by layer."""
    return [layer.compressed[method] for layer in prefill.prefilled(setting).cache.layers]


def assert_same_construction(ours, reference, exact: bool) -> None:
    """Kept sets, residual sizes and entry counts (``stats``), padding and used entries always equal;
    kept keys and values and the entries' keys and values equal bit for bit when ``exact``, else
    within ``ROUNDING``."""
    for state, expected in zip(ours, reference, strict=True):
        assert torch.equal(state.kept, expected.kept)
        assert state.stats == expected.stats
        assert (state.main_bias is None) == (expected.main_bias is None)
        if expected.main_bias is not None:
            assert torch.equal(state.main_bias, expected.main_bias)
        assert torch.equal(state.residual.log_counts, expected.residual.log_counts)
        pairs = [
            (state.main_keys, expected.main_keys),
            (state.main_values, expected.main_values),
            (state.residual.keys, expected.residual.keys),
            (state.residual.values, expected.residual.values),
        ]
        for actual, wanted in pairs:
            if exact:
                assert torch.equal(actual, wanted)
            else:
                torch.testing.assert_close(actual, wanted, **ROUNDING)


@pytest.mark.parametrize("name", NAMES)
def test_query_agnostic_equals_compress_after_bit_for_bit(after, during, methods, name):
    """The same context forward: every layer's construction and the greedy tokens are identical."""
    method = methods[name]
    ours = states_during(during, method, "agnostic")
    assert_same_construction(ours, states_after(after, method, "agnostic"), exact=True)
    if name.endswith(FIXED):
        assert any(any(state.stats["residual_entries"]) for state in ours)  # entries were compared
    generation, reference = during.generate(method, "agnostic", 8), after.generate(method, "agnostic", 8)
    assert generation.token_ids == reference.token_ids
    assert generation.cache_stats == reference.cache_stats


@pytest.mark.parametrize("name", NAMES)
def test_layers_compressed_one_by_one_equal_the_stacked_batch_bit_for_bit(after, methods, name):
    """A CPU compresses a long prompt's layers one by one (``CPU_LAYER_BATCH_BYTES``), a GPU stacks a batch
    of layers along the heads (``LAYER_BATCH_BYTES``): the same construction, bit for bit."""
    observations = after.observations("agnostic")
    method = methods[name]
    stacked = method.compress_batch(observations, len(observations))
    alone = [state for obs in observations for state in method.compress_batch([obs], len(observations))]
    assert_same_construction(alone, stacked, exact=True)
    if name.endswith(FIXED):
        assert any(any(state.stats["residual_entries"]) for state in alone)  # entries were compared


@pytest.mark.parametrize("name", NAMES)
def test_query_aware_equals_compress_after_to_rounding(after, during, methods, name):
    """One forward over the whole prompt instead of context + question: on this prompt no decision
    flips (same kept sets, sizes, entry counts and cluster sizes, same greedy tokens and statistics),
    and kept keys and values and entries agree to ``ROUNDING``."""
    method = methods[name]
    ours = states_during(during, method, "aware")
    assert_same_construction(ours, states_after(after, method, "aware"), exact=False)
    if name.endswith(FIXED):
        assert any(any(state.stats["residual_entries"]) for state in ours)  # entries were compared
    generation, reference = during.generate(method, "aware", 8), after.generate(method, "aware", 8)
    assert generation.token_ids == reference.token_ids
    assert generation.cache_stats == reference.cache_stats


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_budget_covering_the_prompt_keeps_the_full_layers_and_decoding_leaves_them(
    after, during, methods, setting
):
    """Ratio 0 compresses nothing (the stored layers are the exact ones, as compress-after keeps them):
    the tokens of the full cache, again on a second run, so decoding extended a copy."""
    keep_all, full = methods["keep-all"], build_method(FULL_METHOD)
    first, second = (during.generate(keep_all, setting, 8) for _ in range(2))
    assert first.cache_stats == second.cache_stats == after.generate(keep_all, setting, 8).cache_stats
    assert first.cache_stats["compressed"] is False
    assert first.token_ids == second.token_ids == after.generate(full, setting, 8).token_ids


@pytest.mark.parametrize("setting", SETTINGS)
def test_decoding_leaves_the_stored_states_unchanged(during, methods, setting):
    method = methods["adakv+reskv"]
    stored = states_during(during, method, setting)
    tensors = [
        (
            state.main_keys,
            state.main_values,
            state.residual.keys,
            state.residual.values,
            state.residual.log_counts,
        )
        for state in stored
    ]
    before = [[tensor.clone() for tensor in layer] for layer in tensors]
    first = during.generate(method, setting, 8)
    for layer, copies in zip(tensors, before, strict=True):
        assert all(torch.equal(tensor, copy) for tensor, copy in zip(layer, copies, strict=True))
    assert during.generate(method, setting, 8).token_ids == first.token_ids


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_full_layer_is_freed_before_the_next_layer_attends(backbone, monkeypatch, setting):
    """The dispatch is recorded: when a layer's attention starts, the memory of no earlier layer's full
    keys or values is alive. Weak references to their storages (torch keeps a storage's Python object
    while anything uses it), so that a view kept anywhere, such as an observation's, keeps them too;
    no garbage collection is run."""
    full_storages: list[weakref.ref] = []
    attend = CompressingLayer.attend

    def recording_attend(layer, module, query, key, value, scaling):
        alive = [index // 2 for index, ref in enumerate(full_storages) if ref() is not None]
        assert not alive, f"layer {module.layer_idx} attends while layers {alive} keep their full cache"
        full_storages.extend([weakref.ref(key.untyped_storage()), weakref.ref(value.untyped_storage())])
        return attend(layer, module, query, key, value, scaling)

    monkeypatch.setattr(CompressingLayer, "attend", recording_attend)
    method = build_method("snapkv+reskv", 0.6)
    prefill = Prefill(
        backbone, random_prompt(TOKENS, PROMPT_LENGTH, seed=5), CONTEXT_LENGTH, [method], retain="compressed"
    )
    prefill.compressed(method, setting)
    assert len(full_storages) == 2 * backbone.model.config.num_hidden_layers
    assert all(ref() is None for ref in full_storages)


def test_the_full_method_is_refused_naming_the_mode(backbone, during):
    message = r"the full method needs the full cache, which Prefill\(\.\.\., retain='compressed'\) frees .*"
    message += "retain='full'"
    with pytest.raises(ValueError, match=message):
        Prefill(
            backbone, random_prompt(TOKENS, 40, seed=0), 30, [build_method(FULL_METHOD)], retain="compressed"
        )
    with pytest.raises(ValueError, match=message):
        during.compressed(build_method(FULL_METHOD), "aware")


def test_quality_measures_and_observations_are_refused_naming_the_mode(during, methods):
    with pytest.raises(
        ValueError, match=r"quality measures \(answer_ids\) needs the full cache.*retain='full'"
    ):
        during.generate(methods["snapkv"], "aware", 2, answer_ids=[5, 6])
    with pytest.raises(
        ValueError, match=r"observations\(\) needs the full cache.*retain='compressed'.*retain='full'"
    ):
        during.observations("agnostic")


def test_a_method_not_given_at_construction_is_refused(during):
    """Another SnapKV at the same ratio is another Method: nothing was compressed for it."""
    with pytest.raises(
        ValueError, match=r"method 'snapkv' was not given to this Prefill\(\.\.\., retain='compressed'\)"
    ):
        during.compressed(build_method("snapkv", 0.6), "agnostic")


def test_an_unknown_retain_names_the_choices(backbone):
    with pytest.raises(ValueError, match=r"unknown retain 'gpu'; choose one of \['full', 'compressed'\]"):
        Prefill(backbone, random_prompt(TOKENS, 40, seed=0), 30, retain="gpu")


@pytest.mark.parametrize("base", ["snapkv", "adakv"])
def test_a_reskv_request_peaks_within_five_percent_of_its_base_at_the_8b_attention_shape(base):
    """+ResKV's memory rule (reskv.md: its peak is its base's plus the validation proxy's buffers) where
    those buffers weigh most against the layer's own: one layer with Llama-3.1-8B's attention (32 query
    heads, 8 KV heads, head dim 128; widths of 256, bf16), 2,048 tokens, ratio 0.9, each request
    compressing inside its prefill. Peaks are allocator events, deterministic. A proxy that keeps a
    copy of ``S'``, joins its buffers in the cache's dtype and materialises its bias per query fails
    this test."""
    backbone = dataclasses.replace(narrow_llama_8b_attention(num_layers=1), stop_token_ids=())
    prompt = random_prompt(range(500), 2048, seed=3)
    peaks = {}
    for name in (base, base + RESIDUAL_SUFFIX):
        method = build_method(name, 0.9)
        with peak_allocated("cpu") as peak:
            Prefill(backbone, prompt, len(prompt), [method], retain="compressed").generate(method, "aware", 1)
        peaks[name] = peak.bytes
    assert peaks[base + RESIDUAL_SUFFIX] <= 1.05 * peaks[base], peaks
