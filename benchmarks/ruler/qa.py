"""Question answering over many documents: qa_1 (SQuAD v2.0 dev) and qa_2 (HotpotQA dev distractor).

Upstream: ``scripts/data/synthetic/qa.py`` (``read_squad``, ``read_hotpotqa``,
``generate_input_output``, ``generate_samples``); template and answer prefix from
``scripts/data/synthetic/constants.py``. Sample ``i`` asks question ``i`` of the file (upstream's
``index + pre_samples`` with one chunk); its gold documents are mixed with distractors (first the
other paragraphs of the same SQuAD article, then random documents) and shuffled.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks import BenchmarkError
from benchmarks.ruler.fitting import Budget, fit_sample, search_size
from benchmarks.ruler.prompt import Prompt, PromptFormat
from benchmarks.ruler.templates import DOCUMENT_PROMPT, TEMPLATES, split_template

SPEC = TEMPLATES["qa"]
STEP = 10  # generate_samples ``incremental``: documents


@dataclass(frozen=True)
class Question:
    query: str
    answers: list[str]
    gold: list[int]  # indexes into the sorted unique documents
    related: list[int]  # SQuAD: the other paragraphs of the same article


def read_squad(path: Path) -> tuple[list[Question], list[str]]:
    """Answerable SQuAD questions; documents are the unique paragraphs, sorted."""
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    documents = sorted({paragraph["context"] for article in data for paragraph in article["paragraphs"]})
    number = {document: index for index, document in enumerate(documents)}
    questions = []
    for article in data:
        article_docs = [number[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = number[paragraph["context"]]
            questions.extend(
                Question(
                    qa["question"],
                    [answer["text"] for answer in qa["answers"]],
                    [own],
                    [doc for doc in article_docs if doc != own],
                )
                for qa in paragraph["qas"]
                if not qa["is_impossible"]
            )
    return questions, documents


def read_hotpotqa(path: Path) -> tuple[list[Question], list[str]]:
    """HotpotQA questions; a document is "title\\nsentences", its ten given paragraphs are gold."""
    data = json.loads(path.read_text(encoding="utf-8"))

    def as_document(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({as_document(*paragraph) for sample in data for paragraph in sample["context"]})
    number = {document: index for index, document in enumerate(documents)}
    questions = [
        Question(
            sample["question"],
            [sample["answer"]],
            [number[as_document(*paragraph)] for paragraph in sample["context"]],
            [],
        )
        for sample in data
    ]
    return questions, documents


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


class DocumentSampler:
    """Builds qa prompts with a given number of documents from one seeded run."""

    def __init__(self, fmt: PromptFormat, seed: int, questions: list[Question], documents: list[str]) -> None:
        self.fmt = fmt
        self.seed = seed
        self.rng = random.Random(seed)
        self.questions = questions
        self.documents = documents
        self.head, self.tail = split_template(SPEC.template)

    def choose(self, question: Question, num_docs: int) -> list[int]:
        """Gold documents, then related ones, then random others, up to ``num_docs``."""
        wanted_extra = num_docs - len(question.gold)
        if wanted_extra <= len(question.related):
            return question.gold + self.rng.sample(question.related, wanted_extra)
        taken = set(question.gold + question.related)
        others = [index for index in range(len(self.documents)) if index not in taken]
        extra = self.rng.sample(others, max(0, wanted_extra - len(question.related)))
        return question.gold + question.related + extra

    def build(self, index: int, num_docs: int) -> Prompt:
        question = self.questions[index]
        if num_docs < len(self.documents):
            chosen = self.choose(question, num_docs)
        else:
            # more documents than exist: all of them, repeated
            chosen = (list(range(len(self.documents))) * -(-num_docs // len(self.documents)))[:num_docs]
        random.Random(self.seed).shuffle(chosen)
        context = "\n\n".join(
            DOCUMENT_PROMPT.format(i=i + 1, document=self.documents[doc]) for i, doc in enumerate(chosen)
        )
        return self.fmt.prompt(
            self.head,
            context,
            self.tail.format(query=question.query),
            SPEC.answer_prefix,
            question.answers,
            metadata={
                "question_index": index,
                "num_documents": num_docs,
                "gold_documents": [i + 1 for i, doc in enumerate(chosen) if doc in question.gold],
            },
        )


def generate(
    task: str, args: dict, fmt: PromptFormat, max_seq_length: int, num_samples: int, seed: int
) -> list[Prompt]:
    """generate_samples: estimate and binary search on question 0, then question i for sample i."""
    questions, documents = READERS[args["dataset"]](Path(args["data_file"]))
    if num_samples > len(questions):
        raise BenchmarkError(
            f"RULER {task}: {num_samples} samples asked, {args['data_file']} has {len(questions)} questions"
        )
    sampler = DocumentSampler(fmt, seed, questions, documents)
    budget = Budget(task, max_seq_length, SPEC.tokens_to_generate, fmt)
    tokens_per_doc = fmt.count(sampler.build(0, STEP).text) / STEP
    upper = max(int((max_seq_length / tokens_per_doc) * 3), STEP * 2)
    size = search_size(lambda n: budget.total(sampler.build(0, n)), STEP, upper, budget)
    return [fit_sample(lambda n, i=i: sampler.build(i, n), size, STEP, budget) for i in range(num_samples)]
