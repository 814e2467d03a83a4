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
(reskv.md, "Where the full cache lives").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reskv.backbones import Backbone
from reskv.cache import CACHE_KWARG, CompressedLayer, ObservedLayer, ResKVCache
from reskv.compress import CompressedLayerState, compress_layers
from reskv.config import (
    COMPILED_WITHOUT_SHARED_SOFTMAX,
    DECODE_MODES,
    NO_RESIDUAL_RULE,
    SETTINGS,
    DecodeRule,
    ResidualConfig,
)
from reskv.prompting import tokenize_prompt
from reskv.quality import FORCED_STEPS, ProbeLayer, kl_divergence, sequence_log_prob, significant
from reskv.scoring import LayerObservation, TokenScorer
from reskv.stats import CacheStats, Quality, Run, Timings

# Bound on the keys and values of the layers compressed together: ResKV's work on them is stacked
# into one copy, so that its ops are paid once per batch, not once per layer (a GPU's host pays
# ~23 us per op whatever its size; issue 22). 4 GiB holds all 32 layers of an 8B-shaped model up to
# 32K tokens in bf16 (8 layers at 131K), a transient well within a GPU's memory.
LAYER_BATCH_BYTES = 4 << 30
# On CPU a batch holds at most 8 MiB of keys and values: one layer of the embedded model at 4K (6 MB).
# Stacking saves per-op time, which matters on CPU only for small layers (the tests' tiny models
# compress 30% faster stacked), while a large stack's transients fall out of the CPU's caches: the
# proxy's loss logits are 410 MB for the embedded model's 30 layers at 4K, 14 MB for one. ResKV's
# construction on that prompt took 3.6 s in one-layer batches and 4.4 s stacked at ratio 0.5, 2.3 s
# and 2.7 s at 0.9 (snapkv+reskv minus snapkv, 2 threads, medians of 3 interleaved in one run; this
# host's speed drifted by 15% from run to run, so compare the two, not the seconds). The bits are the
# same (tests/test_in_prefill.py compares the two).
CPU_LAYER_BATCH_BYTES = 8 << 20
# Where a Prefill keeps the prompt: the full cache, compressed into copies ("full"), or each layer
# compressed during the forward and freed ("compressed"; reskv.md, "Where the full cache lives").
RETAIN = ("full", "compressed")
# Queries recorded per layer during prefill: enough for SnapKV/AdaKV/CaM (64), TOVA (1) and
# the validation proxy (96 fit + 32 validation).
DEFAULT_OBSERVATION_WINDOW = 128


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
        """How its cache is attended: the residual's rule (a ``ResidualConfig`` is one), or without a
        residual ``NO_RESIDUAL_RULE``."""
        return self.residual or NO_RESIDUAL_RULE

    @property
    def retained_fraction(self) -> float:
        """The share of the prompt its cache holds (1 for the full cache): what orders a grid's rows."""
        return 1.0 if self.scorer is None else 1.0 - self.ratio

    @property
    def needs_accumulated_attention(self) -> bool:
        return self.scorer is not None and self.scorer.needs_accumulated_attention

    def compress(self, cache: ResKVCache, scaling: float) -> tuple[ResKVCache, dict]:
        """A compressed copy of a prefilled cache and its statistics; ``cache`` is left unchanged.

        Layers are compressed in batches (``layer_batches``): ResKV's own work runs once per batch."""
        if self.scorer is None:
            return cache.fork(), {"compressed": False}
        observations = [layer.observation(index, scaling) for index, layer in enumerate(cache.layers)]
        states = []
        for batch in layer_batches(observations):
            states += self.compress_batch(batch, len(cache.layers))
        kept = [layer if state is None else state for layer, state in zip(cache.layers, states, strict=True)]
        return self.assemble(kept, observations[0].seq_len)

    def compress_batch(
        self, observations: list[LayerObservation], num_layers: int
    ) -> list[CompressedLayerState | None]:
        """``compress_layers`` with this method's scorer, ratio and residual, in a ``num_layers`` model."""
        return compress_layers(observations, self.scorer, self.ratio, self.residual, num_layers)

    def assemble(
        self, layers: Sequence[CompressedLayerState | ObservedLayer], seq_len: int
    ) -> tuple[ResKVCache, dict]:
        """A new cache over this method's compressed layers (an ``ObservedLayer`` where the budget
        covers the ``seq_len``-token prompt) and its statistics; ``layers`` are left unchanged: a
        ``CompressedLayer`` copies its state into new buffers, an ``ObservedLayer`` is forked."""
        rule = self.decode_rule
        cache_layers, per_layer = [], []
        for layer in layers:
            if isinstance(layer, ObservedLayer):
                cache_layers.append(layer.fork())
                continue
            cache_layers.append(CompressedLayer(layer, seq_len, rule))
            per_layer.append(layer.stats)
        stats = {"compressed": bool(per_layer)}
        if per_layer:
            stats["budget"] = per_layer[0]["budget"]
            stats |= {key: [layer[key] for layer in per_layer] for key in per_layer[0] if key != "budget"}
        return ResKVCache(cache_layers), stats


