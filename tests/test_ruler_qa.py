"""RULER qa_1 / qa_2 document assembly on small fake SQuAD v2 / HotpotQA files, and their absence."""

from __future__ import annotations

import json
import re

import pytest

import benchmarks
from benchmarks.ruler import generate_items, load_items, qa_sources
from benchmarks.ruler.qa import read_hotpotqa, read_squad
from reskv.backbones import load_tokenizer

LENGTH = 1024


def paragraph(article: int, number: int) -> str:
    return (
        f"Paragraph {number} of article {article} tells that the river number {article}{number} flows "
        f"north past the old mill, where the miller kept {number + 3} goats and a lantern."
    )


def squad_fixture() -> dict:
    """Three articles of eight paragraphs; one answerable and one impossible question each."""
    data = []
    for article in range(3):
        paragraphs = []
        for number in range(8):
            paragraphs.append(
                {
                    "context": paragraph(article, number),
                    "qas": [
                        {
                            "question": f"How many goats did the miller of river {article}{number} keep?",
                            "answers": [{"text": str(number + 3)}, {"text": f"{number + 3} goats"}],
                            "is_impossible": False,
                        },
                        {"question": "Who painted the mill?", "answers": [], "is_impossible": True},
                    ],
                }
            )
        data.append({"title": f"Article {article}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": data}


def hotpot_fixture() -> list[dict]:
    """Six questions, each with ten titled paragraphs drawn from a shared pool of fifteen."""
    pool = [[f"Title {i}", [f"Sentence one of {i}. ", f"Sentence two of {i}."]] for i in range(15)]
    return [
        {
            "_id": str(q),
            "question": f"Which title holds fact {q}?",
            "answer": f"Title {q}",
            "context": [pool[(q + k) % 15] for k in range(10)],
        }
        for q in range(6)
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture
def qa_dir(tmp_path):
    (tmp_path / "dev-v2.0.json").write_text(json.dumps(squad_fixture()))
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(hotpot_fixture()))
    return tmp_path


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No download, no environment folder, an empty download folder."""
    monkeypatch.setattr(qa_sources, "download", lambda url, target: False)
    monkeypatch.setattr(qa_sources, "DOWNLOAD_DIR", tmp_path / "downloads")
    monkeypatch.delenv(qa_sources.QA_DIR_ENV, raising=False)


def test_read_squad_keeps_answerable_questions_and_their_article(qa_dir):
    questions, documents = read_squad(qa_dir / "dev-v2.0.json")
    assert len(questions) == 24 and len(documents) == 24
    assert documents == sorted(documents)
    first = questions[0]
    assert first.answers == ["3", "3 goats"]
    assert documents[first.gold[0]] == paragraph(0, 0)
    assert sorted(documents[i] for i in first.related) == sorted(paragraph(0, n) for n in range(1, 8))


def test_read_hotpotqa_documents_are_title_and_joined_sentences(qa_dir):
    questions, documents = read_hotpotqa(qa_dir / "hotpot_dev_distractor_v1.json")
    assert len(questions) == 6 and len(documents) == 15
    assert "Title 3\nSentence one of 3. Sentence two of 3." in documents
    assert len(questions[2].gold) == 10 and questions[2].answers == ["Title 2"]


DOCUMENT = re.compile(r"Document (\d+):\n(.*?)(?=\n\nDocument |\n\nAnswer the)", flags=re.S)


def documents_of(text: str) -> list[tuple[int, str]]:
    return [(int(n), body) for n, body in DOCUMENT.findall(text)]


def test_qa_1_mixes_gold_related_and_random_paragraphs(qa_dir, tokenizer, offline):
    items = generate_items("qa_1", tokenizer, length=LENGTH, num_samples=2, qa_data_dir=qa_dir)
    for index, item in enumerate(items):
        context = tokenizer.decode(item.context_ids)
        question = tokenizer.decode(item.question_ids)
        assert item.length + item.max_new_tokens <= LENGTH
        assert item.max_new_tokens == 32 and item.metric == "string_match_part"
        assert item.references == (str(index + 3), f"{index + 3} goats")
        assert f"Question: How many goats did the miller of river 0{index} keep?" in question
        assert question.endswith("<|im_start|>assistant\n Answer:")
        documents = documents_of(context + question)
        assert [n for n, _ in documents] == list(range(1, len(documents) + 1))
        bodies = [body for _, body in documents]
        assert paragraph(0, index) in bodies
        assert bodies.index(paragraph(0, index)) + 1 in item.metadata["gold_documents"]
        if len(bodies) > 8:  # more than the article holds: all of it, then other articles
            assert all(paragraph(0, n) in bodies for n in range(8))
        assert len(bodies) == item.metadata["num_documents"]


def test_qa_2_keeps_all_ten_given_paragraphs(qa_dir, tokenizer, offline):
    (item,) = generate_items("qa_2", tokenizer, length=LENGTH, num_samples=1, qa_data_dir=qa_dir)
    bodies = [body for _, body in documents_of(tokenizer.decode(item.prompt_ids))]
    assert all(f"Title {k}\nSentence one of {k}. Sentence two of {k}." in bodies for k in range(10))
    assert item.references == ("Title 0",)


def test_qa_files_are_found_through_the_environment(qa_dir, tokenizer, offline, monkeypatch, tmp_path):
    monkeypatch.setenv(qa_sources.QA_DIR_ENV, str(qa_dir))
    items = load_items(
        "qa_1",
        tokenizer,
        length=LENGTH,
        num_samples=1,
        cache_dir=tmp_path / "cache",
        tokenizer_name="smollm2-135m",
    )
    assert items[0].references == ("3", "3 goats")
    (cached,) = (tmp_path / "cache").rglob("*.jsonl")
    assert cached.name.startswith("qa_1-len1024-smollm2-135m-seed42-n1-dev-v2.0-")


@pytest.mark.parametrize(
    ("task", "file_name"), [("qa_1", "dev-v2.0.json"), ("qa_2", "hotpot_dev_distractor_v1.json")]
)
def test_missing_qa_data_is_reported_unavailable(task, file_name, tokenizer, offline, tmp_path):
    with pytest.raises(benchmarks.TaskUnavailable, match=re.escape(file_name)) as error:
        load_items(task, tokenizer, length=LENGTH, num_samples=1, qa_data_dir=tmp_path / "empty")
    assert f"{qa_sources.QA_DIR_ENV}=DIR" in str(error.value)
    assert "benchmark.options.qa_data_dir=DIR" in str(error.value)
    with pytest.raises(benchmarks.TaskUnavailable):
        benchmarks.load_items("ruler", task, tokenizer, length=LENGTH, num_samples=1)


def test_more_samples_than_questions_is_an_error(qa_dir, tokenizer, offline):
    with pytest.raises(benchmarks.BenchmarkError, match="6 questions"):
        generate_items("qa_2", tokenizer, length=LENGTH, num_samples=7, qa_data_dir=qa_dir)
