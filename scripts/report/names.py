"""How the tables and figures name settings, backbones, benchmarks, tasks and budgets.

Methods are named by the registry (``baselines.registry``); these are the other display names.
"""

from __future__ import annotations

import benchmarks
from benchmarks.longbench import ENGLISH_TASKS

SETTING_NAMES = {"aware": "q-Aware", "agnostic": "q-Agnostic"}
BACKBONE_NAMES = {
    "llama3.1-8b-instruct": "LLaMA-3.1-8B",
    "qwen2.5-7b-instruct": "Qwen-2.5-7B",
    "smollm2-135m": "SmolLM2-135M",
    "gemma3-270m": "Gemma-3-270M",
    "tiny-llama": "tiny-llama",
    "tiny-qwen2": "tiny-qwen2",
}
BENCHMARK_NAMES = {"ruler": "RULER", "longbench": "LongBench", "longbench-e": "LongBench-E"}
# Column heads; the paper's where it names a task (NrtvQA, RB-P, S-1, ...).
TASK_NAMES = {
    "niah_single_1": "S-1",
    "niah_single_2": "S-2",
    "niah_single_3": "S-3",
    "niah_multikey_1": "MK-1",
    "niah_multikey_2": "MK-2",
    "niah_multikey_3": "MK-3",
    "niah_multivalue": "MV",
    "niah_multiquery": "MQ",
    "vt": "VT",
    "cwe": "CWE",
    "fwe": "FWE",
    "qa_1": "QA-1",
    "qa_2": "QA-2",
    "narrativeqa": "NrtvQA",
    "qasper": "Qasper",
    "multifieldqa_en": "MF-en",
    "hotpotqa": "HotpotQA",
    "2wikimqa": "2WikiMQA",
    "musique": "Musique",
    "gov_report": "Gov.",
    "qmsum": "QMSum",
    "multi_news": "MultiNews",
    "trec": "TREC",
    "triviaqa": "TriviaQA",
    "samsum": "SAMSum",
    "passage_count": "PCount",
    "passage_retrieval_en": "PRe",
    "lcc": "LCC",
    "repobench-p": "RB-P",
    "multifieldqa_zh": "MF-zh",
    "dureader": "DuReader",
    "vcsum": "VCSum",
    "lsht": "LSHT",
    "passage_retrieval_zh": "PRe-zh",
}


def averaged_task_set(benchmark: str) -> tuple[str, ...]:
    """The tasks a benchmark's average is defined over (LongBench: its 16 English tasks)."""
    return tuple(ENGLISH_TASKS) if benchmark == "longbench" else benchmarks.tasks(benchmark)


def retained(ratio: float, cache_share: float | None = None) -> str:
    """Column head of a compression ratio: the retained share of the KV cache (0.9 -> 10%); with the
    whole cache's share where it differs (a model with sliding-window layers, reskv.md, Hybrid
    attention), both: ``10% (45% of cache)``."""
    head = f"{round((1 - ratio) * 100, 1):g}%"
    return head if cache_share is None else f"{head} ({round(cache_share * 100):g}% of cache)"


def backbone_name(backbone: str) -> str:
    return BACKBONE_NAMES.get(backbone, backbone)


def length_name(benchmark: str, length: int) -> str:
    return f"{length // 1024}K" if benchmark == "ruler" and length % 1024 == 0 else str(length)


def benchmark_name(benchmark: str, length: int) -> str:
    """A benchmark and length as tables and figures title them: ``RULER-4K``."""
    return f"{BENCHMARK_NAMES.get(benchmark, benchmark)}-{length_name(benchmark, length)}"
