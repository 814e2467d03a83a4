"""How a sample's grid is cut into decode batches of views (``reskv.views``), and how much of a
device's memory they take, without torch: the engine decodes by it (``reskv.grid``), and a dry run
estimates a grid's device hours by it (``scripts.harness.dry_run``), one rule for both.

A batch's rows are views of the prefilled cache the prefill already holds, so what a batch adds is
the views' layout (``view_batch_bytes``): per row and layer a keep mask over the shared slots, its
residual entries (the largest the proxy may choose, ``ViewRow.planned``), its appended slots; one
adjusted values tensor per method and setting that adjusts values (CaM); and a step's fp32 logits
over the shared slots and the entries, one layer at a time. The memory rule: a batch's layout may take
(``memory_limit``) ``MEMORY_SHARE`` of what the device can still give, the caching allocator's
reserved but unused bytes included (``DeviceMemory.available``), less what the sample's construction
holds meanwhile (``ModelShape.construction_bytes``). The paper grid at 32K on an H200 is one batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from reskv.config import AUTO, DECODE_CHOICES, DEVICE_MEMORY_SHARE, budget_for, residual_size

# The share of what a device can still give (its construction's bytes set aside) that a batch's
# views may take; the rest is left to one step's other activations (the logits over the vocabulary)
# and to the allocator's slack.
MEMORY_SHARE = 0.8
# The bytes of an fp32 element: the construction's k-means points, the entries' bias, a step's logits.
FP32_BYTES = 4


def grid_decoding(decode: str, decode_batch: int | str, device_type: str) -> tuple[str, int | None]:
    """The decode mode and the most rows a batch holds (``None``: as many as ``view_batches`` allows)
    that ``decode`` (``DECODE_CHOICES``) and ``decode_batch`` (``check_decode_batch``'s: a positive
    integer or ``"auto"``) ask for on a device of ``device_type`` ("cuda", "cpu", ...). This is where
    the device decides whether a grid decodes as views of its prefilled cache (``reskv.views``; the
    rule decides which rows may: ``DecodeRule.batches``): more than one row a batch. ``"auto"``: on
    CUDA the compiled step (CUDA graphs, no host cost per op) and every configuration of a sample in
    one batch of views (one forward a step, the weights and the shared cache read once for all);
    elsewhere eager decoding, each configuration alone (bit for bit what the committed results
    decoded)."""
    if decode not in DECODE_CHOICES:
        raise ValueError(f"unknown decode mode {decode!r}; choose one of {list(DECODE_CHOICES)}")
    cuda = device_type == "cuda"
    if decode == AUTO:
        decode = "compiled" if cuda else "eager"
    if decode_batch == AUTO:
        return decode, None if cuda else 1
    return decode, decode_batch


def check_decode_batch(decode_batch: object) -> int | str:
    """``decode_batch`` if it is a positive integer or ``"auto"``; else a ``ValueError`` naming both
    (the plan asks it of a run's configuration, a script of its argument; ``grid_decoding`` takes the
    value as checked)."""
    if decode_batch != AUTO and (
        isinstance(decode_batch, bool) or not isinstance(decode_batch, int) or decode_batch < 1
    ):
        raise ValueError(
            f"decode_batch {decode_batch!r} must be a positive integer (1: each configuration alone) or "
            f"{AUTO!r} (on CUDA every configuration of a sample in one batch of views, elsewhere 1)"
        )
    return decode_batch


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as its caching allocator sees it, in bytes."""

    total: int  # the device's memory
    free: int  # the driver's free memory (``torch.cuda.mem_get_info``)
    reserved: int  # held by the caching allocator (``torch.cuda.memory_reserved``)
    allocated: int  # of which tensors take (``torch.cuda.memory_allocated``)

    @property
    def available(self) -> int:
        """What a new tensor can still take: the driver's free memory and the allocator's reserved but
        unused bytes (the harness never empties its cache, so after a sample most of it is there)."""
        return self.free + self.reserved - self.allocated

    @classmethod
    def holding(cls, total: int, held: int) -> DeviceMemory:
        """A device of ``total`` bytes whose tensors take ``held`` (a dry run's: the weights and the
        prefilled caches), its allocator reserving no more."""
        return cls(total=total, free=total - held, reserved=held, allocated=held)


