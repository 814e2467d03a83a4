"""Run a grid of KV-cache compression configurations on a benchmark and file the results.

    python run.py                                   # the embedded default, a few minutes on CPU
    python run.py method=snapkv+reskv ratio=0.9
    python run.py method=[snapkv,snapkv+reskv] ratio=[0.6,0.9] setting=[aware,agnostic]
    python run.py -m hydra/launcher=local method=snapkv,adakv    # parallel jobs (joblib)
    python run.py grid=paper_ruler dry_run=true     # the grid, its result files and device hours
    python run.py --help                            # methods, benchmarks, tasks, presets, options

Configuration lives in configs/ (Hydra); the loop itself in scripts.harness.grid. Results go to
``<results_dir>/runs`` (one JSON per configuration, resumable), the log beside them in
``<results_dir>/logs``; README "Running experiments" has the details.

``--help`` and every configuration error answer before torch and transformers are imported
(those imports take far longer than the answer); a failed invocation leaves no log directory behind.
"""

from __future__ import annotations

import logging
import shutil
import sys
import textwrap
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import benchmarks
from baselines.registry import METHODS, OPTIONS, RESKV_OPTIONS
from reskv.config import SETTINGS
from scripts.harness.dry_run import check_dry_run
from scripts.harness.plan import CONFIG_DIR, GridEntry, Plan, PlanError, make_plan
from scripts.harness.records import MethodLabel, option_text

log = logging.getLogger("run")
# Config groups chosen by name on the command line (``backbone=tiny-llama``); a name not in
# configs/<group>/ is refused here, before Hydra, with the same message and exit code as any
# other bad value.
CONFIG_GROUPS = ("backbone", "benchmark", "grid", "ablation")
PAPER_RATIOS = (0.6, 0.7, 0.8, 0.9)
INTERRUPTED = "interrupted; rerun the same command to resume"


def group_choices(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))


def check_group_overrides(arguments: list[str]) -> None:
    """Refuse ``group=name`` (or a sweep ``group=a,b``) naming no file of configs/<group>/."""
    for argument in arguments:
        key, separator, value = argument.lstrip("+~").partition("=")
        if not separator or key not in CONFIG_GROUPS or "(" in value:
            continue
        choices = group_choices(key)
        for name in value.split(","):
            if name not in choices and not (key == "grid" and name == "null"):
                raise PlanError(f"unknown {key} {name!r}; choose from {choices}")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def override_text(value) -> str:
    """An option value as a command-line override writes it: a label's text, a list in brackets."""
    if isinstance(value, tuple):
        return "[" + ",".join(option_text(part) for part in value) + "]"
    return option_text(value)


def usage() -> str:
    """``--help``: what can be run, from the registries themselves (no torch needed)."""
    task_lines = []
    for benchmark in benchmarks.BENCHMARKS:
        sets = ", ".join(benchmarks.task_sets(benchmark))
        task_lines.append(f"  {benchmark} ({sets}): {', '.join(benchmarks.tasks(benchmark))}")
    return "\n".join(
        [
            "usage: python run.py [-m] [key=value ...]      (Hydra overrides; lists as key=[a,b])",
            "",
            __doc__.split("\n\n")[1].rstrip(),
            "",
            f"method=      {', '.join(METHODS)}",
            '             a method may carry option overrides, quoted: "method=[snapkv+reskv,'
            "'snapkv+reskv~validate=false']\"",
            f"setting=     {', '.join(SETTINGS)}  (query-aware / query-agnostic compression)",
            "ratio=       fraction of the prompt's KV evicted, strictly in (0, 1); the paper uses "
            + ", ".join(f"{ratio:g}" for ratio in PAPER_RATIOS)
            + "\n             (a model with sliding-window layers: of its full-attention layers' KV)",
            f"backbone=    {', '.join(group_choices('backbone'))}",
            f"benchmark=   {', '.join(group_choices('benchmark'))}",
            "benchmark.tasks=  a list of tasks or a task set:",
            *task_lines,
            "benchmark.length=  prompt length in tokens (RULER's sequence length, LongBench's truncation)",
            f"grid=        sweep presets: {', '.join(group_choices('grid'))}",
            f"ablation=    {', '.join(group_choices('ablation'))}",
            "",
            "num_samples=N (null: every sample)   seed=42   max_new_tokens=N (cap; smoke tests only)",
            "shard.index=I shard.count=K (split samples over jobs)   share_prefill=true|false",
            "threads=N (torch CPU threads)   results_dir=DIR   decode=auto|eager|compiled",
            "decode_batch=N|auto (configurations of a sample decoded together; 1: each alone)",
            "jobs_per_gpu=N (a sweep's jobs sharing one GPU of a node; 1: a GPU each, held by a lock)",
            "dry_run=true|calibrate (print the grid, its result files and device hours; calibrate: "
            "measure this device first)   calibration=DEVICE-KIND|FILE.json",
            *(
                f"{name}={override_text(option.default)} ({type(option.default).__name__})  {option.help}"
                for name, option in OPTIONS.items()
            ),
            "reskv.OPTION=...  ResKV hyper-parameters, here at their defaults (reskv.config.ResidualConfig):",
            *textwrap.wrap(
                "  ".join(f"{name}={override_text(value)}" for name, value in RESKV_OPTIONS.items()),
                width=100,
                initial_indent="  ",
                subsequent_indent="  ",
                break_on_hyphens=False,
            ),
            "",
            "Hydra's own help: python run.py --hydra-help",
        ]
    )


