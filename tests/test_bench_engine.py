"""The engine benchmark (scripts.bench.engine): its FLOP accounting against hand-counted operations,
and how its decode timing steps the caches."""

from __future__ import annotations

import statistics
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from baselines import build_method
from reskv.engine import Prefill
from scripts.bench import engine
from scripts.bench.engine import counted_gflop, decode_seconds_per_token, paired_ratio
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone


def test_counted_flops_of_a_matmul_and_of_causal_and_full_attention():
    a, b = torch.randn(3, 5), torch.randn(5, 7)
    # [3, 5] @ [5, 7]: 3 * 7 outputs, 5 multiply-adds each.
    assert counted_gflop(torch.matmul, a, b) * 1e9 == 2 * 3 * 7 * 5
    query, key, value = (torch.randn(1, 2, 8, 4) for _ in range(3))
    # Per head q k^T and p v over 8 x 8 positions, head dim 4: 2 * (2 * 8 * 8 * 4) = 1024.
    full = 2 * 1024
    assert counted_gflop(F.scaled_dot_product_attention, query, key, value) * 1e9 == full
    # The causal kernel skips the masked half.
    causal = counted_gflop(F.scaled_dot_product_attention, query, key, value, None, 0.0, True)
    assert causal * 1e9 == full // 2
    # Grouped-query attention: 4 query heads over 2 key/value heads, each query head as above.
    query = torch.randn(1, 4, 8, 4)
    grouped = counted_gflop(
        partial(F.scaled_dot_product_attention, is_causal=True, enable_gqa=True), query, key, value
    )
    assert grouped * 1e9 == 4 * 1024 // 2


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_decode_timing_steps_each_cache_in_turn_in_the_mode_asked(decode, monkeypatch):
    """Lockstep (A B A B ...) over the asked step function, the compiled one with one untimed first
    step per cache, and medians over the timed steps only. The compiled step is a spy around the eager
    one here (no compilation); each step advances a fake clock by a duration that names the cache and
    the step, so the medians are known."""
    prefill = Prefill(cached_tiny_backbone("tiny-llama", 4, 2), random_prompt(TOKENS, 120, seed=0), 100)
    next_logits = Prefill.next_logits
    clock, stepped = [0.0], []  # stepped: the caches of the asked mode's steps, in call order

    def spy(mode):
        def step(self, token_ids, cache):
            if mode == decode:
                stepped.append(id(cache))
                caches = list(dict.fromkeys(stepped))
                clock[0] += 1000 * caches.index(id(cache)) + stepped.count(id(cache))
            return next_logits(self, token_ids, cache)

        return step

    monkeypatch.setattr(Prefill, "compiled_next_logits", spy("compiled"))
    monkeypatch.setattr(Prefill, "next_logits", spy("eager"))
    monkeypatch.setattr("scripts.bench.engine.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    methods = {name: build_method(name, 0.5) for name in ("snapkv", "snapkv+reskv")}
    seconds = decode_seconds_per_token(prefill, methods, 3, decode=decode)
    untimed = 1 if decode == "compiled" else 0
    looped = stepped[-2 * (3 + untimed) :]  # the eager first answer token is stepped before, eagerly
    assert looped[0] != looped[1] and looped == looped[:2] * (3 + untimed)
    assert len(stepped) == len(looped) + (decode == "eager")
    # A cache's n-th step (from 1) takes 1000 * its rank + n; the untimed first one is left out.
    rank = list(dict.fromkeys(stepped)).index(looped[0])
    assert seconds["snapkv"] == 1000 * rank + statistics.median(range(1 + untimed, 4 + untimed))


def test_the_engine_benchmark_fills_every_column_of_its_rows(monkeypatch, capsys):
    """``main`` end to end on the embedded model at a short prompt, the compiled step stood in for by
    the eager one (no compilation): every column of the speed table holds a figure."""
    monkeypatch.setattr(Prefill, "compiled_next_logits", Prefill.next_logits)
    arguments = ["--lengths", "400", "--ratios", "0.9", "--decode-tokens", "2", "--rounds", "1"]
    engine.main([*arguments, "--skip-memory", "--count-lengths"])
    rows = [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("│")
    ]
    speed = [row for row in rows if len(row) == 18]
    assert len(speed) == 1 and all(speed[0]) and speed[0][1] == "0.9"


def test_a_paired_ratio_divides_each_step_by_its_partner():
    """Steps that grow tenfold from one pair to the next (the machine's speed drifting), each +ResKV
    step twice its partner: every paired ratio is 2, where steps paired otherwise differ by powers of
    ten. With 8 pairs the 95% interval is the extremes (P(X = 0) = 1/256, P(X <= 1) = 9/256)."""
    snapkv = [10.0**power for power in range(8)]
    samples = {"snapkv": snapkv, "snapkv+reskv": [2 * seconds for seconds in snapkv]}
    assert paired_ratio(samples, "snapkv+reskv", "snapkv") == "2.000 [2.000, 2.000]"
    samples["snapkv+reskv"][3] = 3 * snapkv[3]  # one pair off: the median stays, the interval widens
    assert paired_ratio(samples, "snapkv+reskv", "snapkv") == "2.000 [2.000, 3.000]"
