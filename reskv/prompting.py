"""A prompt as one token sequence split into a reusable context prefix and a question suffix."""

from __future__ import annotations


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
