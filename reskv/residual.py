"""Residual entries: k-means summaries (mean key, mean value, count) of evicted tokens (Eq. summary).

Batched over KV heads with padding: heads evict different numbers of tokens (AdaKV) and get
different residual sizes (validation proxy), so points and centres carry validity masks and
unused slots end with ``log_count = -inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from reskv.config import DEVICE_MEMORY_SHARE
from reskv.selection import gather_rows, token_rows, uploaded

# Bound on the k-means distance block (fp32 bytes) on CPU, so transient memory does not grow with
# s * r: one layer's clustering then holds mostly its fp32 points (its peak at Llama-3.1-8B's shape
# and 32K tokens is measured by ``scripts.bench.engine.kmeans_peak_memory``). 4 MiB is also the
# fastest block on CPU: larger blocks are fresh pages on every call, smaller ones make the GEMMs thin.
# The block size changes no bit of the result (tests/test_reskv_invariants.py).
DISTANCE_CHUNK_BYTES = 4 << 20
# BLOCK_LAYOUT: a block is whole rows (a row: one head's [E, r] distances) while a row fits, so a
# block's GEMMs are never thin (slices of several rows' points make them thin, and slower on CPU).
# On CUDA the block is ``reskv.config.DEVICE_MEMORY_SHARE`` of the device's memory.


# Rows of different sizes clustered in one call are padded to the largest size and point count
# (``pads_within``). On CPU, where distance FLOPs cost the time, rows are split into groups whose
# padded distances stay within this factor of their own (AdaKV's ragged heads padded into one group
# per grid level would compute mostly padding).
CPU_PADDING_TOLERANCE = 1.25
# On CUDA a group costs the host its launches whatever its size (about 45: four Lloyd steps of the
# nearest-centre kernel, the sums, counts and update, and the gathers; ~20 us each) and, where the
# nearest centres are the torch path's, the device its padded distances. A group then takes rows of
# one level while the distances they pad (points x centres) stay under what a group's launches cost:
# 45 x 20 us at the nearest-centre kernel's 24.6 TFLOP/s (results/gpu/README.md) is ~2.2e10 FLOP, 2e7
# points x centres at a head dim of 128 over 4 Lloyd steps (2 x 128 x 4 FLOP each); a uniform level
# stays one group.
CUDA_PADDING_SLACK = 20_000_000
# Where ``reskv.nearest_kernel`` finds the nearest centres (``nearest_skips_padding``) it scans each
# row's own points and centres only, so padding costs no products; a padded point still costs its
# share of the group's passes over ``[rows, E, d]``: the keys and the values gathered, upcast and
# weighed, each Lloyd step's sums and the values' (about 52 d bytes, 6.7 KB at a head dim of 128,
# ~2 ns at 3 TB/s). A group then takes rows of every level (``level_row_groups``) while the points it
# pads stay under what a group's ~45 launches cost (~0.9 ms): ~400,000 padded points.
CUDA_PADDED_POINTS_SLACK = 400_000
# Find each point's nearest centre by ``first_minimum``'s vectorised passes on CPU (a GPU's layout,
# as ``scripts.bench.construction_counts`` counts it, uses ``argmin``).
CPU_VECTORISED_ARGMIN = True
# On CUDA with Triton installed, find the nearest centres by ``reskv.nearest_kernel`` (the distances
# never written: no distance blocks, one launch per Lloyd step) where it has a form for the points
# (``nearest_kernel.precision``: bf16 keys' on tensor cores); off, or for other points, by the torch
# path below.
CUDA_FUSED_NEAREST = True
# On CUDA with Triton, run each k-means group's Lloyd steps as ``reskv.lloyd_kernel`` where the nearest
# centres of the keys have a kernel form (``nearest_kernel_form``: bf16 keys): its points read by index
# from the keys and values (no fp32 copy of them), a zeroed scratch and 1 + 2 x iterations launches a
# group (10 ops) where the torch path launches ~86 (``scripts.bench.grid_constructions --fused-lloyd``
# counts both). Off until a GPU has checked and timed it (``scripts.bench.gpu_check.first``'s kernels
# and profile stages).
CUDA_FUSED_LLOYD = False
# On CUDA, sum each cluster's points by ``sorted_cluster_sums`` (a sort and a segment sum, in point
# order: the same sums from run to run) instead of ``index_add_``'s atomics, a visible share of the
# construction's device time on a GPU (results/gpu/README.md). Off until a GPU has timed it
# (``scripts.bench.gpu_check --compare-paths``): it costs 4 more ops per call, which a GPU's host
# pays where the device may not gain them back.
CUDA_SORTED_CLUSTER_SUMS = False
# On CPU the distances of a k-means step are computed over a whole number of 8-centre widths: MKL's
# product and ``amin`` both slow down on a ragged width, more than the padding costs. Padding
# centres have norm +inf, so they never win, and the real centres' distances keep every bit: checked
# for widths 12-139, 1-32 rows of 40-7300 points, head dims 64 and 128. Narrower products MKL
# computes in blocks of 4 columns whose sums round by the width (7 centres padded to 8 or to 16 round
# differently from 7 alone), so on CPU a row of fewer centres is never padded: not here, and not
# into a group of wider rows (``padded_groups``; padding would change which of two tied centres a
# point takes, tests/test_construction_plan.py).
CPU_DISTANCE_WIDTH_MULTIPLE = 8
CPU_NARROWEST_PADDED_WIDTH = 12


def pads_within(padded: int, own: int, device: torch.device) -> bool:
    """Whether a k-means group whose rows hold ``own`` points x centres may run padded to ``padded`` on
    ``device``: on CPU within ``CPU_PADDING_TOLERANCE`` times its own, on CUDA within
    ``CUDA_PADDING_SLACK`` more."""
    if device.type == "cuda":
        return padded - own <= CUDA_PADDING_SLACK
    return padded <= CPU_PADDING_TOLERANCE * own


def nearest_kernel_form(device: torch.device, points_in_bf16: bool) -> str | None:
    """The product form (``reskv.nearest_kernel.PRECISIONS``) in which ``reskv.nearest_kernel`` finds
    the nearest centres of points on ``device`` (all bf16 values, or not): on CUDA with Triton and
    ``CUDA_FUSED_NEAREST``, where the kernel has a form for them; ``None`` where the torch path runs."""
    if device.type != "cuda" or not CUDA_FUSED_NEAREST:
        return None
    from reskv import nearest_kernel  # imports Triton (slow to import), which the CPU never runs

    return nearest_kernel.precision(points_in_bf16) if nearest_kernel.available() else None


def nearest_skips_padding(keys: Tensor) -> bool:
    """Whether the nearest-centre step of points gathered from ``keys`` runs ``reskv.nearest_kernel``
    (``nearest_kernel_form``), which scans each row's own points and centres only."""
    return nearest_kernel_form(keys.device, keys.dtype == torch.bfloat16) is not None


