"""A grid's constructions share what does not depend on the ratio (``reskv.compress.SharedLayers``):
every configuration's kept sets, residual sizes, entries and main cache equal, bit for bit on CPU
fp32, those of compressing it alone; and the shared work runs once."""

from __future__ import annotations

import pytest
import torch

import reskv.compress
from baselines import build_method
from baselines.cam import CaM
from reskv.backbones import tiny_backbone
from reskv.config import SETTINGS, ResidualConfig
from reskv.engine import Prefill
from reskv.method import shared_batches
from reskv.scoring import TokenScorer
from scripts.bench.dispatch_counts import count_dispatch
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone

# Every kind of base rule (per-head scores, pooled over heads, accumulated, budgets spread over heads
# and over layers, merged values), with and without ResKV, at two ratios, and the ablations whose
# proxy or selection differ.
GRID = [
    *[(name, ratio) for name in ("snapkv", "snapkv+reskv", "adakv", "adakv+reskv") for ratio in (0.6, 0.9)],
    ("tova+reskv", 0.8),
    ("h2o+reskv", 0.8),
    ("pyramidkv+reskv", 0.8),
    ("cam", 0.7),
    ("snapkv+reskv", 0.7, ResidualConfig(final_selection="fit")),
    ("snapkv+reskv", 0.7, ResidualConfig(validate=False)),
    ("snapkv+reskv", 0.7, ResidualConfig(grid=(0.0, 0.3))),
]


def grid_methods():
    return [build_method(name, ratio, residual=rest[0] if rest else None) for name, ratio, *rest in GRID]


@pytest.fixture(scope="module")
def prefill():
    backbone = cached_tiny_backbone("tiny-qwen2", 6, 2)
    return Prefill(backbone, random_prompt(TOKENS, 400, seed=11), 370, grid_methods())


def tensors(cache) -> list[torch.Tensor]:
    """Every buffer a compressed cache decodes from, layer by layer."""
    return [
        buffer
        for layer in cache.layers
        for buffer in (layer._keys, layer._values, layer._bias, layer.entry_count, layer.evicted_fraction)
    ]


@pytest.mark.parametrize("planned", [False, True], ids=["shared", "planned"])
@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_each_configuration_of_a_shared_grid_equals_its_compression_alone(prefill, setting, planned):
    """Sharing what the configurations compute alike, and (planned, as a grid runs, in both settings)
    constructing a setting's all together the first time one is asked for, the context's layers read
    as the first tokens of the whole prompt's stacked copy, gives each its compression alone, bit for
    bit."""
    methods = grid_methods()
    alone = [prefill.compressed(method, setting) for method in methods]
    requests = [(method, planned_setting) for planned_setting in SETTINGS for method in methods]
    with prefill.sharing_construction(requests if planned else ()):
        shared = [prefill.compressed(method, setting) for method in methods]
        if planned and setting == "agnostic":  # the context's stacked keys view the whole prompt's
            (agnostic,), (aware,) = prefill.shared_batches("agnostic"), prefill.shared_batches("aware")
            assert agnostic.stacked().keys.data_ptr() == aware.stacked().keys.data_ptr()
    assert any(sum(map(sum, stats["residual_entries"])) for _, stats in alone)  # entries were built
    for (alone_cache, alone_stats), (shared_cache, shared_stats) in zip(alone, shared, strict=True):
        assert shared_stats == alone_stats
        for got, expected in zip(tensors(shared_cache), tensors(alone_cache), strict=True):
            assert torch.equal(got, expected)


def test_each_configuration_of_a_planned_grid_holds_its_entries_at_its_own_width(prefill):
    """A setting's final entries are clustered at once (``reskv.compress.final_entries``), stacked and
    padded to the widest configuration's; each configuration then holds entries of its own width, as
    alone, not views that would keep the stacked entries alive."""
    methods = [method for method in grid_methods() if method.residual is not None]

    def held(cache) -> list[int]:
        return [layer.residual.keys.untyped_storage().nbytes() for layer in cache.layers]

    alone = [held(prefill.compressed(method, "aware")[0]) for method in methods]
    with prefill.sharing_construction([(method, "aware") for method in methods]):
        planned = [held(prefill.compressed(method, "aware")[0]) for method in methods]
    assert planned == alone
    assert len({sum(nbytes) for nbytes in alone}) > 2  # the configurations' widths differ


