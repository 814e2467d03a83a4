"""A sample's grid decoded together: the configurations of one prompt as the rows of one stacked cache
(``reskv.cache.StackedLayer``), one model forward a step for all of them, eager or compiled.

    for index, generation in decode_grid(prefill, requests, max_new_tokens=32, decode="compiled"):
        ...

Rows are ordered by the slots their caches will hold and cut into batches that pad little and whose
stacked cache fits the device's memory beside what the sample's construction holds
(``reskv.batching.sample_batches``; at most ``max_rows`` rows); a batch that fails to allocate all
the same is split and decoded again (``decoded_or_split``). Each batch's rows are compressed
(sharing, within a setting, what does not depend on the ratio: ``Prefill.sharing_construction``),
stacked straight from their compressed states, and the question is fed to its query-agnostic rows
in one forward, which the query-aware rows pass through with their new slots masked; then one
greedy decode steps every row, a row that stopped being fed on with its logits unread, so that the
batch keeps its shape (one compiled graph whatever the rows).
A row's tokens equal its decode alone but at near ties: a batch pads its rows and sums their
attention in another order. A batch of one, and a row without the shared softmax (which the stacked
attention does not compute), decode alone as ``Prefill.generate`` does, bit for bit.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from reskv.batching import DeviceMemory, ModelShape, decode_batches, predicted_slots, sample_batches
from reskv.cache import ObservedLayer, ResKVCache, StackedLayer, StackedRow, WindowedLayer
from reskv.compress import CompressedLayerState
from reskv.decoding import RECOMPILE_LIMIT_HIT, bucketed, compiled_next_logits, forward, greedy
from reskv.engine import Generation, Prefill
from reskv.method import Method
from reskv.model import Backbone
from reskv.quality import FORCED_STEPS, TeacherForced


@dataclass
class GridRow:
    """A request of the grid on its way through a batch."""

    index: int  # into the requests
    method: Method
    setting: str
    slots: int  # the slots its row of a stacked cache takes: predicted, then counted once compressed
    layers: list[CompressedLayerState | ObservedLayer] | None = None  # let go of once stacked
    stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    compressed: ResKVCache | None = None  # for the quality measures: its cache before the question


def model_shape(backbone: Backbone) -> ModelShape:
    """The sizes of ``backbone``'s model that the memory rule counts."""
    config, model = backbone.model.config, backbone.model
    return ModelShape(
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        query_heads=config.num_attention_heads,
        head_dim=backbone.head_dim,
        dtype_bytes=model.dtype.itemsize,
    )


def device_memory(device: torch.device) -> DeviceMemory | None:
    """What a CUDA device's driver and caching allocator say of its memory now; ``None`` elsewhere
    (no limit: ``max_rows`` bounds a batch)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def decode_grid(
    prefill: Prefill,
    requests: Sequence[tuple[Method, str]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    min_new_tokens: int = 0,
    answer_ids: Sequence[int] | None = None,
    decode: str = "eager",
    max_rows: int | None = None,
) -> Iterator[tuple[int, Generation]]:
    """``(index into requests, generation)`` of every request, batch by batch (module docstring).
    ``decode`` is the step of a batch (``"eager"`` or ``"compiled"``); a request without the shared
    softmax decodes alone and eagerly whatever ``decode`` is (its run section says so). Compiled,
    a batch of one is a stacked cache of one row too, so that the rows' rules reach the compiled
    step as tensors: a grid compiles at most ``reskv.decoding.COMPILED_GRAPH_BOUND`` graphs. In a batch,
    ``decode_s`` is the batch's time shared equally by its rows (their sum is the time spent), likewise
    ``question_s`` among its query-agnostic rows and the teacher-forced part of ``quality_s``."""
    prefill.check_positions(max_new_tokens)
    quality = answer_ids is not None
    feeds = max(max_new_tokens, FORCED_STEPS, len(answer_ids or ())) if quality else max_new_tokens
    prompt, context = len(prefill.prompt_ids), prefill.context_length
    rows = [
        GridRow(index, method, setting, predicted_slots(prompt, context, ratio_of(method), setting, feeds))
        for index, (method, setting) in enumerate(requests)
    ]
    alone = [row for row in rows if not row.method.decode_rule.batches]
    stacked = [row for row in rows if row.method.decode_rule.batches]
    shape, copies = model_shape(prefill.backbone), 2 if quality else 1
    settings = len({row.setting for row in stacked if row.method.scorer is not None})  # compressed
    planned, limit = sample_batches(
        [row.slots for row in stacked],
        shape,
        device_memory(prefill.backbone.device),
        prompt,
        settings,
        prefill.observation_window,
        max_rows,
        copies,
    )
    options = dict(
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        min_new_tokens=min_new_tokens,
        answer_ids=answer_ids,
    )
    with prefill.sharing_construction(requests):
        for batch in [[stacked[row] for row in rows] for rows in planned]:
            if len(batch) == 1 and decode != "compiled":  # compiled, a row alone is a stacked one
                yield batch[0].index, alone_generation(prefill, batch[0], options)
                continue
            for row in batch:
                compress(prefill, row, quality, feeds)
            # Split again by the slots the rows took (a ragged method's longest head is known now).
            actual = decode_batches([row.slots for row in batch], shape.slot_bytes, limit, max_rows, copies)
            for rows in actual:
                yield from decoded_or_split(
                    prefill, [batch[row] for row in rows], decode, quality, feeds, options
                )
        for row in alone:
            yield row.index, alone_generation(prefill, row, options)


def alone_generation(prefill: Prefill, row: GridRow, options: dict) -> Generation:
    """``row`` decoded alone and eagerly, as ``Prefill.generate`` decodes it, bit for bit."""
    generation = prefill.generate(row.method, row.setting, decode="eager", **options)
    generation.run["batch_rows"] = 1
    return generation


def ratio_of(method: Method) -> float | None:
    """The ratio a request's row is compressed at; ``None`` for the full cache (no scorer)."""
    return None if method.scorer is None else method.ratio


