"""What ptxas gives each Triton kernel of the project on a GPU, read on a machine without one.

    python -m scripts.bench.kernel_resources              # sm_90: the H100 and H200
    python -m scripts.bench.kernel_resources --arch 80    # an A100

Triton compiles each kernel for the GPU architecture with its own bundled toolchain (the one it uses
on the GPU, so the figures are the GPU's for the installed Triton), at the tiles and warps its
launcher uses (the constants of ``reskv.nearest_kernel``, ``reskv.lloyd_kernel``, ``reskv.loss_kernel``,
``reskv.decode_kernel`` and ``reskv.attention_sums_kernel``), for the head
dims of the paper's backbones (128) and the embedded model (64) and each cache dtype. Triton's
``cuobjdump`` then reads the registers a thread holds and the stack bytes it keeps in local memory:
a kernel whose tiles do not fit its registers spills them there and reads them back in its inner
loop. Needs Triton (the ``kernels`` extra), no GPU.

    python -m scripts.bench.kernel_resources --tiles      # the k-means' tiles the GPU check times

``--tiles`` compiles the k-means' bf16x3 kernels (the nearest-centre kernel and the Lloyd steps') at
each of ``NEAREST_TILES`` and counts, besides, the SASS instructions of the nearest-centre scan's loop
(one tile of centres against the program's tile of points): a warp issues that many for
``2 x points x centres x d`` FLOP of the k-means' formula, so their ratio bounds the rate an SM's
four schedulers can issue (``results/README.md`` gives the H200's).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from rich.console import Console
from rich.table import Table

from reskv import attention_sums_kernel, decode_kernel, lloyd_kernel, loss_kernel, nearest_kernel
from scripts.bench.gpu_check.correctness import DTYPES

HEAD_DIMS = (64, 128)
CACHE_DTYPES = ("fp32", "bf16", "fp16")
# The nearest-centre kernel's tiles (points and centres a program takes, its warps) that the GPU
# check's ``tiles`` stage times, the launchers' own first; ``--tiles`` prints what ptxas gives each.
# Each fits an H100's shared memory (227 KiB a program) at head dims 64 and 128.
NEAREST_TILES = (
    (nearest_kernel.POINT_TILE, nearest_kernel.CENTER_TILE, nearest_kernel.NUM_WARPS),
    (64, 64, 8),
    (128, 32, 8),
    (128, 64, 8),
)


@dataclass(frozen=True)
class KernelBuild:
    """One compilation of a kernel: its argument types, constexpr values, warps per program, whether
    multiplies and adds may fuse and its loops' pipeline stages (the launcher's ``num_warps``,
    ``enable_fp_fusion`` and ``num_stages``, ``None`` where it names none)."""

    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    fp_fusion: bool
    num_stages: int | None = None


@dataclass(frozen=True)
class Resources:
    """What ptxas gave one compiled kernel."""

    registers: int  # per thread
    stack_bytes: int  # per thread, in local memory: spilled registers
    shared_bytes: int  # per program
    loop_opcodes: Counter[str]  # the instructions a warp issues in the longest loop's body (``longest_loop``)
    atomics: Counter[str]  # the listing's atomic instructions, by mnemonic (``REDG.E.ADD.F32x4...``)


def kernel_builds(head_dim: int, cache_dtype: str) -> list[KernelBuild]:
    """The compilations the launchers make for ``head_dim`` and a cache in ``cache_dtype``: the
    nearest-centre kernel (fp32 points, each product form ``nearest_kernel`` offers), the Lloyd steps'
    kernels where the nearest centres of the cache's keys have a form (``lloyd_builds``), the proxy's
    errors (``loss_build``), the gated decode step's two kernels (the largest row tile,
    ``decode_kernel.MAX_ROWS`` rows), and for a
    half-precision cache the view kernel over each pool and attention's column sums and outputs
    (``attention_sums_kernel``). A tile is
    a power of two, at least 16 (``tl.dot``'s least), as the launchers round them."""
    dim_tile, rows = (max(16, 1 << (size - 1).bit_length()) for size in (head_dim, decode_kernel.MAX_ROWS))
    parts = parts_type()
    nearest = [
        KernelBuild(
            f"nearest ({precision})",
            nearest_kernel._nearest_kernel,
            {"points": "*fp32", "centers": parts if precision == "bf16x3" else "*fp32"}
            | {
                "center_norms": "*fp32",
                "nearest_index": "*i64",
                "point_counts": "*i64",
                "center_counts": "*i64",
            }
            | dict.fromkeys(["num_points", "num_centers", "dim"], "i32"),
            {
                "HAS_EXTENTS": True,  # a k-means group's rows each over its own (reskv.residual._cluster)
                "POINT_TILE": nearest_kernel.POINT_TILE,
                "CENTER_TILE": nearest_kernel.CENTER_TILE,
                "DIM_TILE": dim_tile,
                "PRECISION": precision,
            },
            nearest_kernel.NUM_WARPS,
            nearest_kernel.FP_FUSION,
        )
        for precision in nearest_kernel.PRECISIONS
    ]
    split = KernelBuild(
        "centres' split",
        nearest_kernel._split_kernel,
        {"centers": "*fp32", "parts": parts, "num_centers": "i32", "dim": "i32"},
        {"CENTER_TILE": nearest_kernel.CENTER_TILE, "DIM_TILE": dim_tile},
        4,  # Triton's default: the launcher names none
        True,
    )
    partials = dict.fromkeys(["partial_max", "partial_sum", "partial_output"], "*fp32")
    chunk = KernelBuild(
        "decode chunks",
        decode_kernel._chunk_kernel,
        dict.fromkeys(["queries", "keys", "values"], f"*{cache_dtype}")
        | {"bias": "*fp32"}
        | partials
        | dict.fromkeys(["rows", "num_slots", "dim", "residual_slots", "chunk_slots", "entry_chunks"], "i32")
        | {"scaling": "fp32"},
        {"ROW_TILE": rows, "SLOT_TILE": decode_kernel.SLOT_TILE, "DIM_TILE": dim_tile},
        decode_kernel.NUM_WARPS,
        decode_kernel.FP_FUSION,
        decode_kernel.NUM_STAGES,
    )
    merge = KernelBuild(
        "decode merge",
        decode_kernel._merge_kernel,
        partials
        | {"output": f"*{cache_dtype}"}
        | dict.fromkeys(["rows", "dim", "chunks", "entry_chunks"], "i32")
        | dict.fromkeys(["alpha_tau", "alpha", "log_g_min"], "fp32"),
        {"ROW_TILE": rows, "DIM_TILE": dim_tile},
        4,  # Triton's default: the launcher names none
        decode_kernel.FP_FUSION,
    )
    column_shape = dict.fromkeys(["num_queries", "num_keys", "first_position", "dim", "group"], "i32")
    column_tiles = {
        "QUERY_TILE": attention_sums_kernel.QUERY_TILE,
        "KEY_TILE": attention_sums_kernel.KEY_TILE,
        "DIM_TILE": dim_tile,
        "IEEE": False,
    }
    inputs = dict.fromkeys(["queries", "keys"], f"*{cache_dtype}")
    lse_arguments = (
        inputs
        | {"values": f"*{cache_dtype}", "log_sum_exp": "*fp32", "outputs": "*fp32"}
        | dict.fromkeys(["queries_head", "keys_head", "values_head"], "i32")
        | column_shape
        | {"scaling": "fp32"}
    )
    log_sum_exp, outputs = (
        KernelBuild(
            name,
            attention_sums_kernel._log_sum_exp_kernel,
            lse_arguments,
            column_tiles | {"QUERY_TILE": query_tile, "KEY_TILE": key_tile, "OUTPUTS": with_outputs},
            attention_sums_kernel.NUM_WARPS,
            True,  # Triton's default: the launcher names none
        )
        for name, query_tile, key_tile, with_outputs in [
            (
                "column sums: log-sum-exp",
                attention_sums_kernel.QUERY_TILE,
                attention_sums_kernel.KEY_TILE,
                False,
            ),
            (
                "attention outputs",
                attention_sums_kernel.OUTPUT_QUERY_TILE,
                attention_sums_kernel.OUTPUT_KEY_TILE,
                True,
            ),
        ]
    )
    columns = KernelBuild(
        "column sums",
        attention_sums_kernel._column_sums_kernel,
        inputs
        | {"log_sum_exp": "*fp32", "sums": "*fp32"}
        | dict.fromkeys(["queries_head", "keys_head"], "i32")
        | column_shape
        | {"scaling": "fp32"},
        column_tiles,
        attention_sums_kernel.NUM_WARPS,
        True,
    )
    # A grid step of views: one pool's partial softmaxes, the shared slots (each row's keep mask) and
    # the entry pool (its bias and each row's window), as ``decode_kernel.view_partials`` launches them.
    view_shape = dict.fromkeys(["heads", "group", "slots", "dim", "rows", "chunk_slots"], "i32")
    view_tiles = {
        "ROW_TILE": decode_kernel.VIEW_ROW_TILE,
        "SLOT_TILE": decode_kernel.VIEW_SLOT_TILE,
        "DIM_TILE": dim_tile,
        "PRECISION": "ieee" if cache_dtype == "fp32" else None,
    }
    pool_inputs = dict.fromkeys(["queries", "keys", "values_0", "values_1", "values_2"], f"*{cache_dtype}")
    tiles = dict.fromkeys(["tile_first", "tile_rows", "tile_source"], "*i32")
    views = [
        KernelBuild(
            f"views: {pool}",
            decode_kernel._pool_kernel,
            pool_inputs | reads | tiles | partials | view_shape | {"scaling": "fp32"},
            view_tiles
            | {"HAS_HIDDEN": pool == "shared", "HAS_BIAS": pool != "shared", "HAS_WINDOW": pool != "shared"},
            decode_kernel.VIEW_NUM_WARPS,
            decode_kernel.FP_FUSION,
        )
        for pool, reads in (
            ("shared", {"hidden": "*u8", "bias": f"*{cache_dtype}", "first": "*i32", "last": "*i32"}),
            ("entries", {"hidden": f"*{cache_dtype}", "bias": "*fp32", "first": "*i64", "last": "*i64"}),
        )
    ]
    # H2O's column sums and the views run on CUDA for half-precision caches only (reskv.scoring,
    # decode_kernel.VIEW_DTYPES).
    half = [*views, log_sum_exp, columns, outputs] if cache_dtype != "fp32" else []
    return [
        *nearest,
        split,
        *lloyd_builds(dim_tile, cache_dtype),
        loss_build(dim_tile, cache_dtype),
        chunk,
        merge,
        *half,
    ]


def parts_type() -> str:
    """The pointer type of the centres' split that the bf16x3 scans read (``nearest_kernel.split_centers``):
    ``nearest_kernel.parts_dtype``."""
    dtype = nearest_kernel.parts_dtype()
    return "*" + next(name for name, named in DTYPES.items() if named == dtype)


def loss_build(dim_tile: int, cache_dtype: str) -> KernelBuild:
    """``reskv.loss_kernel``'s compilation for a cache in ``cache_dtype``: the gate open and clamped, a
    population weight other than 1 (every branch the paper grid's rule and its ablations take)."""
    strides = [
        "queries_head", "queries_query", "full_head", "full_query", "main_rows_stride", "entry_keys_row",
        "entry_keys_slot", "entry_values_row", "entry_values_slot", "log_counts_row", "row_stride",
        "num_queries", "boundary", "exact_count", "validation_count", "dim",
    ]  # fmt: skip
    return KernelBuild(
        "proxy errors",
        loss_kernel._errors_kernel,
        dict.fromkeys(["queries", "key_rows", "value_rows", "entry_keys", "entry_values"], f"*{cache_dtype}")
        | dict.fromkeys(["full_output", "log_counts", "found"], "*fp32")
        | dict.fromkeys(["heads", "main_rows", "main_counts", "entry_counts"], "*i64")
        | dict.fromkeys(strides, "i32")
        | dict.fromkeys(["scaling", "tau", "alpha", "g_min", "population_weight"], "fp32"),
        {
            "GATE_OPEN": True,
            "CLAMP_GATE": True,
            "UNIT_POPULATION_WEIGHT": False,
            "QUERY_TILE": loss_kernel.QUERY_TILE,
            "SLOT_TILE": loss_kernel.SLOT_TILE,
            "DIM_TILE": dim_tile,
            "PRECISION": loss_kernel.product_precision(DTYPES[cache_dtype]),
        },
        loss_kernel.NUM_WARPS,
        True,  # Triton's default: the launcher names none
    )


def lloyd_builds(dim_tile: int, cache_dtype: str) -> list[KernelBuild]:
    """``reskv.lloyd_kernel``'s compilations for keys and values in ``cache_dtype``, where the nearest
    centres of such keys have a product form (``nearest_kernel.precision``; none: no build): its
    assignment step, without the values and with them, each alone and shared by a family, and its
    centres' three modes."""
    form = nearest_kernel.precision(cache_dtype == "bf16")
    if form is None:
        return []
    layout = (
        dict.fromkeys(["key_rows"], f"*{cache_dtype}")
        | dict.fromkeys(["order", "offsets", "heads", "sizes", "rows_index"], "*i64")
        | dict.fromkeys(["cluster_sums", "cluster_counts", "centers"], "*fp32")
        | {"center_parts": parts_type()}
        | {"center_norms": "*fp32"}
    )
    shape = dict.fromkeys(["row_stride", "order_stride", "num_centers", "dim"], "i32")
    tiles = {"HAS_OFFSETS": True, "PRECISION": form, "CENTER_TILE": nearest_kernel.CENTER_TILE}
    tiles |= {"DIM_TILE": dim_tile}
    steps = {"value_rows": f"*{cache_dtype}", "point_counts": "*i64", "family": "*i64"}
    steps |= {"num_points": "i32", "family_width": "i32"}
    assign = [
        KernelBuild(
            f"lloyd assign ({form}{', values' if with_values else ''}{', shared' if shared else ''})",
            lloyd_kernel._assign_kernel,
            layout | steps | shape,
            tiles | {"WITH_VALUES": with_values, "SHARED": shared, "POINT_TILE": nearest_kernel.POINT_TILE},
            nearest_kernel.NUM_WARPS,
            True,  # Triton's default: the launcher names none
        )
        for shared in (False, True)  # a family's first step shared (``lloyd_kernel.cluster``)
        for with_values in (False, True)
    ]
    entries = dict.fromkeys(["entry_keys", "entry_values"], f"*{cache_dtype}") | {"entry_log_counts": "*fp32"}
    centres = [
        KernelBuild(
            f"lloyd centres ({mode})",
            lloyd_kernel._centres_kernel,
            layout | entries | {"entry_width": "i32"} | shape,
            tiles | {"MODE": mode},
            nearest_kernel.NUM_WARPS,
            True,
        )
        for mode in lloyd_kernel.CENTRE_MODES
    ]
    return [*assign, *centres]


def compiled_resources(build: KernelBuild, arch: int) -> Resources:
    """Compile ``build`` for CUDA architecture ``arch`` (90: sm_90) and read its cubin's resource use."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = build.signature | dict.fromkeys(build.constexprs, "constexpr")
    index = build.kernel.arg_names.index
    attrs = {(index(name),): [["tt.divisibility", 16]] for name in aligned_arguments(build)}
    compiled = triton.compile(
        ASTSource(fn=build.kernel, signature=signature, constexprs=build.constexprs, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": build.num_warps, "enable_fp_fusion": build.fp_fusion}
        | ({"num_stages": build.num_stages} if build.num_stages is not None else {}),
    )
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage, sass = (
            subprocess.run([str(cuobjdump), flag, str(cubin)], capture_output=True, text=True, check=True)
            for flag in ("--dump-resource-usage", "-sass")
        )
    figures = dict(re.findall(r"(REG|STACK):(\d+)", usage.stdout))
    loop = longest_loop(sass.stdout)
    atomics = Counter(re.findall(r"\s((?:REDG|ATOMG)\.[A-Z0-9_.x]+)", sass.stdout))
    return Resources(int(figures["REG"]), int(figures["STACK"]), compiled.metadata.shared, loop, atomics)


def aligned_arguments(build: KernelBuild) -> list[str]:
    """The arguments a launch marks divisible by 16, as Triton's JIT does (``triton/runtime/jit.py``'s
    specialization: a pointer 16-byte aligned, an integer a multiple of 16, unless the kernel names it
    in ``do_not_specialize``): every pointer, torch's allocations being aligned, and the integers that
    are the head dim or a stride of one head's or one query's rows, multiples of the head dim (64 and
    128 here). Left out, the compiler cannot prove a tile's rows contiguous and aligned: it loads them
    element by element and does not pipeline the loads, so the figures would not be the GPU's."""
    params = {param.name: param for param in build.kernel.params}
    return [
        name
        for name, kind in build.signature.items()
        if kind.startswith("*")
        or (not params[name].do_not_specialize and (name == "dim" or name.endswith(("_head", "_query"))))
    ]


