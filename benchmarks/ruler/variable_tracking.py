"""Variable tracking (vt): follow a chain of ``VAR X = VAR Y`` assignments hidden in noise.

Upstream: ``scripts/data/synthetic/variable_tracking.py`` (``generate_chains``,
``generate_input_output``, ``randomize_icl``, ``sys_vartrack_w_noise_random``, ``main``); template and
answer prefix from ``scripts/data/synthetic/constants.py``. Only the ``noise`` haystack is built:
it is the one ``scripts/synthetic.yaml`` uses.

Upstream's run, reproduced in order from one ``random.seed(seed)`` / ``np.random.seed(seed)``:
first an in-context example (3-letter names, value 12345, upstream's base template, fitted to 500
tokens with nothing to generate), then the samples, each preceded inside the user turn by that
example with its names and value redrawn.
"""

from __future__ import annotations

import random
import string

import numpy as np

from benchmarks.ruler.fitting import Budget, fit_sample, search_size
from benchmarks.ruler.haystacks import depth_percent
from benchmarks.ruler.prompt import Prompt, PromptFormat
from benchmarks.ruler.templates import NOISE, TEMPLATES, split_template

SPEC = TEMPLATES["variable_tracking"]
EXAMPLE_MAX_SEQ_LENGTH = 500  # main(): the in-context example's own length budget
EXAMPLE_VALUE = "12345"


class ChainSampler:
    """Builds vt prompts of a given number of noise lines from one seeded run."""

    def __init__(self, seed: int, num_chains: int, num_hops: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.RandomState(seed)  # the legacy global generator np.random.seed seeds
        self.num_chains = num_chains
        self.num_hops = num_hops
        self.head, self.tail = split_template(SPEC.template)

    def name(self, length: int) -> str:
        return "".join(self.rng.choices(string.ascii_uppercase, k=length))

    def value(self) -> str:
        return str(self.np_rng.randint(10000, 99999))

    def chains(self, is_example: bool) -> tuple[list[list[str]], list[list[str]]]:
        """generate_chains: the variables of each chain and its statements, value first."""
        name_length = 3 if is_example else 5
        hops = min(10, self.num_hops) if is_example else self.num_hops
        needed = (hops + 1) * self.num_chains
        names = [self.name(name_length) for _ in range(needed)]
        while len(set(names)) < needed:
            names.append(self.name(name_length))
        variables, chains = [], []
        # Upstream cuts the whole list, redrawn names included, into chains: after a duplicate the
        # last cut is short and indexing it raises IndexError, which upstream's sample loop retries.
        for start in range(0, len(names), hops + 1):
            chain_names = names[start : start + hops + 1]
            first = f"VAR {chain_names[0]} = {EXAMPLE_VALUE if is_example else self.value()}"
            hops_text = [f"VAR {chain_names[j + 1]} = VAR {chain_names[j]} " for j in range(hops)]
            chains.append([first, *hops_text])
            variables.append(chain_names)
        return variables, chains

    def noise_context(self, num_lines: int, chains: list[list[str]]) -> str:
        """Each chain's statements inserted in order at sorted random lines of the noise."""
        lines = [NOISE] * num_lines
        for chain in chains:
            positions = sorted(self.rng.sample(range(len(lines)), len(chain)))
            for offset, (position, statement) in enumerate(zip(positions, chain, strict=True)):
                lines.insert(position + offset, statement)
        return "\n".join(lines).replace(". \n", ".\n")

    def randomize_example(self, example: str) -> str:
        """randomize_icl: redraw the example's answer names (every occurrence) and its value."""
        for target in example.strip().split()[-self.num_hops - 1 :]:
            example = example.replace(target, self.name(len(target)))
        return example.replace(EXAMPLE_VALUE, self.value())

    def build(
        self, fmt: PromptFormat, num_lines: int, is_example: bool = False, example: str | None = None
    ) -> Prompt:
        variables, chains = self.chains(is_example)
        context = self.noise_context(num_lines, chains)
        lead = "" if example is None else self.randomize_example(example) + "\n"
        fields = {"query": chains[0][0].split("=")[-1].strip(), "num_v": self.num_hops + 1}
        return fmt.prompt(
            lead + self.head.format(**fields),
            context,
            self.tail.format(**fields),
            SPEC.answer_prefix.format(**fields),
            references=variables[0],
            metadata={
                "haystack": "noise",
                "haystack_size": num_lines,
                "chain_depths": depth_percent(context, [s for chain in chains for s in chain]),
            },
        )


def _fit(
    sampler: ChainSampler,
    fmt: PromptFormat,
    budget: Budget,
    step: int,
    num_samples: int,
    is_example: bool,
    example: str | None,
) -> list[Prompt]:
    """sys_vartrack_w_noise_random: estimate, binary search, then samples stepped down until they fit."""
    example_tokens = 0 if example is None else fmt.count(example)
    tokens_per_line = fmt.count(sampler.build(fmt, step, is_example).text) / step
    upper = max(int((budget.max_seq_length / tokens_per_line) * 3), step * 2)
    size = search_size(
        lambda n: budget.total(sampler.build(fmt, n, is_example)) + example_tokens, step, upper, budget
    )
    return [
        fit_sample(
            lambda n: sampler.build(fmt, n, is_example, example), size, step, budget, retry_on=(IndexError,)
        )
        for _ in range(num_samples)
    ]


def generate(
    task: str, args: dict, fmt: PromptFormat, max_seq_length: int, num_samples: int, seed: int
) -> list[Prompt]:
    if args["type_haystack"] != "noise":
        raise NotImplementedError("only the noise haystack of scripts/synthetic.yaml is built")
    sampler = ChainSampler(seed, args["num_chains"], args["num_hops"])
    base = PromptFormat(fmt.tokenizer, "base")
    example_budget = Budget(f"{task} (in-context example)", EXAMPLE_MAX_SEQ_LENGTH, 0, base)
    (example,) = _fit(sampler, base, example_budget, 5, 1, is_example=True, example=None)
    example_text = example.text + " " + " ".join(example.references) + "\n"
    step = 5 if max_seq_length < 4096 else 10
    budget = Budget(task, max_seq_length, SPEC.tokens_to_generate, fmt)
    return _fit(sampler, fmt, budget, step, num_samples, is_example=False, example=example_text)
