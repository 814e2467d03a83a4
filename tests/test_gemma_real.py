"""The embedded Gemma 3 270M on real RULER prompts: with the full cache, the engine's greedy tokens are
transformers' own ``generate``'s, token for token, at 4K and at 8K (16 times its 512-token window)."""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.ruler import load_items
from reskv.backbones import load_backbone
from reskv.cache import ATTENTION_NAME
from reskv.engine import Prefill
from reskv.method import Method

NEW_TOKENS = 24


@functools.cache
def gemma():
    return load_backbone("gemma3-270m")


@pytest.mark.slow
@pytest.mark.parametrize("length", [4096, 8192])
def test_full_cache_greedy_tokens_equal_transformers_generate_on_ruler(length):
    backbone = gemma()
    item = load_items("niah_single_1", backbone.tokenizer, length=length, num_samples=1)[0]
    assert len(item.prompt_ids) > length - item.max_new_tokens - 200  # a prompt of about that length
    full = Method("full")
    prefill = Prefill(backbone, item.prompt_ids, item.context_length, [full])
    ours = prefill.generate(full, "aware", NEW_TOKENS, item.stop_token_ids).token_ids
    backbone.model.set_attn_implementation("sdpa")
    try:
        generated = backbone.model.generate(
            torch.tensor([item.prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    finally:
        backbone.model.set_attn_implementation(ATTENTION_NAME)
    reference = generated[0, len(item.prompt_ids) :].tolist()
    assert len(ours) == NEW_TOKENS
    assert ours == reference
