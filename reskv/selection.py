"""Top-k token selection with a protected recent window, ragged across heads."""

from __future__ import annotations

import torch
from torch import Tensor


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


def select_main(scores: Tensor, window: int, main_sizes: Tensor) -> Tensor:
    """Kept-token mask ``[H, s]``: the last ``window`` tokens plus the top ``main_sizes[h] - window``
    tokens before them (Eq. main_selection: ``M = P ∪ Top_{m-|P|}(s)``).

    ``main_sizes`` is ``[H]`` (ragged budgets, e.g. AdaKV). A head whose size is below the window
    keeps only its last ``main_sizes[h]`` tokens: the documented fallback for budgets smaller
    than the protected window.
    """
    num_heads, seq_len = scores.shape
    window = min(window, seq_len)
    sizes = main_sizes.to(scores.device).clamp(min=0, max=seq_len)
    prefix_len = seq_len - window
    prefix_kept = score_ranks(scores[:, :prefix_len]) < (sizes - window).clamp(min=0)[:, None]
    from_end = seq_len - 1 - torch.arange(window, device=scores.device)  # window positions, newest first
    window_kept = torch.zeros(num_heads, seq_len, dtype=torch.bool, device=scores.device)
    window_rank = torch.arange(window, device=scores.device)[None, :] < sizes[:, None]
    window_kept[:, from_end] = window_rank
    window_kept[:, :prefix_len] = prefix_kept
    return window_kept


def token_rows(heads: Tensor, positions: Tensor, seq_len: int) -> Tensor:
    """``gather_rows``'s index ``[R, n]``: token ``positions[r]`` of head ``heads[r]`` as a row of the
    ``[H * s, d]`` flattened states. Built once, it serves the keys' and the values' gathers."""
    return heads[:, None] * seq_len + positions


def gather_rows(states: Tensor, rows: Tensor) -> Tensor:
    """``[R, n, d]``: the rows ``rows`` (``token_rows``) of ``[H, s, d]`` states flattened to
    ``[H * s, d]``."""
    head_dim = states.shape[-1]
    return states.reshape(-1, head_dim).index_select(0, rows.reshape(-1)).reshape(*rows.shape, head_dim)
