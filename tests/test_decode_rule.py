"""Every decode-time option is honoured on every decode path: for each field of ``DecodeRule`` (read
from its declaration, so a field added there is covered here unedited), a non-default value decoded
alone, in a batch of two beside the default, eager and compiled, gives the tokens and logits it gives
alone, and changes them from the default's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines import build_method
from reskv.config import ResidualConfig
from reskv.decode_rule import DecodeRule
from reskv.decoding import compiled_next_logits, release_compiled
from reskv.engine import Prefill
from scripts.measure import random_prompt
from tests.conftest import TOKENS, cached_tiny_backbone
from tests.test_grid_decode import alone_logits, batch_logits, eager_step, grid

NEW_TOKENS = 6
# Rows of one batch within fp32 rounding of their decode alone (test_grid_decode), compiled within
# inductor's (test_decode_path); a rule's effect on the logits is far larger.
BATCH_TOLERANCE = {"rtol": 0, "atol": 2e-5}
COMPILED_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
EFFECT = 1e-3


def non_default(field: dataclasses.Field):
    """A value other than the field's default, from its type: a switch flipped, a number doubled, and
    for a default of 0 a value near the top of [0, 1) (a floor such as ``g_min`` changes a decode only
    above the gate, which stays near 0.9 on this prompt)."""
    if isinstance(field.default, bool):
        return not field.default
    return 2 * field.default if field.default else 0.99


NON_DEFAULT_VALUES = {field.name: non_default(field) for field in dataclasses.fields(DecodeRule)}


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each option compiles graphs of its own rule: what earlier tests of this worker compiled must not
    count against torch._dynamo's recompile limit (the suite runs in any order)."""
    release_compiled()


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    return Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270)


def reskv(**options):
    return build_method("snapkv+reskv", 0.6, residual=ResidualConfig(**options)), "aware"


def compiled_step(prefill: Prefill):
    def step(token_ids, cache):
        return compiled_next_logits(prefill.backbone, token_ids, cache)

    return step


def test_the_options_are_every_field_of_the_rule():
    """The fields are the rule's, each with a value its default is not."""
    assert set(NON_DEFAULT_VALUES) >= {"tau", "alpha", "g_min", "beta", "gate", "shared_softmax"}
    assert all(value != getattr(DecodeRule(), name) for name, value in NON_DEFAULT_VALUES.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(NON_DEFAULT_VALUES))
def test_a_decode_time_option_is_honoured_alone_and_beside_the_default_eager_and_compiled(prefill, name):
    changed, default = reskv(**{name: NON_DEFAULT_VALUES[name]}), reskv()
    rule = changed[0].decode_rule
    assert getattr(rule, name) == NON_DEFAULT_VALUES[name]  # the layers' plain rule carries it
    alone = alone_logits(prefill, *changed)
    assert (alone - alone_logits(prefill, *default)).abs().max() > EFFECT, "the option changes nothing"
    tokens = prefill.generate(*changed, max_new_tokens=NEW_TOKENS).token_ids
    if rule.compiles:
        torch.testing.assert_close(
            alone_logits(prefill, *changed, step=prefill.compiled_next_logits), alone, **COMPILED_TOLERANCE
        )
    for decode in ("eager", "compiled"):
        for max_rows in (1, 2):
            first, beside = grid(
                prefill, [changed, default], max_new_tokens=NEW_TOKENS, decode=decode, max_rows=max_rows
            )
            assert first.token_ids == tokens, (decode, max_rows)
            assert first.run == {
                "decode": rule.decode_mode(decode),
                "batch_rows": 2 if max_rows == 2 and rule.batches else 1,
            }
            assert beside.token_ids == prefill.generate(*default, max_new_tokens=NEW_TOKENS).token_ids
    if not rule.batches:
        return
    default_alone = alone_logits(prefill, *default)
    steps = {
        "eager": (eager_step(prefill), BATCH_TOLERANCE),
        "compiled": (compiled_step(prefill), COMPILED_TOLERANCE),
    }
    for decode, (step, tolerance) in steps.items():
        together = batch_logits(prefill, [changed, default], step)
        for row, expected in enumerate((alone, default_alone)):
            torch.testing.assert_close(
                together[row], expected, **tolerance, msg=lambda text, at=(decode, row): f"{at}: {text}"
            )
