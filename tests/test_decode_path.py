"""One decode path for every method (issue 24): static buffers, no host sync, and a compiled step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from baselines import build_method
from reskv.cache import CompressedLayer
from reskv.engine import Prefill, static_cache
from scripts.bench.dispatch_counts import count_dispatch
from scripts.measure import random_prompt
from tests.conftest import TINY_RUN, TOKENS, cached_tiny_backbone

ROOT = Path(__file__).resolve().parent.parent
DECODED_METHODS = ("full", "snapkv", "snapkv+reskv", "adakv+reskv")
FORCED = [17, 905, 3, 2211, 64, 7]  # tokens fed one at a time, whatever the model would choose


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    return Prefill(
        backbone, random_prompt(TOKENS, 300, seed=3), 270, [build_method(m, 0.7) for m in DECODED_METHODS]
    )


def decode_cache(prefill: Prefill, name: str):
    """The static cache ``generate`` decodes for ``name`` (query-aware), room for the forced tokens."""
    cache, _ = prefill.compressed(build_method(name, 0.7), "aware")
    cache.reserve(len(FORCED))
    return static_cache(cache, len(FORCED))


def forced_logits(prefill: Prefill, cache, step) -> torch.Tensor:
    return torch.stack([step([token], cache) for token in FORCED])


@pytest.mark.parametrize("name", DECODED_METHODS)
def test_a_decode_step_reads_nothing_back_from_the_device(prefill, name):
    """Every layer is a static ``CompressedLayer`` (the full method's too) and one eager decode step
    makes no host-device sync: the slot it writes is a device-side position."""
    cache = decode_cache(prefill, name)
    assert all(isinstance(layer, CompressedLayer) for layer in cache.layers)
    prefill.next_logits([FORCED[0]], cache)
    with count_dispatch() as counts:
        prefill.next_logits([FORCED[1]], cache)
    assert counts.syncs == 0 and counts.by_op["index_copy_"] == 2 * len(cache.layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODED_METHODS)
def test_the_compiled_step_gives_the_eager_logits(prefill, name):
    """``torch.compile(fullgraph=True)`` of the decode step (no graph break, no data-dependent shape)
    gives the eager step's logits along the same tokens, to fp32 rounding, and the same greedy tokens."""
    torch._dynamo.reset()
    eager = forced_logits(prefill, decode_cache(prefill, name), prefill.next_logits)
    compiled = forced_logits(prefill, decode_cache(prefill, name), prefill._compiled_step)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    generated = {
        mode: prefill.generate(build_method(name, 0.7), "agnostic", 6, decode=mode)
        for mode in ("eager", "compiled")
    }
    assert generated["compiled"].token_ids == generated["eager"].token_ids


@pytest.mark.slow
def test_the_runner_decodes_compiled_when_asked_and_records_it(tmp_path):
    """``decode=compiled`` reaches every generation: the same answers as ``decode=eager`` and the mode
    in each result file's provenance."""
    answers = {}
    for mode in ("eager", "compiled"):
        command = [
            *TINY_RUN,
            "method=[full,snapkv+reskv]",
            "ratio=0.7",
            f"decode={mode}",
            f"results_dir={tmp_path / mode}",
        ]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        for path in sorted((tmp_path / mode / "runs").rglob("*.json")):
            result = json.loads(path.read_text())
            assert result["provenance"]["machine"]["decode"] == mode
            answers.setdefault(mode, []).append([sample["prediction"] for sample in result["samples"]])
    assert len(answers["eager"]) == 2 and answers["compiled"] == answers["eager"]
