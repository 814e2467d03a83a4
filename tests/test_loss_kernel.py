"""``reskv/loss_kernel.py`` under Triton's interpreter on CPU: a validation proxy's errors for every
candidate row, against the proxy's torch path (``ValidationProxy.caches_errors``, which
tests/test_proxy.py checks against a float64 loop written from the spec)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

import reskv.proxy
from baselines import build_method, build_scorer
from reskv.config import ResidualConfig, budget_for, candidate_sizes
from reskv.engine import Prefill
from reskv.proxy import ValidationProxy, observation_split
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone, interpreted

PROMPT_LENGTH = 300
RATIOS = (0.5, 0.7)
# The rules the kernel computes: the paper's, the gate closed, a clamped gate, a population weight.
RULES = {
    "paper": ResidualConfig(),
    "no gate": ResidualConfig(gate=False),
    "clamped gate": ResidualConfig(g_min=0.9, tau=0.05),  # sigmoid(alpha (tau - p_max)) < 0.65: clamped
    "beta 0.5": ResidualConfig(beta=0.5),
}


def proxies_and_sets(base: str = "adakv", rules: tuple[ResidualConfig, ...] | None = None):
    """For each of ``rules`` (``RULES`` by default), a proxy over layer 1 of a tiny Qwen2 (3 query heads
    a KV head) prefilled on a 300-token prompt, and its candidates' budget sets at ratios 0.5 and 0.7
    (``candidate_rows``' argument) under ``base`` (AdaKV: budgets of every head its own, so main caches
    are padded; candidates of every grid level, and the main-only one with no entries)."""
    prefill = Prefill(
        cached_tiny_backbone("tiny-qwen2", 6, 2), random_prompt(TOKENS, PROMPT_LENGTH, seed=11),
        PROMPT_LENGTH, [build_method("h2o", 0.5)],
    )  # fmt: skip
    obs = prefill.prefilled("agnostic").cache.layers[1].observation(1, prefill.scaling)
    scorer = build_scorer(base)
    scores = scorer.prompt_scores(obs)
    for rule in rules or RULES.values():
        proxy = ValidationProxy(obs, scorer, rule, observation_split(obs, rule))
        sets = []
        for ratio in RATIOS:
            budgets = scorer.head_budgets(scores, budget_for(PROMPT_LENGTH, ratio)).tolist()
            sizes = candidate_sizes(rule, budgets, proxy.prefix_window, proxy.validation_count)
            sets.append((budgets, [[0] * len(budgets), *sizes]))
        yield proxy, sets


def proxies_and_candidates(base: str = "adakv"):
    """``proxies_and_sets``' proxies, each with its candidates built together (``candidate_rows``)."""
    for proxy, sets in proxies_and_sets(base):
        yield proxy, proxy.candidate_rows(sets)


def errors_through_the_proxy(proxy, candidates):
    """``proxy.sets_errors`` with ``fused_losses`` on (as ``CUDA_FUSED_LOSSES`` on a GPU): the errors,
    and the calls of ``loss_kernel.errors`` (IEEE products: the tiny models' keys are fp32)."""
    from reskv import loss_kernel  # imports Triton

    with (
        mock.patch.object(reskv.proxy, "fused_losses", lambda keys, rule: True),
        mock.patch.object(loss_kernel, "errors", wraps=loss_kernel.errors) as kernel,
    ):
        return proxy.sets_errors(*candidates), kernel.call_count


def test_fused_losses_equal_the_torch_paths_within_fp32_rounding(tmp_path):
    """Where ``fused_losses`` says so, ``ValidationProxy.sets_errors`` hands the rows of both ratios'
    candidates to the kernel in one call, each row read over its own slots though the rows are laid
    out to the widest; under each of ``RULES`` every candidate's errors per validation query equal the
    torch path's (each ratio's caches laid out alone) within fp32 rounding (online softmaxes, another
    summation order), and their means choose the same size in every head."""
    pytest.importorskip("triton")
    cases = list(proxies_and_candidates())
    for _, (every_row, layouts) in cases:
        assert every_row.padded and all(padded for *_, padded in layouts)  # padded main caches
        narrow = layouts[1]  # ratio 0.7's rows, laid out wider beside ratio 0.5's
        assert narrow[1] < every_row.main_rows.shape[1] and narrow[2] < every_row.residual.keys.shape[1]
    found = interpreted("tests.test_loss_kernel:errors_through_the_proxy", cases, tmp_path)
    for (proxy, candidates), (kernel, calls) in zip(cases, found, strict=True):
        plain, heads = proxy.sets_errors(*candidates), proxy.obs.num_kv_heads
        assert calls == 1 and kernel.shape == plain.shape and torch.isfinite(kernel).all()
        torch.testing.assert_close(kernel, plain, rtol=2e-5, atol=1e-7)
        for rows, *_ in candidates[1]:
            assert torch.equal(
                kernel[rows].mean(-1).reshape(-1, heads).argmin(0),
                plain[rows].mean(-1).reshape(-1, heads).argmin(0),
            )


def test_fused_losses_refuse_the_ablation_without_the_shared_softmax():
    pytest.importorskip("triton")
    from reskv import loss_kernel

    rule = dataclasses.replace(ResidualConfig(), shared_softmax=False)
    with pytest.raises(ValueError, match="shared softmax only"):
        loss_kernel.errors(*([None] * 12), rule)
