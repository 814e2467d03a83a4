"""Residual entries: k-means summaries (mean key, mean value, count) of evicted tokens (Eq. summary).

Batched over KV heads with padding: heads evict different numbers of tokens (AdaKV) and get
different residual sizes (validation proxy), so points and centres carry validity masks and
unused slots end with ``log_count = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
    def empty(cls, keys: Tensor) -> ResidualEntries:
        num_heads, _, head_dim = keys.shape
        none = keys.new_zeros(num_heads, 0, head_dim)
        return cls(none, none.clone(), torch.zeros(num_heads, 0, device=keys.device))


def lloyd_assignments(points: Tensor, point_valid: Tensor, centers: Tensor, center_valid: Tensor,
                      iterations: int) -> Tensor:
    """Cluster index of every point after ``iterations`` Lloyd steps (assign, then move centres to means).

    Squared Euclidean distance; ties go to the lower centre index (``argmin``), so with the init
    ordered by score the better-scored of two identical centres wins and the other ends empty.
    A centre that loses all its points keeps its position for the next step. ``points`` is
    ``[H, E, d]``, ``centers`` ``[H, r, d]``; invalid points get index ``r`` (no cluster).
    """
    points = points.float()
    centers = centers.float()
    point_weight = point_valid.float()[..., None]
    num_centers = centers.shape[1]
    assignments = None
    for _ in range(iterations):
        distances = (centers * centers).sum(-1)[:, None, :] - 2 * points @ centers.transpose(1, 2)
        distances = distances.masked_fill(~center_valid[:, None, :], float("inf"))
        assignments = distances.argmin(dim=-1)
        membership = torch.nn.functional.one_hot(assignments, num_centers).float() * point_weight
        counts = membership.sum(dim=1)  # [H, r]
        sums = membership.transpose(1, 2) @ points
        centers = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centers)
    return assignments.masked_fill(~point_valid, num_centers)


def build_residual(keys: Tensor, values: Tensor, evicted: Tensor, scores: Tensor, sizes: Tensor,
                   iterations: int) -> ResidualEntries:
    """Summarise each head's evicted tokens into ``sizes[h]`` entries (reskv.md, Residual entries).

    Lloyd k-means on keys, initialised deterministically from the ``sizes[h]`` evicted keys with
    the highest scores (ties toward the lower position); ``sizes`` is capped at ``|E|``. Entry
    ``j`` stores the mean key, mean value and ``log(count)`` of its cluster; empty clusters are
    dropped (``log_count = -inf``), so their slot never receives softmax mass.
    """
    num_heads, seq_len, head_dim = keys.shape
    evicted_counts = evicted.sum(dim=-1)
    sizes = torch.minimum(sizes.to(keys.device), evicted_counts)
    max_size = int(sizes.max()) if num_heads else 0
    if max_size == 0:
        return ResidualEntries.empty(keys)
    max_points = int(evicted_counts.max())
    # Evicted tokens first, best score first (stable: ties toward the lower position); the
    # first sizes[h] of them are the initial centres.
    ranked = torch.where(evicted, scores.float(), torch.full_like(scores, float("-inf"), dtype=torch.float))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :max_points]
    gather = order[..., None].expand(-1, -1, head_dim)
    point_keys = keys.gather(1, gather).float()
    point_values = values.gather(1, gather).float()
    point_valid = torch.arange(max_points, device=keys.device)[None, :] < evicted_counts[:, None]
    center_valid = torch.arange(max_size, device=keys.device)[None, :] < sizes[:, None]

    assignments = lloyd_assignments(point_keys, point_valid, point_keys[:, :max_size], center_valid, iterations)
    membership = torch.nn.functional.one_hot(assignments, max_size + 1)[..., :max_size].float()
    counts = membership.sum(dim=1)
    denominators = counts.clamp(min=1)[..., None]
    mean_keys = (membership.transpose(1, 2) @ point_keys) / denominators
    mean_values = (membership.transpose(1, 2) @ point_values) / denominators
    log_counts = torch.where(counts > 0, counts.log(), torch.full_like(counts, float("-inf")))
    return ResidualEntries(mean_keys.to(keys.dtype), mean_values.to(values.dtype), log_counts)
