"""The generations of one prompt decoded together as one batch (issue 25): each row as if alone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from baselines import build_method
from reskv.cache import CACHE_KWARG, ResKVCache, StackedLayer
from reskv.config import ResidualConfig
from reskv.engine import Prefill, greedy
from scripts.measure import random_prompt
from tests.conftest import TINY_RUN, TOKENS, cached_tiny_backbone

ROOT = Path(__file__).resolve().parent.parent

FORCED = [17, 905, 3, 2211, 64, 7]  # tokens fed one at a time, whatever the model would choose
# Rows of every kind a batch mixes: the full cache (as long as the prompt), bases, ragged AdaKV,
# CaM's merged values, and ResKV under each gate rule (default, clamped, closed, another tau/alpha,
# no population weight), at two ratios and in both settings.
RULES = {
    "default": ResidualConfig(),
    "g_min": ResidualConfig(g_min=0.99),
    "no_gate": ResidualConfig(gate=False),
    "tau": ResidualConfig(tau=0.7, alpha=3.0, beta=0.0),
}
REQUESTS = [
    (name, ratio, rule, setting)
    for setting in ("aware", "agnostic")
    for name, ratio, rule in [
        ("full", None, None),
        ("snapkv", 0.9, None),
        ("adakv", 0.6, None),
        ("cam", 0.9, None),
        *(
            (name, ratio, rule)
            for name in ("snapkv+reskv", "adakv+reskv")
            for ratio in (0.6, 0.9)
            for rule in RULES
        ),
    ]
]


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    return Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270)


def requests(names=REQUESTS):
    return [
        (build_method(name, ratio, residual=RULES.get(rule)), setting) for name, ratio, rule, setting in names
    ]


def grid(prefill: Prefill, methods, **options) -> list:
    """``generate_grid``'s generations in the order of the requests."""
    generations = dict(prefill.generate_grid(methods, **options))
    return [generations[row] for row in range(len(methods))]


def prompted_cache(
    prefill: Prefill, method, setting: str, spare_slots: int
) -> tuple[ResKVCache, torch.Tensor]:
    """What ``generate`` decodes from: the cache after the whole prompt and the logits there."""
    prepared = prefill._prepare(method, setting, spare_slots, with_quality=False)
    return prepared.cache, prepared.logits


def test_stacked_rows_get_the_logits_each_gets_alone(prefill):
    """Along the same forced tokens, every row of one batch gets the logits its own cache gives it alone
    (``shared_softmax_attention``, itself checked against the spec's loop): the padding to the longest
    row and the per-row gate rules change nothing but fp32 rounding."""
    alone, stacked_caches, first_logits = [], [], []
    for method, setting in requests():
        cache, logits = prompted_cache(prefill, method, setting, len(FORCED))
        alone.append(torch.stack([logits] + [prefill.next_logits([token], cache) for token in FORCED[:-1]]))
        cache, logits = prompted_cache(prefill, method, setting, len(FORCED))
        stacked_caches.append(cache)
        first_logits.append(logits)
    stacked = ResKVCache.stacked(stacked_caches, len(FORCED))
    assert all(isinstance(layer, StackedLayer) for layer in stacked.layers)
    steps = [torch.stack(first_logits)]
    for token in FORCED[:-1]:
        ids = torch.full((len(first_logits), 1), token)
        steps.append(
            prefill.backbone.model(input_ids=ids, use_cache=True, **stacked_kwargs(prefill, stacked)).logits[
                :, -1
            ]
        )
    together = torch.stack(steps, dim=1)  # [rows, steps, V]
    for row, expected in enumerate(alone):
        torch.testing.assert_close(together[row], expected, rtol=0, atol=2e-5, msg=f"row {REQUESTS[row]}")


def stacked_kwargs(prefill: Prefill, cache: ResKVCache) -> dict:
    return {prefill.backbone.cache_argument: cache, CACHE_KWARG: cache}


