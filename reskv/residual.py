"""Residual entries: k-means summaries (mean key, mean value, count) of evicted tokens (Eq. summary).

Batched over KV heads with padding: heads evict different numbers of tokens (AdaKV) and get
different residual sizes (validation proxy), so points and centres carry validity masks and
unused slots end with ``log_count = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reskv.selection import gather_tokens

# Bound on the k-means distance block (fp32 bytes), so transient memory does not grow with
# s * r: one layer's clustering at Llama-3.1-8B's shape and 32K tokens peaks at 142 MiB, mostly
# the fp32 points (``reskv.compress.kmeans_peak_memory``, ratio 0.6, r = 0.2 b, CPU). 4 MiB is
# also the fastest block measured on CPU: [3, 3634, 64] points against 395 centres take 8.0 ms
# in 4 MiB blocks and 12.1 ms in one, [3, 7200, 64] against 790 centres 30 ms and 68 ms (2 cores,
# torch 2.13): larger blocks are fresh pages on every call, smaller ones make the GEMMs thin.
# The block size changes no bit of the result (tests/test_reskv_invariants.py).
DISTANCE_CHUNK_BYTES = 4 << 20


def residual_sizes(ratio: float, budgets: Tensor) -> Tensor:
    """``r = floor(ratio * b + 0.5)`` per head (reskv.md): a share of each head's budget ``b``
    rounded half up, computed in float64 whatever the budgets' dtype."""
    return torch.floor(ratio * budgets.double() + 0.5).long()


@dataclass
class ResidualEntries:
    """``r_max`` slots per KV head; a slot with ``log_counts == -inf`` is unused."""

    keys: Tensor  # [H_kv, r_max, d]
    values: Tensor  # [H_kv, r_max, d]
    log_counts: Tensor  # [H_kv, r_max] fp32

    @property
    def entries_per_head(self) -> Tensor:
        return torch.isfinite(self.log_counts).sum(dim=-1)

    @classmethod
    def empty(cls, num_heads: int, like: Tensor) -> ResidualEntries:
        none = like.new_zeros(num_heads, 0, like.shape[-1])
        return cls(none, none.clone(), torch.zeros(num_heads, 0, device=like.device))


def cluster_sums(
    weighted_points: Tensor, weights: Tensor, assignments: Tensor, num_centers: int
) -> tuple[Tensor, Tensor]:
    """Per-cluster sums ``[H, r, d]`` and member counts ``[H, r]``.

    ``weights`` is 1 for valid points and 0 for padding; ``weighted_points`` are the points
    multiplied by it. ``index_add_`` accumulates in a fixed order on CPU, so results are
    bit-for-bit reproducible.
    """
    num_heads, _, dim = weighted_points.shape
    # One flat index over (head, cluster): index_add_ is far cheaper than a scatter over d.
    heads = torch.arange(num_heads, device=assignments.device)[:, None]
    flat_index = (assignments + num_centers * heads).reshape(-1)
    counts = weights.new_zeros(num_heads * num_centers).index_add_(0, flat_index, weights.reshape(-1))
    sums = weighted_points.new_zeros(num_heads * num_centers, dim)
    sums.index_add_(0, flat_index, weighted_points.reshape(-1, dim))
    sums, counts = sums.reshape(num_heads, num_centers, dim), counts.reshape(num_heads, num_centers)
    return sums, counts


