"""A RULER prompt in a model template, its token count and its Item.

Upstream (``scripts/data/prepare.py``) builds the prompt as ``model_template.format(task_template=
template) + answer_prefix``, with hand-written model templates (``scripts/data/template.py``), and
counts its tokens with the backbone's tokenizer without special tokens (``scripts/data/tokenizer.py``,
``HFTokenizer.text_to_tokens``). The model template here is, by default (``template="model"``), the
backbone's own chat template: the task text is the single user message, the generation prompt
follows and the answer prefix is appended after it; a tokenizer without a chat template gets
upstream's ``base`` template (the task text alone). ``template=<name>`` uses upstream's template of
that name instead (``templates.RULER_TEMPLATES``), for parity with official RULER numbers.

Token ids of the final prompt: with the backbone's chat template no special tokens are added (the
template writes its own); with a RULER template the prompt is tokenized as upstream's inference
does (``scripts/pred/model_wrappers.py`` and the vLLM server call the tokenizer with its default
special tokens), so a tokenizer that adds BOS adds it, even in front of ``meta-llama3``'s own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks import BenchmarkError
from benchmarks.item import Item, tokenize_prompt
from benchmarks.ruler.templates import RULER_TEMPLATES, single_answer

MODEL_TEMPLATE = "model"  # the backbone's own chat template
TEMPLATE_CHOICES = (MODEL_TEMPLATE, *RULER_TEMPLATES)


@dataclass(frozen=True)
class Prompt:
    """The whole prompt text and where its context (the haystack or documents) ends."""

    text: str
    context_chars: int
    answer_prefix: str
    references: tuple[str, ...]
    metadata: dict[str, Any] = field(default_factory=dict)


def check_template(template: str) -> None:
    if template not in TEMPLATE_CHOICES:
        raise BenchmarkError(
            f"unknown RULER template {template!r} (benchmark.options.template); choose one of "
            f"{list(TEMPLATE_CHOICES)}: 'model' is the backbone's chat template, the others are "
            "RULER's scripts/data/template.py"
        )


class PromptFormat:
    """Wraps task text in a model template and counts tokens with the backbone's tokenizer.

    ``template`` is ``"model"`` (the backbone's chat template; upstream's ``base`` when it has none)
    or a RULER template name; ``"base"`` is the task text alone (vt's in-context example is built so).
    """

    def __init__(self, tokenizer, template: str = MODEL_TEMPLATE) -> None:
        check_template(template)
        self.tokenizer = tokenizer
        if template == MODEL_TEMPLATE and tokenizer.chat_template is None:
            template = "base"
        self.template = template
        # RULER's template as the text before and after the task (None: the backbone's chat template)
        self.wrapper = None
        if template != MODEL_TEMPLATE:
            self.wrapper = RULER_TEMPLATES[template].split("{task_template}")

    @property
    def add_special_tokens(self) -> bool:
        """Whether the final prompt's tokenization adds the tokenizer's special tokens (module docstring)."""
        return self.wrapper is not None

    def for_single_answer(self) -> PromptFormat:
        """The format for a single-answer niah prompt, whose task text the caller rewords itself.

        Upstream rewords the whole wrapped template (``niah.py``), so a RULER template's own text is
        reworded too; the backbone's chat template (which may hold a system prompt) is left alone.
        """
        if self.wrapper is None:
            return self
        reworded = PromptFormat(self.tokenizer, self.template)
        reworded.wrapper = [single_answer(part) for part in self.wrapper]
        return reworded

    def count(self, text: str) -> int:
        """Token count of ``text`` as upstream measures it: no BOS or other added special tokens."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, user_text: str) -> str:
        """``user_text`` as the one user turn of the chat template, generation prompt included."""
        if self.wrapper is not None:
            before, after = self.wrapper
            return before + user_text + after
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


def to_item(
    task: str,
    index: int,
    prompt: Prompt,
    fmt: PromptFormat,
    tokens_to_generate: int,
    metric: str,
    max_seq_length: int,
) -> Item:
    """The Item of one prompt: context = text up to the end of the haystack, question = the rest."""
    context_text = prompt.text[: prompt.context_chars]
    question_text = prompt.text[prompt.context_chars :]
    prompt_ids, context_length = tokenize_prompt(
        fmt.tokenizer, context_text, question_text, add_special_tokens=fmt.add_special_tokens
    )
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
