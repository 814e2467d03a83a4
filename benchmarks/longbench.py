"""LongBench v1: samples, prompts and scoring as upstream's ``LongBench/`` code defines them.

Upstream: ``THUDM/LongBench`` (MIT), read at commit 2e00731f8d0bff23dc4325161044d0ed8af94c1e.
Prompt templates and generation lengths are ``LongBench/config/dataset2prompt.json`` and
``dataset2maxlen.json``, copied verbatim into ``longbench_prompts.json``; prompt building follows
``LongBench/pred.py``, scoring ``LongBench/eval.py``, the metrics ``LongBench/metrics.py``
(``benchmarks.metrics``). LongBench-E (the ``_e`` files, ``scorer_e``) is ``benchmarks.longbench_e``.

Chat template rule. The paper keeps the native completion format for the code tasks only (lcc,
repobench-p) and uses the backbone's chat template everywhere else: ``template_rule="paper"``, the
default. ``template_rule="upstream"`` is ``pred.py``'s rule, which also leaves trec, triviaqa, samsum
and lsht untemplated.

Context/question split (ours; upstream has no such notion). The context segment is everything up
to the end of the sample's ``context`` field: the chat template's opening, the task instruction
and the context itself. The question segment is the rest: the question, the answer cue and the
template's generation prompt. Without truncation the boundary is known exactly from the template.
When the middle truncation removes tokens, the context segment is the kept tokens that lay wholly
inside the original context segment: if the cut falls inside the context (the usual case) the
boundary stays right before the question; if the question alone is longer than the kept tail half,
the cut reaches into the question, the head half is context and the tail half (part of the
question) is question. A token straddling the boundary goes to the question, as
``benchmarks.item.split_point`` does.
"""

from __future__ import annotations

import json
import os
import socket
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks import BenchmarkError, TaskUnavailable
from benchmarks.item import Item, split_point, tokenize_prompt
from benchmarks.metrics import METRICS

TASKS = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
    "multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh",
)  # fmt: skip
# The 16 English tasks whose unweighted mean KV-compression papers report.
ENGLISH_TASKS = TASKS[:16]
TASK_SETS = {"all": TASKS, "english": ENGLISH_TASKS}

# Tasks left without the chat template, per rule. "paper": the code-completion tasks keep their
# native format (the paper's setup). "upstream": pred.py's "chat models are better off without
# build prompts on these tasks".
NO_CHAT_TEMPLATE_TASKS = {
    "paper": frozenset({"lcc", "repobench-p"}),
    "upstream": frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}),
}
TEMPLATE_RULES = tuple(NO_CHAT_TEMPLATE_TASKS)
# eval.py: these tasks score only the first line of the prediction.
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# eval.py ``dataset2metric``, by metric name (keys of ``benchmarks.metrics.METRICS``).
TASK_METRICS = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}

_SPEC = json.loads(Path(__file__).with_name("longbench_prompts.json").read_text(encoding="utf-8"))
DATASET2PROMPT: dict[str, str] = _SPEC["dataset2prompt"]
DATASET2MAXLEN: dict[str, int] = _SPEC["dataset2maxlen"]

DATA_ENV = "RESKV_LONGBENCH_DIR"
HUB_DATASET = "THUDM/LongBench"
DATA_ZIP_URL = f"https://huggingface.co/datasets/{HUB_DATASET}/resolve/main/data.zip"
# Seconds to wait for the hub before reporting the data as missing (it is unreachable offline).
HUB_TIMEOUT = 5.0
FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


def _local_candidates(file_stem: str, data_dir: str | Path | None) -> list[Path]:
    """Where the task's jsonl may lie: the official ``data.zip`` layout or a flat directory."""
    root = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    if not root:
        return []
    return [Path(root) / "data" / f"{file_stem}.jsonl", Path(root) / f"{file_stem}.jsonl"]


def _probe_hub(endpoint: str) -> None:
    """Raise ``OSError`` unless the hub accepts a connection: huggingface_hub itself retries at length."""
    url = urlsplit(endpoint)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT).close()
    except OSError as error:
        raise OSError(f"{endpoint} unreachable ({error})") from error


def _hub_data_zip() -> Path:
    """``data.zip`` of the hub dataset, from the local hub cache or downloaded.

    The hub dataset is a loading script plus ``data.zip``; ``datasets`` >= 4 no longer runs
    loading scripts, so the archive itself is fetched. Raises ``OSError`` when unavailable.
    """
    from huggingface_hub import constants, hf_hub_download

    try:
        return Path(hf_hub_download(HUB_DATASET, "data.zip", repo_type="dataset", local_files_only=True))
    except OSError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise OSError("HF_HUB_OFFLINE is set")
    _probe_hub(constants.ENDPOINT)
    try:
        return Path(hf_hub_download(HUB_DATASET, "data.zip", repo_type="dataset", etag_timeout=HUB_TIMEOUT))
    except Exception as error:  # HTTP errors of huggingface_hub are not OSErrors
        raise OSError(f"download failed: {error}") from error


