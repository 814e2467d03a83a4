"""Each point's nearest k-means centre in one Triton kernel, the distances never written
(``../shared/design/gpu-path.md``, D6).

``reskv.residual.nearest_centers``' torch path writes the ``[rows, E, r]`` fp32 distances
(``baddbmm``) and reads them back (``argmin``): on a GPU those memory passes, not the products'
FLOPs, take most of the construction's device time above its floor, and at long prompts one layer's
distances take blocks of gigabytes (results/gpu/README.md). Here a program takes a tile of one
row's points, runs over that row's centres a tile at a time with a running minimum, and writes only
the index: one launch per Lloyd step, no distance block. Given each row's own point count and size
(a k-means group's rows padded to its largest), it runs over those alone: padding costs no product.

The rule is the torch path's: ``||c||² + bias - 2<p, c>`` (``center_norms`` holds the first two
terms, ``+inf`` on padding centres), ties to the lower centre index: each column of the tiles keeps
its first minimum (tiles come in increasing order and a later one must be strictly smaller to win),
and after the scan the row takes the lowest index among the columns holding its minimum. No
reduction across a tile's columns runs in the loop, where it would take shuffles and, between
warpgroups, barriers. The products ``<p, c>`` run in one of three forms (``PRECISION``):

- ``"ieee"``: fp32 arithmetic on the CUDA cores, as cuBLAS's fp32 ``baddbmm`` (no TF32);
- ``"tf32x3"``: three TF32 tensor-core products, fp32-like accuracy;
- ``"bf16x3"``, only where every point is a bf16 value (the keys of a bf16 model, upcast): an fp32
  centre is split exactly into three parts of bf16 precision (``c = high + middle + low``: 8
  significant bits each, 24 in all, fp32's), and ``<p, c> = <p, low> + <p, middle> + <p, high>``
  runs as three tensor-core products whose every term ``p_i c_i`` is exact in their fp32
  accumulators. Their operands are bf16, or TF32 (``SPLIT_OPERANDS``), which holds 8-bit values
  exactly too, at half bf16's rate; Triton's interpreter multiplies bf16 operands wrongly, so the
  CPU tests run the split with TF32 operands. The centres are split once, not in every program's
  loop (``split_centers``; the Lloyd steps' centre updates write their parts too). The loop then
  loads the parts straight into the products' operands and converts nothing; the compiler copies
  the parts into shared memory ahead of the products, and a warp issues fewer instructions a tile
  (results/README.md, the k-means' scan).

Only the products' summation order and the accumulators' rounding differ from cuBLAS's, so near
ties may go another way on the GPU, as they may between two BLAS libraries; the CPU keeps the torch
path and its bit-identity with the spec's plain loop.

Triton is optional: without it (a CPU install) ``available`` is false and the torch path runs.
Tested on CPU under ``TRITON_INTERPRET=1`` (tests/test_reskv_invariants.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Tile sizes and warps per program, sized so that ptxas keeps the tiles in registers on sm_90 at head
# dims 64 and 128 (``python -m scripts.bench.kernel_resources``; 64 x 64 tiles with 4 warps spill at
# head dim 128 in IEEE fp32); not tuned for the tensor-core forms, whose candidates the GPU check's
# ``tiles`` stage times (``scripts.bench.kernel_resources.NEAREST_TILES``). ``reskv.lloyd_kernel``'s
# scan takes them too.
POINT_TILE = 64
CENTER_TILE = 32
NUM_WARPS = 8
# Which form runs (``precision``), as ``python -m scripts.bench.gpu_check.first --stages nearest``
# measured on an H200 (results/gpu/README.md): points that are all bf16 values take "bf16x3"
# (``BF16_SPLIT``), faster than the torch path; other points take ``PRODUCT_PRECISION``, where
# ``None`` leaves them to ``reskv.residual``'s torch path, which was faster than "ieee" and as fast as
# "tf32x3" there.
BF16_SPLIT = True
PRODUCT_PRECISION: str | None = None
PRECISIONS = ("ieee", "tf32x3", "bf16x3")
# The operands of "bf16x3"'s three products: "bf16" or "tf32" (the module docstring).
SPLIT_OPERANDS = "bf16"
# No contraction of a multiply and an add into one FMA outside the product (``norms - 2 * products``
# rounds the same either way, 2x being exact), whatever Triton's default (on up to 3.9, off from 3.10).
FP_FUSION = False


def available() -> bool:
    """Whether Triton is installed (the kernel then runs on CUDA tensors)."""
    return triton is not None


def precision(points_in_bf16: bool) -> str | None:
    """The products' form (``PRECISIONS``) for points that are, or may not be, all bf16 values; ``None``
    where the kernel does not run for them (the torch path does)."""
    return "bf16x3" if points_in_bf16 and BF16_SPLIT else PRODUCT_PRECISION


def nearest(
    points: Tensor,
    centers: Tensor,
    center_norms: Tensor,
    form: str,
    split_operands: str | None = None,
    extents: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Index ``[R, E]`` (int64) of each point's nearest centre, as ``reskv.residual.nearest_centers``.

    ``points`` ``[R, E, d]`` and ``centers`` ``[R, r, d]`` fp32 (read contiguous); ``center_norms``
    ``[R, r]``: ``||c||²`` plus the centres' bias, a row's minimum finite. ``form``: the products'
    (``PRECISIONS``; ``"bf16x3"`` only where every point is a bf16 value, the centres then split by
    ``split_centers`` first), whose split operands are ``split_operands`` (``SPLIT_OPERANDS`` when
    ``None``). ``extents``, each row's points and centres ``[R]`` each (int64) where rows are padded to
    a group's ``E`` and ``r``: a program then scans only its row's own centres, and a tile wholly past
    its row's points none (their index is 0), so a group's padding costs no products.
    """
    if form not in PRECISIONS:
        raise ValueError(f"unknown product form {form!r}; choose one of {list(PRECISIONS)}")
    num_rows, num_points, dim = points.shape
    points, centers, center_norms = points.contiguous(), centers.contiguous(), center_norms.contiguous()
    scanned = centers
    if form == "bf16x3":
        scanned = split_centers(centers, split_operands)
    nearest_index = torch.empty(num_rows, num_points, dtype=torch.long, device=points.device)
    grid = (num_rows, triton.cdiv(num_points, POINT_TILE))
    point_counts, center_counts = extents if extents is not None else (nearest_index, nearest_index)
    _nearest_kernel[grid](
        points,
        scanned,
        center_norms,
        nearest_index,
        point_counts.contiguous(),
        center_counts.contiguous(),
        num_points,
        centers.shape[1],
        dim,
        HAS_EXTENTS=extents is not None,
        POINT_TILE=POINT_TILE,
        CENTER_TILE=CENTER_TILE,
        DIM_TILE=max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        PRECISION=form,
        num_warps=NUM_WARPS,
        enable_fp_fusion=FP_FUSION,
    )
    return nearest_index


