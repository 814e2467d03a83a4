"""CaM: SnapKV selection, then each evicted value is merged, with some probability, into the next
retained values instead of being dropped.

References: zyxxmu/cam ``cam_hf/utils_hh/modify_llama_cam.py`` (``local_cam_mask``: merge
probability = the evicted token's score over the mean score of its merge window, Bernoulli
mask, value added with weight 1 / 32 to the window) and NVIDIA kvpress
``kvpress/presses/cam_press.py`` (bulk eviction: the window is the next ``merge_budget``
*retained* tokens). Fixed by baselines.md (CaM): selection is SnapKV's; per KV head, evicted
token ``i`` (position order) merges into ``T_i``, the next up to 32 retained tokens after it, with
``p_i = clamp(s_i / mean(s_T_i), 0, 1)`` on the *un-pooled* SnapKV window scores, ``m_i ~
Bernoulli(p_i)`` from a generator seeded by the run seed, ``V_t += m_i V_i / |T_i|``; keys never
change.

Where the spec is silent:
- ``s`` on targets inside the protected window is the same statistic on those columns (the
  window queries' mean causal attention), since merge targets may lie there.
- Randomness: ``torch.Generator`` seeded with ``seed * LAYER_SEED_STRIDE + layer_idx``, so layers
  draw independent streams and a run is reproducible; one ``torch.rand(H_kv, s)`` call gives
  ``u[h, i]`` and ``m_i = u[h, i] < p_i`` (a Bernoulli draw whose outcome for a token does not
  depend on which other tokens were evicted).
- ``0 / 0`` (no attention on the token nor its targets) gives ``p = 0``; ``x / 0`` gives ``p = 1``
  (as kvpress). An evicted token with no retained token after it has no targets: no merge.
- Merges accumulate in fp32 and the result is cast back to the values' dtype once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from baselines.snapkv import SnapKV, observation_queries, window_attention
from reskv.scoring import LayerObservation

LAYER_SEED_STRIDE = 1000  # more than any model's layer count: (seed, layer) pairs never collide


def running_sums(rows: Tensor, width: int, ahead: bool) -> Tensor:
    """Sums of ``width`` consecutive entries along dim 0, zeros outside: entries ``r .. r + width - 1``
    when ``ahead``, else ``r - width + 1 .. r``. Sliding views, so no cancellation as with cumsums."""
    pad = rows.new_zeros(width - 1, *rows.shape[1:])
    return torch.cat([rows, pad] if ahead else [pad, rows]).unfold(0, width, 1).sum(dim=-1)


def merge_evicted(
    values: Tensor, scores: Tensor, kept: Tensor, uniforms: Tensor, merge_targets: int
) -> Tensor:
    """Values ``[H_kv, s, d]`` after merging the evicted tokens of ``kept`` (``[H_kv, s]`` bool).

    ``scores`` are the un-pooled window scores ``[H_kv, s]``, ``uniforms`` the ``[H_kv, s]`` draws.
    Vectorised over tokens, as ranks among a head's retained tokens: evicted token ``i``'s targets
    are ranks ``start_i .. start_i + |T_i| - 1`` with ``start_i`` the number retained before ``i``
    (a cumulative count), so ``mean(s_T_i)`` is a forward window sum, and retained rank ``r``
    receives the weighted values of all ``i`` with ``start_i`` in ``r - merge_targets + 1 .. r``:
    a backward window sum of the values grouped by ``start_i``.
    """
    merged = values.to(torch.float32, copy=True)
    for head in range(values.shape[0]):
        retained = kept[head].nonzero().squeeze(1)
        if retained.numel() == 0:  # nothing to merge into
            continue
        evicted = (~kept[head]).nonzero().squeeze(1)
        start = kept[head].cumsum(0)[evicted]  # i itself is not retained; == |retained| if none follow
        count = (retained.numel() - start).clamp(max=merge_targets)  # |T_i|
        retained_scores = torch.cat([scores[head, retained], scores.new_zeros(1)])  # rank |retained|: none
        target_mean = running_sums(retained_scores, merge_targets, ahead=True)[start] / count.clamp(min=1)
        ratio = (scores[head, evicted] / target_mean).nan_to_num(nan=0.0, posinf=1.0).clamp(0, 1)
        weight = ((uniforms[head, evicted] < ratio) & (count > 0)) / count.clamp(min=1)  # m_i / |T_i|
        by_start = merged.new_zeros(retained.numel() + 1, values.shape[2])
        by_start.index_add_(0, start, values[head, evicted].float() * weight[:, None])
        merged[head, retained] += running_sums(by_start[:-1], merge_targets, ahead=False)
    return merged.to(values.dtype)


class CaM(SnapKV):
    """SnapKV selection with value merging of the evicted tokens (baselines.md, CaM)."""

    name = "cam"

    def __init__(self, window: int = 64, kernel_size: int = 5, merge_targets: int = 32, seed: int = 42):
        super().__init__(window, kernel_size)
        self.merge_targets = merge_targets
        self.seed = seed

    def adjust_values(self, obs: LayerObservation, kept: Tensor) -> Tensor:
        """New values (``obs.values`` is never modified); keys are not touched."""
        queries, positions = observation_queries(obs, self.window)
        scores = window_attention(queries, positions, obs.keys, obs.scaling)
        generator = torch.Generator().manual_seed(self.seed * LAYER_SEED_STRIDE + obs.layer_idx)
        uniforms = torch.rand(kept.shape, generator=generator).to(kept.device)
        return merge_evicted(obs.values, scores, kept, uniforms, self.merge_targets)
