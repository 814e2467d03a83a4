"""Prefill once, then compress copies and decode greedily: the engine's public API.

    prefill = Prefill(backbone, prompt_ids, context_length, methods)
    for method in methods:
        for setting in SETTINGS:
            generation = prefill.generate(method, setting, max_new_tokens=64)

The context prefix is prefilled once. The query-aware setting extends a copy of that cache
with the question suffix (one more exact forward over the suffix only), then compresses; the
query-agnostic setting compresses the context cache and feeds the suffix on top of the
compressed cache. Compression always builds a new cache, so one prefill serves every
(method, ratio, setting).

``Prefill(..., retain="compressed")`` never holds a full cache of every layer: each setting's
forward compresses each layer for every registered method as its attention runs and frees it
(reskv.md, "Where the full cache lives"). A prompt's configurations decoded together, as the runner
decodes a sample's grid: ``reskv.grid.decode_grid``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.cache import CompressingLayer, ObservedLayer, ResKVCache, WindowedLayer
from reskv.compress import CompressedLayerState, Family, SharedLayers
from reskv.config import COMPILED_WITHOUT_SHARED_SOFTMAX, DECODE_MODES, DEFAULT_OBSERVATION_WINDOW, SETTINGS
from reskv.decoding import compiled_next_logits, forward, greedy, static_cache
from reskv.method import Method, attended_slots, compression_stats, retained_shares, shared_batches
from reskv.model import Backbone
from reskv.prompting import tokenize_prompt
from reskv.quality import QualityProbe
from reskv.scoring import LayerObservation
from reskv.stats import CacheStats, Quality, Run, Timings

# Where a Prefill keeps the prompt: the full cache, compressed into copies ("full"), or each layer
# compressed during the forward and freed ("compressed"; reskv.md, "Where the full cache lives").
RETAIN = ("full", "compressed")


@dataclass
class Generation:
    """One greedy answer and what it cost."""

    token_ids: list[int]
    text: str
    cache_stats: CacheStats
    timings: Timings = field(default_factory=dict)
    quality: Quality | None = None  # reskv.quality's measures, when asked for (``answer_ids``)
    run: Run = field(default_factory=dict)


@dataclass
class PrefilledState:
    """An exact forward's cache (read it through forks: ``ResKVCache.fork``) and its next-token logits."""

    cache: ResKVCache
    last_logits: Tensor