def test_rows_kept_after_others_left_go_on_with_their_own_logits(prefill):
    """``keep`` drops rows mid-decode and reorders the rest: each kept row's next logits still equal
    its own cache's alone."""
    methods = requests()
    kept = [len(methods) - 1, 0, 5, 9]
    alone = []
    for method, setting in [methods[row] for row in kept]:
        cache, _ = prompted_cache(prefill, method, setting, len(FORCED))
        alone.append(torch.stack([prefill.next_logits([token], cache) for token in FORCED]))
    stacked = ResKVCache.stacked(
        [prompted_cache(prefill, m, s, len(FORCED))[0] for m, s in methods], len(FORCED)
    )
    together = []
    for step, token in enumerate(FORCED):
        if step == 2:
            stacked.keep(kept)
        rows = len(methods) if step < 2 else len(kept)
        ids = torch.full((rows, 1), token)
        logits = prefill.backbone.model(
            input_ids=ids, use_cache=True, **stacked_kwargs(prefill, stacked)
        ).logits
        together.append(logits[:, -1] if step >= 2 else logits[kept, -1])
    torch.testing.assert_close(torch.stack(together, dim=1), torch.stack(alone), rtol=0, atol=2e-5)


def test_greedy_rows_stop_on_their_own_and_the_rest_go_on():
    """Scripted logits: row 0 stops at its third token, row 2 at its first (once ``min_new_tokens = 1``
    allows it: its first choice is the stop token, masked), row 1 runs to ``max_new_tokens``."""
    stop, vocabulary = 9, 10
    scripts = {0: [4, 5, stop], 1: [1, 2, 3, 4, 5], 2: [stop, stop]}
    runner_up = {0: 6, 1: 6, 2: 7}  # each row's second choice: what the masked stop gives way to

    def logits_for(rows: list[int], produced: int) -> torch.Tensor:
        logits = torch.zeros(len(rows), vocabulary)
        for index, row in enumerate(rows):
            logits[index, scripts[row][produced]] = 2.0
            logits[index, runner_up[row]] = 1.0
        return logits

    remaining, kept_calls, produced = [0, 1, 2], [], [0]

    def step(token_ids: list[int]) -> torch.Tensor:
        assert len(token_ids) == len(remaining)
        produced[0] += 1
        return logits_for(remaining, produced[0])

    def keep(rows: list[int]) -> None:
        kept_calls.append(rows)
        remaining[:] = [remaining[row] for row in rows]

    answers = greedy(logits_for(remaining, 0), step, keep, 5, 1, {stop})
    assert answers == [[4, 5], [1, 2, 3, 4, 5], [7]]
    assert kept_calls == [[0, 1], [1]]


BATCHED_QUALITY = ("answer_log_prob", "answer_log_prob_gap", "kl")  # teacher-forced as one batch


@pytest.mark.parametrize("answer", [[11, 205, 3, 3000, 41], [11]], ids=["answer", "one-token-answer"])
def test_a_batch_of_one_is_generate_bit_for_bit_and_a_batch_its_quality_to_rounding(prefill, answer):
    """``decode_batch=1`` decodes each request as ``generate`` does, quality measures included. In a
    batch of 4, the teacher-forced measures (answer log-likelihood, KL along the forced tokens) come
    from one forward of the batch's prompted caches and equal ``generate``'s to fp32 rounding; the
    probe's (attention error, residual share) runs per row and is exact."""
    methods = requests([request for request in REQUESTS if request[2] in (None, "default")])
    alone = [
        prefill.generate(method, setting, max_new_tokens=8, answer_ids=answer) for method, setting in methods
    ]
    for decode_batch in (1, 4):
        together = grid(prefill, methods, max_new_tokens=8, answer_ids=answer, decode_batch=decode_batch)
        for one, batched in zip(alone, together, strict=True):
            assert batched.token_ids == one.token_ids and batched.cache_stats == one.cache_stats
            if decode_batch == 1:
                assert batched.quality == one.quality
            exact = {key: value for key, value in one.quality.items() if key not in BATCHED_QUALITY}
            assert {key: batched.quality[key] for key in exact} == exact
            for key in BATCHED_QUALITY:
                assert batched.quality[key] == pytest.approx(one.quality[key], rel=1e-5, abs=1e-6), key
        assert max(generation.run["decode_batch"] for generation in together) == decode_batch


