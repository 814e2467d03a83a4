"""A sample's grid decoded as views of its one prefilled cache (reskv.md, "Decoding a grid").

Every configuration of one prompt keeps a subset of the same prefilled keys and values: the
query-agnostic context cache is a prefix of the query-aware one, byte for byte (the aware cache is the
context cache extended), and a method that adjusts values (CaM) changes only its values. So a row,
per layer, is a keep mask over the shared slots (``RowView``), its residual entries with their log
counts, the slots it appends (the query-agnostic question, the decoded tokens) and its rule's gate;
no row copies its main keys or values. One forward a step decodes every row (``ViewLayer``): the
shared keys are read once for all rows' queries, each row's entries and appended slots beside them,
and the shared softmax (reskv.md) combines the parts.

Each part gives, per query, a partial softmax (``Partial``: its largest logit, the sum of
``exp(logit - max)``, the values weighed by those): the shared slots (``shared_partial``, masked per
row), the entries of every row laid end to end in one pool (``entry_partial``, each row reading its
own segment), and the row's appended slots (``appended_partial``). The main part (shared and appended
merged, ``merged``) gives ``p_max = 1 / sum exp(a - max(a))``, hence ``log g``, which shifts the
entries' part; the two are merged and normalised once. That is the rule of ``shared_softmax_attention``
up to the rounding of a reduction in another order. On CUDA with Triton a decode step's shared and
entry parts over a half-precision cache are ``reskv.decode_kernel``'s split-K kernel instead
(``CUDA_FUSED_VIEWS``, ``decode_kernel.VIEW_DTYPES``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reskv.attention import RowGates, population_bias
from reskv.cache import (
    ObservedLayer,
    ResKVCache,
    StaticSlotsLayer,
    StaticWindowedLayer,
    WindowedLayer,
    causal_bias,
    static_address,
)
from reskv.compress import CompressedLayerState, kept_positions
from reskv.decode_rule import NO_RESIDUAL_RULE, DecodeRule
from reskv.decoding import bucketed

# On CUDA with Triton, a decode step's shared slots and entry pool are ``reskv.decode_kernel``'s split-K
# kernel (keys and values read once in their dtype, no fp32 logits written); off, the torch form.
CUDA_FUSED_VIEWS = True
# The values tensors a compiled step reads (``SharedSlots.values``): the prefilled values and the
# adjusted values of each method and setting that adjust them (the paper grid's CaM in two settings),
# the prefilled values again where a batch has fewer, so that one graph serves every batch; a batch
# with more compiles a graph of its own.
VALUE_TENSORS = 3


@dataclass
class RowView:
    """One configuration's layer as a view of the sample's shared prefilled layer: the first ``seen``
    shared slots (the prompt it compressed: the whole prompt, or the context), of which it keeps
    ``keep`` (``[H_kv, seen]`` bool; ``None``: all), its residual entries (``None``: none), and where
    its main values differ from the shared ones (a method that adjusts values, CaM) those values at the
    kept positions (``values``, in ``kept_positions`` order) under ``values_key``, the same for every
    row whose adjusted values are one tensor (reskv.md)."""

    seen: int
    keep: Tensor | None
    entries: tuple[Tensor, Tensor, Tensor] | None  # keys, values [H_kv, r, d], bias [H_kv, r] fp32
    rule: DecodeRule
    values_key: Hashable | None = None
    values: Tensor | None = None

    @classmethod
    def of(
        cls, layer: CompressedLayerState | ObservedLayer, rule: DecodeRule, values_key: Hashable | None
    ) -> RowView:
        """A method's layer (``Method.compressed_layers``) as a view: a compressed state's kept set,
        entries (their population bias by ``rule``) and, under a ``values_key``, its main values; an
        exact layer (the full cache, a budget that covers the prompt) keeps every slot it holds."""
        if not isinstance(layer, CompressedLayerState):
            return cls(layer.keys.shape[2], None, None, NO_RESIDUAL_RULE)
        residual, entries = layer.residual, None
        if residual.keys.shape[1]:
            bias = population_bias(residual.log_counts, rule)
            entries = residual.keys, residual.values, bias
        values = layer.main_values if values_key is not None else None
        return cls(layer.kept.shape[1], layer.kept, entries, rule, values_key, values)


# A part's partial softmax per query: its largest logit ``[..., Q, 1]`` (``-inf`` where it has no
# visible slot), the sum of ``exp(logit - max)`` and the values weighed by those ``[..., Q, d]`` (0
# where it has no visible slot), in fp32.
Partial = tuple[Tensor, Tensor, Tensor]


# The lowest fp32 number: a maximum clamped to it (``-inf`` where a row sees no slot of a part) is a
# reference for ``exp(logit - reference)`` that is never ``-inf - -inf``, and that no visible logit nears.
LOWEST = torch.finfo(torch.float32).min


def merged(first: Partial, second: Partial) -> Partial:
    """The partial softmax of two parts' slots together: each referred to the larger maximum (a part
    without a visible slot weighs 0, both without: all 0)."""
    maximum = torch.maximum(first[0], second[0])
    reference = maximum.clamp(min=LOWEST)
    first_scale, second_scale = (first[0] - reference).exp_(), (second[0] - reference).exp_()
    total = torch.addcmul(first[1] * first_scale, second[1], second_scale)
    return maximum, total, torch.addcmul(first[2] * first_scale, second[2], second_scale)


def softmax_partial(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``logits``' maximum, sum of ``exp(logit - max)``, and the weights (``logits``, overwritten)."""
    maximum = logits.amax(dim=-1, keepdim=True)
    weights = logits.sub_(maximum.clamp(min=LOWEST)).exp_()
    return maximum, weights.sum(dim=-1, keepdim=True), weights


