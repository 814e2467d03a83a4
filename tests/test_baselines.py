"""The five baseline rules against plain re-computations written loop by loop from baselines.md.

Each rule test builds a small ``LayerObservation``, selects with the shared ``select_main`` and
compares with a reference that uses explicit loops over heads and queries, ``torch.softmax`` per
query, pooling written out as sums, and a sort by (score descending, position ascending).
References work in float64, so the comparisons also pin the fp32 rounding as harmless.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import reskv.scoring
from baselines.adakv import AdaKV, safeguarded_caps
from baselines.h2o import H2O
from baselines.snapkv import WINDOW_FILL, SnapKV
from baselines.tova import TOVA
from reskv.scoring import LayerObservation, accumulated_attention
from reskv.selection import select_main
from tests.conftest import interpreted

D = 4
SCALING = 1 / math.sqrt(D)


def make_obs(
    seq_len: int, kv_heads: int, group: int, observed: int, seed: int = 0, layer_idx: int = 0
) -> tuple[LayerObservation, torch.Tensor]:
    """Random post-RoPE-like tensors; returns the observation and the full prompt queries."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv_heads, seq_len, D, generator=gen)
    values = torch.randn(kv_heads, seq_len, D, generator=gen)
    all_queries = 2 * torch.randn(kv_heads * group, seq_len, D, generator=gen)
    obs = LayerObservation(
        layer_idx=layer_idx,
        keys=keys,
        values=values,
        queries=all_queries[:, seq_len - min(seq_len, observed) :],
        accumulated=None,
        scaling=SCALING,
    )
    return obs, all_queries


# ---- plain references -------------------------------------------------------------------------


def plain_probs(query: torch.Tensor, head_keys: torch.Tensor, position: int) -> list[float]:
    """Softmax of one query at ``position`` over one head's keys, future keys masked."""
    logits = torch.tensor(
        [
            float(query.double() @ head_keys[j].double()) * SCALING if j <= position else -math.inf
            for j in range(head_keys.shape[0])
        ],
        dtype=torch.float64,
    )
    return torch.softmax(logits, dim=0).tolist()


def plain_window_mean(queries, positions, keys, group: int) -> list[list[float]]:
    """Per KV head: mean over its group's heads and over the queries of the attention on each key."""
    kv_heads, seq_len, _ = keys.shape
    result = []
    for kv in range(kv_heads):
        row = [0.0] * seq_len
        for head in range(kv * group, (kv + 1) * group):
            for qi in range(queries.shape[1]):
                probs = plain_probs(queries[head, qi], keys[kv], int(positions[qi]))
                for j in range(seq_len):
                    row[j] += probs[j] / (group * queries.shape[1])
        result.append(row)
    return result


def plain_pool(row: list[float], kernel: int) -> list[float]:
    """avg_pool1d(kernel, stride 1, padding kernel // 2), zero padding counted in the divisor."""
    half = kernel // 2
    return [
        sum(row[c + o] for o in range(-half, half + 1) if 0 <= c + o < len(row)) / kernel
        for c in range(len(row))
    ]


def plain_snapkv(queries, positions, keys, group: int, protected: int, kernel: int) -> list[list[float]]:
    """Prefix scores per KV head: group mean first (of the un-pooled rows), then pooling."""
    prefix_len = keys.shape[1] - min(protected, keys.shape[1])
    return [
        plain_pool(row[:prefix_len], kernel) for row in plain_window_mean(queries, positions, keys, group)
    ]


def plain_kept(prefix_scores: list[list[float]], seq_len: int, window: int, sizes: list[int]) -> torch.Tensor:
    """The last ``window`` tokens (or the last ``size`` if smaller) plus the top ``size - window`` before."""
    window = min(window, seq_len)
    kept = torch.zeros(len(sizes), seq_len, dtype=torch.bool)
    for head, size in enumerate(sizes):
        size = min(size, seq_len)
        for position in range(seq_len - min(size, window), seq_len):
            kept[head, position] = True
        ranked = sorted(range(seq_len - window), key=lambda p, h=head: (-prefix_scores[h][p], p))
        for position in ranked[: max(size - window, 0)]:
            kept[head, position] = True
    return kept


def f64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def kept_by(scorer, obs: LayerObservation, budget: int) -> torch.Tensor:
    scores = scorer.prompt_scores(obs)
    return select_main(scores, scorer.window, scorer.head_budgets(scores, budget))


