"""The one item format every benchmark yields and the engine consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Item:
    """One prompt, already templated and tokenized with the backbone's tokenizer.

    ``prompt_ids`` is the whole prompt (chat template and answer prefix included) tokenized as
    one sequence; its first ``context_length`` tokens are the reusable context prefix and the
    rest is the question suffix. Splitting the token sequence of the whole prompt (rather than
    tokenizing the two parts apart) keeps the tokens identical in the query-aware and
    query-agnostic settings.
    """

    benchmark: str
    task: str
    index: int
    prompt_ids: tuple[int, ...]
    context_length: int
    answer_prefix: str
    references: tuple[str, ...]
    max_new_tokens: int
    metric: str
    # Extra token ids that end generation besides the backbone's EOS (LongBench samsum: newline).
    stop_token_ids: tuple[int, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.context_length <= len(self.prompt_ids):
            raise ValueError(
                f"context_length {self.context_length} outside (0, {len(self.prompt_ids)}] for "
                f"{self.benchmark}/{self.task}#{self.index}"
            )

    @property
    def context_ids(self) -> tuple[int, ...]:
        return self.prompt_ids[: self.context_length]

    @property
    def question_ids(self) -> tuple[int, ...]:
        return self.prompt_ids[self.context_length :]

    @property
    def length(self) -> int:
        return len(self.prompt_ids)


def split_point(offsets: list[tuple[int, int]], context_chars: int) -> int:
    """Number of leading tokens that lie entirely inside the first ``context_chars`` characters.

    ``offsets`` is the tokenizer's offset mapping for the whole prompt. A token that straddles
    the boundary goes to the question suffix, so the prefix never holds part of the question.
    """
    count = 0
    for start, end in offsets:
        if end > context_chars and end > start:
            break
        count += 1
    return count


def tokenize_prompt(
    tokenizer, context_text: str, question_text: str, add_special_tokens: bool = False
) -> tuple[tuple[int, ...], int]:
    """Tokenize ``context_text + question_text`` as one sequence and locate the context/question split.

    By default no special tokens are added: chat-templated text already carries what the template
    puts in (no BOS for SmolLM2; Llama 3's template writes its own ``<|begin_of_text|>``). Prompts
    used without a template (LongBench's few-shot and code tasks) pass ``add_special_tokens=True``
    as upstream's plain ``tokenizer(prompt)`` call does.
    """
    encoded = tokenizer(
        context_text + question_text, add_special_tokens=add_special_tokens, return_offsets_mapping=True
    )
    ids = tuple(encoded["input_ids"])
    return ids, split_point(encoded["offset_mapping"], len(context_text))
