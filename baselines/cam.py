"""CaM as the field ran it: merge values along the prompt, then select with SnapKV.

Rule of baselines.md (CaM), the prefill form of Zefan-Cai/KVCache-Factory
``pyramidkv/pyramidkv_utils.py`` ``CAMKVCluster.update_kv`` / ``_update_kv_kv_head`` (c97f9d7),
itself a port of zyxxmu/cam's ``local_cam_mask``. Per KV head, with ``a`` the un-pooled window
attention (SnapKV's statistic before pooling: the last ``W`` queries, fp32 causal softmax, group
mean, mean over the queries), ``start = ceil(0.1 s)`` and merge window ``m = 64``:

    for i = start, ..., s - m - 1 in order:
        p_i = a_i / max(a[0:start] ∪ a[i : i+m])         (NaN -> 0, inf -> 1; so p_i <= 1)
        m_i ~ Bernoulli(p_i)
        if m_i: V[i+1 : i+m+1] += V[i] / m              (V[i] as already merged into: cascade)

Keys never change, and every position in the range takes part whether or not it is retained.
The retained set is then SnapKV's own (pooled) selection: KVCache-Factory selects CaM's tokens by
the un-pooled window sum, but this project keeps SnapKV's selection so that "SnapKV vs +CaM"
differs by the merge alone, as the paper's table frames it.

Where this differs from KVCache-Factory (baselines.md decides):
- The merge runs in fp32 (float64 for float64 values) and is cast back once; upstream adds in
  place in the model dtype and casts the softmax weights to it before averaging.
- ``start`` is ``ceil(s / 10)`` in exact arithmetic; upstream's ``ceil(0.1 * s)`` in floating
  point gives one more for some multiples of 10 (``s = 30`` -> 4).
- Draws: ``torch.bernoulli`` on the global generator upstream; here ``m_i = u[h, i] < p_i`` with
  ``u = torch.rand(H_kv, s)`` from a ``torch.Generator`` seeded with
  ``seed * LAYER_SEED_STRIDE + layer_idx``, so layers draw independent streams, a run is
  reproducible, and the draws do not depend on the device.
- Upstream clamps ``p_i`` to ``[0, 1]``; here ``p_i <= 1`` by construction (the max includes
  ``a_i``) and a draw ``u < p`` needs no clamp.
- Upstream returns prompts shorter than its capacity untouched; here a prompt that fits its
  budget is left untouched (``compress_layer`` returns before calling ``adjust_values``).

The cascade is the banded linear recurrence ``V'[j] = V[j] + sum_{i=j-m}^{j-1} c_i V'[i]`` with
``c_i = m_i / m``, solved ``m`` positions at a time (``cascade``): no ``s x s`` matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from baselines.snapkv import SnapKV, observation_queries, window_attention
from reskv.scoring import LayerObservation

LAYER_SEED_STRIDE = 1000  # more than any model's layer count: (seed, layer) pairs never collide
MERGE_WINDOW = 64  # baselines.md (CaM) 2: each merge spreads over the next 64 positions
INVERSE_CHUNK = (
    64  # blocks solved at once: inverses and carries of H * 64 * m * m floats each (8 MiB fp32 for 8 heads)
)


def merge_start(seq_len: int) -> int:
    """The first position that may merge: ``ceil(0.1 s)``, in exact arithmetic."""
    return -(-seq_len // 10)


def merge_probabilities(attention: Tensor, merge_window: int) -> Tensor:
    """``p`` ``[H_kv, s]`` (baselines.md, CaM 3): ``a_i / max(a[0:start] ∪ a[i:i+m])`` for
    ``i = start .. s-m-1``, zero elsewhere (those positions never merge)."""
    heads, seq_len = attention.shape
    start = merge_start(seq_len)
    probabilities = attention.new_zeros(heads, seq_len)
    if seq_len - merge_window <= start:  # no position leaves a full window behind it
        return probabilities
    sources = slice(start, seq_len - merge_window)
    ahead = attention[:, start:-1].unfold(1, merge_window, 1).amax(dim=-1)  # max a[i:i+m], i in sources
    sinks = attention[:, :start].amax(dim=-1, keepdim=True)
    ratio = attention[:, sources] / torch.maximum(sinks, ahead)
    probabilities[:, sources] = ratio.nan_to_num(nan=0.0, posinf=1.0)
    return probabilities


def block_inverses(coefficients: Tensor) -> Tensor:
    """``(I - L_b)^-1`` ``[H, n, m, m]`` for blocks ``coefficients`` ``[H, n, 1, m]``, with
    ``L_b[r, k] = c_k`` for ``k < r``: a unit lower-triangular system per block."""
    merge_window = coefficients.shape[-1]
    identity = torch.eye(merge_window, dtype=coefficients.dtype, device=coefficients.device)
    earlier = identity.new_ones(merge_window, merge_window).tril(-1)
    return torch.linalg.solve_triangular(
        identity - earlier * coefficients, identity, upper=False, unitriangular=True
    )


def cascade(values: Tensor, coefficients: Tensor, merge_window: int) -> Tensor:
    """Solve ``V'[j] = V[j] + sum_{i=j-m}^{j-1} c_i V'[i]`` for ``values`` ``[H, s, d]`` and
    ``coefficients`` ``[H, s]``, in the coefficients' dtype (``m`` = ``merge_window``).

    Blocks of ``m`` positions: position ``r`` of block ``b`` receives from positions ``k >= r`` of
    block ``b - 1`` and ``k < r`` of its own, so ``(I - L_b) V'_b = V_b + U_b V'_{b-1}`` with
    ``L_b[r, k] = c_k (k < r)`` and ``U_b[r, k] = c_{k of b-1} (k >= r)``, that is
    ``V'_b = A_b V_b + C_b V'_{b-1}`` with ``A_b = (I - L_b)^-1`` and ``C_b = A_b U_b``. ``A_b V_b``
    and ``C_b`` do not depend on other blocks and are computed ``INVERSE_CHUNK`` blocks at a time;
    the sequential part is one ``[H, m, m] @ [H, m, d]`` product per block. Never ``s x s``.
    """
    heads, seq_len, dim = values.shape
    padding = -seq_len % merge_window  # a short last block: zero coefficients, dropped at the end
    blocks = coefficients.new_zeros(heads, seq_len + padding, dim)
    blocks[:, :seq_len] = values
    blocks = blocks.view(heads, -1, merge_window, dim)
    own = torch.nn.functional.pad(coefficients, (0, padding)).view(heads, -1, 1, merge_window)
    previous = torch.cat([torch.zeros_like(own[:, :1]), own[:, :-1]], dim=1)  # block 0 has none
    reaching = torch.ones(merge_window, merge_window, dtype=torch.bool, device=values.device).triu()
    for first in range(0, blocks.shape[1], INVERSE_CHUNK):
        chunk = slice(first, first + INVERSE_CHUNK)
        inverses = block_inverses(own[:, chunk])
        blocks[:, chunk] = inverses @ blocks[:, chunk]
        carries = inverses @ (reaching * previous[:, chunk])
        for index in range(max(first, 1), min(first + INVERSE_CHUNK, blocks.shape[1])):
            blocks[:, index].baddbmm_(carries[:, index - first], blocks[:, index - 1])
    return blocks.view(heads, -1, dim)[:, :seq_len]


def merge_values(
    values: Tensor, attention: Tensor, uniforms: Tensor, merge_window: int = MERGE_WINDOW
) -> Tensor:
    """Values ``[H_kv, s, d]`` after CaM's cascading merges (baselines.md, CaM 3), a new tensor.

    ``attention`` is the un-pooled window attention ``[H_kv, s]``, ``uniforms`` the ``[H_kv, s]``
    draws in ``[0, 1)``: position ``i`` merges when ``uniforms[h, i] < p_i``. Computed in fp32
    (float64 for float64 values) and cast back to the values' dtype once.
    """
    start = merge_start(values.shape[1])
    merges = uniforms < merge_probabilities(attention, merge_window)
    compute = torch.float64 if values.dtype == torch.float64 else torch.float32
    # Positions before ``start`` neither merge nor receive, so the recurrence starts there.
    coefficients = merges[:, start:].to(compute) / merge_window
    merged = cascade(values[:, start:], coefficients, merge_window).to(values.dtype)
    return torch.cat([values[:, :start], merged], dim=1)


class CaM(SnapKV):
    """SnapKV selection on values merged CaM's way (baselines.md, CaM)."""

    def __init__(
        self, window: int = 64, kernel_size: int = 5, merge_window: int = MERGE_WINDOW, seed: int = 42
    ):
        super().__init__(window, kernel_size)
        self.merge_window = merge_window
        self.seed = seed

    def adjust_values(self, obs: LayerObservation, num_layers: int = 1) -> Tensor:
        """New values (``obs.values`` is never modified); keys are not touched, and which tokens are
        kept plays no part: every position in the merge range takes part, retained or not. Layers
        stacked along the heads merge in one cascade, each with its own layer's draws."""
        queries, positions = observation_queries(obs, self.window)
        attention = window_attention(queries, positions, obs.keys, obs.scaling)
        return merge_values(obs.values, attention, self.uniforms(obs, num_layers), self.merge_window)

    def uniforms(self, obs: LayerObservation, num_layers: int) -> Tensor:
        """The draws ``[H_kv, s]`` of each stacked layer from its own seeded CPU generator, on the
        device without the host waiting for it (``reskv.selection.uploaded``'s way)."""
        shape, device = (obs.num_kv_heads // num_layers, obs.seq_len), obs.values.device
        draws = [
            torch.rand(shape, generator=torch.Generator().manual_seed(self.seed * LAYER_SEED_STRIDE + layer))
            for layer in range(obs.layer_idx, obs.layer_idx + num_layers)
        ]
        host = draws[0] if num_layers == 1 else torch.cat(draws)
        return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
