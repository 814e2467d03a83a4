"""A sample's paper-grid decode at the 8B shape, from the plan: decode batches, KV bytes a grid step
reads, bytes written before the first token, and ops of one eager grid step.

    python -m scripts.bench.grid_decode_plan [--lengths 4096 32768] [--ops-length 512]

The grid is configs/grid/paper_ruler.yaml's 73 configurations of one sample (``paper_ruler_requests``),
a ``--lengths`` prompt whose last 32 tokens are the question, 32 tokens decoded, on an H200 holding the
bf16 weights and both prefilled caches (``H200_MEMORY``). From the plan (host integers, no model):

- the decode batches the grid cuts (``reskv.batching.view_batches``: every row a view of the
  prefilled cache, ``reskv.views``);
- bytes a grid step reads besides the weights: the shared prefilled keys and values once, CaM's
  adjusted values once a setting at the slots its rows keep, every row's entries (at most the proxy's
  largest share of its budget: ``ViewRow.planned``) and appended slots
  (``reskv.batching.view_step_slots``), and the keep masks and the entries' bias;
- bytes written before the first token: the constructions' gathers of each row's main keys and values
  (``reskv.compress``, let go of as each row becomes a view), then the views' own (keep masks, the
  entry pool and its bias, CaM's adjusted values put back at their positions, the appended buffers).

Ops: the grid decoded on the 32-layer 8B attention shape at ``--ops-length`` tokens (narrow widths,
random weights, ``scripts.bench.decode_counts``), each batch's eager decode step counted
(``scripts.bench.dispatch_counts``); a grid step at the planned lengths takes one such step a batch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

import reskv.grid
from reskv.batching import (
    FP32_BYTES,
    DeviceMemory,
    ModelShape,
    ViewRow,
    sample_memory_limit,
    view_batches,
    view_step_slots,
)
from reskv.config import budget_for
from reskv.engine import Prefill
from reskv.grid import values_key
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.bench.dispatch_counts import count_dispatch
from scripts.bench.grid_counts import QUESTION_TOKENS
from scripts.bench.grid_gpu import paper_ruler_requests
from scripts.measure import random_prompt

# Llama-3.1-8B-Instruct's attention in bf16, and the H200 the grid ran on (results/gpu/README.md):
# its memory as the driver gives it and the bf16 weights (the committed H100 calibration's).
LLAMA_8B = ModelShape(layers=32, kv_heads=8, query_heads=32, head_dim=128, dtype_bytes=2)
H200_MEMORY = 143_771 << 20
WEIGHTS_BYTES = 16_060_522_496
NEW_TOKENS = 32
OBSERVED_QUERIES = 128
GB = 1e9


def planned(length: int, shape: ModelShape = LLAMA_8B) -> dict:
    """The views of one sample's grid at ``length`` prompt tokens, from the plan."""
    requests = paper_ruler_requests()
    context = length - QUESTION_TOKENS
    rows, gathers = [], 0
    heads = shape.layers * shape.kv_heads
    for method, setting in requests:
        compressed = length if setting == "aware" else context
        residual = method.residual
        shares = () if residual is None else (*residual.grid, residual.fixed_ratio)
        ratio = None if method.scorer is None else method.ratio
        rows.append(ViewRow.planned(compressed, ratio, shares, values_key(method, setting)))
        if ratio is not None:  # at most its budget's slots
            gathers += min(compressed, budget_for(compressed, ratio)) * heads * shape.kv_slot_bytes
    held = WEIGHTS_BYTES + (length + context) * heads * shape.kv_slot_bytes
    limit = sample_memory_limit(shape, DeviceMemory.holding(H200_MEMORY, held), length, 2, OBSERVED_QUERIES)
    appended = QUESTION_TOKENS + NEW_TOKENS
    batches = view_batches(rows, shape, limit, length, appended, None)
    read = masks = entries = sources = 0
    for batch in batches:
        batch_rows = [rows[row] for row in batch]
        read += view_step_slots(batch_rows, length, appended) * heads * shape.kv_slot_bytes
        masks += len(batch) * length * heads
        entries += sum(row.entry_slots for row in batch_rows) * heads * (shape.kv_slot_bytes + FP32_BYTES)
        adjusted = len({row.values_key for row in batch_rows} - {None})
        sources += adjusted * length * heads * shape.head_dim * shape.dtype_bytes
    appended_bytes = len(rows) * appended * heads * shape.kv_slot_bytes
    bias = sum(row.entry_slots for row in rows) * heads * FP32_BYTES
    return {
        "length": length,
        "batches": sorted((len(batch) for batch in batches), reverse=True),
        "kv_read_gb": (read + masks + bias) / GB,
        "gathers_gb": gathers / GB,
        "decode_copies_gb": (masks + entries + sources + appended_bytes) / GB,
        "entries_gb": entries / GB,
        "adjusted_values_gb": sources / GB,
    }


def ops_of_a_step(length: int) -> tuple[int, int]:
    """Ops of one eager grid step (every batch's step) at ``length`` tokens on the narrow 8B shape, and
    the batches it took."""
    torch.manual_seed(0)
    backbone = dataclasses.replace(narrow_llama_8b_attention(), stop_token_ids=())
    prompt = random_prompt(range(1, backbone.model.config.vocab_size), length, seed=42)
    requests = paper_ruler_requests()
    counted, batches = [], []
    original = reskv.grid.greedy

    def counted_greedy(logits, step, *args):
        def counted_step(token_ids):
            with count_dispatch() as counts:
                result = step(token_ids)
            counted.append(counts.ops)
            return result

        batches.append(logits.shape[0])
        return original(logits, counted_step, *args)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(reskv.grid, "greedy", counted_greedy))
        prefill = Prefill(backbone, prompt, length - QUESTION_TOKENS, [method for method, _ in requests])
        list(reskv.grid.decode_grid(prefill, requests, 3, min_new_tokens=3, max_rows=None))
    steps = len(counted) // len(batches)
    return sum(counted) // steps, len(batches)


def plan_table(lengths: list[int], ops_length: int) -> Table:
    step_ops, step_batches = ops_of_a_step(ops_length)
    per_batch = step_ops / step_batches
    table = Table(
        title=f"The paper grid's decode (73 configurations), 8B shape, H200 memory, {NEW_TOKENS} tokens; "
        f"ops: {step_ops:,} an eager grid step of {step_batches} batches at {ops_length} tokens"
    )
    columns = [
        "prompt tokens",
        "batches",
        "KV read a step GB",
        "gathers GB",
        "decode copies GB",
        "of which entries GB",
        "CaM values GB",
        "ops a step",
    ]
    for column in columns:
        table.add_column(column, justify="right")
    for length in lengths:
        row = planned(length)
        table.add_row(
            f"{length:,}",
            str(row["batches"]),
            f"{row['kv_read_gb']:.1f}",
            f"{row['gathers_gb']:.1f}",
            f"{row['decode_copies_gb']:.1f}",
            f"{row['entries_gb']:.1f}",
            f"{row['adjusted_values_gb']:.1f}",
            f"{round(per_batch * len(row['batches'])):,}",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--ops-length", type=int, default=512)
    args = parser.parse_args(argv)
    Console(width=200).print(plan_table(args.lengths, args.ops_length))


if __name__ == "__main__":
    main()
