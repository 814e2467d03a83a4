"""Frequent words extraction (fwe): the three most frequent coded words of a Zipf-distributed text.

Upstream: ``scripts/data/synthetic/freq_words_extraction.py`` (``generate_input_output``,
``sys_kwext``); template and answer prefix from ``scripts/data/synthetic/constants.py``. Unlike the
other tasks its length fitting is linear: the word count grows by ``max_len // 32`` from
``max_len // 6`` until the prompt reaches ``max_len`` (one step back is kept), and each sample steps
down from there while it is too long.
"""

from __future__ import annotations

import math
import random
import string

import numpy as np

from benchmarks.ruler.fitting import Budget
from benchmarks.ruler.prompt import Prompt, PromptFormat
from benchmarks.ruler.templates import TEMPLATES, split_template

SPEC = TEMPLATES["freq_words_extraction"]
CODED_WORD_LENGTH = 6  # --coded_wordlen default
# scipy.special.zeta(alpha) for the one alpha scripts/synthetic.yaml uses; pi**2/6 equals scipy's
# value bit for bit (checked against scipy 1.17.1), so scipy is not a dependency.
RIEMANN_ZETA = {2.0: math.pi**2 / 6}


class CodedTextSampler:
    """Builds fwe prompts from one seeded run."""

    def __init__(self, fmt: PromptFormat, seed: int, alpha: float) -> None:
        if alpha not in RIEMANN_ZETA:
            raise NotImplementedError(f"zeta({alpha}) is not tabulated; synthetic.yaml uses alpha 2.0")
        self.fmt = fmt
        self.seed = seed
        self.alpha = alpha
        self.rng = random.Random(seed)
        self.head, self.tail = split_template(SPEC.template)

    def coded_word(self) -> str:
        return "".join(self.rng.choices(string.ascii_lowercase, k=CODED_WORD_LENGTH))

    def vocabulary(self, size: int) -> list[str]:
        """``size`` distinct coded words, sorted, shuffled; the most frequent becomes '...' (noise)."""
        words = [self.coded_word() for _ in range(size)]
        while len(set(words)) < size:
            words.append(self.coded_word())
        words = sorted(set(words))
        random.Random(self.seed).shuffle(words)
        words[0] = "..."
        return words

    def build(self, vocabulary: list[str], num_words: int) -> Prompt:
        """gen_text: word of rank k repeated int(num_words * k**-alpha / zeta(alpha)) times, shuffled."""
        ranks = np.arange(1, len(vocabulary) + 1)
        counts = (num_words * (ranks**-self.alpha) / RIEMANN_ZETA[self.alpha]).astype(int)
        words = [word for word, count in zip(vocabulary, counts, strict=True) for _ in range(count)]
        random.Random(self.seed).shuffle(words)
        return self.fmt.prompt(
            self.head,
            " ".join(words),
            self.tail,
            SPEC.answer_prefix,
            vocabulary[1:4],
            metadata={"num_words": num_words, "vocab_size": len(vocabulary)},
        )


def generate(
    task: str, args: dict, fmt: PromptFormat, max_seq_length: int, num_samples: int, seed: int
) -> list[Prompt]:
    """sys_kwext: find the word count once, then draw each sample's vocabulary and step down to fit."""
    sampler = CodedTextSampler(fmt, seed, args["alpha"])
    budget = Budget(task, max_seq_length, SPEC.tokens_to_generate, fmt)
    max_len = max_seq_length - SPEC.tokens_to_generate
    vocab_size, step = max_len // 50, max_len // 32
    if vocab_size < 4:  # the noise word and the three answers
        raise budget.too_small(4 * 50 + SPEC.tokens_to_generate)

    vocabulary = sampler.vocabulary(vocab_size)
    num_words = max_len // CODED_WORD_LENGTH
    while budget.total(sampler.build(vocabulary, num_words)) < max_seq_length:
        num_words += step
    num_words -= step

    prompts = []
    for _ in range(num_samples):
        vocabulary, used = sampler.vocabulary(vocab_size), num_words
        prompt = sampler.build(vocabulary, used)
        while (total := budget.total(prompt)) > max_seq_length:
            if used <= 0:
                raise budget.too_small(total)
            used -= step
            prompt = sampler.build(vocabulary, used)
        prompts.append(prompt)
    return prompts
