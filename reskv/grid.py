"""A sample's grid decoded together: the configurations of one prompt as views of its one prefilled cache
(``reskv.views``), one model forward a step for all of them, eager or compiled.

    for index, generation in decode_grid(prefill, requests, max_new_tokens=32, decode="compiled"):
        ...

Every row is compressed first (sharing, within a setting, what does not depend on the ratio:
``Prefill.sharing_construction``) and kept as its view: per layer its kept set, its residual entries and,
for a method that adjusts values (CaM), those values; its main keys and values are let go of. The rows
then decode in one batch (``reskv.batching.view_batches``: more only where ``max_rows`` or the device's
memory asks for it), the question fed to its query-agnostic rows in one forward which the query-aware
rows pass through with their new slots masked, then one greedy decode steps every row, a row that
stopped being fed on with its logits unread, so that the batch keeps its shape. A batch the device
cannot allocate all the same is decoded in halves from the rows already built, never compressed again.
A row's tokens equal its decode alone but at near ties: its attention sums its slots in another order.
Rows decode alone as ``Prefill.generate`` does, bit for bit, where the view form is not used: a batch
of one, a row without the shared softmax (``DecodeRule.batches``), and a prefill that keeps no full
cache to view (``retain="compressed"``). The quality measures of every row are its own cache's, as
``Prefill.generate`` computes them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from reskv.batching import DeviceMemory, ModelShape, ViewRow, sample_memory_limit, values_order, view_batches
from reskv.cache import ResKVCache, WindowedLayer
from reskv.compress import scorer_key
from reskv.decoding import RECOMPILE_LIMIT_HIT, compiled_next_logits, forward, greedy
from reskv.engine import Generation, Prefill
from reskv.method import Method
from reskv.model import Backbone
from reskv.scoring import TokenScorer
from reskv.views import RowView, view_cache


@dataclass
class GridRow:
    """A request of the grid on its way through a batch."""

    index: int  # into the requests
    method: Method
    setting: str
    views: list[RowView | WindowedLayer] | None = None  # per layer, once compressed
    stats: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    compressed: ResKVCache | None = None  # for the quality measures: its cache before the question

    @property
    def values_key(self) -> Hashable | None:
        return values_key(self.method, self.setting)


def values_key(method: Method, setting: str) -> Hashable | None:
    """What a request's main values are where its method adjusts them (CaM): one tensor per scorer and
    setting (``reskv.views.RowView``); ``None`` for the shared values."""
    scorer = method.scorer
    if scorer is None or type(scorer).adjust_values is TokenScorer.adjust_values:
        return None
    return scorer_key(scorer), setting


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


def viewed(prefill: Prefill, method: Method) -> bool:
    """Whether a request decodes as a view of the prefilled cache: its rule batches (the shared softmax)
    and the prefill keeps the full cache."""
    return method.decode_rule.batches and prefill.retain == "full"


def planned_row(prefill: Prefill, row: GridRow) -> ViewRow:
    """A request's view as the memory rule plans it (``reskv.batching.ViewRow``)."""
    compressed = len(prefill.prompt_ids) if row.setting == "aware" else prefill.context_length
    method, residual = row.method, row.method.residual
    shares = () if residual is None else (*residual.grid, residual.fixed_ratio)
    ratio = None if method.scorer is None else method.ratio
    return ViewRow.planned(compressed, ratio, shares, row.values_key)


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
    softmax decodes alone and eagerly whatever ``decode`` is (its run section says so). Compiled, a
    row alone is a batch of one too, decoded beside a copy of itself: a grid compiles at most
    ``reskv.decoding.COMPILED_GRAPH_BOUND`` graphs. In a batch, ``decode_s`` is the batch's time shared
    equally by its rows (their sum is the time spent), likewise ``question_s`` among its query-agnostic
    rows."""
    prefill.check_positions(max_new_tokens)
    quality = answer_ids is not None
    rows = [GridRow(index, method, setting) for index, (method, setting) in enumerate(requests)]
    alone = [row for row in rows if not viewed(prefill, row.method)]
    together = [row for row in rows if viewed(prefill, row.method)]
    question = len(prefill.prompt_ids) - prefill.context_length
    limit = sample_memory_limit(
        model_shape(prefill.backbone),
        device_memory(prefill.backbone.device),
        len(prefill.prompt_ids),
        len({row.setting for row in together if row.method.scorer is not None}),
        prefill.observation_window,
    )
    batches = view_batches(
        [planned_row(prefill, row) for row in together],
        model_shape(prefill.backbone),
        limit,
        len(prefill.prompt_ids),
        question + max_new_tokens,
        max_rows,
    )
    options = dict(
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        min_new_tokens=min_new_tokens,
        answer_ids=answer_ids,
    )
    with prefill.sharing_construction(requests):
        for batch in [[together[row] for row in rows] for rows in batches]:
            if len(batch) == 1 and decode != "compiled":  # compiled, a row alone is a batch too
                yield batch[0].index, alone_generation(prefill, batch[0], options)
                continue
            for row in batch:
                compress(prefill, row, quality)
            yield from decoded_or_halved(prefill, batch, decode, options)
    for row in alone:
        yield row.index, alone_generation(prefill, row, options)


def alone_generation(prefill: Prefill, row: GridRow, options: dict) -> Generation:
    """``row`` decoded alone and eagerly, as ``Prefill.generate`` decodes it, bit for bit."""
    generation = prefill.generate(row.method, row.setting, decode="eager", **options)
    generation.run["batch_rows"] = 1
    return generation


def compress(prefill: Prefill, row: GridRow, quality: bool) -> None:
    """``row``'s compression as views (``reskv.views.RowView``; a sliding-window layer as it is) and its
    statistics; with ``quality``, its cache before the question."""
    start = time.perf_counter()
    layers, row.stats = prefill.compressed_layers(row.method, row.setting)
    rule, key = row.method.decode_rule, row.values_key
    row.views = [
        layer if isinstance(layer, WindowedLayer) else RowView.of(layer, rule, key) for layer in layers
    ]
    row.timings["compress_s"] = time.perf_counter() - start
    if quality:
        row.compressed, _ = row.method.assemble(layers, row.stats["compressed_tokens"])


def decoded_or_halved(
    prefill: Prefill, rows: list[GridRow], decode: str, options: dict
) -> list[tuple[int, Generation]]:
    """The generations of ``rows`` (compressed) as one batch (``decode_batch``); a batch the device
    cannot allocate is let go of, split in halves and each decoded from the same views, down to rows
    alone, so that no sample is lost to the memory plan's misses and no row is compressed twice. A
    row's ``run`` section counts the splits (``out_of_memory_splits``). A compiled batch past
    torch._dynamo's recompile limit, and a row alone that cannot be allocated beside its copy, are
    decoded again eagerly, their ``run`` section saying why (``compile_fallback``)."""
    try:
        return list(decode_batch(prefill, rows, decode, **options))
    except RECOMPILE_LIMIT_HIT as error:
        decoded = list(decode_batch(prefill, rows, "eager", **options))
        for _, generation in decoded:
            generation.run["compile_fallback"] = type(error).__name__
        return decoded
    except torch.OutOfMemoryError:
        if len(rows) == 1 and decode == "eager":
            raise
        if len(rows) == 1:  # compiled beside its copy (decode_batch): alone, eagerly
            decoded = list(decode_batch(prefill, rows, "eager", **options))
            decoded[0][1].run["compile_fallback"] = torch.OutOfMemoryError.__name__
            return decoded
    gc.collect()
    if prefill.backbone.device.type == "cuda":
        torch.cuda.empty_cache()
    decoded = []
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        decoded += decoded_or_halved(prefill, part, decode, options)
    for _, generation in decoded:
        generation.run["out_of_memory_splits"] = generation.run.get("out_of_memory_splits", 0) + 1
    return decoded


def prompted_views(
    prefill: Prefill, rows: list[GridRow], feeds: int, decode: str = "eager"
) -> tuple[ResKVCache, torch.Tensor]:
    """``rows`` (compressed) as one cache of views after the whole prompt (``reskv.views.view_cache``,
    in ``values_order``, laid out for ``decode``) with room for ``feeds`` more tokens, and each row's
    next-token logits there ``[B, V]``: a query-aware row's are the prefill's, the query-agnostic rows
    are fed the question in one forward (the query-aware rows pass through it, their new slots
    masked), timed as their ``question_s``."""
    backbone, device = prefill.backbone, prefill.backbone.device
    question = prefill.prompt_ids[prefill.context_length :]
    agnostic = [row.setting == "agnostic" for row in rows]
    fed = question if any(agnostic) else []
    shared = prefill.prefilled("aware" if not all(agnostic) else "agnostic").cache.layers
    seq_len = len(prefill.prompt_ids) - len(fed)
    rules = [row.method.decode_rule for row in rows]
    compiled = decode == "compiled"
    cache = view_cache(shared, [row.views for row in rows], rules, seq_len, len(fed) + feeds, compiled)
    logits = torch.stack([prefill.prefilled("aware").last_logits] * len(rows)) if not all(agnostic) else None
    if fed:
        start = time.perf_counter()
        fed_rows = torch.tensor(agnostic, device=device)
        cache.feeding(fed_rows)
        fed_logits = forward(backbone, torch.tensor([fed] * len(rows), device=device), cache)[:, -1]
        cache.feeding(torch.ones_like(fed_rows))
        logits = fed_logits if logits is None else torch.where(fed_rows[:, None], fed_logits, logits)
        fed_once = {id(row): row for row in rows if row.setting == "agnostic"}  # a copy fed once
        seconds = (time.perf_counter() - start) / len(fed_once)
        for row in fed_once.values():
            row.timings["question_s"] = seconds
    return cache, logits


def decode_batch(
    prefill: Prefill,
    rows: list[GridRow],
    decode: str,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    min_new_tokens: int,
    answer_ids: Sequence[int] | None,
) -> Iterator[tuple[int, Generation]]:
    """The generations of ``rows`` (compressed) decoded as one cache of views (``prompted_views``).
    Compiled, a row alone decodes beside a copy of itself whose answer is dropped: torch._dynamo would
    give a batch of one row a graph of its own, whose compilation costs far more than the copy's steps
    (results/gpu/README.md), so a grid compiles ``reskv.decoding.COMPILED_GRAPH_BOUND`` graphs."""
    backbone, device = prefill.backbone, prefill.backbone.device
    copied = rows * 2 if decode == "compiled" and len(rows) == 1 else rows
    order = values_order([row.values_key for row in copied])
    ordered = [copied[index] for index in order]
    cache, logits = prompted_views(prefill, ordered, max_new_tokens, decode)

    def step(token_ids: list[int]) -> torch.Tensor:
        if decode == "compiled":
            return compiled_next_logits(backbone, token_ids, cache)
        return forward(backbone, torch.tensor(token_ids, device=device)[:, None], cache)[:, -1]

    start = time.perf_counter()
    answers = greedy(logits, step, max_new_tokens, min_new_tokens, prefill.stop_ids(stop_token_ids))
    seconds = (time.perf_counter() - start) / len(rows)
    done = set()
    for row, answer in zip(ordered, answers, strict=True):
        if id(row) in done:  # a copy's
            continue
        done.add(id(row))
        row.timings |= {"decode_s": seconds, "decode_tokens": len(answer)}
        text = backbone.tokenizer.decode(answer, skip_special_tokens=True)
        measures = None
        if answer_ids is not None:
            start = time.perf_counter()
            measures = quality_alone(prefill, row, answer_ids, max_new_tokens)
            row.timings["quality_s"] = time.perf_counter() - start
        run = {"decode": decode, "batch_rows": len(rows)}
        yield row.index, Generation(answer, text, row.stats, row.timings, measures, run)


def quality_alone(prefill: Prefill, row: GridRow, answer_ids: Sequence[int], max_new_tokens: int) -> dict:
    """``row``'s quality measures as ``Prefill.generate`` computes them, bit for bit: from its own cache
    before the question, fed the question alone where query-agnostic (``reskv.quality``)."""
    cache = row.compressed
    compressed = cache.fork()
    question = prefill.prompt_ids[prefill.context_length :]
    logits = prefill.prefilled(row.setting).last_logits
    cache.reserve((len(question) if row.setting == "agnostic" else 0) + max_new_tokens)
    if row.setting == "agnostic" and question:
        logits = prefill.next_logits(question, cache)
    return prefill.quality_probe.measures(row.setting, compressed, cache.fork(), logits, answer_ids)
