"""What a generation reports besides its tokens, declared where it is produced (torch-free).

``reskv.engine.Generation`` carries four sections, which a result file stores per sample under
these keys (``scripts.harness.records.SampleRecord``, ``docs/spec/platform.md``):

- ``cache_stats`` (``CacheStats``): the compressed cache (``reskv.method.Method.compress``,
  per layer and KV head from ``reskv.compress.compress_layers``);
- ``timings`` (``Timings``): where the wall-clock time went, and the tokens decoded in it;
- ``run`` (``Run``): how the generation was run (the rows it was decoded with; the runner adds
  how many configurations shared its prefill);
- ``quality`` (``Quality``), when asked for: ``reskv.quality``'s distances to the full cache.

The fields of ``timings`` and ``run`` carry their unit (``Annotated[int, COUNT]``): seconds and
tokens add up over samples (a result file's top-level ``timings``, ``scripts.harness.store``),
a count of configurations or rows does not, nor a name (the decode mode).
"""

from __future__ import annotations

from typing import Annotated, TypedDict, get_type_hints

SECONDS = "seconds"
TOKENS = "tokens"
COUNT = "count"
NAME = "name"  # a value that names something (a mode), not a quantity
SUMMED = (SECONDS, TOKENS)  # the units a file's totals add up over its samples
# A field written only when what it counts happens (a batch split for memory, a compiled batch decoded
# eagerly): ``Annotated[int, COUNT, OCCASIONAL]``.
OCCASIONAL = "occasional"


class CacheStats(TypedDict, total=False):
    """``cache_stats``: the compressed cache of one sample; the lists are per compressed layer and
    per KV head (a method that compressed nothing has ``compressed`` false and no lists)."""

    compressed: bool
    budget: int  # retained slots per KV head, b (reskv.md, Budget)
    main_slots: list[list[int]]
    residual_entries: list[list[int]]  # entries built (empty clusters dropped)
    residual_slots: list[list[int]]  # r, the slots given to entries
    # The ratio of the ResKV grid r came from, r = floor(g * b_h + 0.5) (reskv.md, Validation proxy):
    # the proxy's choice, fixed_ratio without validation, 0 for the main cache only; +ResKV only.
    residual_choice: list[list[float]]
    prompt_tokens: int
    compressed_tokens: int  # the tokens the setting compresses: the prompt, or the context
    slots: list[list[int]]  # attended: main slots plus entries, per layer (every layer) and KV head
    # The retained share (reskv.md, Hybrid attention): the compressed layers' slots over s per KV head,
    # and every layer's over the full cache's, whose sliding-window layers hold their window.
    retained_compressed: float
    retained_cache: float


class Timings(TypedDict, total=False):
    """``timings``: wall-clock seconds of one sample's phases and the tokens decoded. The prefills
    (``prefill_s``, ``prompt_prefill_s``, ``question_prefill_s``) serve every configuration of the
    sample that shared them (``Run.prefill_shared_by``)."""

    prefill_s: Annotated[float, SECONDS]  # the context
    prompt_prefill_s: Annotated[
        float, SECONDS
    ]  # the whole prompt compressed as it runs (retain="compressed")
    question_prefill_s: Annotated[float, SECONDS]  # the question on the context's cache (query-aware)
    compress_s: Annotated[float, SECONDS]
    question_s: Annotated[float, SECONDS]  # the question fed to the compressed cache (query-agnostic)
    decode_s: Annotated[float, SECONDS]  # in a batch, the batch's time shared equally by its rows
    decode_tokens: Annotated[int, TOKENS]
    quality_s: Annotated[float, SECONDS]


class Run(TypedDict, total=False):
    """``run``: how one sample's generation was run."""

    decode: Annotated[str, NAME]  # the decode step that ran: "eager" or "compiled" (``DECODE_MODES``)
    batch_rows: Annotated[int, COUNT]  # rows decoded together in its batch (``reskv.grid.decode_grid``)
    out_of_memory_splits: Annotated[int, COUNT, OCCASIONAL]  # its batch split for want of memory (reskv.grid)
    compile_fallback: Annotated[str, NAME, OCCASIONAL]  # why its compiled batch decoded eagerly instead
    prefill_shared_by: Annotated[int, COUNT]  # configurations that shared the sample's prefills


class Quality(TypedDict, total=False):
    """``quality``: distances of one sample's cache to the full cache (``reskv.quality``)."""

    answer_tokens: int  # the reference answer's tokens the log-likelihoods cover
    answer_log_prob: float
    answer_log_prob_full: float
    answer_log_prob_gap: float
    kl: float
    attention_error: float
    residual_share: float
    attention_error_by_layer: list[float]
    residual_share_by_layer: list[float]


SECTIONS = {"cache_stats": CacheStats, "timings": Timings, "run": Run, "quality": Quality}


def fields(section: str) -> tuple[str, ...]:
    """The declared fields of a section (``SECTIONS``), in declaration order."""
    return tuple(SECTIONS[section].__annotations__)


def units(section: str) -> dict[str, str]:
    """The unit of each field of ``timings`` or ``run`` (``SECONDS``, ``TOKENS``, ``COUNT``)."""
    hints = get_type_hints(SECTIONS[section], include_extras=True)
    return {name: hint.__metadata__[0] for name, hint in hints.items()}


def occasional(section: str) -> tuple[str, ...]:
    """The fields of ``section`` written only when what they count happens (``OCCASIONAL``)."""
    hints = get_type_hints(SECTIONS[section], include_extras=True)
    return tuple(name for name, hint in hints.items() if OCCASIONAL in getattr(hint, "__metadata__", ()))


def summed(section: str) -> tuple[str, ...]:
    """The fields of ``section`` that add up over samples (seconds and tokens)."""
    return tuple(name for name, unit in units(section).items() if unit in SUMMED)
