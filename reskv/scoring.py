"""What a base method sees of a prefilled layer, and the interface its scoring rule implements.

Shapes use ``H`` query heads, ``H_kv`` KV heads, group size ``G = H // H_kv`` (query head ``h``
belongs to KV head ``h // G``, the ``repeat_kv`` convention), ``s`` prompt tokens, head dim ``d``.
Queries and keys are post-RoPE, as they sit in the cache.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Query chunk for attention statistics over long prompts: bounds memory at H * chunk * s floats.
QUERY_CHUNK = 512
# On CUDA with Triton installed, attention's sums over half-precision queries, keys and values by
# ``reskv.attention_sums_kernel``, no probability written (``fused_attention_sums``): H2O's column
# sums, SnapKV's window means and TOVA's last query (``mean_attention``), the validation proxy's full
# outputs; off, or elsewhere, by the torch path's fp32 probabilities. Off until a GPU has checked it
# against the torch path and timed it (``scripts.bench.gpu_check.first``'s kernels and profile stages).
CUDA_FUSED_ATTENTION_SUMS = False


@dataclass
class LayerObservation:
    """One layer right after prefill: its cache and the queries the scorers may use."""

    layer_idx: int
    keys: Tensor  # [H_kv, s, d]
    values: Tensor  # [H_kv, s, d]
    queries: Tensor  # [H, n, d]: the last n prompt queries, n = min(s, observation window)
    accumulated: Tensor | None  # [H_kv, s] fp32: H2O column sums over all prompt queries, or None
    scaling: float

    @property
    def seq_len(self) -> int:
        return self.keys.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def group_size(self) -> int:
        return self.queries.shape[0] // self.keys.shape[0]

    @property
    def query_positions(self) -> range:
        """Positions of ``queries`` in the prompt: the last n positions (host integers, so scorers
        slice and bound them without reading the device)."""
        return range(self.seq_len - self.queries.shape[1], self.seq_len)


def stack_layers(
    observations: list[LayerObservation], prefix_of: LayerObservation | None = None
) -> LayerObservation:
    """``L`` layers of one prompt as one observation with ``L * H_kv`` KV heads (and ``L * H`` query
    heads), layer-major: query head ``h`` still belongs to KV head ``h // G``, so every rule whose
    heads are independent scores the stack as it scores each layer. The stack is a copy of the
    layers' tensors: one op for many, since a GPU's host pays per op whatever its size. With
    ``prefix_of``, the stack of the same layers after a longer prompt whose first ``s`` tokens are
    these (the query-aware cache extends the context's), the keys and values are views of its first
    ``s`` tokens: no second copy. One layer is its own stack."""
    if len(observations) == 1:
        return observations[0]
    first, seq_len = observations[0], observations[0].seq_len
    accumulated = None
    if first.accumulated is not None:
        accumulated = torch.cat([obs.accumulated for obs in observations])
    if prefix_of is None:
        keys, values = (
            torch.cat([obs.keys for obs in observations]),
            torch.cat([obs.values for obs in observations]),
        )
    else:
        keys, values = prefix_of.keys[:, :seq_len], prefix_of.values[:, :seq_len]
    queries = torch.cat([obs.queries for obs in observations])
    return LayerObservation(first.layer_idx, keys, values, queries, accumulated, first.scaling)


def group_mean(per_query_head: Tensor, num_kv_heads: int) -> Tensor:
    """Reduce a ``[H, ...]`` tensor to ``[H_kv, ...]`` by the mean over each GQA group (reskv.md, GQA)."""
    return per_query_head.reshape(num_kv_heads, -1, *per_query_head.shape[1:]).mean(dim=1)


def causal_attention_probs(queries: Tensor, keys: Tensor, query_positions: range, scaling: float) -> Tensor:
    """fp32 softmax attention ``[H, n, s]`` of queries at ``query_positions`` over keys ``0..s-1``.

    Causal: a query at position ``t`` gives zero weight to keys after ``t``. Memory is
    ``H * n * s`` floats, so callers pass observation-sized query sets (or chunks). Only the
    columns from the earliest query position on can be in a query's future, so only they are
    masked (in place): the prompt-long rest of the logits is touched by the softmax alone.
    """
    num_kv_heads, seq_len, head_dim = keys.shape
    grouped = queries.float().reshape(num_kv_heads, -1, head_dim)  # [H_kv, G*n, d]
    logits = (grouped @ keys.float().transpose(1, 2)).mul_(scaling)  # [H_kv, G*n, s]
    logits = logits.reshape(queries.shape[0], queries.shape[1], seq_len)
    first = min(query_positions[0] + 1, seq_len)
    # Column first + j is after query start + i when j - i > start - first: an upper triangle.
    future = torch.ones(len(query_positions), seq_len - first, dtype=torch.bool, device=keys.device)
    logits[..., first:].masked_fill_(future.triu_(query_positions.start - first + 1), float("-inf"))
    # In place, into the logits: glibc often maps a second buffer of this size (13 MiB for 96 x 9
    # queries at 4K) fresh on every call, and its page faults then cost more than the arithmetic
    # on CPU. Same bits.
    return torch.softmax(logits, dim=-1, out=logits)


def fused_attention_sums(queries: Tensor) -> bool:
    """Whether ``reskv.attention_sums_kernel`` computes attention's sums over ``queries``:
    ``CUDA_FUSED_ATTENTION_SUMS``, CUDA with Triton, and half precision (fp32's IEEE products spill)."""
    half = queries.dtype in (torch.bfloat16, torch.float16)
    if not (CUDA_FUSED_ATTENTION_SUMS and queries.is_cuda and half):
        return False
    from reskv import attention_sums_kernel  # imports Triton (slow to import), which the CPU never runs

    return attention_sums_kernel.available()


def fused_column_sums(queries: Tensor, keys: Tensor, query_positions: range, scaling: float) -> Tensor:
    """``[H, s]`` fp32: each key's causal attention summed over ``queries`` by
    ``reskv.attention_sums_kernel`` (``fused_attention_sums``), 0 for keys after the last query."""
    from reskv import attention_sums_kernel

    visible = query_positions[-1] + 1  # later keys get no weight
    sums = attention_sums_kernel.column_sums(queries, keys[:, :visible], query_positions[0], scaling)
    return sums if visible == keys.shape[1] else F.pad(sums, (0, keys.shape[1] - visible))


def mean_attention(queries: Tensor, keys: Tensor, query_positions: range, scaling: float) -> Tensor:
    """``[H, s]`` fp32: each key's causal attention averaged over ``queries`` (a query's zero weight on
    the keys after it counted, as SnapKV's upstream does; TOVA's one query: its attention): the mean of
    ``causal_attention_probs``, or where ``fused_attention_sums`` the kernel's column sums over the
    query count, no probability written and no fp32 copy of the keys."""
    if fused_attention_sums(queries):
        return fused_column_sums(queries, keys, query_positions, scaling).mul_(1 / len(query_positions))
    probs = causal_attention_probs(queries, keys, query_positions, scaling)
    # One query's mean is its own attention: a view, no op (TOVA's last query).
    return probs[:, 0] if probs.shape[1] == 1 else probs.mean(dim=1)


def attention_outputs(
    queries: Tensor, keys: Tensor, values: Tensor, query_positions: range, scaling: float
) -> Tensor:
    """``[H_kv, G n, d]`` fp32: the causal attention outputs of ``queries`` ``[H, n, d]`` at
    ``query_positions`` over ``keys`` and ``values`` ``[H_kv, s, d]``, each group's query heads stacked
    (query head major): ``causal_attention_probs`` times the values, or where ``fused_attention_sums``
    ``reskv.attention_sums_kernel.outputs`` (no probability written)."""
    num_kv_heads = keys.shape[0]
    if fused_attention_sums(queries):
        from reskv import attention_sums_kernel

        visible = query_positions[-1] + 1
        found = attention_sums_kernel.outputs(
            queries, keys[:, :visible], values[:, :visible], query_positions[0], scaling
        )
        return found.view(num_kv_heads, -1, found.shape[-1])
    probs = causal_attention_probs(queries, keys, query_positions, scaling)
    return torch.bmm(probs.view(num_kv_heads, -1, probs.shape[-1]), values.float())


def accumulated_attention(queries: Tensor, keys: Tensor, query_positions: range, scaling: float) -> Tensor:
    """H2O's heavy-hitter statistic: column sums of causal attention over the given queries.

    Returns ``[H_kv, s]`` (mean over each group of query heads). Computed in query chunks so no
    ``s x s`` tensor is materialised, or by ``reskv.attention_sums_kernel`` where
    ``fused_attention_sums``. Reference: FMInference/H2O ``modify_llama.py``
    (``_update_hh_score``): plain sums, no normalisation by how many queries see a token.
    """
    if fused_attention_sums(queries):
        return group_mean(fused_column_sums(queries, keys, query_positions, scaling), keys.shape[0])
    total = torch.zeros(queries.shape[0], keys.shape[1], device=keys.device, dtype=torch.float32)
    for start in range(0, queries.shape[1], QUERY_CHUNK):
        chunk = slice(start, start + QUERY_CHUNK)
        visible = query_positions[chunk][-1] + 1  # later keys get no weight from this chunk
        probs = causal_attention_probs(queries[:, chunk], keys[:, :visible], query_positions[chunk], scaling)
        total[:, :visible] += probs.sum(dim=1)
    return group_mean(total, keys.shape[0])


def observation_queries(obs: LayerObservation, window: int) -> tuple[Tensor, range]:
    """The last ``window`` observed queries ``[H, n, d]`` and their prompt positions ``[n]``.

    When fewer queries were observed (short prompts: the engine observes ``min(s, ...)``), all of
    them are used; the protected window is unaffected.
    """
    return obs.queries[:, -window:], obs.query_positions[-window:]


class TokenScorer:
    """A base method's rule: token scores, the protected window and the per-head allocation.

    Subclasses (one file each in ``baselines/``) implement ``score``: the rule applied to a prefix
    of keys with some observation queries. The deployed cache scores the whole prompt with the
    method's own observation window (``prompt_scores``); the validation proxy scores the prefix
    before its first validation query with the fit queries (reskv.md, Validation proxy). The
    shared compressor (``reskv.compress``) does the selection, so every method keeps the
    protected window plus the top-scored tokens before it, ties broken toward lower positions.
    Scores are ``[H_kv, s]`` fp32; entries inside the protected window are ignored.
    """

    window: int = 0  # the protected recent tokens P, always kept
    needs_accumulated_attention: bool = False  # H2O: capture column sums during prefill
    # How ``head_budgets`` spreads the budget, for whoever checks a cache against it: "uniform"
    # (every KV head keeps b), "head" (a layer's heads share H_kv * b unevenly: AdaKV), "layer"
    # (a layer's heads keep one budget, the layers average b: PyramidKV).
    budget_scope: str = "uniform"

    def score(self, keys: Tensor, queries: Tensor, positions: range, scaling: float) -> Tensor:
        """Scores ``[H_kv, s]`` of the prefix ``keys`` ``[H_kv, s, d]`` (positions ``0 .. s-1``, its
        protected window the last ``window`` of them) from ``queries`` ``[H, n, d]`` at ``positions``
        (contiguous prompt positions)."""
        raise NotImplementedError

    def stacked_score(
        self, keys: Tensor, queries: Tensor, positions: range, scaling: float, num_layers: int
    ) -> Tensor:
        """``score`` of ``num_layers`` layers stacked along the heads (``stack_layers``). Rules whose
        heads are independent score the stack as one layer; a rule that pools over a layer's heads
        (TOVA) overrides this."""
        return self.score(keys, queries, positions, scaling)

    def prompt_scores(self, obs: LayerObservation, num_layers: int = 1) -> Tensor:
        """Scores for the deployed cache: the rule on the whole prompt with the method's own
        window of observed queries (its last ``window`` queries; TOVA: the last one). ``obs`` may
        stack ``num_layers`` layers along its heads (``stack_layers``: ``stacked_score``)."""
        queries, positions = observation_queries(obs, self.window)
        return self.stacked_score(obs.keys, queries, positions, obs.scaling, num_layers)

    def scores_key(self) -> Hashable:
        """What decides this rule's scores (``score``, ``stacked_score``, ``prompt_scores``) and its
        protected window: rules that share it score alike, so a grid scores a setting once for them all
        (``reskv.compress.SharedLayers``). By default the rule's class and attributes; a rule whose
        subclasses score as it does (SnapKV: AdaKV, CaM) says so."""
        return type(self), tuple(sorted(vars(self).items()))

    def head_budgets(
        self, scores: Tensor, budget: int, *, layer_idx: int | None = None, num_layers: int | None = None
    ) -> Tensor:
        """Slots each KV head of layer ``layer_idx`` (of the model's ``num_layers``) keeps, protected
        window included: ``[H_kv]`` long, ``budget`` each (PyramidKV spreads budgets over layers)."""
        return torch.full((scores.shape[0],), budget, dtype=torch.long, device=scores.device)

    def stacked_head_budgets(
        self, scores: Tensor, budget: int, *, first_layer: int, num_layers: int | None = None
    ) -> Tensor:
        """``head_budgets`` of consecutive layers from ``first_layer``, their scores stacked
        ``[L, H_kv, s]``: ``[L, H_kv]``. One call per layer; a rule whose budgets can be computed for
        the layers at once (AdaKV) overrides this, with the same values."""
        return torch.stack(
            [
                self.head_budgets(layer_scores, budget, layer_idx=first_layer + offset, num_layers=num_layers)
                for offset, layer_scores in enumerate(scores)
            ]
        )

    def host_budgets(
        self, scores: Tensor, budgets: Sequence[int], *, first_layer: int, num_layers: int | None = None
    ) -> list[list[list[int]]]:
        """``stacked_head_budgets`` at each of ``budgets`` (a grid's ratios), as host integers
        ``[budget][layer][head]``: read from the device once for them all, and never where they do not
        depend on the scores (a rule that keeps ``head_budgets`` as it is here; PyramidKV's pyramid)."""
        rule = type(self)
        if (rule.head_budgets, rule.stacked_head_budgets) == (
            TokenScorer.head_budgets,
            TokenScorer.stacked_head_budgets,
        ):
            return [[[budget] * scores.shape[1] for _ in scores] for budget in budgets]
        per_budget = [
            self.stacked_head_budgets(scores, budget, first_layer=first_layer, num_layers=num_layers)
            for budget in budgets
        ]
        return torch.stack(per_budget).tolist()

    def adjust_values(self, obs: LayerObservation, num_layers: int = 1) -> Tensor:
        """The values ``[H_kv, s, d]`` the main cache takes its kept tokens' from: the layer's own, or a
        merging rule's (CaM overrides this). They may not depend on which tokens are kept, so that a
        grid computes them once for all its ratios; ``obs`` may stack ``num_layers`` layers along its
        heads (``stack_layers``, from layer ``obs.layer_idx`` on)."""
        return obs.values
