"""RULER: 13 synthetic long-context tasks whose prompts are fitted to a length with the backbone's tokenizer.

Upstream: NVIDIA/RULER at commit ``templates.UPSTREAM_COMMIT`` (2026-07-22): ``scripts/data/prepare.py``
(task config + model template + answer prefix), the generators in ``scripts/data/synthetic/``, the
metrics in ``scripts/eval/synthetic/constants.py``. The spec is ``docs/spec/benchmarks.md``.

Every item is one upstream sample: its prompt is a model template around the task text, then the
answer prefix. The model template is the backbone's own chat template (``template="model"``, the
default; single-answer rewording applied to the task text before wrapping, so a system prompt is
not reworded) or one of RULER's own (``template="meta-llama3"``, ...; reworded after wrapping, as
upstream does). The context segment of the item ends with the haystack (or the documents); the
question segment is the question, the end of the template and the answer prefix.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import BenchmarkError
from benchmarks.item import Item
from benchmarks.ruler import common_words, freq_words, niah, qa, qa_sources, variable_tracking
from benchmarks.ruler.cache import DEFAULT_CACHE_DIR, cache_file, read_items, tokenizer_key, write_items
from benchmarks.ruler.prompt import MODEL_TEMPLATE, PromptFormat, check_template, to_item
from benchmarks.ruler.scoring import METRICS, postprocess_pred, task_score
from benchmarks.ruler.templates import TASK_CONFIGS, TEMPLATES, UPSTREAM_COMMIT

__all__ = [
    "TASKS", "TASK_SETS", "UPSTREAM_COMMIT", "generate_items", "load_items", "score_item", "task_score",
]  # fmt: skip

TASKS = tuple(TASK_CONFIGS)
TASK_SETS = {"all": TASKS}
GENERATORS = {
    "niah": niah.generate,
    "variable_tracking": variable_tracking.generate,
    "common_words_extraction": common_words.generate,
    "freq_words_extraction": freq_words.generate,
    "qa": qa.generate,
}


def _check_request(task: str, length: int, num_samples: int, template: str) -> None:
    check_template(template)
    if task not in TASKS:
        raise BenchmarkError(f"unknown ruler task {task!r}; choose one of {list(TASKS)}")
    if not isinstance(length, int) or length <= 0:
        raise BenchmarkError(f"RULER length must be a positive number of tokens, got {length!r}")
    if not isinstance(num_samples, int) or num_samples <= 0:
        raise BenchmarkError(f"RULER num_samples must be a positive integer, got {num_samples!r}")


def _task_args(task: str, qa_data_dir: str | Path | None) -> dict:
    """The task's synthetic.yaml arguments; qa tasks also get their data file (or TaskUnavailable)."""
    generator, args = TASK_CONFIGS[task]
    if generator == "qa":
        return {**args, "data_file": qa_sources.locate(args["dataset"], qa_data_dir)}
    return args


def _generate(
    task: str, args: dict, tokenizer, length: int, num_samples: int, seed: int, template: str
) -> list[Item]:
    generator = TASK_CONFIGS[task][0]
    spec = TEMPLATES[generator]
    fmt = PromptFormat(tokenizer, template)
    prompts = GENERATORS[generator](task, args, fmt, length, num_samples, seed)
    return [
        to_item(task, index, prompt, fmt, spec.tokens_to_generate, spec.metric, length)
        for index, prompt in enumerate(prompts)
    ]


def generate_items(
    task: str,
    tokenizer,
    *,
    length: int,
    num_samples: int,
    seed: int = 42,
    qa_data_dir: str | Path | None = None,
    template: str = MODEL_TEMPLATE,
) -> list[Item]:
    """Generate the items afresh (no cache)."""
    _check_request(task, length, num_samples, template)
    return _generate(task, _task_args(task, qa_data_dir), tokenizer, length, num_samples, seed, template)


def load_items(
    task: str,
    tokenizer,
    *,
    length: int,
    num_samples: int,
    seed: int = 42,
    tokenizer_name: str | None = None,
    cache_dir: str | Path | None = None,
    qa_data_dir: str | Path | None = None,
    template: str = MODEL_TEMPLATE,
) -> list[Item]:
    """Items of one task at ``length`` (RULER's max_seq_length: prompt + tokens to generate),
    read from the on-disk cache when this exact request was generated before.

    ``template`` is ``"model"`` (the backbone's chat template) or a RULER template name
    (``templates.RULER_TEMPLATES``); qa_1/qa_2 without their data raise ``benchmarks.TaskUnavailable``.
    """
    _check_request(task, length, num_samples, template)
    args = _task_args(task, qa_data_dir)
    source = ""
    if "data_file" in args:
        data_file = Path(args["data_file"])
        source = f"{data_file.stem}-{data_file.stat().st_size}"
    tokenizer_id = tokenizer_key(tokenizer, tokenizer_name)
    cache_root = Path(cache_dir or DEFAULT_CACHE_DIR)
    path = cache_file(cache_root, task, length, tokenizer_id, seed, num_samples, source, template)
    items = read_items(path)
    if items is None:
        items = _generate(task, args, tokenizer, length, num_samples, seed, template)
        write_items(path, items)
    return items


def score_item(item: Item, prediction: str) -> float:
    """RULER's per-sample score in [0, 1]: the cleaned prediction against the item's references."""
    return METRICS[item.metric](postprocess_pred(prediction), item.references)
