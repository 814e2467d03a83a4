"""RULER's prompt strings and task settings: specification data, reproduced exactly (typos included).

Upstream: NVIDIA/RULER (Apache-2.0) at commit ``UPSTREAM_COMMIT``.

- task templates, answer prefixes, tokens to generate: ``scripts/data/synthetic/constants.py``
- per-task arguments of the 13 tasks: ``scripts/synthetic.yaml``
- metric per task: ``scripts/eval/synthetic/constants.py``
- needle and noise sentences: ``scripts/data/synthetic/niah.py``, ``variable_tracking.py``
- document format: ``scripts/data/synthetic/qa.py``
- single-answer rewording: ``scripts/data/synthetic/niah.py`` (``generate_input_output``)
- model templates (RULER's own chat wrappers): ``scripts/data/template.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UPSTREAM_REPO = "NVIDIA/RULER"
UPSTREAM_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"  # 2026-07-22, "Merge pull request #108"


@dataclass(frozen=True)
class TaskTemplate:
    """One entry of upstream's ``TASKS`` dict (data constants) with its eval metric."""

    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str


TEMPLATES = {
    "niah": TaskTemplate(
        template=(
            "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
            "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
            "magic {type_needle_v} for {query} mentioned in the provided text?"
        ),
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
        tokens_to_generate=128,
        metric="string_match_all",
    ),
    "variable_tracking": TaskTemplate(
        template=(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
        ),
        answer_prefix=(
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
            "are assigned the value {query}, they are: "
        ),
        tokens_to_generate=30,
        metric="string_match_all",
    ),
    "common_words_extraction": TaskTemplate(
        template=(
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize "
            "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
            "above list?"
        ),
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        tokens_to_generate=120,
        metric="string_match_all",
    ),
    "freq_words_extraction": TaskTemplate(
        template=(
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
            "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
            "text?"
        ),
        answer_prefix=(
            " Answer: According to the coded text above, the three most frequently appeared words are:"
        ),
        tokens_to_generate=50,
        metric="string_match_all",
    ),
    "qa": TaskTemplate(
        template=(
            "Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
            "the given documents. Only give me the answer and do not output any other words.\n\n"
            "Question: {query}"
        ),
        answer_prefix=" Answer:",
        tokens_to_generate=32,
        metric="string_match_part",
    ),
}


def _niah(
    type_haystack: str,
    type_needle_k: str,
    type_needle_v: str,
    num_needle_k: int = 1,
    num_needle_v: int = 1,
    num_needle_q: int = 1,
) -> tuple[str, dict[str, Any]]:
    return "niah", dict(
        type_haystack=type_haystack,
        type_needle_k=type_needle_k,
        type_needle_v=type_needle_v,
        num_needle_k=num_needle_k,
        num_needle_v=num_needle_v,
        num_needle_q=num_needle_q,
    )


# scripts/synthetic.yaml: task name -> (upstream generator, its arguments), in the yaml's order.
TASK_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_needle_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_needle_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_needle_q=4),
    "vt": ("variable_tracking", dict(type_haystack="noise", num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}

# niah.py: every needle, and every sentence of the "needle" haystack.
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# niah.py / variable_tracking.py: the "noise" haystack repeats this sentence.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# qa.py
DOCUMENT_PROMPT = "Document {i}:\n{document}"

# scripts/data/template.py ``Templates``: RULER's hand-written model templates, by name (the
# ``--model_template_type`` of prepare.py; scripts/config_models.sh uses meta-llama3 for Llama 3.1).
RULER_TEMPLATES = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:"
    ),
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    ),
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": (
        "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full "
        "details. Please feel free to ask any question and I will always answer it\n\nUser: {task_template}"
        "\n\nAssistant:"
    ),
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "jamba": (
        "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>"
    ),
    "nemotron5-instruct": "<SPECIAL_10>System\n\n<SPECIAL_11>User\n{task_template}\n<SPECIAL_11>Assistant\n",
}

# niah.py applies these replacements, in order, when exactly one value is asked for.
SINGLE_ANSWER_REWORDING = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


def single_answer(text: str) -> str:
    """niah.py's rewording of the template for a single answer ("Some ... are" -> "A ... is")."""
    for old, new in SINGLE_ANSWER_REWORDING:
        text = text.replace(old, new)
    return text


def split_template(template: str) -> tuple[str, str]:
    """The template's text before and after ``{context}`` (formatted apart, so the haystack is never
    passed through ``str.format``)."""
    head, tail = template.split("{context}")
    return head, tail