# ---- SnapKV -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_len", "group", "observed", "budget"),
    [(24, 1, 8, 10), (40, 2, 8, 12), (40, 2, 3, 9), (17, 2, 8, 4), (3, 1, 8, 2)],
    ids=["mha", "gqa", "fewer-queries-than-window", "budget-below-window", "prompt-shorter-than-window"],
)
def test_snapkv_matches_plain_rule(seq_len, group, observed, budget):
    obs, _ = make_obs(seq_len, 2, group, observed, seed=seq_len + group)
    scorer = SnapKV(window=4)
    scores = scorer.prompt_scores(obs)
    queries = obs.queries[:, -4:]  # the window; all observed queries when fewer than 4
    expected = plain_snapkv(queries, obs.query_positions[-4:], obs.keys, group, 4, 5)
    prefix_len = seq_len - min(4, seq_len)
    assert torch.allclose(scores[:, :prefix_len].double(), f64(expected).reshape(2, -1), atol=1e-6)
    assert (scores[:, prefix_len:] == WINDOW_FILL).all()
    assert torch.equal(kept_by(scorer, obs, budget), plain_kept(expected, seq_len, 4, [budget, budget]))


def test_snapkv_scores_a_prefix_with_fit_queries_as_the_window():
    """The validation proxy's use: the fit queries act as the window over the prefix before the
    validation queries, whose last 4 tokens are the protected window (reskv.md)."""
    obs, all_queries = make_obs(30, 2, 2, 12, seed=3)
    fit_queries, fit_positions = all_queries[:, 18:26], range(18, 26)
    expected = plain_snapkv(fit_queries, fit_positions, obs.keys[:, :26], 2, 4, 5)
    scores = SnapKV(window=4).score(obs.keys[:, :26], fit_queries, fit_positions, SCALING)
    assert scores.shape == (2, 26)
    assert torch.allclose(scores[:, :22].double(), f64(expected), atol=1e-6)
    assert (scores[:, 22:] == WINDOW_FILL).all()


def test_snapkv_keeps_the_pooled_neighbourhood_of_the_attended_token():
    """All window queries look at key 5 only: pooling makes tokens 3..7 the top five, and the zero
    padding (counted in the divisor) ranks the edge tokens below the flat middle."""
    keys = torch.zeros(1, 20, D)
    keys[0, 5, 0] = 10.0
    queries = torch.zeros(1, 4, D)
    queries[..., 0] = 1.0
    obs = LayerObservation(0, keys, torch.zeros_like(keys), queries, None, SCALING)
    scores = SnapKV(window=4).prompt_scores(obs)
    kept = kept_by(SnapKV(window=4), obs, 4 + 5)
    assert kept[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 16, 17, 18, 19]
    assert scores[0, 0] < scores[0, 10] and scores[0, 15] < scores[0, 10]


# ---- H2O --------------------------------------------------------------------------------------


def plain_column_sums(queries, positions, keys, group: int) -> list[list[float]]:
    """H2O: per KV head, the group mean of the plain sums of every query's attention on each key."""
    rows = plain_window_mean(queries, positions, keys, group)
    return [[value * queries.shape[1] for value in row] for row in rows]  # undo the query mean


@pytest.mark.parametrize("group", [1, 2])
def test_h2o_matches_plain_column_sums(group, monkeypatch):
    monkeypatch.setattr(reskv.scoring, "QUERY_CHUNK", 7)  # the chunked sum must not depend on chunks
    obs, all_queries = make_obs(32, 2, group, 8, seed=5 + group)
    positions = range(32)
    obs.accumulated = accumulated_attention(all_queries, obs.keys, positions, SCALING)
    expected = plain_column_sums(all_queries, positions, obs.keys, group)
    assert torch.allclose(obs.accumulated.double(), f64(expected), atol=1e-5)
    scorer = H2O(window=4)
    assert scorer.needs_accumulated_attention
    assert torch.allclose(scorer.prompt_scores(obs).double(), f64(expected), atol=1e-5)  # the sums themselves
    prefix = [row[:28] for row in expected]
    assert torch.equal(kept_by(scorer, obs, 11), plain_kept(prefix, 32, 4, [11, 11]))


