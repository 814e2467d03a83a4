"""KV caches that plug into transformers through its public extension points.

``ResKVCache`` is a ``transformers.Cache`` whose layers (``AttendingLayer``: transformers'
``CacheLayerMixin`` plus the attention of the queries fed to them) are either

- ``ObservedLayer``: an exact, growing cache (a ``DynamicLayer``) that can record, while the
  prompt is prefilled, what the scorers need: the last observation-window queries and, for
  H2O, column sums of attention (computed in query chunks, never an ``s x s`` tensor);
- ``CompressingLayer``: an ``ObservedLayer`` that compresses itself during its one prefill
  forward and then drops its full keys and values (``Prefill(..., retain="compressed")``);
- ``CompressedLayer``: the exact main cache (ragged heads padded with masked slots) plus the
  residual entries, attended with the shared-softmax rule of ``reskv.attention``; or
- ``WindowedLayer``: a sliding-window layer of a hybrid model (Gemma 3), exact and never compressed;
- ``StaticSlotsLayer``: rows of one batch in static-capacity buffers, ``StaticWindowedLayer`` (the
  sliding-window layers of one generation or of several) or ``reskv.views.ViewLayer`` (a grid's rows
  as views of the prefilled cache); or
- ``reskv.quality.ProbeLayer``: a full layer and a method's, fed the same tokens, compared.

The attention function registered as ``"reskv"`` with transformers' ``AttentionInterface``
hands every call to the layer that holds the state; the model code is used unchanged. Masks
are built here, not by transformers: a custom attention name gets ``attention_mask=None``.
Batch size 1 throughout, but for a ``StaticSlotsLayer``: each prompt is compressed on its own, and the
generations of one prompt may then decode together, one row each.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from reskv.attention import (
    RowGates,
    additive_mask,
    joint_attention,
    joint_buffers,
    shared_softmax_attention,
    stacked_shared_softmax_attention,
)
from reskv.compress import CompressedLayerState
from reskv.decode_rule import NO_RESIDUAL_RULE, DecodeRule, plain_rule
from reskv.residual import ResidualEntries
from reskv.scoring import LayerObservation, accumulated_attention

ATTENTION_NAME = "reskv"
CACHE_KWARG = "reskv_cache"  # the forward kwarg that carries the cache to the attention function
# SDPA backends allowed on CUDA: not cuDNN, which plans once per shape, so a decode whose cache grows
# by one token a step re-plans every step, at a cost that dwarfs the step (results/gpu/README.md).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _uses_flash_attention(query: Tensor) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )


def causal_attention(module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """Exact causal attention of the last ``q`` positions over all ``k`` keys: ``[1, q, H, d]``.

    FlashAttention-2 when installed on a GPU (its causal mask aligns to the bottom right, as
    needed when a suffix continues a cache); PyTorch SDPA otherwise, with an explicit mask when
    queries continue a longer cache (SDPA's ``is_causal`` aligns to the top left).
    """
    if _uses_flash_attention(query):
        return ALL_ATTENTION_FUNCTIONS["flash_attention_2"](module, query, key, value, None, scaling=scaling)[
            0
        ]
    query_len, key_len = query.shape[2], key.shape[2]
    mask = None
    if 1 < query_len < key_len:
        query_positions = torch.arange(key_len - query_len, key_len, device=query.device)
        mask = torch.arange(key_len, device=query.device)[None, :] <= query_positions[:, None]
    with sdpa_kernel(SDPA_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        output = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=query_len == key_len and query_len > 1,
            scale=scaling,
            enable_gqa=True,
        )
    return output.transpose(1, 2).contiguous()


def require_single_sequence(states: Tensor) -> None:
    """Every layer holds one sequence: refuse a batch rather than silently use its first row."""
    if states.shape[0] != 1:
        raise ValueError(
            f"batch size {states.shape[0]}: the ResKV cache holds one sequence (batch size 1); "
            "compress each prompt on its own"
        )


def causal_bias(own_slots: Tensor, slots: int, group_size: int) -> Tensor:
    """``[G * q, slots]``: 0 on the slots up to each of ``q`` tokens' own (``own_slots``, fed together),
    ``-inf`` after, for queries in grouped order (a GQA group's ``G`` heads, each with its ``q`` tokens)."""
    visible = torch.arange(slots, device=own_slots.device)[None, :] <= own_slots[:, None]
    return additive_mask(visible).repeat(group_size, 1)


class AttendingLayer(CacheLayerMixin):
    """A layer of a ``ResKVCache``: it holds keys and values as transformers' ``CacheLayerMixin``
    declares, and computes the attention of the queries fed to it (``reskv_attention`` hands it every
    call of its model layer), so that the layer kind, not the model code, decides how to attend.
    ``window`` is the model layer's sliding window (``None``: full attention over the whole prompt)."""

    window: int | None = None

    @abstractmethod
    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """The attention output ``[B, q, H, d]`` of ``query`` ``[B, H, q, d]`` (the model's layer
        ``module``) over this layer, once ``update`` has written the new ``key`` and ``value`` and
        returned them (``[B, H_kv, k, d]``): the ``q`` queries are the last ``q`` tokens written."""

    def fork(self) -> AttendingLayer:
        """A twin to extend (more prompt tokens, or decoding) without touching this layer."""
        raise TypeError(f"a {type(self).__name__} serves one forward or one decode and is never forked")


class ObservedLayer(DynamicLayer, AttendingLayer):
    """An exact layer; while ``observation_window > 0`` it records queries (and H2O statistics)."""

    def __init__(self, observation_window: int = 0, accumulate: bool = False):
        super().__init__()
        self.observation_window = observation_window
        self.accumulate = accumulate
        self.queries: Tensor | None = None  # [H, n, d]: the last observed queries
        self.accumulated: Tensor | None = None  # [H_kv, s] fp32

    def fork(self, observation_window: int = 0, accumulate: bool = False) -> ObservedLayer:
        """A new layer over the same tensors: ``update`` concatenates, so the original never changes."""
        twin = ObservedLayer(observation_window, accumulate)
        twin.keys, twin.values, twin.is_initialized = self.keys, self.values, self.is_initialized
        if self.is_initialized:
            twin.device = self.device  # what lazy_initialization sets (transformers >= 5.24: no dtype)
        twin.queries, twin.accumulated = self.queries, self.accumulated
        return twin

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        require_single_sequence(query)
        if self.observation_window:
            self._observe(query[0], key[0], scaling)
        return causal_attention(module, query, key, value, scaling)

    def _observe(self, query: Tensor, key: Tensor, scaling: float) -> None:
        recent = query if self.queries is None else torch.cat([self.queries, query], dim=1)
        # A copy, not a view: a view of the last rows keeps the whole prompt's queries alive (16 GiB
        # of bf16 queries over the 32 layers of a Llama-3.1-8B-shaped model at 64K).
        self.queries = recent[:, -self.observation_window :].clone()
        if not self.accumulate:
            return
        key_len = key.shape[1]
        positions = range(key_len - query.shape[1], key_len)
        new_sums = accumulated_attention(query, key, positions, scaling)
        if self.accumulated is not None:
            new_sums[:, : self.accumulated.shape[1]] += self.accumulated
        self.accumulated = new_sums

    def observation(self, layer_idx: int, scaling: float) -> LayerObservation:
        return LayerObservation(
            layer_idx, self.keys[0], self.values[0], self.queries, self.accumulated, scaling
        )


# A method's compression of a batch of layers (``compress_layers`` bound to its scorer, ratio and
# residual); ``None`` for a layer whose budget covers the prompt.
BatchCompressor = Callable[[list[LayerObservation]], list[CompressedLayerState | None]]


class CompressingLayer(ObservedLayer):
    """An ``ObservedLayer`` for one prefill forward that compresses itself as its attention runs,
    then lets go of its full keys and values (``Prefill(..., retain="compressed")``, reskv.md,
    "Where the full cache lives").

    Right after the exact causal output the layer holds all its keys and values, the observed
    queries and the H2O sums: what the compressors need. NVIDIA/kvpress compresses at the same
    point with a forward hook on each attention module (``kvpress/presses/base_press.py``,
    ``BasePress.forward_hook``); here the attention function already dispatches to this layer.
    Each compressor gets the layer as a batch of one; ``compressed`` keeps its result under its
    key: a ``CompressedLayerState``, or, where the budget covers the prompt, an exact
    ``ObservedLayer`` over the full tensors (the cache ``Method.compress`` keeps then). Nothing else
    keeps the full tensors, so they are freed when the model's attention module returns, before the
    next layer runs; the layer cannot be fed again.
    """

    def __init__(
        self, observation_window: int, accumulate: bool, compressors: Mapping[Hashable, BatchCompressor]
    ):
        super().__init__(observation_window, accumulate)
        self.compressors = compressors
        self.compressed: dict[Hashable, CompressedLayerState | ObservedLayer] = {}

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        output = super().attend(module, query, key, value, scaling)
        observation = self.observation(module.layer_idx, scaling)
        for name, compress in self.compressors.items():
            state = compress([observation])[0]
            self.compressed[name] = self.fork() if state is None else state
        self.keys = self.values = self.queries = self.accumulated = None
        return output


def static_address(buffer: Tensor, slots_dim: int | None = None) -> Tensor:
    """``buffer``, marked as written in place at a fixed address by a compiled step: CUDA graphs
    (``reskv.decoding.compiled_step``) skip a graph that mutates any other input, and with
    ``guard=False`` a new cache re-records the graph instead of recompiling it (transformers'
    ``StaticLayer`` marks its buffers the same way). Its ``slots_dim`` is marked dynamic: every
    layer's capacity differs between caches, and left to torch._dynamo's automatic dynamic shapes,
    each layer's would turn dynamic in a recompile of its own."""
    torch._dynamo.mark_static_address(buffer, guard=False)
    if slots_dim is not None:
        torch._dynamo.maybe_mark_dynamic(buffer, slots_dim)
    return buffer


def write_at_position(
    layer: CompressedLayer | StaticSlotsLayer, key_states: Tensor, value_states: Tensor
) -> Tensor:
    """The slots ``[position, position + tokens)`` of a static-slot layer's buffers written with
    ``key_states`` and ``value_states``, claimed on the host first unless a compiled step runs (it
    claimed them before: ``ResKVCache.claim``); returns the slots for the caller's bias write. The
    caller advances ``position`` after it: with one token the slots are ``position`` itself."""
    tokens = key_states.shape[-2]
    if not torch.compiler.is_compiling():
        layer.claim(tokens)
    slots = layer.position if tokens == 1 else layer.position + torch.arange(tokens, device=layer.device)
    layer._keys.index_copy_(2, slots, key_states)
    layer._values.index_copy_(2, slots, value_states)
    return slots


class CompressedLayer(AttendingLayer):
    """Residual entries + main cache after compression, in static-capacity buffers; new tokens are
    appended to main, exact.

    Entries and main cache share one key buffer and one value buffer, ``[entries ; main ; appended ;
    spare]``, with an additive bias row over them: ``beta * log(c_j)`` on the entries, 0 or ``-inf``
    (padding) on main, 0 on appended tokens and ``-inf`` on spare slots (zero-filled). A token is
    written at a device-side slot (``position``, with ``index_copy_``), and attention always spans all
    ``capacity`` slots, the spare ones getting weight 0: a decode step has no host sync and no shape
    that depends on data, which ``torch.compile`` and CUDA graphs need.

    The host keeps its own count of written slots (``claim``): ``update`` claims its tokens when run
    eagerly, and a compiled decode step's caller claims them before the step (``ResKVCache.claim``),
    so that the compiled code never reads a Python counter. A claim beyond the capacity regrows the
    buffers (one copy); ``reserve`` sets the capacity before decoding, so that a generation writes in
    place. ``keys``/``values`` (what ``update`` returns) and ``main_bias`` are views of everything
    after the entries. ``get_seq_length`` reports the uncompressed length, so positions continue from
    it (no re-rotation of cached keys).
    """

    is_sliding = False
    is_compileable = True
    GROWTH_SLOTS = 256  # spare slots of a new layer, and the least a claim regrows by

    def __init__(
        self, state: CompressedLayerState, seq_len: int, rule: DecodeRule, spare_slots: int = GROWTH_SLOTS
    ):
        super().__init__()
        residual = state.residual
        self.residual, self.residual_slots = residual, residual.keys.shape[1]
        main_bias = state.main_bias
        if main_bias is None:
            main_bias = torch.zeros(
                state.main_keys.shape[0], 1, state.main_keys.shape[1], device=state.main_keys.device
            )
        keys, values, bias = joint_buffers(
            residual.keys, residual.values, residual.log_counts,
            state.main_keys, state.main_values, main_bias, rule, spare_slots,
        )  # fmt: skip
        self.filled = self.residual_slots + state.main_keys.shape[1]  # written slots, host side
        self._set_buffers(keys[None], values[None], bias)
        self.position = static_address(torch.tensor([self.filled], device=keys.device))  # next slot
        self.device = keys.device
        # Read by a compiled step instead of the host count (``attend``).
        self.entry_count = static_address(torch.tensor(self.residual_slots, device=keys.device))
        self.evicted_fraction = state.evicted_fraction
        self.rule = plain_rule(rule)
        self.seq_len = seq_len
        self.is_initialized = True

    @classmethod
    def exact(cls, layer: CacheLayerMixin, spare_slots: int) -> CompressedLayer:
        """Every token of an exact layer (the full method's) in a static-capacity layer without entries."""
        keys, values = layer.keys[0], layer.values[0]
        state = CompressedLayerState(
            keys,
            values,
            None,
            ResidualEntries.empty(keys.shape[0], keys),
            kept=keys.new_ones(keys.shape[:2], dtype=torch.bool),
        )
        return cls(state, layer.get_seq_length(), NO_RESIDUAL_RULE, spare_slots)

    def _set_buffers(self, keys: Tensor, values: Tensor, bias: Tensor) -> None:
        self._keys, self._values, self._bias = (static_address(buffer, 2) for buffer in (keys, values, bias))
        self.capacity = keys.shape[2]
        after_entries = slice(self.residual_slots, None)
        self.keys, self.values = keys[:, :, after_entries], values[:, :, after_entries]
        self.main_bias = bias[..., after_entries]

    def _resize(self, capacity: int) -> None:
        """New buffers of ``capacity`` slots holding the written ones (spare: zeros, bias ``-inf``)."""
        written = slice(0, self.filled)
        keys, values = (
            buffer.new_zeros(*buffer.shape[:2], capacity, *buffer.shape[3:])
            for buffer in (self._keys, self._values)
        )
        bias = self._bias.new_full((*self._bias.shape[:-1], capacity), float("-inf"))
        keys[:, :, written], values[:, :, written] = self._keys[:, :, written], self._values[:, :, written]
        bias[..., written] = self._bias[..., written]
        self._set_buffers(keys, values, bias)

    def claim(self, tokens: int) -> None:
        """Count ``tokens`` more written slots on the host, regrowing the buffers if they lack room."""
        if self.filled + tokens > self.capacity:
            self._resize(self.filled + max(tokens, self.GROWTH_SLOTS))
        self.filled += tokens
        self.seq_len += tokens

    def reserve(self, tokens: int) -> None:
        """Make the capacity exactly the written slots plus ``tokens``: a generation of that many tokens
        writes in place, and its attention spans no more spare slots than it will fill."""
        if self.capacity != self.filled + tokens:
            self._resize(self.filled + tokens)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("a compressed layer is built from a prefilled one, never lazily")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        require_single_sequence(key_states)
        slots = write_at_position(self, key_states, value_states)
        self._bias.index_fill_(-1, slots, 0.0)
        self.position.add_(key_states.shape[-2])
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2] + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def fork(self) -> CompressedLayer:
        """A twin to extend without touching this layer: it sees only the written slots, so its first
        ``update`` copies the buffers into new ones."""
        twin = copy.copy(self)
        twin._set_buffers(
            *(buffer[..., : self.filled, :] for buffer in (self._keys, self._values)),
            self._bias[..., : self.filled],
        )
        twin.position = static_address(self.position.clone())
        return twin

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """Attention over this layer's buffers (``key``/``value`` are the ``keys``/``values`` views):
        ``reskv.attention.shared_softmax_attention``, or ``joint_attention`` for the no-shared-softmax
        ablation."""
        require_single_sequence(query)
        if not self.rule.shared_softmax:
            return self.attend_parts(query, scaling, with_residual_share=False)[0]
        queries, bias = self._grouped(query)
        if torch.compiler.is_compiling():
            # One graph whichever layers hold entries (a layer whose heads all chose r = 0 holds none):
            # a graph per pattern of such layers passed torch._dynamo's recompile limit (8), which
            # fullgraph=True makes an error (tests/test_decode_path.py). So the layer is the stacked
            # form's one row, its entries marked by a device count and its gate open whenever its
            # rule has one (without entries log g is added nowhere).
            entries = torch.arange(self._keys.shape[2], device=query.device) < self.entry_count
            gates = RowGates.of([self.rule], query.device)
            output = stacked_shared_softmax_attention(
                queries[None], self._keys, self._values, bias[None], entries, gates, scaling
            )[0]
        else:
            output = shared_softmax_attention(
                queries, self._keys[0], self._values[0], bias, self.residual_slots, scaling, self.rule
            )
        return self._ungrouped(output, query)

    def _grouped(self, query: Tensor) -> tuple[Tensor, Tensor]:
        """``query`` ``[1, H, q, d]`` as ``[H_kv, G * q, d]`` (a GQA group's heads together) and the bias
        it sees; ``q`` tokens fed together (the last ``q`` written) see each other causally."""
        _, num_heads, query_len, head_dim = query.shape
        num_kv_heads = self._keys.shape[1]
        bias = self._bias
        if query_len > 1:
            own_slots = self.position - query_len + torch.arange(query_len, device=query.device)
            bias = bias + causal_bias(own_slots, self.capacity, num_heads // num_kv_heads)
        return query[0].reshape(num_kv_heads, -1, head_dim), bias

    @staticmethod
    def _ungrouped(output: Tensor, query: Tensor) -> Tensor:
        _, num_heads, query_len, head_dim = query.shape
        return output.reshape(num_heads, query_len, head_dim).transpose(0, 1)[None].to(query.dtype)

    def attend_parts(
        self, query: Tensor, scaling: float, with_residual_share: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The attention output ``[1, q, H, d]`` and the residual share ``[H, q]`` of ``query``
        ``[1, H, q, d]`` (``reskv.attention.joint_attention``); the share is ``None`` unless asked
        for."""
        queries, bias = self._grouped(query)
        output, residual_share = joint_attention(
            queries,
            self._keys[0],
            self._values[0],
            bias,
            self.residual_slots,
            scaling,
            self.rule,
            self.evicted_fraction,
            with_residual_share,
        )
        if residual_share is not None:
            residual_share = residual_share.reshape(query.shape[1], query.shape[2])
        return self._ungrouped(output, query), residual_share


class StaticSlotsLayer(AttendingLayer):
    """Rows of one batch in static-capacity buffers that a compiled step writes in place (as
    ``CompressedLayer`` does for one): the spare slots that every row fills at the same slot, one per
    fed token, at a device-side ``position``, after what each row holds; the buffers never grow.
    ``feed_bias`` is the bias new slots get per row: 0, or ``-inf`` for a row that a forward only
    passes through (a query-aware row while the query-agnostic rows are fed the question). A subclass
    builds ``_keys``, ``_values``, ``_bias``, ``feed_bias``, ``position``, ``filled``, ``seq_len`` and
    ``capacity``, and attends."""

    is_compileable = True
    kind = "static"  # what the layer is called in its errors

    def claim(self, tokens: int) -> None:
        """Count ``tokens`` more written slots on the host (``CompressedLayer.claim``)."""
        if self.filled + tokens > self.capacity:
            raise ValueError(
                f"{tokens} tokens exceed the {self.kind} layer's {self.capacity - self.filled} spare slots"
            )
        self.filled += tokens
        self.seq_len += tokens

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError(f"a {self.kind} layer is built from other layers' states, never lazily")

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        tokens = key_states.shape[-2]
        slots = write_at_position(self, key_states, value_states)
        self._bias.index_copy_(3, slots, self.feed_bias.expand(*self._bias.shape[:3], tokens))
        self.written(slots, tokens)
        self.position.add_(tokens)
        return self._keys, self._values

    def written(self, slots: Tensor, tokens: int) -> None:
        """What a subclass records beside the keys and values of ``tokens`` written at ``slots``."""

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity + query_length, 0

    def get_max_length(self) -> int:
        return -1


def windowed_attention(query: Tensor, key: Tensor, value: Tensor, window: int, scaling: float) -> Tensor:
    """Exact sliding-window causal attention ``[1, q, H, d]`` of the last ``q`` of ``k`` positions:
    the query at position ``p`` sees the keys at ``p - window < j <= p`` (transformers'
    ``masking_utils.sliding_window_overlay`` on a causal mask). Queries go ``window`` at a time, each
    chunk over the keys it can see, so no ``q x k`` mask exists (a 32K prompt's would be 1 GiB)."""
    query_len, key_len = query.shape[2], key.shape[2]
    outputs = []
    for start in range(0, query_len, window):
        stop = min(start + window, query_len)
        last = key_len - query_len + stop  # one past the chunk's last position
        first = max(0, key_len - query_len + start - window + 1)
        query_positions = torch.arange(last - (stop - start), last, device=query.device)
        key_positions = torch.arange(first, last, device=query.device)
        distance = query_positions[:, None] - key_positions[None, :]
        visible = (distance >= 0) & (distance < window)
        with sdpa_kernel(SDPA_BACKENDS) if query.is_cuda else contextlib.nullcontext():
            outputs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    query[:, :, start:stop],
                    key[:, :, first:last],
                    value[:, :, first:last],
                    attn_mask=visible,
                    scale=scaling,
                    enable_gqa=True,
                )
            )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


class WindowedLayer(DynamicLayer, AttendingLayer):
    """A sliding-window layer, exact and never compressed: after each forward it keeps the last
    ``window - 1`` tokens, all the next token can see, as transformers' ``DynamicSlidingWindowLayer``
    does (``cache_utils.py``); ``update`` returns them with the new tokens, which attend as the model
    does (``windowed_attention``). ``update`` concatenates, so a fork shares the tensors."""

    is_sliding = True

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.seq_len = 0  # tokens seen, the positions the next one continues from

    def fork(self) -> WindowedLayer:
        twin = WindowedLayer(self.window)
        twin.keys, twin.values, twin.is_initialized = self.keys, self.values, self.is_initialized
        if self.is_initialized:
            twin.device = self.device
        twin.seq_len = self.seq_len
        return twin

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.seq_len += key_states.shape[-2]
        return super().update(key_states, value_states)

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        require_single_sequence(query)
        output = windowed_attention(query, key, value, self.window, scaling)
        dropped = self.keys.shape[-2] - (self.window - 1)
        if dropped > 0:  # a copy: a view would keep the whole forward's keys alive
            self.keys, self.values = (held[:, :, dropped:].clone() for held in (self.keys, self.values))
        return output

    @property
    def slots(self) -> int:
        """Tokens held: the last ``window - 1``, or every one of a shorter prompt."""
        return self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots + query_length, max(self.seq_len - self.slots, 0)

    def get_max_length(self) -> int:
        return self.window


class StaticWindowedLayer(StaticSlotsLayer):
    """Sliding-window layers of ``B`` rows (one generation, or a grid's beside its view layers,
    ``reskv.views.ViewLayer``) in static-capacity buffers that a compiled step writes in place: each
    row's held tokens (``WindowedLayer``), ``-inf`` bias up to the longest row's, then ``spare_slots``
    that every row fills at the same slot, at a device-side ``position``. Each slot records the
    position of its token, so a query at ``p`` sees exactly the slots at ``p - window < j <= p``
    whatever the row held: rows that held different prompts (the whole prompt, or the context to be
    fed the question) stay exact.
    ``feed_bias`` and ``claim`` are ``StaticSlotsLayer``'s."""

    is_sliding = True
    kind = "static windowed"

    def __init__(self, rows: Sequence[WindowedLayer], seq_len: int, spare_slots: int):
        super().__init__()
        self.window = rows[0].window
        self.seq_len, self.filled = seq_len, max(row.slots for row in rows)
        first = rows[0].keys
        batch, num_kv_heads, head_dim = len(rows), first.shape[1], first.shape[-1]
        self.capacity = self.filled + spare_slots
        device = self.device = first.device
        keys = first.new_zeros(batch, num_kv_heads, self.capacity, head_dim)
        values = torch.zeros_like(keys, dtype=rows[0].values.dtype)
        bias = torch.full((batch, 1, 1, self.capacity), float("-inf"), device=device)
        positions = torch.zeros(batch, 1, 1, self.capacity, dtype=torch.long, device=device)
        for row, layer in enumerate(rows):
            held = slice(0, layer.slots)
            keys[row, :, held], values[row, :, held] = layer.keys[0], layer.values[0]
            bias[row, ..., held] = 0.0
            positions[row, ..., held] = torch.arange(
                layer.seq_len - layer.slots, layer.seq_len, device=device
            )
        self._keys, self._values = (static_address(buffer, 2) for buffer in (keys, values))
        self._bias, self._positions = (static_address(buffer, 3) for buffer in (bias, positions))
        self.feed_bias = static_address(torch.zeros(batch, 1, 1, 1, device=device))
        self.position = static_address(torch.tensor([self.filled], device=device))  # the next slot
        self.next_position = static_address(torch.tensor([seq_len], device=device))  # its token's
        for batched in (keys, values, bias, positions, self.feed_bias):
            torch._dynamo.maybe_mark_dynamic(batched, 0)
        self.is_initialized = True

    def written(self, slots: Tensor, tokens: int) -> None:
        """Each written slot's token position, the next token's advanced past them."""
        positions = (self.next_position + (slots - self.position)).expand(*self._positions.shape[:3], tokens)
        self._positions.index_copy_(3, slots, positions)
        self.next_position.add_(tokens)

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """SDPA over every slot, each query seeing the slots whose positions lie in its window."""
        query_len = query.shape[2]
        query_positions = (self.next_position - query_len + torch.arange(query_len, device=self.device))[
            :, None
        ]
        distance = query_positions - self._positions  # [B, 1, q, capacity]
        visible = (distance >= 0) & (distance < self.window)
        mask = self._bias.masked_fill(~visible, float("-inf")).to(query.dtype)
        with sdpa_kernel(SDPA_BACKENDS) if query.is_cuda else contextlib.nullcontext():
            output = torch.nn.functional.scaled_dot_product_attention(
                query, self._keys, self._values, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        return output.transpose(1, 2).contiguous()


class ResKVCache(Cache):
    """A cache of ``AttendingLayer`` objects, one per model layer."""

    def __init__(self, layers: list[AttendingLayer]):
        super().__init__(layers=layers)

    @classmethod
    def for_prefill(
        cls, windows: Sequence[int | None], observation_window: int, accumulate: bool
    ) -> ResKVCache:
        """An empty cache for a model whose layers have these sliding ``windows`` (``None``: full
        attention, observed for compression; a window: a ``WindowedLayer``)."""
        return cls(
            [
                ObservedLayer(observation_window, accumulate) if window is None else WindowedLayer(window)
                for window in windows
            ]
        )

    @classmethod
    def compressing(
        cls,
        windows: Sequence[int | None],
        observation_window: int,
        accumulate: bool,
        compressors: Mapping[Hashable, BatchCompressor],
    ) -> ResKVCache:
        """A cache for one prefill forward that compresses each full-attention layer as it runs
        (``CompressingLayer``); a sliding-window layer stays a ``WindowedLayer``."""
        return cls(
            [
                CompressingLayer(observation_window, accumulate, compressors)
                if window is None
                else WindowedLayer(window)
                for window in windows
            ]
        )

    def fork(self) -> ResKVCache:
        """An exact copy to extend (more prompt tokens or decoding) without touching this one."""
        return ResKVCache([layer.fork() for layer in self.layers])

    @torch.inference_mode()
    def feeding(self, rows: Tensor) -> None:
        """Which rows of a batch the next forwards write into (``StaticSlotsLayer.feed_bias``):
        ``rows`` ``[B]`` bool; the others' new slots get ``-inf``."""
        bias = torch.zeros(rows.shape, device=rows.device).masked_fill_(~rows, float("-inf"))[
            :, None, None, None
        ]
        for layer in self.layers:
            layer.feed_bias.copy_(bias)

    def claim(self, tokens: int) -> None:
        """Count on the host the ``tokens`` a compiled step is about to write (``CompressedLayer.claim``)."""
        for layer in self.layers:
            layer.claim(tokens)

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more in every compressed layer (``CompressedLayer.reserve``)."""
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                layer.reserve(tokens)

    def slots(self) -> list[list[int]]:
        """Attended slots per layer and KV head (main, padding excluded, plus residual entries)."""
        counts = []
        for layer in self.layers:
            num_kv_heads, length = layer.keys.shape[1], layer.keys.shape[2]
            if isinstance(layer, WindowedLayer):
                counts.append([layer.slots] * num_kv_heads)
                continue
            if not isinstance(layer, CompressedLayer):
                counts.append([length] * num_kv_heads)  # every token: nothing to read from the device
                continue
            main = torch.isfinite(layer.main_bias[:, 0]).sum(-1)  # padding and spare slots are -inf
            counts.append((main + layer.residual.entries_per_head).tolist())
        return counts


# What a model may pass the attention function besides the tensors that no form of it needs: they
# describe the positions or the call, which the cache already knows (transformers' model code passes
# ``position_ids`` and ``use_cache`` through; ``is_causal`` and ``output_attentions`` at their values
# here). Every other argument changes the attention and is read below or refused (``refused_arguments``).
INERT_ARGUMENTS = {
    "position_ids": None,
    "use_cache": None,
    "cache_position": None,
    "is_causal": True,
    "output_attentions": False,
}


def refused_arguments(dropout: float, kwargs: dict) -> list[str]:
    """``name=value`` of each argument a model passes the attention function that no form of it
    implements (``reskv_attention``): a dropout above 0, and any argument other than the cache, the
    layer's ``sliding_window`` and ``INERT_ARGUMENTS`` at an inert value, whose value is not ``None``
    (Gemma 2's ``softcap``, the attention sinks ``s_aux``, ...)."""
    refused = [f"dropout={dropout!r}"] if dropout else []
    for name, given in kwargs.items():
        if name in (CACHE_KWARG, "sliding_window") or given is None:
            continue
        if name in INERT_ARGUMENTS and INERT_ARGUMENTS[name] in (None, given):
            continue
        refused.append(f"{name}={given!r}")
    return refused


def reskv_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling=None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """The registered attention function: delegates to the cache layer, or plain causal attention.

    The model's own ``sliding_window`` for the layer (transformers passes it to every attention
    function of a windowed model) must be the cache layer's ``window``: a layer attended with the
    wrong kind is an error, never a silently different model. So is an argument that changes the
    attention and that no form here implements (``refused_arguments``: Gemma 2's logit soft-capping,
    ``softcap``): refused, never dropped, in every form, since every form is reached through this
    function; a backbone's load runs it (``reskv.decoding.check_full_cache``), so such a model is
    refused at load."""
    refused = refused_arguments(dropout, kwargs)
    if refused:
        raise ValueError(
            f"layer {module.layer_idx} of {type(module).__name__} passes its attention {', '.join(refused)}, "
            "which the ResKV attention does not implement (every form: prefill, decode, views, the "
            "kernels); a model that needs it cannot run on this engine"
        )
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    cache = kwargs.get(CACHE_KWARG)
    window = kwargs.get("sliding_window")
    if cache is None:
        if window is not None:
            return windowed_attention(query, key, value, window, scaling), None
        return causal_attention(module, query, key, value, scaling), None
    layer = cache.layers[module.layer_idx]
    if layer.window != window:
        raise ValueError(
            f"layer {module.layer_idx} attends with sliding_window={window} but its cache layer "
            f"({type(layer).__name__}) has window={layer.window}: the cache was built for other layer "
            "kinds than the model's (reskv.model.layer_windows)"
        )
    return layer.attend(module, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, reskv_attention)