def _missing_data(file_stem: str, candidates: list[Path], hub_problem: str) -> TaskUnavailable:
    unset = f"nothing (benchmark.options.data_dir unset, {DATA_ENV} unset)"
    looked = " or ".join(map(str, candidates)) or unset
    return TaskUnavailable(
        f"LongBench data file {file_stem}.jsonl not found: looked for {looked}; hub: {hub_problem}. "
        f"Download {DATA_ZIP_URL} and unzip it into a directory DIR (giving DIR/data/{file_stem}.jsonl), "
        f"then pass benchmark.options.data_dir=DIR on the command line or set the environment "
        f"variable {DATA_ENV}=DIR."
    )


def _parse_samples(lines: Iterable[str], source: str, limit: int | None) -> tuple[list[dict], dict]:
    """The first ``limit`` samples and the file's last sample."""
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise BenchmarkError(f"{source} holds no samples")
    numbered = [*enumerate(lines[:limit]), (len(lines) - 1, lines[-1])]
    parsed = []
    for number, line in numbered:
        sample = json.loads(line)
        missing = [name for name in FIELDS if name not in sample]
        if missing:
            raise BenchmarkError(f"{source}: sample {number} lacks the LongBench fields {missing}")
        parsed.append(sample)
    return parsed[:-1], parsed[-1]


def read_samples(
    file_stem: str, data_dir: str | Path | None = None, limit: int | None = None
) -> tuple[list[dict], dict]:
    """Samples of ``data/<file_stem>.jsonl`` in file order (the first ``limit`` of them) and the
    file's last sample: local jsonl, else the hub's ``data.zip``; ``TaskUnavailable`` without either."""
    candidates = _local_candidates(file_stem, data_dir)
    for path in candidates:
        if path.is_file():
            return _parse_samples(path.read_text(encoding="utf-8").splitlines(), str(path), limit)
    try:
        archive = _hub_data_zip()
    except OSError as error:
        raise _missing_data(file_stem, candidates, str(error)) from error
    member = f"data/{file_stem}.jsonl"
    with zipfile.ZipFile(archive) as bundle:
        if member not in bundle.namelist():
            raise _missing_data(file_stem, candidates, f"{archive} has no {member}")
        text = bundle.read(member).decode("utf-8")
    return _parse_samples(text.splitlines(), f"{archive}:{member}", limit)


def format_prompt(task: str, sample: dict) -> tuple[str, int]:
    """``dataset2prompt[task].format(**sample)`` and the offset where the sample's context ends in it.

    Every template holds ``{context}`` once and puts ``{input}`` after it, so formatting the two
    sides of ``{context}`` apart gives the same text with the boundary known exactly.
    """
    before, after = DATASET2PROMPT[task].split("{context}")
    head = before.format(**sample) + sample["context"]
    return head + after.format(**sample), len(head)


def _common_prefix_length(first: str, second: str) -> int:
    length = min(len(first), len(second))
    return next((index for index in range(length) if first[index] != second[index]), length)