@pytest.mark.parametrize(
    ("group", "num_keys", "num_queries", "dim", "tiles"),
    [
        (1, 150, 150, 64, (64, 64)),  # a prefill
        (2, 150, 100, 80, (64, 64)),  # a question forward
        (2, 150, 101, 32, (16, 16)),  # the tile from key 64 on first seen by query 15 of a tile
        (4, 70, 3, 16, (16, 32)),  # a few tokens
    ],
)
def test_h2o_column_sums_kernel_matches_plain_column_sums(group, num_keys, num_queries, dim, tiles, tmp_path):
    """``reskv/attention_sums_kernel.py``'s column sums under Triton's interpreter (fp32 inputs): each
    query head's column sums over causal softmax attention, here averaged over each group as H2O does,
    equal the plain loop's within fp32 rounding. Ragged tiles (150 = 2 x 64 + 22 keys), queries
    starting mid-way (a forward that extends a cache), grouped query heads, a head dim that is no
    power of two, a key tile whose first reader is the last query of a tile, keys a prefix of a longer
    cache's (its heads' stride, not copied)."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(group)
    kv_heads = 2
    queries = torch.randn(kv_heads * group, num_queries, dim, generator=generator)
    keys = torch.randn(kv_heads, num_keys + 9, dim, generator=generator)[:, :num_keys]
    first = num_keys - num_queries
    case = (queries, keys, first, SCALING, *tiles)
    (sums,) = interpreted("reskv.attention_sums_kernel:column_sums", [case], tmp_path)
    assert sums.shape == (kv_heads * group, num_keys) and sums.dtype == torch.float32
    positions = torch.arange(first, num_keys)
    expected = [
        [value * num_queries for value in row]  # undo the query mean
        for row in plain_window_mean(queries, positions, keys, group)
    ]
    got = sums.reshape(kv_heads, group, num_keys).mean(dim=1)
    assert torch.allclose(got.double(), f64(expected), rtol=1e-5, atol=1e-6)
    assert torch.allclose(
        got.sum(-1), torch.full((kv_heads,), float(num_queries)), rtol=1e-5
    )  # rows sum to 1


def test_h2o_sums_are_not_normalised():
    """Uniform attention: query t gives 1/(t+1) to each key <= t, so key j collects the tail of the
    harmonic series; an average over the queries that see j would be flat instead."""
    obs = LayerObservation(
        0, torch.zeros(1, 12, D), torch.zeros(1, 12, D), torch.zeros(1, 12, D), None, SCALING
    )
    sums = accumulated_attention(torch.zeros(1, 12, D), obs.keys, range(12), SCALING)
    harmonic_tail = [sum(1 / (t + 1) for t in range(j, 12)) for j in range(12)]
    assert torch.allclose(sums[0].double(), f64(harmonic_tail), atol=1e-6)


def test_h2o_window_only_and_prefix_scores_sum_over_their_queries():
    obs, all_queries = make_obs(30, 2, 2, 10, seed=11)
    scorer = H2O(window=4, window_only=True)
    assert not scorer.needs_accumulated_attention
    window_sums = plain_column_sums(obs.queries[:, -4:], torch.arange(26, 30), obs.keys, 2)
    assert torch.allclose(scorer.prompt_scores(obs).double(), f64(window_sums), atol=1e-6)
    fit_sums = plain_column_sums(all_queries[:, 10:20], torch.arange(10, 20), obs.keys[:, :20], 2)
    fit = H2O(window=4).score(obs.keys[:, :20], all_queries[:, 10:20], range(10, 20), SCALING)
    assert torch.allclose(fit.double(), f64(fit_sums), atol=1e-6)


def test_h2o_requires_the_prefill_statistic():
    obs, _ = make_obs(10, 1, 1, 4)
    with pytest.raises(ValueError, match="accumulated"):
        H2O().prompt_scores(obs)


# ---- TOVA -------------------------------------------------------------------------------------


def plain_tova(query_rows, position: int, keys, group: int) -> list[float]:
    """Mean over all query heads of the last query's attention (head h reads KV head h // group)."""
    heads = query_rows.shape[0]
    rows = [plain_probs(query_rows[h], keys[h // group], position) for h in range(heads)]
    return [sum(row[j] for row in rows) / heads for j in range(keys.shape[1])]


@pytest.mark.parametrize("group", [1, 2])
def test_tova_matches_plain_rule_with_one_selection_per_layer(group):
    obs, all_queries = make_obs(24, 2, group, 6, seed=7 + group)
    scorer = TOVA()
    expected = plain_tova(obs.queries[:, -1], 23, obs.keys, group)
    scores = scorer.prompt_scores(obs)
    assert torch.allclose(scores.double(), f64([expected, expected]), atol=1e-6)
    kept = kept_by(scorer, obs, 6)
    assert torch.equal(kept, plain_kept([expected[:23]] * 2, 24, 1, [6, 6]))
    fit = scorer.score(obs.keys[:, :15], all_queries[:, 5:15], range(5, 15), SCALING)
    fit_expected = plain_tova(all_queries[:, 14], 14, obs.keys[:, :15], group)
    assert torch.allclose(fit[1].double(), f64(fit_expected), atol=1e-6)


def test_tova_kv_heads_share_the_layer_choice():
    """KV head 0 alone would keep token 3, head 1 token 8; the layer mean picks 8 (the sharper
    spike) for both."""
    keys = torch.zeros(2, 12, D)
    keys[0, 3, 0], keys[1, 8, 0] = 6.0, 12.0
    queries = torch.zeros(4, 1, D)
    queries[..., 0] = 1.0
    obs = LayerObservation(0, keys, torch.zeros_like(keys), queries, None, SCALING)
    kept = kept_by(TOVA(), obs, 2)
    assert kept[0].nonzero().flatten().tolist() == kept[1].nonzero().flatten().tolist() == [8, 11]


# ---- AdaKV ------------------------------------------------------------------------------------


def plain_caps(prefix_scores: list[list[float]], per_head: int, alpha: Fraction) -> list[int]:
    """Counts in the flattened top H*B (ties: lower head, then lower position), safeguard, then
    largest-remainder rounding with ties to the lower head, all in exact fractions."""
    heads = len(prefix_scores)
    flat = sorted(
        (
            (score, head, position)
            for head, row in enumerate(prefix_scores)
            for position, score in enumerate(row)
        ),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    counts = [0] * heads
    for _, head, _ in flat[: heads * per_head]:
        counts[head] += 1
    exact = [count * (1 - alpha) + alpha * per_head for count in counts]
    caps = [math.floor(value) for value in exact]
    by_remainder = sorted(range(heads), key=lambda h: (-(exact[h] - caps[h]), h))
    for head in by_remainder[: heads * per_head - sum(caps)]:
        caps[head] += 1
    return caps


@pytest.mark.parametrize("group", [1, 2])
def test_adakv_budgets_and_selection_match_plain_rule(group):
    obs, _ = make_obs(36, 3, group, 8, seed=13 + group)
    scorer = AdaKV(window=4)
    scores = scorer.prompt_scores(obs)
    prefix = plain_snapkv(obs.queries[:, -4:], obs.query_positions[-4:], obs.keys, group, 4, 5)
    for budget in range(0, 42):
        sizes = scorer.head_budgets(scores, budget)
        assert int(sizes.sum()) == 3 * budget
        if 4 < budget < 36:
            expected = [cap + 4 for cap in plain_caps(prefix, budget - 4, Fraction(1, 5))]
        else:  # nothing to reallocate: inside the window, or the whole prefix fits
            expected = [budget] * 3
        assert sizes.tolist() == expected
        kept = select_main(scores, 4, sizes)
        assert torch.equal(kept, plain_kept(prefix, 36, 4, expected))
        assert int(kept.sum()) == 3 * min(budget, 36)


def test_main_selections_of_every_budget_at_once_are_the_plain_rule_s():
    """``select_main`` of main sizes ``[budgets, H]`` (a grid's ratios over one ranking) selects for
    every budget what the plain rule keeps, from below the window to the whole prompt."""
    obs, _ = make_obs(36, 3, 2, 8, seed=15)
    scorer = AdaKV(window=4)
    scores = scorer.prompt_scores(obs)
    prefix = plain_snapkv(obs.queries[:, -4:], obs.query_positions[-4:], obs.keys, 2, 4, 5)
    every = [scorer.head_budgets(scores, budget).tolist() for budget in range(42)]
    kept = select_main(scores, 4, torch.tensor(every))
    assert kept.shape == (42, 3, 36)
    for sizes, found in zip(every, kept, strict=True):
        assert torch.equal(found, plain_kept(prefix, 36, 4, sizes))


def test_adakv_largest_remainder_ties_go_to_the_lower_head():
    """B = 2 over 3 heads; head counts (5, 0, 1) or (0, 5, 1) give caps (4.4, 0.4, 1.2) or
    (0.4, 4.4, 1.2): one slot short, remainders .4 tie and head 0 takes it."""
    spike = [10.0, 9.0, 8.0, 7.0, 6.0, 0.0, 0.0, 0.0]
    single = [5.5] + [0.0] * 7
    flat = [0.0] * 8
    assert safeguarded_caps(torch.tensor([spike, flat, single]), 2, 0.2).tolist() == [5, 0, 1]
    assert safeguarded_caps(torch.tensor([flat, spike, single]), 2, 0.2).tolist() == [1, 4, 1]


def test_adakv_flattened_ties_prefer_lower_head_then_position():
    """Equal scores everywhere: the top 6 are head 0's five tokens and head 1's first."""
    caps = safeguarded_caps(torch.zeros(2, 5), 3, 0.2)
    assert caps.tolist() == plain_caps([[0.0] * 5] * 2, 3, Fraction(1, 5)) == [5, 1]


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_adakv_other_alphas(alpha):
    gen = torch.Generator().manual_seed(17)
    scores = torch.rand(4, 20, generator=gen) ** 3
    caps = safeguarded_caps(scores, 7, alpha)
    assert int(caps.sum()) == 28 and int(caps.max()) <= 20
    assert caps.tolist() == plain_caps(scores.double().tolist(), 7, Fraction(alpha).limit_denominator(100))