def parts_dtype(split_operands: str | None = None) -> torch.dtype:
    """The dtype of the centres' split whose products take ``split_operands`` (``SPLIT_OPERANDS`` when
    ``None``): bf16, or fp32 for TF32 operands."""
    return torch.bfloat16 if (split_operands or SPLIT_OPERANDS) == "bf16" else torch.float32


def empty_parts(centers: Tensor, split_operands: str | None) -> Tensor:
    """Room for ``centers``' (``[R, r, d]``) split: ``[R, 3, r, d]``, in ``parts_dtype(split_operands)``."""
    num_rows, num_centers, dim = centers.shape
    dtype = parts_dtype(split_operands)
    return torch.empty(num_rows, 3, num_centers, dim, dtype=dtype, device=centers.device)


def split_centers(centers: Tensor, split_operands: str | None) -> Tensor:
    """``centers`` ``[R, r, d]`` (fp32, contiguous) split exactly into three parts of bf16 precision
    (module docstring), ``[R, 3, r, d]``, the smallest first, in ``parts_dtype(split_operands)``: one
    launch, so that no program of the scan splits them again."""
    num_rows, num_centers, dim = centers.shape
    parts = empty_parts(centers, split_operands)
    _split_kernel[(num_rows, triton.cdiv(num_centers, CENTER_TILE))](
        centers,
        parts,
        num_centers,
        dim,
        CENTER_TILE=CENTER_TILE,
        DIM_TILE=max(16, triton.next_power_of_2(dim)),
    )
    return parts


