"""Feeding tokens to a cache and greedy decoding: the model forward through a ``ResKVCache``, the
static-capacity cache every generation decodes from, and the decode step compiled as one graph.

    cache = static_cache(compressed_cache, spare_slots=max_new_tokens)
    logits = forward(backbone, torch.tensor([[token_id]]), cache)[:, -1]
    answers = greedy(logits, step, max_new_tokens, min_new_tokens, stop_ids)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch._dynamo.utils import counters

from reskv.cache import CACHE_KWARG, CompressedLayer, ResKVCache, StaticWindowedLayer, WindowedLayer
from reskv.model import Backbone, BackboneError


@torch.inference_mode()
def forward(backbone: Backbone, token_ids: Tensor, cache: ResKVCache, every_position: bool = False) -> Tensor:
    """The logits of ``token_ids`` ``[B, n]`` fed to ``cache`` (one sequence, or ``B`` stacked rows),
    extended in place: ``[B, n, V]``, or ``[B, 1, V]`` for the last position only."""
    return backbone.model(
        input_ids=token_ids,
        use_cache=True,
        logits_to_keep=0 if every_position else 1,
        **{backbone.cache_argument: cache, CACHE_KWARG: cache},
    ).logits


def greedy(
    logits: Tensor,
    step: Callable[[list[int]], Tensor],
    max_new_tokens: int,
    min_new_tokens: int,
    stop_ids: set[int],
) -> list[list[int]]:
    """Greedy answers of ``B`` rows from their next-token logits ``[B, V]``; the stop token itself is not
    part of an answer. Until ``min_new_tokens`` tokens exist, stop tokens cannot be chosen.
    ``step(token_ids)`` feeds one token per row and returns the rows' next logits: a row that has
    stopped is fed its last choice again and its logits are not read, so the batch keeps its shape
    (what a compiled step needs); decoding ends when every row has stopped. One host read a step."""
    answers: list[list[int]] = [[] for _ in range(logits.shape[0])]
    going_on = [True] * logits.shape[0]
    if min_new_tokens:  # a copy from the host: only where stop tokens are masked
        stop_index = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    for produced in range(max_new_tokens):
        if produced < min_new_tokens:
            logits = logits.index_fill(-1, stop_index, float("-inf"))
        next_ids = logits.argmax(dim=-1).tolist()
        for row, token_id in enumerate(next_ids):
            if going_on[row] and token_id in stop_ids:
                going_on[row] = False
            elif going_on[row]:
                answers[row].append(token_id)
        if not any(going_on) or produced + 1 == max_new_tokens:
            break
        logits = step(next_ids)
    return answers


def static_cache(cache: ResKVCache, spare_slots: int) -> ResKVCache:
    """``cache`` with every exact layer (the full method's) copied into a static-capacity
    ``CompressedLayer`` without entries, and every sliding-window layer into a ``StaticWindowedLayer``
    of one row, with ``spare_slots``: one decode path for every method, no copy of the cache per step
    (an exact layer's ``update`` concatenates), and the static shapes a compiled step needs."""
    return ResKVCache([static_layer(layer, spare_slots) for layer in cache.layers])


def static_layer(layer, spare_slots: int):
    """One layer of ``static_cache``."""
    if isinstance(layer, CompressedLayer):
        return layer
    if isinstance(layer, WindowedLayer):
        return StaticWindowedLayer([layer], layer.seq_len, spare_slots)
    return CompressedLayer.exact(layer, spare_slots)


# The slots a grid's views hold beside the shared cache under the compiled step (their entry pool, their
# appended slots: ``reskv.views.ViewLayer``) rounded up to a multiple of this. Those dimensions are
# dynamic, but torch._dynamo gives sizes 0 and 1 their own graph and equal sizes one symbol (a guard
# that they stay equal), and a kernel may guard a size's alignment (SDPA's mask on CUDA).
CAPACITY_BUCKET = 64
# The most graphs a grid's compiled step compiles in a process (``reskv.grid.decode_grid``, where
# every row reaches the step in a cache of views, its rule's values as tensors): one, whatever its
# rows, prompts and batches (``reskv.views.ViewLayer``: every size that differs between batches a
# dynamic dimension, none of 0 or 1, the values tensors read always as many), for any number of rows
# from two (torch._dynamo would give one row a graph of its own: ``reskv.grid.decode_batch`` decodes a
# row alone beside a copy); within torch._dynamo's recompile limit (8). A single request's compiled
# step (``Prefill.generate``) compiles a graph per kind of rule besides (its gate, ``g_min`` zero or
# not, ``tau`` and ``alpha`` symbolic once they differ). A batch past the limit all the same decodes
# eagerly (``reskv.grid.decoded_or_halved``).
COMPILED_GRAPH_BOUND = 1
# What ``torch.compile(fullgraph=True)`` raises at the recompile limit, instead of a graph break.
RECOMPILE_LIMIT_HIT = torch._dynamo.exc.FailOnRecompileLimitHit


def bucketed(slots: int) -> int:
    """``slots`` rounded up to a multiple of ``CAPACITY_BUCKET``."""
    return -(-slots // CAPACITY_BUCKET) * CAPACITY_BUCKET


@functools.cache
def compiled_step(model: torch.nn.Module, cache_argument: str):
    """One decode step of ``model`` compiled as one graph (``torch.compile(fullgraph=True)``: no
    graph break): ``(tokens [B, 1], positions [B, 1], cache) -> logits [B, V]``, for a cache of
    ``CompressedLayer``s (``static_cache``, one row) or of ``reskv.views.ViewLayer``s (a grid's rows,
    a dynamic dimension: ``COMPILED_GRAPH_BOUND`` graphs whatever their number). On CUDA its kernels
    are replayed as CUDA graphs (``mode="reduce-overhead"``), which removes the per-op host cost a
    decode step is bound by."""

    def step(token: Tensor, position: Tensor, cache: ResKVCache) -> Tensor:
        output = model(
            input_ids=token,
            position_ids=position,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument: cache, CACHE_KWARG: cache},
        )
        return output.logits[:, -1]

    mode = "reduce-overhead" if model.device.type == "cuda" else None
    return torch.compile(step, fullgraph=True, mode=mode)


def release_compiled() -> None:
    """Forget every compiled step: ``compiled_step``'s cache (which holds its model alive),
    torch._dynamo's graphs and guards, and its counters (``counters["stats"]["unique_graphs"]``, the
    graphs compiled since), which ``torch._dynamo.reset`` keeps. A job calls it when it ends, so that a
    reused worker holds no previous model; whatever counts compiled graphs calls it first."""
    compiled_step.cache_clear()
    torch._dynamo.reset()
    counters.clear()


def compiled_next_logits(backbone: Backbone, token_ids: Sequence[int], cache: ResKVCache) -> Tensor:
    """The next-token logits ``[B, V]`` after one token per row through ``compiled_step``: the host
    claims the cache's slot first, so that the compiled graph reads no Python counter
    (``CompressedLayer.claim``)."""
    position = cache.get_seq_length()
    cache.claim(1)
    device = backbone.device
    tokens = torch.tensor(token_ids, device=device)[:, None]
    positions = torch.full_like(tokens, position)
    if len(token_ids) > 1:  # a batch's rows: one graph whatever their number (``reskv.views.ViewLayer``)
        for batched in (tokens, positions):
            torch._dynamo.maybe_mark_dynamic(batched, 0)
    return compiled_step(backbone.model, backbone.cache_argument)(tokens, positions, cache)


# The full-cache check's decode steps, after its prefill (``check_full_cache``).
CHECK_DECODE_STEPS = 4
# The largest difference ``check_full_cache`` admits between the two forwards' logits, relative to
# the largest reference logit: fp rounding of two summation orders, in the model's dtype.
CHECK_TOLERANCE = {torch.float32: 1e-4}
CHECK_TOLERANCE_HALF = 5e-2


@torch.inference_mode()
def check_full_cache(backbone: Backbone) -> None:
    """Refuse a model whose full-cache logits through a ``ResKVCache`` differ from transformers' own
    forward (``sdpa``, its own cache and masks) beyond fp rounding: a prompt of random tokens longer
    than every sliding window, prefilled, then ``CHECK_DECODE_STEPS`` tokens decoded one at a time from
    the static cache every generation decodes from (``static_cache``), compared at every position.
    Cheap (one prompt of a window's length), and run once per backbone at load, so that a layer kind
    run wrongly (a window ignored, attention sinks, soft-capping) cannot go unnoticed; an attention
    argument the engine does not implement is refused by its own forward, which runs first."""
    model = backbone.model
    windows = [window for window in backbone.windows if window is not None]
    length = min(max(windows, default=0) + 2 * CHECK_DECODE_STEPS, model.config.max_position_embeddings)
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(model.config.vocab_size, (1, length), generator=generator).to(backbone.device)
    # The engine's forward first: an attention argument it does not implement is refused there
    # (``reskv.cache.refused_arguments``), before transformers' own forward is asked for.
    prefilled = length - CHECK_DECODE_STEPS
    cache = ResKVCache.for_prefill(backbone.windows, 0, False)
    logits = [forward(backbone, token_ids[:, :prefilled], cache, every_position=True)[0]]
    cache = static_cache(cache, CHECK_DECODE_STEPS)
    for position in range(prefilled, length):
        logits.append(forward(backbone, token_ids[:, position : position + 1], cache)[0])
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        reference = model(input_ids=token_ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(implementation)
    difference = float((torch.cat(logits).float() - reference).abs().max() / reference.abs().max())
    tolerance = CHECK_TOLERANCE.get(model.dtype, CHECK_TOLERANCE_HALF)
    if not difference <= tolerance:
        raise BackboneError(
            f"backbone {backbone.name!r}: its full-cache logits through the ResKV cache differ from "
            f"transformers' own forward by {difference:.3g} (the largest difference over the largest "
            f"logit; {tolerance} admitted) on a {length}-token check with layer windows "
            f"{backbone.windows}: the engine does not run this model's attention as the model does"
        )