def test_a_grid_scores_each_layer_once_per_score_and_builds_one_proxy_per_score_and_residual(
    prefill, monkeypatch
):
    """Twelve configurations of three rules that score alike (SnapKV, AdaKV, CaM: 2 ratios, SnapKV and
    AdaKV with and without ResKV) score the stacked layers once in all, where alone each scored them;
    one validation proxy serves SnapKV+ResKV and AdaKV+ResKV; CaM merges its values once for its two
    ratios."""
    calls = []
    prompt_scores, merge = TokenScorer.prompt_scores, CaM.adjust_values

    def counted(scorer, obs, num_layers=1):
        calls.append(type(scorer).__name__)
        return prompt_scores(scorer, obs, num_layers)

    def merged(scorer, obs, num_layers=1):
        calls.append("merge")
        return merge(scorer, obs, num_layers)

    class CountedProxy(reskv.compress.ValidationProxy):
        def __init__(self, *args, **kwargs):
            calls.append("proxy")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(TokenScorer, "prompt_scores", counted)
    monkeypatch.setattr(CaM, "adjust_values", merged)
    monkeypatch.setattr(reskv.compress, "ValidationProxy", CountedProxy)
    methods = grid_methods()[:8] + [build_method("cam", ratio) for ratio in (0.6, 0.9)]
    layers = prefill.backbone.model.config.num_hidden_layers
    with prefill.sharing_construction([(method, "agnostic") for method in methods]):
        for method in methods:
            prefill.compressed(method, "agnostic")
    assert sorted(calls) == ["SnapKV", "merge", "proxy"]  # the layers stacked: one call each
    calls.clear()
    for method in methods:
        prefill.compressed(method, "agnostic")
    # Alone, at each of 2 ratios: SnapKV, AdaKV and CaM score each layer, and CaM merges each; with
    # ResKV SnapKV and AdaKV score the stack and build a proxy.
    assert len(calls) == 2 * (3 * layers + layers) + 2 * 2 * (1 + 1)


def test_a_planned_setting_reads_the_device_three_times(prefill):
    """A setting's planned grid (every rule of the paper grid, with and without ResKV, two ratios each)
    waits for the device three times whatever its configurations: AdaKV's budgets for all its ratios,
    the sizes every proxy chose, the entries every final k-means kept; host->device copies never
    wait (``scripts.bench.dispatch_counts``)."""
    bases = ("h2o", "tova", "snapkv", "adakv")
    names = [*bases, *(base + "+reskv" for base in bases), "cam"]
    methods = [build_method(name, ratio) for name in names for ratio in (0.6, 0.8)]
    batches = len(shared_batches(prefill.prefilled("aware").cache, 1.0))  # the question's forward ran
    with prefill.sharing_construction([(method, "aware") for method in methods]):
        with count_dispatch() as counts:
            for method in methods:
                prefill.compressed_layers(method, "aware")
    assert counts.syncs == 3 * batches
    assert set(counts.syncs_by_op) == {"tolist"}


@pytest.mark.parametrize("name", ["snapkv", "adakv", "pyramidkv", "tova", "h2o", "streamingllm", "cam"])
@pytest.mark.parametrize("budget", [40, 150, 380])  # below the window, in between, all of the prefix
def test_a_rule_s_budgets_of_stacked_layers_equal_its_budgets_layer_by_layer(prefill, name, budget):
    """``stacked_head_budgets`` (AdaKV's for all layers at once) against ``head_budgets`` per layer."""
    scorer = build_method(name, 0.5).scorer
    observations = prefill.observations("agnostic")
    scores = torch.stack([scorer.prompt_scores(obs) for obs in observations])
    layers = len(observations)
    expected = torch.stack(
        [
            scorer.head_budgets(layer_scores, budget, layer_idx=layer, num_layers=layers)
            for layer, layer_scores in enumerate(scores)
        ]
    )
    got = scorer.stacked_head_budgets(scores, budget, first_layer=0, num_layers=layers)
    assert torch.equal(got, expected)
    assert name != "adakv" or budget != 150 or len(set(got.flatten().tolist())) > 1  # ragged budgets


@pytest.mark.parametrize("name", ["snapkv", "adakv", "pyramidkv", "tova", "h2o", "streamingllm"])
def test_a_base_rule_s_planned_grid_launches_no_op_per_layer(name):
    """A base rule's four ratios constructed as a planned grid launch as many ops for 6 layers as for
    2: its layers are scored, budgeted and gathered as one stack, and a layer without entries launches
    nothing of its own (a GPU's host pays per op, so the construction does not grow with depth)."""
    ops = {}
    for layers in (2, 6):
        backbone = tiny_backbone("tiny-qwen2", 6, 2, num_hidden_layers=layers)
        methods = [build_method(name, ratio) for ratio in (0.6, 0.7, 0.8, 0.9)]
        prefill = Prefill(backbone, random_prompt(TOKENS, 400, seed=11), 370, methods)
        prefill.prefilled("aware")
        with prefill.sharing_construction([(method, "aware") for method in methods]):
            with count_dispatch() as counts:
                for method in methods:
                    prefill.compressed_layers(method, "aware")
        ops[layers] = counts.ops
    assert ops[6] == ops[2]
