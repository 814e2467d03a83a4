"""The shared-prefill loop that runs a plan (``scripts.harness.plan``) and files its sample records.

Per sample the prompt is prefilled once and every configuration that still lacks that sample
compresses a copy of the prefilled cache and decodes (``reskv.engine``). Each configuration's
samples go to its own resumable result file (``scripts.harness.store``) as ``SampleRecord``s.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import benchmarks
from baselines.registry import (
    FULL_METHOD,
    RESIDUAL_SUFFIX,
)
from benchmarks.item import Item
from scripts.harness.plan import GridEntry, Plan, PlanError
from scripts.harness.records import SampleRecord
from scripts.harness.store import (
    ResultFile,
    ResultFileLocked,
    ResultKey,
    ResultStoreError,
    prompt_digest,
    write_unavailable,
)

if TYPE_CHECKING:
    from reskv.backbones import Backbone
    from reskv.method import Method

log = logging.getLogger(__name__)


def run_plan(plan: Plan, backbone: Backbone) -> None:
    """Run a plan in this process, without progress display (the run.py loop minus its reporting)."""
    grid = GridRun(plan, backbone, load_task_items(plan, backbone.tokenizer))
    grid.open()
    grid.run()


def load_task_items(plan: Plan, tokenizer) -> dict[str, list[Item]]:
    """Items of every task of the plan; a task whose data is missing here is marked unavailable.

    When every task of the plan is unavailable there is nothing to run: a PlanError says why.
    """
    items, reasons = {}, []
    for task in plan.tasks:
        try:
            items[task] = benchmarks.load_items(
                plan.benchmark,
                task,
                tokenizer,
                length=plan.length,
                num_samples=plan.num_samples,
                **plan.benchmark_options,
            )
        except benchmarks.TaskUnavailable as error:
            key = ResultKey(plan.backbone, plan.benchmark, plan.length, task, None, FULL_METHOD, None)
            path = write_unavailable(plan.runs_dir, key, str(error))
            reasons.append(f"{task}: {error}")
            log.warning(
                "%s/%s unavailable, excluded from averages: %s (marked in %s)",
                plan.benchmark,
                task,
                error,
                path,
            )
    if not items:
        raise PlanError(f"every requested {plan.benchmark} task is unavailable here; " + "; ".join(reasons))
    return items


def sample_prompt(index: int, item: Item, max_new_tokens: int) -> dict[str, Any]:
    """What a sample record says about its prompt, whether it was generated or skipped."""
    return {
        "index": index,
        "prompt_digest": prompt_digest(item.prompt_ids),
        "prompt_tokens": item.length,
        "context_tokens": item.context_length,
        "max_new_tokens": max_new_tokens,
        "references": list(item.references),
        "metric": item.metric,
        "metadata": item.metadata,
    }


def sample_record(
    index: int,
    item: Item,
    max_new_tokens: int,
    generation,
    score: float,
    prefill_timings: dict[str, float],
    shared_by: int,
) -> SampleRecord:
    """One generated sample's entry of a result file (``score`` a fraction in [0, 1]).

    Wall-clock values go under ``timings`` only: the shared prefills of the prompt (``prefill_s``
    for the context, ``question_prefill_s`` for the question when a query-aware configuration
    needed it) and this configuration's own ``compress_s``, ``question_s`` (query-agnostic),
    ``decode_s`` and ``quality_s``; ``run`` adds to the generation's the configurations that shared
    the prefills (``prefill_shared_by``); ``quality`` holds ``reskv.quality``'s measures when the
    plan records them (``reskv.stats`` declares each section).
    """
    return SampleRecord(
        **sample_prompt(index, item, max_new_tokens),
        score=score,
        prediction=generation.text,
        prediction_token_ids=list(generation.token_ids),
        cache_stats=generation.cache_stats,
        timings={**prefill_timings, **generation.timings},
        run={**generation.run, "prefill_shared_by": shared_by},
        quality=generation.quality,
    )


def skipped_record(index: int, item: Item, max_new_tokens: int, reason: str) -> SampleRecord:
    """A sample that was not run, and why: no prediction, ``score`` None (summaries leave it out)."""
    return SampleRecord(**sample_prompt(index, item, max_new_tokens), skipped=reason)


@dataclass
class GridRun:
    """The open result files of a plan and the methods they need; ``run`` fills them.

    ``on_sample`` is called after every generation or skip (progress bars), ``on_finished`` with
    the entry, task and final document as soon as a configuration completes its sample range
    (``None`` for one that an earlier run completed).
    """

    plan: Plan
    backbone: Backbone
    items: dict[str, list[Item]]
    on_sample: Callable[[], None] = lambda: None
    on_finished: Callable[[GridEntry, str, dict[str, Any] | None], None] = lambda entry, task, document: None
    files: dict[tuple[str, GridEntry], ResultFile] = field(default_factory=dict)
    methods: dict[tuple[str, float | None], Method] = field(default_factory=dict)  # by (label, ratio)

    def __post_init__(self) -> None:
        from baselines import build_method
        from reskv.batching import grid_decoding

        # The decode mode and the most rows a batch holds, "auto" resolved for the backbone's device.
        self.decode, self.max_rows = grid_decoding(
            self.plan.decode, self.plan.decode_batch, self.backbone.model.device.type
        )

        plan = self.plan
        for entry in plan.grid:
            if (entry.label, entry.ratio) not in self.methods:
                residual = entry.residual if entry.method.endswith(RESIDUAL_SUFFIX) else None
                self.methods[entry.label, entry.ratio] = build_method(
                    entry.method,
                    entry.ratio,
                    residual=residual,
                    seed=plan.seed,
                    options=dict(entry.options),
                )

    @property
    def environment(self) -> dict[str, Any]:
        """Where this run's timings were taken (stored in each new result file's provenance): the
        machine's CPU model, cores, load average and torch threads (``scripts.machine.machine``), the
        GPU's name on CUDA, the model's device and dtype, the decode mode and the most rows a decode
        batch holds ("auto": as many as the device's memory allows), "auto" resolved."""
        from scripts.machine import machine

        facts, model = machine(), self.backbone.model
        return {
            "cpu": facts["cpu"],
            **({"gpu": facts["gpu"]} if "gpu" in facts else {}),
            "cpu_count": facts["cpu_count"],
            "load_average": facts["load_average"],
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "torch_threads": facts["torch_threads"],
            "decode": self.decode,
            "decode_batch": "auto" if self.max_rows is None else self.max_rows,
        }

    def open(self) -> int:
        """Open (lock, resume) every result file; returns the number of generations still to do."""
        environment = self.environment
        task_score = functools.partial(benchmarks.task_score, self.plan.benchmark)
        for task, items in self.items.items():
            sample_range = self.plan.shard_range(len(items))
            for entry in self.plan.grid:
                result = ResultFile(
                    self.plan.runs_dir,
                    entry.key(self.plan, task),
                    sample_range,
                    len(items),
                    self.plan.identity(entry, environment["dtype"]),
                    task_score,
                    environment,
                )
                try:
                    result.open()
                except ResultFileLocked as error:
                    log.warning("skipping %s %s: %s", task, entry.describe(), error)
                    continue
                except ResultStoreError:
                    self.close()
                    raise
                self.files[task, entry] = result
                try:
                    self._check_resumed_samples(result, items)
                except ResultStoreError:
                    self.close()
                    raise
        return sum(len(result.pending) for result in self.files.values())

    def close(self) -> None:
        """Release every open result file (each writes its final JSON if complete)."""
        for result in self.files.values():
            result.close()
        self.files.clear()

    @staticmethod
    def _check_resumed_samples(result: ResultFile, items: list[Item]) -> None:
        for index, record in result.records.items():
            if index < len(items) and record["prompt_digest"] != prompt_digest(items[index].prompt_ids):
                raise ResultStoreError(
                    f"sample {index} of {result.path} was made from another prompt than the benchmark gives "
                    "now (other data, tokenizer or sample count); use another results_dir"
                )

    def run(self) -> None:
        """Every pending (task, sample, configuration); files are closed (and finished) even on error."""
        try:
            for task, items in self.items.items():
                entries = [entry for entry in self.plan.grid if (task, entry) in self.files]
                for entry in entries:
                    if not self.files[task, entry].pending:
                        self._finish(task, entry)
                for index in range(*self.plan.shard_range(len(items))):
                    pending = [
                        entry
                        for entry in entries
                        if (task, entry) in self.files and index not in self.files[task, entry].records
                    ]
                    if pending:
                        self._run_sample(task, index, items[index], pending)
        finally:
            self.close()

    def _finish(self, task: str, entry: GridEntry) -> None:
        self.on_finished(entry, task, self.files.pop((task, entry)).close())

    def _file(self, task: str, entry: GridEntry, record: SampleRecord) -> None:
        """Persist one sample record; a configuration whose range is now complete is finished at once."""
        result = self.files[task, entry]
        result.append(record.to_json())
        self.on_sample()
        if not result.pending:
            self._finish(task, entry)

    def skip_reason(self, entry: GridEntry, item: Item) -> str | None:
        """Why this configuration cannot run this sample, found before the prefill; None if it can.

        The positions must fit the backbone (prompt + answer <= max_position_embeddings), and the
        ratio must leave at least one KV slot for what the setting compresses (the whole prompt
        query-aware, the context query-agnostic; budget as in reskv.md, Budget).
        """
        from reskv.config import budget_for

        max_new_tokens = self.plan.answer_length(item)
        max_positions = self.backbone.model.config.max_position_embeddings
        if item.length + max_new_tokens > max_positions:
            return (
                f"{item.length} prompt tokens + {max_new_tokens} new tokens exceed the backbone's "
                f"max_position_embeddings {max_positions}"
            )
        if entry.ratio is None:
            return None
        compressed = item.length if entry.setting == "aware" else item.context_length
        if budget_for(compressed, entry.ratio) < 1:
            return (
                f"ratio {entry.ratio:g} leaves no KV slot for the {compressed} tokens the "
                f"{entry.setting} setting compresses (budget floor({compressed} * (1 - {entry.ratio:g})) = 0)"
            )
        return None

    def _run_sample(self, task: str, index: int, item: Item, pending: list[GridEntry]) -> None:
        max_new_tokens = self.plan.answer_length(item)
        runnable = []
        for entry in pending:
            reason = self.skip_reason(entry, item)
            if reason is None:
                runnable.append(entry)
            else:
                log.warning("%s sample %d %s skipped: %s", task, index, entry.describe(), reason)
                self._file(task, entry, skipped_record(index, item, max_new_tokens, reason))
        shared_by = len(runnable) if self.plan.share_prefill else 1
        answer_ids = item.answer_ids(self.backbone.tokenizer) if self.plan.quality else None
        decoding = {
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": item.stop_token_ids,
            "min_new_tokens": min(item.min_new_tokens, max_new_tokens),
            "answer_ids": answer_ids,
        }
        for position, prefill, generation in self._generations(item, runnable, decoding):
            entry = runnable[position]
            score = benchmarks.score_item(item, generation.text)
            self._file(
                task,
                entry,
                sample_record(index, item, max_new_tokens, generation, score, prefill.timings, shared_by),
            )

    def _generations(self, item: Item, runnable: list[GridEntry], decoding: dict):
        """``(index into runnable, its prefill, its generation)`` as each is done: one prefill and
        ``reskv.grid.decode_grid`` (batches of at most ``max_rows`` rows), or a prefill per configuration
        (a configuration without the shared softmax decodes eagerly, which "auto" allows)."""
        from reskv.grid import decode_grid

        requests = [(self.methods[entry.label, entry.ratio], entry.setting or "aware") for entry in runnable]
        if self.plan.share_prefill and runnable:
            prefill = self._prefill(item, runnable)
            grid = decode_grid(prefill, requests, decode=self.decode, max_rows=self.max_rows, **decoding)
            for position, generation in grid:
                yield position, prefill, generation
            return
        for position, (entry, (method, setting)) in enumerate(zip(runnable, requests, strict=True)):
            prefill = self._prefill(item, [entry])
            decode = method.decode_rule.decode_mode(self.decode)
            yield position, prefill, prefill.generate(method, setting, decode=decode, **decoding)

    def _prefill(self, item: Item, served: list[GridEntry]):
        """The prompt's prefill for the configurations ``served`` (the question's too, if one is
        query-aware)."""
        from reskv.engine import Prefill

        prefill = Prefill(
            self.backbone,
            item.prompt_ids,
            item.context_length,
            [self.methods[entry.label, entry.ratio] for entry in served],
        )
        if any(entry.setting != "agnostic" for entry in served):
            # The question's prefill now, shared, rather than inside the first query-aware
            # generation's compress_s (where it made the full cache's compress_s non-zero).
            prefill.observations("aware")
        return prefill