def summary_line(entry: GridEntry, task: str, document: dict | None) -> str:
    """One line per finished configuration: score, sample count and where the time went."""
    if document is None:
        return f"{task} {entry.describe()}: already complete, skipped"
    summary, timings = document["summary"], document["timings"]
    skipped = f", {summary['num_skipped']} skipped" if summary["num_skipped"] else ""
    if summary["score_percent"] is None:
        return f"{task} {entry.describe()}: no sample could run ({summary['num_skipped']} skipped)"
    decode_rate = timings.get("decode_tokens", 0) / timings["decode_s"] if timings.get("decode_s") else 0.0
    return (
        f"{task} {entry.describe()}: score {summary['score_percent']:.2f}% over "
        f"{plural(summary['num_samples'], 'sample')}{skipped} "
        f"(compress {timings.get('compress_s', 0):.1f} s, decode {timings.get('decode_s', 0):.1f} s, "
        f"{decode_rate:.1f} tok/s)"
    )


# The quality measures the end table shows (reskv.quality): mean over a configuration's samples.
QUALITY_COLUMNS = (("LL gap", "answer_log_prob_gap", 2), ("KL", "kl", 3), ("attn err", "attention_error", 3))


def paired_text(plan: Plan, entry: GridEntry, results: dict, tasks: list[str]) -> str:
    """A +ResKV entry against its baseline (same setting and ratio) on the samples both scored, as the
    verdict reads it (``scripts.report.verdict.pair_gain``): the difference of the task-average score,
    its 95% interval, the test's p-value, the samples per task and the direction it settles; "" for
    other entries or without shared samples."""
    import pandas as pd

    from scripts.harness.store import ResultKey, scored
    from scripts.report.verdict import pair_gain

    label = MethodLabel.parse(entry.label)
    if not label.residual:
        return ""

    def scores(method: str) -> dict[str, pd.Series]:
        found = {}
        for task in tasks:
            key = ResultKey(
                plan.backbone, plan.benchmark, plan.length, task, entry.setting, method, entry.ratio
            )
            if key in results:
                samples = scored(list(results[key].samples.values()))
                found[task] = pd.Series({sample["index"]: sample["score"] for sample in samples}, dtype=float)
        return found

    gain = pair_gain(scores(label.base), scores(entry.label))
    if gain is None:
        return ""
    found = gain.estimate
    covered = "" if gain.tasks == len(tasks) else f", {gain.tasks} of {len(tasks)} tasks"
    tested = f", p {found.test.text}" if found.test.differing else ""
    shown = f"{found.value:+.2f} {found.interval_text('+')}"
    return f"{shown} (n={found.samples_text}{covered}{tested}) {gain.direction}"