def attended_slots(cache: ResKVCache, stats: dict) -> list[list[int]]:
    """Attended slots per layer and KV head of a cache ``Method.compress`` just returned with ``stats``:
    main tokens plus used entries, from the host's counts where the statistics hold them
    (``ResKVCache.slots`` reads the same from the device, one sync per compressed layer)."""
    if "main_slots" not in stats:
        return cache.slots()
    return [
        [main + entries for main, entries in zip(*counts, strict=True)]
        for counts in zip(stats["main_slots"], stats["residual_entries"], strict=True)
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
class _PrefilledState:
    cache: ResKVCache
    last_logits: Tensor


@dataclass
class _FullReference:
    """What the full cache gives for the quality measures, computed once per prompt."""

    forced_ids: list[int]  # its greedy continuation, FORCED_STEPS tokens
    forced_logits: Tensor  # [FORCED_STEPS, V]: its next-token logits after each of them
    answer_log_probs: dict[tuple[int, ...], float] = field(default_factory=dict)


@dataclass
class _TeacherForced:
    """A generation's logits along the reference answer (``[1 + n, V]``: after the prompt, then after
    each answer token but the last) and along the full cache's forced tokens (``[FORCED_STEPS, V]``)."""

    answered: Tensor
    forced: Tensor


@dataclass
class _Prepared:
    """A request compressed and fed its whole prompt, ready to decode (``Prefill._prepare``)."""

    setting: str
    cache: ResKVCache | None  # let go of once stacked for a batch
    stats: dict
    logits: Tensor  # after the whole prompt
    timings: dict
    compressed: ResKVCache | None  # for the quality measures: before the question (query-agnostic)
    prompted: ResKVCache | None  # ... and after the whole prompt


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
        self._check_positions(0)
        self.observation_window = max([DEFAULT_OBSERVATION_WINDOW] + [m.observation_window for m in methods])
        self.accumulate = any(m.needs_accumulated_attention for m in methods)
        self.scaling = backbone.head_dim**-0.5
        self.timings: dict[str, float] = {}
        self._context: _PrefilledState | None = None
        if retain == "full":
            self._context = self._prefill(self.prompt_ids[:context_length], "prefill_s")
        self._whole_prompt: _PrefilledState | None = None
        self._full_reference: _FullReference | None = None

    def _require_full_cache(self, what: str) -> None:
        """Refuse ``what`` where the full cache is not kept."""
        if self.retain != "full":
            raise ValueError(
                f"{what} needs the full cache, which Prefill(..., retain={self.retain!r}) frees layer by "
                "layer during the prefill; use a Prefill with retain='full' (the default) for it"
            )

    def _prefill(self, token_ids: Sequence[int], timing: str) -> _PrefilledState:
        """An exact forward over ``token_ids`` from an empty cache, timed as ``timings[timing]``: the
        cache is kept (retain="full"), or each layer compressed for every method as it runs."""
        start = time.perf_counter()
        num_layers = self.backbone.model.config.num_hidden_layers
        if self.retain == "full":
            cache = ResKVCache.for_prefill(num_layers, self.observation_window, self.accumulate)
        else:
            compressors = {
                method: functools.partial(method.compress_batch, num_layers=num_layers)
                for method in self.methods
            }
            cache = ResKVCache.compressing(num_layers, self.observation_window, self.accumulate, compressors)
        state = _PrefilledState(cache, self.next_logits(token_ids, cache))
        self.timings[timing] = time.perf_counter() - start
        return state

    def _check_positions(self, max_new_tokens: int) -> None:
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
        logits = self._forward(
            torch.tensor([list(token_ids)], device=self.backbone.device), cache, every_position
        )
        return logits[0] if every_position else logits[0, -1]

    @torch.inference_mode()
    def _forward(self, token_ids: Tensor, cache: ResKVCache, every_position: bool) -> Tensor:
        """The logits of ``token_ids`` ``[B, n]`` fed to ``cache`` (one sequence, or ``B`` stacked rows),
        extended in place: ``[B, n, V]``, or ``[B, 1, V]`` for the last position only."""
        return self.backbone.model(
            input_ids=token_ids,
            use_cache=True,
            logits_to_keep=0 if every_position else 1,
            **{self.backbone.cache_argument: cache, CACHE_KWARG: cache},
        ).logits

    def _prompt_state(self) -> _PrefilledState:
        """The whole prompt, exact: the context cache extended with the question (computed once); with
        retain="compressed", one forward over the whole prompt compressing as it goes."""
        if self._whole_prompt is None and self.retain == "compressed":
            self._whole_prompt = self._prefill(self.prompt_ids, "prompt_prefill_s")
        elif self._whole_prompt is None:
            start = time.perf_counter()
            cache = self._context.cache.fork(self.observation_window, self.accumulate)
            question = self.prompt_ids[self.context_length :]
            logits = self.next_logits(question, cache) if question else self._context.last_logits
            self._whole_prompt = _PrefilledState(cache, logits)
            self.timings["question_prefill_s"] = time.perf_counter() - start
        return self._whole_prompt

    def _source(self, setting: str) -> _PrefilledState:
        """What a setting compresses: the whole prompt (query-aware) or the context (query-agnostic)."""
        if setting not in SETTINGS:
            raise ValueError(f"unknown setting {setting!r}; choose one of {list(SETTINGS)}")
        if setting == "aware":
            return self._prompt_state()
        if self._context is None:  # retain="compressed": the context forward runs on first use
            self._context = self._prefill(self.prompt_ids[: self.context_length], "prefill_s")
        return self._context

    def observations(self, setting: str = "agnostic") -> list[LayerObservation]:
        """Per-layer views of the prefilled cache a setting compresses (the context for query-agnostic,
        the whole prompt for query-aware); read-only, for analyses such as the evicted-key figure."""
        self._require_full_cache("observations()")
        layers = self._source(setting).cache.layers
        return [layer.observation(index, self.scaling) for index, layer in enumerate(layers)]

    def compressed(self, method: Method, setting: str = "aware") -> tuple[ResKVCache, dict]:
        """``method``'s compression of a copy of the cache ``setting`` compresses (the whole prompt
        query-aware, the context query-agnostic: feed it the question) and its statistics; with
        retain="compressed", a new cache over the states its forward stored for ``method``."""
        seq_len = len(self.prompt_ids) if setting == "aware" else self.context_length
        if self.retain == "full":
            cache, stats = method.compress(self._source(setting).cache, self.scaling)
        else:
            if method.scorer is None:
                self._require_full_cache("the full method")
            if method not in self.methods:
                raise ValueError(
                    f"method {method.name!r} was not given to this Prefill(..., retain='compressed'), whose "
                    "forward compresses only for the methods listed then: pass that Method object in "
                    "Prefill(..., methods=[...])"
                )
            layers = self._source(setting).cache.layers
            cache, stats = method.assemble([layer.compressed[method] for layer in layers], seq_len)
        stats["prompt_tokens"] = len(self.prompt_ids)
        stats["compressed_tokens"] = seq_len
        stats["slots"] = attended_slots(cache, stats)
        return cache, stats

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
        if decode == "compiled" and not method.decode_rule.shared_softmax:
            raise ValueError(COMPILED_WITHOUT_SHARED_SOFTMAX)
        self._check_request(max_new_tokens, answer_ids)
        prepared = self._prepare(method, setting, max_new_tokens, answer_ids is not None)
        step = self.decode_step(decode)
        start = time.perf_counter()
        token_ids = self._decode(
            prepared.cache,
            prepared.logits,
            max_new_tokens,
            min_new_tokens,
            self._stop_ids(stop_token_ids),
            step,
        )
        prepared.timings |= {"decode_s": time.perf_counter() - start, "decode_tokens": len(token_ids)}
        return self._finish(prepared, token_ids, answer_ids)

    def generate_grid(
        self,
        requests: Sequence[tuple[Method, str]],
        max_new_tokens: int = 32,
        stop_token_ids: Sequence[int] = (),
        min_new_tokens: int = 0,
        answer_ids: Sequence[int] | None = None,
        decode: str = "eager",
        decode_batch: int = 16,
    ) -> Iterator[tuple[int, Generation]]:
        """``generate`` for several (method, setting) requests decoded together in batches of at most
        ``decode_batch`` rows (issue 25): yields ``(index into requests, generation)`` as each batch ends.
        16 rows decoded the paper's RULER grid fastest on a 2-core CPU (``results/README.md``).

        The requests are ordered by the share of the prompt their caches hold and cut into batches, so
        that a batch pads its rows to similar lengths. A batch's requests are compressed as ``generate``
        does, their caches stacked (``ResKVCache.stacked``) and decoded with one forward of all rows per
        step; a row leaves when it stops. Only one batch's caches exist at a time. A batch of one
        decodes as ``generate`` does, bit for bit, in any ``decode`` mode (``decode_batch=1`` is
        ``generate`` per request); so does a request without the shared softmax, which the stacked
        attention does not compute. Larger batches decode eagerly, and with ``answer_ids`` compute the
        quality measures' teacher-forced logits in one forward too (``_teacher_forced_rows``; the probe
        of attention error and residual share runs per row). In a batch, ``decode_s`` is the batch's
        time shared equally by its rows (their sum is the time spent), likewise the batched part of
        ``quality_s``, and its ``run``'s ``decode_batch`` is its number of rows."""
        if isinstance(decode_batch, bool) or not isinstance(decode_batch, int) or decode_batch < 1:
            raise ValueError(f"decode_batch {decode_batch!r} must be a positive integer")
        if decode not in DECODE_MODES or (decode != "eager" and decode_batch > 1):
            raise ValueError(
                f"decode mode {decode!r} with decode_batch {decode_batch}: batches of several rows decode "
                f"eagerly; choose decode_batch=1 or decode='eager' (modes: {list(DECODE_MODES)})"
            )
        self._check_request(max_new_tokens, answer_ids)
        order = sorted(range(len(requests)), key=lambda row: requests[row][0].retained_fraction)
        stackable = [row for row in order if requests[row][0].decode_rule.shared_softmax]
        batches = [
            stackable[start : start + decode_batch] for start in range(0, len(stackable), decode_batch)
        ]
        batches += [[row] for row in order if row not in stackable]
        step = self.decode_step(decode)
        for batch in batches:
            # Room for the answer in each row's own buffers too: the question fed to a query-agnostic
            # cache attends over all its slots, so its rounding depends on their number (a batch of one
            # is then ``generate`` bit for bit, quality measures included).
            prepared = [
                self._prepare(*requests[row], max_new_tokens, answer_ids is not None) for row in batch
            ]
            start = time.perf_counter()
            if len(batch) == 1:
                stop_ids = self._stop_ids(stop_token_ids)
                cache, logits = prepared[0].cache, prepared[0].logits
                answers = [self._decode(cache, logits, max_new_tokens, min_new_tokens, stop_ids, step)]
            else:
                answers = self._decode_stacked(prepared, max_new_tokens, min_new_tokens, stop_token_ids)
            seconds = (time.perf_counter() - start) / len(batch)
            teacher_forced, quality_s = [None] * len(batch), 0.0
            if answer_ids is not None and len(batch) > 1:
                start = time.perf_counter()
                teacher_forced = self._teacher_forced_rows(prepared, answer_ids)
                quality_s = (time.perf_counter() - start) / len(batch)
            for row, request, answer, forced in zip(batch, prepared, answers, teacher_forced, strict=True):
                request.timings |= {"decode_s": seconds, "decode_tokens": len(answer)}
                generation = self._finish(request, answer, answer_ids, forced, quality_s)
                generation.run["decode_batch"] = len(batch)
                yield row, generation

    def _check_request(self, max_new_tokens: int, answer_ids: Sequence[int] | None) -> None:
        self._check_positions(max_new_tokens)
        if answer_ids is not None:
            self._require_full_cache("the quality measures (answer_ids)")

    def _prepare(self, method: Method, setting: str, spare_slots: int, with_quality: bool) -> _Prepared:
        """``method``'s compressed cache after the whole prompt, with room for ``spare_slots`` tokens,
        the logits after the prompt and, ``with_quality``, the forks the quality measures read."""
        timings = {}
        start = time.perf_counter()
        cache, stats = self.compressed(method, setting)
        timings["compress_s"] = time.perf_counter() - start
        compressed = cache.fork() if with_quality else None  # before the question
        logits = self._source(setting).last_logits
        question = self.prompt_ids[self.context_length :]
        cache.reserve((len(question) if setting == "agnostic" else 0) + spare_slots)
        if setting == "agnostic" and question:
            start = time.perf_counter()
            logits = self.next_logits(question, cache)
            timings["question_s"] = time.perf_counter() - start
        prompted = cache.fork() if with_quality else None  # after the whole prompt
        # One decode path for every method, the full one included.
        cache = static_cache(cache, spare_slots)
        return _Prepared(setting, cache, stats, logits, timings, compressed, prompted)

    def _stop_ids(self, stop_token_ids: Sequence[int]) -> set[int]:
        """The tokens that end an answer: ``stop_token_ids`` and the backbone's."""
        return set(stop_token_ids) | set(self.backbone.stop_token_ids)

    def _decode_stacked(
        self, rows: list[_Prepared], max_new_tokens: int, min_new_tokens: int, stop_token_ids: Sequence[int]
    ) -> list[list[int]]:
        """Greedy answers of ``rows`` decoded as one batch: their caches are stacked (and let go of)."""
        cache = ResKVCache.stacked([row.cache for row in rows], max_new_tokens)
        for row in rows:
            row.cache = None
        device = self.backbone.device

        def step(token_ids: list[int]) -> Tensor:
            return self._forward(torch.tensor(token_ids, device=device)[:, None], cache, False)[:, -1]

        logits = torch.stack([row.logits for row in rows])
        return greedy(
            logits, step, cache.keep, max_new_tokens, min_new_tokens, self._stop_ids(stop_token_ids)
        )

    def _finish(
        self,
        prepared: _Prepared,
        token_ids: list[int],
        answer_ids: Sequence[int] | None,
        teacher_forced: _TeacherForced | None = None,
        batch_quality_s: float = 0.0,
    ) -> Generation:
        """The generation of ``token_ids``: its text and, with ``answer_ids``, its quality measures
        (``teacher_forced`` and its share ``batch_quality_s`` of their time, when its batch computed
        them)."""
        text = self.backbone.tokenizer.decode(token_ids, skip_special_tokens=True)
        quality = None
        if answer_ids is not None:
            start = time.perf_counter()
            quality = self._quality(
                prepared.setting,
                prepared.compressed,
                prepared.prompted,
                prepared.logits,
                answer_ids,
                teacher_forced,
            )
            prepared.timings["quality_s"] = time.perf_counter() - start + batch_quality_s
        return Generation(token_ids, text, prepared.stats, prepared.timings, quality)

    def _teacher_forced(self, cache: ResKVCache, last_logits: Tensor, token_ids: Sequence[int]) -> Tensor:
        """``[1 + n, V]``: ``last_logits``, then the logits after each of ``token_ids`` fed to ``cache``."""
        if not token_ids:
            return last_logits[None]
        return torch.cat([last_logits[None], self.next_logits(token_ids, cache, every_position=True)])

    def _reference(self) -> _FullReference:
        """The full cache's greedy continuation and its logits along it (``reskv.quality``)."""
        if self._full_reference is None:
            whole = self._prompt_state()
            self._check_positions(FORCED_STEPS)
            forced_ids = self._decode(whole.cache.fork(), whole.last_logits, FORCED_STEPS, 0, set())
            logits = self._teacher_forced(whole.cache.fork(), whole.last_logits, forced_ids)[1:]
            self._full_reference = _FullReference(forced_ids, logits)
        return self._full_reference

    def _answer_log_prob(self, cache: ResKVCache, last_logits: Tensor, answer_ids: tuple[int, ...]) -> float:
        logits = self._teacher_forced(cache, last_logits, answer_ids[:-1])
        return sequence_log_prob(logits, torch.tensor(answer_ids, device=logits.device))

    def _measured_answer(self, answer_ids: Sequence[int]) -> tuple[int, ...]:
        """The reference answer the quality measures score: a long one (a LongBench summary) is cut where
        the backbone's positions end."""
        return tuple(answer_ids)[: self.max_positions - len(self.prompt_ids)]

    def _teacher_forced_rows(self, rows: list[_Prepared], answer_ids: Sequence[int]) -> list[_TeacherForced]:
        """The teacher-forced logits of the quality measures for a batch of ``rows`` in one forward: each
        row's prompted cache twice (``ResKVCache.stacked``), fed the answer and the full cache's forced
        tokens; the shorter feed is padded at its end, which no earlier position sees."""
        answer_ids, forced_ids = self._measured_answer(answer_ids), self._reference().forced_ids
        feeds = [list(answer_ids[:-1]), list(forced_ids)]
        length = max(len(feed) for feed in feeds)
        padded = [feed + forced_ids[:1] * (length - len(feed)) for feed in feeds]
        prompted = [static_cache(row.prompted, 0) for row in rows]
        cache = ResKVCache.stacked(prompted + prompted, length)
        ids = torch.tensor([padded[0]] * len(rows) + [padded[1]] * len(rows), device=self.backbone.device)
        logits = self._forward(ids, cache, every_position=True)
        answered, forced = logits[: len(rows), : len(feeds[0])], logits[len(rows) :, : len(forced_ids)]
        return [
            _TeacherForced(torch.cat([row.logits[None], row_answered]), row_forced)
            for row, row_answered, row_forced in zip(rows, answered, forced, strict=True)
        ]

    def _quality(
        self,
        setting: str,
        compressed: ResKVCache,
        prompted: ResKVCache,
        last_logits: Tensor,
        answer_ids: Sequence[int],
        teacher_forced: _TeacherForced | None = None,
    ) -> dict:
        """``reskv.quality``'s measures of one generation: ``compressed`` is the method's cache before
        the question (query-agnostic) or prompt, ``prompted`` and ``last_logits`` after the prompt;
        ``teacher_forced`` the logits along the answer and the forced tokens, when a batch computed them
        (``_teacher_forced_rows``)."""
        reference = self._reference()
        whole = self._prompt_state()
        answer_ids = self._measured_answer(answer_ids)
        if teacher_forced is None:
            teacher_forced = _TeacherForced(
                self._teacher_forced(prompted.fork(), last_logits, answer_ids[:-1]),
                self._teacher_forced(prompted, last_logits, reference.forced_ids)[1:],
            )
        quality: dict = {"answer_tokens": len(answer_ids)}
        if answer_ids:
            if answer_ids not in reference.answer_log_probs:
                reference.answer_log_probs[answer_ids] = self._answer_log_prob(
                    whole.cache.fork(), whole.last_logits, answer_ids
                )
            full = reference.answer_log_probs[answer_ids]
            answered = teacher_forced.answered
            own = sequence_log_prob(answered, torch.tensor(answer_ids, device=answered.device))
            quality.update(answer_log_prob=own, answer_log_prob_full=full, answer_log_prob_gap=own - full)
        forced_logits = teacher_forced.forced
        quality["kl"] = float(kl_divergence(reference.forced_logits, forced_logits).mean())
        # The probe feeds what the method's cache has not seen yet (the question, query-agnostic)
        # and the forced tokens; only the forced tokens' queries are measured.
        fed = list(self.prompt_ids[self.context_length :]) if setting == "agnostic" else []
        probe = ResKVCache(
            [
                ProbeLayer(full_layer, method_layer, len(reference.forced_ids))
                for full_layer, method_layer in zip(
                    self._source(setting).cache.fork().layers, compressed.layers, strict=True
                )
            ]
        )
        self.next_logits(fed + reference.forced_ids, probe)
        errors = torch.stack([layer.attention_error for layer in probe.layers])
        shares = torch.stack([layer.residual_share for layer in probe.layers])
        quality.update(
            attention_error=float(errors.mean()),
            residual_share=float(shares.mean()),
            attention_error_by_layer=significant(errors),
            residual_share_by_layer=significant(shares),
        )
        return quality

    def compiled_next_logits(self, token_ids: Sequence[int], cache: ResKVCache) -> Tensor:
        """``next_logits`` of one token through ``compiled_step`` (``compiled_next_logits``)."""
        return compiled_next_logits(self.backbone, token_ids, cache)

    def decode_step(self, decode: str) -> Callable[[Sequence[int], ResKVCache], Tensor]:
        """The step a ``decode`` mode (``DECODE_MODES``) feeds each token through: ``compiled_next_logits``
        for ``"compiled"``, else ``next_logits``."""
        return self.compiled_next_logits if decode == "compiled" else self.next_logits

    def _decode(
        self,
        cache: ResKVCache,
        logits: Tensor,
        max_new_tokens: int,
        min_new_tokens: int,
        stop_ids: set[int],
        step=None,
    ) -> list[int]:
        """Greedy decoding of one cache (``greedy`` with one row). ``step`` computes the next logits of one
        token (``next_logits`` unless given)."""
        step = step or self.next_logits
        (token_ids,) = greedy(
            logits[None],
            lambda token_ids: step(token_ids, cache)[None],
            None,
            max_new_tokens,
            min_new_tokens,
            stop_ids,
        )
        return token_ids


def greedy(
    logits: Tensor,
    step: Callable[[list[int]], Tensor],
    keep: Callable[[list[int]], None] | None,
    max_new_tokens: int,
    min_new_tokens: int,
    stop_ids: set[int],
) -> list[list[int]]:
    """Greedy answers of ``B`` rows from their next-token logits ``[B, V]``; the stop token itself is not
    part of an answer. Until ``min_new_tokens`` tokens exist, stop tokens cannot be chosen.
    ``step(token_ids)`` feeds one token per remaining row and returns their next logits; when some rows
    stop and others go on, ``keep(rows)`` is told which rows (indices among the remaining) go on first."""
    answers: list[list[int]] = [[] for _ in range(logits.shape[0])]
    remaining = list(range(logits.shape[0]))  # the answers the rows of ``logits`` belong to
    stop_index = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    for produced in range(max_new_tokens):
        if produced < min_new_tokens:
            logits = logits.index_fill(-1, stop_index, float("-inf"))
        next_ids = logits.argmax(dim=-1).tolist()
        going_on = [row for row, token_id in enumerate(next_ids) if token_id not in stop_ids]
        for row in going_on:
            answers[remaining[row]].append(next_ids[row])
        if not going_on or produced + 1 == max_new_tokens:
            break
        if len(going_on) < len(remaining):
            keep(going_on)
            remaining = [remaining[row] for row in going_on]
        logits = step([next_ids[row] for row in going_on])
    return answers


def static_cache(cache: ResKVCache, spare_slots: int) -> ResKVCache:
    """``cache`` with every exact layer (the full method's) copied into a static-capacity
    ``CompressedLayer`` without entries, with ``spare_slots``: one decode path for every method, no
    copy of the cache per step (an exact layer's ``update`` concatenates), and the static shapes a
    compiled step needs."""
    return ResKVCache(
        [
            layer if isinstance(layer, CompressedLayer) else CompressedLayer.exact(layer, spare_slots)
            for layer in cache.layers
        ]
    )


@functools.cache
def compiled_step(model: torch.nn.Module, cache_argument: str):
    """One decode step of ``model`` compiled as one graph (``torch.compile(fullgraph=True)``: no
    graph break): ``(token [1, 1], position [1, 1], cache) -> logits [V]``, for a cache of
    ``CompressedLayer``s (``static_cache``). On CUDA its kernels are replayed as CUDA graphs
    (``mode="reduce-overhead"``), which removes the per-op host cost a decode step is bound by (issue 24)."""

    def step(token: Tensor, position: Tensor, cache: ResKVCache) -> Tensor:
        output = model(
            input_ids=token,
            position_ids=position,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument: cache, CACHE_KWARG: cache},
        )
        return output.logits[0, -1]

    mode = "reduce-overhead" if model.device.type == "cuda" else None
    return torch.compile(step, fullgraph=True, mode=mode)


def compiled_next_logits(backbone: Backbone, token_ids: Sequence[int], cache: ResKVCache) -> Tensor:
    """The next-token logits ``[V]`` after one token through ``compiled_step``: the host claims the
    cache's slot first, so that the compiled graph reads no Python counter (``CompressedLayer.claim``)."""
    (token_id,) = token_ids
    position = cache.get_seq_length()
    cache.claim(1)
    device = backbone.device
    return compiled_step(backbone.model, backbone.cache_argument)(
        torch.tensor([[token_id]], device=device), torch.tensor([[position]], device=device), cache
    )


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
