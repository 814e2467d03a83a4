"""The validation proxy as a simulated decode (reskv.md, "Validation proxy: a simulated decode").

The reference below is written from the spec in float64 with plain loops over heads, candidates
and validation queries: its own softmax, its own fit scores, its own top-k and its own k-means.
It calls none of the proxy's code.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch

import reskv.proxy
from baselines import build_method, build_scorer
from reskv.compress import ResidualConfig, budget_for, compress_layer
from reskv.config import candidate_sizes, residual_size
from reskv.engine import Prefill
from reskv.proxy import ValidationProxy, observation_split
from reskv.scoring import LayerObservation
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone, interpreted
from tests.test_baselines import plain_caps

PROMPT_LENGTH = 300
RATIO = 0.5
WINDOWS = {"snapkv": 64, "adakv": 64, "h2o": 64, "tova": 1}
BASES = tuple(WINDOWS)
FIT, VALIDATION = 96, 32


@pytest.fixture(
    scope="module", params=[("tiny-llama", 4, 2), ("tiny-qwen2", 6, 2)], ids=["llama-g2", "qwen2-g3"]
)
def observation(request) -> LayerObservation:
    prefill = Prefill(
        cached_tiny_backbone(*request.param),
        random_prompt(TOKENS, PROMPT_LENGTH, seed=11),
        PROMPT_LENGTH,
        [build_method("h2o", RATIO)],  # records H2O's prefill statistic for the deployed scores
    )
    return prefill.prefilled("agnostic").cache.layers[1].observation(1, prefill.scaling)


# ---- float64 reference, written from reskv.md --------------------------------------------------


def own_softmax(logits: torch.Tensor) -> torch.Tensor:
    weights = torch.exp(logits - logits.max())
    return weights / weights.sum()


def causal_probs(query: torch.Tensor, keys: torch.Tensor, position: int, scaling: float) -> torch.Tensor:
    """One query's attention over ``keys`` (one head), zero after ``position``."""
    probs = torch.zeros(keys.shape[0], dtype=torch.float64)
    probs[: position + 1] = own_softmax(keys[: position + 1].double() @ query.double() * scaling)
    return probs