def result_table(plan: Plan, available_tasks: set[str]):
    """Scores of this plan's configurations as found on disk (resumed and earlier shards included);
    ``n/a`` for a task whose data is unavailable here, ``skipped`` where no sample could run (the
    result file says why), ``–`` for a configuration not run yet. With the quality measures on,
    their means over the configuration's samples (all tasks) follow: a tie in score still shows
    which cache stays closer to the full one. Each +ResKV entry shows its paired difference to its
    baseline (``paired_text``)."""
    from rich.table import Table

    from scripts.harness.store import load_results, scored

    results = {result.key: result for result in load_results(plan.runs_dir)[0]}
    title = f"{plan.backbone} · {plan.benchmark}-{plan.length} (score %, samples)"
    if plan.quality:
        title += "\nLL gap, KL, attn err: distance to the full cache (reskv.quality; 0 = identical)"
    paired = any(MethodLabel.parse(entry.label).residual for entry in plan.grid)
    if paired:
        title += (
            "\n+ResKV - base: task-average score difference to the baseline (points), 95% paired "
            "interval, n shared samples per task, p of the sign-flip test over samples; replicated: "
            "p <= 0.05 above 0, reversed: below, unresolved: p > 0.05 (or too few samples differ for any "
            "test); no information: every sample tied (make tables: the verdict, with the size against "
            "the paper's)"
        )
    table = Table(title=title)
    table.add_column("configuration")
    for task in plan.tasks:
        table.add_column(task, justify="right")
    for head, _, _ in QUALITY_COLUMNS if plan.quality else ():
        table.add_column(head, justify="right")
    if paired:
        table.add_column("+ResKV - base", justify="right")
    averaged = [task for task in plan.tasks if task in available_tasks]
    for entry in plan.grid:
        row = [entry.describe()]
        measured = []
        for task in plan.tasks:
            result = results.get(entry.key(plan, task))
            samples = scored(list(result.samples.values())) if result else []
            measured += [sample["quality"] for sample in samples if "quality" in sample]
            scores = [sample["score"] for sample in samples]
            if task not in available_tasks:
                row.append("n/a")
            elif scores:
                row.append(f"{benchmarks.task_score(plan.benchmark, scores):.2f} ({len(scores)})")
            elif result and result.samples:
                row.append(f"skipped ({len(result.samples)})")
            else:
                row.append("–")
        for _, name, digits in QUALITY_COLUMNS if plan.quality else ():
            values = [quality[name] for quality in measured if name in quality]
            row.append(f"{sum(values) / len(values):.{digits}f}" if values else "–")
        if paired:
            row.append(paired_text(plan, entry, results, averaged))
        table.add_row(*row)
    return table


def run(plan: Plan, threads: int | None, job_number: int | None = None) -> None:
    """Load the backbone and the items, run the grid with a progress bar, print the scores.

    Launcher job ``job_number`` (None outside a sweep) runs on a GPU of its own where several are
    visible, held by a lock until it ends (``scripts.harness.devices``); it lets go of its model and
    compiled graphs then, so that a worker the launcher reuses starts bare."""
    from scripts.harness.devices import job_on_device

    with job_on_device(plan.device, job_number is not None, plan.jobs_per_gpu, threads) as device:
        run_grid(plan, device)


def run_grid(plan: Plan, device: str) -> None:
    """``run``'s work on ``device``."""
    from rich.console import Console
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from reskv.backbones import load_backbone
    from scripts.harness.grid import GridRun, load_task_items

    started = time.perf_counter()
    backbone = load_backbone(plan.backbone, plan.dtype, device)
    items = load_task_items(plan, backbone.tokenizer)
    grid = GridRun(plan, backbone, items)
    with logging_redirect_tqdm():
        total = grid.open()
        log.info(
            "%s on %s, %s-%d: %s x %s, %s to do (shard %d/%d)",
            plan.backbone,
            backbone.device,
            plan.benchmark,
            plan.length,
            plural(len(items), "task"),
            plural(len(plan.grid), "configuration"),
            plural(total, "generation"),
            plan.shard_index,
            plan.shard_count,
        )
        with tqdm(total=total, desc="grid", unit="gen", dynamic_ncols=True) as progress:
            grid.on_sample = lambda: progress.update()
            grid.on_finished = lambda entry, task, document: log.info(summary_line(entry, task, document))
            grid.run()
    log.info("done in %.1f s; results in %s", time.perf_counter() - started, plan.runs_dir)
    Console().print(result_table(plan, set(items)))


