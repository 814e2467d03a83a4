"""Run a grid of KV-cache compression configurations on a benchmark and file the results.

    python run.py                                   # the embedded default, a few minutes on CPU
    python run.py method=snapkv+reskv ratio=0.9
    python run.py method=[snapkv,snapkv+reskv] ratio=[0.6,0.9] setting=[aware,agnostic]
    python run.py -m hydra/launcher=local method=snapkv,adakv    # parallel jobs (joblib)

Configuration lives in configs/ (Hydra); the loop itself in scripts.experiment. Results go to
``<results_dir>/runs`` (one JSON per configuration, resumable), the log beside them in
``<results_dir>/logs``; README "Running experiments" has the details.
"""

from __future__ import annotations

import logging
import sys
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from benchmarks import BenchmarkError, task_score
from reskv.backbones import BackboneError, load_backbone
from scripts.experiment import GridEntry, GridRun, Plan, PlanError, load_task_items, make_plan
from scripts.results_store import ResultStoreError, load_results

log = logging.getLogger("run")


def summary_line(entry: GridEntry, task: str, document: dict | None) -> str:
    """One line per finished configuration: score, sample count and where the time went."""
    if document is None:
        return f"{task} {entry.describe()}: already complete, skipped"
    summary, timings = document["summary"], document["timings"]
    decode_rate = timings.get("decode_tokens", 0) / timings["decode_s"] if timings.get("decode_s") else 0.0
    return (
        f"{task} {entry.describe()}: score {summary['score']:.2f} over {summary['num_samples']} samples "
        f"(compress {timings.get('compress_s', 0):.1f} s, decode {timings.get('decode_s', 0):.1f} s, "
        f"{decode_rate:.1f} tok/s)"
    )


def result_table(plan: Plan) -> Table:
    """Scores of this plan's configurations as found on disk (resumed and earlier shards included)."""
    keys = {entry.key(plan, task): entry for task in plan.tasks for entry in plan.grid}
    results = [result for result in load_results(plan.runs_dir)[0] if result.key in keys]
    table = Table(title=f"{plan.backbone} · {plan.benchmark}-{plan.length} (score, samples)")
    table.add_column("configuration")
    for task in plan.tasks:
        table.add_column(task, justify="right")
    for entry in plan.grid:
        row = [entry.describe()]
        for task in plan.tasks:
            found = [result for result in results if result.key == entry.key(plan, task)]
            scores = [sample["score"] for sample in found[0].samples.values()] if found else []
            row.append(f"{task_score(scores):.2f} ({len(scores)})" if scores else "–")
        table.add_row(*row)
    return table


def run(plan: Plan) -> None:
    started = time.perf_counter()
    backbone = load_backbone(plan.backbone, plan.dtype, plan.device)
    items = load_task_items(plan, backbone.tokenizer)
    grid = GridRun(plan, backbone, items)
    with logging_redirect_tqdm():
        total = grid.open()
        log.info(
            "%s on %s-%d: %d tasks x %d configurations, %d generations to do (shard %d/%d)",
            plan.backbone,
            plan.benchmark,
            plan.length,
            len(items),
            len(plan.grid),
            total,
            plan.shard_index,
            plan.shard_count,
        )
        with tqdm(total=total, desc="grid", unit="gen", dynamic_ncols=True) as progress:
            grid.on_sample = lambda: progress.update()
            grid.on_finished = lambda entry, task, document: log.info(summary_line(entry, task, document))
            grid.run()
    log.info("done in %.1f s; results in %s", time.perf_counter() - started, plan.runs_dir)
    Console().print(result_table(plan))


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(config: DictConfig) -> None:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        plan = make_plan(OmegaConf.to_container(config, resolve=True))
        run(plan)
    except (PlanError, BackboneError, BenchmarkError, ResultStoreError) as error:
        log.error("%s", error)
        sys.exit(2)


if __name__ == "__main__":
    main()