def reference_fit_scores(base: str, obs: LayerObservation, boundary: int) -> list[torch.Tensor]:
    """Per KV head, the base rule's scores over ``S' = [0, boundary)`` from the fit queries."""
    keys, group = obs.keys[:, :boundary], obs.group_size
    fit_queries = obs.queries[:, :FIT]  # positions boundary - 96 .. boundary - 1
    positions = range(boundary - FIT, boundary)
    if base == "tova":  # the last fit query, averaged over every query head of the layer
        row = (
            sum(
                causal_probs(fit_queries[h, -1], keys[h // group], boundary - 1, obs.scaling)
                for h in range(obs.queries.shape[0])
            )
            / obs.queries.shape[0]
        )
        return [row] * obs.num_kv_heads
    rows = []
    for kv in range(obs.num_kv_heads):
        total = torch.zeros(boundary, dtype=torch.float64)
        for h in range(kv * group, (kv + 1) * group):
            for i, position in enumerate(positions):
                total += causal_probs(fit_queries[h, i], keys[kv], position, obs.scaling)
        if base == "h2o":  # plain column sums, mean over the group
            rows.append(total / group)
            continue
        mean = total / (group * FIT)  # SnapKV / AdaKV: mean over the window, then pooled (kernel 5)
        prefix = boundary - WINDOWS[base]
        pooled = torch.zeros(boundary, dtype=torch.float64)
        for c in range(prefix):
            pooled[c] = sum(mean[j] for j in range(c - 2, c + 3) if 0 <= j < prefix) / 5
        rows.append(pooled)
    return rows


def reference_kept(scores: torch.Tensor, length: int, window: int, size: int) -> list[int]:
    """``P ∪ Top_{size-|P|}`` over positions ``0 .. length-1`` (ties toward the lower position)."""
    window = min(window, length)
    if size <= window:
        return list(range(length - max(size, 0), length))
    ranked = sorted(range(length - window), key=lambda p: (-float(scores[p]), p))
    return sorted(ranked[: size - window]) + list(range(length - window, length))


def reference_entries(keys, values, evicted: list[int], scores, size: int, iterations: int = 4):
    """Lloyd k-means on the evicted keys, init from the top-``size`` scored ones; empty clusters dropped."""
    size = min(size, len(evicted))
    if size == 0:
        return []
    init = sorted(evicted, key=lambda p: (-float(scores[p]), p))[:size]
    centres = [keys[p].double() for p in init]
    for _ in range(iterations):
        members = [[] for _ in range(size)]
        for p in evicted:
            distances = [float(((keys[p].double() - centre) ** 2).sum()) for centre in centres]
            members[distances.index(min(distances))].append(p)  # ties: the lower centre index
        centres = [
            torch.stack([keys[p].double() for p in group]).mean(0) if group else centre
            for group, centre in zip(members, centres, strict=True)
        ]
    return [
        (centre, torch.stack([values[p].double() for p in group]).mean(0), len(group))
        for group, centre in zip(members, centres, strict=True)
        if group
    ]


def reference_output(query, main_keys, main_values, entries, scaling, rule: ResidualConfig) -> torch.Tensor:
    """The shared-softmax decode rule with its gate, one query, float64."""
    query = query.double()
    main_logits = main_keys.double() @ query * scaling
    peak = float(own_softmax(main_logits).max())
    gate = max(rule.g_min, 1 / (1 + math.exp(-rule.alpha * (rule.tau - peak))))
    logits, values = [main_logits], [main_values.double()]
    for key, value, count in entries:
        logits.append((key @ query * scaling + rule.beta * math.log(count) + math.log(gate)).reshape(1))
        values.append(value.reshape(1, -1))
    return own_softmax(torch.cat(logits)) @ torch.cat(values)


def reference_errors(obs, kv: int, scores, budget: int, size: int, window: int, rule: ResidualConfig):
    """Per validation query (group head major) of KV head ``kv``: ``||ô - o_S||²`` for the candidate
    with ``m' = b - r - 32`` main tokens of ``S'`` and ``r`` entries of ``E' = S' \\ M'``."""
    boundary = obs.seq_len - VALIDATION
    keys, values = obs.keys[kv], obs.values[kv]
    main = reference_kept(scores, boundary, window, budget - size - VALIDATION)
    evicted = [p for p in range(boundary) if p not in set(main)]
    entries = reference_entries(keys, values, evicted, scores, size)
    errors = []
    for h in range(kv * obs.group_size, (kv + 1) * obs.group_size):
        for i in range(VALIDATION):
            t = boundary + i
            query = obs.queries[h, FIT + i]
            seen = main + list(range(boundary, t + 1))
            output = reference_output(query, keys[seen], values[seen], entries, obs.scaling, rule)
            exact = causal_probs(query, keys, t, obs.scaling) @ values.double()
            errors.append(float(((output - exact) ** 2).sum()))
    return errors, entries


def reference_prompt_scores(obs: LayerObservation, base: str = "snapkv") -> list[list[float]]:
    """Deployed scores per KV head over the prefix before the protected window: SnapKV's from the
    last 64 queries, pooled; TOVA's from the last query, averaged over every query head."""
    if base == "tova":
        last = obs.seq_len - 1
        row = (
            sum(
                causal_probs(obs.queries[h, -1], obs.keys[h // obs.group_size], last, obs.scaling)
                for h in range(obs.queries.shape[0])
            )
            / obs.queries.shape[0]
        )
        return [row[:last].tolist()] * obs.num_kv_heads
    prefix = obs.seq_len - 64
    rows = []
    for kv in range(obs.num_kv_heads):
        total = torch.zeros(obs.seq_len, dtype=torch.float64)
        for h in range(kv * obs.group_size, (kv + 1) * obs.group_size):
            for i in range(64):
                total += causal_probs(obs.queries[h, -64 + i], obs.keys[kv], prefix + i, obs.scaling)
        mean = total / (obs.group_size * 64)
        rows.append(
            [float(sum(mean[j] for j in range(c - 2, c + 3) if 0 <= j < prefix) / 5) for c in range(prefix)]
        )
    return rows


def reference_budgets(base: str, obs: LayerObservation, budget: int) -> list[int]:
    """Deployed budgets: ``b`` per head, or AdaKV's caps from its deployed SnapKV scores."""
    if base != "adakv":
        return [budget] * obs.num_kv_heads
    caps = plain_caps(reference_prompt_scores(obs), budget - 64, Fraction(1, 5))
    return [cap + 64 for cap in caps]


def reference_choice(base: str, obs: LayerObservation, budgets: list[int], rule: ResidualConfig):
    """Per head: the chosen r, the losses of the admissible candidates and of ``r = 0``."""
    boundary = obs.seq_len - VALIDATION
    window = min(WINDOWS[base], boundary)
    scores = reference_fit_scores(base, obs, boundary)
    choices = []
    for kv, budget in enumerate(budgets):
        main_only = sum(reference_errors(obs, kv, scores[kv], budget, 0, window, rule)[0]) / (
            obs.group_size * VALIDATION
        )
        losses = {}
        for ratio in rule.grid:
            size = math.floor(ratio * budget + 0.5)
            if size == 0 or size in losses or budget - size - VALIDATION - window < 0:
                continue
            errors, entries = reference_errors(obs, kv, scores[kv], budget, size, window, rule)
            assert entries  # the candidate has residual entries
            losses[size] = sum(errors) / len(errors)
        best = min(losses, key=lambda size: (losses[size], list(losses).index(size))) if losses else 0
        chosen = best if losses and losses[best] < (1 - rule.delta) * main_only else 0
        choices.append((chosen, losses, main_only))
    return choices


def test_residual_sizes_round_half_up():
    """``r = floor(ratio * b + 0.5)`` (reskv.md): 2.5 slots give 3, where round-half-to-even
    (Python's ``round``, ``torch.round``) gives 2; 0.5 gives 1, and an empty budget 0."""
    # 0.05 * b = 0.5, 1.5, 2.5, 0, 0.35 by hand
    assert [residual_size(0.05, budget) for budget in [10, 30, 50, 0, 7]] == [1, 2, 3, 0, 0]


@pytest.mark.parametrize("base", BASES)
def test_proxy_choice_equals_an_independent_float64_recomputation(observation, base):
    obs, rule = observation, ResidualConfig()
    budget = budget_for(obs.seq_len, RATIO)
    budgets = reference_budgets(base, obs, budget)
    choices = reference_choice(base, obs, budgets, rule)
    assert max(len(losses) for _, losses, _ in choices) >= 2  # at least two admissible candidates
    for _, losses, main_only in choices:  # margins far above float noise: the decision is stable
        best, *others = sorted(losses.values()) or [math.inf]
        threshold = (1 - rule.delta) * main_only
        assert abs(best - threshold) > 1e-4 * threshold
        assert not others or others[0] - best > 1e-4 * others[0]
    state = compress_layer(obs, build_scorer(base), RATIO, rule)
    assert [
        m + r for m, r in zip(state.stats["main_slots"], state.stats["residual_slots"], strict=True)
    ] == budgets
    assert state.stats["residual_slots"] == [chosen for chosen, _, _ in choices]
    proxy = proxy_for(obs, base)  # the losses themselves, candidate by candidate
    budget_tensor = torch.tensor(budgets)
    for kv, (_, losses, main_only) in enumerate(choices):
        for size, expected in [(0, main_only), *losses.items()]:
            loss = proxy.losses(budget_tensor, torch.full_like(budget_tensor, size))[kv]
            torch.testing.assert_close(
                loss.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-3, atol=0
            )
    # A delta between the heads' best-to-main-only ratios: some heads keep r*, others fall back to 0.
    ratios = sorted(min(losses.values()) / main_only for _, losses, main_only in choices if losses)
    assert ratios[-1] > 1.02 * ratios[0]  # 1% either side of the threshold: far above float noise
    delta = 1 - math.sqrt(ratios[0] * ratios[-1])
    expected = [
        min(losses, key=losses.get) if min(losses.values()) < (1 - delta) * main_only else 0
        for _, losses, main_only in choices
    ]
    assert 0 in expected and max(expected) > 0
    split = compress_layer(obs, build_scorer(base), RATIO, ResidualConfig(delta=delta))
    assert split.stats["residual_slots"] == expected


@pytest.mark.parametrize("base", ["snapkv", "adakv"])
def test_each_head_records_the_ratio_its_residual_size_came_from(observation, base):
    """``residual_choice`` per head: the first ratio of the run's grid (here not the default one)
    whose ``r = floor(ratio * b_h + 0.5)`` is the size chosen, 0 for none; the fixed ratio without
    validation."""
    for config in (
        ResidualConfig(grid=(0.0, 0.3, 0.04, 0.12)),
        ResidualConfig(validate=False, fixed_ratio=0.3),
    ):
        stats = compress_layer(observation, build_scorer(base), RATIO, config).stats
        expected = []
        for main, size in zip(stats["main_slots"], stats["residual_slots"], strict=True):
            ratios = [ratio for ratio in config.grid if math.floor(ratio * (main + size) + 0.5) == size]
            expected.append(0.0 if size == 0 else ratios[0] if config.validate else config.fixed_ratio)
        assert stats["residual_choice"] == expected
        assert set(expected) - {0.0, *ResidualConfig().grid}  # some head took a ratio the default grid lacks


def proxy_for(obs: LayerObservation, base: str, config: ResidualConfig | None = None) -> ValidationProxy:
    config = config or ResidualConfig()
    return ValidationProxy(obs, build_scorer(base), config, observation_split(obs, config))


@pytest.mark.parametrize("base", BASES)
def test_9_a_validation_query_error_ignores_every_later_token(observation, base):
    """Invariant 9: poison the keys, values and queries after ``t`` with huge numbers; the errors of
    the validation queries at ``t`` (every group head) do not move. Budgets are the proxy's input,
    held fixed (AdaKV's come from the deployed scores, which read the whole prompt)."""
    budgets = torch.full((observation.num_kv_heads,), budget_for(observation.seq_len, RATIO))
    sizes = torch.full_like(budgets, 15)
    boundary = observation.seq_len - VALIDATION
    assert int(proxy_for(observation, base).candidate(budgets, sizes).residual.entries_per_head.min()) > 0
    for offset in (0, 5, VALIDATION - 2):
        t = boundary + offset
        poisoned = dataclasses.replace(
            observation,
            keys=observation.keys.clone(),
            values=observation.values.clone(),
            queries=observation.queries.clone(),
        )
        poisoned.keys[:, t + 1 :] = 1e4
        poisoned.values[:, t + 1 :] = -1e4
        poisoned.queries[:, FIT + offset + 1 :] = 1e4
        rows = offset + VALIDATION * torch.arange(observation.group_size)  # query t of every group head
        clean = proxy_for(observation, base).errors(budgets, sizes)[:, rows]
        dirty = proxy_for(poisoned, base).errors(budgets, sizes)
        assert torch.equal(dirty[:, rows], clean)
        assert torch.isfinite(dirty).all()
        if offset < VALIDATION - 2:  # later queries do see the poison: the test can tell
            assert not torch.equal(
                dirty[:, rows + 1], proxy_for(observation, base).errors(budgets, sizes)[:, rows + 1]
            )


@pytest.mark.parametrize("base", ["snapkv", "tova"])
def test_fit_switch_deploys_the_validated_cache(observation, base):
    """``final_selection="fit"``: ``M' ∪ [β, s)`` selected by the fit scores and the entries of
    ``E'``; ``"base"``: the plain selection of ``b - r`` tokens. Both against the reference."""
    obs, budget, window = observation, budget_for(observation.seq_len, RATIO), WINDOWS[base]
    boundary = obs.seq_len - VALIDATION
    base_state = compress_layer(obs, build_scorer(base), RATIO, ResidualConfig())
    fit_state = compress_layer(obs, build_scorer(base), RATIO, ResidualConfig(final_selection="fit"))
    sizes = fit_state.stats["residual_slots"]
    assert sizes == base_state.stats["residual_slots"] and max(sizes) > 0
    fit_scores = reference_fit_scores(base, obs, boundary)
    prompt_scores = reference_prompt_scores(obs, base)
    for kv, size in enumerate(sizes):
        fit_main = reference_kept(fit_scores[kv], boundary, window, budget - size - VALIDATION)
        fit_kept = fit_main + list(range(boundary, obs.seq_len))
        base_kept = reference_kept(torch.tensor(prompt_scores[kv]), obs.seq_len, window, budget - size)
        assert fit_kept != base_kept  # the two readings differ here
        assert fit_state.kept[kv].nonzero().flatten().tolist() == fit_kept
        assert base_state.kept[kv].nonzero().flatten().tolist() == base_kept
        evicted = [p for p in range(boundary) if p not in set(fit_main)]
        entries = reference_entries(obs.keys[kv], obs.values[kv], evicted, fit_scores[kv], size)
        used = torch.isfinite(fit_state.residual.log_counts[kv])
        if size == 0:
            continue
        assert int(used.sum()) == len(entries) > 0
        expected_keys = torch.stack([key for key, _, _ in entries])
        torch.testing.assert_close(
            fit_state.residual.keys[kv][used].double(), expected_keys, rtol=1e-5, atol=1e-5
        )
        expected_counts = torch.tensor([float(count) for _, _, count in entries]).log()
        torch.testing.assert_close(fit_state.residual.log_counts[kv][used], expected_counts.float())


@pytest.mark.parametrize("base", ["snapkv", "adakv"])
def test_losses_in_blocks_of_rows_equal_the_losses_of_all_rows_at_once(observation, base, monkeypatch):
    """The candidate losses in blocks of a few rows (``loss_block_bytes``, as on a GPU, where all rows
    at once would hold tens of GB) are each row's of one call for all rows, bit for bit, so the proxy
    chooses the same sizes."""
    proxy = proxy_for(observation, base)
    budgets = [budget_for(observation.seq_len, RATIO)] * observation.num_kv_heads
    caches = proxy.candidates(budgets, [[0] * len(budgets), [15] * len(budgets), [30] * len(budgets)])
    whole, chosen = proxy.caches_errors(caches), proxy.choose(budgets)
    monkeypatch.setattr(reskv.proxy, "loss_block_bytes", lambda device: 1)  # one row a block
    assert torch.equal(proxy.caches_errors(caches), whole)
    assert torch.equal(proxy.choose(budgets), chosen)


@pytest.mark.parametrize("base", ["snapkv", "adakv"])
def test_candidates_of_several_budget_sets_built_together_are_each_set_s_alone(observation, base):
    """A grid's ratios' candidates built together (``candidate_sets``: one ranking gathered, one
    k-means) give each set its caches laid out as alone, the same shapes and bits, and so the same
    losses and choices (``choose_each``); ratio 0.4's heads are laid out wider than 0.6's."""
    proxy, heads = proxy_for(observation, base), observation.num_kv_heads
    budget_sets = [
        reference_budgets(base, observation, budget_for(observation.seq_len, ratio))
        for ratio in (0.4, 0.6, 0.5)
    ]
    window = proxy.prefix_window
    sizes = [
        [
            [0] * heads,
            *(row for row in candidate_sizes(proxy.config, budgets, window, VALIDATION) if any(row)),
        ]
        for budgets in budget_sets
    ]
    together = proxy.candidate_sets(list(zip(budget_sets, sizes, strict=True)))
    for budgets, candidates, got in zip(budget_sets, sizes, together, strict=True):
        alone = proxy.candidates(budgets, candidates)
        assert got.padded == alone.padded
        for field in ("heads", "main_rows", "main_counts", "main_bias", "entry_counts", "evicted"):
            expected, found = getattr(alone, field), getattr(got, field)
            assert (found is None) == (expected is None)
            assert expected is None or (found.shape == expected.shape and torch.equal(found, expected))
        for field in ("keys", "values", "log_counts"):
            expected, found = getattr(alone.residual, field), getattr(got.residual, field)
            assert found.shape == expected.shape and torch.equal(found, expected)
        assert torch.equal(proxy.caches_errors(got), proxy.caches_errors(alone))
    assert together[0].main_rows.shape[1] > together[1].main_rows.shape[1]  # the layouts differ

    # Every set chooses in one pass, sets of fewer candidates than others padded in its tables: one
    # without any (a budget of |P'| + |validation| slots leaves no candidate an entry), one with some.
    def admissible(budgets):
        return [row for row in candidate_sizes(proxy.config, budgets, window, VALIDATION) if any(row)]

    unfit = [window + VALIDATION] * heads
    partial = next(
        [budget] * heads
        for budget in range(window + VALIDATION, observation.seq_len)
        if 0 < len(admissible([budget] * heads)) < len(sizes[0]) - 1
    )
    assert not admissible(unfit)
    every = [unfit, *budget_sets, partial, unfit]
    chosen = proxy.choose_each(every)
    assert chosen.shape == (len(every), heads) and not chosen[0].any() and not chosen[-1].any()
    assert all(torch.equal(got, proxy.choose(budgets)) for got, budgets in zip(chosen, every, strict=True))
    assert chosen[1:-1].any(dim=1).all()  # each set with candidates chose one somewhere


def test_candidate_sets_are_built_in_batches_whose_index_tables_fit_a_loss_block(observation, monkeypatch):
    """``table_batches``: sets of 2, 3 and 1 candidates over H heads hold index tables of 2, 3 and 1
    times ``H * β * 32`` bytes; within 4 of those, the first set goes alone and the last two together.
    A batch a set chooses the same sizes, bit for bit, as one batch for all."""
    proxy, heads = proxy_for(observation, "snapkv"), observation.num_kv_heads
    budget = budget_for(observation.seq_len, 0.4)
    sets = [([budget] * heads, [[0] * heads] * candidates) for candidates in (2, 3, 1)]
    unit = heads * proxy.boundary * 32  # by hand: 4 int64 tables a row and token before β
    monkeypatch.setattr(reskv.proxy, "loss_block_bytes", lambda device: 4 * unit)
    assert proxy.table_batches(sets) == [sets[:1], sets[1:]]
    budget_sets = [[budget_for(observation.seq_len, ratio)] * heads for ratio in (0.4, 0.5, 0.6)]
    monkeypatch.setattr(reskv.proxy, "loss_block_bytes", lambda device: math.inf)
    together = proxy.choose_each(budget_sets)
    monkeypatch.setattr(reskv.proxy, "loss_block_bytes", lambda device: 1)
    assert len(proxy.table_batches([(budgets, [[0] * heads]) for budgets in budget_sets])) == 3
    apart = proxy.choose_each(budget_sets)
    assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))
    assert any(int(chosen.max()) > 0 for chosen in together)


def test_beta_zero_keeps_the_residual_in_the_proxy(observation):
    """Invariant 10 in the proxy: with beta = 0 the candidate losses are finite and a residual is
    still chosen where it helps (a NaN in the losses would silently turn it off)."""
    config = ResidualConfig(beta=0.0)
    proxy = proxy_for(observation, "snapkv", config)
    budgets = torch.full((observation.num_kv_heads,), budget_for(observation.seq_len, RATIO))
    sizes = torch.full_like(budgets, 15)
    assert int(proxy.candidate(budgets, sizes).residual.entries_per_head.min()) > 0
    assert torch.isfinite(proxy.errors(budgets, sizes)).all()
    assert int(proxy.choose(budgets).max()) > 0


def test_validation_split_is_96_fit_and_32_validation_queries(observation):
    fit, validation = observation_split(observation, ResidualConfig())
    assert (fit.start, fit.stop, validation.start, validation.stop) == (0, 96, 96, 128)
    proxy = proxy_for(observation, "snapkv")
    assert proxy.boundary == observation.seq_len - 32 and proxy.fit_scores.shape[1] == proxy.boundary


def test_short_prompt_splits_3_to_1_and_moves_the_boundary():
    backbone = cached_tiny_backbone("tiny-qwen2", 6, 2)
    short = Prefill(backbone, random_prompt(TOKENS, 40, seed=2), 40, [build_method("snapkv+reskv", 0.5)])
    obs = short.prefilled("agnostic").cache.layers[1].observation(1, short.scaling)
    fit, validation = observation_split(obs, ResidualConfig())
    assert (fit.stop - fit.start, validation.stop - validation.start) == (30, 10)
    proxy = proxy_for(obs, "snapkv")
    assert proxy.boundary == 30 and proxy.validation_count == 10
    generation = short.generate(build_method("snapkv+reskv", 0.5), "aware", 3)
    assert len(generation.token_ids) <= 3


@pytest.mark.parametrize(
    ("group", "num_keys", "num_queries", "dim"),
    [
        (1, 150, 32, 64),  # the proxy's validation queries, ragged key tiles (150 = 2 x 64 + 22)
        (2, 150, 100, 80),  # grouped heads, query tiles past the last query, a head dim no power of two
        (3, 70, 3, 16),  # a few queries
    ],
)
def test_the_full_outputs_kernel_equals_plain_causal_attention(group, num_keys, num_queries, dim, tmp_path):
    """``reskv.attention_sums_kernel.outputs`` under Triton's interpreter (fp32 inputs): ``o_S(t)``, each
    query's attention over the keys ``0 .. t`` times their values, equals a plain float64 loop's within
    fp32 rounding; queries a slice of more observed ones and keys and values a prefix of a longer
    cache's (their heads' strides, not copied), as the proxy passes them."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(group)
    kv_heads = 2
    queries = torch.randn(kv_heads * group, num_queries + 5, dim, generator=generator)[:, 5:]
    keys, values = (torch.randn(kv_heads, num_keys + 7, dim, generator=generator)[:, :num_keys] for _ in "kv")
    first, scaling = num_keys - num_queries, dim**-0.5
    case = (queries, keys, values, first, scaling)
    (found,) = interpreted("reskv.attention_sums_kernel:outputs", [case], tmp_path)
    assert found.shape == queries.shape and found.dtype == torch.float32
    for head in range(kv_heads * group):
        for index in range(num_queries):
            probs = causal_probs(queries[head, index], keys[head // group], first + index, scaling)
            expected = probs @ values[head // group].double()
            assert torch.allclose(found[head, index].double(), expected, rtol=1e-5, atol=1e-6), (head, index)