def truncate_middle(tokenizer, prompt: str, context_end: int, max_length: int) -> tuple[str, int]:
    """``pred.py``'s middle truncation, carrying the context boundary along.

    The prompt is tokenized as upstream's ``tokenizer(prompt, truncation=False)`` (special tokens
    included); when longer than ``max_length`` the first and last ``max_length // 2`` tokens are
    decoded apart with ``skip_special_tokens=True`` and joined. The boundary moves to the end of
    the kept tokens lying wholly inside the context (see the module docstring); it is measured on
    the joined text as the common prefix with the decoded context tokens, which is exact unless
    decoding a partial sequence differs at its end (a split multi-byte character), and then errs
    towards the question.
    """
    encoded = tokenizer(prompt, truncation=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    if len(ids) <= max_length:
        return prompt, context_end
    half = max_length // 2
    head, tail = ids[:half], ids[-half:]
    text = tokenizer.decode(head, skip_special_tokens=True) + tokenizer.decode(tail, skip_special_tokens=True)
    context_tokens = split_point(encoded["offset_mapping"], context_end)
    tail_context_tokens = max(0, context_tokens - (len(ids) - half))
    kept_context = tokenizer.decode(head[:context_tokens], skip_special_tokens=True) + tokenizer.decode(
        tail[:tail_context_tokens], skip_special_tokens=True
    )
    return text, _common_prefix_length(text, kept_context)


def chat_wrap(tokenizer, prompt: str, context_end: int) -> tuple[str, int]:
    """The backbone's own chat template around the prompt, and where the context ends in it.

    The question text is located by its last occurrence in the templated text, right-stripped,
    so templates that trim the message (Llama 3's ``| trim``) are handled too.
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    question = prompt[context_end:].rstrip()
    start = text.rfind(question) if question else -1
    if start <= 0:
        raise BenchmarkError(
            f"cannot find the question {question[:60]!r} in the chat-templated prompt: the template "
            "rewrites the message, so the context/question split is unknown"
        )
    return text, start


def newline_token_id(tokenizer) -> int:
    """``pred.py``'s extra samsum stop token: ``tokenizer.encode("\\n", add_special_tokens=False)[-1]``."""
    return tokenizer.encode("\n", add_special_tokens=False)[-1]


def build_item(
    benchmark: str,
    task: str,
    tokenizer,
    sample: dict,
    index: int,
    max_length: int,
    template_rule: str,
    all_classes: list[str] | None,
) -> Item:
    """One sample as an ``Item``: format, truncate in the middle, template, tokenize and split.

    ``all_classes`` is the task file's (its last line's): ``eval.py`` scores every prediction of a
    file with the ``all_classes`` of the last line it read. samsum gets upstream's generation rule:
    a newline also ends the answer, and the first token is neither EOS nor a newline
    (``pred.py``: ``min_length=context_length + 1``, ``eos_token_id=[eos, newline]``).
    """
    prompt, context_end = truncate_middle(tokenizer, *format_prompt(task, sample), max_length)
    templated = task not in NO_CHAT_TEMPLATE_TASKS[template_rule]
    if templated:
        prompt, context_end = chat_wrap(tokenizer, prompt, context_end)
    prompt_ids, context_length = tokenize_prompt(
        tokenizer, prompt[:context_end], prompt[context_end:], add_special_tokens=not templated
    )
    return Item(
        benchmark=benchmark,
        task=task,
        index=index,
        prompt_ids=prompt_ids,
        context_length=context_length,
        answer_prefix="",
        references=tuple(sample["answers"]),
        max_new_tokens=DATASET2MAXLEN[task],
        metric=TASK_METRICS[task],
        stop_token_ids=(newline_token_id(tokenizer),) if task == "samsum" else (),
        min_new_tokens=1 if task == "samsum" else 0,
        metadata={"all_classes": all_classes, "length": sample["length"], "_id": sample["_id"]},
    )


def check_options(length: int, num_samples: int | None, template_rule: str) -> None:
    if length < 2:
        raise BenchmarkError(f"length {length} too small: the middle truncation keeps length // 2 tokens")
    if num_samples is not None and num_samples < 0:
        raise BenchmarkError(f"num_samples must be >= 0 or None, got {num_samples}")
    if template_rule not in TEMPLATE_RULES:
        raise BenchmarkError(
            f"unknown LongBench template_rule {template_rule!r} (benchmark.options.template_rule); "
            f"choose one of {list(TEMPLATE_RULES)}"
        )


def items_from_file(
    benchmark: str,
    task: str,
    file_stem: str,
    tokenizer,
    length: int,
    num_samples: int | None,
    data_dir: str | Path | None,
    template_rule: str,
) -> list[Item]:
    """Items of the first ``num_samples`` samples of ``data/<file_stem>.jsonl``, prompted as ``task``."""
    check_options(length, num_samples, template_rule)
    samples, last = read_samples(file_stem, data_dir, limit=num_samples)
    return [
        build_item(benchmark, task, tokenizer, sample, index, length, template_rule, last["all_classes"])
        for index, sample in enumerate(samples)
    ]


def load_items(
    task: str,
    tokenizer,
    *,
    length: int,
    num_samples: int | None = None,
    data_dir: str | Path | None = None,
    template_rule: str = "paper",
    seed: int = 42,
) -> list[Item]:
    """Items of one task: the first ``num_samples`` samples of ``data/<task>.jsonl`` (all when None).

    ``length`` is LongBench's ``max_length`` for the middle truncation (``model2maxlen`` upstream).
    ``template_rule`` is ``"paper"`` or ``"upstream"`` (module docstring). ``seed`` is accepted for
    the harness's uniform call; LongBench draws nothing at random. Missing data raises
    ``benchmarks.TaskUnavailable`` with the way to get it.
    """
    if task not in TASKS:
        raise BenchmarkError(f"unknown longbench task {task!r}; choose one of {list(TASKS)}")
    return items_from_file("longbench", task, task, tokenizer, length, num_samples, data_dir, template_rule)


def score_item(item: Item, prediction: str) -> float:
    """``eval.py``'s per-sample score: first line only for some tasks, max of the metric over references."""
    if item.task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[item.metric]
    all_classes = item.metadata.get("all_classes")
    scores = (metric(prediction, reference, all_classes=all_classes) for reference in item.references)
    return float(max([0.0, *scores]))


def task_score(sample_scores: Sequence[float]) -> float:
    """``eval.py`` ``scorer``: ``round(100 * total_score / len(predictions), 2)``, the total summed in
    sample order from 0 (so ``(100 * total) / n``, not ``100 * (total / n)``)."""
    return round(100 * sum(sample_scores) / len(sample_scores), 2)