def decoded_or_split(
    prefill: Prefill, rows: list[GridRow], decode: str, quality: bool, feeds: int, options: dict
) -> list[tuple[int, Generation]]:
    """The generations of ``rows`` (compressed) as one batch (``decode_batch``); a batch the device
    cannot allocate is let go of, split in halves and each decoded again (its rows compressed again),
    down to rows alone, so that no sample is lost to the memory plan's misses. A row's ``run``
    section counts the splits (``out_of_memory_splits``). A compiled batch past torch._dynamo's
    recompile limit, and a row alone that cannot be allocated beside its copy, are decoded again
    eagerly, their ``run`` section saying why (``compile_fallback``)."""
    try:
        return list(decode_batch(prefill, rows, decode, feeds, **options))
    except RECOMPILE_LIMIT_HIT as error:
        for row in rows:
            compress(prefill, row, quality, feeds)
        decoded = list(decode_batch(prefill, rows, "eager", feeds, **options))
        for _, generation in decoded:
            generation.run["compile_fallback"] = type(error).__name__
        return decoded
    except torch.OutOfMemoryError:
        if len(rows) == 1 and decode == "eager":
            raise
        if len(rows) == 1:  # compiled beside its copy (decode_batch): alone, eagerly
            compress(prefill, rows[0], quality, feeds)
            decoded = list(decode_batch(prefill, rows, "eager", feeds, **options))
            decoded[0][1].run["compile_fallback"] = torch.OutOfMemoryError.__name__
            return decoded
    gc.collect()
    if prefill.backbone.device.type == "cuda":
        torch.cuda.empty_cache()
    decoded = []
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        for row in part:
            compress(prefill, row, quality, feeds)
        decoded += decoded_or_split(prefill, part, decode, quality, feeds, options)
    for _, generation in decoded:
        generation.run["out_of_memory_splits"] = generation.run.get("out_of_memory_splits", 0) + 1
    return decoded


def compress(prefill: Prefill, row: GridRow, quality: bool, feeds: int) -> None:
    """``row``'s compressed layers and statistics, and the slots they take with the question and
    ``feeds`` fed tokens; with ``quality``, its cache before the question."""
    start = time.perf_counter()
    row.layers, row.stats = prefill.compressed_layers(row.method, row.setting)
    row.timings["compress_s"] = time.perf_counter() - start
    question = len(prefill.prompt_ids) - prefill.context_length
    row.slots = max(stacked_row(layer, row.method).slots for layer in row.layers) + question + feeds
    if quality:
        row.compressed, _ = row.method.assemble(row.layers, row.stats["compressed_tokens"])


def stacked_row(
    layer: CompressedLayerState | ObservedLayer | WindowedLayer, method: Method
) -> StackedRow | WindowedLayer:
    """A method's layer as a row of a stacked cache: a sliding-window layer as it is
    (``ResKVCache.stacked`` stacks it in a ``StaticWindowedLayer``), any other as a ``StackedRow``."""
    return layer if isinstance(layer, WindowedLayer) else StackedRow.of(layer, method.decode_rule)