def longest_loop(sass: str) -> Counter[str]:
    """The opcodes (``HGMMA``, ``LDGSTS``, ...), counted, of the instructions from a backward branch's
    target to the branch, the longest such span of ``cuobjdump -sass``'s listing (addressed in bytes):
    a kernel's inner loop, as the compiler laid it out; none where nothing branches back."""
    predicate = r"(?:@!?U?P\w+\s+)?"
    branches = re.findall(rf"/\*([0-9a-f]+)\*/\s+{predicate}BRA\s+0x([0-9a-f]+)", sass)
    spans = [
        (int(target, 16), int(branch, 16)) for branch, target in branches if int(branch, 16) > int(target, 16)
    ]
    if not spans:
        return Counter()
    first, last = max(spans, key=lambda span: span[1] - span[0])
    listing = re.findall(rf"/\*([0-9a-f]+)\*/\s+{predicate}([A-Z][A-Z0-9_]*)", sass)
    return Counter(opcode for address, opcode in listing if first <= int(address, 16) <= last)


def tile_switches(tiles: tuple[int, int, int]) -> list[tuple]:
    """The switches (module, flag, value) that set ``tiles`` (``NEAREST_TILES``' points, centres, warps)
    as the nearest-centre kernel's, and so the Lloyd steps'."""
    flags = ("POINT_TILE", "CENTER_TILE", "NUM_WARPS")
    return [(nearest_kernel, flag, value) for flag, value in zip(flags, tiles, strict=True)]


