"""Length fitting: the haystack size is searched so that prompt tokens + tokens to generate fit.

Upstream: the "Binary search for optimal haystack size" and the per-sample retry loop shared (as
copies) by ``scripts/data/synthetic/niah.py`` (``generate_samples``), ``variable_tracking.py``
(``sys_vartrack_w_noise_random``), ``common_words_extraction.py`` (``sys_word_pair_random``) and
``qa.py`` (``generate_samples``). Every probe builds a full sample and so draws from the random
generators exactly as upstream's probes do; the samples therefore depend on the probe sequence.

Where upstream would loop forever (nothing fits even at the smallest haystack) a ``BenchmarkError``
names the minimum length instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks import BenchmarkError
from benchmarks.ruler.prompt import Prompt, PromptFormat


@dataclass(frozen=True)
class Budget:
    """``max_seq_length`` counts the prompt tokens plus the tokens to generate."""

    task: str
    max_seq_length: int
    tokens_to_generate: int
    fmt: PromptFormat

    def total(self, prompt: Prompt) -> int:
        return self.fmt.count(prompt.text) + self.tokens_to_generate

    def too_small(self, smallest_total: int) -> BenchmarkError:
        return BenchmarkError(
            f"RULER {self.task}: length {self.max_seq_length} is too small for the task's template; "
            f"it needs at least {smallest_total} tokens (prompt at the smallest haystack + "
            f"{self.tokens_to_generate} to generate)"
        )


def search_size(total_tokens: Callable[[int], int], lower: int, upper: int, budget: Budget) -> int:
    """Largest haystack size in [lower, upper] whose probe fits, by upstream's binary search."""
    best = None
    smallest_total = None
    while lower <= upper:
        mid = (lower + upper) // 2
        total = total_tokens(mid)
        if total <= budget.max_seq_length:
            best, lower = mid, mid + 1
        else:
            smallest_total, upper = total, mid - 1
    if best is None:
        raise budget.too_small(smallest_total)
    return best


def fit_sample(
    build: Callable[[int], Prompt],
    size: int,
    step: int,
    budget: Budget,
    retry_on: tuple[type[Exception], ...] = (),
) -> Prompt:
    """Build one sample at ``size``, stepping the haystack down by ``step`` until it fits.

    A build raising one of ``retry_on`` is retried like an oversize sample, as upstream's bare
    ``except`` does.
    """
    while True:
        try:
            prompt = build(size)
        except retry_on:
            prompt = None
        if prompt is not None:
            total = budget.total(prompt)
            if total <= budget.max_seq_length:
                return prompt
            if size <= step:
                raise budget.too_small(total)
        if size > step:
            size -= step
