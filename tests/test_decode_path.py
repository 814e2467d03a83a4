"""One decode path for every method: static buffers, no host sync, and a compiled step."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from baselines import build_method
from reskv.backbones import tiny_backbone
from reskv.cache import CompressedLayer, ResKVCache
from reskv.decode_rule import DecodeRule, plain_rule
from reskv.decoding import release_compiled, static_cache
from reskv.engine import Prefill
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
    reads nothing back from the device: the slot it writes is a device-side position. Its one wait is
    the fed token's copy to the device (not ``non_blocking``: a sync on CUDA,
    ``scripts.bench.dispatch_counts``)."""
    cache = decode_cache(prefill, name)
    assert all(isinstance(layer, CompressedLayer) for layer in cache.layers)
    prefill.next_logits([FORCED[0]], cache)
    with count_dispatch() as counts:
        prefill.next_logits([FORCED[1]], cache)
    assert counts.syncs_by_op == {"tensor(device=)": 1}
    assert counts.by_op["index_copy_"] == 2 * len(cache.layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODED_METHODS)
def test_the_compiled_step_gives_the_eager_logits(prefill, name):
    """``torch.compile(fullgraph=True)`` of the decode step (no graph break, no data-dependent shape)
    gives the eager step's logits along the same tokens, to fp32 rounding, and the same greedy tokens."""
    release_compiled()
    eager = forced_logits(prefill, decode_cache(prefill, name), prefill.next_logits)
    compiled = forced_logits(prefill, decode_cache(prefill, name), prefill.compiled_next_logits)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
    generated = {
        mode: prefill.generate(build_method(name, 0.7), "agnostic", 6, decode=mode)
        for mode in ("eager", "compiled")
    }
    assert generated["compiled"].token_ids == generated["eager"].token_ids


@pytest.mark.slow
def test_one_compiled_graph_serves_every_pattern_of_layers_with_and_without_entries():
    """Which layers of a +ResKV cache hold residual entries varies with the prompt and the ratio (a layer
    whose heads all chose ``r = 0`` holds none: here a SnapKV layer given +ResKV's rule). The compiled
    step must not specialise on it: the 16 caches of 4 layers, each layer with entries or without,
    compile at most 2 graphs (static shapes first, then dynamic ones), each giving the eager step's
    logits. A graph per pattern would pass torch._dynamo's recompile limit (8), which
    ``fullgraph=True`` turns into an error in the middle of a run. (A base method's cache, whose rule
    has no gate, compiles its own graph: one SDPA call per layer, tests/test_dispatch_counts.py.)"""
    backbone = tiny_backbone("tiny-llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    methods = [build_method(name, 0.6) for name in ("snapkv", "snapkv+reskv")]
    prefill = Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270, methods)
    base, reskv = (prefill.compressed(method, "aware")[0] for method in methods)
    assert all(layer.residual_slots > 0 for layer in reskv.layers)
    assert all(layer.residual_slots == 0 for layer in base.layers)

    def cache_of(pattern: tuple[bool, ...]) -> ResKVCache:
        layers = [(reskv if entries else base).layers[i].fork() for i, entries in enumerate(pattern)]
        for layer in layers:
            layer.rule = reskv.layers[0].rule
        cache = ResKVCache(layers)
        cache.reserve(1)
        return static_cache(cache, 1)

    release_compiled()
    for pattern in itertools.product((False, True), repeat=len(reskv.layers)):
        eager = prefill.next_logits([FORCED[0]], cache_of(pattern))
        compiled = prefill.compiled_next_logits([FORCED[0]], cache_of(pattern))
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.slow
def test_a_runs_methods_compile_one_graph_per_kind_of_cache():
    """A run decodes many methods at many ratios in one process: base and full caches (no gate, one
    SDPA call per layer) and +ResKV ones (the gated form) are two kinds of graph, each compiled once
    (the slots marked dynamic from the first call), whatever the number of configurations: far under
    torch._dynamo's recompile limit (8). Left to automatic dynamic shapes, the slots take 3 graphs."""
    backbone = tiny_backbone("tiny-llama", num_attention_heads=4, num_key_value_heads=2)
    names = ("full", "snapkv", "snapkv+reskv", "adakv", "adakv+reskv", "tova+reskv")
    methods = [build_method(name, ratio) for ratio in (0.6, 0.9) for name in names]
    prefill = Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270, methods)
    release_compiled()
    for method in methods:
        for setting in ("aware", "agnostic"):
            prefill.generate(method, setting, max_new_tokens=3, decode="compiled")
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.slow
def test_the_compiled_step_follows_a_rule_whose_gate_parameters_change():
    """Rules that differ in ``tau`` and ``alpha`` recompile the step once with the two as symbolic floats;
    its gate must then still be the eager one (torch 2.13's inductor drops ``rsub``'s symbolic
    ``alpha``, which gave ``log g`` off by 0.09)."""
    backbone = tiny_backbone("tiny-llama", num_attention_heads=4, num_key_value_heads=2)
    method = build_method("snapkv+reskv", 0.6)
    prefill = Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270, [method])
    cache, _ = prefill.compressed(method, "aware")
    assert all(layer.residual_slots > 0 for layer in cache.layers)
    release_compiled()
    for tau, alpha in ((0.25, 12.0), (0.3, 8.0), (0.2, 16.0)):
        rule = plain_rule(dataclasses.replace(DecodeRule(), tau=tau, alpha=alpha))
        logits = {}
        for step in (prefill.next_logits, prefill.compiled_next_logits):
            layers = [layer.fork() for layer in cache.layers]
            for layer in layers:
                layer.rule = rule
            decoded = static_cache(ResKVCache(layers), 1)
            decoded.reserve(1)
            logits[step] = step([FORCED[0]], decoded)
        torch.testing.assert_close(*logits.values(), rtol=1e-4, atol=1e-5)


def test_the_compiled_step_refuses_the_no_shared_softmax_ablation_before_decoding(prefill):
    method = build_method("snapkv+reskv", 0.7)
    ablation = dataclasses.replace(
        method, residual=dataclasses.replace(method.residual, shared_softmax=False)
    )
    with pytest.raises(ValueError, match="no_shared_softmax ablation .* decodes with decode=eager"):
        prefill.generate(ablation, "aware", max_new_tokens=2, decode="compiled")
    assert prefill.generate(ablation, "aware", max_new_tokens=2).token_ids  # eager decodes it


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


def test_an_attention_argument_no_form_implements_refuses_the_model_at_load():
    """Gemma 2 soft-caps its attention logits (``softcap``, passed to the attention function): the
    engine's forms do not, so the model is refused at load (the load's check runs the engine's forward
    first), naming the argument and its value, rather than run with the argument dropped. With
    ``attn_logit_softcapping`` unset the argument is ``None`` and nothing is refused there."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    from reskv.backbones import _finish, embedded_model_dir
    from reskv.cache import refused_arguments

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16,
        attn_logit_softcapping=50.0, max_position_embeddings=4096,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"layer 0 of Gemma2Attention passes its attention softcap=50.0, which"
    ):
        _finish("tiny-gemma2", Gemma2ForCausalLM(config).float(), tokenizer)
    assert refused_arguments(0.0, {"softcap": None, "position_ids": torch.zeros(1), "use_cache": True}) == []
    assert refused_arguments(0.1, {"s_aux": 1.0, "is_causal": False}) == [
        "dropout=0.1",
        "s_aux=1.0",
        "is_causal=False",
    ]