@dataclass(frozen=True)
class ModelShape:
    """What a model's attention holds per token: the sizes the memory rule counts."""

    layers: int
    kv_heads: int
    query_heads: int
    head_dim: int
    dtype_bytes: int  # of the model's keys and values

    @property
    def kv_slot_bytes(self) -> int:
        """Bytes of one slot's keys and values at one layer and KV head."""
        return 2 * self.head_dim * self.dtype_bytes

    def construction_bytes(
        self, prompt_tokens: int, settings: int, observed_queries: int, distances: int
    ) -> int:
        """Bytes a sample's construction holds beside the prefilled caches while its batches are cut
        and decoded: per compressed setting, the stacked copy of every layer's keys, values and
        observed queries (``reskv.compress.SharedLayers``, kept until the sample's grid ends); one
        k-means group's fp32 copy of its points' keys (then values), at most every head's whole prompt
        (``reskv.residual``); and the k-means distance block (``distances`` bytes). Not counted: the
        scorers' fp32 scores and the validation proxies (a head's score a token, a few hundred
        queries), under a percent of the stacked copies at the paper's shapes."""
        stacked = (
            self.layers
            * (2 * self.kv_heads * prompt_tokens + self.query_heads * observed_queries)
            * self.head_dim
            * self.dtype_bytes
        )
        points = self.layers * self.kv_heads * prompt_tokens * self.head_dim * FP32_BYTES
        return settings * stacked + points + distances


def memory_limit(memory: DeviceMemory | None, construction: int) -> int | None:
    """Bytes a batch's views may take (``view_batch_bytes``): ``MEMORY_SHARE`` of what
    ``memory`` can still give less ``construction`` (``ModelShape.construction_bytes``); ``None``
    (no limit) without a device memory, where ``max_rows`` bounds a batch."""
    if memory is None:
        return None
    return max(0, int((memory.available - construction) * MEMORY_SHARE))


def sample_memory_limit(
    shape: ModelShape, memory: DeviceMemory | None, prompt_tokens: int, settings: int, observed_queries: int
) -> int | None:
    """``memory_limit`` for a sample of ``prompt_tokens`` whose grid compresses in ``settings`` settings
    with ``observed_queries`` queries kept a layer, the k-means distance block being
    ``DEVICE_MEMORY_SHARE`` of the device (``reskv.residual.distance_block_bytes``). The grid
    (``reskv.grid``) and the dry run (``scripts.harness.dry_run``) both cut batches by it."""
    if memory is None:
        return None
    distances = memory.total // DEVICE_MEMORY_SHARE
    return memory_limit(
        memory, shape.construction_bytes(prompt_tokens, settings, observed_queries, distances)
    )


@dataclass(frozen=True)
class ViewRow:
    """A row of a batch of views as the memory rule plans it: the slots of its entries per layer and KV
    head (an upper bound), what its main values are where its method adjusts them (one tensor per
    key: ``reskv.views.RowView``; ``None`` for the shared values), and the shared slots a head keeps
    (``None``: every one)."""

    entry_slots: int = 0
    values_key: Hashable | None = None
    kept_slots: int | None = None

    @classmethod
    def planned(
        cls,
        compressed_tokens: int,
        ratio: float | None,
        residual_shares: Sequence[float] = (),
        values_key: Hashable | None = None,
    ) -> ViewRow:
        """A request compressing ``compressed_tokens`` at ``ratio`` (``None``: the full cache) whose
        residual may take ``residual_shares`` of a head's budget (its proxy's grid and fixed ratio; none
        without a residual): at most the largest share's ``r = floor(share * b + 0.5)`` entries
        (``reskv.config.residual_size``) where the budget compresses, and the rest of the budget kept.
        A ragged method's head (AdaKV) may take more."""
        budget = compressed_tokens if ratio is None else budget_for(compressed_tokens, ratio)
        if budget >= compressed_tokens:
            return cls(0, values_key)
        entries = residual_size(max(residual_shares), budget) if residual_shares else 0
        return cls(entries, values_key, budget - entries)


