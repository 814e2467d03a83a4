"""Common words extraction (cwe): the 10 words repeated most often in a numbered word list.

Upstream: ``scripts/data/synthetic/common_words_extraction.py`` (``get_example``,
``generate_input_output``, ``sys_word_pair_random``); template and answer prefix from
``scripts/data/synthetic/constants.py``.

Upstream formats its whole model template (chat wrapper + task + answer prefix) for the few-shot
example too, and puts that example, its answer and a newline before the real prompt. With the
backbone's chat template the example is therefore a complete chat-wrapped prompt with its answer,
ahead of the sample's own chat-wrapped prompt, exactly as upstream's ``meta-llama3`` template does.

Upstream draws more words than wonderwords holds from ``json/english_words.json`` (a Git LFS file
not available offline); that happens only far beyond 32K and raises here.
"""

from __future__ import annotations

import random

from benchmarks import BenchmarkError
from benchmarks.ruler.fitting import Budget, fit_sample, search_size
from benchmarks.ruler.prompt import Prompt, PromptFormat
from benchmarks.ruler.templates import TEMPLATES, split_template
from benchmarks.ruler.words import common_words

SPEC = TEMPLATES["common_words_extraction"]
NUM_FEWSHOT = 1  # upstream's --num_fewshot default
ESTIMATE_WORDS = 4096  # sys_word_pair_random estimates tokens per word on a list of this many words
STEP = 10  # sys_word_pair_random ``incremental``


def numbered(words: list[str]) -> str:
    """ "1. word1 2. word2 ..." (get_example and the few-shot answer)."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


class WordListSampler:
    """Builds cwe prompts with a given number of distinct words from one seeded run."""

    def __init__(
        self, fmt: PromptFormat, seed: int, max_seq_length: int, freq_cw: int, freq_ucw: int, num_cw: int
    ) -> None:
        self.fmt = fmt
        self.seed = seed
        self.rng = random.Random(seed)
        self.words = common_words(seed)
        self.num_cw = num_cw
        # generate_input_output: shorter lists and fewer repeats below 4096 tokens
        if max_seq_length < 4096:
            self.shot_shape, self.repeats = (20, 3, 1), (6, 1)
        else:
            self.shot_shape, self.repeats = (40, 10, 3), (freq_cw, freq_ucw)
        self.head, self.tail = split_template(SPEC.template)

    def word_list(self, num_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        """get_example: ``num_cw`` common words repeated more often than the rest, shuffled."""
        if num_words > len(self.words):
            raise BenchmarkError(
                f"RULER cwe needs {num_words} distinct words; wonderwords holds {len(self.words)} and "
                "upstream's json/english_words.json (Git LFS) is not available offline"
            )
        chosen = self.rng.sample(self.words, num_words)
        common, uncommon = chosen[: self.num_cw], chosen[self.num_cw :]
        words = common * common_repeats + uncommon * uncommon_repeats
        random.Random(self.seed).shuffle(words)
        return numbered(words), common

    def build(self, num_words: int) -> Prompt:
        shots = []
        for _ in range(NUM_FEWSHOT):
            context, answer = self.word_list(*self.shot_shape)
            shot = self.fmt.prompt(self.head, context, self.tail, SPEC.answer_prefix, answer)
            shots.append(shot.text + " " + numbered(answer))
        context, answer = self.word_list(num_words, *self.repeats)
        return self.fmt.prompt(
            self.head,
            context,
            self.tail,
            SPEC.answer_prefix,
            answer,
            metadata={"num_words": num_words},
            lead="\n".join(shots) + "\n",
        )


def generate(
    task: str, args: dict, fmt: PromptFormat, max_seq_length: int, num_samples: int, seed: int
) -> list[Prompt]:
    """sys_word_pair_random: estimate on 4096 words, binary search, samples stepped down until they fit."""
    sampler = WordListSampler(fmt, seed, max_seq_length, **args)
    budget = Budget(task, max_seq_length, SPEC.tokens_to_generate, fmt)
    tokens_per_word = fmt.count(sampler.build(ESTIMATE_WORDS).text) / ESTIMATE_WORDS
    upper = max(int(max_seq_length // tokens_per_word) * 2, STEP * 2)
    size = search_size(lambda n: budget.total(sampler.build(n)), STEP, upper, budget)
    return [fit_sample(sampler.build, size, STEP, budget) for _ in range(num_samples)]
