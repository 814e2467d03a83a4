"""A plan's work per task: its samples, their nominal token counts, and what the result store already
holds of them (``task_plans``), without data or a tokenizer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from scripts.harness.plan import GridEntry, Plan

# Tokens of a sample's question segment (what follows the context: question, the template's end,
# the answer prefix): nominal, as the calibration's question forwards are.
QUESTION_TOKENS = 64
# Tokens per whitespace-separated word: English prose (the RULER essays: ~112K words, ~145K tokens,
# benchmarks.ruler.haystacks) and code (this repository's Python files with the embedded SmolLM2
# tokenizer: 2.84).
TOKENS_PER_WORD = {"prose": 1.3, "code": 2.8}
# LongBench's statistics (THUDM/LongBench, LongBench/task.md): samples and mean length in words
# (Python's split) of each English task, and which are code.
LONGBENCH_STATISTICS = {
    "narrativeqa": (200, 18409),
    "qasper": (200, 3619),
    "multifieldqa_en": (150, 4559),
    "hotpotqa": (200, 9151),
    "2wikimqa": (200, 4887),
    "musique": (200, 11214),
    "gov_report": (200, 8734),
    "qmsum": (200, 10614),
    "multi_news": (200, 2113),
    "trec": (200, 5177),
    "triviaqa": (200, 8209),
    "samsum": (200, 6258),
    "passage_count": (200, 11141),
    "passage_retrieval_en": (200, 9289),
    "lcc": (500, 1235),
    "repobench-p": (500, 4206),
}
LONGBENCH_CODE_TASKS = ("lcc", "repobench-p")


@dataclass(frozen=True)
class Workload:
    """One task's samples and nominal token counts per sample."""

    samples: int | None  # before sharding; None when no count is known
    prompt_tokens: int
    question_tokens: int
    answer_tokens: int  # decode steps: the task's generation length, or the plan's cap
    lengths: str  # where the prompt length comes from
    # ``samples`` is the count the run will have (RULER generates exactly ``num_samples``): result files
    # an earlier round wrote with another count do not override it.
    exact: bool = False


def answer_length(benchmark: str, task: str) -> int:
    """The task's generation length (``Item.max_new_tokens``), from the benchmark's own tables."""
    if benchmark == "ruler":
        from benchmarks.ruler.templates import TASK_CONFIGS, TEMPLATES

        return TEMPLATES[TASK_CONFIGS[task][0]].tokens_to_generate
    from benchmarks.longbench import DATASET2MAXLEN

    return DATASET2MAXLEN[task]


def task_workload(plan: Plan, task: str) -> Workload:
    """Nominal samples and token counts of a task (module docstring): no data, no tokenizer."""
    generated = answer_length(plan.benchmark, task)
    answer = generated if plan.max_new_tokens is None else min(generated, plan.max_new_tokens)
    if plan.benchmark == "ruler":
        return Workload(
            plan.num_samples, plan.length - generated, QUESTION_TOKENS, answer, "length - answer", exact=True
        )
    if plan.benchmark == "longbench" and task in LONGBENCH_STATISTICS:
        count, words = LONGBENCH_STATISTICS[task]
        per_word = TOKENS_PER_WORD["code" if task in LONGBENCH_CODE_TASKS else "prose"]
        prompt = min(plan.length, round(words * per_word) + QUESTION_TOKENS)
        samples = count if plan.num_samples is None else min(count, plan.num_samples)
        return Workload(samples, prompt, QUESTION_TOKENS, answer, f"mean {words:,} words")
    return Workload(plan.num_samples, 0, QUESTION_TOKENS, answer, "no length statistics")


@dataclass
class TaskPlan:
    """A task of the plan: its workload, this shard's sample range and what the store holds of it."""

    task: str
    workload: Workload
    sample_range: tuple[int, int]
    done: dict[GridEntry, set[int]] = field(default_factory=dict)  # samples in the range on disk

    @property
    def range_size(self) -> int:
        return self.sample_range[1] - self.sample_range[0]

    def status(self, entry: GridEntry) -> str:
        found = len(self.done.get(entry, ()))
        return "done" if found == self.range_size else "partial" if found else "to do"

    def pending(self, entries: Sequence[GridEntry]) -> Counter[tuple[GridEntry, ...]]:
        """How many samples of the range lack exactly each set of configurations (none: left out)."""
        lacking: Counter[tuple[GridEntry, ...]] = Counter()
        for index in range(*self.sample_range):
            missing = tuple(entry for entry in entries if index not in self.done.get(entry, ()))
            if missing:
                lacking[missing] += 1
        return lacking


def task_plans(plan: Plan) -> list[TaskPlan]:
    """Every task of the plan with the samples the result store holds of it, read without writing:
    a task's sample count is the plan's where the benchmark makes exactly that many (RULER), else the
    one its result files were written with (a dataset's own size), else the nominal one."""
    from scripts.harness.store import load_results

    held = load_results(plan.runs_dir)[0] if plan.runs_dir.exists() else []
    results = {result.key: result for result in held}
    plans = []
    for task in plan.tasks:
        workload = task_workload(plan, task)
        found = {entry: results.get(entry.key(plan, task)) for entry in plan.grid}
        totals = [result.samples_total for result in found.values() if result is not None]
        total = max(totals) if totals and not workload.exact else workload.samples
        sample_range = plan.shard_range(total) if total is not None else (0, 0)
        done = {
            entry: {index for index in result.samples if sample_range[0] <= index < sample_range[1]}
            for entry, result in found.items()
            if result is not None
        }
        plans.append(TaskPlan(task, workload, sample_range, done))
    return plans
