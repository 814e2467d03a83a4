"""How a sample's grid is cut into decode batches, and how much of a device's memory they may take,
without torch: the engine decodes by it (``reskv.grid``), and a dry run estimates a grid's device
hours by it (``scripts.harness.dry_run``), one rule for both.

The memory rule: what a batch's compressed states and stacked cache may take (``memory_limit``) is
``MEMORY_SHARE`` of what the device can still give, the caching allocator's reserved but unused
bytes included (``DeviceMemory.available``), less what the sample's construction holds meanwhile
(``ModelShape.construction_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reskv.config import AUTO, DECODE_CHOICES, DEVICE_MEMORY_SHARE, budget_for

# The share of what a device can still give (its construction's bytes set aside) that a batch's
# compressed states and stacked cache may take together; the rest is left to one step's activations
# (their attention logits, the logits over the vocabulary) and to the allocator's slack.
MEMORY_SHARE = 0.8
# The bytes of an fp32 element: the construction's k-means points and a stacked cache's bias.
FP32_BYTES = 4

# The most a batch pads its rows, as a multiple of the slots they hold: a padded slot costs a step its
# memory traffic and its share of the attention, and rows of a grid hold from a tenth of the prompt
# (ratio 0.9) to all of it (the full cache), which would then pad the others tenfold. Twice keeps the
# paper grid's compressed rows (10% to 40% of the prompt) in one batch and the full cache apart; the
# value is this project's choice, not a measurement.
PADDING = 2


def grid_decoding(decode: str, decode_batch: int | str, device_type: str) -> tuple[str, int | None]:
    """The decode mode and the most rows a batch holds (``None``: as many as ``decode_batches``
    allows) that ``decode`` (``DECODE_CHOICES``) and ``decode_batch`` (``check_decode_batch``'s: a
    positive integer or ``"auto"``) ask for on a device of ``device_type`` ("cuda", "cpu", ...).
    ``"auto"``: on CUDA the compiled step (CUDA graphs, no host cost per op) and every configuration
    of a sample in as few batches as the padding and the memory allow (one forward a step, the
    weights read once for all); elsewhere eager decoding, each configuration alone (bit for bit what
    the committed results decoded)."""
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
            f"{AUTO!r} (on CUDA every configuration of a sample in as few batches as the memory allows, "
            "elsewhere 1)"
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
    def slot_bytes(self) -> int:
        """Bytes one slot of one row takes over every layer of a stacked cache: its keys and values in
        the model's dtype, its fp32 bias and its entry mark."""
        return self.layers * self.kv_heads * (2 * self.head_dim * self.dtype_bytes + FP32_BYTES + 1)

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
    """Bytes a batch's compressed states and stacked cache may take: ``MEMORY_SHARE`` of what
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


def predicted_slots(
    prompt_tokens: int, context_tokens: int, ratio: float | None, setting: str, feeds: int
) -> int:
    """The slots a request's row takes in a stacked cache before it is compressed: its prompt's budget
    (``b`` per head of what it compresses, the whole prompt when aware, the context when agnostic;
    all of it for the full cache, ``ratio`` None; a ragged method's longest head may hold more,
    counted once compressed), the question's slots (a stacked cache feeds it to its agnostic rows
    and keeps its slots, masked, in the others) and ``feeds`` fed tokens."""
    compressed = prompt_tokens if setting == "aware" else context_tokens
    kept = compressed if ratio is None else min(compressed, budget_for(compressed, ratio))
    return kept + prompt_tokens - context_tokens + feeds


def decode_batches(
    slots: Sequence[int], row_slot_bytes: int, limit: int | None, max_rows: int | None, state_copies: int = 1
) -> list[list[int]]:
    """Rows (indices into ``slots``, each row's slot count) cut into batches, in ascending order of
    slots: a row joins the current batch while the batch holds at most ``max_rows`` rows, pads its
    rows to at most ``PADDING`` times the slots they hold (rows x longest <= PADDING x their sum), and
    its stacked cache and its rows' compressed states (``state_copies`` of each: 2 where the quality
    measures keep a row's cache before the question), ``(rows x longest + copies x their sum) x
    row_slot_bytes``, stay within ``limit`` bytes (``None``: no limit); a row beyond the limit on its
    own decodes alone."""
    order = sorted(range(len(slots)), key=lambda row: slots[row])
    batches: list[list[int]] = []
    for row in order:
        batch = batches[-1] if batches else None
        if batch is not None and (max_rows is None or len(batch) < max_rows):
            padded = (len(batch) + 1) * slots[row]
            held = sum(slots[other] for other in batch) + slots[row]
            fits = limit is None or (padded + state_copies * held) * row_slot_bytes <= limit
            if padded <= PADDING * held and fits:
                batch.append(row)
                continue
        batches.append([row])
    return batches


def sample_batches(
    slots: Sequence[int],
    shape: ModelShape | None,
    memory: DeviceMemory | None,
    prompt_tokens: int,
    settings: int,
    observed_queries: int,
    max_rows: int | None,
    state_copies: int = 1,
) -> tuple[list[list[int]], int | None]:
    """A sample's rows of ``slots`` (``predicted_slots``) cut into batches (``decode_batches``) within
    the memory a device gives them (``sample_memory_limit``), and that limit: the grid decodes by them
    (``reskv.grid.decode_grid``), the dry run counts them. Without a ``memory`` or a ``shape`` (a dry
    run's calibration that gives neither), no limit."""
    if memory is None or shape is None:
        return decode_batches(slots, 0, None, max_rows, state_copies), None
    limit = sample_memory_limit(shape, memory, prompt_tokens, settings, observed_queries)
    return decode_batches(slots, shape.slot_bytes, limit, max_rows, state_copies), limit
