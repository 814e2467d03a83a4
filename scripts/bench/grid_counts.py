"""Ops and host-device syncs of serving one sample's paper grid, against one full-cache request of the
same sample, at Llama-3.1-8B's attention shape.

    python -m scripts.bench.grid_counts --lengths 2048 4096 --new-tokens 16 --decode-batch auto 16 1

The grid is the paper's RULER grid of one sample: the full cache, and SnapKV, AdaKV and each +ResKV at
ratios 0.6-0.9 in both settings (33 configurations), served as the runner serves it: one prefill,
the constructions sharing what they can (``Prefill.sharing_construction``), then the configurations
decoded ``--decode-batch`` rows at a time (``reskv.grid.decode_grid``; ``auto``: as many as the
batching rule lets together). The unit is one full-cache request: the same prefill, then ``generate``.
Every answer runs to ``--new-tokens`` tokens (no stop token), eagerly; the model is the 32-layer 8B
attention shape of ``scripts.bench.decode_counts`` (tiny hidden and MLP widths, random weights) and
the construction is laid out as on an 80 GB GPU (``scripts.bench.construction_counts.gpu_layout``);
the host syncs are counted per step of a decode batch.
On a GPU each op costs the host ~23 us at batch 1 (``results/gpu/README.md``), so these counts
predict where a grid's wall time goes there. The ops are split by stage: the prefills, the
constructions, the rows' views of the prefilled cache, feeding the question to the query-agnostic
rows, and decoding.
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
from baselines import build_method
from reskv.engine import Prefill
from reskv.views import ViewLayer
from scripts.bench.construction_counts import gpu_layout
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.bench.dispatch_counts import DispatchCounts, count_dispatch, stage
from scripts.measure import random_prompt

PAPER_METHODS = ("snapkv", "snapkv+reskv", "adakv", "adakv+reskv")
PAPER_RATIOS = (0.6, 0.7, 0.8, 0.9)
QUESTION_TOKENS = 32
STAGES = ("prefill", "construction", "views", "question", "decode")


def paper_grid() -> list[tuple]:
    """The 33 (method, setting) requests of one sample of the paper's RULER grid."""
    methods = [build_method(name, ratio) for name in PAPER_METHODS for ratio in PAPER_RATIOS]
    return [(build_method("full"), "aware")] + [
        (method, setting) for setting in ("aware", "agnostic") for method in methods
    ]


@contextlib.contextmanager
def staged():
    """Ops counted in the engine's stages (``STAGES``; the rest, the decode loop, counts as "decode")."""
    wrapped = (
        (Prefill, "__init__", "prefill"),
        (Prefill, "prefilled", "prefill"),
        (Prefill, "compressed_layers", "construction"),
        (ViewLayer, "__init__", "views"),
        (reskv.grid, "prompted_views", "question"),
    )
    with contextlib.ExitStack() as stack:
        for owner, name, label in wrapped:
            original = getattr(owner, name)

            def in_stage(*args, _original=original, _label=label, **kwargs):
                with stage(_label):
                    return _original(*args, **kwargs)

            stack.enter_context(mock.patch.object(owner, name, in_stage))
        with stage("decode"):
            yield


def count_grid(backbone, length: int, new_tokens: int, max_rows: int | None) -> tuple[DispatchCounts, float]:
    """The ops and syncs of one sample's grid (``paper_grid``) at ``length`` prompt tokens, and the
    number of decode batches it took."""
    prompt = random_prompt(range(1, backbone.model.config.vocab_size), length, seed=42)
    requests = paper_grid()
    with gpu_layout(), staged(), count_dispatch() as counts:
        prefill = Prefill(backbone, prompt, length - QUESTION_TOKENS, [method for method, _ in requests])
        prefill.prefilled("aware")
        grid = reskv.grid.decode_grid(prefill, requests, new_tokens, max_rows=max_rows)
        rows = [generation.run["batch_rows"] for _, generation in grid]
    return counts, sum(1 / size for size in rows)


def count_full_request(backbone, length: int, new_tokens: int) -> DispatchCounts:
    """The ops and syncs of one full-cache request of the same prompt: its prefill and decode."""
    prompt = random_prompt(range(1, backbone.model.config.vocab_size), length, seed=42)
    full = build_method("full")
    with gpu_layout(), staged(), count_dispatch() as counts:
        prefill = Prefill(backbone, prompt, length - QUESTION_TOKENS, [full])
        prefill.generate(full, "aware", new_tokens)
    return counts


def counts_table(lengths: list[int], new_tokens: int, batches: list[str]) -> Table:
    table = Table(title=f"One sample's paper grid (33 configurations) against one full-cache request, ops "
                  f"(syncs), 8B attention shape, {new_tokens} new tokens, eager")  # fmt: skip
    for column in ("prompt tokens", "decode batch", *STAGES, "total", "x full request", "syncs a step"):
        table.add_column(column, justify="right")
    torch.manual_seed(0)
    backbone = dataclasses.replace(narrow_llama_8b_attention(), stop_token_ids=())
    for length in lengths:
        full = count_full_request(backbone, length, new_tokens)
        per_step = full.syncs_by_stage["decode"] / new_tokens
        total = f"{full.ops:,} ({full.syncs})"
        table.add_row(str(length), "full request", *stage_cells(full), total, "1.00", f"{per_step:.2f}")
        for batch in batches:
            counts, decode_batches = count_grid(
                backbone, length, new_tokens, None if batch == "auto" else int(batch)
            )
            per_step = counts.syncs_by_stage["decode"] / (new_tokens * decode_batches)  # a batch's step
            cells = [f"{counts.ops:,} ({counts.syncs})", f"{counts.ops / full.ops:.2f}", f"{per_step:.2f}"]
            table.add_row(str(length), batch, *stage_cells(counts), *cells)
    return table


def stage_cells(counts: DispatchCounts) -> list[str]:
    return [f"{counts.ops_by_stage[name]:,} ({counts.syncs_by_stage[name]})" for name in STAGES]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--decode-batch", nargs="+", default=["auto"], help="rows a batch holds at most, or auto"
    )
    args = parser.parse_args(argv)
    Console(width=240).print(counts_table(args.lengths, args.new_tokens, args.decode_batch))


if __name__ == "__main__":
    main()
