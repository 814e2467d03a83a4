"""A RULER prompt in the backbone's chat template, its token count and its Item.

Upstream (``scripts/data/prepare.py``) builds the prompt as ``model_template.format(task_template=
template) + answer_prefix``, with hand-written model templates (``scripts/data/template.py``), and
counts its tokens with the backbone's tokenizer without special tokens (``scripts/data/tokenizer.py``,
``HFTokenizer.text_to_tokens``). Here the model template is the backbone's own chat template: the
task text is the single user message, the generation prompt follows and the answer prefix is
appended after it. A tokenizer without a chat template gets upstream's ``base`` template (the task
text alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks import BenchmarkError
from benchmarks.item import Item, tokenize_prompt


@dataclass(frozen=True)
class Prompt:
    """The whole prompt text and where its context (the haystack or documents) ends."""

    text: str
    context_chars: int
    answer_prefix: str
    references: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptFormat:
    """Wraps task text in the backbone's chat template and counts tokens with its tokenizer.

    ``use_chat_template=False`` is upstream's ``base`` template (vt's in-context example is built so).
    """

    def __init__(self, tokenizer, use_chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and tokenizer.chat_template is not None

    def count(self, text: str) -> int:
        """Token count of ``text`` as upstream measures it: no BOS or other added special tokens."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, user_text: str) -> str:
        """``user_text`` as the one user turn of the chat template, generation prompt included."""
        if not self.use_chat_template:
            return user_text
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )

    def prompt(
        self,
        head: str,
        context: str,
        tail: str,
        answer_prefix: str,
        references: list[str] | tuple[str, ...],
        metadata: dict[str, Any] | None = None,
        lead: str = "",
    ) -> Prompt:
        """``lead + chat(head + context + tail) + answer_prefix``; the context ends after ``context``.

        ``lead`` is text upstream puts before the model template (cwe's few-shot example).
        """
        task_text = head + context + tail
        wrapped = self.chat(task_text)
        start = wrapped.find(task_text)
        if start < 0:
            raise BenchmarkError("the chat template rewrites the user message; RULER's context is lost in it")
        return Prompt(
            text=lead + wrapped + answer_prefix,
            context_chars=len(lead) + start + len(head) + len(context),
            answer_prefix=answer_prefix,
            references=tuple(references),
            metadata=dict(metadata or {}),
        )


def to_item(task: str, index: int, prompt: Prompt, tokenizer, tokens_to_generate: int, metric: str,
            max_seq_length: int) -> Item:
    """The Item of one prompt: context = text up to the end of the haystack, question = the rest."""
    context_text = prompt.text[: prompt.context_chars]
    prompt_ids, context_length = tokenize_prompt(tokenizer, context_text, prompt.text[prompt.context_chars:])
    metadata = {
        "max_seq_length": max_seq_length,
        # upstream's "length": prompt tokens plus the tokens to generate
        "length": len(prompt_ids) + tokens_to_generate,
        "prompt_tokens": len(prompt_ids),
        **prompt.metadata,
    }
    return Item(
        benchmark="ruler",
        task=task,
        index=index,
        prompt_ids=prompt_ids,
        context_length=context_length,
        answer_prefix=prompt.answer_prefix,
        references=prompt.references,
        max_new_tokens=tokens_to_generate,
        metric=metric,
        metadata=metadata,
    )
