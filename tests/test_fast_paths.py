"""Fast paths against the straightforward computations they replace.

Each reference below is the plain form written here from reskv.md: two separate matmuls and an
explicit softmax for attention, a full ``[n, s]`` causal mask for observation probabilities, a
loop over points for cluster sums, a growing ``torch.cat`` cache for decoding. None of them
calls the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from baselines import build_scorer
from reskv.attention import gate_values, joint_attention, shared_softmax_attention
from reskv.cache import CompressedLayer
from reskv.compress import ResidualConfig, budget_for, compress_layer
from reskv.decode_rule import DecodeRule
from reskv.engine import Prefill
from reskv.proxy import ValidationProxy, observation_split
from reskv.residual import lloyd_assignments
from reskv.scoring import LayerObservation, causal_attention_probs
from reskv.selection import gather_rows
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone, interpreted, separate_attention

PROMPT_LENGTH = 300


@pytest.fixture(scope="module", params=[("tiny-llama", 4, 2), ("tiny-qwen2", 6, 2)], ids=["g2", "g3"])
def observation(request) -> LayerObservation:
    prefill = Prefill(
        cached_tiny_backbone(*request.param), random_prompt(TOKENS, PROMPT_LENGTH, seed=5), PROMPT_LENGTH
    )
    return prefill.prefilled("agnostic").cache.layers[1].observation(1, prefill.scaling)


def plain_attention(queries, main_keys, main_values, main_bias, entries, scaling, rule: DecodeRule):
    """The rule with main cache and entries apart: two logits matmuls, one explicit softmax over
    ``[main ; entries]`` with ``beta log c + log g`` on the entries (unused entries dropped),
    or for the no-shared-softmax ablation the two normalised branches mixed by ``g |E| / s``.
    ``entries`` is ``(keys, values, log_counts, evicted_fraction)`` for one batch of heads."""
    keys, values, log_counts, evicted_fraction = entries
    main_logits = queries.double() @ main_keys.double().transpose(1, 2) * scaling + main_bias.double()
    main_probs = main_logits.softmax(dim=-1)
    gate = torch.sigmoid(rule.alpha * (rule.tau - main_probs.amax(dim=-1))).clamp(min=rule.g_min)
    if not rule.gate:
        gate = torch.ones_like(gate)
    used = torch.isfinite(log_counts)[:, None, :]
    population = torch.where(
        used, rule.beta * log_counts.double().masked_fill(~used[:, 0], 0)[:, None, :], -math.inf
    )
    residual_logits = queries.double() @ keys.double().transpose(1, 2) * scaling + population
    if rule.shared_softmax:
        logits = torch.cat([main_logits, residual_logits + gate.log()[..., None]], dim=-1)
        return logits.softmax(dim=-1) @ torch.cat([main_values, values], dim=1).double()
    residual_output = residual_logits.softmax(dim=-1).nan_to_num() @ values.double()
    weight = (gate * evicted_fraction[:, None].double())[..., None]
    return (1 - weight) * (main_probs @ main_values.double()) + weight * residual_output


def random_entries(obs: LayerObservation, slots: int, unused: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    dim = obs.keys.shape[-1]
    keys = torch.randn(obs.num_kv_heads, slots, dim, generator=generator) * obs.keys.std()
    values = torch.randn(obs.num_kv_heads, slots, dim, generator=generator)
    log_counts = torch.rand(obs.num_kv_heads, slots, generator=generator) * 3
    log_counts[0, slots - unused :] = -math.inf  # head 0 has unused slots
    return keys, values, log_counts


def padded_layer_with_entries(obs: LayerObservation, rule: DecodeRule, slots: int = 7, unused: int = 3):
    """Queries, ``[entries ; main]`` keys, values and bias (head 1 padded, head 0 with unused entries)
    and the plain rule's float64 output on them (``plain_attention``)."""
    keys, values, log_counts = random_entries(obs, slots=slots, unused=unused, seed=1)
    main_bias = torch.zeros(obs.num_kv_heads, 1, obs.seq_len)
    main_bias[1, 0, :40] = -math.inf  # head 1 padded
    queries = obs.queries[:, -3:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    evicted_fraction = torch.full((obs.num_kv_heads,), 0.4)
    population = torch.where(
        torch.isfinite(log_counts), rule.beta * log_counts.nan_to_num(neginf=0), -math.inf
    )
    joint = (
        queries,
        torch.cat([keys, obs.keys], dim=1),
        torch.cat([values, obs.values], dim=1),
        torch.cat([population[:, None, :], main_bias], dim=-1),
        evicted_fraction,
    )
    expected = plain_attention(
        queries,
        obs.keys,
        obs.values,
        main_bias,
        (keys, values, log_counts, evicted_fraction),
        obs.scaling,
        rule,
    )
    return joint, expected


@pytest.mark.parametrize(
    "rule",
    [DecodeRule(), DecodeRule(beta=0.0), DecodeRule(gate=False), DecodeRule(shared_softmax=False)],
    ids=["default", "beta0", "no-gate", "no-shared-softmax"],
)
def test_joint_attention_equals_the_two_matmul_softmax(observation, rule):
    """One matmul over ``[entries ; main]`` with the population bias as the entries' bias row equals
    the plain two-matmul rule, with padded main slots and unused entries."""
    (queries, keys, values, bias, evicted_fraction), expected = padded_layer_with_entries(observation, rule)
    joint, _ = joint_attention(queries, keys, values, bias, 7, observation.scaling, rule, evicted_fraction)
    torch.testing.assert_close(joint.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slots", [7, 0], ids=["entries", "base"])
@pytest.mark.parametrize(
    "rule",
    [DecodeRule(), DecodeRule(beta=0.0), DecodeRule(gate=False), DecodeRule(g_min=0.99)],
    ids=["default", "beta0", "no-gate", "g-min"],
)
def test_the_decode_path_equals_the_two_matmul_softmax(observation, rule, slots):
    """The decode path's single SDPA call, the gate folded into the entries' bias, equals the plain
    rule with padded main slots and unused entries, and with no entries at all (a base method)."""
    (queries, keys, values, bias, _), expected = padded_layer_with_entries(
        observation, rule, slots=slots, unused=3 if slots else 0
    )
    decoded = shared_softmax_attention(queries, keys, values, bias, slots, observation.scaling, rule)
    torch.testing.assert_close(decoded.double(), expected, rtol=1e-5, atol=1e-6)


def test_the_fused_decode_kernel_equals_the_two_matmul_softmax(observation, tmp_path):
    """``reskv/decode_kernel.py`` (CUDA's gated decode step) under Triton's interpreter on CPU equals the
    plain rule, with padded main slots and unused entries: for four rules (a gate clamped at ``g_min``
    among them), with 200 spare slots (bias ``-inf``, zero keys, as a static buffer's) that leave the
    last chunks with no slot to attend, with 70 entries (three chunks of entries, the last of them all
    unused in head 0, and main chunks starting off a tile's boundary), and with bf16 keys and values
    (its output then bf16)."""
    pytest.importorskip("triton")
    rules = [DecodeRule(), DecodeRule(beta=0.0), DecodeRule(g_min=0.99), DecodeRule(tau=0.7, alpha=3.0)]
    cases, expected = [], []
    for rule in rules:
        (queries, keys, values, bias, _), plain = padded_layer_with_entries(observation, rule)
        cases.append((queries, keys, values, bias, 7, observation.scaling, rule))
        expected.append(plain)
    queries, keys, values, bias, slots, scaling, rule = cases[0]
    spare = keys.new_zeros(keys.shape[0], 200, keys.shape[-1])
    spare_bias = bias.new_full((bias.shape[0], 1, 200), -math.inf)
    cases.append(
        (
            queries,
            torch.cat([keys, spare], 1),
            torch.cat([values, spare], 1),
            torch.cat([bias, spare_bias], -1),
        )
        + (slots, scaling, rule)
    )
    expected.append(expected[0])
    (many_queries, many_keys, many_values, many_bias, _), plain = padded_layer_with_entries(
        observation, rule, slots=70, unused=25
    )
    cases.append((many_queries, many_keys, many_values, many_bias, 70, scaling, rule))
    expected.append(plain)
    cases.append((queries.bfloat16(), keys.bfloat16(), values.bfloat16(), bias, slots, scaling, rule))
    expected.append(plain_attention_of(cases[-1], observation))
    launches = [(*case[:-1], case[-1].gate_terms) for case in cases]  # the kernel takes the gate's terms
    fused = interpreted("reskv.decode_kernel:gated_attention", launches, tmp_path)
    for output, plain in zip(fused[:-1], expected[:-1], strict=True):
        assert output.dtype == torch.float32
        torch.testing.assert_close(output.double(), plain, rtol=1e-5, atol=1e-6)
    assert fused[-1].dtype == torch.bfloat16
    torch.testing.assert_close(fused[-1].double(), expected[-1], rtol=1e-2, atol=1e-2)


def plain_attention_of(case: tuple, obs: LayerObservation):
    """``plain_attention`` of a case of ``[entries ; main]`` buffers with 7 entries (their bias row the
    population's, as ``padded_layer_with_entries`` builds it), in the case's own dtype's values."""
    queries, keys, values, bias, slots, scaling, rule = case
    log_counts = bias[:, 0, :slots] / rule.beta if rule.beta else bias[:, 0, :slots]
    entries = (keys[:, :slots], values[:, :slots], log_counts, torch.ones(keys.shape[0]))
    return plain_attention(
        queries, keys[:, slots:], values[:, slots:], bias[..., slots:], entries, scaling, rule
    )


def lse_merge_attention(queries, main_keys, main_values, entries, scaling, rule: DecodeRule):
    """reskv.md's two-branch form in float64: main output and log-sum-exp, residual output and
    log-sum-exp (``log g`` on the entries), merged with ``w = sigmoid(lse_M - lse_R)``."""
    keys, values, log_counts = entries
    main_logits = queries.double() @ main_keys.double().transpose(1, 2) * scaling
    main_lse = main_logits.logsumexp(dim=-1)
    gate = torch.sigmoid(rule.alpha * (rule.tau - (main_logits.amax(dim=-1) - main_lse).exp()))
    residual_logits = (
        queries.double() @ keys.double().transpose(1, 2) * scaling
        + rule.beta * log_counts.double()[:, None, :]
        + gate.log()[..., None]
    )
    residual_lse = residual_logits.logsumexp(dim=-1)
    main_output = (main_logits - main_lse[..., None]).exp() @ main_values.double()
    residual_output = (residual_logits - residual_lse[..., None]).exp() @ values.double()
    weight = torch.sigmoid(main_lse - residual_lse)[..., None]
    return weight * main_output + (1 - weight) * residual_output


@pytest.mark.parametrize(
    "rule",
    [DecodeRule(), DecodeRule(tau=0.7, alpha=3.0), DecodeRule(g_min=0.05)],
    ids=["default", "tau", "g_min"],
)
def test_gate_is_the_spec_formula_bit_for_bit(rule):
    """``g = max(g_min, sigmoid(alpha * (tau - p_max)))`` with ``p_max = 1 / main mass``, exactly as
    reskv.md writes it, over masses from 1 (one slot holds everything: ``p_max = 1``) to 10^4."""
    main_mass = torch.cat(
        [torch.ones(1), 1 + torch.rand(4000, generator=torch.Generator().manual_seed(3)) * 1e4]
    )
    expected = torch.sigmoid(rule.alpha * (rule.tau - 1 / main_mass)).clamp(min=rule.g_min)
    assert expected.min() < 0.5 < expected.max()  # the gate both closes and opens here
    assert torch.equal(gate_values(main_mass[:, None, None], rule.gate_terms)[:, 0, 0], expected)


def test_single_normalisation_equals_the_lse_merge(observation):
    """Invariant 5 against the form reskv.md writes out: the one normalisation over ``[entries ;
    main]`` that ``joint_attention`` computes equals the two-branch LSE merge."""
    obs, rule = observation, DecodeRule()
    keys, values, log_counts = random_entries(obs, slots=5, unused=0, seed=3)
    # Sharpened copies of the last queries, so the gate spans open to nearly closed.
    last = obs.queries[:, -2:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    queries = torch.cat([last * sharpness for sharpness in (1, 30, 100, 300)], dim=1)
    main_peak = (queries @ obs.keys.transpose(1, 2) * obs.scaling).softmax(-1).amax(-1)
    assert main_peak.min() < 0.05 and main_peak.max() > 0.5
    output = separate_attention(
        queries, obs.keys, obs.values, None, keys, values, log_counts, obs.scaling, rule
    )
    expected = lse_merge_attention(
        queries, obs.keys, obs.values, (keys, values, log_counts), obs.scaling, rule
    )
    assert torch.isfinite(log_counts).all()  # every head has entries
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)


def test_entries_far_above_the_main_logits_do_not_overflow(observation):
    """An entry whose logit exceeds every main logit by more than fp32's exp range (88.7) still
    gets its exact share: the weights are referred to the larger maximum, not the main one."""
    obs, rule = observation, DecodeRule()
    queries = obs.queries[:, -2:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    direction = queries.mean(dim=1, keepdim=True)  # [H_kv, 1, d]: one entry key per head
    smallest_dot = (direction * queries).sum(-1).amin(-1)[:, None, None]
    keys = direction * (200.0 / (obs.scaling * smallest_dot))  # every entry logit >= 200
    values = torch.randn(obs.num_kv_heads, 1, obs.keys.shape[-1])
    log_counts = torch.zeros(obs.num_kv_heads, 1)
    entry_logits = (queries @ keys.transpose(1, 2))[..., 0] * obs.scaling
    main_max = (queries @ obs.keys.transpose(1, 2)).amax(-1) * obs.scaling
    assert (entry_logits - main_max > 100).all()
    output = separate_attention(
        queries, obs.keys, obs.values, None, keys, values, log_counts, obs.scaling, rule
    )
    expected = plain_attention(
        queries,
        obs.keys,
        obs.values,
        torch.zeros(obs.num_kv_heads, 1, obs.seq_len),
        (keys, values, log_counts, None),
        obs.scaling,
        rule,
    )
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "rule",
    [DecodeRule(), DecodeRule(gate=False), DecodeRule(shared_softmax=False)],
    ids=["default", "no-gate", "no-shared-softmax"],
)
def test_a_head_without_entries_gives_exactly_the_main_only_output(observation, rule):
    """Head 0's entry slots are all unused (another head has entries, so the layer has slots):
    its output is bit for bit the one computed with no entry slots at all, under every rule."""
    obs = observation
    keys, values, log_counts = random_entries(obs, slots=4, unused=4, seed=4)
    queries = obs.queries[:, -3:].reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
    evicted_fraction = torch.full((obs.num_kv_heads,), 0.4)
    with_slots = separate_attention(
        queries, obs.keys, obs.values, None, keys, values, log_counts, obs.scaling, rule, evicted_fraction
    )
    without = separate_attention(
        queries, obs.keys, obs.values, None, keys[:, :0], values[:, :0], log_counts[:, :0], obs.scaling, rule
    )
    assert not torch.isfinite(log_counts[0]).any() and torch.isfinite(log_counts[1:]).all()
    assert torch.equal(with_slots[0], without[0])
    assert not torch.equal(with_slots[1:], without[1:])  # the other heads' entries do count


def test_decode_buffer_equals_a_growing_concatenated_cache(observation, monkeypatch):
    """Tokens written at the layer's device-side position (the buffer regrown every 2 tokens here)
    give, in the written slots, the keys, values and bias of a cache rebuilt by ``torch.cat`` at every
    step, ``-inf`` bias on every slot not yet written, and the same outputs."""
    monkeypatch.setattr(CompressedLayer, "GROWTH_SLOTS", 2)
    obs, rule = observation, ResidualConfig(validate=False, fixed_ratio=0.2)
    state = compress_layer(obs, build_scorer("adakv"), 0.5, rule)
    assert int(state.residual.entries_per_head.min()) > 0 and state.main_bias is not None  # entries, padding
    layer = CompressedLayer(state, obs.seq_len, rule)
    plain_keys, plain_values, plain_bias = state.main_keys, state.main_values, state.main_bias
    generator = torch.Generator().manual_seed(2)
    dim = obs.keys.shape[-1]
    for step in range(5):
        new = 1 + step % 2  # one or two tokens at a time
        new_keys = torch.randn(1, obs.num_kv_heads, new, dim, generator=generator)
        new_values = torch.randn(1, obs.num_kv_heads, new, dim, generator=generator)
        keys, values = layer.update(new_keys, new_values)
        plain_keys = torch.cat([plain_keys, new_keys[0]], dim=1)
        plain_values = torch.cat([plain_values, new_values[0]], dim=1)
        plain_bias = torch.cat([plain_bias, torch.zeros(obs.num_kv_heads, 1, new)], dim=-1)
        written = plain_keys.shape[1]
        assert keys.shape[2] >= written
        assert torch.equal(keys[0, :, :written], plain_keys) and torch.equal(
            values[0, :, :written], plain_values
        )
        assert torch.equal(layer.main_bias[..., :written], plain_bias)
        assert torch.equal(
            layer.main_bias[..., written:], torch.full_like(layer.main_bias[..., written:], -math.inf)
        )
        query = torch.randn(1, obs.queries.shape[0], 1, dim, generator=generator)
        output = layer.attend(None, query, keys, values, obs.scaling)[0, 0]  # [H, d]
        residual = state.residual
        expected = plain_attention(
            query[0].reshape(obs.num_kv_heads, -1, dim),
            plain_keys,
            plain_values,
            plain_bias,
            (residual.keys, residual.values, residual.log_counts, state.evicted_fraction),
            obs.scaling,
            rule,
        )
        torch.testing.assert_close(output.double(), expected.reshape(-1, dim), rtol=1e-5, atol=1e-6)


def test_a_reserved_generation_writes_in_place(observation):
    """After ``reserve(n)`` the buffers hold exactly the written slots plus ``n``: the next ``n``
    tokens are written into the same storage (no copy of the cache during a generation) and the
    token after them regrows it."""
    obs, rule = observation, ResidualConfig(validate=False, fixed_ratio=0.2)
    state = compress_layer(obs, build_scorer("snapkv"), 0.5, rule)
    layer = CompressedLayer(state, obs.seq_len, rule)
    assert int(layer.residual.entries_per_head.min()) > 0  # the buffers hold entries and main cache
    written = layer.residual.keys.shape[1] + state.main_keys.shape[1]
    layer.reserve(5)
    assert layer.keys.shape[2] == written + 5 - layer.residual.keys.shape[1]

    def storages():
        return layer.keys.untyped_storage().data_ptr(), layer.values.untyped_storage().data_ptr()

    reserved = storages()
    token = torch.zeros(1, obs.num_kv_heads, 1, obs.keys.shape[-1])
    for _ in range(5):
        layer.update(token, token)
    assert storages() == reserved
    layer.update(token, token)
    assert storages()[0] != reserved[0] and storages()[1] != reserved[1]


def test_observation_probabilities_equal_the_fully_masked_softmax(observation):
    """Masking only the columns a query's future can reach gives the same bits as masking the
    whole ``[n, s]`` grid, for query positions anywhere in the prompt (H2O's chunks)."""
    obs = observation
    for positions in (range(3, 8), range(40, 42), range(200, 205), range(PROMPT_LENGTH - 5, PROMPT_LENGTH)):
        queries = obs.queries[:, : len(positions)]
        probs = causal_attention_probs(queries, obs.keys, positions, obs.scaling)
        grouped = queries.reshape(obs.num_kv_heads, -1, obs.keys.shape[-1])
        logits = (grouped @ obs.keys.transpose(1, 2) * obs.scaling).reshape(
            queries.shape[0], len(positions), -1
        )
        future = torch.arange(obs.seq_len)[None, :] > torch.tensor(positions)[:, None]
        assert torch.equal(probs, logits.masked_fill(future, -math.inf).softmax(dim=-1))


def test_lloyd_returns_the_last_steps_sums_and_counts(observation):
    """The sums and counts handed back with the assignments (a flat index: ``9 * head + cluster``) are
    those of the final assignments, recomputed here point by point."""
    obs = observation
    points = obs.keys[:, :120].float()
    weights = torch.ones(points.shape[:2])
    weights[1, 100:] = 0  # padded points of head 1
    points = points * weights[..., None]
    flat_index, sums, counts = lloyd_assignments(points, weights, points[:, :9], iterations=3)
    flat_index = flat_index.reshape(points.shape[:2])
    assert torch.equal(flat_index // 9, torch.arange(points.shape[0])[:, None].expand_as(flat_index))
    assignments = flat_index % 9
    for head in range(points.shape[0]):
        for cluster in range(9):
            members = [
                p for p in range(points.shape[1]) if weights[head, p] > 0 and assignments[head, p] == cluster
            ]
            assert counts[head, cluster] == len(members)
            expected = points[head, members].double().sum(0) if members else torch.zeros(points.shape[-1])
            torch.testing.assert_close(sums[head, cluster].double(), expected.double(), rtol=1e-5, atol=1e-6)
    assert int(counts[1].sum()) == 100 and int((counts > 0).sum()) > 9  # padding excluded, clusters used


def test_proxy_errors_equal_the_two_matmul_rule_over_the_candidate(observation):
    """The proxy's one-buffer errors equal the plain rule over the candidate's main cache, the exact
    tokens ``β .. t`` (causal) and its entries, for every candidate of the grid; the chosen ``r``
    per head is what the plain rule's losses choose."""
    obs, config = observation, ResidualConfig()
    proxy = ValidationProxy(obs, build_scorer("snapkv"), config, observation_split(obs, config))
    budget = budget_for(obs.seq_len, 0.5)
    budgets = torch.full((obs.num_kv_heads,), budget)
    boundary = proxy.boundary
    validation_positions = torch.arange(boundary, obs.seq_len).repeat(obs.group_size)
    plain_losses = {}
    grid_sizes = [int(math.floor(ratio * budget + 0.5)) for ratio in config.grid]  # all admissible here
    for size in grid_sizes:
        sizes = torch.full_like(budgets, size)
        candidate = proxy.candidate(budgets, sizes)
        candidate_keys, candidate_values = (
            gather_rows(part, candidate.main_rows) for part in (obs.keys, obs.values)
        )
        main_keys = torch.cat([candidate_keys, obs.keys[:, boundary:]], dim=1)
        main_values = torch.cat([candidate_values, obs.values[:, boundary:]], dim=1)
        exact = torch.arange(boundary, obs.seq_len)[None, :] <= validation_positions[:, None]
        main_bias = torch.cat(
            [
                torch.zeros(len(validation_positions), candidate.main_rows.shape[1]),
                torch.zeros(exact.shape).masked_fill(~exact, -math.inf),
            ],
            dim=-1,
        )[None]
        residual = candidate.residual
        output = plain_attention(
            proxy.validation_queries,
            main_keys,
            main_values,
            main_bias,
            (residual.keys, residual.values, residual.log_counts, candidate.evicted / proxy.boundary),
            obs.scaling,
            config,
        )
        full_logits = proxy.validation_queries.double() @ obs.keys.double().transpose(1, 2) * obs.scaling
        future = torch.arange(obs.seq_len)[None, :] > validation_positions[:, None]
        full_output = full_logits.masked_fill(future, -math.inf).softmax(-1) @ obs.values.double()
        plain_errors = ((output - full_output) ** 2).sum(-1)
        assert size == 0 or int(residual.entries_per_head.min()) > 0
        torch.testing.assert_close(proxy.errors(budgets, sizes).double(), plain_errors, rtol=1e-3, atol=1e-9)
        plain_losses[size] = plain_errors.mean(-1)
    best = [
        min(grid_sizes[1:], key=lambda size: float(plain_losses[size][kv])) for kv in range(obs.num_kv_heads)
    ]
    expected = [
        size if plain_losses[size][kv] < (1 - config.delta) * plain_losses[0][kv] else 0
        for kv, size in enumerate(best)
    ]
    assert compress_layer(obs, build_scorer("snapkv"), 0.5, config).stats["residual_slots"] == expected
