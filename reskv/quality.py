"""How close a compressed cache keeps the model to the full cache, beyond exact match.

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
  (``ProbeLayer``), and the share of attention mass that went to residual entries; their means
  are over the compressed layers (a model's sliding-window layers are never compressed).

``reskv.engine.Prefill.generate(..., answer_ids=...)`` runs them through a ``QualityProbe``; what
the full cache computes is computed once per prompt. Both sides go through the same code, so the
full cache measured against itself gives KL 0, log-likelihood gap 0 and attention error 0 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from reskv.cache import AttendingLayer, CompressedLayer, ResKVCache
from reskv.decoding import greedy

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


class ProbeLayer(AttendingLayer):
    """One layer of the full cache and the same layer of a method's cache, fed the same tokens.

    ``update`` appends the model's new keys and values to both; ``attend`` returns the full layer's
    output (so the model goes on with the full cache's hidden states) and records, for the last
    ``measured_rows`` queries, how far the method layer's output on the same queries is from it
    (``attention_error``, mean over query heads and rows) and the residual share of its attention
    mass (``residual_share``, 0 for a layer without residual entries).
    """

    is_sliding = False

    def __init__(self, reference: AttendingLayer, method: AttendingLayer, measured_rows: int):
        super().__init__()
        self.reference, self.method = reference, method
        self.measured_rows = measured_rows
        self.is_initialized = True
        self.attention_error: Tensor | None = None
        self.residual_share: Tensor | None = None
        self._method_states: tuple[Tensor, Tensor] | None = None

    @property
    def window(self) -> int | None:
        """The layer's kind (``AttendingLayer.window``): its reference's."""
        return self.reference.window

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


class QualityProbe:
    """The measures above for the generations of one prompt (``Prefill``, which keeps the full cache):
    what the full cache gives (its greedy continuation of ``FORCED_STEPS`` tokens, its logits along
    them, its log-likelihood of each reference answer) is computed once, on first use."""

    def __init__(self, prefill):  # a reskv.engine.Prefill, which holds its probe
        self.prefill = prefill
        self._forced: tuple[list[int], Tensor] | None = None
        self._answer_log_probs: dict[tuple[int, ...], float] = {}

    def reference(self) -> tuple[list[int], Tensor]:
        """The full cache's greedy continuation and its next-token logits after each of those tokens
        (``[FORCED_STEPS, V]``)."""
        if self._forced is None:
            prefill = self.prefill
            whole = prefill.prefilled("aware")
            prefill.check_positions(FORCED_STEPS)
            cache = whole.cache.fork()
            (forced_ids,) = greedy(
                whole.last_logits[None],
                lambda token_ids: prefill.next_logits(token_ids, cache)[None],
                FORCED_STEPS,
                0,
                set(),
            )
            logits = self.teacher_forced(whole.cache.fork(), whole.last_logits, forced_ids)[1:]
            self._forced = forced_ids, logits
        return self._forced

    def measured_answer(self, answer_ids: Sequence[int]) -> tuple[int, ...]:
        """The reference answer the measures score: a long one (a LongBench summary) is cut where the
        backbone's positions end."""
        prefill = self.prefill
        return tuple(answer_ids)[: prefill.max_positions - len(prefill.prompt_ids)]

    def teacher_forced(self, cache: ResKVCache, last_logits: Tensor, token_ids: Sequence[int]) -> Tensor:
        """``[1 + n, V]``: ``last_logits``, then the logits after each of ``token_ids`` fed to ``cache``."""
        if not token_ids:
            return last_logits[None]
        return torch.cat([last_logits[None], self.prefill.next_logits(token_ids, cache, every_position=True)])

    def measures(
        self,
        setting: str,
        compressed: ResKVCache,
        prompted: ResKVCache,
        last_logits: Tensor,
        answer_ids: Sequence[int],
    ) -> dict:
        """The measures of one generation: ``compressed`` is the method's cache before the question
        (query-agnostic) or prompt, ``prompted`` and ``last_logits`` after the prompt."""
        prefill = self.prefill
        forced_ids, forced_logits = self.reference()
        whole = prefill.prefilled("aware")
        answer_ids = self.measured_answer(answer_ids)
        answered = self.teacher_forced(prompted.fork(), last_logits, answer_ids[:-1])
        forced = self.teacher_forced(prompted, last_logits, forced_ids)[1:]
        quality: dict = {"answer_tokens": len(answer_ids)}
        if answer_ids:
            if answer_ids not in self._answer_log_probs:
                logits = self.teacher_forced(whole.cache.fork(), whole.last_logits, answer_ids[:-1])
                self._answer_log_probs[answer_ids] = sequence_log_prob(
                    logits, torch.tensor(answer_ids, device=logits.device)
                )
            full = self._answer_log_probs[answer_ids]
            own = sequence_log_prob(answered, torch.tensor(answer_ids, device=answered.device))
            quality.update(answer_log_prob=own, answer_log_prob_full=full, answer_log_prob_gap=own - full)
        quality["kl"] = float(kl_divergence(forced_logits, forced).mean())
        # The probe feeds what the method's cache has not seen yet (the question, query-agnostic)
        # and the forced tokens; only the forced tokens' queries are measured.
        fed = list(prefill.prompt_ids[prefill.context_length :]) if setting == "agnostic" else []
        probe = ResKVCache(
            [
                ProbeLayer(full_layer, method_layer, len(forced_ids))
                for full_layer, method_layer in zip(
                    prefill.prefilled(setting).cache.fork().layers, compressed.layers, strict=True
                )
            ]
        )
        prefill.next_logits(fed + forced_ids, probe)
        errors = torch.stack([layer.attention_error for layer in probe.layers])
        shares = torch.stack([layer.residual_share for layer in probe.layers])
        # The means are over the compressed layers: a sliding-window layer is the full cache's own.
        compressed = torch.tensor([layer.window is None for layer in probe.layers], device=errors.device)
        quality.update(
            attention_error=float(errors[compressed].mean()),
            residual_share=float(shares[compressed].mean()),
            attention_error_by_layer=significant(errors),
            residual_share_by_layer=significant(shares),
        )
        return quality