def grouped(queries: Tensor) -> Tensor:
    """``queries`` ``[B, H_kv, Q, d]`` as ``[H_kv, B * Q, d]``: every row's queries of a KV head together,
    what one product with a pool's keys takes (one copy a layer)."""
    batch, heads, rows, dim = queries.shape
    return queries.transpose(0, 1).reshape(heads, batch * rows, dim)


def grouped_logits(queries: Tensor, keys: Tensor, scaling: float, batch: int) -> Tensor:
    """The ``grouped`` queries of ``batch`` rows against one pool's ``keys`` ``[H_kv, P, d]``: fp32
    logits ``[H_kv, B, Q, P]``, the keys read once for all rows, in their own dtype on CUDA."""
    if keys.is_cuda and keys.dtype != torch.float32:
        logits = torch.bmm(queries, keys.transpose(1, 2), out_dtype=torch.float32)
    else:
        logits = torch.bmm(queries.float(), keys.float().transpose(1, 2))
    return logits.mul_(scaling).view(queries.shape[0], batch, -1, keys.shape[1])


def weighed(weights: Tensor, values: Tensor) -> Tensor:
    """``weights`` ``[H_kv, n, Q, P]`` (fp32) times ``values`` ``[H_kv, P, d]``: ``[H_kv, n, Q, d]`` fp32,
    the values read in their own dtype on CUDA (fp32 accumulation), in fp32 on CPU."""
    heads, rows, queries, slots = weights.shape
    flat = weights.reshape(heads, rows * queries, slots)
    if values.is_cuda and values.dtype != torch.float32:
        product = torch.bmm(flat.to(values.dtype), values, out_dtype=torch.float32)
    else:
        product = torch.bmm(flat, values.float())
    return product.view(heads, rows, queries, -1)


