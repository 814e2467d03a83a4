"""Top-k token selection with a protected recent window, ragged across heads, and the host's ways of
giving the device what it planned without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from reskv.attention import additive_mask


def uploaded(values: Sequence[int] | Sequence[float], device: torch.device, dtype=torch.long) -> Tensor:
    """Host numbers (a plan's sizes and counts) as a tensor on ``device``, the host not waiting for it:
    on CUDA a copy that is not ``non_blocking`` waits for the stream, every kernel queued before it
    (torch's ``memcpy_and_sync``), so the copy goes from pinned memory, ``non_blocking`` (the caching
    host allocator keeps the pinned block until the copy has run)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def padding_bias(counts: Tensor, slots: int) -> Tensor:
    """``[R, 1, slots]`` additive bias over rows padded to ``slots``: 0 on each row's first
    ``counts[r]`` slots (``counts`` on the device), ``-inf`` on its padding."""
    return additive_mask(torch.arange(slots, device=counts.device) < counts[:, None])[:, None, :]


def score_order(scores: Tensor) -> Tensor:
    """Positions ``[H, n]`` by descending score, ties toward the lower position.

    A stable sort gives the tie order reskv.md fixes (it matches NVIDIA kvpress's SnapKV index
    for index). ``scores`` is ``[H, n]``.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def score_ranks(scores: Tensor) -> Tensor:
    """Rank of every position by descending score (0 = best), ties toward the lower position
    (``score_order``); the result has the shape of ``scores``."""
    order = score_order(scores)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks


def prefix_ranks(scores: Tensor, window: int) -> Tensor:
    """``score_ranks`` of each head's tokens before its last ``window`` (``[H, s - window]``): what the
    main selection ranks, whatever the heads' sizes, so that selections of one score at several sizes
    (a grid's ratios) sort once."""
    return score_ranks(scores[:, : scores.shape[1] - min(window, scores.shape[1])])


def select_main(scores: Tensor, window: int, main_sizes: Tensor, ranks: Tensor | None = None) -> Tensor:
    """Kept-token mask ``[..., H, s]``: the last ``window`` tokens plus the top ``main_sizes[..., h] -
    window`` tokens before them (Eq. main_selection: ``M = P ∪ Top_{m-|P|}(s)``).

    ``main_sizes`` is ``[..., H]`` on the scores' device (ragged budgets, e.g. AdaKV; several
    selections of the same scores, e.g. a grid's ratios, along the leading dimensions). A head whose
    size is below the window keeps only its last ``main_sizes[..., h]`` tokens: the documented
    fallback for budgets smaller than the protected window. ``ranks``: the scores' ``prefix_ranks``
    for ``window``, when they are at hand.
    """
    seq_len = scores.shape[-1]
    window = min(window, seq_len)
    sizes = main_sizes.clamp(min=0, max=seq_len)
    prefix_len = seq_len - window
    ranks = prefix_ranks(scores, window) if ranks is None else ranks
    prefix_kept = ranks < (sizes - window).clamp(min=0)[..., None]
    from_end = seq_len - 1 - torch.arange(window, device=scores.device)  # window positions, newest first
    window_kept = torch.zeros(*sizes.shape, seq_len, dtype=torch.bool, device=scores.device)
    window_rank = torch.arange(window, device=scores.device) < sizes[..., None]
    window_kept[..., from_end] = window_rank
    window_kept[..., :prefix_len] = prefix_kept
    return window_kept


def row_stride(states: Tensor) -> int:
    """Rows of ``[H, s, d]`` states' storage from one head to the next: ``s``, or a longer prompt's
    length when the states are its first ``s`` tokens (a view: ``reskv.scoring.stack_layers``)."""
    heads, seq_len, dim = states.shape
    if states.stride()[1:] == (dim, 1) and states.stride(0) % dim == 0:
        return states.stride(0) // dim
    return seq_len  # any other layout is gathered from a contiguous copy (``storage_rows``)


def storage_rows(states: Tensor) -> Tensor:
    """``[H, s, d]`` states as rows ``[N, d]`` of their storage, head ``h``'s token ``t`` at row
    ``h * row_stride(states) + t``: a view, the states contiguous or a prefix of longer ones."""
    heads, seq_len, dim = states.shape
    stride = row_stride(states)
    if stride == seq_len:
        return states.reshape(-1, dim)
    return states.as_strided(((heads - 1) * stride + seq_len, dim), (dim, 1))


def token_rows(heads: Tensor, positions: Tensor, states: Tensor) -> Tensor:
    """``gather_rows``'s index ``[R, n]`` into ``states``: token ``positions[r]`` of head ``heads[r]`` as
    a row of ``storage_rows(states)``. Built once, it serves the gathers of every tensor laid out as
    ``states`` (a layer's keys and its values)."""
    return heads[:, None] * row_stride(states) + positions


def gather_rows(states: Tensor, rows: Tensor) -> Tensor:
    """``[R, n, d]``: the rows ``rows`` (``token_rows``) of ``[H, s, d]`` states (``storage_rows``)."""
    head_dim = states.shape[-1]
    return storage_rows(states).index_select(0, rows.reshape(-1)).reshape(*rows.shape, head_dim)
