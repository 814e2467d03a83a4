"""The quality measures (reskv.quality): exact zeros against the full cache, hand-computed values,
and the measures recomputed by plain loops over the model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from baselines import build_method
from benchmarks.item import Item
from reskv.attention import joint_attention, joint_bias
from reskv.config import ResidualConfig
from reskv.engine import Prefill
from reskv.method import Method
from reskv.quality import FORCED_STEPS, kl_divergence, sequence_log_prob
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone
from tests.test_engine import KeepEverything

ANSWER = [311, 4032, 17, 980]
MEASURES = ("kl", "answer_log_prob_gap", "attention_error", "residual_share")


@pytest.fixture
def backbone():
    return cached_tiny_backbone("tiny-qwen2", 6, 2)


@pytest.fixture
def prefill(backbone) -> Prefill:
    return Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 260, [build_method("snapkv+reskv", 0.7)])


def test_kl_of_a_hand_built_two_token_case():
    # P = (1/4, 3/4), Q = (1/2, 1/2): KL = 1/4 log(1/2) + 3/4 log(3/2)
    full = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    method = torch.tensor([[5.0, 5.0]])
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kl_divergence(full, method).item() == pytest.approx(expected, abs=1e-12)
    assert kl_divergence(full, full).item() == 0.0


def test_sequence_log_prob_of_a_hand_built_case():
    # row 0 = (1/2, 1/2) predicts token 1; row 1 = (3/4, 1/4) predicts token 0
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    expected = math.log(0.5) + math.log(0.75)
    assert sequence_log_prob(logits, torch.tensor([1, 0])) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("setting", ["aware", "agnostic"])
@pytest.mark.parametrize("method", [build_method("full"), KeepEverything("keep")], ids=["full", "keep-all"])
def test_the_full_cache_and_a_cache_keeping_every_token_are_at_distance_zero(prefill, method, setting):
    quality = prefill.generate(method, setting, max_new_tokens=4, answer_ids=ANSWER).quality
    assert quality["answer_tokens"] == len(ANSWER)
    if method.name == "full":  # the same code on the same cache: exactly zero
        assert {name: quality[name] for name in MEASURES} == dict.fromkeys(MEASURES, 0.0)
        assert set(quality["attention_error_by_layer"]) == {0.0}
    else:  # fp32 joint attention against SDPA over the same tokens
        assert quality["kl"] == pytest.approx(0.0, abs=1e-9)
        assert quality["answer_log_prob_gap"] == pytest.approx(0.0, abs=1e-4)
        assert quality["attention_error"] == pytest.approx(0.0, abs=1e-5)
        assert quality["residual_share"] == 0.0


def test_measures_equal_plain_loops_over_the_model(backbone, prefill):
    """KL by step-by-step forced decoding of a freshly compressed cache against the full model run
    without any cache, and the answer log-likelihoods from one plain forward over prompt + answer."""
    method = build_method("snapkv", 0.7)
    quality = prefill.generate(method, "aware", max_new_tokens=4, answer_ids=ANSWER).quality
    model, prompt = backbone.model, prefill.prompt_ids

    def logits_of(ids):
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0].double()

    forced = []
    for _ in range(FORCED_STEPS):  # the full cache's greedy continuation
        forced.append(int(logits_of(prompt + forced)[-1].argmax()))
    full_logits = logits_of(prompt + forced)[len(prompt) :]
    cache, _ = prefill.compressed(method, "aware")
    method_logits = []
    for token in forced:
        method_logits.append(prefill.next_logits([token], cache).double())
    expected_kl = (
        sum(
            float((p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum())
            for p, q in zip(full_logits, method_logits, strict=True)
        )
        / FORCED_STEPS
    )
    assert quality["kl"] > 0
    assert quality["kl"] == pytest.approx(expected_kl, rel=1e-3)

    answer_logits = logits_of(prompt + ANSWER)[len(prompt) - 1 : -1].log_softmax(-1)
    expected_full = float(sum(answer_logits[j, token] for j, token in enumerate(ANSWER)))
    assert quality["answer_log_prob_full"] == pytest.approx(expected_full, abs=1e-3)
    assert quality["answer_log_prob_gap"] == quality["answer_log_prob"] - quality["answer_log_prob_full"]


@dataclasses.dataclass(frozen=True)
class OneLayerOnly(Method):
    """SnapKV on one layer only; every other layer keeps the exact prefilled cache."""

    layer: int = 0

    def compressed_layers(self, cache, scaling, shared=None):
        layers = list(cache.layers)
        layers[self.layer] = build_method("snapkv", 0.7).compressed_layers(cache, scaling, shared)[self.layer]
        return layers


@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_a_layers_error_depends_on_its_own_compression_only(prefill, setting):
    """Every layer is fed the full model's hidden states, so errors do not compound: a layer's error
    is the same whether the layers before it are compressed or exact, and 0 where it is exact."""
    everywhere = prefill.generate(build_method("snapkv", 0.7), setting, max_new_tokens=4, answer_ids=ANSWER)
    errors = everywhere.quality["attention_error_by_layer"]
    assert len(errors) > 1 and min(errors) > 0
    for layer in range(len(errors)):
        alone = prefill.generate(
            OneLayerOnly("one", layer=layer), setting, max_new_tokens=4, answer_ids=ANSWER
        )
        expected = [0.0] * len(errors)
        expected[layer] = errors[layer]
        assert alone.quality["attention_error_by_layer"] == pytest.approx(expected, rel=1e-5)


def test_residual_share_is_the_softmax_mass_on_the_entries():
    """Against one plain softmax over [entries ; main] logits, the gate's log added to the entries."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(2, 5, 4, generator=generator)
    keys, values = torch.randn(2, 9, 4, generator=generator), torch.randn(2, 9, 4, generator=generator)
    log_counts = torch.tensor([[0.0, math.log(3.0), float("-inf")], [math.log(2.0), 0.0, 0.0]])
    rule = ResidualConfig()
    bias = joint_bias(log_counts, None, 6, rule)
    _, share = joint_attention(queries, keys, values, bias, 3, 0.5, rule, with_residual_share=True)
    logits = queries @ keys.transpose(1, 2) * 0.5 + bias
    main_probs = logits[..., 3:].softmax(-1)
    gate = torch.sigmoid(rule.alpha * (rule.tau - main_probs.amax(-1))).clamp(min=rule.g_min)
    logits[..., :3] += gate.log()[..., None]
    expected = logits.softmax(-1)[..., :3].sum(-1)
    assert (share > 0).all()
    torch.testing.assert_close(share, expected, rtol=1e-5, atol=1e-6)