@dataclass
class SharedSlots:
    """A layer's shared prefilled slots as every row of a batch reads them: the keys ``[H_kv, S, d]``,
    the slots each row does not see, ``hidden`` ``[B, H_kv, S]`` (its keep mask inverted), and the
    values the rows read, ``(first, last, values)`` for rows ``[first, last)`` (the shared values, or a
    method's adjusted ones). What a compiled step reads instead, no host integer of the rows in its
    graph: ``values``, the prefilled values first, then each adjusted tensor, at least
    ``VALUE_TENSORS`` (the prefilled values again where there are fewer), and each row's index into
    them, ``row_source`` ``[B]``."""

    keys: Tensor
    hidden: Tensor
    sources: list[tuple[int, int, Tensor]]
    values: list[Tensor]
    row_source: Tensor


def shared_partial(queries: Tensor, shared: SharedSlots, scaling: float) -> Partial:
    """The shared slots' partial softmax ``[H_kv, B, Q, ...]`` of ``grouped`` queries, each row seeing the
    slots it keeps."""
    logits = grouped_logits(queries, shared.keys, scaling, shared.hidden.shape[0])
    logits.masked_fill_(shared.hidden.transpose(0, 1)[:, :, None, :], float("-inf"))
    maximum, total, weights = softmax_partial(logits)
    if torch.compiler.is_compiling():  # every row's product with each values tensor, each row's kept
        output = weighed(weights, shared.values[0])
        for index, values in enumerate(shared.values[1:], 1):
            chosen = (shared.row_source == index)[None, :, None, None]
            output = torch.where(chosen, weighed(weights, values), output)
        return maximum, total, output
    if len(shared.sources) == 1:
        return maximum, total, weighed(weights, shared.sources[0][2])
    output = torch.cat([weighed(weights[:, first:last], values) for first, last, values in shared.sources], 1)
    return maximum, total, output


@dataclass
class EntryPool:
    """Every row's residual entries of one layer laid end to end (no row padded to another's): keys and
    values ``[H_kv, E, d]``, their population bias ``[H_kv, E]`` (``-inf`` on unused slots), and each
    row's segment as a mask ``outside`` ``[B, E]`` (True off its own entries) and as bounds ``first``,
    ``last`` ``[B]`` (the kernel's)."""

    keys: Tensor
    values: Tensor
    bias: Tensor
    outside: Tensor
    first: Tensor
    last: Tensor

    @property
    def slots(self) -> int:
        return self.keys.shape[1]


def entry_partial(queries: Tensor, pool: EntryPool, scaling: float) -> Partial:
    """The entries' partial softmax ``[H_kv, B, Q, ...]`` of ``grouped`` queries, each row seeing its own
    segment."""
    logits = grouped_logits(queries, pool.keys, scaling, pool.outside.shape[0]).add_(
        pool.bias[:, None, None, :]
    )
    logits.masked_fill_(pool.outside[None, :, None, :], float("-inf"))
    maximum, total, weights = softmax_partial(logits)
    return maximum, total, weighed(weights, pool.values)


def appended_partial(queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scaling: float) -> Partial:
    """Each row's appended slots (``keys``/``values`` ``[B, H_kv, A, d]``, ``bias`` broadcastable to
    ``[B, H_kv, Q, A]``) for its ``queries`` ``[B, H_kv, Q, d]``: their partial softmax, as
    ``[H_kv, B, Q, ...]`` views; the keys and values read in their own dtype on CUDA."""
    batch, heads, rows, dim = queries.shape
    flat_queries, flat_keys = queries.flatten(0, 1), keys.flatten(0, 1).transpose(1, 2)
    if keys.is_cuda and keys.dtype != torch.float32:
        logits = torch.bmm(flat_queries, flat_keys, out_dtype=torch.float32)
    else:
        logits = torch.bmm(flat_queries.float(), flat_keys.float())
    logits = logits.view(batch, heads, rows, -1).mul_(scaling).add_(bias)
    maximum, total, weights = softmax_partial(logits)
    flat_weights, flat_values = weights.flatten(0, 1), values.flatten(0, 1)
    if values.is_cuda and values.dtype != torch.float32:
        output = torch.bmm(flat_weights.to(values.dtype), flat_values, out_dtype=torch.float32)
    else:
        output = torch.bmm(flat_weights, flat_values.float())
    output = output.view(batch, heads, rows, dim)
    return maximum.transpose(0, 1), total.transpose(0, 1), output.transpose(0, 1)


