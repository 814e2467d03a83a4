"""How close a compressed cache keeps the model to the full cache, beyond exact match (issue 10).

Per prompt and method, against the full cache (the exact prefill of the same prompt):

- **answer log-likelihood**: ``log p(answer | prompt)`` of a reference answer's tokens, teacher
  forced, under each cache (``sequence_log_prob``);
- **distribution distance**: ``KL(full || method)`` of the next-token distributions at the first
  ``FORCED_STEPS`` decode steps, both caches fed the full cache's greedy continuation: step ``i``
  feeds its token ``t_i`` and compares the distributions the two models then predict
  (``kl_divergence``);
- **mechanism**, at those same steps: per layer, the relative attention-output error
  ``||o_method - o_full|| / ||o_full||`` (per query head and step, then averaged) with every layer
  of both caches fed the full model's hidden states, so errors do not compound across layers
  (``ProbeLayer``), and the share of attention mass that went to residual entries.

``reskv.engine.Prefill.generate(..., answer_ids=...)`` runs them; what the full cache computes is
computed once per prompt. Both sides go through the same code, so the full cache measured against
itself gives KL 0, log-likelihood gap 0 and attention error 0 exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from reskv.cache import CompressedLayer

FORCED_STEPS = 16


def kl_divergence(reference_logits: Tensor, logits: Tensor) -> Tensor:
    """``KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))`` per row of two ``[..., V]`` logit tensors,
    ``P = softmax(reference_logits)``, ``Q = softmax(logits)``; computed in float64."""
    reference_log_probs = reference_logits.double().log_softmax(-1)
    log_probs = logits.double().log_softmax(-1)
    return (reference_log_probs.exp() * (reference_log_probs - log_probs)).sum(-1)


def sequence_log_prob(logits: Tensor, token_ids: Tensor) -> float:
    """``sum_j log softmax(logits[j])[token_ids[j]]``: row ``j`` of ``logits`` ``[n, V]`` predicts
    token ``j``; in float64."""
    log_probs = logits.double().log_softmax(-1)
    return float(log_probs.gather(-1, token_ids[:, None]).sum())


def significant(values: Tensor, digits: int = 6) -> list[float]:
    """Per-layer figures as short JSON numbers (0 stays exactly 0)."""
    return [float(f"{value:.{digits}g}") for value in values.tolist()]


class ProbeLayer(CacheLayerMixin):
    """One layer of the full cache and the same layer of a method's cache, fed the same tokens.

    ``update`` appends the model's new keys and values to both; ``attend`` returns the full layer's
    output (so the model goes on with the full cache's hidden states) and records, for the last
    ``measured_rows`` queries, how far the method layer's output on the same queries is from it
    (``attention_error``, mean over query heads and rows) and the residual share of its attention
    mass (``residual_share``, 0 for a layer without residual entries).
    """

    is_sliding = False

    def __init__(self, reference: CacheLayerMixin, method: CacheLayerMixin, measured_rows: int):
        super().__init__()
        self.reference, self.method = reference, method
        self.measured_rows = measured_rows
        self.is_initialized = True
        self.attention_error: Tensor | None = None
        self.residual_share: Tensor | None = None
        self._method_states: tuple[Tensor, Tensor] | None = None

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("a probe layer pairs two filled layers, never lazily")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self._method_states = self.method.update(key_states, value_states)
        return self.reference.update(key_states, value_states)

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        output = self.reference.attend(module, query, key, value, scaling)
        rows = slice(query.shape[2] - self.measured_rows, None)
        if isinstance(self.method, CompressedLayer):
            method_output, residual_share = self.method.attend_parts(query, scaling)
            self.residual_share = residual_share[:, rows].float().mean()
        else:
            method_output = self.method.attend(module, query, *self._method_states, scaling)
            self.residual_share = query.new_zeros((), dtype=torch.float32)
        full = output[0, rows].float()
        error = (method_output[0, rows].float() - full).norm(dim=-1) / full.norm(dim=-1)
        self.attention_error = error.mean()
        return output

    def get_seq_length(self) -> int:
        return self.reference.get_seq_length()

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.reference.get_mask_sizes(*args, **kwargs)

    def get_max_length(self) -> int:
        return -1
