"""A compression method (a base scorer at a ratio, optionally with a residual) and how it compresses
a prefilled cache: layer by layer batches, each batch's ResKV work stacked into one copy.

    method = Method("snapkv+reskv", 0.9, SnapKV(), ResidualConfig())
    cache, stats = method.compress(prefilled_cache, scaling)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reskv.cache import CompressedLayer, ObservedLayer, ResKVCache, WindowedLayer
from reskv.compress import CompressedLayerState, SharedLayers, compress_layers
from reskv.config import DEFAULT_OBSERVATION_WINDOW, ResidualConfig
from reskv.decode_rule import NO_RESIDUAL_RULE, DecodeRule
from reskv.scoring import LayerObservation, TokenScorer

# Bound on the keys and values of the layers compressed together: ResKV's work on them is stacked
# into one copy, so its ops are paid once per batch, not once per layer (a GPU's host pays the same
# per op whatever its size). 4 GiB holds all 32 layers of an 8B-shaped model up to 32K tokens in bf16.
LAYER_BATCH_BYTES = 4 << 30
# On CPU stacking saves per-op time only for small layers, while a large stack's transients fall out
# of the caches; 8 MiB holds one layer of the embedded model at 4K (results/README.md has the timings).
# The bits are the same either way (tests/test_in_prefill.py).
CPU_LAYER_BATCH_BYTES = 8 << 20


@dataclass(frozen=True)
class Method:
    """A compression method: a base scorer at a ratio, optionally with a residual cache.

    ``scorer is None`` is the full cache (the ratio is then ignored).
    """

    name: str
    ratio: float | None = None
    scorer: TokenScorer | None = None
    residual: ResidualConfig | None = None

    @property
    def observation_window(self) -> int:
        needed = [DEFAULT_OBSERVATION_WINDOW]
        if self.scorer is not None:
            needed.append(self.scorer.window)
        if self.residual is not None:
            needed.append(self.residual.observation_window)
        return max(needed)

    @property
    def decode_rule(self) -> DecodeRule:
        """How its cache is attended: the residual's decode-time part, or without a residual
        ``NO_RESIDUAL_RULE``."""
        return NO_RESIDUAL_RULE if self.residual is None else self.residual.decode_rule

    @property
    def needs_accumulated_attention(self) -> bool:
        return self.scorer is not None and self.scorer.needs_accumulated_attention

    def compressed_layers(
        self, cache: ResKVCache, scaling: float, shared: list[SharedLayers] | None = None
    ) -> list[CompressedLayerState | ObservedLayer | WindowedLayer]:
        """What this method's copy of a prefilled cache is made of, layer by layer: a compressed state,
        or the prefilled layer itself where the budget covers the prompt (every layer of the full
        cache) and in a sliding-window layer, which is never compressed (reskv.md, "Hybrid
        attention"); ``cache`` is left unchanged. The full-attention layers are compressed in batches
        (``shared_batches``): ResKV's own work runs once per batch. ``shared`` are ``cache``'s batches
        as other compressions of it shared them."""
        if self.scorer is None:
            return list(cache.layers)
        count = sum(not isinstance(layer, WindowedLayer) for layer in cache.layers)
        states = iter(
            [
                state
                for batch in shared or shared_batches(cache, scaling)
                for state in self.compress_batch(batch, count)
            ]
        )
        layers = []
        for layer in cache.layers:
            state = None if isinstance(layer, WindowedLayer) else next(states)
            layers.append(layer if state is None else state)
        return layers

    def compress(
        self, cache: ResKVCache, scaling: float, shared: list[SharedLayers] | None = None
    ) -> tuple[ResKVCache, dict]:
        """A compressed copy of a prefilled cache (``compressed_layers`` assembled) and its statistics."""
        return self.assemble(self.compressed_layers(cache, scaling, shared), cache.get_seq_length())

    def compress_batch(
        self, layers: list[LayerObservation] | SharedLayers, num_layers: int
    ) -> list[CompressedLayerState | None]:
        """``compress_layers`` with this method's scorer, ratio and residual, in a model of ``num_layers``
        compressed (full-attention) layers."""
        return compress_layers(layers, self.scorer, self.ratio, self.residual, num_layers)

    def assemble(
        self, layers: Sequence[CompressedLayerState | ObservedLayer | WindowedLayer], seq_len: int
    ) -> tuple[ResKVCache, dict]:
        """A new cache over this method's compressed layers (an ``ObservedLayer`` where the budget
        covers the ``seq_len``-token prompt, a ``WindowedLayer`` in a sliding-window layer) and its
        statistics (``compression_stats``); ``layers`` are left unchanged: a ``CompressedLayer`` copies
        its state into new buffers, an exact layer is forked."""
        rule = self.decode_rule
        cache = ResKVCache(
            [
                CompressedLayer(layer, seq_len, rule)
                if isinstance(layer, CompressedLayerState)
                else layer.fork()
                for layer in layers
            ]
        )
        return cache, compression_stats(layers)


def compression_stats(layers: Sequence[CompressedLayerState | ObservedLayer | WindowedLayer]) -> dict:
    """What a compressed cache holds, from its layers' host-side statistics: whether it compressed
    anything and, if so, the budget and, per compressed layer and KV head, the main slots, the residual
    entries kept and the residual size chosen (no device read)."""
    per_layer = [layer.stats for layer in layers if isinstance(layer, CompressedLayerState)]
    stats = {"compressed": bool(per_layer)}
    if per_layer:
        stats["budget"] = per_layer[0]["budget"]
        stats |= {key: [layer[key] for layer in per_layer] for key in per_layer[0] if key != "budget"}
    return stats


def attended_slots(layers: Sequence[CompressedLayerState | ObservedLayer | WindowedLayer]) -> list[list[int]]:
    """Attended slots per layer and KV head of a method's ``compressed_layers``: main tokens plus used
    entries, or every token an exact layer holds (a sliding-window layer's: its window)."""
    return [
        [
            main + entries
            for main, entries in zip(layer.stats["main_slots"], layer.stats["residual_entries"], strict=True)
        ]
        if isinstance(layer, CompressedLayerState)
        else [layer.keys.shape[-2]] * layer.keys.shape[1]
        for layer in layers
    ]


def retained_shares(
    layers: Sequence[CompressedLayerState | ObservedLayer | WindowedLayer],
    slots: list[list[int]],
    seq_len: int,
) -> dict[str, float]:
    """The retained share of the compressed layers (their attended ``slots`` over ``seq_len`` per KV
    head, what the full cache holds there) and of the whole cache (every layer's slots over the full
    cache's, where a sliding-window layer holds its window whatever the method): reskv.md, "Hybrid
    attention"."""
    windowed = [isinstance(layer, WindowedLayer) for layer in layers]
    compressed = [sum(counts) for counts, window in zip(slots, windowed, strict=True) if not window]
    held = sum(sum(counts) for counts in slots)
    full = sum(
        sum(counts) if window else len(counts) * seq_len
        for counts, window in zip(slots, windowed, strict=True)
    )
    return {
        "retained_compressed": sum(compressed) / (len(compressed) * len(slots[0]) * seq_len),
        "retained_cache": held / full,
    }


def shared_batches(
    cache: ResKVCache, scaling: float, prefix_of: list[SharedLayers] | None = None
) -> list[SharedLayers]:
    """A prefilled cache's compressed (full-attention) layers in ``layer_batches``, each ready to be
    shared by compressions. An observation's ``layer_idx`` is the layer's index among them: the layer
    schedules (PyramidKV) and per-layer seeds (CaM) run over the compressed layers only. With
    ``prefix_of``, the batches of a cache that extends this one (the query-aware cache extends the
    context's), the layers are batched as those and read their stacked copy (``SharedLayers``)."""
    compressed = [layer for layer in cache.layers if not isinstance(layer, WindowedLayer)]
    observations = [layer.observation(index, scaling) for index, layer in enumerate(compressed)]
    if prefix_of is None:
        return [SharedLayers(batch) for batch in layer_batches(observations)]
    starts = [batch.observations[0].layer_idx for batch in prefix_of]
    return [
        SharedLayers(observations[start : start + len(longer.observations)], longer)
        for start, longer in zip(starts, prefix_of, strict=True)
    ]


def layer_batches(observations: list[LayerObservation]) -> list[list[LayerObservation]]:
    """Consecutive layers whose keys and values together hold at most ``LAYER_BATCH_BYTES`` on CUDA,
    ``CPU_LAYER_BATCH_BYTES`` elsewhere (at least one layer a batch). ResKV stacks a batch into one
    copy (``reskv.scoring.stack_layers``)."""
    obs = observations[0]
    layer_bytes = 2 * obs.keys.numel() * obs.keys.element_size()
    batch_bytes = LAYER_BATCH_BYTES if obs.keys.is_cuda else CPU_LAYER_BATCH_BYTES
    per_batch = max(1, batch_bytes // layer_bytes)
    return [observations[start : start + per_batch] for start in range(0, len(observations), per_batch)]