def view_batch_bytes(
    rows: Sequence[ViewRow], shape: ModelShape, shared_slots: int, appended_slots: int
) -> int:
    """Bytes a batch of ``rows`` adds to the prefilled cache it views (``shared_slots`` a layer and KV
    head), every row appending ``appended_slots``: per layer and KV head each row's keep mask (a byte a
    slot), entries (keys, values, an fp32 bias) and appended keys and values; each row's appended bias;
    one adjusted values tensor per ``values_key``; and a step's fp32 logits over the shared slots and
    the entries, one layer at a time, for every query head of every row."""
    heads = shape.layers * shape.kv_heads
    masks = len(rows) * shared_slots * heads
    entries = sum(row.entry_slots for row in rows) * heads * (shape.kv_slot_bytes + FP32_BYTES)
    appended = len(rows) * appended_slots * (heads * shape.kv_slot_bytes + shape.layers * FP32_BYTES)
    sources = len({row.values_key for row in rows} - {None})
    adjusted = sources * heads * shared_slots * shape.head_dim * shape.dtype_bytes
    pooled = shared_slots + sum(row.entry_slots for row in rows)
    logits = len(rows) * shape.query_heads * pooled * FP32_BYTES
    return masks + entries + appended + adjusted + logits


def view_batches(
    rows: Sequence[ViewRow],
    shape: ModelShape,
    limit: int | None,
    shared_slots: int,
    appended_slots: int,
    max_rows: int | None,
) -> list[list[int]]:
    """``rows`` (indices) in the fewest batches of consecutive rows, as equal as can be, each of at most
    ``max_rows`` rows (``None``: any number) whose ``view_batch_bytes`` stay within ``limit`` (``None``:
    no limit); a row beyond the limit on its own decodes alone. Rows whose values are adjusted alike go
    together (an adjusted values tensor is read once a batch)."""
    order = values_order([row.values_key for row in rows])
    count = len(order)
    if not count:
        return []
    batches = max(1, -(-count // max_rows)) if max_rows else 1
    while True:
        size = -(-count // batches)
        cut = [order[start : start + size] for start in range(0, count, size)]
        fits = limit is None or all(
            view_batch_bytes([rows[row] for row in batch], shape, shared_slots, appended_slots) <= limit
            for batch in cut
        )
        if fits or size == 1:
            return cut
        batches += 1


def values_order(keys: Sequence[Hashable | None]) -> list[int]:
    """Indices of rows whose values keys are ``keys`` (``ViewRow.values_key``), reordered so that equal
    keys are consecutive: the shared values' rows (``None``) first, the others by first appearance."""
    first: dict[Hashable | None, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, -1 if key is None else index)
    return sorted(range(len(keys)), key=lambda index: first[keys[index]])


def view_step_slots(rows: Sequence[ViewRow], shared_slots: int, appended_slots: int) -> float:
    """Slots a decode step of a batch of ``rows`` reads per layer and KV head, a slot being one
    position's key and value: the shared slots once for every row; each adjusted values tensor at the
    slots its rows keep (half a slot each), the most one of them keeps, their kept sets being nested
    (CaM keeps SnapKV's selection from its setting's one set of scores at every ratio); and each row's
    entries and appended slots."""
    adjusted: dict[Hashable, int] = {}
    for row in rows:
        if row.values_key is not None:
            kept = shared_slots if row.kept_slots is None else min(row.kept_slots, shared_slots)
            adjusted[row.values_key] = max(adjusted.get(row.values_key, 0), kept)
    own = sum(row.entry_slots for row in rows) + len(rows) * appended_slots
    return shared_slots + sum(adjusted.values()) / 2 + own
