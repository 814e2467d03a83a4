"""The shared measurement helper (scripts.measure) against allocations of known size."""

from __future__ import annotations

import math
import random

import torch

from reskv.backbones import random_backbone
from scripts import measure
from scripts.bench.dispatch_counts import count_dispatch
from scripts.machine import cpu_model
from scripts.measure import (
    machine,
    median_interval,
    peak_allocated,
    peak_memory,
    peak_site,
    random_prompt,
)

MIB = 2**20


def test_peak_memory_rises_by_a_tensor_allocated_in_the_block():
    """The peak sees a 256 MiB tensor freed before the block ends. Nine tenths of it, not all: the
    resident set may shrink between the two blocks on a loaded machine."""
    with peak_memory("cpu") as idle:
        pass
    with peak_memory("cpu") as busy:
        held = torch.ones(256 * MIB // 4)  # ones: every page written, so resident
        del held
    assert busy.bytes - idle.bytes >= 0.9 * 256 * MIB


def test_peak_memory_on_cpu_adds_the_peak_allocated_to_the_resident_size_at_entry(monkeypatch):
    monkeypatch.setattr(measure, "proc_status_bytes", {"VmRSS": 1000}.__getitem__)
    with peak_memory("cpu") as peak:
        for _ in range(2):
            held = torch.ones(4 * MIB // 4)
            del held
    assert peak.bytes == 1000 + 4 * MIB
    assert peak.kind == "RSS at entry + peak allocated"


def test_peak_allocated_counts_what_is_held_at_once_not_the_sum():
    _before = torch.ones(MIB // 4)  # allocated before the block: not counted
    with peak_allocated("cpu") as peak:
        for _ in range(3):
            transient = torch.ones(4 * MIB // 4)
            del transient
    assert peak.bytes == 4 * MIB


def test_random_prompt_draws_from_the_vocabulary_as_torch_randint_does():
    prompt = random_prompt(range(100, 40000), 500, seed=3)
    generator = torch.Generator().manual_seed(3)
    assert prompt == torch.randint(100, 40000, (500,), generator=generator).tolist()
    assert set(random_prompt([7, 11], 50, seed=0)) == {7, 11}


def test_machine_names_the_cores_threads_and_load():
    info = machine()
    assert info["torch_threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert len(info["load_average"]) == 3 and info["cpu_count"] >= 1
    assert info["cpu"] == cpu_model()  # tests/test_devices.py checks it


def test_peak_site_finds_a_wide_mlp_product_of_the_last_layer():
    # With the MLP 16 times wider than the residual stream, a forward's peak is the product
    # act(gate(x)) * up(x) of its last layer (transformers' LlamaMLP): three [s, I] tensors alive.
    torch.manual_seed(0)
    intermediate, tokens = 1024, 256
    backbone = random_backbone(
        "llama3.1-8b-instruct",
        torch.float32,
        "cpu",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=intermediate,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    )
    ids = torch.randint(1, 512, (1, tokens))
    with torch.inference_mode(), peak_site(backbone.model) as site:
        backbone.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    assert site.modules[-2:] == ["model.layers.1", "model.layers.1.mlp"] and site.op == "aten::mul"
    assert site.bytes >= 3 * intermediate * tokens * 4
    # The hooks that marked the modules are removed at exit.
    assert all(not module._forward_pre_hooks for module in backbone.model.modules())


def test_recorded_matmuls_keep_each_products_layout_and_replay_it(monkeypatch):
    """An expanded bias keeps its zero strides and a transposed operand its swapped ones (the
    layouts the BLAS call sees); elementwise ops are not recorded; each product is replayed once
    more, timed, into its warm-up's output."""
    centres, points, norms = torch.randn(2, 5, 4), torch.randn(2, 7, 4), torch.randn(2, 5)
    queries, keys = torch.randn(3, 4), torch.randn(6, 4)

    def work():
        torch.baddbmm(norms[:, None, :].expand(2, 7, 5), points, centres.transpose(1, 2), alpha=-2).amin(-1)
        return (queries @ keys.T).softmax(-1)

    calls = measure.recorded_matmuls(work)
    assert [call.op for call in calls] == [torch.ops.aten.baddbmm.default, torch.ops.aten.mm.default]
    assert calls[0].arguments[:3] == (
        ((2, 7, 5), (5, 0, 1), torch.float32),
        ((2, 7, 4), (28, 4, 1), torch.float32),
        ((2, 4, 5), (20, 1, 4), torch.float32),
    )
    assert calls[0].keywords == {"alpha": -2}
    assert calls[1].arguments == (((3, 4), (4, 1), torch.float32), ((4, 6), (1, 4), torch.float32))
    for call in calls:
        operands = [operand for operand in call.operands() if isinstance(operand, torch.Tensor)]
        recorded = [argument for argument in call.arguments if isinstance(argument, tuple)]
        assert [(tuple(o.shape), o.stride(), o.dtype) for o in operands] == [
            (tuple(size), stride, dtype) for size, stride, dtype in recorded
        ]
    ticks = iter([0, 5, 10, 12, 20, 29, 30, 37, 40, 41, 50, 58])  # runs of 5, 2, 9 and 7, 1, 8 ticks
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(ticks))
    with count_dispatch() as counts:
        assert measure.replayed_matmul_seconds(work, repeats=3) == 2 + 1  # each product's fastest run
    assert next(ticks, None) is None
    # The block once, then each product's warm-up and its three timed runs.
    assert (counts.by_op["baddbmm"], counts.by_op["mm"]) == (1 + 1 + 3, 1 + 1 + 3)


def test_median_interval_takes_the_ranks_of_the_binomial_tails_by_hand():
    """95%: n = 10 keeps ranks 2 and 9 (P(X <= 1) = 11/1024 = 0.011, P(X <= 2) = 56/1024 = 0.055 for
    X ~ Binomial(10, 1/2)); n = 32 ranks 10 and 23 (P(X <= 9) = 0.0100, P(X <= 10) = 0.0251); n = 6
    the extremes (1/64 = 0.016); n = 5 none (1/32 = 0.031 > 0.025)."""
    shuffled = random.Random(0).sample(range(1, 11), 10)
    assert median_interval(shuffled) == (5.5, 2, 9)
    assert median_interval([float(v) for v in range(1, 33)]) == (16.5, 10.0, 23.0)
    assert median_interval([3, 1, 2, 6, 5, 4]) == (3.5, 1, 6)
    assert median_interval([1, 2, 3, 4, 5]) == (3, -math.inf, math.inf)


def test_median_interval_holds_the_true_median_at_least_as_often_as_it_says():
    """Exponential draws (median ln 2), 20 at a time: the sign-test interval's exact coverage there is
    1 - 2 P(X <= 5) = 0.959 for X ~ Binomial(20, 1/2); 4,000 trials estimate it within about 0.003."""
    draws = random.Random(1)
    trials = 4000
    covered = 0
    for _ in range(trials):
        _, low, high = median_interval([draws.expovariate(1.0) for _ in range(20)])
        covered += low <= math.log(2) <= high
    assert 0.95 <= covered / trials <= 0.97
