"""What one sample's paper RULER grid constructs, against its floor: host syncs, ops, k-means FLOPs and
fp32 bytes, counted on CPU as a GPU would run them.

    python -m scripts.bench.grid_constructions [--length 4096] [--fused-lloyd] [--fused-losses]
        [--fused-sums] [--out FILE]

The 72 compressed configurations of ``configs/grid/paper_ruler.yaml`` (``grid_gpu.paper_ruler_requests``:
H2O, TOVA, SnapKV, AdaKV and each +ResKV, CaM, at ratios 0.6-0.9, both settings; the full cache, the
73rd, constructs nothing) are constructed as the grid constructs them (``Prefill.sharing_construction``
of the 72 requests), one after another in the plan's order, on one prompt prefilled by the 32-layer
8B attention shape (``decode_counts.narrow_llama_8b_attention``: random weights, bf16) and laid out
as on an 80 GB GPU (``construction_counts.gpu_layout``). Nothing is decoded. For the grid, and for
each (method, setting)'s four ratios constructed as a grid of their own (what it shares with other
methods in the whole grid then counted as its own):

- **syncs**: every wait of the host on the device (``dispatch_counts``: reads, and host->device copies
  that are not ``non_blocking``);
- **ops**: launching aten ops;
- **k-means FLOPs over the unpadded formula**: the nearest-centre products the k-means launches
  (rows x padded points x padded centres x 2 d a Lloyd step; where the GPU's kernel skips a group's
  padding, ``reskv.residual.nearest_skips_padding``, each row's own; where ``reskv.lloyd_kernel``
  shares a family's first step, its largest row's alone) over ``2 d |E| r`` a step summed over its
  rows, each with its own point count and residual size;
- **fp32 bytes written**: fp32 results of the construction's ops, apart from the nearest-centre step's
  distance blocks (the torch path's here; on CUDA the kernel writes none, ``reskv.nearest_kernel``),
  which are given beside them; and the largest fp32 result one op wrote.

With ``--fused-lloyd`` the k-means groups of bf16 keys are clustered as on a GPU with
``reskv.residual.CUDA_FUSED_LLOYD`` (``fused_lloyd_launches``): each group's launches of
``reskv.lloyd_kernel`` are counted, and its entries computed by the torch path uncounted; with
``--fused-losses`` the validation proxies' errors as on a GPU with ``reskv.proxy.CUDA_FUSED_LOSSES``
(``fused_loss_launches``), likewise; with ``--fused-sums`` SnapKV's window means and the proxies'
full outputs as with ``reskv.scoring.CUDA_FUSED_ATTENTION_SUMS`` (``fused_sum_launches``), likewise.

The counts depend on the shapes the data decides (AdaKV's budgets, the residual sizes the proxies
chose on this random model), not on the weights otherwise. A few minutes of CPU at 2K tokens, tens
at 4K.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

import reskv.nearest_kernel
import reskv.proxy
import reskv.residual
import reskv.scoring
from reskv.engine import Prefill
from reskv.proxy import ValidationProxy
from scripts.bench.construction_counts import gpu_layout
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.bench.dispatch_counts import (
    DispatchCounts,
    count_dispatch,
    current_stage,
    launched,
    stage,
    uncounted,
)
from scripts.bench.grid_counts import QUESTION_TOKENS
from scripts.bench.grid_gpu import paper_ruler_requests
from scripts.machine import machine
from scripts.measure import random_prompt

# The fp32 points a part of a k-means group copies when the torch path stands in for the Lloyd kernel
# (``fused_lloyd_launches``).
STAND_IN_POINTS_BYTES = 2**30
NEAREST = "/nearest"  # suffix of the stage a construction's nearest-centre step runs in


@dataclasses.dataclass
class KmeansWork:
    """The k-means groups one construction ran: FLOPs as launched and by the unpadded formula."""

    padded: float = 0.0  # the groups' whose nearest-centre step computes their padding
    # Per group: (point counts, residual sizes, 2 d x Lloyd steps, whether its nearest-centre step
    # skips padding); read after the count, so that the formula's reads of the device are not counted
    # as the construction's.
    groups: list = dataclasses.field(default_factory=list)
    # Per call of ``cluster_rows`` whose families ``reskv.lloyd_kernel`` clusters with their first step
    # shared: (point counts, residual sizes, 2 d, the families).
    shared: list = dataclasses.field(default_factory=list)

    def formula(self, skipping_padding_only: bool = False) -> float:
        return sum(
            factor * float((counts * torch.minimum(sizes, counts)).sum())
            for counts, sizes, factor, skips in self.groups
            if skips or not skipping_padding_only
        )

    def saved(self) -> float:
        """The first step's products that a family's rows but its largest do not launch."""
        return sum(
            factor * float((counts[members[:-1]] * sizes[members[:-1]]).sum())
            for counts, sizes, factor, families in self.shared
            for members in families
        )

    def launched(self) -> float:
        return self.padded + self.formula(skipping_padding_only=True) - self.saved()


@contextlib.contextmanager
def probed(work: dict[str, KmeansWork]):
    """Every construction in a stage of its (method, setting) (``Prefill.compressed_layers``), its
    nearest-centre step in a stage of its own, and its k-means groups recorded in ``work``."""
    compressed_layers, nearest_centers, cluster, cluster_rows = (
        Prefill.compressed_layers,
        reskv.residual.nearest_centers,
        reskv.residual._cluster,
        reskv.proxy.cluster_rows,
    )

    def in_stage(prefill, method, setting="aware"):
        with stage(f"{method.name} {setting}"):
            return compressed_layers(prefill, method, setting)

    def nearest(*args, **kwargs):
        with stage(current_stage() + NEAREST):
            return nearest_centers(*args, **kwargs)

    def recorded(keys, values, heads, order, offsets, point_counts, sizes, group, iterations):
        factor, skips = 2 * keys.shape[-1] * iterations, reskv.residual.nearest_skips_padding(keys)
        found = work[current_stage()]
        if not skips:
            found.padded += factor * len(group.rows) * group.max_points * group.max_size
        found.groups.append((point_counts.clone(), sizes.clone(), factor, skips))
        return cluster(keys, values, heads, order, offsets, point_counts, sizes, group, iterations)

    def families_recorded(
        keys, values, heads, order, offsets, point_counts, sizes, groups, iterations, families
    ):
        if families and reskv.residual.fused_lloyd_form(keys) is not None:
            with uncounted():
                shared = (point_counts.clone(), sizes.clone(), 2 * keys.shape[-1], families)
            work[current_stage()].shared.append(shared)
        return cluster_rows(
            keys, values, heads, order, offsets, point_counts, sizes, groups, iterations, families
        )

    with (
        mock.patch.object(Prefill, "compressed_layers", in_stage),
        mock.patch.object(reskv.residual, "nearest_centers", nearest),
        mock.patch.object(reskv.residual, "_cluster", recorded),
        mock.patch.object(reskv.proxy, "cluster_rows", families_recorded),
    ):
        yield


class CountedKernel:
    """A Triton kernel that runs nothing: each launch counted as one op (``dispatch_counts.launched``)
    writing the fp32 bytes of the tensors ``written`` names among its arguments."""

    def __init__(self, name: str, written: Callable[[dict], list[torch.Tensor]]):
        self.name, self.written = name, written

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, **arguments) -> None:
        mode = arguments.get("MODE", "")
        written = sum(4 * tensor.numel() for tensor in self.written(arguments))
        launched(f"{self.name} {mode}".strip(), written)


def lloyd_writes(arguments: dict) -> list[torch.Tensor]:
    """What a ``reskv.lloyd_kernel`` launch writes in fp32: an assignment step its clusters' sums and
    counts; an init or update the centres and their norms; the final entries their log-counts (as many
    as the norms)."""
    mode = arguments.get("MODE")
    if mode is None:
        return [arguments["cluster_sums"], arguments["cluster_counts"]]
    if mode == "final":
        return [arguments["center_norms"]]
    return [arguments["centers"], arguments["center_norms"]]


@contextlib.contextmanager
def fused_lloyd_launches():
    """The k-means groups of bf16 keys clustered as on a GPU with ``reskv.residual.CUDA_FUSED_LLOYD``:
    by ``reskv.lloyd_kernel.cluster``, whose launches are counted (``CountedKernel``) while its entries
    are computed by the torch path, uncounted, in parts of the group whose points' fp32 copy fits
    ``STAND_IN_POINTS_BYTES`` (a merged group's copy would not fit a small host; a row's entries
    depend on the rows beside it only through the padding)."""
    from reskv import lloyd_kernel  # imports Triton

    cluster = lloyd_kernel.cluster

    def counted_cluster(*arguments, families=()):
        cluster(*arguments, families=families)
        keys, values, heads, order, offsets, point_counts, sizes, group, iterations, entries, _ = arguments
        with uncounted(), mock.patch.object(reskv.residual, "fused_lloyd_form", lambda keys: None):
            host_sizes, host_points = sizes.tolist(), point_counts.tolist()
            each = max(1, STAND_IN_POINTS_BYTES // (group.max_points * keys.shape[-1] * 4))
            for start in range(0, len(group.rows), each):
                part = reskv.residual.row_group(group.rows[start : start + each], host_sizes, host_points)
                alone = reskv.residual.cluster_rows(
                    keys, values, heads, order, offsets, point_counts, sizes, [part], iterations
                )
                for field, computed in zip(entries.fields(), alone.fields(), strict=True):
                    field[part.rows, : part.max_size] = computed[part.rows]
        return entries

    def form_on_a_gpu(keys):  # reskv.residual.nearest_kernel_form on CUDA with Triton
        return reskv.nearest_kernel.precision(keys.dtype == torch.bfloat16)

    with (
        mock.patch.object(reskv.residual, "fused_lloyd_form", form_on_a_gpu),
        mock.patch.object(lloyd_kernel, "cluster", counted_cluster),
        mock.patch.object(lloyd_kernel, "_assign_kernel", CountedKernel("lloyd assign", lloyd_writes)),
        mock.patch.object(lloyd_kernel, "_centres_kernel", CountedKernel("lloyd centres", lloyd_writes)),
    ):
        yield


@contextlib.contextmanager
def fused_loss_launches():
    """The validation proxies' errors as on a GPU with ``reskv.proxy.CUDA_FUSED_LOSSES``: by
    ``reskv.loss_kernel.errors``, whose launch is counted (``CountedKernel``) while the errors are
    computed by the torch path, uncounted."""
    from reskv import loss_kernel  # imports Triton

    sets_errors = ValidationProxy.sets_errors

    def counted_errors(proxy, every_row, layouts):
        with mock.patch.object(reskv.proxy, "fused_losses", lambda keys, rule: rule.shared_softmax):
            sets_errors(proxy, every_row, layouts)
        with uncounted():
            return sets_errors(proxy, every_row, layouts)

    with (
        mock.patch.object(ValidationProxy, "sets_errors", counted_errors),
        mock.patch.object(
            loss_kernel, "_errors_kernel", CountedKernel("proxy errors", lambda a: [a["found"]])
        ),
    ):
        yield


@contextlib.contextmanager
def fused_sum_launches():
    """Attention's sums over bf16 queries as on a GPU with ``reskv.scoring.CUDA_FUSED_ATTENTION_SUMS``:
    SnapKV's window means (the deployed window's and the proxies' fit scores) and the proxies' full
    outputs by ``reskv.attention_sums_kernel``, whose launches are counted (``CountedKernel``) while
    the sums are computed by the torch path, uncounted."""
    from reskv import attention_sums_kernel  # imports Triton

    column_sums, outputs = attention_sums_kernel.column_sums, attention_sums_kernel.outputs

    def counted_column_sums(queries, keys, first_position, scaling):
        found = column_sums(queries, keys, first_position, scaling)
        with uncounted():
            positions = range(first_position, keys.shape[1])
            return found.copy_(reskv.scoring.causal_attention_probs(queries, keys, positions, scaling).sum(1))

    def counted_outputs(queries, keys, values, first_position, scaling):
        found = outputs(queries, keys, values, first_position, scaling)
        positions = range(first_position, keys.shape[1])
        with uncounted(), mock.patch.object(reskv.scoring, "fused_attention_sums", lambda queries: False):
            return found.copy_(
                reskv.scoring.attention_outputs(queries, keys, values, positions, scaling).view_as(found)
            )

    def lse_writes(arguments: dict) -> list[torch.Tensor]:
        return [arguments["outputs" if arguments["OUTPUTS"] else "log_sum_exp"]]

    with (
        mock.patch.object(
            reskv.scoring, "fused_attention_sums", lambda queries: queries.dtype == torch.bfloat16
        ),
        mock.patch.object(attention_sums_kernel, "column_sums", counted_column_sums),
        mock.patch.object(attention_sums_kernel, "outputs", counted_outputs),
        mock.patch.object(
            attention_sums_kernel, "_log_sum_exp_kernel", CountedKernel("attention sums", lse_writes)
        ),
        mock.patch.object(
            attention_sums_kernel, "_column_sums_kernel", CountedKernel("column sums", lambda a: [a["sums"]])
        ),
    ):
        yield


def counted(prefill: Prefill, requests: list) -> tuple[DispatchCounts, dict[str, KmeansWork]]:
    """The counts of ``requests``' constructions, shared and planned as a grid's (module docstring),
    and their k-means work per (method, setting)."""
    work: dict[str, KmeansWork] = defaultdict(KmeansWork)
    with probed(work), count_dispatch() as counts, prefill.sharing_construction(requests):
        for method, setting in requests:
            prefill.compressed_layers(method, setting)
    return counts, work


def count_constructions(
    length: int, fused_lloyd: bool = False, fused_losses: bool = False, fused_sums: bool = False
) -> dict:
    """The figures (``figures``) of one sample's 72 constructions at ``length`` tokens: the grid's, and
    each (method, setting)'s four ratios constructed as a grid of their own (work it shares with other
    methods in the whole grid is then its own); and every construction matmul's GFLOP
    (``FlopCounterMode``) in the grid. ``fused_lloyd``: the k-means by ``fused_lloyd_launches``;
    ``fused_losses``: the proxies' errors by ``fused_loss_launches``; ``fused_sums``: attention's sums
    by ``fused_sum_launches``."""
    backbone = narrow_llama_8b_attention()
    prompt = random_prompt(range(1, backbone.model.config.vocab_size), length, seed=42)
    requests = [(method, setting) for method, setting in paper_ruler_requests() if method.scorer is not None]
    families = defaultdict(list)
    for method, setting in requests:
        families[f"{method.name} {setting}"].append((method, setting))
    lloyd = fused_lloyd_launches() if fused_lloyd else contextlib.nullcontext()
    losses = fused_loss_launches() if fused_losses else contextlib.nullcontext()
    sums = fused_sum_launches() if fused_sums else contextlib.nullcontext()
    with torch.inference_mode(), gpu_layout(), lloyd, losses, sums:
        prefill = Prefill(backbone, prompt, length - QUESTION_TOKENS, [method for method, _ in requests])
        prefill.prefilled("aware")
        with FlopCounterMode(display=False) as flops:
            grid = figures(*counted(prefill, requests))
        alone = {name: figures(*counted(prefill, family)) for name, family in sorted(families.items())}
    return {
        "grid": grid,
        "per_method_setting": alone,
        "construction_matmul_gflop": flops.get_total_flops() / 1e9,
    }


def figures(counts: DispatchCounts, work: dict[str, KmeansWork]) -> dict:
    """Syncs, ops, k-means FLOPs as launched and by formula, fp32 bytes written apart from the
    nearest-centre step's and by it, of every stage counted together; and the syncs by kind and the
    largest fp32 result."""
    names = {name.removesuffix(NEAREST) for name in counts.ops_by_stage}
    stages = [*names, *(name + NEAREST for name in names)]
    return {
        "syncs": sum(counts.syncs_by_stage[name] for name in stages),
        "ops": sum(counts.ops_by_stage[name] for name in stages),
        "kmeans_gflop_launched": sum(found.launched() for found in work.values()) / 1e9,
        "kmeans_gflop_formula": sum(found.formula() for found in work.values()) / 1e9,
        "fp32_gb": sum(counts.fp32_bytes_by_stage[name] for name in names) / 1e9,
        "nearest_fp32_gb": sum(counts.fp32_bytes_by_stage[name + NEAREST] for name in names) / 1e9,
        "largest_fp32_gb": counts.largest_fp32_bytes / 1e9,
        "syncs_by_op": dict(counts.syncs_by_op),
    }


def ratio(row: dict) -> str:
    formula = row["kmeans_gflop_formula"]
    return f"{row['kmeans_gflop_launched'] / formula:.3f}" if formula else "-"


def figures_table(found: dict, length: int) -> Table:
    table = Table(
        title=f"One sample's paper RULER grid, its 72 constructions at {length} tokens, 8B attention shape, "
        "GPU layout: each (method, setting)'s four ratios as a grid of their own, then the whole grid"
    )
    columns = ("method, setting", "syncs", "ops", "k-means GFLOP", "/ unpadded", "fp32 GB", "+ distances GB")
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for name, row in [*found["per_method_setting"].items(), ("grid", found["grid"])]:
        table.add_row(
            name,
            str(row["syncs"]),
            f"{row['ops']:,}",
            f"{row['kmeans_gflop_launched']:,.1f}",
            ratio(row),
            f"{row['fp32_gb']:.2f}",
            f"{row['nearest_fp32_gb']:.2f}",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument(
        "--fused-lloyd", action="store_true", help="the k-means as reskv.lloyd_kernel launches it on a GPU"
    )
    parser.add_argument(
        "--fused-losses", action="store_true", help="the proxies' errors as reskv.loss_kernel computes them"
    )
    parser.add_argument(
        "--fused-sums",
        action="store_true",
        help="SnapKV's window means and the proxies' full outputs as reskv.attention_sums_kernel sums them",
    )
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    found = count_constructions(args.length, args.fused_lloyd, args.fused_losses, args.fused_sums)
    found |= {
        "length": args.length,
        "fused_lloyd": args.fused_lloyd,
        "fused_losses": args.fused_losses,
        "fused_sums": args.fused_sums,
    }
    found["machine"] = machine()
    grid = found["grid"]
    console = Console(width=200)
    console.print(figures_table(found, args.length))
    console.print(
        f"the grid's syncs by kind: {grid['syncs_by_op']}; every construction matmul: "
        f"{found['construction_matmul_gflop']:,.1f} GFLOP; the largest fp32 result: "
        f"{grid['largest_fp32_gb']:.2f} GB"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
