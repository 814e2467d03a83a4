"""End to end on the embedded SmolLM2-135M (slow: runs in CI, skipped by `make test-fast`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from baselines import METHODS, RESIDUAL_BASES, build_method
from reskv.backbones import load_backbone
from reskv.compress import budget_for
from reskv.engine import Prefill
from reskv.prompting import tokenize_prompt

pytestmark = pytest.mark.slow

NEEDLE = "7341295"
# Every compressing method once, each scorer at both ratios across its pair: a base method with a
# +ResKV pair at 0.6, its composition (which adds k-means over every layer) and CaM at 0.9, the
# ratio of the paper's ResKV and CaM tables.
SWEEP = [(name, 0.6 if name in RESIDUAL_BASES else 0.9) for name in METHODS if name != "full"]
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@pytest.fixture(scope="module")
def backbone():
    return load_backbone("smollm2-135m")


@pytest.fixture(scope="module")
def needle_prefill(backbone):
    """A ~2K-token RULER-style single-needle prompt in a repeated-sentence haystack."""
    haystack = [FILLER] * 80
    haystack.insert(35, f"One of the special magic numbers for long-context is: {NEEDLE}. ")
    context = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n" + "".join(haystack)
    )
    question = "\nWhat is the special magic number for long-context mentioned in the provided text?"
    prompt = backbone.tokenizer.apply_chat_template(
        [{"role": "user", "content": context + question}], tokenize=False, add_generation_prompt=True
    )
    prompt += "The special magic number for long-context mentioned in the provided text is"
    split = prompt.index(question)
    prompt_ids, context_length = tokenize_prompt(backbone.tokenizer, prompt[:split], prompt[split:])
    assert 1800 <= len(prompt_ids) <= 2300
    methods = [build_method(name, ratio) for name in METHODS for ratio in (0.6, 0.9)]
    return Prefill(backbone, prompt_ids, context_length, methods)


def test_full_cache_finds_the_needle(needle_prefill):
    for setting in ("aware", "agnostic"):
        assert NEEDLE in needle_prefill.generate(build_method("full"), setting, max_new_tokens=12).text


@pytest.mark.parametrize(("name", "ratio"), SWEEP)
def test_every_method_runs_in_both_settings_with_caches_of_the_expected_size(needle_prefill, name, ratio):
    method = build_method(name, ratio)
    scope = method.scorer.budget_scope
    layers = needle_prefill.backbone.num_layers
    for setting in ("aware", "agnostic"):
        generation = needle_prefill.generate(method, setting, max_new_tokens=4)
        stats = generation.cache_stats
        budget = budget_for(stats["compressed_tokens"], ratio)
        assert stats["budget"] == budget and len(stats["slots"]) == layers
        for slots, main, reserved in zip(
            stats["slots"], stats["main_slots"], stats["residual_slots"], strict=True
        ):
            allocated = [m + r for m, r in zip(main, reserved, strict=True)]
            if scope == "head":  # AdaKV: uneven heads, the layer's total
                assert sum(allocated) == budget * len(allocated)
            elif scope == "layer":  # PyramidKV: one budget per layer, the same for its heads
                assert len(set(allocated)) == 1
            else:
                assert (scope, allocated) == ("uniform", [budget] * len(allocated))
            if scope != "layer":
                assert sum(slots) <= budget * len(slots)
        if scope == "layer":  # the layer budgets average b (baselines.md, PyramidKV)
            layer_budgets = [
                main[0] + reserved[0]
                for main, reserved in zip(stats["main_slots"], stats["residual_slots"], strict=True)
            ]
            assert sum(layer_budgets) == budget * layers
        if name.endswith("+reskv"):
            # The proxy gives residual slots somewhere (not necessarily everywhere).
            assert any(r for layer in stats["residual_slots"] for r in layer)
        assert 0 < len(generation.token_ids) <= 4


def test_the_readme_python_example_runs_as_written_and_the_full_cache_answers(capsys):
    """The README's Python block, executed verbatim: the full cache finds both numbers."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    exec(compile(example, "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert "4711" in lines[0]
    full_line = next(line for line in lines if line.startswith("full aware"))
    assert "7374122" in full_line.split("(")[0] and full_line.endswith(" 0.0")
