"""Each point's nearest k-means centre in one Triton kernel, the distances never written
(``../shared/design/gpu-path.md``, D6).

``reskv.residual.nearest_centers``' torch path writes the ``[rows, E, r]`` fp32 distances
(``baddbmm``) and reads them back (``argmin``): on a GPU those memory passes, not the products'
FLOPs, take most of the construction's device time above its floor, and at long prompts one layer's
distances take blocks of gigabytes (results/gpu/README.md). Here a program takes a tile of one
row's points, runs over that row's centres a tile at a time with a running minimum, and writes only
the index: one launch per Lloyd step, no distance block.

The rule is the torch path's: ``||c||² + bias - 2<p, c>`` (``center_norms`` holds the first two
terms, ``+inf`` on padding centres), fp32 products in IEEE arithmetic (no TF32, as cuBLAS's default
``baddbmm``), ties to the lower centre index (within a tile the smallest index holding the tile's
minimum; tiles come in increasing order and a later one must be strictly smaller to win). Only the
products' rounding may differ from cuBLAS's, so near ties may go another way on the GPU, as they
may between two BLAS libraries; the CPU keeps the torch path and its bit-identity with the spec's
plain loop.

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

# Tile sizes and warps per program, not timed on a GPU yet: ``scripts.bench.gpu_check
# --compare-paths`` times the construction with this kernel and with the torch path, which decides
# between them. Sized so that ptxas keeps the tiles in registers on sm_90 at head dims 64 and 128
# (``python -m scripts.bench.kernel_resources``; 64 x 64 tiles with 4 warps spill at head dim 128 in
# IEEE fp32).
POINT_TILE = 64
CENTER_TILE = 32
NUM_WARPS = 8
# ``tl.dot``'s input precision. "ieee" is fp32 arithmetic on the CUDA cores, as cuBLAS's fp32
# ``baddbmm``; "tf32x3" (three TF32 tensor-core products, fp32-like accuracy without IEEE bits) is
# the faster candidate should the kernel prove compute-bound, timed by ``--compare-paths`` too.
PRODUCT_PRECISION = "ieee"
# No contraction of a multiply and an add into one FMA outside the product (``norms - 2 * products``
# rounds the same either way, 2x being exact), whatever Triton's default (on up to 3.9, off from 3.10).
FP_FUSION = False


def available() -> bool:
    """Whether Triton is installed (the kernel then runs on CUDA tensors)."""
    return triton is not None


def nearest(points: Tensor, centers: Tensor, center_norms: Tensor) -> Tensor:
    """Index ``[R, E]`` (int64) of each point's nearest centre, as ``reskv.residual.nearest_centers``.

    ``points`` ``[R, E, d]`` and ``centers`` ``[R, r, d]`` fp32 (read contiguous); ``center_norms``
    ``[R, r]``: ``||c||²`` plus the centres' bias, a row's minimum finite.
    """
    num_rows, num_points, dim = points.shape
    points, centers, center_norms = points.contiguous(), centers.contiguous(), center_norms.contiguous()
    nearest_index = torch.empty(num_rows, num_points, dtype=torch.long, device=points.device)
    grid = (num_rows, triton.cdiv(num_points, POINT_TILE))
    _nearest_kernel[grid](
        points,
        centers,
        center_norms,
        nearest_index,
        num_points,
        centers.shape[1],
        dim,
        POINT_TILE=POINT_TILE,
        CENTER_TILE=CENTER_TILE,
        DIM_TILE=max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        PRECISION=PRODUCT_PRECISION,
        num_warps=NUM_WARPS,
        enable_fp_fusion=FP_FUSION,
    )
    return nearest_index


if triton is not None:

    @triton.jit(do_not_specialize=["num_points", "num_centers"])  # one compilation per head dim
    def _nearest_kernel(
        points,
        centers,
        center_norms,
        nearest_index,
        num_points,
        num_centers,
        dim,
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
        best = tl.full([POINT_TILE], float("inf"), tl.float32)
        best_index = tl.zeros([POINT_TILE], tl.int32)
        for start in range(0, num_centers, CENTER_TILE):
            center = start + tl.arange(0, CENTER_TILE)
            center_tile = tl.load(
                centers + (row * num_centers + center[:, None]) * dim + feature[None, :],
                mask=(center[:, None] < num_centers) & (feature[None, :] < dim),
                other=0.0,
            )
            norms = tl.load(
                center_norms + row * num_centers + center, mask=center < num_centers, other=float("inf")
            )
            products = tl.dot(point_tile, tl.trans(center_tile), input_precision=PRECISION)
            distances = norms[None, :] - 2.0 * products
            tile_best = tl.min(distances, axis=1)
            # The tile's first minimum, written out: the interpreter's argmin ignores tie_break_left.
            tile_index = tl.min(
                tl.where(distances == tile_best[:, None], center[None, :], num_centers), axis=1
            )
            better = tile_best < best
            best = tl.where(better, tile_best, best)
            best_index = tl.where(better, tile_index, best_index)
        tl.store(nearest_index + row * num_points + point, best_index.to(tl.int64), mask=point < num_points)