class Prefill:
    """One prompt prefilled once, serving any number of (method, setting) generations.

    ``retain`` (``RETAIN``) says where the prompt is kept. "full" (the default): the context is
    prefilled here (``timings["prefill_s"]``) and kept exact; the query-aware setting extends a
    copy with the question on first use (``question_prefill_s``); every method compresses copies,
    any method may be asked for, and the quality measures and ``observations`` read the full cache.

    "compressed": nothing is prefilled here. A setting's first use runs one forward (the context
    for query-agnostic, ``prefill_s``; the whole prompt for query-aware, ``prompt_prefill_s``)
    in which each layer is compressed for every method of ``methods`` as its attention runs, then
    freed (``reskv.cache.CompressingLayer``): no full cache of all layers ever exists, and the
    compression time is part of that forward's. Query-agnostic states equal "full"'s bit for bit
    (the same context forward); query-aware ones get the question's keys and values from one
    forward instead of a context forward and a question forward, equal only up to fp rounding.
    Only the methods given here can be asked for; the full method, the quality measures and
    ``observations`` need "full".
    """

    def __init__(
        self,
        backbone: Backbone,
        prompt_ids: Sequence[int],
        context_length: int,
        methods: Sequence[Method] = (),
        retain: str = "full",
    ):
        prompt_ids = single_sequence(prompt_ids)
        if not 0 < context_length <= len(prompt_ids):
            raise ValueError(f"context_length {context_length} outside (0, {len(prompt_ids)}]")
        if retain not in RETAIN:
            raise ValueError(f"unknown retain {retain!r}; choose one of {list(RETAIN)}")
        self.retain = retain
        self.methods = tuple(methods)
        if any(method.scorer is None for method in self.methods):
            self._require_full_cache("the full method")
        self.backbone = backbone
        self.prompt_ids = prompt_ids
        self.context_length = context_length
        config = backbone.model.config
        self.max_positions = config.max_position_embeddings
        self.check_positions(0)
        self.observation_window = max([DEFAULT_OBSERVATION_WINDOW] + [m.observation_window for m in methods])
        self.accumulate = any(m.needs_accumulated_attention for m in methods)
        self.scaling = backbone.scaling
        self.timings: dict[str, float] = {}
        self._context: PrefilledState | None = None
        if retain == "full":
            self._context = self._prefill(self.prompt_ids[:context_length], "prefill_s")
        self._whole_prompt: PrefilledState | None = None
        self.quality_probe = QualityProbe(self)
        # Per setting, while a grid shares its constructions (``sharing_construction``), and the families
        # it constructs together.
        self._shared: dict[str, list[SharedLayers]] | None = None
        self._families: dict[str, list[Family]] = {}

    def _require_full_cache(self, what: str) -> None:
        """Refuse ``what`` where the full cache is not kept."""
        if self.retain != "full":
            raise ValueError(
                f"{what} needs the full cache, which Prefill(..., retain={self.retain!r}) frees layer by "
                "layer during the prefill; use a Prefill with retain='full' (the default) for it"
            )

    def _prefill(self, token_ids: Sequence[int], timing: str) -> PrefilledState:
        """An exact forward over ``token_ids`` from an empty cache, timed as ``timings[timing]``: the
        cache is kept (retain="full"), or each layer compressed for every method as it runs."""
        start = time.perf_counter()
        windows = self.backbone.windows
        if self.retain == "full":
            cache = ResKVCache.for_prefill(windows, self.observation_window, self.accumulate)
        else:
            num_layers = windows.count(None)  # the compressed ones
            compressors = {
                method: functools.partial(method.compress_batch, num_layers=num_layers)
                for method in self.methods
            }
            cache = ResKVCache.compressing(windows, self.observation_window, self.accumulate, compressors)
        state = PrefilledState(cache, self.next_logits(token_ids, cache))
        self.timings[timing] = time.perf_counter() - start
        return state

    def check_positions(self, max_new_tokens: int) -> None:
        """Refuse to run past the backbone's positions (the runner checks earlier and skips)."""
        needed = len(self.prompt_ids) + max_new_tokens
        if needed > self.max_positions:
            raise ValueError(
                f"{len(self.prompt_ids)} prompt tokens + {max_new_tokens} new tokens = {needed} positions "
                f"exceed the backbone's max_position_embeddings {self.max_positions}"
            )

    @torch.inference_mode()
    def next_logits(
        self, token_ids: Sequence[int], cache: ResKVCache, every_position: bool = False
    ) -> Tensor:
        """The next-token logits after ``token_ids`` fed to ``cache`` (``[V]``), or after each of them
        (``[n, V]``); ``cache`` (a prefilled one, or one from ``compressed``) is extended in place."""
        logits = forward(
            self.backbone, torch.tensor([list(token_ids)], device=self.backbone.device), cache, every_position
        )
        return logits[0] if every_position else logits[0, -1]

    def prefilled(self, setting: str) -> PrefilledState:
        """The exact forward a setting compresses, run on first use: the whole prompt (query-aware: the
        context cache extended with the question; with retain="compressed", one forward over the whole
        prompt compressing as it goes) or the context (query-agnostic). Read its cache through forks."""
        if setting not in SETTINGS:
            raise ValueError(f"unknown setting {setting!r}; choose one of {list(SETTINGS)}")
        if setting == "agnostic":
            if self._context is None:  # retain="compressed": the context forward runs on first use
                self._context = self._prefill(self.prompt_ids[: self.context_length], "prefill_s")
            return self._context
        if self._whole_prompt is None and self.retain == "compressed":
            self._whole_prompt = self._prefill(self.prompt_ids, "prompt_prefill_s")
        elif self._whole_prompt is None:
            start = time.perf_counter()
            # Observed again: the question's queries are the last ones a query-aware method scores.
            cache = ResKVCache(
                [
                    layer.fork()
                    if isinstance(layer, WindowedLayer)
                    else layer.fork(self.observation_window, self.accumulate)
                    for layer in self._context.cache.layers
                ]
            )
            question = self.prompt_ids[self.context_length :]
            logits = self.next_logits(question, cache) if question else self._context.last_logits
            self._whole_prompt = PrefilledState(cache, logits)
            self.timings["question_prefill_s"] = time.perf_counter() - start
        return self._whole_prompt

    def observations(self, setting: str = "agnostic") -> list[LayerObservation]:
        """Per-layer views of the prefilled cache a setting compresses (the context for query-agnostic,
        the whole prompt for query-aware), its compressed (full-attention) layers only, each indexed
        among them; read-only, for analyses such as the evicted-key figure."""
        self._require_full_cache("observations()")
        layers = [
            layer for layer in self.prefilled(setting).cache.layers if not isinstance(layer, WindowedLayer)
        ]
        return [layer.observation(index, self.scaling) for index, layer in enumerate(layers)]

    def compressed_layers(
        self, method: Method, setting: str = "aware"
    ) -> tuple[list[CompressedLayerState | ObservedLayer | WindowedLayer], dict]:
        """``method``'s compression of the cache ``setting`` compresses (the whole prompt query-aware, the
        context query-agnostic), as the layers a cache is made of (``Method.compressed_layers``), and
        its statistics; with retain="compressed", the states its forward stored for ``method``."""
        seq_len = len(self.prompt_ids) if setting == "aware" else self.context_length
        if self.retain == "full":
            cache = self.prefilled(setting).cache
            shared = None if self._shared is None else self.shared_batches(setting)
            layers = method.compressed_layers(cache, self.scaling, shared)
        else:
            if method.scorer is None:
                self._require_full_cache("the full method")
            if method not in self.methods:
                raise ValueError(
                    f"method {method.name!r} was not given to this Prefill(..., retain='compressed'), whose "
                    "forward compresses only for the methods listed then: pass that Method object in "
                    "Prefill(..., methods=[...])"
                )
            layers = [
                layer.compressed[method] if isinstance(layer, CompressingLayer) else layer
                for layer in self.prefilled(setting).cache.layers
            ]
        stats = compression_stats(layers) | {
            "prompt_tokens": len(self.prompt_ids),
            "compressed_tokens": seq_len,
        }
        stats["slots"] = attended_slots(layers)
        stats |= retained_shares(layers, stats["slots"], seq_len)
        return layers, stats

    def compressed(self, method: Method, setting: str = "aware") -> tuple[ResKVCache, dict]:
        """``method``'s compression of a copy of the cache ``setting`` compresses (feed it the question,
        query-agnostic) and its statistics (``compressed_layers``, assembled)."""
        layers, stats = self.compressed_layers(method, setting)
        cache, _ = method.assemble(layers, stats["compressed_tokens"])
        return cache, stats

    def shared_batches(self, setting: str) -> list[SharedLayers]:
        """A setting's layers as ``sharing_construction`` shares them, made on first use and planned with
        its families. The query-agnostic layers (the context's) of a grid that compresses query-aware
        too read the query-aware stacked copy, whose first tokens they are: one copy for both."""
        if setting not in self._shared:
            longer = None
            if setting == "agnostic" and "aware" in self._families:
                longer = self.shared_batches("aware")
            cache = self.prefilled(setting).cache
            self._shared[setting] = shared_batches(cache, self.scaling, longer)
            for batch in self._shared[setting]:
                batch.plan(self._families.get(setting, ()))
        return self._shared[setting]

    @contextlib.contextmanager
    def sharing_construction(self, requests: Sequence[tuple[Method, str]] = ()) -> Iterator[None]:
        """Within the block, the compressions of one setting share what every compression of its cache
        computes alike (``reskv.compress.SharedLayers``: scores, budgets, stacked layers, merged values,
        validation proxies; the same values bit for bit), which is let go of when the block ends. The
        ``(method, setting)`` requests given (a sample's grid) are constructed together, per setting, the
        first time one of them is asked for (``SharedLayers.plan``): the device is read a few times
        for them all instead of a few times each."""
        ratios: dict[tuple[str, Hashable], set[float]] = {}
        representatives: dict[tuple[str, Hashable], Method] = {}
        for method, setting in requests:
            if method.scorer is not None:
                key = setting, Family(method.scorer, method.residual, ()).key
                ratios.setdefault(key, set()).add(method.ratio)
                representatives.setdefault(key, method)
        self._families = {}
        for (setting, key), method in representatives.items():
            family = Family(method.scorer, method.residual, tuple(sorted(ratios[setting, key])))
            self._families.setdefault(setting, []).append(family)
        self._shared = {}
        try:
            yield
        finally:
            self._shared, self._families = None, {}

    def generate(
        self,
        method: Method,
        setting: str = "aware",
        max_new_tokens: int = 32,
        stop_token_ids: Sequence[int] = (),
        min_new_tokens: int = 0,
        answer_ids: Sequence[int] | None = None,
        decode: str = "eager",
    ) -> Generation:
        """Compress a copy of the prefilled cache for ``method`` and decode greedily.

        Until ``min_new_tokens`` tokens exist, stop tokens (the backbone's and ``stop_token_ids``)
        cannot be chosen (transformers' ``min_length`` semantics). With ``answer_ids`` (a reference
        answer's tokens, possibly empty) the generation also carries ``reskv.quality``'s measures
        against the full cache (``quality_s`` in its timings). ``decode="compiled"`` runs each decode step
        as one compiled graph (``compiled_step``): the same tokens, no per-op host overhead; the first
        step of each new cache shape pays the compilation."""
        if decode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {decode!r}; choose one of {list(DECODE_MODES)}")
        if decode == "compiled" and not method.decode_rule.compiles:
            raise ValueError(COMPILED_WITHOUT_SHARED_SOFTMAX)
        self.check_positions(max_new_tokens)
        with_quality = answer_ids is not None
        if with_quality:
            self._require_full_cache("the quality measures (answer_ids)")
        timings = {}
        start = time.perf_counter()
        cache, stats = self.compressed(method, setting)
        timings["compress_s"] = time.perf_counter() - start
        compressed = cache.fork() if with_quality else None  # before the question
        logits = self.prefilled(setting).last_logits
        question = self.prompt_ids[self.context_length :]
        cache.reserve((len(question) if setting == "agnostic" else 0) + max_new_tokens)
        if setting == "agnostic" and question:
            start = time.perf_counter()
            logits = self.next_logits(question, cache)
            timings["question_s"] = time.perf_counter() - start
        prompted = cache.fork() if with_quality else None  # after the whole prompt
        cache = static_cache(cache, max_new_tokens)  # one decode path for every method, the full one too
        step = self.decode_step(decode)
        start = time.perf_counter()
        (token_ids,) = greedy(
            logits[None],
            lambda token_ids: step(token_ids, cache)[None],
            max_new_tokens,
            min_new_tokens,
            self.stop_ids(stop_token_ids),
        )
        timings |= {"decode_s": time.perf_counter() - start, "decode_tokens": len(token_ids)}
        text = self.backbone.tokenizer.decode(token_ids, skip_special_tokens=True)
        quality = None
        if with_quality:
            start = time.perf_counter()
            quality = self.quality_probe.measures(setting, compressed, prompted, logits, answer_ids)
            timings["quality_s"] = time.perf_counter() - start
        return Generation(token_ids, text, stats, timings, quality, {"decode": decode})

    def stop_ids(self, stop_token_ids: Sequence[int]) -> set[int]:
        """The tokens that end an answer: ``stop_token_ids`` and the backbone's."""
        return set(stop_token_ids) | set(self.backbone.stop_token_ids)

    def compiled_next_logits(self, token_ids: Sequence[int], cache: ResKVCache) -> Tensor:
        """``next_logits`` of one token through ``compiled_step`` (``compiled_next_logits``)."""
        return compiled_next_logits(self.backbone, token_ids, cache)[0]

    def decode_step(self, decode: str) -> Callable[[Sequence[int], ResKVCache], Tensor]:
        """The step a ``decode`` mode (``DECODE_MODES``) feeds each token through: ``compiled_next_logits``
        for ``"compiled"``, else ``next_logits``."""
        return self.compiled_next_logits if decode == "compiled" else self.next_logits


def single_sequence(prompt_ids: Sequence[int] | Tensor) -> list[int]:
    """The prompt as one list of ids; a batch of several sequences is refused (batch size 1)."""
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"prompt_ids of shape {tuple(ids.shape)} (batch size {ids.shape[0]}): the engine takes one "
            "sequence (batch size 1); build one Prefill per prompt"
        )
    return ids.tolist()


def generate(
    backbone: Backbone,
    method: Method,
    context: str,
    question: str,
    setting: str = "aware",
    max_new_tokens: int = 32,
    chat_template: bool = True,
) -> Generation:
    """Answer ``question`` about ``context`` (plain text) with one method in one setting.

    With ``chat_template`` the two are wrapped as one user turn of the backbone's template; the
    context prefix ends where the question starts, and both settings see identical tokens.
    """
    tokenizer = backbone.tokenizer
    prompt = context + question
    if chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    context_end = prompt.index(context) + len(context)
    prompt_ids, context_length = tokenize_prompt(tokenizer, prompt[:context_end], prompt[context_end:])
    prefill = Prefill(backbone, prompt_ids, context_length, [method])
    return prefill.generate(method, setting, max_new_tokens)