def view_attention(shared: Partial, entries: Partial | None, appended: Partial, gates: RowGates) -> Tensor:
    """The shared softmax (reskv.md) of every row from its parts' partial softmaxes ``[H_kv, B, Q, ...]``:
    the main part is the shared and the appended slots, whose sum over its own maximum is ``1 / p_max``
    (``reskv.attention.gate_values``); ``log g`` (``RowGates.log_gate``: 0 where a row's gate is not
    open) shifts the entries' part, and one normalisation takes both. Output ``[B, H_kv, Q, d]`` fp32."""
    main_max, main_sum, main_output = merged(shared, appended)
    if entries is None:
        return (main_output / main_sum).transpose(0, 1)
    # main_sum >= 1 (its largest weight is exp(0)): every row sees at least one main slot.
    log_gate = gates.log_gate(main_sum.reciprocal().transpose(0, 1)).transpose(0, 1)
    entry_max, entry_sum, entry_output = entries
    _, total, output = merged(
        (main_max, main_sum, main_output), (entry_max + log_gate, entry_sum, entry_output)
    )
    return (output / total).transpose(0, 1)


class ViewLayer(StaticSlotsLayer):
    """One full-attention layer of a batch of a sample's rows, each a view of the shared prefilled layer
    (``RowView``): the shared keys and values as the prefill holds them (no copy), each row's keep mask,
    the rows' entries in one pool, and the appended slots in static-capacity buffers that every row
    fills at the same slot (``StaticSlotsLayer``: ``feed_bias``, ``claim``; a query-aware row passes
    through the question's forward with its new slots masked). Rows must be ordered so that those of
    one ``values_key`` are consecutive (``reskv.batching.values_order``).

    For the compiled step (``compiled``) the entry pool always exists and it and the appended slots
    take multiples of ``reskv.decoding.CAPACITY_BUCKET`` slots (no size of 0 or 1, which torch._dynamo
    would give graphs of their own), every dimension that differs between batches is marked dynamic
    (the rows, the shared slots, the pool's and the appended slots), and the rows read
    ``VALUE_TENSORS`` values tensors or more (``SharedSlots``): one graph serves every batch."""

    is_sliding = False
    kind = "view"

    def __init__(
        self,
        rows: Sequence[RowView],
        keys: Tensor,
        values: Tensor,
        gates: RowGates,
        seq_len: int,
        spare_slots: int,
        compiled: bool = False,
    ):
        super().__init__()
        heads, slots, dim = keys.shape
        batch, device = len(rows), keys.device
        self.device, self.gates, self.seq_len = device, gates, seq_len
        hidden = torch.ones(batch, heads, slots, dtype=torch.bool, device=device)
        for row, view in enumerate(rows):
            hidden[row, :, : view.seen] = False if view.keep is None else ~view.keep
        sources, by_key, row_source = [], {None: dynamic(values, 1)}, []
        for first, last, key in consecutive_runs([view.values_key for view in rows]):
            if key not in by_key:
                by_key[key] = dynamic(adjusted_values(rows[first:last], values), 1)
            sources.append((first, last, by_key[key]))
            row_source += [list(by_key).index(key)] * (last - first)
        tensors = list(by_key.values())
        # The padding views are marked as the tensor they view: an unmarked one would fix the shared
        # slots' dimension to this prompt's length, and the next prompt would compile another graph.
        tensors += [dynamic(tensors[0].view_as(tensors[0]), 1) for _ in range(VALUE_TENSORS - len(tensors))]
        row_source = dynamic(torch.tensor(row_source, device=device), 0)
        self.shared = SharedSlots(dynamic(keys, 1), dynamic(hidden, 0, 2), sources, tensors, row_source)
        self.entries = entry_pool(rows, keys, compiled)
        spare_slots = bucketed(spare_slots) if compiled else spare_slots
        self.filled, self.capacity = 0, spare_slots  # the appended slots
        self._keys = dynamic(keys.new_zeros(batch, heads, spare_slots, dim), 0, 2)
        self._values = dynamic(values.new_zeros(batch, heads, spare_slots, dim), 0, 2)
        self._bias = dynamic(torch.full((batch, 1, 1, spare_slots), float("-inf"), device=device), 0, 3)
        self.feed_bias = dynamic(torch.zeros(batch, 1, 1, 1, device=device), 0)
        self.position = static_address(torch.zeros(1, dtype=torch.long, device=device))  # the next slot
        self.is_initialized = True

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
        """Each row's shared-softmax attention over its view; ``q`` tokens fed together (the last ``q``
        appended) see each other causally."""
        batch, num_heads, query_len, head_dim = query.shape
        num_kv_heads = self._keys.shape[1]
        queries = query.reshape(batch, num_kv_heads, -1, head_dim)
        bias = self._bias
        if query_len > 1:
            own_slots = self.position - query_len + torch.arange(query_len, device=query.device)
            bias = bias + causal_bias(own_slots, self.capacity, num_heads // num_kv_heads)
        shared, entries = self.pool_partials(queries, scaling)
        appended = appended_partial(queries, self._keys, self._values, bias, scaling)
        output = view_attention(shared, entries, appended, self.gates)
        return output.reshape(batch, num_heads, query_len, head_dim).transpose(1, 2).to(query.dtype)

    def pool_partials(self, queries: Tensor, scaling: float) -> tuple[Partial, Partial | None]:
        """The shared slots' and the entry pool's partial softmaxes: ``reskv.decode_kernel``'s kernel for
        one decoded token on CUDA (``CUDA_FUSED_VIEWS``), else the torch form."""
        entries = self.entries
        if queries.is_cuda and CUDA_FUSED_VIEWS and not torch.compiler.is_compiling():
            from reskv import decode_kernel  # imports Triton (slow to import), which the CPU never runs

            if decode_kernel.available() and decode_kernel.views_fit(queries, len(self.shared.sources)):
                return decode_kernel.view_partials(queries, self.shared, entries, scaling)
        queries = grouped(queries)
        shared = shared_partial(queries, self.shared, scaling)
        return shared, None if entries is None else entry_partial(queries, entries, scaling)


def consecutive_runs(keys: Sequence[Hashable]) -> list[tuple[int, int, Hashable]]:
    """``(first, last, key)`` of each run of equal consecutive ``keys``."""
    runs: list[tuple[int, int, Hashable]] = []
    for index, key in enumerate(keys):
        if runs and runs[-1][2] == key:
            runs[-1] = (runs[-1][0], index + 1, key)
        else:
            runs.append((index, index + 1, key))
    return runs


def adjusted_values(rows: Sequence[RowView], shared_values: Tensor) -> Tensor:
    """The adjusted values ``[H_kv, S, d]`` that ``rows`` (one ``values_key``) read: each row's values put
    back at its kept positions (``kept_positions``' order, its padding slots at evicted positions of the
    same tensor), zeros where no row keeps a slot. A value two rows put at one position must agree (the
    method adjusts values once for every configuration of a setting, CaM's merge ignoring the kept
    set): otherwise a ``ValueError``, read once per layer."""
    source = torch.zeros_like(shared_values)
    written = torch.zeros(shared_values.shape[:2], dtype=torch.bool, device=shared_values.device)
    disagree = torch.zeros((), dtype=torch.bool, device=shared_values.device)
    for view in rows:
        positions = kept_positions(view.keep, view.values.shape[1])
        index = positions[..., None].expand(-1, -1, source.shape[-1])
        before = written.gather(1, positions)
        disagree |= ((source.gather(1, index) != view.values) & before[..., None]).any()
        source.scatter_(1, index, view.values)
        written.scatter_(1, positions, True)
    if bool(disagree):
        raise ValueError(
            f"rows of values key {rows[0].values_key!r} adjust the values of one position differently: a "
            "view of the shared cache holds one adjusted value per position and setting"
        )
    return source


def entry_pool(rows: Sequence[RowView], keys: Tensor, compiled: bool = False) -> EntryPool | None:
    """The rows' entries laid end to end (``EntryPool``), in the keys' dtype; ``None`` when no row has
    any. For the compiled step (``ViewLayer``) the pool always exists, padded with unused slots (bias
    ``-inf``, outside every row) to a multiple of ``CAPACITY_BUCKET``."""
    segments = [view.entries[0].shape[1] if view.entries else 0 for view in rows]
    if not any(segments) and not compiled:
        return None
    heads, _, dim = keys.shape
    padding = bucketed(max(sum(segments), 1)) - sum(segments) if compiled else 0
    unused = (keys.new_zeros(heads, padding, dim),) * 2 + (keys.new_full((heads, padding), float("-inf")),)
    parts = [view.entries for view in rows if view.entries] + [unused]
    pool_keys, pool_values, bias = (
        torch.cat([part[which].to(keys.dtype if which < 2 else torch.float32) for part in parts], 1)
        for which in range(3)
    )
    bounds = torch.tensor(segments).cumsum(0)
    first, last = (bound.to(keys.device) for bound in (bounds - torch.tensor(segments), bounds))
    slot = torch.arange(pool_keys.shape[1], device=keys.device)
    outside = (slot[None, :] < first[:, None]) | (slot[None, :] >= last[:, None])
    return EntryPool(
        dynamic(pool_keys, 1), dynamic(pool_values, 1), dynamic(bias, 1), dynamic(outside, 0, 1),
        dynamic(first, 0), dynamic(last, 0),
    )  # fmt: skip


def dynamic(tensor: Tensor, *dims: int) -> Tensor:
    """``tensor`` at a static address for a compiled step (``reskv.cache.static_address``: CUDA graphs
    copy no input that is so marked), ``dims`` marked dynamic (they differ between batches)."""
    static_address(tensor)
    for dim in dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


@torch.inference_mode()
def view_cache(
    shared_layers: Sequence[ObservedLayer | WindowedLayer],
    rows: Sequence[Sequence[RowView | WindowedLayer]],
    rules: Sequence[DecodeRule],
    seq_len: int,
    spare_slots: int,
    compiled: bool = False,
) -> ResKVCache:
    """A batch's cache: ``rows[b][l]`` is row ``b``'s view of layer ``l`` of ``shared_layers`` (the
    prefilled cache every row's view reads: the whole prompt's, or the context's when no row is
    query-aware), its rule ``rules[b]``; a sliding-window layer's rows are their own windows
    (``StaticWindowedLayer``, as a single generation holds them). Every row continues at position
    ``seq_len``, with room for ``spare_slots`` fed tokens; laid out for the compiled step where
    ``compiled`` (``ViewLayer``). Its tensors are inference tensors, as the prefilled ones are (a
    compiled step guards on the kind)."""
    device = next(layer.keys.device for layer in shared_layers)
    gates = RowGates.of(list(rules), device)
    for column in gates.columns:
        torch._dynamo.maybe_mark_dynamic(column, 0)
    layers = []
    for shared, layer_rows in zip(shared_layers, zip(*rows, strict=True), strict=True):
        if isinstance(shared, WindowedLayer):
            layers.append(StaticWindowedLayer(layer_rows, seq_len, spare_slots))
        else:
            layers.append(
                ViewLayer(layer_rows, shared.keys[0], shared.values[0], gates, seq_len, spare_slots, compiled)
            )
    return ResKVCache(layers)
