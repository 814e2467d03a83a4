"""A model whose layers differ in kind (Gemma 3: sliding-window layers between full-attention ones), on a
tiny random Gemma 3 whose 16-token window is far shorter than its prompts: the full cache decodes as
transformers' own ``generate`` does, every decode path gives the same tokens, and methods compress the
full-attention layers only (reskv.md, Hybrid attention)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import zipfile
from types import SimpleNamespace

import pytest
import torch

import reskv.assets
import reskv.cache
from baselines import build_method
from reskv.assets import AssetError, ChunkedAsset, WheelAsset, assembled_path
from reskv.backbones import TINY_WINDOW, tiny_backbone
from reskv.cache import ResKVCache
from reskv.decoding import forward
from reskv.engine import Prefill
from reskv.grid import decode_grid
from reskv.model import BackboneError, layer_windows
from scripts.harness.store import SCHEMA, ResultKey
from scripts.measure import random_prompt
from scripts.report.index import ResultIndex
from scripts.report.tables import all_tables
from tests.conftest import TOKENS

PROMPT, CONTEXT = 100, 90  # tokens: the prompt, and its context prefix
NEW_TOKENS = 12
# Layers: windowed, full, windowed, full, windowed, full (tiny_backbone's pattern): 3 compressed.
LAYERS, KV_HEADS = 6, 2


@functools.cache
def gemma():
    return tiny_backbone(
        "tiny-gemma3", num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS
    )


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    return Prefill(gemma(), random_prompt(TOKENS, PROMPT, seed=1), CONTEXT)


@contextlib.contextmanager
def transformers_attention(backbone):
    """The model on transformers' own SDPA attention, its own cache and masks, within the block."""
    backbone.model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        backbone.model.set_attn_implementation(reskv.cache.ATTENTION_NAME)