def test_a_row_without_the_shared_softmax_decodes_alone(prefill):
    ablation = build_method("snapkv+reskv", 0.9, residual=ResidualConfig(shared_softmax=False))
    methods = [(ablation, "aware"), *requests(REQUESTS[:3])]
    together = grid(prefill, methods, max_new_tokens=4, decode_batch=8)
    assert [generation.run["decode_batch"] for generation in together] == [1, 3, 3, 3]
    assert together[0].token_ids == prefill.generate(ablation, "aware", max_new_tokens=4).token_ids


def test_a_bad_decode_batch_or_a_compiled_batch_is_refused_naming_the_values(prefill):
    with pytest.raises(ValueError, match="decode_batch 0 must be a positive integer"):
        grid(prefill, requests(REQUESTS[:2]), decode_batch=0)
    with pytest.raises(
        ValueError, match="decode mode 'compiled' with decode_batch 2: .* choose decode_batch=1"
    ):
        grid(prefill, requests(REQUESTS[:2]), decode="compiled", decode_batch=2)


def test_batches_hold_rows_of_similar_length_and_only_one_batch_is_compressed_at_a_time(prefill, monkeypatch):
    """Rows are ordered by the share of the prompt they keep (the full cache last), and a batch's
    requests are compressed only when the previous batch has been handed out."""
    methods = requests([request for request in REQUESTS if request[2] in (None, "default")])
    events = []
    prepare = Prefill._prepare

    def recording_prepare(self, method, setting, *args):
        events.append(("prepare", method.retained_fraction))
        return prepare(self, method, setting, *args)

    monkeypatch.setattr(Prefill, "_prepare", recording_prepare)
    for _, generation in prefill.generate_grid(methods, max_new_tokens=3, decode_batch=4):
        events.append(("yield", generation.run["decode_batch"]))
    kinds = "".join("p" if kind == "prepare" else "y" for kind, _ in events)
    sizes = [4] * (len(methods) // 4) + ([len(methods) % 4] if len(methods) % 4 else [])
    assert kinds == "".join("p" * size + "y" * size for size in sizes)
    fractions = [value for kind, value in events if kind == "prepare"]
    assert fractions == sorted(fractions) and fractions[-2:] == [1.0, 1.0]


@pytest.mark.slow
def test_the_runner_decodes_a_sample_s_configurations_together_when_asked_and_records_it(tmp_path):
    """``decode_batch=4``: every configuration's record holds the tokens, statistics and quality measures
    of ``decode_batch=1`` (tiny model: no near ties), its batch's size in its timings, and the plan's
    batch in its provenance."""
    records = {}
    for decode_batch in (1, 4):
        command = [
            *TINY_RUN,
            "max_new_tokens=6",
            "method=[full,snapkv,snapkv+reskv,adakv+reskv]",
            "ratio=[0.6,0.9]",
            "setting=[aware,agnostic]",
            "backbone.quality=true",
            f"decode_batch={decode_batch}",
            f"results_dir={tmp_path / str(decode_batch)}",
        ]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        for path in sorted((tmp_path / str(decode_batch) / "runs").rglob("*.json")):
            result = json.loads(path.read_text())
            assert result["provenance"]["machine"]["decode_batch"] == decode_batch
            (sample,) = result["samples"]
            records.setdefault(decode_batch, []).append(sample)
    assert len(records[1]) == 13 == len(records[4])  # the full cache once, 12 compressed
    for alone, batched in zip(records[1], records[4], strict=True):
        for key in ("prediction_token_ids", "cache_stats"):
            assert batched[key] == alone[key], key
        for key, value in alone["quality"].items():  # the teacher-forced ones to fp32 rounding
            assert batched["quality"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert sorted(sample["run"]["decode_batch"] for sample in records[4]) == [1] + [4] * 12
    assert {sample["run"]["decode_batch"] for sample in records[1]} == {1}
