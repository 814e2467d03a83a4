"""How a sample's grid is cut into decode batches, without torch: the engine decodes by it
(``reskv.grid``), and a dry run estimates a grid's device hours by it (``scripts.harness.estimate``).
"""

from __future__ import annotations

from collections.abc import Sequence

from reskv.config import AUTO, DECODE_CHOICES

# The most a batch pads its rows, as a multiple of the slots they hold: a padded slot costs a step its
# memory traffic and its share of the attention, and rows of a grid hold from a tenth of the prompt
# (ratio 0.9) to all of it (the full cache), which would then pad the others tenfold. Twice keeps the
# paper grid's compressed rows (10% to 40% of the prompt) in one batch and the full cache apart; the
# value is this project's choice, not a measurement.
PADDING = 2


def grid_decoding(decode: str, decode_batch: int | str, device_type: str) -> tuple[str, int | None]:
    """The decode mode and the most rows a batch holds (``None``: as many as ``decode_batches``
    allows) that ``decode`` (``DECODE_CHOICES``) and ``decode_batch`` (a positive integer or
    ``"auto"``) ask for on a device of ``device_type`` ("cuda", "cpu", ...). ``"auto"``: on CUDA the
    compiled step (CUDA graphs, no host cost per op) and every configuration of a sample in as few
    batches as the padding and the memory allow (one forward a step, the weights read once for all);
    elsewhere eager decoding, each configuration alone (bit for bit what the committed results
    decoded)."""
    if decode not in DECODE_CHOICES:
        raise ValueError(f"unknown decode mode {decode!r}; choose one of {list(DECODE_CHOICES)}")
    cuda = device_type == "cuda"
    if decode == AUTO:
        decode = "compiled" if cuda else "eager"
    if decode_batch == AUTO:
        return decode, None if cuda else 1
    if isinstance(decode_batch, bool) or not isinstance(decode_batch, int) or decode_batch < 1:
        raise ValueError(f"decode_batch {decode_batch!r} must be a positive integer or {AUTO!r}")
    return decode, decode_batch


def decode_batches(
    slots: Sequence[int], row_slot_bytes: int, limit: int | None, max_rows: int | None
) -> list[list[int]]:
    """Rows (indices into ``slots``, each row's slot count) cut into batches, in ascending order of
    slots: a row joins the current batch while the batch holds at most ``max_rows`` rows, pads its
    rows to at most ``PADDING`` times the slots they hold (rows x longest <= PADDING x their sum), and
    its stacked cache and its rows' compressed states, ``(rows x longest + their sum) x
    row_slot_bytes``, stay within ``limit`` bytes (``None``: no limit); a row beyond the limit on its
    own decodes alone."""
    order = sorted(range(len(slots)), key=lambda row: slots[row])
    batches: list[list[int]] = []
    for row in order:
        batch = batches[-1] if batches else None
        if batch is not None and (max_rows is None or len(batch) < max_rows):
            padded = (len(batch) + 1) * slots[row]
            held = sum(slots[other] for other in batch) + slots[row]
            if padded <= PADDING * held and (limit is None or (padded + held) * row_slot_bytes <= limit):
                batch.append(row)
                continue
        batches.append([row])
    return batches