def dry_run(
    plan: Plan, mode: bool | str, calibration: str | None, threads: int | None, job_number: int | None
) -> None:
    """Print the plan, what the result store holds of it and its device hours without loading the
    model (``scripts.harness.dry_run``); ``mode="calibrate"`` first measures this device's rates
    (``scripts.harness.dry_run.calibrate``) into the calibration file the estimate then reads."""
    from rich.console import Console

    from scripts.harness.dry_run.rates import CALIBRATION_DIR, EstimateError, calibration_path, read_rates
    from scripts.harness.dry_run.report import report

    path = calibration_path(calibration, plan.device)
    if mode == "calibrate":
        from scripts.harness.devices import job_on_device
        from scripts.harness.dry_run.calibrate import calibrate

        with job_on_device(plan.device, job_number is not None, plan.jobs_per_gpu, threads) as device:
            calibrate(plan, device, path)
    rates, problem = None, ""
    if path.exists():
        try:
            rates = read_rates(path, plan.backbone)
        except EstimateError as error:
            problem = str(error)
    else:
        committed = sorted(found.stem for found in CALIBRATION_DIR.glob("*.json"))
        problem = (
            f"no calibration file {path}; measure this device with dry_run=calibrate, or name one with "
            f"calibration=KIND (committed: {', '.join(committed)})"
        )
    unresolved = []
    if any(plan.runs_dir.glob("*/*/*/*/*/*.json")):  # results to judge: which claims more rounds resolve
        from scripts.report.verdict import rounds_needed

        unresolved = rounds_needed(plan.results_dir)
    # Wide enough for its tables when piped (rich takes 80 columns then).
    Console(width=None if sys.stdout.isatty() else 140).print(report(plan, rates, problem, unresolved))


def hydra_job_number() -> int | None:
    """This job's number in a sweep (``hydra.job.num``); None in a single run."""
    from hydra.core.hydra_config import HydraConfig

    return OmegaConf.select(HydraConfig.get(), "job.num", default=None)


def fail(error: Exception) -> None:
    print(f"run.py: error: {error}", file=sys.stderr)
    sys.exit(2)


def remove_log_dir(results_dir: Path) -> None:
    """Delete this invocation's log directory, and its parents left empty, up to ``results_dir``."""
    from hydra.core.hydra_config import HydraConfig

    directory = Path(HydraConfig.get().runtime.output_dir)
    shutil.rmtree(directory, ignore_errors=True)
    for parent in directory.parents:
        if parent == results_dir or not parent.is_relative_to(results_dir) or any(parent.iterdir()):
            break
        parent.rmdir()


def run_errors() -> tuple[type[Exception], ...]:
    """Errors of a run that are the user's to fix (message, exit 2), not the code's (traceback)."""
    from reskv.backbones import BackboneError
    from scripts.harness.store import ResultStoreError

    return BackboneError, ResultStoreError


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(config: DictConfig) -> None:
    try:
        check_dry_run(config.dry_run)
        plan = make_plan(OmegaConf.to_container(config, resolve=True))
        if config.dry_run:
            dry_run(plan, config.dry_run, config.calibration, config.threads, hydra_job_number())
            remove_log_dir(Path(config.results_dir))  # a plan leaves no trace
        else:
            run(plan, config.threads, hydra_job_number())
    except (PlanError, benchmarks.BenchmarkError) as error:
        remove_log_dir(Path(config.results_dir))
        fail(error)
    # Evaluated only when the clause above did not match: a configuration error never imports torch.
    except run_errors() as error:
        remove_log_dir(Path(config.results_dir))
        fail(error)


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(usage())
        sys.exit(0)
    try:
        check_group_overrides(sys.argv[1:])
        main()
    except PlanError as error:
        fail(error)
    except KeyboardInterrupt:  # result files are closed by then; their journals hold every sample
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
