"""The one item format every benchmark yields and the engine consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reskv.prompting import split_point, tokenize_prompt

__all__ = ["Item", "split_point", "tokenize_prompt"]


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
    # While fewer than this many tokens were generated, the backbone's EOS and ``stop_token_ids``
    # are masked out, so generation cannot end there (LongBench samsum: 1, upstream pred.py's
    # ``min_length=context_length + 1``; the engine's ``Prefill.generate(..., min_new_tokens=...)``).
    min_new_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens {self.min_new_tokens} outside [0, max_new_tokens={self.max_new_tokens}] for "
                f"{self.benchmark}/{self.task}#{self.index}"
            )
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

    def answer_ids(self, tokenizer) -> tuple[int, ...]:
        """The first reference's tokens as they would follow the prompt (after the answer prefix):
        one separating space unless the prompt ends in whitespace (RULER's answer prefixes end in a
        word, "... mentioned in the provided text is"; a chat template ends in a newline). Empty
        when the item has no reference. The quality measures' answer log-likelihood reads them."""
        if not self.references:
            return ()
        last = tokenizer.decode(self.prompt_ids[-1:])
        separator = "" if not last or last[-1].isspace() else " "
        return tuple(tokenizer(separator + self.references[0], add_special_tokens=False)["input_ids"])
