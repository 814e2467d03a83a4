"""A k-means group's Lloyd steps in Triton, its points read by index from the keys and values, nothing
the size of its points written (``../shared/design/gpu-path.md``).

``reskv.residual``'s torch path (``_cluster``) copies a group's points out of the cache into fp32
``[A, E, d]`` (the keys, then the values), and launches about 13 ops a Lloyd step (the centres' norms,
the nearest centres, the flat cluster index, the sums and counts, the update): about 86 a group. On a
GPU each launch costs the host ~20 us whatever its size, and each copy a pass over the points. Here a
group (``reskv.residual.RowGroup``) is one zeroed allocation and 1 + 2 x iterations launches (9 at 4 steps;
with families, below, one upload of their table besides):

- a zeroed scratch of fp32: each cluster's key and value sums ``[A, r, 2, d]``, then its member count
  ``[A, r]`` (a cluster's sums a row of ``2d``, so that a thread adds four aligned floats an atomic);
- ``_centres_kernel``, ``"init"``: each row's first ``sizes[i]`` points (its best-scored evicted tokens)
  as its initial centres, and their squared norms (``+inf`` past the row's size: never nearest); in
  ``"bf16x3"``, their exact split too (``nearest_kernel.write_parts``), which the scan reads;
- each Lloyd step, ``_assign_kernel``: a tile of one row's points read by index from the keys (row
  ``i``: head ``heads[i]``'s tokens ``order[i, offset_i :]``, its first ``point_counts[i]``; the
  layout ``reskv.residual.cluster_rows`` takes), each point's nearest centre
  (``nearest_kernel.nearest_in_row``, distances never written), and the point added to its cluster's
  sums and count; on the last step its value too, read by the same index;
- the first step of a family shared (``families``, ``reskv.residual.nested_families``: rows of one
  head whose initial centres, and points, are each the last of the next larger row's, as a
  validation proxy's candidates of one budget are): the largest row's programs scan its centres'
  suffixes, the smallest member's first, carrying the running minimum, and after each member's suffix
  add the point to that member's sums where the member holds it (``_assign_kernel``, ``SHARED``); the
  other members' programs scan nothing. Each member gets the assignment it gets alone (the same
  distances, a tie to the lower index) for the largest's products;
- between steps, ``_centres_kernel``, ``"update"``: each centre moved to its cluster's mean (an empty
  cluster's kept), its norm (and split), and the sums zeroed for the next step;
- ``_centres_kernel``, ``"final"``: the entries (reskv.md, Residual entries), the mean key and value
  (``sums / max(count, 1)``: an empty slot's stay 0) and ``log(count)`` (``-inf`` for an empty one),
  written into the group's rows of the entries in their dtype.

The rule is the torch path's; the arithmetic differs in its order only. The norms are summed by the
kernel, the products are ``nearest_kernel``'s, and the sums are added by atomics in whatever order the
device runs them (as CUDA's ``index_add_`` does): near ties may go another way, and sums differ in
their last bits from run to run. CPU keeps the torch path. Tested on CPU under ``TRITON_INTERPRET=1``
(tests/test_lloyd_kernel.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reskv import nearest_kernel
from reskv.nearest_kernel import triton
from reskv.selection import row_stride, storage_rows, uploaded

if TYPE_CHECKING:
    from reskv.residual import ResidualEntries, RowGroup

if triton is not None:
    import triton.language as tl

    from reskv.nearest_kernel import nearest_in_row, row_parts, scanned_row, write_parts

# ``_centres_kernel``'s modes (module docstring).
CENTRE_MODES = ("init", "update", "final")


def cluster(
    keys: Tensor,
    values: Tensor,
    heads: Tensor,
    order: Tensor,
    offsets: Tensor | None,
    point_counts: Tensor,
    sizes: Tensor,
    group: RowGroup,
    iterations: int,
    entries: ResidualEntries,
    form: str,
    split_operands: str | None = None,
    families: Sequence[Sequence[int]] = (),
) -> ResidualEntries:
    """``group``'s rows of ``entries`` after ``iterations`` Lloyd steps, as ``reskv.residual.cluster_rows``
    computes them (its arguments, ``sizes[i] <= point_counts[i]``), written in place; ``entries``.

    ``keys`` and ``values`` ``[H, s, d]`` share their storage's layout (``token_rows``); ``entries``
    are contiguous (``cluster_rows`` makes them); ``form`` and ``split_operands`` are the nearest
    centres' products (``reskv.nearest_kernel.nearest``). The tiles, warps and split operands are the
    nearest-centre kernel's, read at the call, so that setting them there sets both kernels'."""
    device, dim = keys.device, keys.shape[-1]
    num_rows, num_centers = len(group.rows), group.max_size
    rows_index = uploaded(group.rows, device)
    cluster_sums, cluster_counts, centers, center_parts, center_norms = group_buffers(
        num_rows, num_centers, dim, form, split_operands, device
    )
    has_offsets = offsets is not None
    layout = dict(
        key_rows=storage_rows(keys),
        order=order,
        offsets=offsets if has_offsets else point_counts,  # not read without offsets
        heads=heads,
        sizes=sizes,
        rows_index=rows_index,
        cluster_sums=cluster_sums,
        cluster_counts=cluster_counts,
        centers=centers,
        center_parts=centers if center_parts is None else center_parts,  # not read without a split
        center_norms=center_norms,
        row_stride=row_stride(keys),
        order_stride=order.stride(0),
        num_centers=num_centers,
        dim=dim,
        HAS_OFFSETS=has_offsets,
        PRECISION=form,
        DIM_TILE=max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        CENTER_TILE=nearest_kernel.CENTER_TILE,
        num_warps=nearest_kernel.NUM_WARPS,
    )
    centres_grid = (num_rows, triton.cdiv(num_centers, nearest_kernel.CENTER_TILE))
    outputs = dict(entry_keys=entries.keys, entry_values=entries.values, entry_log_counts=entries.log_counts)
    unused = dict(entry_keys=centers, entry_values=centers, entry_log_counts=center_norms)
    _centres_kernel[centres_grid](**layout, **unused, entry_width=0, MODE="init")
    value_rows = storage_rows(values)
    family, family_width = family_table(group, families, device)
    for step in range(iterations):
        last = step + 1 == iterations
        shared = step == 0 and family_width > 1
        _assign_kernel[(num_rows, triton.cdiv(group.max_points, nearest_kernel.POINT_TILE))](
            **layout,
            value_rows=value_rows,
            point_counts=point_counts,
            num_points=group.max_points,
            family=family if shared else rows_index,  # not read unless shared
            family_width=family_width,
            WITH_VALUES=last,
            SHARED=shared,
            POINT_TILE=nearest_kernel.POINT_TILE,
        )
        if not last:
            _centres_kernel[centres_grid](**layout, **unused, entry_width=0, MODE="update")
    _centres_kernel[centres_grid](**layout, **outputs, entry_width=entries.keys.shape[1], MODE="final")
    return entries


def group_buffers(
    num_rows: int, num_centers: int, dim: int, form: str, split_operands: str | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """What ``cluster`` holds for a group of ``num_rows`` rows of ``num_centers`` centres (the module
    docstring's layout): its clusters' key and value sums and member counts, two views of one zeroed
    allocation; the centres; in ``"bf16x3"`` their split (``nearest_kernel.empty_parts``, else
    ``None``); the centres' norms."""
    slots = num_rows * num_centers
    scratch = torch.zeros(slots * (2 * dim + 1), device=device)
    cluster_sums, cluster_counts = scratch.split([slots * 2 * dim, slots])
    centers = torch.empty(num_rows, num_centers, dim, device=device)
    center_parts = None
    if form == "bf16x3":
        center_parts = nearest_kernel.empty_parts(centers, split_operands)
    center_norms = torch.empty(num_rows, num_centers, device=device)
    return cluster_sums, cluster_counts, centers, center_parts, center_norms


def bytes_a_centre(dim: int, form: str) -> int:
    """The bytes ``cluster`` holds for each centre of a group in ``form`` (``group_buffers``), what
    ``reskv.residual.scratch_groups`` sizes a group by."""
    held = group_buffers(1, 1, dim, form, None, torch.device("meta"))
    return sum(buffer.nbytes for buffer in held if buffer is not None)


def family_table(
    group: RowGroup, families: Sequence[Sequence[int]], device: torch.device
) -> tuple[Tensor | None, int]:
    """The first step's table of ``group`` (``cluster``): row ``i`` of the group lists, where it leads
    a family of ``families`` (rows of the table, smallest size first, the largest leading), its
    members' rows in the group, itself last, and otherwise itself alone, or nothing where another row
    leads it; -1 past a row's members. With no family of two rows in the group: ``None, 1``."""
    position = {row: index for index, row in enumerate(group.rows)}
    kept = [[position[row] for row in members] for members in families if members[-1] in position]
    if sum(map(len, kept)) != sum(row in position for members in families for row in members):
        raise ValueError("a family's rows must be clustered in one group (reskv.residual.scratch_groups)")
    width = max(map(len, kept), default=1)
    if width == 1:
        return None, 1
    table = [[index] + [-1] * (width - 1) for index in range(len(group.rows))]
    for members in kept:
        for member in members[:-1]:
            table[member] = [-1] * width
        table[members[-1]] = members + [-1] * (width - len(members))
    return uploaded(table, device), width


if triton is not None:

    @triton.jit
    def point_tokens(
        order, offsets, heads, table_row, slot, valid, row_stride, order_stride, HAS_OFFSETS: tl.constexpr
    ):
        """Rows of the keys' storage (``storage_rows``) of the points at ``slot`` of table row
        ``table_row`` (``cluster``'s layout), 0 where not ``valid``."""
        start = tl.load(offsets + table_row) if HAS_OFFSETS else 0
        position = tl.load(order + table_row * order_stride + start + slot, mask=valid, other=0)
        return tl.load(heads + table_row) * row_stride + position

    @triton.jit
    def rounded(means, dtype: tl.constexpr):
        """fp32 ``means`` in ``dtype`` to nearest, ties to even, as torch's ``to``: bf16 by its bits
        (finite values), since Triton's interpreter truncates a cast to bf16; others by a cast."""
        if dtype == tl.bfloat16:
            bits = means.to(tl.uint32, bitcast=True)
            bits += 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return means.to(dtype)

    @triton.jit(do_not_specialize=["row_stride", "order_stride", "num_centers", "entry_width"])
    def _centres_kernel(
        key_rows,
        order,
        offsets,
        heads,
        sizes,
        rows_index,
        cluster_sums,
        cluster_counts,
        centers,
        center_parts,
        center_norms,
        entry_keys,
        entry_values,
        entry_log_counts,
        entry_width,
        row_stride,
        order_stride,
        num_centers,
        dim,
        MODE: tl.constexpr,
        HAS_OFFSETS: tl.constexpr,
        PRECISION: tl.constexpr,
        CENTER_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        table_row = tl.load(rows_index + row)
        center = tl.program_id(1) * CENTER_TILE + tl.arange(0, CENTER_TILE)
        feature = tl.arange(0, DIM_TILE)
        in_row = center < num_centers
        tile_mask = in_row[:, None] & (feature[None, :] < dim)
        slot = row * num_centers + center  # the centre's row of ``centers``, its cluster's sums and count
        sums_at = cluster_sums + slot[:, None] * (2 * dim) + feature[None, :]
        counts_at = cluster_counts + slot
        if MODE == "final":
            counts = tl.load(counts_at, mask=in_row, other=0.0)
            denominators = tl.maximum(counts, 1.0)[:, None]
            key_sums = tl.load(sums_at, mask=tile_mask, other=0.0)
            value_sums = tl.load(sums_at + dim, mask=tile_mask, other=0.0)
            out = table_row * entry_width + center
            out_at = out[:, None] * dim + feature[None, :]
            tl.store(
                entry_keys + out_at,
                rounded(key_sums / denominators, entry_keys.dtype.element_ty),
                mask=tile_mask,
            )
            tl.store(
                entry_values + out_at,
                rounded(value_sums / denominators, entry_values.dtype.element_ty),
                mask=tile_mask,
            )
            tl.store(entry_log_counts + out, tl.log(counts), mask=in_row)
        else:
            real = center < tl.load(sizes + table_row)  # the row's own centres
            if MODE == "init":  # the row's first points, best-scored first
                tokens = point_tokens(
                    order, offsets, heads, table_row, center, real, row_stride, order_stride, HAS_OFFSETS
                )
                tile = tl.load(
                    key_rows + tokens[:, None] * dim + feature[None, :],
                    mask=real[:, None] & tile_mask,
                    other=0.0,
                ).to(tl.float32)
            else:
                counts = tl.load(counts_at, mask=in_row, other=0.0)
                previous = tl.load(
                    centers + slot[:, None] * dim + feature[None, :], mask=tile_mask, other=0.0
                )
                # An empty cluster's 0 / 0 is discarded: its centre keeps its position.
                tile = tl.where(
                    counts[:, None] > 0,
                    tl.load(sums_at, mask=tile_mask, other=0.0) / counts[:, None],
                    previous,
                )
                tl.store(sums_at, tl.zeros([CENTER_TILE, DIM_TILE], tl.float32), mask=tile_mask)
                tl.store(counts_at, tl.zeros([CENTER_TILE], tl.float32), mask=in_row)
            tl.store(centers + slot[:, None] * dim + feature[None, :], tile, mask=tile_mask)
            if PRECISION == "bf16x3":
                at = center[:, None] * dim + feature[None, :]
                write_parts(
                    row_parts(center_parts, row, num_centers, dim), at, tile, tile_mask, num_centers * dim
                )
            norms = tl.where(real, tl.sum(tile * tile, axis=1), float("inf"))
            tl.store(center_norms + slot, norms, mask=in_row)

    @triton.jit
    def add_points(
        cluster_sums, cluster_counts, slot, point_tile, value_tile, valid, feature, dim,
        POINT_TILE: tl.constexpr, WITH_VALUES: tl.constexpr,
    ):  # fmt: skip
        """The ``valid`` points of a tile added to the sums and counts of their clusters' ``slot``s
        (``cluster``'s layout); with ``WITH_VALUES``, their values too."""
        sums_at = cluster_sums + slot[:, None] * (2 * dim) + feature[None, :]
        tile_mask = valid[:, None] & (feature[None, :] < dim)
        # Relaxed: sums that no program reads before the launch ends need no ordering (the default,
        # acq_rel, fences every add).
        tl.atomic_add(sums_at, point_tile, mask=tile_mask, sem="relaxed")
        ones = tl.full([POINT_TILE], 1.0, tl.float32)
        tl.atomic_add(cluster_counts + slot, ones, mask=valid, sem="relaxed")
        if WITH_VALUES:
            tl.atomic_add(sums_at + dim, value_tile, mask=tile_mask, sem="relaxed")

    @triton.jit(do_not_specialize=["row_stride", "order_stride", "num_centers", "num_points", "family_width"])
    def _assign_kernel(
        key_rows,
        value_rows,
        order,
        offsets,
        heads,
        point_counts,
        sizes,
        rows_index,
        family,
        cluster_sums,
        cluster_counts,
        centers,
        center_parts,
        center_norms,
        row_stride,
        order_stride,
        num_points,
        num_centers,
        family_width,
        dim,
        HAS_OFFSETS: tl.constexpr,
        WITH_VALUES: tl.constexpr,
        SHARED: tl.constexpr,
        POINT_TILE: tl.constexpr,
        CENTER_TILE: tl.constexpr,
        DIM_TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        table_row = tl.load(rows_index + row)
        point = tl.program_id(1) * POINT_TILE + tl.arange(0, POINT_TILE)
        feature = tl.arange(0, DIM_TILE)
        own_points = tl.load(point_counts + table_row)
        valid = point < own_points
        tile_mask = valid[:, None] & (feature[None, :] < dim)
        tokens = point_tokens(
            order, offsets, heads, table_row, point, valid, row_stride, order_stride, HAS_OFFSETS
        )
        token_at = tokens[:, None] * dim + feature[None, :]
        point_tile = tl.load(key_rows + token_at, mask=tile_mask, other=0.0).to(tl.float32)
        value_tile = point_tile
        if WITH_VALUES:
            value_tile = tl.load(value_rows + token_at, mask=tile_mask, other=0.0).to(tl.float32)
        # The row's own centres; none for a tile wholly past its points.
        live = tl.program_id(1) * POINT_TILE < own_points
        size = tl.load(sizes + table_row).to(tl.int32)
        last = tl.where(live, size, 0)
        row_norms = center_norms + row * num_centers
        row_centers = scanned_row(center_parts, row, num_centers, dim, PRECISION)  # the centres if no split
        if SHARED:  # the row's family's first step (``cluster``): its centres' suffixes, smallest first
            best = tl.full([POINT_TILE], float("inf"), tl.float32)
            best_index = tl.zeros([POINT_TILE], tl.int32)
            for k in range(family_width):
                member = tl.load(family + row * family_width + k)  # a row of the group, -1: none
                present = member >= 0
                member_size = tl.load(sizes + tl.load(rows_index + tl.maximum(member, 0))).to(tl.int32)
                shift = size - member_size  # the member's centres and points start this much later
                first = tl.where(present & live, shift, last)
                range_best, range_index = nearest_in_row(
                    point_tile, row_centers, row_norms, num_centers, first, last, dim, feature,
                    POINT_TILE, CENTER_TILE, PRECISION,
                )  # fmt: skip
                # The range's centres precede every one scanned before it: a tie goes to the range.
                take = range_best <= best
                best = tl.where(take, range_best, best)
                best_index = tl.where(take, range_index, best_index)
                last = first
                # The member's points: the leader's from ``shift`` on (none where no member is).
                held = valid & (point >= tl.where(present, shift, num_points))
                slot = member * num_centers + best_index - shift
                add_points(
                    cluster_sums, cluster_counts, slot, point_tile, value_tile, held, feature, dim,
                    POINT_TILE, WITH_VALUES,
                )  # fmt: skip
        else:
            _, nearest = nearest_in_row(
                point_tile, row_centers, row_norms, num_centers, 0, last, dim, feature, POINT_TILE,
                CENTER_TILE, PRECISION,
            )  # fmt: skip
            add_points(
                cluster_sums, cluster_counts, row * num_centers + nearest, point_tile, value_tile, valid,
                feature, dim, POINT_TILE, WITH_VALUES,
            )  # fmt: skip