if triton is not None:

    @triton.jit
    def write_parts(parts, at, tile, mask, part_stride):
        """fp32 centres ``tile`` split exactly into three parts of bf16 precision (module docstring),
        written at ``at`` of ``parts``' three planes ``part_stride`` apart, the smallest first, in
        ``parts``' dtype (bf16 or fp32: either holds an 8-bit value exactly). Exact whatever the casts'
        rounding (the interpreter truncates): each part is the top 8 bits of what the larger left."""
        high = tile.to(tl.bfloat16).to(tl.float32)
        rest = tile - high
        middle = rest.to(tl.bfloat16).to(tl.float32)
        dtype = parts.dtype.element_ty
        tl.store(parts + at, (rest - middle).to(dtype), mask=mask)
        tl.store(parts + part_stride + at, middle.to(dtype), mask=mask)
        tl.store(parts + 2 * part_stride + at, high.to(dtype), mask=mask)

    @triton.jit
    def row_parts(parts, row, num_centers, dim):
        """Row ``row``'s three planes of the centres' split ``[R, 3, r, d]`` (``empty_parts``)."""
        return parts + row * 3 * num_centers * dim

    @triton.jit
    def scanned_row(scanned, row, num_centers, dim, PRECISION: tl.constexpr):
        """Row ``row`` of what a scan in ``PRECISION`` reads: the three planes of the centres' split
        ``[R, 3, r, d]`` in ``"bf16x3"``, the centres ``[R, r, d]`` otherwise."""
        if PRECISION == "bf16x3":
            at = row_parts(scanned, row, num_centers, dim)
        else:
            at = scanned + row * num_centers * dim
        return at

    @triton.jit(do_not_specialize=["num_centers"])
    def _split_kernel(centers, parts, num_centers, dim, CENTER_TILE: tl.constexpr, DIM_TILE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        center = tl.program_id(1) * CENTER_TILE + tl.arange(0, CENTER_TILE)
        feature = tl.arange(0, DIM_TILE)
        at = center[:, None] * dim + feature[None, :]
        mask = (center[:, None] < num_centers) & (feature[None, :] < dim)
        tile = tl.load(centers + row * num_centers * dim + at, mask=mask)
        write_parts(row_parts(parts, row, num_centers, dim), at, tile, mask, num_centers * dim)

    @triton.jit
    def split_product(point_tile, part, accumulator):
        """``point_tile @ part.T (+ accumulator)`` of 8-bit values in bf16 or fp32 (TF32 operands),
        exact, on the tensor cores."""
        if part.dtype == tl.bfloat16:
            return tl.dot(point_tile, tl.trans(part), accumulator)
        return tl.dot(point_tile, tl.trans(part), accumulator, input_precision="tf32")

    @triton.jit
    def nearest_in_row(
        point_tile,
        centers,
        center_norms,
        num_centers,
        first,
        scanned,
        dim,
        feature,
        POINT_TILE: tl.constexpr,
        CENTER_TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """The distance (fp32, ``+inf`` where none is scanned) and index (int32) of each of
        ``point_tile``'s points' nearest centre among one row's centres ``first`` to ``scanned``
        (``centers`` ``[num_centers, dim]`` fp32, for ``"bf16x3"`` their parts ``[3, num_centers, dim]``
        from ``write_parts``, and their ``center_norms``, the row's), by the rule and in the
        ``PRECISION`` of the module docstring: the centres a tile at a time, a running minimum, no
        distance written."""
        # Each column's first minimum (module docstring), the columns reduced after the scan.
        best = tl.full([POINT_TILE, CENTER_TILE], float("inf"), tl.float32)
        best_center = tl.zeros([POINT_TILE, CENTER_TILE], tl.int32)
        operands = point_tile.to(centers.dtype.element_ty)  # the parts' dtype; fp32 otherwise
        part_stride = num_centers * dim
        for start in range(first, scanned, CENTER_TILE):
            center = start + tl.arange(0, CENTER_TILE)
            at = center[:, None] * dim + feature[None, :]
            mask = (center[:, None] < scanned) & (feature[None, :] < dim)
            norms = tl.load(center_norms + center, mask=center < scanned, other=float("inf"))
            if PRECISION == "bf16x3":  # the parts, smallest first (module docstring)
                low = tl.load(centers + at, mask=mask, other=0.0)
                products = split_product(operands, low, None)
                middle = tl.load(centers + part_stride + at, mask=mask, other=0.0)
                products = split_product(operands, middle, products)
                high = tl.load(centers + 2 * part_stride + at, mask=mask, other=0.0)
                products = split_product(operands, high, products)
            else:
                center_tile = tl.load(centers + at, mask=mask, other=0.0)
                products = tl.dot(operands, tl.trans(center_tile), input_precision=PRECISION)
            distances = norms[None, :] - 2.0 * products
            better = distances < best
            best = tl.where(better, distances, best)
            best_center = tl.where(better, center[None, :], best_center)
        nearest = tl.min(best, axis=1)
        # The first minimum: the lowest centre among the columns holding it, written out (the
        # interpreter's argmin ignores tie_break_left).
        return nearest, tl.min(tl.where(best == nearest[:, None], best_center, num_centers), axis=1)

    @triton.jit(do_not_specialize=["num_points", "num_centers"])  # one compilation per head dim
    def _nearest_kernel(
        points,
        centers,
        center_norms,
        nearest_index,
        point_counts,
        center_counts,
        num_points,
        num_centers,
        dim,
        HAS_EXTENTS: tl.constexpr,
        POINT_TILE: tl.constexpr,
        CENTER_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * num_points * dim passes 2^31 at long prompts
        point = tl.program_id(1) * POINT_TILE + tl.arange(0, POINT_TILE)
        feature = tl.arange(0, DIM_TILE)
        point_tile = tl.load(
            points + (row * num_points + point[:, None]) * dim + feature[None, :],
            mask=(point[:, None] < num_points) & (feature[None, :] < dim),
            other=0.0,
        )
        scanned = num_centers
        if HAS_EXTENTS:  # the row's own centres; none for a tile of its padding points
            own = tl.minimum(tl.load(center_counts + row).to(tl.int32), num_centers)
            scanned = tl.where(tl.program_id(1) * POINT_TILE < tl.load(point_counts + row), own, 0)
        row_centers = scanned_row(centers, row, num_centers, dim, PRECISION)  # ``split_centers``' in bf16x3
        _, best_index = nearest_in_row(
            point_tile, row_centers, center_norms + row * num_centers, num_centers, 0, scanned, dim, feature,
            POINT_TILE, CENTER_TILE, PRECISION,
        )  # fmt: skip
        tl.store(nearest_index + row * num_points + point, best_index.to(tl.int64), mask=point < num_points)