def stacked_prompt(
    prefill: Prefill, rows: list[GridRow], feeds: int, decode: str = "eager"
) -> tuple[ResKVCache, torch.Tensor]:
    """``rows`` (compressed) as one stacked cache after the whole prompt, with room for ``feeds`` more
    tokens (for the compiled step, every layer's capacity the same multiple of ``CAPACITY_BUCKET``:
    ``reskv.decoding.bucketed``), and each row's next-token logits there ``[B, V]``: a query-aware
    row's are the prefill's, the query-agnostic rows are fed the question in one forward (the
    query-aware rows pass through it, their new slots masked), timed as their ``question_s``. The
    cache is marked there (``ResKVCache.mark``), and the rows let go of their compressed layers."""
    backbone, device = prefill.backbone, prefill.backbone.device
    question = prefill.prompt_ids[prefill.context_length :]
    agnostic = [row.setting == "agnostic" for row in rows]
    fed = question if any(agnostic) else []
    stacked_rows = [[stacked_row(layer, row.method) for layer in row.layers] for row in rows]
    seq_len, spare = len(prefill.prompt_ids) - len(fed), len(fed) + feeds
    windowed = any(isinstance(layer, WindowedLayer) for layer in stacked_rows[0])
    if decode == "compiled" and not windowed:  # a sliding-window model's cache as ResKVCache.stacked makes it
        by_layer = list(zip(*stacked_rows, strict=True))
        capacity = bucketed(max(row.slots for layer_rows in by_layer for row in layer_rows) + spare)
        cache = ResKVCache(
            [
                StackedLayer(layer_rows, seq_len, capacity - max(row.slots for row in layer_rows))
                for layer_rows in by_layer
            ]
        )
    else:
        cache = ResKVCache.stacked(stacked_rows, seq_len, spare)
    for row in rows:
        row.layers = None
    logits = torch.stack([prefill.prefilled("aware").last_logits] * len(rows))
    if fed:
        start = time.perf_counter()
        fed_rows = torch.tensor(agnostic, device=device)
        cache.feeding(fed_rows)
        fed_logits = forward(backbone, torch.tensor([fed] * len(rows), device=device), cache)[:, -1]
        cache.feeding(torch.ones_like(fed_rows))
        logits = torch.where(fed_rows[:, None], fed_logits, logits)
        fed_once = {id(row): row for row in rows if row.setting == "agnostic"}  # a copy fed once
        seconds = (time.perf_counter() - start) / len(fed_once)
        for row in fed_once.values():
            row.timings["question_s"] = seconds
    cache.mark()
    return cache, logits


def decode_batch(
    prefill: Prefill,
    rows: list[GridRow],
    decode: str,
    feeds: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    min_new_tokens: int,
    answer_ids: Sequence[int] | None,
) -> Iterator[tuple[int, Generation]]:
    """The generations of ``rows`` (compressed) decoded as one stacked cache (``stacked_prompt``).
    Compiled, a row alone decodes beside a copy of itself whose answer is dropped: torch._dynamo would
    give a batch of one row a graph of its own, whose compilation costs far more than the copy's steps
    (results/gpu/README.md), so a grid compiles ``reskv.decoding.COMPILED_GRAPH_BOUND`` graphs."""
    backbone, device = prefill.backbone, prefill.backbone.device
    copied = rows * 2 if decode == "compiled" and len(rows) == 1 else rows
    cache, logits = stacked_prompt(prefill, copied, feeds, decode)

    def step(token_ids: list[int]) -> torch.Tensor:
        if decode == "compiled":
            return compiled_next_logits(backbone, token_ids, cache)
        return forward(backbone, torch.tensor(token_ids, device=device)[:, None], cache)[:, -1]

    start = time.perf_counter()
    answers = greedy(logits, step, max_new_tokens, min_new_tokens, prefill.stop_ids(stop_token_ids))
    seconds = (time.perf_counter() - start) / len(rows)
    teacher_forced: list[TeacherForced | None] = [None] * len(rows)
    quality_s = 0.0
    if answer_ids is not None:
        start = time.perf_counter()
        teacher_forced = prefill.quality_probe.teacher_forced_stacked(cache, logits, answer_ids)
        quality_s = (time.perf_counter() - start) / len(rows)
    kept = zip(rows, answers, logits, teacher_forced, strict=False)  # a copy's last, dropped
    for row, answer, row_logits, forced in kept:
        row.timings |= {"decode_s": seconds, "decode_tokens": len(answer)}
        text = backbone.tokenizer.decode(answer, skip_special_tokens=True)
        measures = None
        if answer_ids is not None:
            start = time.perf_counter()
            measures = prefill.quality_probe.measures(
                row.setting, row.compressed, None, row_logits, answer_ids, forced
            )
            row.timings["quality_s"] = time.perf_counter() - start + quality_s
        run = {"decode": decode, "batch_rows": len(rows)}
        yield row.index, Generation(answer, text, row.stats, row.timings, measures, run)
