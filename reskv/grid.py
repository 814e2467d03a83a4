"""A sample's grid decoded together: the configurations of one prompt as the rows of one stacked cache
(``reskv.cache.StackedLayer``), one model forward a step for all of them, eager or compiled.

    for index, generation in decode_grid(prefill, requests, max_new_tokens=32, decode="compiled"):
        ...

Rows are ordered by the slots their caches will hold and cut into batches that pad little and whose
stacked cache fits the device's memory (``reskv.batching.decode_batches``; at most ``max_rows``
rows). Each batch's rows are compressed (sharing, within a setting, what does not depend on the
ratio: ``Prefill.sharing_construction``), stacked straight from their compressed states, and the
question is fed to its query-agnostic rows in one forward, which the query-aware rows pass through
with their new slots masked; then one greedy decode steps every row, a row that stopped being fed on
with its logits unread, so that the batch keeps its shape (one compiled graph whatever the rows).
A row's tokens equal its decode alone but at near ties: a batch pads its rows and sums their
attention in another order. A batch of one, and a row without the shared softmax (which the stacked
attention does not compute), decode alone as ``Prefill.generate`` does, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from reskv.batching import decode_batches
from reskv.cache import ObservedLayer, ResKVCache, StackedRow, WindowedLayer
from reskv.compress import CompressedLayerState
from reskv.config import budget_for
from reskv.decoding import compiled_next_logits, forward, greedy
from reskv.engine import Generation, Prefill
from reskv.method import Method
from reskv.quality import FORCED_STEPS, TeacherForced

# The share of a CUDA device's free memory a batch's compressed states and stacked cache may take
# together; the rest is left to one step's activations (their attention logits, the logits over the
# vocabulary) and to the allocator's slack.
CUDA_MEMORY_SHARE = 0.8


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


def slot_bytes(prefill: Prefill) -> int:
    """Bytes one slot of one row takes over every layer of a stacked cache: its keys and values in the
    model's dtype, its fp32 bias and its entry mark."""
    config, model = prefill.backbone.model.config, prefill.backbone.model
    heads = config.num_key_value_heads
    return config.num_hidden_layers * heads * (2 * prefill.backbone.head_dim * model.dtype.itemsize + 4 + 1)


def memory_limit(device: torch.device) -> int | None:
    """Bytes a batch's compressed states and stacked cache may take (``CUDA_MEMORY_SHARE`` of what is
    free on a CUDA device); ``None`` (no limit) elsewhere, where ``max_rows`` bounds a batch."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * CUDA_MEMORY_SHARE)


def predicted_slots(prefill: Prefill, method: Method, setting: str, spare: int) -> int:
    """The slots a request's row will take before it is compressed: its prompt's budget (``b`` per head:
    a ragged method's longest head may hold more, counted once compressed), the question when it is
    fed after compression, and ``spare`` fed tokens."""
    compressed = len(prefill.prompt_ids) if setting == "aware" else prefill.context_length
    kept = compressed if method.scorer is None else min(compressed, budget_for(compressed, method.ratio))
    return kept + len(prefill.prompt_ids) - prefill.context_length + spare


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
    softmax decodes alone and eagerly whatever ``decode`` is (its run section says so). In a batch,
    ``decode_s`` is the batch's time shared equally by its rows (their sum is the time spent), likewise
    ``question_s`` among its query-agnostic rows and the teacher-forced part of ``quality_s``."""
    prefill.check_positions(max_new_tokens)
    quality = answer_ids is not None
    feeds = max(max_new_tokens, FORCED_STEPS, len(answer_ids or ())) if quality else max_new_tokens
    rows = [
        GridRow(index, method, setting, predicted_slots(prefill, method, setting, feeds))
        for index, (method, setting) in enumerate(requests)
    ]
    alone = [row for row in rows if not row.method.decode_rule.batches]
    stacked = [row for row in rows if row.method.decode_rule.batches]
    bytes_per_slot = slot_bytes(prefill)
    limit = memory_limit(prefill.backbone.device)
    planned = decode_batches([row.slots for row in stacked], bytes_per_slot, limit, max_rows)
    options = dict(
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        min_new_tokens=min_new_tokens,
        answer_ids=answer_ids,
    )
    with prefill.sharing_construction():
        for batch in [[stacked[row] for row in rows] for rows in planned] + [[row] for row in alone]:
            if len(batch) == 1:
                (row,) = batch
                mode = row.method.decode_rule.decode_mode(decode)
                generation = prefill.generate(row.method, row.setting, decode=mode, **options)
                generation.run["decode_batch"] = 1
                yield row.index, generation
                continue
            for row in batch:
                compress(prefill, row, quality, feeds)
            # Split again by the slots the rows took (a ragged method's longest head is known now).
            actual = decode_batches([row.slots for row in batch], bytes_per_slot, limit, max_rows)
            for rows in actual:
                yield from decode_batch(prefill, [batch[row] for row in rows], decode, feeds, **options)


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


def stacked_prompt(prefill: Prefill, rows: list[GridRow], feeds: int) -> tuple[ResKVCache, torch.Tensor]:
    """``rows`` (compressed) as one stacked cache after the whole prompt, with room for ``feeds`` more
    tokens, and each row's next-token logits there ``[B, V]``: a query-aware row's are the prefill's,
    the query-agnostic rows are fed the question in one forward (the query-aware rows pass through
    it, their new slots masked), timed as their ``question_s``. The cache is marked there
    (``ResKVCache.mark``), and the rows let go of their compressed layers."""
    backbone, device = prefill.backbone, prefill.backbone.device
    question = prefill.prompt_ids[prefill.context_length :]
    agnostic = [row.setting == "agnostic" for row in rows]
    fed = question if any(agnostic) else []
    cache = ResKVCache.stacked(
        [[stacked_row(layer, row.method) for layer in row.layers] for row in rows],
        len(prefill.prompt_ids) - len(fed),
        len(fed) + feeds,
    )
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
        seconds = (time.perf_counter() - start) / sum(agnostic)
        for row in rows:
            if row.setting == "agnostic":
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
    """The generations of ``rows`` (compressed) decoded as one stacked cache (``stacked_prompt``)."""
    backbone, device = prefill.backbone, prefill.backbone.device
    cache, logits = stacked_prompt(prefill, rows, feeds)

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
    for row, answer, row_logits, forced in zip(rows, answers, logits, teacher_forced, strict=True):
        row.timings |= {"decode_s": seconds, "decode_tokens": len(answer)}
        text = backbone.tokenizer.decode(answer, skip_special_tokens=True)
        measures = None
        if answer_ids is not None:
            start = time.perf_counter()
            measures = prefill.quality_probe.measures(
                row.setting, row.compressed, None, row_logits, answer_ids, forced
            )
            row.timings["quality_s"] = time.perf_counter() - start + quality_s
        run = {"decode": decode, "decode_batch": len(rows)}
        yield row.index, Generation(answer, text, row.stats, row.timings, measures, run)
