"""PyramidKV's layer budgets follow KVCache-Factory's beta = 20 pyramid and average b exactly."""

from __future__ import annotations

import pytest
import torch

from baselines.pyramidkv import PyramidKV, pyramid_budgets
from baselines.snapkv import SnapKV
from reskv.config import budget_for
from reskv.scoring import LayerObservation


def upstream_prefix_counts(capacity: int, window: int, layers: int, q_len: int, beta: int = 20) -> list[int]:
    """KVCache-Factory ``PyramidKVCluster.update_kv``'s prefix tokens kept per layer, as written
    there (floored ``steps``), for a prompt long enough for its pyramid branch."""
    min_num = (capacity - window) // beta
    max_num = (capacity - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (capacity - window) * 2 - max_num
    steps = (max_num - min_num) // (layers - 1)
    return [max_num - layer * steps for layer in range(layers)]


@pytest.mark.parametrize(
    ("budget", "seq_len", "layers"),
    [(400, 4000, 30), (410, 4096, 32), (819, 4096, 32), (400, 740, 30), (100, 1000, 12), (60, 300, 2)],
)
def test_layer_budgets_are_upstreams_pyramid_rounded_to_sum_to_every_layers_b(budget, seq_len, layers):
    window = 32
    budgets = pyramid_budgets(budget, seq_len, layers, window, 20)
    upstream = [count + window for count in upstream_prefix_counts(budget, window, layers, seq_len)]
    assert sum(budgets) == budget * layers  # upstream's average exceeds C by its floored steps
    # The same first layer; the last is upstream's min_num (its floored steps stop short of it).
    assert budgets[0] == upstream[0] and budgets[-1] == 2 * budget - upstream[0]
    assert upstream[-1] - budgets[-1] == (upstream[0] - budgets[-1]) % (layers - 1)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] <= seq_len
    line = torch.linspace(upstream[0], budget * 2 - upstream[0], layers, dtype=torch.float64)
    assert (torch.tensor(budgets, dtype=torch.float64) - line).abs().max() < 1


def test_upstream_clamps_the_first_layer_to_the_prompt_and_shifts_the_last_up():
    # C = 400, W = 32, L = 740: max_num 718 >= 708 = L - W, so max_num = 708 and min_num = 28.
    budgets = pyramid_budgets(400, 740, 30, 32, 20)
    assert budgets[0] == 740 and budgets[-1] == 60


@pytest.mark.parametrize(("budget", "seq_len"), [(600, 1000), (30, 1000), (400, 400)])
def test_uniform_budgets_where_upstream_keeps_c_everywhere_or_the_window_fills_the_budget(budget, seq_len):
    # L < 2 (C - W): upstream's SnapKV branch; C <= W: this project's shared fallback.
    assert pyramid_budgets(budget, seq_len, 8, 32, 20) == [budget] * 8


def test_scores_are_snapkvs_with_the_32_token_window():
    generator = torch.Generator().manual_seed(0)
    obs = LayerObservation(
        layer_idx=0,
        keys=torch.randn(2, 200, 8, generator=generator),
        values=torch.randn(2, 200, 8, generator=generator),
        queries=torch.randn(4, 128, 8, generator=generator),
        accumulated=None,
        scaling=8**-0.5,
    )
    assert torch.equal(PyramidKV().prompt_scores(obs), SnapKV(window=32).prompt_scores(obs))


def test_head_budgets_name_the_layer_arguments_the_compressor_must_pass():
    scores = torch.zeros(2, 4000)
    with pytest.raises(ValueError, match=r"head_budgets\(scores, budget, layer_idx=..., num_layers=...\)"):
        PyramidKV().head_budgets(scores, 400)
    budgets = [PyramidKV().head_budgets(scores, 400, layer_idx=layer, num_layers=30) for layer in range(30)]
    assert [int(b[0]) for b in budgets] == pyramid_budgets(400, 4000, 30, 32, 20)
    assert all(torch.equal(b, b[:1].expand(2)) for b in budgets)


def test_a_compressed_prompt_keeps_the_pyramid_in_every_layer():
    from baselines import build_method
    from reskv.engine import Prefill
    from scripts.measure import random_prompt
    from tests.conftest import TOKENS, cached_tiny_backbone

    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    method = build_method("pyramidkv", 0.8)
    prefill = Prefill(backbone, random_prompt(TOKENS, 600, seed=2), 600, [method])
    stats = prefill.generate(method, "aware", 2).cache_stats
    budget = budget_for(600, 0.8)
    expected = pyramid_budgets(budget, 600, backbone.num_layers, 32, 20)
    assert [max(heads) for heads in stats["main_slots"]] == expected