def nearest_centers(points: Tensor, centers: Tensor, chunk_bytes: int) -> Tensor:
    """Index ``[H, E]`` of each point's nearest centre by squared Euclidean distance.

    ``||c||² - 2<p, c>`` (the point's own norm does not change the argmin); ties go to the lower
    centre index. The ``[H, E, r]`` distances are computed over chunks of points holding at most
    ``chunk_bytes`` of fp32, so a layer's transient memory stays bounded whatever ``s`` and ``r``.
    """
    num_heads, num_points, _ = points.shape
    num_centers = centers.shape[1]
    chunk = max(1, chunk_bytes // (4 * num_heads * max(num_centers, 1)))
    center_norms = (centers * centers).sum(-1)[:, None, :]
    centers_t = centers.transpose(1, 2)
    nearest = torch.empty(num_heads, num_points, dtype=torch.long, device=points.device)
    for start in range(0, num_points, chunk):
        part = points[:, start : start + chunk]
        nearest[:, start : start + chunk] = torch.baddbmm(center_norms, part, centers_t, alpha=-2).argmin(-1)
    return nearest


def lloyd_assignments(
    points: Tensor, weights: Tensor, centers: Tensor, iterations: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Cluster index of every point after ``iterations`` Lloyd steps (assign, then move centres to
    means), with the last step's per-cluster sums ``[H, r, d]`` and counts ``[H, r]`` (the entries
    are their means, so they are not summed twice).

    With the init ordered by score, ties in ``nearest_centers`` make the better-scored of two
    identical centres win and the other end empty. A centre that loses all its points keeps its
    position. ``points`` ``[H, E, d]`` fp32, zero where ``weights`` is 0; ``centers`` ``[H, r, d]``;
    ``iterations >= 1``.
    """
    centers = centers.float()
    for _ in range(iterations):
        assignments = nearest_centers(points, centers, DISTANCE_CHUNK_BYTES)
        sums, counts = cluster_sums(points, weights, assignments, centers.shape[1])
        centers = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centers)
    return assignments, sums, counts


def build_residual(
    keys: Tensor, values: Tensor, evicted: Tensor, scores: Tensor, sizes: Tensor, iterations: int
) -> ResidualEntries:
    """Summarise each head's evicted tokens into ``sizes[h]`` entries (reskv.md, Residual entries).

    ``keys``/``values`` are ``[H, s, d]``; ``evicted``, ``scores`` and ``sizes`` have ``R`` rows,
    ``R`` a multiple of ``H`` when candidate selections are stacked (row ``r`` is head ``r % H``).

    Lloyd k-means on keys, initialised deterministically from the ``sizes[h]`` evicted keys with
    the highest scores (ties toward the lower position); ``sizes`` is capped at ``|E|``. Entry
    ``j`` stores the mean key, mean value and ``log(count)`` of its cluster; empty clusters are
    dropped (``log_count = -inf``), so their slot never receives softmax mass.
    """
    rows = evicted.shape[0]
    sizes = torch.minimum(sizes.to(keys.device), evicted.sum(dim=-1))
    max_size = int(sizes.max())
    entries = ResidualEntries(
        keys.new_zeros(rows, max_size, keys.shape[-1]),
        values.new_zeros(rows, max_size, values.shape[-1]),
        torch.full((rows, max_size), float("-inf"), device=keys.device),
    )
    if max_size == 0:
        return entries
    # Rows are clustered in groups of equal size: no centre padding, and rows without entries
    # (stacked candidates often include r = 0) cost nothing.
    for size in sizes.unique().tolist():
        if size == 0:
            continue
        rows_of_size = torch.nonzero(sizes == size).squeeze(1)
        mean_keys, mean_values, log_counts = _cluster(
            keys,
            values,
            rows_of_size % keys.shape[0],
            evicted[rows_of_size],
            scores[rows_of_size],
            size,
            iterations,
        )
        entries.keys[rows_of_size, :size] = mean_keys.to(keys.dtype)
        entries.values[rows_of_size, :size] = mean_values.to(values.dtype)
        entries.log_counts[rows_of_size, :size] = log_counts
    return entries


def _cluster(
    keys: Tensor, values: Tensor, heads: Tensor, evicted: Tensor, scores: Tensor, size: int, iterations: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Means and log-counts ``[A, size, ...]`` for rows that all get ``size`` entries (``size <= |E|``)."""
    evicted_counts = evicted.sum(dim=-1)
    max_points = int(evicted_counts.max())
    # Evicted tokens first, best score first (stable: ties toward the lower position); the
    # first ``size`` of them are the initial centres.
    ranked = torch.where(evicted, scores.float(), torch.full_like(scores, float("-inf"), dtype=torch.float))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :max_points]
    weights = (torch.arange(max_points, device=keys.device)[None, :] < evicted_counts[:, None]).float()
    point_keys = gather_tokens(keys, order, heads).float().mul_(weights[..., None])
    assignments, key_sums, counts = lloyd_assignments(point_keys, weights, point_keys[:, :size], iterations)
    del point_keys  # values are gathered only now, so both never sit in memory at once
    point_values = gather_tokens(values, order, heads).float().mul_(weights[..., None])
    value_sums, _ = cluster_sums(point_values, weights, assignments, size)
    denominators = counts.clamp(min=1)[..., None]
    log_counts = torch.where(counts > 0, counts.log(), torch.full_like(counts, float("-inf")))
    return key_sums / denominators, value_sums / denominators, log_counts