def tile_builds(head_dim: int, tiles: tuple[int, int, int]) -> list[KernelBuild]:
    """The k-means' bf16x3 compilations for a bf16 cache at ``tiles`` (``tile_switches``): the
    nearest-centre kernel's and the Lloyd steps' (``lloyd_builds``)."""
    with contextlib.ExitStack() as stack:
        for switch in tile_switches(tiles):
            stack.enter_context(mock.patch.object(*switch))
        builds = kernel_builds(head_dim, "bf16")
    return [build for build in builds if build.name == "nearest (bf16x3)" or build.name.startswith("lloyd")]


def tiles_table(arch: int) -> Table:
    """``--tiles``' table: each of ``NEAREST_TILES``' builds (``tile_builds``) at each head dim, and,
    for the scans, the k-means formula's FLOP a warp issues per instruction of the loop."""
    import triton

    title = f"Triton {triton.__version__}: the k-means' bf16x3 kernels by tiles, compiled for sm_{arch}"
    table = Table(title=f"{title} (ptxas, per thread)")
    columns = ("kernel", "head dim", "points x centres", "warps", "registers", "spilled bytes", "shared KiB")
    for column in (*columns, "loop instructions a warp", "formula FLOP a warp-instruction"):
        table.add_column(column, justify="right")
    for head_dim in HEAD_DIMS:
        for points, centers, warps in NEAREST_TILES:
            for build in tile_builds(head_dim, (points, centers, warps)):
                resources = compiled_resources(build, arch)
                # The shared step's longest loop is its members', around the scan.
                scan = build.name.startswith(("nearest", "lloyd assign")) and "shared" not in build.name
                loop_instructions = resources.loop_opcodes.total()
                issued = loop_instructions * warps
                flop = f"{2 * points * centers * head_dim / issued:.0f}" if scan else "-"
                table.add_row(
                    build.name, str(head_dim), f"{points} x {centers}", str(warps), str(resources.registers),
                    str(resources.stack_bytes), f"{resources.shared_bytes / 1024:.0f}",
                    str(loop_instructions), flop,
                )  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, major and minor (90)")
    parser.add_argument("--tiles", action="store_true", help="the k-means' kernels at each of NEAREST_TILES")
    args = parser.parse_args(argv)
    if args.tiles:
        Console(width=200).print(tiles_table(args.arch))
        return
    import triton

    title = f"Triton {triton.__version__} kernels compiled for sm_{args.arch} (ptxas, per thread)"
    table = Table(title=title)
    for column in ("kernel", "head dim", "cache dtype", "warps", "registers", "spilled bytes", "shared KiB"):
        table.add_column(column, justify="right")
    for head_dim in HEAD_DIMS:
        for cache_dtype in CACHE_DTYPES:
            for build in kernel_builds(head_dim, cache_dtype):
                if build.name.startswith(("nearest", "centres' split")) and cache_dtype != "fp32":
                    continue  # the k-means reads fp32 points and centres whatever the cache holds
                resources = compiled_resources(build, args.arch)
                table.add_row(
                    build.name,
                    str(head_dim),
                    cache_dtype,
                    str(build.num_warps),
                    str(resources.registers),
                    str(resources.stack_bytes),
                    f"{resources.shared_bytes / 1024:.0f}",
                )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