def fused_lloyd_form(keys: Tensor) -> str | None:
    """The product form in which ``reskv.lloyd_kernel`` clusters points of ``keys`` (``CUDA_FUSED_LLOYD``
    and the nearest-centre kernel's form for them, ``nearest_kernel_form``); ``None``: the torch path."""
    if not CUDA_FUSED_LLOYD:
        return None
    return nearest_kernel_form(keys.device, keys.dtype == torch.bfloat16)


def distance_block_bytes(device: torch.device) -> int:
    """The k-means distance block for ``device``: ``DISTANCE_CHUNK_BYTES`` on CPU, a
    ``DEVICE_MEMORY_SHARE`` of the device's memory on CUDA (as ``reskv.batching`` sets aside)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // DEVICE_MEMORY_SHARE
    return DISTANCE_CHUNK_BYTES


def distance_width(num_centers: int, device: torch.device) -> int:
    """Centres per row the k-means distances are computed over on ``device``: on CPU from
    ``CPU_NARROWEST_PADDED_WIDTH`` on, ``num_centers`` rounded up to ``CPU_DISTANCE_WIDTH_MULTIPLE``."""
    if device.type == "cuda" or num_centers < CPU_NARROWEST_PADDED_WIDTH:
        return num_centers
    return -(-num_centers // CPU_DISTANCE_WIDTH_MULTIPLE) * CPU_DISTANCE_WIDTH_MULTIPLE


@dataclass
class ResidualEntries:
    """``r_max`` slots per KV head; a slot with ``log_counts == -inf`` is unused."""

    keys: Tensor  # [H_kv, r_max, d]
    values: Tensor  # [H_kv, r_max, d]
    log_counts: Tensor  # [H_kv, r_max] fp32

    @property
    def entries_per_head(self) -> Tensor:
        return torch.isfinite(self.log_counts).sum(dim=-1)

    def fields(self) -> tuple[Tensor, Tensor, Tensor]:
        """Keys, values and log-counts, the order the constructor takes them."""
        return self.keys, self.values, self.log_counts

    @classmethod
    def empty(cls, num_heads: int, like: Tensor) -> ResidualEntries:
        none = like.new_zeros(num_heads, 0, like.shape[-1])
        return cls(none, none.clone(), torch.zeros(num_heads, 0, device=like.device))


def flat_cluster_index(assignments: Tensor, row_offsets: Tensor) -> Tensor:
    """One flat index over (row, cluster), ``row_offsets`` ``[R, 1]`` being ``r * row``: one
    ``index_add_`` then sums every row, far cheaper than a scatter over ``d``."""
    return (assignments + row_offsets).reshape(-1)


def cluster_sums(weighted_points: Tensor, flat_index: Tensor, num_centers: int) -> Tensor:
    """Per-cluster sums ``[R, r, d]`` of points ``[R, E, d]`` at ``flat_index`` (``flat_cluster_index``).

    Padding points must be zero (``weighted_points`` are the points times their 0/1 weight), so
    they add nothing wherever they are assigned. ``index_add_`` accumulates in a fixed order on
    CPU, so results are bit-for-bit reproducible; on CUDA with ``CUDA_SORTED_CLUSTER_SUMS`` the sums are
    ``sorted_cluster_sums``' instead.
    """
    num_rows, _, dim = weighted_points.shape
    if weighted_points.is_cuda and CUDA_SORTED_CLUSTER_SUMS:
        return sorted_cluster_sums(weighted_points, flat_index, num_centers)
    sums = weighted_points.new_zeros(num_rows * num_centers, dim)
    return sums.index_add_(0, flat_index, weighted_points.reshape(-1, dim)).reshape(
        num_rows, num_centers, dim
    )


def sorted_cluster_sums(weighted_points: Tensor, flat_index: Tensor, num_centers: int) -> Tensor:
    """``cluster_sums`` without atomics: the points sorted by cluster (stable, so each cluster's in
    their own order) and summed per segment, each segment in sequence. On CUDA ``index_add_`` adds a
    point's ``d`` values by atomics, many points onto few clusters, in an order that changes from run
    to run; this sums every cluster in point order, as CPU ``index_add_`` does (the same bits on
    CPU). ``unsafe``: the segment lengths are counted here, so ``segment_reduce`` need not check them
    (which reads the device)."""
    num_rows, _, dim = weighted_points.shape
    order = flat_index.sort(stable=True).indices
    every_point = torch.ones_like(flat_index).reshape(num_rows, -1)  # padding points too: all are sorted
    lengths = cluster_counts(every_point, flat_index, num_centers).reshape(-1)
    sorted_points = weighted_points.reshape(-1, dim).index_select(0, order)
    sums = torch.segment_reduce(sorted_points, "sum", lengths=lengths, unsafe=True)
    return sums.reshape(num_rows, num_centers, dim)


def cluster_counts(weights: Tensor, flat_index: Tensor, num_centers: int) -> Tensor:
    """Members ``[R, r]`` of each cluster: the weights (1 valid, 0 padding) summed per cluster."""
    counts = weights.new_zeros(weights.shape[0] * num_centers)
    return counts.index_add_(0, flat_index, weights.reshape(-1)).reshape(weights.shape[0], num_centers)


def row_offsets(num_rows: int, num_centers: int, device: torch.device) -> Tensor:
    """``r * row`` ``[R, 1]``, for ``flat_cluster_index``."""
    return torch.arange(0, num_rows * num_centers, num_centers, device=device)[:, None]


def nearest_centers(
    points: Tensor,
    centers: Tensor,
    chunk_bytes: int,
    center_bias: Tensor | None = None,
    points_in_bf16: bool = False,
    extents: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Index ``[R, E]`` of each point's nearest centre by squared Euclidean distance.

    ``||c||² - 2<p, c>`` (the point's own norm does not change the argmin); ties go to the lower
    centre index. ``center_bias`` ``[R, r]`` (0, or ``+inf`` on a row's padding centres, which then
    never win) lets rows with fewer centres share one call; on CPU padding centres also round the
    width up (``distance_width``). On CUDA with Triton, ``reskv.nearest_kernel`` finds them in one
    pass (``CUDA_FUSED_NEAREST``) where ``points_in_bf16`` says every point is a bf16 value (the keys
    of a bf16 model), on tensor cores, each row over its own ``extents`` (points and centres ``[R]``
    each; a padding point's index may then be 0, where padding weighs nothing). Otherwise the
    ``[R, E, r]`` distances are computed in blocks holding at most ``chunk_bytes`` of fp32, so
    transient memory stays bounded whatever ``s`` and ``r``: whole rows while a row fits
    (``BLOCK_LAYOUT``), else slices of one row's points.
    """
    num_rows, num_points, _ = points.shape
    center_norms = (centers * centers).sum(-1)
    if center_bias is not None:
        center_norms.add_(center_bias)
    form = nearest_kernel_form(points.device, points_in_bf16)
    if form is not None:
        from reskv import nearest_kernel

        return nearest_kernel.nearest(points, centers, center_norms, form, extents=extents)
    width = distance_width(centers.shape[1], points.device)
    if width > centers.shape[1]:  # padding centres at the origin with norm +inf (distance_width)
        padding = width - centers.shape[1]
        centers = F.pad(centers, (0, 0, 0, padding))
        center_norms = F.pad(center_norms, (0, padding), value=math.inf)
    point_bytes = 4 * max(width, 1)  # one point's distances
    rows_per_block = max(1, chunk_bytes // (num_points * point_bytes))
    chunk = num_points if rows_per_block > 1 else max(1, chunk_bytes // point_bytes)
    center_norms, centers_t = center_norms[:, None, :], centers.transpose(1, 2)
    if rows_per_block >= num_rows and chunk >= num_points:
        return first_minimum(torch.baddbmm(center_norms, points, centers_t, alpha=-2)).long()
    nearest = torch.empty(num_rows, num_points, dtype=torch.long, device=points.device)
    for row in range(0, num_rows, rows_per_block):
        rows = slice(row, row + rows_per_block)
        for start in range(0, num_points, chunk):
            part = points[rows, start : start + chunk]
            distances = torch.baddbmm(center_norms[rows], part, centers_t[rows], alpha=-2)
            nearest[rows, start : start + chunk] = first_minimum(distances)
    return nearest


def first_minimum(distances: Tensor) -> Tensor:
    """``distances.argmin(-1)``: each row's smallest value's index, ties to the lower index; ``distances``
    (finite or ``+inf``, a row's minimum finite) is overwritten.

    On CPU (``CPU_VECTORISED_ARGMIN``) an index reduction is a scalar loop, while ``amin`` and
    elementwise passes are vectorised, so these passes take less time than ``argmin``. ``d > min``
    marks the losers, written as 1.0 and 0.0 over the distances (one pass where ``sign(d - min)``
    takes two); index ``j`` plus ``r`` for a loser leaves the first minimum's index the smallest value
    (exact: indices are far below 2^24). Returned as fp32 on CPU, to be written into an index tensor.
    On CUDA ``argmin`` is one launch, and launches are what the host pays for there."""
    if distances.is_cuda or not CPU_VECTORISED_ARGMIN:
        return distances.argmin(-1)
    num_centers = distances.shape[-1]
    losers = distances.gt_(distances.amin(-1, keepdim=True))
    indices = torch.arange(num_centers, dtype=distances.dtype, device=distances.device)
    return torch.add(indices, losers, alpha=num_centers, out=losers).amin(-1)


def lloyd_assignments(
    points: Tensor,
    weights: Tensor,
    centers: Tensor,
    iterations: int,
    center_bias: Tensor | None = None,
    points_in_bf16: bool = False,
    extents: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Cluster of every point after ``iterations`` Lloyd steps (assign, then move centres to means),
    as a ``flat_cluster_index`` (``r * row + cluster``, what summing other per-point data by cluster
    takes), with the last step's per-cluster sums ``[R, r, d]`` and counts ``[R, r]`` (the entries
    are their means, so they are not summed twice).

    With the init ordered by score, ties in ``nearest_centers`` make the better-scored of two
    identical centres win and the other end empty. A centre that loses all its points keeps its
    position. ``points`` ``[R, E, d]`` fp32, zero where ``weights`` is 0; ``centers`` ``[R, r, d]``;
    ``center_bias``, ``points_in_bf16`` and ``extents`` as in ``nearest_centers``; ``iterations >= 1``.
    """
    centers = centers.float()
    block, num_centers = distance_block_bytes(points.device), centers.shape[1]
    offsets = row_offsets(points.shape[0], num_centers, points.device)
    for step in range(iterations):
        assignments = nearest_centers(points, centers, block, center_bias, points_in_bf16, extents)
        flat_index = flat_cluster_index(assignments, offsets)
        sums, counts = (
            cluster_sums(points, flat_index, num_centers),
            cluster_counts(weights, flat_index, num_centers),
        )
        if step + 1 < iterations:  # the last step's means are the entries: the caller divides once
            # An empty cluster's 0 / 0 is discarded by the where: no clamp of the counts (one op fewer
            # per step, each op a fixed host cost on a GPU).
            centers = torch.where(counts[..., None] > 0, sums / counts[..., None], centers)
    return flat_index, sums, counts


@dataclass(frozen=True)
class RowGroup:
    """Rows clustered in one padded k-means, with the host's bounds of their shapes (so no shape is
    read back from the device): the largest residual size and point count among them, and whether
    every row has ``max_size`` entries (then no centre is padding)."""

    rows: list[int]
    max_size: int
    max_points: int
    equal_sizes: bool


def build_residual(
    keys: Tensor,
    values: Tensor,
    evicted: Tensor,
    scores: Tensor,
    sizes: Tensor,
    iterations: int,
    row_groups: list[RowGroup] | None = None,
) -> ResidualEntries:
    """Summarise each row's evicted tokens into ``sizes[i]`` entries (reskv.md, Residual entries).

    ``keys``/``values`` are ``[H, s, d]``; ``evicted``, ``scores`` and ``sizes`` have ``R`` rows,
    row ``i`` reading head ``i % H`` (layers or candidates stacked along the head dimension).

    Lloyd k-means on keys, initialised deterministically from the ``sizes[i]`` evicted keys with
    the highest scores (ties toward the lower position); ``sizes`` is capped at ``|E|``. Entry
    ``j`` stores the mean key, mean value and ``log(count)`` of its cluster; empty clusters are
    dropped (``log_count = -inf``), so their slot never receives softmax mass.

    ``row_groups`` says which rows are clustered together; the engine's plan passes them from host
    integers, so nothing here waits for the device. Without them, sizes and point counts are read
    back (one sync) and grouped by ``padded_groups``.
    """
    rows = evicted.shape[0]
    evicted_counts = evicted.sum(dim=-1)
    sizes = torch.minimum(sizes.to(keys.device), evicted_counts)
    if row_groups is None:
        host_sizes, host_counts = torch.stack([sizes, evicted_counts]).tolist()
        with_entries = [row for row, size in enumerate(host_sizes) if size]
        row_groups = level_row_groups([with_entries], host_sizes, host_counts, keys)
    # Evicted tokens first, best score first (stable: ties toward the lower position); each row's
    # first ``sizes[i]`` of them are its initial centres.
    ranked = torch.where(evicted, scores.float(), float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    heads = torch.arange(rows, device=keys.device) % keys.shape[0]
    return cluster_rows(keys, values, heads, order, None, evicted_counts, sizes, row_groups, iterations)


def padded_groups(
    rows: list[int],
    sizes: list[int],
    point_counts: list[int],
    device: torch.device,
    point_capacity: int | None = None,
) -> list[RowGroup]:
    """``rows`` (host ints, each with entries: ``0 < sizes[i] <= point_counts[i]``) as few k-means
    groups as keep each group's padded distances (rows x largest size x most points) within what
    ``pads_within`` allows on ``device``; or, given a ``point_capacity`` (where the nearest-centre step
    skips padding: ``level_row_groups``), its padded points within ``CUDA_PADDED_POINTS_SLACK`` and
    all its points (rows x most points) within that capacity. Rows are taken largest size first. On
    CPU a row of fewer than ``CPU_NARROWEST_PADDED_WIDTH`` centres joins rows of its own size only."""
    padding_free = point_capacity is not None
    narrow = 0 if device.type == "cuda" or padding_free else CPU_NARROWEST_PADDED_WIDTH
    groups, current = [], []
    most_points = own_points = own_distances = 0  # of ``current``
    for row in sorted(rows, key=lambda row: (-sizes[row], -point_counts[row], row)):
        held = (len(current) + 1) * max(most_points, point_counts[row])
        if padding_free:
            padded = held - own_points - point_counts[row]
            fits = padded <= CUDA_PADDED_POINTS_SLACK and held <= point_capacity
        else:
            distances = own_distances + sizes[row] * point_counts[row]
            fits = pads_within(held * sizes[current[0] if current else row], distances, device)
        narrow_beside_wider = current and sizes[row] < narrow and sizes[row] != sizes[current[0]]
        if current and (narrow_beside_wider or not fits):
            groups.append(current)
            current, most_points, own_points, own_distances = [], 0, 0, 0
        current.append(row)
        most_points = max(most_points, point_counts[row])
        own_points += point_counts[row]
        own_distances += sizes[row] * point_counts[row]
    groups.append(current)
    return [row_group(group, sizes, point_counts) for group in groups if group]


def row_group(rows: list[int], sizes: list[int], point_counts: list[int]) -> RowGroup:
    """``rows`` (largest size first) as one ``RowGroup``."""
    most_points = max(point_counts[row] for row in rows)
    return RowGroup(rows, sizes[rows[0]], most_points, equal_sizes=sizes[rows[0]] == sizes[rows[-1]])


def scratch_groups(
    rows: list[int],
    sizes: list[int],
    point_counts: list[int],
    keys: Tensor,
    families: Sequence[Sequence[int]] = (),
) -> list[RowGroup]:
    """``rows`` as the k-means groups ``reskv.lloyd_kernel`` clusters (``fused_lloyd_form``). It reads
    the points in place and skips each row's padding, so a group takes rows of every level while what it
    holds (rows x largest size x ``lloyd_kernel.bytes_a_centre``: the clusters' sums and counts, the
    centres, their split and norms) fits the memory planned for the points' fp32 copy that it does not
    make (``padding_free_capacity`` points of ``d`` fp32). Rows are taken largest size first, a family
    of ``families`` (rows whose first step the kernel shares, its largest last: ``cluster_rows``) with
    its largest, whole."""
    from reskv import lloyd_kernel  # imports Triton, which only the kernel's form runs

    dim = keys.shape[-1]
    capacity = padding_free_capacity(keys) * dim * 4  # bytes: the points of d fp32
    held_a_centre = lloyd_kernel.bytes_a_centre(dim, fused_lloyd_form(keys))
    family_of = {row: list(members) for members in families for row in members}
    units = [family_of.get(row, [row]) for row in rows if family_of.get(row, [row])[-1] == row]

    def largest_first(row: int) -> tuple[int, int, int]:
        return -sizes[row], -point_counts[row], row

    groups, current, largest = [], [], 0
    for unit in sorted(units, key=lambda unit: largest_first(unit[-1])):
        if current and (len(current) + len(unit)) * largest * held_a_centre > capacity:
            groups.append(current)
            current = []
        if not current:
            largest = sizes[unit[-1]]  # units come largest first: a group's first holds its largest
        current += unit
    groups.append(current)
    return [row_group(sorted(group, key=largest_first), sizes, point_counts) for group in groups if group]


def padding_free_capacity(keys: Tensor) -> int:
    """The points a k-means group whose nearest-centre step skips padding may hold: the fp32 copy of
    every row's points that the construction's memory plans (``reskv.batching.ModelShape``'s
    ``construction_bytes``), ``keys`` ``[R, s, d]``, and the distance block that the kernel does not
    write (``distance_block_bytes``)."""
    rows, seq_len, dim = keys.shape
    return rows * seq_len + distance_block_bytes(keys.device) // (4 * dim)


def level_row_groups(
    levels: list[list[int]],
    sizes: list[int],
    point_counts: list[int],
    keys: Tensor,
    families: Sequence[Sequence[int]] = (),
) -> list[RowGroup]:
    """The k-means groups of rows given by level (a validation proxy's candidate, or a final grid
    level: a level's sizes are close), ``sizes`` and ``point_counts`` host ints by row, points read
    from ``keys``: each level split by ``padded_groups``; where the nearest-centre step skips padding
    (``nearest_skips_padding``), every level's rows together, a group within ``padding_free_capacity``;
    where ``reskv.lloyd_kernel`` clusters them (``fused_lloyd_form``), as ``scratch_groups``, each of
    ``families`` whole."""
    every_row = [row for level in levels for row in level]
    if fused_lloyd_form(keys) is not None:
        return scratch_groups(every_row, sizes, point_counts, keys, families)
    if nearest_skips_padding(keys):
        return padded_groups(every_row, sizes, point_counts, keys.device, padding_free_capacity(keys))
    return [group for level in levels for group in padded_groups(level, sizes, point_counts, keys.device)]


def nested_families(
    rows: list[int], heads: list[int], offsets: list[int], sizes: list[int], point_counts: list[int]
) -> list[list[int]]:
    """``rows`` (host ints by row: head, offset into its head's ranking, size, point count) in the
    families whose first Lloyd step ``cluster_rows`` shares: a head's rows whose centres and points end
    at the same places of its ranking (``offset + size``, ``offset + count``), by increasing size, ties
    by row; a row with no such other is in none."""
    by_ends: dict[tuple[int, int, int], list[int]] = {}
    for row in rows:
        ends = (heads[row], offsets[row] + sizes[row], offsets[row] + point_counts[row])
        by_ends.setdefault(ends, []).append(row)
    families = [members for members in by_ends.values() if len(members) > 1]
    return [sorted(members, key=lambda row: (sizes[row], row)) for members in families]


def cluster_rows(
    keys: Tensor,
    values: Tensor,
    heads: Tensor,
    order: Tensor,
    point_offsets: Tensor | None,
    point_counts: Tensor,
    sizes: Tensor,
    row_groups: list[RowGroup],
    iterations: int,
    families: Sequence[Sequence[int]] = (),
) -> ResidualEntries:
    """Entries ``[R, r_max]`` for rows whose points are ``order[i, offset_i : offset_i + count_i]``.

    Row ``i`` reads keys and values of head ``heads[i]`` at the positions ``order[i]`` lists, best
    score first, from ``point_offsets[i]`` on (0 when ``None``): the validation proxy's candidates
    of one head evict nested suffixes of one ranking (reskv.md: ``E' = S' \\ M'``, ``M'`` the top
    of that ranking), so one sort serves them all. ``sizes[i] <= point_counts[i]``; rows in no group
    get no entries. A group is one padded k-means whose rows get the entries they get alone:
    padded points weigh 0 and padded centres never win (``nearest_centers``); on CUDA with
    ``CUDA_FUSED_LLOYD``, ``reskv.lloyd_kernel`` clusters it, each row over its own points and centres.

    ``families`` (each within one group, its rows by increasing size) are rows of one head, equal
    ``order`` rows, whose centres and points end at the same places (``offset + size`` and ``offset +
    count``): each one's initial centres are the last of the next's, and its points the last of the
    next's, as a validation proxy's candidates of one head and budget are (``reskv.proxy``). Their
    first Lloyd step is then one scan of the largest's centres (``reskv.lloyd_kernel``); the torch
    path clusters every row alone, to the same entries.
    """
    rows, dim = order.shape[0], keys.shape[-1]
    max_size = max((group.max_size for group in row_groups), default=0)
    entries = ResidualEntries(
        keys.new_zeros(rows, max_size, dim),
        values.new_zeros(rows, max_size, dim),
        torch.full((rows, max_size), float("-inf"), device=keys.device),
    )
    fused_form = fused_lloyd_form(keys)
    if fused_form is not None:
        from reskv import lloyd_kernel

        for group in row_groups:
            lloyd_kernel.cluster(
                keys, values, heads, order, point_offsets, point_counts, sizes, group, iterations, entries,
                fused_form, families=families,
            )  # fmt: skip
        return entries
    for group in row_groups:
        first, last = group.rows[0], group.rows[-1]
        contiguous = group.rows == list(range(first, last + 1))
        # Rows in one run are a slice: a view, where an index tensor gathers copies.
        index = slice(first, last + 1) if contiguous else uploaded(group.rows, keys.device)
        offsets = None if point_offsets is None else point_offsets[index]
        mean_keys, mean_values, log_counts = _cluster(
            keys,
            values,
            heads[index],
            order[index],
            offsets,
            point_counts[index],
            sizes[index],
            group,
            iterations,
        )
        entries.keys[index, : group.max_size] = mean_keys.to(keys.dtype)
        entries.values[index, : group.max_size] = mean_values.to(values.dtype)
        entries.log_counts[index, : group.max_size] = log_counts
    return entries


def _cluster(
    keys: Tensor,
    values: Tensor,
    heads: Tensor,
    order: Tensor,
    offsets: Tensor | None,
    point_counts: Tensor,
    sizes: Tensor,
    group: RowGroup,
    iterations: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Means and log-counts ``[A, max_size, ...]`` of one group's rows."""
    slots = torch.arange(group.max_points, device=keys.device)
    if offsets is None:
        positions = order[:, : group.max_points]
    else:
        positions = order.gather(1, (offsets[:, None] + slots).clamp_(max=order.shape[1] - 1))
    weights = (slots[None, :] < point_counts[:, None]).float()
    center_bias = None
    if not group.equal_sizes:
        unused = torch.arange(group.max_size, device=keys.device)[None, :] >= sizes[:, None]
        center_bias = torch.zeros(unused.shape, device=keys.device).masked_fill_(unused, float("inf"))
    rows = token_rows(heads, positions, keys)  # one index for the keys' and the values' gathers
    point_keys = gather_rows(keys, rows).float().mul_(weights[..., None])
    centers = point_keys[:, : group.max_size]
    flat_index, key_sums, counts = lloyd_assignments(
        point_keys,
        weights,
        centers,
        iterations,
        center_bias,
        points_in_bf16=keys.dtype == torch.bfloat16,
        extents=(point_counts, sizes),
    )
    del point_keys, centers  # values are gathered only now, so both never sit in memory at once
    point_values = gather_rows(values, rows).float().mul_(weights[..., None])
    value_sums = cluster_sums(point_values, flat_index, group.max_size)
    # Clamped, unlike the centre update's where: an empty slot's key and value must stay 0, since a
    # decode step multiplies every slot's key (0 * NaN would poison its logits).
    denominators = counts.clamp(min=1)[..., None]
    # log(0) is -inf: an empty cluster's slot gets no softmax mass (reskv.md, Residual entries).
    return key_sums / denominators, value_sums / denominators, counts.log()
