"""Needle in a haystack: the eight ``niah_*`` tasks.

Upstream: ``scripts/data/synthetic/niah.py`` (``generate_input_output``, ``generate_samples``),
template and answer prefix from ``scripts/data/synthetic/constants.py``. One ``NeedleSampler`` is one
run of upstream's script: ``random.seed(seed)`` once, then the size estimate, the binary-search probes
and the samples all draw from the same generator, in upstream's order.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from benchmarks.ruler.fitting import Budget, fit_sample, search_size
from benchmarks.ruler.haystacks import (
    DEPTHS,
    depth_percent,
    essay_text,
    insert_at_depths,
    split_sentences,
    warn_if_beyond_essays,
)
from benchmarks.ruler.prompt import Prompt, PromptFormat
from benchmarks.ruler.templates import NEEDLE, NOISE, TEMPLATES, single_answer, split_template
from benchmarks.ruler.words import needle_keys

SPEC = TEMPLATES["niah"]


@dataclass(frozen=True)
class NeedleConfig:
    """The niah arguments of ``scripts/synthetic.yaml``."""

    type_haystack: str  # noise | essay | needle
    type_needle_k: str  # words | numbers | uuids
    type_needle_v: str
    num_needle_k: int
    num_needle_v: int
    num_needle_q: int


class NeedleSampler:
    """Builds niah prompts of a given haystack size, drawing from one seeded generator."""

    def __init__(self, config: NeedleConfig, fmt: PromptFormat, seed: int) -> None:
        self.config = config
        # niah.py: every query asks a different key, so there are at least as many keys as queries
        self.num_keys = max(config.num_needle_k, config.num_needle_q)
        self.fmt = fmt
        self.seed = seed
        self.rng = random.Random(seed)
        template, answer_prefix, self.value_label = SPEC.template, SPEC.answer_prefix, config.type_needle_v
        if config.num_needle_q * config.num_needle_v == 1:
            template, answer_prefix = single_answer(template), single_answer(answer_prefix)
            self.fmt = fmt.for_single_answer()
            self.value_label = config.type_needle_v[:-1]  # "numbers" -> "number"
        self.head, self.tail = split_template(template)
        self.answer_prefix = answer_prefix

    def draw(self, kind: str) -> str:
        """niah.py ``generate_random``: a 7-digit number, an adjective-noun key or a uuid4."""
        if kind == "numbers":
            return str(self.rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return self.rng.choice(needle_keys())
        if kind == "uuids":
            return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        raise ValueError(f"unknown needle type {kind!r}")

    def needle(self, key: str, value: str) -> str:
        return NEEDLE.format(type_needle_v=self.config.type_needle_v, key=key, value=value)

    def essay_context(self, num_words: int, needles: list[str]) -> str:
        sentences = split_sentences(essay_text(num_words).strip())
        return insert_at_depths(sentences, needles, self.rng.sample(DEPTHS, len(needles)))

    def line_context(self, num_lines: int, needles: list[str]) -> str:
        """Noise sentences or distractor needles, one a line, the needles inserted among them."""
        if self.config.type_haystack == "noise":
            lines = [NOISE] * num_lines
        else:
            lines = [
                self.needle(self.draw(self.config.type_needle_k), self.draw(self.config.type_needle_v))
                for _ in range(num_lines)
            ]
        indexes = sorted(self.rng.sample(range(num_lines), len(needles)), reverse=True)
        for index, needle in zip(indexes, needles, strict=True):
            lines.insert(index, needle)
        return "\n".join(lines)

    def build(self, haystack_size: int) -> Prompt:
        keys, values, needles = [], [], []
        for _ in range(self.num_keys):
            keys.append(self.draw(self.config.type_needle_k))
            values.append([self.draw(self.config.type_needle_v) for _ in range(self.config.num_needle_v)])
            needles.extend(self.needle(keys[-1], value) for value in values[-1])
        random.Random(self.seed).shuffle(needles)
        if self.config.type_haystack == "essay":
            context = self.essay_context(haystack_size, needles)
        else:
            context = self.line_context(haystack_size, needles)

        asked = self.rng.sample(range(self.num_keys), self.config.num_needle_q)
        queries = [keys[i] for i in asked]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        fields = {"type_needle_v": self.value_label, "query": query}
        return self.fmt.prompt(
            self.head.format(**fields),
            context,
            self.tail.format(**fields),
            self.answer_prefix.format(**fields),
            references=[value for i in asked for value in values[i]],
            metadata={
                "haystack": self.config.type_haystack,
                "haystack_size": haystack_size,
                "num_needles": len(needles),
                "needle_depths": depth_percent(context, needles),
            },
        )


def haystack_step(type_haystack: str, max_seq_length: int) -> int:
    """niah.py ``incremental``: the search's lower bound and the per-sample step down."""
    if type_haystack == "essay":
        return 500
    return 5 if max_seq_length < 4096 else 25


def generate(
    task: str, args: dict, fmt: PromptFormat, max_seq_length: int, num_samples: int, seed: int
) -> list[Prompt]:
    """niah.py ``generate_samples``: estimate, binary search, then each sample stepped down until it fits."""
    config = NeedleConfig(**args)
    sampler = NeedleSampler(config, fmt, seed)
    budget = Budget(task, max_seq_length, SPEC.tokens_to_generate, fmt)
    step = haystack_step(config.type_haystack, max_seq_length)
    tokens_per_haystack = fmt.count(sampler.build(step).text) / step
    # upstream: 3x the estimate as slack, at least two steps
    upper = max(int((max_seq_length / tokens_per_haystack) * 3), step * 2)
    size = search_size(lambda n: budget.total(sampler.build(n)), step, upper, budget)
    if config.type_haystack == "essay":
        # an oversize probe is rejected alike with either text; only a kept size past the essays differs
        warn_if_beyond_essays(size)
    return [fit_sample(sampler.build, size, step, budget) for _ in range(num_samples)]