def test_residual_share_is_measured_where_the_cache_has_entries(prefill):
    method = build_method("snapkv+reskv", 0.7, residual=ResidualConfig(validate=False))
    generation = prefill.generate(method, "aware", max_new_tokens=4, answer_ids=ANSWER)
    assert sum(map(sum, generation.cache_stats["residual_entries"])) > 0  # the cache has entries
    shares = generation.quality["residual_share_by_layer"]
    assert all(0.0 <= share < 1.0 for share in shares) and max(shares) > 0
    plain = prefill.generate(build_method("snapkv", 0.7), "aware", max_new_tokens=4, answer_ids=ANSWER)
    assert plain.quality["residual_share"] == 0.0


def test_an_answer_past_the_backbone_positions_is_cut_where_they_end(prefill, monkeypatch):
    monkeypatch.setattr(prefill, "max_positions", len(prefill.prompt_ids) + FORCED_STEPS + 2)
    quality = prefill.generate(
        build_method("snapkv", 0.7), "aware", max_new_tokens=2, answer_ids=ANSWER * 10
    ).quality
    assert quality["answer_tokens"] == FORCED_STEPS + 2


def test_without_answer_ids_nothing_is_measured(prefill):
    assert prefill.generate(build_method("snapkv", 0.7), "aware", max_new_tokens=2).quality is None


@pytest.mark.parametrize(("prompt_end", "separator"), [(" the number is", " "), ("assistant\n", "")])
def test_answer_ids_follow_the_prompt_with_one_space_unless_it_ends_in_whitespace(
    backbone, prompt_end, separator
):
    tokenizer = backbone.tokenizer
    prompt_ids = tuple(tokenizer("Some context." + prompt_end, add_special_tokens=False)["input_ids"])
    item = Item("ruler", "niah", 0, prompt_ids, 2, prompt_end, ("7374122",), 8, "string_match_all")
    expected = tokenizer(separator + "7374122", add_special_tokens=False)["input_ids"]
    assert item.answer_ids(tokenizer) == tuple(expected)
    no_reference = Item("ruler", "niah", 0, prompt_ids, 2, prompt_end, (), 8, "string_match_all")
    assert no_reference.answer_ids(tokenizer) == ()
