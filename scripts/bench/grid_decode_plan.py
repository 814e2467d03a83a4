"""A sample's paper-grid decode at the 8B shape, from the plan: decode batches, KV bytes a grid step
reads, bytes written before the first token, and ops of one eager grid step.

    python -m scripts.bench.grid_decode_plan [--lengths 4096 32768] [--ops-length 512]

The grid is configs/grid/paper_ruler.yaml's 73 configurations of one sample (``paper_ruler_requests``),
a ``--lengths`` prompt whose last 32 tokens are the question, 32 tokens decoded, on an H200 holding the
bf16 weights and both prefilled caches (``H200_MEMORY``). From the plan (host integers, no model):

- the decode batches the grid cuts (``reskv.batching.sample_batches``);
- KV bytes a grid step reads: every batch's keys and values, each row padded to its batch's longest;
- bytes written before the first token: the constructions' gathers of each row's main keys and values
  (``reskv.compress``), then each batch's stacked buffers (``reskv.cache.StackedLayer``: keys, values,
  fp32 bias and entry marks at the batch's capacity, its rows copied in).

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
from reskv.batching import DeviceMemory, ModelShape, predicted_slots, sample_batches
from reskv.config import budget_for
from reskv.engine import Prefill
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


def kv_slot_bytes(shape: ModelShape) -> int:
    """Keys and values of one slot over every layer and KV head."""
    return shape.layers * shape.kv_heads * 2 * shape.head_dim * shape.dtype_bytes


def planned(length: int, shape: ModelShape = LLAMA_8B) -> dict:
    """The stacked layout of one sample's grid at ``length`` prompt tokens, from the plan."""
    requests = paper_ruler_requests()
    context = length - QUESTION_TOKENS
    slots = [
        predicted_slots(length, context, None if m.scorer is None else m.ratio, setting, NEW_TOKENS)
        for m, setting in requests
    ]
    held = WEIGHTS_BYTES + (length + context) * kv_slot_bytes(shape)
    memory = DeviceMemory.holding(H200_MEMORY, held)
    batches, _ = sample_batches(slots, shape, memory, length, 2, OBSERVED_QUERIES, None)
    kv = kv_slot_bytes(shape)
    read = sum(len(batch) * max(slots[row] for row in batch) for batch in batches) * kv
    gathers = 0
    for method, setting in requests:
        compressed = length if setting == "aware" else context
        if method.scorer is not None:
            gathers += min(compressed, budget_for(compressed, method.ratio)) * kv
    stacked = sum(len(batch) * max(slots[row] for row in batch) for batch in batches) * shape.slot_bytes
    return {
        "length": length,
        "batches": sorted((len(batch) for batch in batches), reverse=True),
        "kv_read_gb": read / GB,
        "gathers_gb": gathers / GB,
        "decode_copies_gb": stacked / GB,
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