def test_the_tiny_gemma_has_both_layer_kinds():
    assert gemma().windows == [TINY_WINDOW, None] * (LAYERS // 2)


@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_full_cache_greedy_tokens_equal_transformers_generate(prefill, setting):
    backbone = prefill.backbone
    ours = prefill.generate(build_method("full"), setting, max_new_tokens=NEW_TOKENS).token_ids
    with transformers_attention(backbone):
        generated = backbone.model.generate(
            torch.tensor([prefill.prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            min_new_tokens=NEW_TOKENS,
        )
    reference = generated[0, PROMPT:].tolist()
    assert len(ours) == NEW_TOKENS  # the random model's stop token never comes: every step compared
    assert ours == reference


def test_compiled_step_and_grid_decode_equal_the_eager_single_decode(prefill):
    requests = [
        (build_method(name, ratio), setting)
        for setting in ("aware", "agnostic")
        for name, ratio in [("full", None), ("snapkv", 0.7), ("snapkv+reskv", 0.7), ("pyramidkv", 0.5)]
    ]
    eager = [prefill.generate(m, s, max_new_tokens=NEW_TOKENS).token_ids for m, s in requests]
    compiled = [
        prefill.generate(m, s, max_new_tokens=NEW_TOKENS, decode="compiled").token_ids for m, s in requests
    ]
    assert compiled == eager
    for decode in ("eager", "compiled"):
        generations = dict(decode_grid(prefill, requests, max_new_tokens=NEW_TOKENS, decode=decode))
        assert max(generation.run["batch_rows"] for generation in generations.values()) == len(requests)
        assert [generations[row].token_ids for row in range(len(requests))] == eager


def test_budget_is_floor_of_s_times_one_minus_rho_in_every_compressed_layer(prefill):
    _, stats = prefill.compressed_layers(build_method("snapkv", 0.75), "aware")
    assert stats["budget"] == 25  # floor(100 * 0.25)
    assert stats["main_slots"] == [[25] * KV_HEADS] * (LAYERS // 2)  # the full-attention layers only
    windowed = [[TINY_WINDOW - 1] * KV_HEADS]  # the last window - 1 tokens, all the next one sees
    assert stats["slots"] == (windowed + [[25] * KV_HEADS]) * (LAYERS // 2)


def test_retained_shares_of_the_compressed_layers_and_of_the_whole_cache(prefill):
    _, stats = prefill.compressed_layers(build_method("snapkv", 0.75), "aware")
    assert stats["retained_compressed"] == 25 / 100
    # 3 compressed layers x 2 heads x 25 slots and 3 windowed x 2 x 15, over the full cache's
    # 3 x 2 x 100 + 3 x 2 x 15.
    assert stats["retained_cache"] == (150 + 90) / (600 + 90)
    _, full = prefill.compressed_layers(build_method("full"), "aware")
    assert full["retained_compressed"] == full["retained_cache"] == 1.0


def test_pyramidkv_spreads_its_budgets_over_the_compressed_layers_only(prefill):
    _, stats = prefill.compressed_layers(build_method("pyramidkv", 0.5), "aware")
    # b = 50, window W = 32, beta = 20 (baselines.md, PyramidKV): C - W = 18, min 18 // 20 = 0, max
    # 2 * 18 - 0 = 36 (below s - W = 68), a line from 36 down to 0 over the 3 compressed layers.
    assert stats["main_slots"] == [[36 + 32] * KV_HEADS, [18 + 32] * KV_HEADS, [0 + 32] * KV_HEADS]


def test_adakv_allots_each_compressed_layers_budget_over_its_heads(prefill):
    _, stats = prefill.compressed_layers(build_method("adakv", 0.5), "aware")
    assert len(stats["main_slots"]) == LAYERS // 2
    assert [sum(heads) for heads in stats["main_slots"]] == [KV_HEADS * 50] * (LAYERS // 2)


def test_a_cache_built_for_other_layer_kinds_is_refused():
    backbone = gemma()
    cache = ResKVCache.for_prefill([None] * LAYERS, 0, False)
    with pytest.raises(ValueError, match="layer 0 attends with sliding_window=16 but its cache layer"):
        forward(backbone, torch.tensor([random_prompt(TOKENS, 20, seed=0)]), cache)


def test_an_unknown_layer_kind_is_refused_naming_the_layer():
    config = SimpleNamespace(
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "chunked_attention"],
    )
    with pytest.raises(BackboneError, match="layer 2 of the model is of kind 'chunked_attention'"):
        layer_windows(config)
    assert layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=64)) == [64, 64]  # Mistral v0.1


def test_a_model_run_otherwise_than_transformers_runs_it_is_refused_at_load(monkeypatch):
    """Sliding-window layers attended over the whole prompt (what the engine did before it knew the
    kind) differ from transformers' forward on the load check's prompt."""
    monkeypatch.setattr(
        reskv.cache,
        "windowed_attention",
        lambda q, k, v, window, s: reskv.cache.causal_attention(None, q, k, v, s),
    )
    with pytest.raises(BackboneError, match="differ from transformers' own forward"):
        tiny_backbone("tiny-gemma3", num_hidden_layers=2)


def chunk_wheels(tmp_path, parts: list[bytes]) -> ChunkedAsset:
    """``parts`` as the members of pinned wheels in ``tmp_path/wheels``, as a chunked asset."""
    (tmp_path / "wheels").mkdir()
    chunks = []
    for index, data in enumerate(parts):
        chunk = WheelAsset(
            f"model-part{index + 1}", "1.0.0", f"model_part{index + 1}/data/model.bin.part{index:02d}"
        )
        with zipfile.ZipFile(tmp_path / "wheels" / chunk.wheel_name, "w") as wheel:
            wheel.writestr(chunk.member, data)
        chunks.append(chunk)
    whole = b"".join(parts)
    return ChunkedAsset("model.bin", tuple(chunks), hashlib.sha256(whole).hexdigest())


def test_a_chunked_asset_is_its_chunks_in_order_checked_against_its_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(reskv.assets, "ASSETS_DIR", tmp_path)
    parts = [b"first chunk;", b"second;", b"third and last"]
    asset = chunk_wheels(tmp_path, parts)
    assert assembled_path(asset).read_bytes() == b"".join(parts)


def test_a_chunked_asset_whose_sha256_differs_is_an_error_naming_the_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(reskv.assets, "ASSETS_DIR", tmp_path)
    asset = chunk_wheels(tmp_path, [b"first chunk;", b"second;"])
    swapped = ChunkedAsset(asset.name, asset.chunks[::-1], asset.sha256)  # out of order
    with pytest.raises(
        AssetError, match="model_part2-1.0.0-py3-none-any.whl, model_part1-1.0.0-py3-none-any.whl"
    ):
        assembled_path(swapped)
    assert not list((tmp_path / "assembled").iterdir())  # nothing kept to be loaded later


def test_tables_name_the_whole_caches_retained_share_beside_the_budget(tmp_path):
    """Hand-written records of a hybrid backbone: the averages table's budget head gives the whole
    cache's share (the mean over the configurations' samples) beside the compressed layers' 10%; a
    backbone whose two shares agree keeps the plain head."""
    runs_dir = tmp_path / "runs"
    shares = {  # (backbone, method): per-sample (retained_compressed, retained_cache)
        ("gemma3-270m", "snapkv"): [(0.1, 0.44), (0.1, 0.46)],
        ("gemma3-270m", "snapkv+reskv"): [(0.1, 0.45), (0.1, 0.45)],
        ("smollm2-135m", "snapkv"): [(0.1, 0.1), (0.1, 0.1)],
    }
    for (backbone, method), samples in shares.items():
        key = ResultKey(backbone, "ruler", 4096, "niah_single_1", "aware", method, 0.9)
        records = [
            {
                "index": index,
                "score": 1,
                "prediction": "7",
                "cache_stats": {"retained_compressed": c, "retained_cache": w},
            }
            for index, (c, w) in enumerate(samples)
        ]
        path = key.path(runs_dir)
        path.parent.mkdir(parents=True)
        path.write_text(
            json.dumps({"schema": SCHEMA, "key": key.to_json(), "samples_total": 2, "samples": records})
        )
    index, warnings = ResultIndex.from_directory(runs_dir)
    tables = {table.name: table for table in all_tables(index)}
    heads = [text for text, _ in tables["ruler_averages"].heads[-1]]
    assert heads == ["10% (45% of cache)", "10%"]


@pytest.mark.parametrize("decode", ["alone", "grid"])
def test_quality_measures_average_the_compressed_layers(prefill, decode):
    """The attention probe runs on both layer kinds; a sliding-window layer is the full cache's own
    (error 0, no entries) and the means are over the full-attention layers."""
    method, answer = build_method("snapkv+reskv", 0.75), random_prompt(TOKENS, 3, seed=2)
    if decode == "alone":
        quality = prefill.generate(method, "agnostic", max_new_tokens=4, answer_ids=answer).quality
    else:
        requests = [(method, "agnostic"), (build_method("snapkv", 0.75), "aware")]
        quality = dict(decode_grid(prefill, requests, max_new_tokens=4, answer_ids=answer))[0].quality
    errors = quality["attention_error_by_layer"]
    assert errors[0::2] == [0.0] * (LAYERS // 2)  # the windowed layers
    assert min(errors[1::2]) > 0
    assert quality["attention_error"] == pytest.approx(sum(errors[1::2]) / (LAYERS // 2), rel=1e-5)
